"""What a part of the GPU reads (GPU only; torch with CUDA green contexts):
`python -m benchmarks.probe_sm_rates [--sms 16 32] [--configs default 16:1:3:11:c ...] [--fp8] [--out DIR]`.

On the whole GPU the attention benchmark's decodes are bound by HBM, so their tile loops differ by a few percent;
on a few SMs each loop is bound by what its programs keep in flight and compute there, which is what counts when the
decode shares the GPU with a prefill (benchmarks/NOTES.md, "The mixed step's SM-time"). For each k of --sms, on a
green context of k SMs (`torch.cuda.green_contexts`), it prints torch.sum's read rate over 1 GiB and, per decode
config, the mixed step's decode part (60 requests x 2048 keys, the benchmark's heads and block size) in us and GB/s
an SM, beside the same call on the whole GPU.

A config is `default` (the committed plan) or BLOCK_N:warps:stages:programs_per_SM:loop, the loop being p (Triton's
pipeline) or c (the table-chunk loop, one warp). A diagnostic, not a benchmark: prints a table
and writes JSON with --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from torch_dsv4_ops import platform
from torch_dsv4_ops.kernels import attention as kernels
from torch_dsv4_ops.ops import attention as ops

from . import bench_attention as bench

LOOPS = {"p": kernels.LOOP_PIPELINE, "c": kernels.LOOP_TABLE_CHUNKS}
READ_ELEMENTS = 256 * 2**20          # fp32: 1 GiB


def decode_tiles(config: str, geo: kernels.Geometry, target: platform.Target, block_h: int) -> dict | None:
    """The `_decode_tiles` dict of a config string, with the committed plan's BLOCK_H; None for `default`."""
    if config == "default":
        return None
    block_n, warps, stages, per_sm, loop = config.split(":")
    tiles = dict(BLOCK_H=block_h, BLOCK_N=int(block_n), num_warps=int(warps),
                 num_stages=int(stages), per_sm=int(per_sm), loop=LOOPS[loop])
    if loop == "c":
        tiles.update(chunk=kernels.table_chunk(geo.bs, int(block_n), target), at_most=True)
    return tiles


def _timed(fn, calls: int = 10, samples: int = 5) -> float:
    """Median µs per call of fn(i) over `samples` runs of `calls` back-to-back calls (CUDA events)."""
    fn(0)
    torch.cuda.synchronize()
    out = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(out)


def _on(stream: torch.cuda.Stream, fn):
    """fn(i) run on `stream`, ordered after and before the current stream's work."""
    main = torch.cuda.current_stream()

    def run(i: int) -> None:
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            fn(i)
        main.wait_stream(stream)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--configs", nargs="+", default=["default", "16:1:3:11:c", "64:2:2:4:p"])
    parser.add_argument("--fp8", action="store_true", help="fp8 e4m3 caches instead of bf16")
    parser.add_argument("--out", default=None, help="directory for sm_rates.json")
    args = parser.parse_args()
    from torch.cuda import green_contexts
    if not torch.cuda.is_available() or not green_contexts.SUPPORTED:
        print("probe_sm_rates needs a CUDA GPU and a torch built with green contexts")
        return 1
    import torch_dsv4_ops
    from torch_dsv4_ops.ops.attention import example_batch

    device = torch.device("cuda")
    spec = bench.Spec(60, 2048, args.fp8)
    sets = [example_batch(spec.query_lens(), spec.seq_lens(), hq=bench.HQ, hkv=bench.HKV, dim=bench.D, bs=bench.BS,
                          fp8=args.fp8, seed=1 + i, device=device) for i in range(2)]
    nbytes = spec.bytes_per_call()
    x = torch.empty(READ_ELEMENTS, device=device).normal_()

    def decode(i: int) -> None:
        torch_dsv4_ops.chunked_prefill_paged_decode(*sets[i % 2])

    committed = kernels._decode_tiles
    rows, contexts = [], []
    try:
        for k in args.sms:
            contexts.append(green_contexts.GreenContext.create(num_sms=k, device_id=device.index or 0))
            stream = contexts[-1].Stream()     # valid while its context lives: kept to the end
            us = _timed(_on(stream, lambda i: x.sum()))
            gbps = x.numel() * 4 / us / 1e3
            rows.append(dict(sms=k, config="torch.sum", us=us, gbps=gbps, gbps_per_sm=gbps / k))
            print(f"{k:4d} SMs  torch.sum 1 GiB           {gbps:7.0f} GB/s  {gbps / k:5.1f} GB/s an SM", flush=True)
            for config in args.configs:
                def tiles(geo, q_dtype, kv_fp8, target, config=config):
                    plan = committed(geo, q_dtype, kv_fp8, target)
                    return decode_tiles(config, geo, target, plan["BLOCK_H"]) or plan
                kernels._decode_tiles = tiles
                ops._CHUNKED_PLANS.clear()
                whole = _timed(decode)
                part = _timed(_on(stream, decode))
                rows.append(dict(sms=k, config=config, fp8=args.fp8, us=part, us_all_sms=whole,
                                 gbps_per_sm=nbytes / part / 1e3 / k))
                print(f"{k:4d} SMs  decode {config:18s} {part:7.1f} us   {nbytes / part / 1e3 / k:5.1f} GB/s an SM"
                      f"  (all SMs: {whole:.1f} us)", flush=True)
    finally:
        kernels._decode_tiles = committed
        ops._CHUNKED_PLANS.clear()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sm_rates.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, case=spec.name,
                           bytes=nbytes, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
