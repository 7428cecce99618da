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
import triton.testing

import torch_dsv4_ops
from torch_dsv4_ops.kernels import cache as kernels

from .harness import host_us_per_call


@triton.jit
def _one_ptr(p):
    tl.store(p, tl.load(p) + 1)


def _warps_sweep(dev) -> None:
    """fp8 (bf16 -> e4m3) kernel time per call vs num_warps: in a graph at T = 1 and 64 (hot key/value,
    rotating slots) and by do_bench at T = 65536. Each thread's divisions run one after another."""
    from torch_dsv4_ops import layout, platform

    target = platform.target_for(dev)
    heads, dim, bs = 8, 128, 16
    codec = kernels.make_codec(torch.bfloat16, torch.uint8, layout.E4M3FN, target)
    for tokens in (1, 64, 65536):
        nsets = 64 if tokens < 1024 else 4
        num_slots = layout.round_up(2 * tokens * nsets, bs)
        kc = torch.empty(num_slots // bs, bs, heads, dim, dtype=torch.uint8, device=dev)
        geo = kernels.nhd_geometry(kc)
        key = torch.randn(tokens, heads, dim, dtype=torch.bfloat16, device=dev)
        slots = [torch.randperm(num_slots, device=dev)[:tokens] for _ in range(nsets)]
        scale = torch.full((1,), 0.05, device=dev)
        meta = kernels.constexprs(heads, dim, dim, geo, geo, bs, codec, target)
        ints = kernels.runtime_args(num_slots, 1, 0, key.stride(), key.stride(), geo, geo)
        grid = (tokens, -(-heads // meta["BLOCK_H"]))
        for warps in (4, 8, 16):
            m = dict(meta, num_warps=warps)

            def call(i):
                kernels.flash_cache_write_kernel[grid](key, key, kc, kc, slots[i % nsets], scale, scale, *ints, **m)
            call(0)
            torch.cuda.synchronize()
            if tokens < 1024:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for i in range(100):
                        call(i)
                g.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    g.replay()
                end.record()
                end.synchronize()
                us = start.elapsed_time(end) * 1e3 / 1000
            else:
                us = 1e3 * triton.testing.do_bench(lambda: call(1), return_mode="median")
            print(f"fp8 T={tokens:<6} num_warps={warps:<3} {us:8.2f} us/call")


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
    _warps_sweep(dev)


if __name__ == "__main__":
    main()
