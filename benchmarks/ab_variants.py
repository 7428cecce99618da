"""A/B of kernel-module variants in one process (GPU): `python -m benchmarks.ab_variants FAMILY [--rounds N] VARIANT...`

FAMILY is `topk` (the top-k benchmark's four cases), `insert` (the indexer K insert cases), `k_cache` (the
fp8_ds_mla K-cache insert at T = 65536 and the whole-sequence gathers), `indexer_q` (the indexer q quantisation at
T = 65536), `sparse_index` (the index builders' three headline cases), `cache` (the flash-cache writes into
head-major caches at T = 65536, prefill runs and random slots, bf16 and fp8) or `sparse_mla` (the sparse MLA
benchmark's decode and prefill cases through the sm_90 Gluon kernels, `kernels/sparse_mla_gluon.py`).
Each VARIANT is `LABEL=PATH[:NAME=VALUE,...]`: the kernel module's source at PATH (e.g. the current
`torch_dsv4_ops/kernels/topk.py`, or an older version saved with `git show REV:torch_dsv4_ops/kernels/topk.py >
old.py`), loaded as its own module inside the package (so its relative imports resolve), with module constants
overridden (`REG_CAP=92` sets `{"cuda": 92}`). The op module's reference to the kernel module is pointed at each
variant in turn and its plan caches emptied, and every case is checked against the reference and timed by CUDA-graph
replay (`harness.time_graph`), the variants alternating in each of N rounds, so that machine drift shows as a
difference between rounds, not variants.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile

import torch
import triton.language as tl

from torch_dsv4_ops.ops import cache as cache_ops, indexer as indexer_ops, indexer_q as indexer_q_ops, \
    k_cache as k_cache_ops, sparse_index as sparse_index_ops, sparse_mla as sparse_mla_ops, topk as topk_ops
from torch_dsv4_ops.ops._plans import PlanCache

from . import (bench_cache, bench_indexer, bench_indexer_q, bench_k_cache, bench_sparse_index, bench_sparse_mla,
               bench_topk, harness)


def load_kernel_source(stem: str, source: str, directory: str):
    """`source` (a kernel module's text) as module torch_dsv4_ops.kernels.<stem>, written to directory/<stem>.py, so
    that its relative imports resolve."""
    name = f"torch_dsv4_ops.kernels.{stem}"
    path = pathlib.Path(directory) / f"{stem}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_variant(index: int, path: str, consts: dict, directory: str):
    """The module at `path` as torch_dsv4_ops.kernels._variant<index>, with `consts` set on it."""
    module = load_kernel_source(f"_variant{index}", pathlib.Path(path).read_text(), directory)
    for key, value in consts.items():
        old = getattr(module, key)
        if isinstance(old, dict):
            value = {"cuda": value}
        setattr(module, key, tl.constexpr(value) if isinstance(old, tl.constexpr) else value)
    return module


def parse(variant: str) -> tuple[str, str, dict]:
    label, _, rest = variant.partition("=")
    path, _, assigns = rest.partition(":")
    consts = {k: int(v) for k, v in (a.split("=") for a in assigns.split(",") if a)}
    return label, path, consts


def _topk_cases(device) -> list:
    specs = [bench_topk.Spec(op, *shape, ranges) for op, shape, ranges in (
        ("decode", bench_topk.DECODE, "full"), ("decode", bench_topk.DECODE, "random"),
        ("prefill", bench_topk.PREFILL, "causal"), ("prefill", bench_topk.PREFILL, "full"))]
    return [(s, bench_topk.build(s, device)) for s in specs]


def _insert_cases(device) -> list:
    specs = [bench_indexer.Spec("insert", T=t) for t in bench_indexer.INSERT_T]
    specs.append(bench_indexer.Spec("insert", T=bench_indexer.HEADLINE_T, pages=True))
    return [(s, bench_indexer.build_insert(s, device)) for s in specs]


def _cache_cases(device) -> list:
    specs = [bench_cache.Spec(bench_cache.HEADLINE_T, kv_cache_dtype=kv, layout="head_major", runs=runs)
             for runs in (True, False) for kv in ("auto", "fp8")]
    return [(s, bench_cache.build(s, device)) for s in specs]


def _k_cache_cases(device) -> list:
    k = bench_k_cache
    specs = [k.Spec("insert", T=k.HEADLINE_T)] + [k.Spec("gather", R=k.GATHER_WHOLE[0], L=k.GATHER_WHOLE[1],
                                                          use_fnuz=fnuz) for fnuz in (False, True)]
    return [(s, (k.build_insert if s.op == "insert" else k.build_gather)(s, device)) for s in specs]


def _indexer_q_cases(device) -> list:
    s = bench_indexer_q.Spec("q", T=bench_indexer_q.HEADLINE_T)
    return [(s, bench_indexer_q.build_q(s, device))]


def _sparse_index_cases(device) -> list:
    return [(s, bench_sparse_index.build(s, device)) for s in bench_sparse_index.headline_specs()]


def _sparse_mla_cases(device) -> list:
    specs = [bench_sparse_mla.Spec(kind, batch) for kind, batch in (("c4a", 256), ("swa", 256), ("c4a", 64),
                                                                       ("c4a", 8))]
    specs.append(bench_sparse_mla.Spec("prefill", bench_sparse_mla.PREFILL_TOKENS))
    return [(s, bench_sparse_mla.build(s, device)) for s in specs]


# family: (op module, its attribute that holds the kernel module swapped, its plan caches' names, the cases)
FAMILIES = {"topk": (topk_ops, "kernels", ("_PLANS",), _topk_cases),
            "insert": (indexer_ops, "kernels", ("_INSERT_PLANS",), _insert_cases),
            "cache": (cache_ops, "kernels", ("_FLASH_PLANS", "_DIFFKV_PLANS"), _cache_cases),
            "indexer_q": (indexer_q_ops, "kernels", ("_Q_PLANS",), _indexer_q_cases),
            "sparse_index": (sparse_index_ops, "kernels", ("_PLANS",), _sparse_index_cases),
            "k_cache": (k_cache_ops, "kernels", ("_INSERT_PLANS", "_GATHER_PLANS"), _k_cache_cases),
            "sparse_mla": (sparse_mla_ops, "sparse_mla_gluon", ("_DECODE_PLANS", "_PREFILL_PLANS"), _sparse_mla_cases)}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab_variants", description=__doc__.splitlines()[0])
    p.add_argument("family", choices=sorted(FAMILIES))
    p.add_argument("variants", nargs="+", help="LABEL=PATH[:NAME=VALUE,...]")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("ab_variants: needs a CUDA GPU")
        return 1
    ops, attribute, plans, build = FAMILIES[args.family]
    original = getattr(ops, attribute)
    with tempfile.TemporaryDirectory() as d:
        variants = [(label, load_variant(i, path, consts, d))
                    for i, (label, path, consts) in enumerate(map(parse, args.variants))]
        workloads = build(torch.device("cuda"))
        width = max(len(label) for label, _ in variants)
        try:
            for r in range(args.rounds):
                for label, module in variants:
                    setattr(ops, attribute, module)
                    for name in plans:
                        setattr(ops, name, PlanCache())
                    cells = []
                    for spec, w in workloads:
                        check = w.check()
                        cells.append(f"{spec.name} {harness.time_graph(w, 20):8.2f} us {check}")
                    print(f"r{r} {label:{width}s} " + " | ".join(cells), flush=True)
        finally:
            setattr(ops, attribute, original)
            for name in plans:
                setattr(ops, name, PlanCache())
    return 0


if __name__ == "__main__":
    sys.exit(main())
