"""Tile and warp sweep of the k_cache, sparse_index, head-major cache-write and indexer insert kernels on a GPU,
one command:

    python -m benchmarks.sweep_tiles --out DIR [--only k_cache|sparse_index|cache|indexer] [--focus]

For each variant (module-level tile settings of `kernels/k_cache.py`, `kernels/sparse_index.py`,
`kernels/cache.py` or `kernels/indexer.py`, set for the variant and restored after), the plan caches are
emptied and the family's benchmark cases of interest are timed with the benchmark harness (same build,
timing method and reference check as `benchmarks.run`). Writes DIR/sweep_tiles.json and prints one line per (variant, case). The chosen
settings are the modules' defaults; this records why.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from torch_dsv4_ops.kernels import cache as kc
from torch_dsv4_ops.kernels import indexer as ki
from torch_dsv4_ops.kernels import k_cache as kk
from torch_dsv4_ops.kernels import sparse_index as ks
from torch_dsv4_ops.ops import cache as oc
from torch_dsv4_ops.ops import indexer as oi
from torch_dsv4_ops.ops import k_cache as ok
from torch_dsv4_ops.ops import sparse_index as osi

from . import bench_cache as bc
from . import bench_indexer as bi
from . import bench_k_cache as bk
from . import bench_sparse_index as bs
from . import harness


def _k_cache_plan():
    insert = [bk._case(bk.Spec("insert", T=t), series=False) for t in (65536, 64)]
    gather = [bk._case(bk.Spec("gather", R=16, L=8192), series=False),
              bk._case(bk.Spec("gather", R=16, L=128, window=True), series=False)]
    plans = []
    for tokens, warps in ((1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (4, 4), (8, 4), (8, 8)):
        plans.append(({"INSERT_TILES": ((0, tokens),), "INSERT_MAX_WARPS": warps}, insert))
    for block_t, warps in ((1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (8, 2), (8, 4), (8, 8), (16, 4)):
        plans.append(({"BLOCK_T": block_t, "BLOCK_T_NARROW": block_t, "GATHER_MAX_WARPS": warps}, gather))
    return kk, (ok._INSERT_PLANS, ok._GATHER_PLANS), plans


def _sparse_plan():
    big = [bs._case(s) for s in bs.headline_specs()]
    small = [bs._case(bs.Spec(op, t)) for op in bs.OPS for t in (64, 256)]
    # each kernel's widest tile in these cases (columns), so PER_THREAD = tile / (32 * warps)
    tiles = {"global": 512, "combine": 512, "flashinfer": 512, "c128a": 1024, "fill": 512}
    plans = [({}, big + small)]          # the defaults: PER_THREAD's warps below ONE_WARP_ROWS rows, then one
    for per_sm in (8, 16):               # programs of the row-looping kernels (32, the default: a program per row)
        plans.append(({"ROW_PROGRAMS_PER_SM": per_sm}, big))
    for warps in (1, 2, 4, 8):           # the same warps at every row count
        per_thread = {k: max(1, tile // (32 * warps)) for k, tile in tiles.items()}
        plans.append(({"PER_THREAD": per_thread, "ONE_WARP_ROWS": {}}, big + small))
    return ks, (osi._PLANS,), plans


def _cache_plan():
    """Warps of the head-major group kernel, on the prefill pattern (runs of 16 slots), bf16 and fp8."""
    runs = [bc._case(bc.Spec(bc.HEADLINE_T, kv_cache_dtype=kv, layout="head_major", runs=True), series=False)
            for kv in ("auto", "fp8")]
    return kc, (oc._FLASH_PLANS,), [({"GROUP_WARPS_BY_X": {16: w, 8: w}}, runs) for w in (2, 1, 4, 8)]


def _indexer_plan():
    """Rows per group and warps of the indexer K insert, random slots and whole pages."""
    insert = [bi._case(bi.Spec("insert", T=bi.HEADLINE_T, pages=q)) for q in (False, True)]
    return ki, (oi._INSERT_PLANS,), [({"INSERT_TOKENS": t, "INSERT_MAX_WARPS": w}, insert)
                                     for t, w in ((8, 4), (8, 2), (16, 2), (16, 4), (32, 4), (64, 4), (64, 8), (4, 1))]


def _k_cache_focus():
    """The insert's tokens and warps around the default, and the window gather's narrow step."""
    insert = [bk._case(bk.Spec("insert", T=65536), series=False),
              bk._case(bk.Spec("insert", T=65536, sequential=True), series=False)]
    window = [bk._case(bk.Spec("gather", R=16, L=128, window=True), series=False)]
    plans = [({"INSERT_TILES": ((0, t),), "INSERT_MAX_WARPS": w}, insert)
             for t, w in ((2, 2), (2, 1), (4, 1), (4, 2), (1, 1))]
    plans += [({"BLOCK_T_NARROW": b, "GATHER_MAX_WARPS": w}, window) for b, w in ((2, 4), (1, 1), (1, 2), (2, 2))]
    return kk, (ok._INSERT_PLANS, ok._GATHER_PLANS), plans


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--only", choices=("k_cache", "sparse_index", "cache", "indexer"))
    p.add_argument("--focus", action="store_true", help="the few variants around the current defaults")
    args = p.parse_args()
    device = torch.device("cuda")
    ceiling = harness.copy_ceiling(device)
    print("copy ceiling", ceiling, flush=True)
    rows = []
    families = {"k_cache": _k_cache_plan, "sparse_index": _sparse_plan, "cache": _cache_plan, "indexer": _indexer_plan}
    if args.focus:
        families = {"k_cache": _k_cache_focus}
    for fam, make in families.items():
        if args.only and args.only != fam:
            continue
        module, caches, plans = make()
        for settings, cases in plans:
            saved = {k: getattr(module, k) for k in settings}
            for k, v in settings.items():
                setattr(module, k, v)
            for c in caches:
                c.clear()
            try:
                for case in cases:
                    rec = harness.run_case(case, device, ceiling["gbps"])
                    rec["settings"] = settings
                    rows.append(rec)
                    extra = "".join(f" {k.split('_')[0]} {rec[k].get('pct_of_copy')} %" for k in
                                    ("graph_crosscheck", "do_bench_crosscheck") if k in rec)
                    print(f"{fam:12s} {json.dumps(settings):70s} {case.name:28s} {rec.get('us', 'ERR')!s:>9} us "
                          f"{rec.get('pct_of_copy', '')!s:>7} %{extra} {rec.get('check', rec.get('error', ''))}",
                          flush=True)
            finally:
                for k, v in saved.items():
                    setattr(module, k, v)
                for c in caches:
                    c.clear()
        with open(os.path.join(args.out, "sweep_tiles.json"), "w") as f:
            json.dump({"ceiling": ceiling, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
