"""Test-session setup. Without a GPU, Triton kernels run under Triton's interpreter, which must be
switched on before triton is imported; on a GPU machine they run compiled.

The interpreter's numeric traps (CONVENTIONS.md) are avoided by the kernels rather than patched:
values are widened to fp32 right after loading (no bf16 arithmetic); every fp8 conversion and every
fp32 -> bf16 rounding goes through kernels/fp8.py, whose software codec the interpreter always uses
(`platform.native_fp8` is False there; tests/test_fp8_codec.py holds it bit-exact to torch over all
codes and every finite bf16 value); masks are built from tensors only; no autotune, no
make_block_ptr; test grids stay at a few dozen programs. numpy comes with the package's install.
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before conftest could set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # triton 3.9 warns when unset

import pytest  # noqa: E402

import torch_dsv4_ops  # noqa: E402,F401  (registers the ops)
from torch_dsv4_ops.testing import shard_members  # noqa: E402

GPU = torch.cuda.is_available()
DEVICES = ["cuda"] if GPU else ["cpu"]
MATRIX_TESTS = "test_compile_matrix.py"


def _is_matrix_test(item) -> bool:
    return item.path.name == MATRIX_TESTS


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip_gpu)
    # the compile-matrix tests last: they wait for the matrix started in the background at collection
    items.sort(key=_is_matrix_test)
    # DSV4_TEST_SHARD=k/n keeps shard k of n (`testing.shard_members`): scripts/gpu_suite.sh runs the attention
    # tests as parallel shards (their Triton compiles dominate, and each process compiles on its own core)
    shard = os.environ.get("DSV4_TEST_SHARD")
    if shard:
        k, n = (int(v) for v in shard.split("/"))
        members = shard_members([item.nodeid for item in items], k, n)
        items[:] = [item for item, member in zip(items, members) if member]


ROOT = pathlib.Path(__file__).resolve().parents[1]


class MatrixRun:
    """The compile matrix CLI (`python -m torch_dsv4_ops.compile_matrix --scope ci --json`) in a subprocess
    without TRITON_INTERPRET. It starts as soon as collection finds a compile-matrix test, so its compiles
    overlap the interpreter tests instead of following them (CI has 2 cores), and the compile-matrix tests run
    last (`pytest_collection_modifyitems`)."""

    def __init__(self):
        self.dir = tempfile.TemporaryDirectory(prefix="dsv4_matrix_")
        self.json = pathlib.Path(self.dir.name) / "matrix.json"
        self.log = open(pathlib.Path(self.dir.name) / "matrix.log", "w+")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "torch_dsv4_ops.compile_matrix", "--quiet", "--scope",
                                      "ci", "--json", str(self.json)], cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True)

    def result(self, timeout: float = 1500) -> dict:
        """The CLI's JSON plus its exit status (`returncode`) and output (`stdout`); fails the test if it crashed."""
        returncode = self.proc.wait(timeout=timeout)
        self.log.seek(0)
        output = self.log.read()
        if not self.json.exists():
            pytest.fail(f"the compile matrix crashed (exit {returncode}):\n{output[-6000:]}")
        data = json.loads(self.json.read_text())
        data["returncode"], data["stdout"] = returncode, output
        return data

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        self.dir.cleanup()


def pytest_collection_finish(session):
    if any(_is_matrix_test(item) for item in session.items):
        session.config.dsv4_matrix = MatrixRun()


def pytest_unconfigure(config):
    run = getattr(config, "dsv4_matrix", None)
    if run is not None:
        run.close()


@pytest.fixture(scope="session")
def matrix_run(request) -> MatrixRun:
    """The compile-matrix subprocess started at collection (or now, if collection did not start it)."""
    config = request.config
    if getattr(config, "dsv4_matrix", None) is None:
        config.dsv4_matrix = MatrixRun()
    return config.dsv4_matrix


@pytest.fixture(params=DEVICES)
def device(request):
    """The device the op under test runs on: the GPU if present, else CPU (the Triton kernel
    under the interpreter)."""
    return torch.device(request.param)
