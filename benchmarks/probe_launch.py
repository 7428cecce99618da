"""Where the eager host time of one launch goes (GPU only): `python -m benchmarks.probe_launch`.

Prints Triton's launch hooks, the host microseconds per call of each piece of a launch (from a
trivial kernel to the public op), and a profile of the public op. A diagnostic, not a benchmark.
"""
from __future__ import annotations

import cProfile
import pstats

import torch
import triton
import triton.language as tl

import torch_dsv4_ops
from torch_dsv4_ops.kernels import cache as kernels

from .harness import host_us_per_call


@triton.jit
def _one_ptr(p):
    tl.store(p, tl.load(p) + 1)


def main() -> None:
    from triton import knobs

    dev = torch.device("cuda")
    print("launch_enter_hook:", knobs.runtime.launch_enter_hook, "exit:", knobs.runtime.launch_exit_hook)
    x = torch.zeros(16, device=dev)
    xi = torch.zeros(1, dtype=torch.int32, device=dev)
    compiled = _one_ptr[(1,)](xi)
    stream = torch._C._cuda_getCurrentRawStream(0)
    addr = xi.data_ptr()
    key = torch.randn(1, 8, 128, dtype=torch.bfloat16, device=dev)
    kc = torch.zeros(64, 16, 8, 128, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    slot = torch.tensor([5], device=dev)
    one = torch.ones(1, device=dev)
    args = (key, key, kc, vc, slot, "auto", one, one)
    pieces = {
        "x.add_(1)": lambda: x.add_(1),
        "torch._C._cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "torch.cuda.current_device()": torch.cuda.current_device,
        "tensor.data_ptr()": xi.data_ptr,
        "trivial kernel[grid](tensor)": lambda: _one_ptr[(1,)](xi),
        "trivial compiled.run(int address)": lambda: compiled.run(1, 1, 1, stream, compiled.function,
                                                                   compiled.packed_metadata, None, None, None, addr),
        "trivial compiled.run(tensor)": lambda: compiled.run(1, 1, 1, stream, compiled.function,
                                                              compiled.packed_metadata, None, None, None, xi),
        "OPS kernel impl (no dispatcher)": lambda: torch_dsv4_ops.OPS["reshape_and_cache_flash"].kernel(*args),
        "public reshape_and_cache_flash": lambda: torch_dsv4_ops.reshape_and_cache_flash(*args),
    }
    for name, fn in pieces.items():
        try:
            print(f"{name:<40} {host_us_per_call(fn, dev, 2000, 3):8.2f} us")
        except Exception as e:   # report and go on
            print(f"{name:<40} ERROR {type(e).__name__}: {e}")
    print("launcher direct specialisations:", kernels.LAUNCHER.cache_size(), "direct:", kernels.LAUNCHER.direct)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        torch_dsv4_ops.reshape_and_cache_flash(*args)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
