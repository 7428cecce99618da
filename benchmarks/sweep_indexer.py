"""Tile sweeps of the indexer kernels on a GPU (benchmarks/NOTES.md, "The rest of the indexer"):

    python -m benchmarks.sweep_indexer [paged] [prefill] [q] [topk]

Each sweep patches the kernel module's tile constants (and the product path of the logits: fp8 MMA or decoded
bf16 / fp16), empties the op's plan cache so the next call plans again, and times the family benchmark's workload:
paged logits B 64 x next_n 2 x 16384 entries and prefill logits 4096 x 8192 (do_bench), Q RoPE + quantisation
T 65536 (do_bench), top-k decode 128 x 16384 (CUDA-graph replay) and prefill 4096 x 8192 causal (do_bench).
Prints one line per configuration and a JSON line at the end. Needs a CUDA GPU.
"""
from __future__ import annotations

import itertools
import json
import os
import sys

import torch

from torch_dsv4_ops.kernels import indexer_q as q_kernels, mqa_logits as logits_kernels, topk as topk_kernels
from torch_dsv4_ops.ops import indexer_q as q_ops, mqa_logits as logits_ops, topk as topk_ops

from . import bench_indexer_q, bench_mqa_logits, bench_topk, harness

F16 = lambda target, q_fmt, k_fmt, decoded=None: logits_kernels.DOT_F16     # noqa: E731  (force the fp16 path)
BF16 = lambda target, q_fmt, k_fmt, decoded=None: logits_kernels.DOT_BF16   # noqa: E731  (force the bf16 path)


def _time(w: harness.Workload) -> float:
    w.run(0)
    torch.cuda.synchronize()
    return harness.time_rotating(w)


def _try(label: str, fn):
    try:
        return fn()
    except Exception as e:   # a configuration that does not compile or fit is a result
        print(label, "ERR", str(e)[:200], flush=True)
        return None


def _paged_configs() -> list:
    """(mode, BLOCK_N, warps, stages, programs per SM, register cap or 0) of the paged sweep:
    `SWEEP_PAGED="f16,64,4,2,4[,168];..."`, or
    the product below (the fp16 path only: Hopper's fp8 MMA is too short an accumulator for SPEC's tolerance)."""
    spec = os.environ.get("SWEEP_PAGED")
    if spec:
        fields = [c.split(",") for c in spec.split(";")]
        return [(f[0], *map(int, f[1:5]), int(f[5]) if len(f) > 5 else 0) for f in fields]
    return list(itertools.product(("f16",), (64, 128), (4, 8), (1, 2, 3), (2, 3, 4, 6, 8), (0,)))


def sweep_paged(dev) -> list:
    read = harness.read_matmul_ceilings(dev)["read_ceiling"]["gbps"]
    spec = bench_mqa_logits.Spec("paged", batch=64, next_n=2, length=16384)
    w = bench_mqa_logits.build_paged(spec, dev)
    saved = (dict(logits_kernels.PAGED_TILE), logits_kernels.PAGED_PROGRAMS_PER_SM, logits_kernels.dot_mode)
    out = []
    for mode, bn, warps, stages, pps, maxnreg in _paged_configs():
        logits_kernels.dot_mode = {"f16": F16, "bf16": BF16}.get(mode, saved[2])
        logits_kernels.PAGED_TILE.update(BLOCK_N=bn, num_warps=warps, num_stages=stages, maxnreg=maxnreg)
        logits_kernels.PAGED_PROGRAMS_PER_SM = pps
        logits_ops._PAGED_PLANS.clear()
        us = _try(f"paged {mode} {bn} {warps} {stages} {pps} {maxnreg}", lambda: _time(w))
        if us is not None:
            r = dict(mode=mode, bn=bn, warps=warps, stages=stages, pps=pps, maxnreg=maxnreg, us=us,
                     pct_read=100 * spec.bytes_per_call() / us / 1e3 / read)
            print("paged", r, flush=True)
            out.append(r)
    logits_kernels.PAGED_TILE.clear()
    logits_kernels.PAGED_TILE.update(saved[0])
    logits_kernels.PAGED_PROGRAMS_PER_SM, logits_kernels.dot_mode = saved[1], saved[2]
    logits_ops._PAGED_PLANS.clear()
    return out


