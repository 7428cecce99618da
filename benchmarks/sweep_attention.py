"""Tile sweep of the attention kernels on a GPU: `python -m benchmarks.sweep_attention [--decode-only |
--prefill-only] [--chunks] [--bf16-only]`.

Times the benchmark's decode and mixed-step cases (benchmarks/bench_attention.py) under each tile
setting of `kernels/attention.py` (patched in place of `decode_tiles` / `prefill_tiles`) and prints
one line per (setting, case): median µs by do_bench and GB/s. The committed defaults come from it.
The decode tiles are timed in Triton's pipeline (LOOP_PIPELINE); --chunks sweeps the table-chunk loop instead
(LOOP_TABLE_CHUNKS, one warp, the grid within per_sm programs an SM, the mixed step too); --bf16-only
leaves out the fp8-cache cases; SWEEP_PREFILL="256x64x8x3,128x64x4x2x0,..." picks the prefill tiles (BLOCK_M x
BLOCK_N x warps x stages [x tile_ids]) to time instead of all 24.
"""
from __future__ import annotations

import itertools
import os
import sys

import torch

from torch_dsv4_ops.kernels import attention as kernels, early
from torch_dsv4_ops.ops import attention as ops

from . import bench_attention as bench
from . import harness


# (BLOCK_N, warps, stages, programs per SM the split count aims at) of the decode kernel
DECODE_CONFIGS = ((128, 4, 2, 2), (128, 4, 3, 2), (64, 2, 2, 4), (64, 2, 3, 4), (64, 4, 2, 4), (32, 1, 2, 4),
                  (32, 1, 3, 8), (32, 1, 4, 8), (32, 2, 2, 8), (32, 2, 3, 8))
# --chunks: (BLOCK_N, stages, per_sm, k_groups, early touch, combine parts) of the table-chunk loop on one warp,
# against the defaults (None), timed again last
CHUNK_CONFIGS = (None, (16, 2, 8, True, False, 4), (16, 3, 8, True, False, 4), (16, 4, 8, True, False, 4),
                 (16, 2, 8, True, False, 1), (16, 2, 8, False, False, 4), (16, 2, 11, True, False, 4),
                 (16, 2, 8, True, True, 4), (32, 2, 8, True, False, 4), None)


def _time(args) -> float:
    import torch_dsv4_ops
    return harness.time_do_bench(lambda: torch_dsv4_ops.chunked_prefill_paged_decode(*args))


def _reset():
    ops._CHUNKED_PLANS.clear()
    ops._CONTEXT_PLANS.clear()


