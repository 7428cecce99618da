# torch_dsv4_ops: `make demo` runs the self-check, `make test` the whole CPU suite.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
TRITON_VERSION ?= 3.9.0
OUT ?= out

.PHONY: install demo test test-fast gpu-test bench compile-matrix stubs clean

# Installs torch (CPU build on machines without a GPU) only when it is missing, then the package
# with its test extras. On the GPU machine (no network) use `pip install --no-deps -e .` instead.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	@$(PYTHON) -c "import triton" 2>/dev/null || $(PIP) install -q triton==$(TRITON_VERSION)
	$(PIP) install -q -e ".[test]"

demo: install
	$(PYTHON) -m torch_dsv4_ops

# The whole CPU suite: references, Triton kernels under the interpreter, schemas, compile matrix.
test: install
	$(PYTHON) -m pytest -q -p no:cacheprovider

test-fast:
	$(PYTHON) -m pytest -q -x -p no:cacheprovider

# On an H100/H200 (writes logs and benchmark JSON/PNG under $(OUT)).
gpu-test:
	OUT=$(OUT) bash scripts/gpu_suite.sh

bench:
	$(PYTHON) -m benchmarks.run --out $(OUT)/bench

compile-matrix:
	env -u TRITON_INTERPRET $(PYTHON) -m torch_dsv4_ops.compile_matrix

stubs:
	$(PYTHON) -m torch_dsv4_ops.stubs

clean:
	rm -rf build dist *.egg-info .pytest_cache $(OUT)
