"""The sparse MLA decode's sm_90 Gluon kernel against the Triton kernel (H100, Triton 3.6):
`python -m benchmarks.probe_gluon_sparse_mla_decode`.

On the benchmark's decode cases (64 heads; C4A: SWA 128 + top-k 512 from an extra cache; SWA-only) and a few batch
sizes it times, by do_bench over the benchmark's input sets: the op's plan, the op with the Gluon path switched
off (the Triton kernel and its split plan), and both forced to one split (the op then runs the Gluon kernel where
its rule plans it: lists of at least `MIN_DECODE_STEPS` steps, so not SWA-only), and checks that each agrees with
the Triton kernel's default. How the kernel came to be: benchmarks/NOTES.md,
"Sparse MLA decode in Gluon".
"""
from __future__ import annotations

import contextlib
import itertools
import sys

from torch_dsv4_ops.kernels import sparse_mla_gluon as gluon_kernels
from torch_dsv4_ops.ops import sparse_mla as ops

from . import bench_sparse_mla as bench, harness

CASES = (("c4a", 64), ("c4a", 128), ("c4a", 256), ("swa", 256))


@contextlib.contextmanager
def _path(gluon: bool, splits: int | None):
    """The op with the Gluon path allowed or not and `splits` forced (None: its own), planned afresh."""
    ops._DECODE_PLANS.clear()
    try:
        with harness.plan_rule_off(gluon_kernels, "decode_planned", off=not gluon), \
                ops.forced_splits(splits) if splits else contextlib.nullcontext():
            yield
    finally:
        ops._DECODE_PLANS.clear()


def main(argv=None) -> int:
    dev = harness.nvidia_device("probe_gluon_sparse_mla_decode")
    if dev is None:
        return 1
    for kind, batch in CASES:
        run, out, lse = bench.decode_runner(kind, batch, dev)
        results = {}
        for label, gluon, splits in (("op plan", True, None), ("triton", False, None), ("triton unsplit", False, 1),
                                     ("op unsplit", True, 1)):
            with _path(gluon, splits):
                run(0)
                results[label] = (out.clone(), lse.clone())
                it = itertools.count()
                us = harness.time_do_bench(lambda: run(next(it) % 2))
            ref_out, ref_lse = results.get("triton", results[label])
            d_out = (results[label][0].float() - ref_out.float()).abs().max().item()
            d_lse = (results[label][1] - ref_lse).abs().max().item()
            print(f"{kind} B={batch:3d} {label:15s} {us:8.2f} us   against the Triton kernel: out {d_out:.3g}, "
                  f"lse {d_lse:.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