def main() -> int:
    device = torch.device("cuda")
    from torch_dsv4_ops.ops.attention import example_batch

    decode_specs = [bench.Spec(64, 4096), bench.Spec(64, 4096, True), bench.Spec(1, 32768)]
    mixed = bench.Spec(**bench.MIXED)
    prefill_only = bench.Spec(0, 0, prefills=4, new=512, cached=2048)
    batches = {s.name: (s, example_batch(s.query_lens(), s.seq_lens(), hq=bench.HQ, hkv=bench.HKV, dim=bench.D,
                                         bs=bench.BS, fp8=s.fp8, seed=1, device=device))
               for s in decode_specs + [mixed, prefill_only]}
    original_prefill = kernels.prefill_tiles

    all_decode = [bench.Spec(r, c, fp8) for fp8 in (False, True) for r, c in bench.DECODE
                  if not (fp8 and "--bf16-only" in sys.argv)]
    for s in all_decode:
        if s.name not in batches:
            batches[s.name] = (s, example_batch(s.query_lens(), s.seq_lens(), hq=bench.HQ, hkv=bench.HKV,
                                                dim=bench.D, bs=bench.BS, fp8=s.fp8, seed=1, device=device))
    original_decode = kernels.decode_tiles
    chunks = "--chunks" in sys.argv
    for config in () if "--prefill-only" in sys.argv else CHUNK_CONFIGS if chunks else DECODE_CONFIGS:
        if config is None:
            kernels.decode_tiles, label = original_decode, "default"
        elif chunks:
            kernels.decode_tiles = _chunk_tiles(original_decode, *config)
            label = "chunks BLOCK_N={} stages={} per_sm={} k_groups={} touch={} parts={}".format(*config)
        else:
            kernels.decode_tiles = _pipeline_tiles(original_decode, *config)
            label = "BLOCK_N={} warps={} stages={} per_sm={}".format(*config)
        _time_decodes(all_decode + [mixed] if chunks else all_decode, batches, label)
    kernels.decode_tiles = original_decode
    _reset()
    if "--decode-only" in sys.argv:
        return 0
    for concurrent in (False, True):
        ops.CONCURRENT.enabled = concurrent
        us = _time(batches[mixed.name][1])
        print(f"mixed step, prefill and decode on two streams={concurrent}: {us:.1f} us", flush=True)
    ops.CONCURRENT.enabled = True

    for block_m, block_n, warps, stages, tile_ids in _prefill_configs():
        def tiles(geo, q_dtype, target, block_m=block_m, block_n=block_n, warps=warps, stages=stages,
                  tile_ids=tile_ids):
            heads = min(triton_next_pow2(geo.group), block_m)
            return dict(HEADS=heads, BLOCK_Q=block_m // heads, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                        tile_ids=bool(tile_ids))
        kernels.prefill_tiles = tiles
        _reset()
        label = f"prefill BLOCK_M={block_m} BLOCK_N={block_n} warps={warps} stages={stages} tile_ids={tile_ids}"
        for s in (prefill_only, mixed):
            try:
                us = _time(batches[s.name][1])
                print(f"{label} | {s.name}: {us:.1f} us {s.flops() / us / 1e6:.0f} TFLOP/s", flush=True)
            except Exception as e:
                print(f"{label} | {s.name}: ERROR {e!s:.100}", flush=True)
    kernels.prefill_tiles = original_prefill
    return 0


def _pipeline_tiles(original_decode, block_n, warps, stages, per_sm):
    """`decode_tiles` with Triton's pipeline loop and these tiles, for every cache."""
    def tiles(geo, q_dtype, kv_fp8, target):
        t = original_decode(geo, q_dtype, kv_fp8, target)
        return dict(t, BLOCK_N=block_n, num_warps=warps, num_stages=stages, per_sm=per_sm, at_most=False,
                    loop=kernels.LOOP_PIPELINE, early=0)
    return tiles


def _chunk_tiles(original_decode, block_n, stages, per_sm, k_groups, touch, parts):
    """`decode_tiles` with the table-chunk loop on one warp, for float caches too."""
    def tiles(geo, q_dtype, kv_fp8, target):
        t = original_decode(geo, q_dtype, kv_fp8, target)
        return dict(t, BLOCK_N=block_n, num_warps=1, num_stages=stages, per_sm=per_sm, at_most=True,
                    loop=kernels.LOOP_TABLE_CHUNKS, chunk=kernels.table_chunk(geo.bs, block_n, target),
                    k_groups=k_groups, combine_parts=parts,
                    early=early.flags(touch=touch, late=touch) if early.use_early(target) else 0)
    return tiles


def _time_decodes(specs, batches, label):
    _reset()
    for s in specs:
        try:
            us = _time(batches[s.name][1])
            print(f"decode {label} | {s.name}: {us:.1f} us {s.bytes_per_call() / us / 1e3:.0f} GB/s", flush=True)
        except Exception as e:   # e.g. out of shared memory
            print(f"decode {label} | {s.name}: ERROR {e!s:.100}", flush=True)


def _prefill_configs():
    """(BLOCK_M, BLOCK_N, warps, stages, tile_ids) of the prefill sweep: SWEEP_PREFILL="256x64x8x3,128x64x4x2x0"
    (a fifth field 0: per-key block-id lookups; 1, the default: one table load per block), or 24 settings."""
    env = os.environ.get("SWEEP_PREFILL")
    if env:
        return [(tuple(int(x) for x in c.split("x")) + (1,))[:5] for c in env.split(",")]
    return list(itertools.product((128, 256), (32, 64, 128), (4, 8), (2, 3), (1,)))


def triton_next_pow2(n: int) -> int:
    import triton
    return triton.next_power_of_2(n)


if __name__ == "__main__":
    sys.exit(main())
