"""Host cost of the sm_90 Gluon paths' launches, and where the sparse MLA decode's Gluon kernel beats the Triton
kernel (H100, Triton 3.6): `python -m benchmarks.probe_gluon_launch`.

1. Eager calls of the sparse MLA decode on the benchmark's cases and of the paged indexer logits, with the Gluon
   kernels launched by their `FastLauncher` (direct: Triton's JIT only on a signature's first call) and by Triton's
   public path (every call through the JIT): the host's time per call (100 calls queued, wall clock until the last
   returns, before any synchronisation) and do_bench's GPU time (which flushes L2 between calls and so hides the
   host's time behind the flush).
2. CUDA-graph replay (no host cost) of the decode at several batch sizes: the Triton kernel's own plan, the Gluon
   kernel forced unsplit, and the op's plan (the Gluon kernel split as the Triton kernel would be, its programs
   persistent: at most one an SM), at 64 heads and at 128 (a program a block of 64 heads), C4A and SWA-only.
Each line also gives the largest difference from the Triton kernel's result. NOTES.md: "Gluon launches".
"""
from __future__ import annotations

import contextlib
import itertools
import sys
import time

import torch

from torch_dsv4_ops.kernels import mqa_logits_gluon, sparse_mla_gluon
from torch_dsv4_ops.ops import mqa_logits as logits_ops, sparse_mla as ops

from . import bench_mqa_logits, bench_sparse_mla as bench, harness

EAGER_CASES = (("c4a", 64), ("c4a", 128), ("c4a", 256), ("swa", 256))
GRAPH_CASES = (("c4a", 8, 64), ("c4a", 16, 64), ("c4a", 32, 64), ("c4a", 48, 64), ("c4a", 64, 64), ("c4a", 128, 64),
               ("c4a", 256, 64), ("c4a", 16, 128), ("c4a", 64, 128), ("c4a", 128, 128), ("swa", 8, 64),
               ("swa", 64, 64), ("swa", 256, 64), ("swa", 512, 64))


@contextlib.contextmanager
def _public(launchers, plan_caches, on: bool):
    """Inside (when `on`), the launchers take Triton's public path on every call; the plans are made afresh."""
    kept = [f._policy for f in launchers]
    for cache in plan_caches:
        cache.clear()
    if on:
        for f in launchers:
            f._policy = (False, None)
    try:
        yield
    finally:
        for f, p in zip(launchers, kept):
            f._policy = p
        for cache in plan_caches:
            cache.clear()


def _host_us(run, calls: int = 100) -> float:
    """Host µs per eager call: `calls` calls queued back to back, timed until the last returns."""
    run(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        run(i)
    host = (time.perf_counter() - start) * 1e6 / calls
    torch.cuda.synchronize()
    return host


def _triton_result(run, out):
    with harness.plan_rule_off(sparse_mla_gluon, "decode_planned"), _public([], [ops._DECODE_PLANS], False):
        run(0)
        return out.float().clone()


def main(argv=None) -> int:
    dev = harness.nvidia_device("probe_gluon_launch")
    if dev is None:
        return 1
    mla = [sparse_mla_gluon.DECODE_LAUNCHER, sparse_mla_gluon.PREFILL_LAUNCHER]
    for kind, batch in EAGER_CASES:
        run, out, _ = bench.decode_runner(kind, batch, dev)
        ref = _triton_result(run, out)
        for label, public in (("direct", False), ("public", True)):
            with _public(mla, [ops._DECODE_PLANS], public):
                run(0)
                diff = (out.float() - ref).abs().max().item()
                host = _host_us(run)
                it = itertools.count()
                us = harness.time_do_bench(lambda: run(next(it)))
            print(f"eager  decode {kind} B={batch:3d} op plan, Gluon launches {label}: host {host:7.2f} us a call, "
                  f"GPU {us:8.2f} us  (out vs Triton {diff:.3g})", flush=True)

    s = bench_mqa_logits.Spec("paged", batch=bench_mqa_logits.PAGED["B"], next_n=bench_mqa_logits.PAGED["next_n"],
                              length=bench_mqa_logits.PAGED["L"])
    cache, tables, qs, ws, lens = bench_mqa_logits.paged_inputs(s, dev, nsets=2)
    logits = torch.empty(s.batch * s.next_n, s.length, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sched = logits_ops.get_paged_mqa_logits_metadata(lens, bench_mqa_logits.BS, sms)

    def paged(i: int) -> None:
        logits_ops.fp8_fp4_paged_mqa_logits((qs[i % 2], None), cache, ws[i % 2], lens, tables[i % 2], sched,
                                            s.length, True, out=logits)

    for label, public in (("direct", False), ("public", True)):
        with _public([mqa_logits_gluon.PAGED_LAUNCHER], [logits_ops._PAGED_PLANS], public):
            paged(0)
            host = _host_us(paged)
            it = itertools.count()
            us = harness.time_do_bench(lambda: paged(next(it)))
        print(f"eager  paged logits B={s.batch} next_n={s.next_n}, Gluon launch {label}: host {host:7.2f} us a call, "
              f"GPU {us:8.2f} us", flush=True)

    for kind, batch, hq in GRAPH_CASES:
        run, out, _ = bench.decode_runner(kind, batch, dev, hq=hq)
        ref = _triton_result(run, out)
        for label, gluon, splits in (("Triton plan", False, None), ("Gluon unsplit", True, 1), ("op plan", True, None)):
            with harness.plan_rule_off(sparse_mla_gluon, "decode_planned", off=not gluon), \
                    _public([], [ops._DECODE_PLANS], False), \
                    (ops.forced_splits(splits) if splits else contextlib.nullcontext()):
                run(0)
                diff = (out.float() - ref).abs().max().item()
                us = harness.graph_us_per_call(run, n_calls=20)
            print(f"graph  decode {kind} B={batch:3d} H={hq:3d} {label:13s}: {us:8.2f} us  (out vs Triton {diff:.3g})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
