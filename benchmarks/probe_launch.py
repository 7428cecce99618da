"""Where the eager host time of one launch goes (GPU only): `python -m benchmarks.probe_launch [--tiles]`.

Prints Triton's launch hooks, the host microseconds per call of each piece of a launch (from a
trivial kernel to the public op), and a profile of the public op; with --tiles also the tile sweep
of the cache kernel. A diagnostic, not a benchmark.
"""
from __future__ import annotations

import cProfile
import pstats
import sys

import torch
import triton
import triton.language as tl
import triton.testing

import torch_dsv4_ops
from torch_dsv4_ops.kernels import cache as kernels

from .harness import graph_us_per_call, host_us_per_call


@triton.jit
def _one_ptr(p):
    tl.store(p, tl.load(p) + 1)


def _tile_sweep(dev) -> None:
    """Kernel time per call vs tile (heads per program, warps), bf16 -> bf16 and bf16 -> e4m3:
    in a graph at small T (hot: one key/value set, cold: a fresh set per call; rotating slots)
    and by do_bench at T = 65536."""
    from torch_dsv4_ops import layout, platform

    target = platform.target_for(dev)
    heads, dim, bs = 8, 128, 16
    for kv, cache_dtype, fmt in (("auto", torch.bfloat16, None), ("fp8", torch.uint8, layout.E4M3FN)):
        codec = kernels.make_codec(torch.bfloat16, cache_dtype, fmt, target)
        for tokens in (1, 16, 64, 65536):
            for hot in ((True, False) if tokens < 1024 else (True,)):
                nsets = (64 if hot else 512) if tokens < 1024 else 4
                num_slots = layout.round_up(2 * tokens * nsets, bs)
                kc = torch.empty(num_slots // bs, bs, heads, dim, dtype=cache_dtype, device=dev)
                geo = kernels.nhd_geometry(kc)
                keys = [torch.randn(tokens, heads, dim, dtype=torch.bfloat16, device=dev)
                        for _ in range(1 if hot else nsets)]
                slots = [torch.randperm(num_slots, device=dev)[:tokens] for _ in range(nsets)]
                scale = torch.full((1,), 0.05, device=dev)
                base = kernels.constexprs(heads, dim, dim, geo, geo, bs, codec, target)
                ints = kernels.runtime_args(num_slots, 1, 0, keys[0].stride(), keys[0].stride(), geo, geo)
                for block_h, warps in ((8, 4), (8, 8), (4, 4), (2, 4), (2, 2), (1, 2), (1, 1)):
                    m = dict(base, BLOCK_H=block_h, num_warps=warps)
                    grid = (tokens, heads // block_h)

                    def call(i):
                        k = keys[i % len(keys)]
                        kernels.flash_cache_write_kernel[grid](k, k, kc, kc, slots[i % nsets], scale, scale, *ints, **m)
                    if tokens < 1024:
                        us = graph_us_per_call(call)
                    else:
                        call(0)
                        us = 1e3 * triton.testing.do_bench(lambda: call(1), return_mode="median")
                    print(f"{kv:<4} T={tokens:<6} {'hot ' if hot else 'cold'} BLOCK_H={block_h} warps={warps:<2} "
                          f"{us:8.2f} us/call")


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
    if "--tiles" in sys.argv:
        _tile_sweep(dev)


if __name__ == "__main__":
    main()
