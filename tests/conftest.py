"""Test-session setup. Without a GPU, Triton kernels run under Triton's interpreter, which must be
switched on before triton is imported; on a GPU machine they run compiled.

The interpreter's numeric traps (CONVENTIONS.md) are avoided by the kernels rather than patched:
values are widened to fp32 right after loading (no bf16 arithmetic); every fp8 conversion and every
fp32 -> bf16 rounding goes through kernels/fp8.py, whose software codec the interpreter always uses
(`platform.native_fp8` is False there; tests/test_fp8_codec.py holds it bit-exact to torch over all
codes and every finite bf16 value); masks are built from tensors only; no autotune, no
make_block_ptr; test grids stay at a few dozen programs. numpy comes with the package's install.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before conftest could set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # triton 3.9 warns when unset

import pytest  # noqa: E402

import torch_dsv4_ops  # noqa: E402,F401  (registers the ops)

GPU = torch.cuda.is_available()
DEVICES = ["cuda"] if GPU else ["cpu"]


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip_gpu)
    # DSV4_TEST_SHARD=k/n keeps every n-th test from the k-th: scripts/gpu_suite.sh runs the attention
    # tests as parallel shards (their Triton compiles dominate, and each process compiles on its own core)
    shard = os.environ.get("DSV4_TEST_SHARD")
    if shard:
        k, n = (int(v) for v in shard.split("/"))
        items[:] = [item for i, item in enumerate(items) if i % n == k]


@pytest.fixture(params=DEVICES)
def device(request):
    """The device the op under test runs on: the GPU if present, else CPU (the Triton kernel
    under the interpreter)."""
    return torch.device(request.param)
