# torch_dsv4_ops: `make demo` runs the self-check, `make test` the whole CPU suite. `make help` lists the targets.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
TRITON_VERSION ?= 3.9.0
# Where the CPU build of torch comes from when no local CPU wheel (find-links / extra index) has it.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
OUT ?= out
# Written after a successful install; `make test` skips pip while it is newer than setup.py.
STAMP := .install.stamp

.PHONY: help install demo test test-fast gpu-test bench compile-matrix stubs clean

# The first target is the default goal: `make` alone installs.
install: $(STAMP) ## install torch (CPU build) and triton if missing, then the package with its test extras (once)

# torch: only when it cannot be imported, and then the CPU build: "torch==X+cpu" resolves where a
# local CPU wheel is on a find-links dir or extra index, and fails fast on plain PyPI (whose torch
# is the CUDA build, gigabytes of nvidia packages); then PyTorch's CPU index. On the GPU machine
# (no network) install with `pip install --no-deps --no-build-isolation -e .` instead.
$(STAMP): setup.py
	@$(PYTHON) -c "import torch" 2>/dev/null || { \
	  echo "installing torch $(TORCH_VERSION) (CPU build)"; \
	  $(PIP) install -q "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || { \
	    echo "no local torch $(TORCH_VERSION)+cpu wheel; trying $(TORCH_CPU_INDEX)"; \
	    $(PIP) install -q --index-url $(TORCH_CPU_INDEX) "torch==$(TORCH_VERSION)"; }; }
	@$(PYTHON) -c "import triton" 2>/dev/null || { \
	  echo "installing triton $(TRITON_VERSION)"; $(PIP) install -q "triton==$(TRITON_VERSION)"; }
	$(PIP) install -q -e ".[test]"
	@touch $@

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-15s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "  variables: PYTHON=$(PYTHON) OUT=$(OUT) TORCH_VERSION=$(TORCH_VERSION) TRITON_VERSION=$(TRITON_VERSION)"

demo: install ## install, then self-check every op on the best device present (python -m torch_dsv4_ops)
	$(PYTHON) -m torch_dsv4_ops

# References, Triton kernels under the interpreter (conftest sets TRITON_INTERPRET=1 without a GPU),
# schemas, opcheck, torch.compile and the AOT compile matrix. Two pytest processes side by side, to keep
# CI's 2 cores busy: the compile-matrix tests (whose conftest starts the matrix compiles at once, in their own
# worker processes) and every other test spread over TEST_WORKERS pytest-xdist workers. The matrix tests'
# output follows the others'.
TEST_WORKERS ?= 2
MATRIX_LOG := .matrix-tests.log
test: install ## install, then run the whole CPU suite (what CI runs)
	@$(PYTHON) -m pytest -q -p no:cacheprovider tests/test_compile_matrix.py > $(MATRIX_LOG) 2>&1 & matrix=$$!; \
	$(PYTHON) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --ignore=tests/test_compile_matrix.py; rest=$$?; \
	wait $$matrix; mrc=$$?; echo "==== compile-matrix tests ===="; cat $(MATRIX_LOG); rm -f $(MATRIX_LOG); \
	test $$rest -eq 0 -a $$mrc -eq 0

test-fast: ## run the suite as is, stopping at the first failure (no install step)
	$(PYTHON) -m pytest -q -x -p no:cacheprovider

# On an H100/H200 (writes logs and benchmark JSON/PNG under $(OUT)). Refuses to start without a GPU.
gpu-test: ## on an H100/H200: GPU suite, memcheck, self-check and benchmarks, results under OUT=dir
	@$(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || { \
	  echo "make gpu-test: no GPU (torch.cuda.is_available() is False, or torch is missing); run it on an H100/H200, or use 'make test' here" >&2; \
	  exit 1; }
	OUT=$(OUT) bash scripts/gpu_suite.sh

bench: install ## install the bench extra (matplotlib), then the benchmarks: JSON + PNG under OUT/bench
	@$(PYTHON) -c "import matplotlib" 2>/dev/null || { \
	  echo "installing the bench extra (matplotlib)"; $(PIP) install -q -e ".[test,bench]"; }
	$(PYTHON) -m benchmarks.run --out $(OUT)/bench

compile-matrix: ## compile every kernel specialisation for every GPU target, no GPU needed
	env -u TRITON_INTERPRET $(PYTHON) -m torch_dsv4_ops.compile_matrix

stubs: ## regenerate csrc_stubs/ (C++ declarations of every dsv4:: schema)
	$(PYTHON) -m torch_dsv4_ops.stubs

clean: ## remove build outputs, OUT and the install stamp (the next make test reinstalls)
	rm -rf build dist *.egg-info .pytest_cache $(OUT) $(STAMP)
