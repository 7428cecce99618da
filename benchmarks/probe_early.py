"""The work before the wait, on and off (GPU with PDL only): `python -m benchmarks.probe_early [--rounds N]`.

For each kernel that reads its inputs before `gdc_wait` (`torch_dsv4_ops/kernels/early.py`), times the benchmark's
own cases by graph replay with the kernel's EARLY flags as committed and with none (EARLY = 0 with the same warps;
the window gather also with the rows per program of targets without PDL), alternating N rounds in one process, each
checked against the CPU reference. A diagnostic, not a benchmark (`NOTES.md`, "Work before the wait").
"""
from __future__ import annotations

import argparse

import torch

from torch_dsv4_ops import platform
from torch_dsv4_ops.kernels import attention, early, k_cache, sparse_index
from torch_dsv4_ops.ops import attention as attention_ops
from torch_dsv4_ops.ops import k_cache as k_cache_ops
from torch_dsv4_ops.ops import sparse_index as sparse_index_ops

from . import bench_attention, bench_k_cache, bench_sparse_index
from .harness import time_graph


def _alternate(label: str, w, variants: dict, rounds: int) -> None:
    """Time workload w under each variant (a function that installs it), `rounds` times in turn."""
    for _ in range(rounds):
        for name, install in variants.items():
            restore = install()
            try:
                chk = w.check()
                us = [time_graph(w, 100) for _ in range(2)]
            finally:
                restore()
            print(f"{label:<28} {name:<9} " + " ".join(f"{u:7.3f}" for u in us) + f" us  {chk}", flush=True)


def _patch(module, name: str, value):
    """Install module.name = value and clear the ops' plans; returns the restoring function."""
    old = getattr(module, name)

    def clear():
        sparse_index_ops._PLANS.clear()
        k_cache_ops._GATHER_PLANS.clear()
        attention_ops._CHUNKED_PLANS.clear()
        attention_ops._CONTEXT_PLANS.clear()

    setattr(module, name, value)
    clear()

    def restore():
        setattr(module, name, old)
        clear()
    return restore


def _no_early(constexprs):
    return lambda *a, **k: dict(constexprs(*a, **k), EARLY=0)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probe_early", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    dev = torch.device("cuda")
    if not early.use_early(platform.target_for(dev)):
        raise SystemExit("needs a GPU with programmatic dependent launch (sm_90+)")
    print(torch.cuda.get_device_name(), flush=True)
    for op in ("combine", "flashinfer"):
        for T in (64, 256, 4096):
            w = bench_sparse_index.build(bench_sparse_index.Spec(op, T), dev)
            fn = f"{op}_constexprs"
            _alternate(f"{op} T={T}", w, {
                "none": lambda fn=fn: _patch(sparse_index, fn, _no_early(getattr(sparse_index, fn))),
                "committed": lambda: (lambda: None)}, args.rounds)
    for R, L in (bench_k_cache.GATHER_WINDOW, (4, 128)):
        w = bench_k_cache.build_gather(bench_k_cache.Spec("gather", R=R, L=L, window=True), dev)
        _alternate(f"window gather {R} x {L}", w, {
            "none": lambda: _patch(k_cache, "gather_early", lambda *a: 0),
            "committed": lambda: (lambda: None)}, args.rounds)
    for R, ctx in ((1, 32768), (1, 8192), (64, 4096)):      # the fp8-cache decode (`_decode_touch`)
        w = bench_attention.build(bench_attention.Spec(R, ctx, fp8=True), dev)
        _alternate(f"fp8 decode {R} x {ctx}", w, {
            "none": lambda: _patch(attention, "decode_constexprs", _no_early(attention.decode_constexprs)),
            "committed": lambda: (lambda: None)}, args.rounds)


if __name__ == "__main__":
    main()