def sweep_prefill(dev) -> list:
    spec = bench_mqa_logits.Spec("prefill", "full", 4096, 8192)
    w = bench_mqa_logits.build_prefill(spec, dev)
    saved = (dict(logits_kernels.PREFILL_TILE), logits_kernels.dot_mode)
    out = []
    for mode, bn, qh, warps, stages in itertools.product(("fp8", "bf16", "f16"), (64, 128), (128, 256), (4, 8),
                                                         (2, 3)):
        logits_kernels.dot_mode = {"f16": F16, "bf16": BF16}.get(mode, saved[1])
        logits_kernels.PREFILL_TILE.update(BLOCK_N=bn, QH=qh, num_warps=warps, num_stages=stages)
        logits_ops._PREFILL_PLANS.clear()
        us = _try(f"prefill {mode} {bn} {qh} {warps} {stages}", lambda: _time(w))
        if us is not None:
            r = dict(mode=mode, bn=bn, qh=qh, warps=warps, stages=stages, us=us, tflops=spec.flops() / us / 1e6)
            print("prefill", r, flush=True)
            out.append(r)
    logits_kernels.PREFILL_TILE.update(saved[0])
    logits_kernels.dot_mode = saved[1]
    logits_ops._PREFILL_PLANS.clear()
    return out


def sweep_q(dev) -> list:
    copy = harness.copy_ceiling(dev)["gbps"]
    spec = bench_indexer_q.Spec("q", T=65536)
    w = bench_indexer_q.build_q(spec, dev)
    saved = (q_kernels.Q_ROWS, q_kernels.Q_MAX_WARPS)
    out = []
    for rows, warps in itertools.product((8, 16, 32, 64, 128), (1, 2, 4, 8)):
        q_kernels.Q_ROWS, q_kernels.Q_MAX_WARPS = rows, warps
        q_ops._Q_PLANS.clear()
        us = _try(f"q {rows} {warps}", lambda: _time(w))
        if us is not None:
            r = dict(rows=rows, max_warps=warps, us=us, pct_copy=100 * spec.bytes_per_call() / us / 1e3 / copy)
            print("q", r, flush=True)
            out.append(r)
    q_kernels.Q_ROWS, q_kernels.Q_MAX_WARPS = saved
    q_ops._Q_PLANS.clear()
    return out


def _topk_configs() -> list:
    """(keys per lane, warp cap) pairs: SWEEP_TOPK="64,8;32,16" or every pair of the grid."""
    env = os.environ.get("SWEEP_TOPK")
    if env:
        return [tuple(int(x) for x in item.split(",")) for item in env.split(";") if item]
    return list(itertools.product((8, 16, 32, 64), (4, 8, 16, 32)))


def sweep_topk(dev) -> list:
    """Keys per lane x the warp cap of the in-register path (the rows fit one tile)."""
    saved = (topk_kernels.PER_THREAD, topk_kernels.MAX_WARPS["cuda"])
    out = []
    for spec in (bench_topk.Spec("decode", 128, 16384, "full"), bench_topk.Spec("prefill", 4096, 8192, "causal")):
        w = bench_topk.build(spec, dev)
        for per_thread, warps in _topk_configs():
            topk_kernels.PER_THREAD, topk_kernels.MAX_WARPS["cuda"] = per_thread, warps
            topk_ops._PLANS.clear()
            if spec.op == "decode":
                us = _try("topk", lambda: harness.graph_us_per_call(lambda i: w.run(i % w.nsets), n_calls=20))
            else:
                us = _try("topk", lambda: _time(w))
            if us is not None:
                r = dict(op=spec.op, per_thread=per_thread, max_warps=warps, us=us)
                print("topk", r, flush=True)
                out.append(r)
    topk_kernels.PER_THREAD, topk_kernels.MAX_WARPS["cuda"] = saved
    topk_ops._PLANS.clear()
    return out


SWEEPS = {"paged": sweep_paged, "prefill": sweep_prefill, "q": sweep_q, "topk": sweep_topk}


def main(argv=None) -> int:
    names = list(sys.argv[1:] if argv is None else argv) or list(SWEEPS)
    unknown = [n for n in names if n not in SWEEPS]
    if unknown:
        raise SystemExit(f"unknown sweeps {unknown}; known: {list(SWEEPS)}")
    if not torch.cuda.is_available():
        raise SystemExit("the sweeps need a CUDA GPU")
    dev = torch.device("cuda")
    print("JSON", json.dumps({n: SWEEPS[n](dev) for n in names}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
