"""The paged indexer logits' sm_90 Gluon path against the Triton kernel, per split size (H100, Triton 3.6):
`python -m benchmarks.probe_gluon_paged_logits [--tiles-per-split N ...]`.

On the benchmark's case (B = 64 requests, next_n = 2, 64 heads, 16384 entries each, 64-key pages written by the
insert op) it runs `kernels/mqa_logits_gluon.py`'s kernel at each split size given (32: the op's plan on 132
SMs, one wave of 4 programs per SM) and the op with the Gluon path switched off (the Triton kernel), checks the
two agree, and times both by do_bench beside the read ceiling. How the kernel came to be, and the variants that
lost: benchmarks/NOTES.md, "Paged indexer logits in Gluon".
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton

from torch_dsv4_ops import layout, platform
from torch_dsv4_ops.kernels import mqa_logits_gluon as gluon_kernels
from torch_dsv4_ops.kernels._launch import PointerAs
from torch_dsv4_ops.ops import mqa_logits as ops

from . import bench_mqa_logits as bench, harness


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiles-per-split", type=int, nargs="+", default=[32, 64, 16])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    dev = harness.nvidia_device("probe_gluon_paged_logits")
    if dev is None:
        return 1
    target = platform.target_for(dev)
    torch.manual_seed(0)
    s = bench.Spec("paged", batch=bench.PAGED["B"], next_n=bench.PAGED["next_n"], length=bench.PAGED["L"])
    cache, tables, qs, ws, lens = bench.paged_inputs(s, dev, nsets=4)
    if not gluon_kernels.planned(target, bench.HEADS, s.next_n, bench.BS, qs[0], ws[0], layout.E4M3FN,
                                 layout.E4M3FN):
        print("probe_gluon_paged_logits: the Gluon path is not planned here (needs sm_90 and Triton "
              + " or ".join(gluon_kernels.VERIFIED_TRITON) + ")")
        return 1
    width = s.length // bench.BS
    nb = cache.shape[0]
    out_op = torch.empty(s.batch * s.next_n, s.length, device=dev)
    out = torch.empty_like(out_op)
    with harness.plan_rule_off(gluon_kernels, "planned"):          # the op's plan of its Triton kernel
        triton_launch = ops._paged_plan(qs[0], cache, ws[0], lens, tables[0], s.length, True, out_op, False)

    def run_triton(j: int) -> None:
        triton_launch(qs[j], cache, ws[j], lens, tables[j], out_op)

    def run_gluon(j: int, per: int) -> None:
        gluon_kernels.paged_mqa_logits_gluon_kernel[(s.batch, triton.cdiv(width, per))](
            qs[j].view(torch.uint8), PointerAs(cache, torch.int32), ws[j], lens, tables[j], out, s.length, nb,
            cache.stride(0) // 4, width, lens.stride(0), lens.stride(1), tables[j].stride(0), tables[j].stride(1),
            out.stride(0), per, NEXT_N=s.next_n, LENS_2D=True, CLEAN=True, num_warps=4,
            maxnreg=gluon_kernels.MAXNREG)

    run_triton(0)
    for per in args.tiles_per_split:
        out.fill_(7.0)
        run_gluon(0, per)
        finite = out_op.isfinite()
        row_max = out_op.where(finite, 0.0).abs().amax(1, keepdim=True)
        err = ((out - out_op).abs() / row_max).where(finite, 0.0).max().item()
        same_inf = bool((finite == out.isfinite()).all())
        print(f"{per} tiles per split: largest difference from the Triton kernel {err:.2g} of the row's max "
              f"|logit|; -inf where its: {same_inf}")
    read_gbps = harness.read_matmul_ceilings(dev)["read_ceiling"]["gbps"]
    print(f"read ceiling {read_gbps:.1f} GB/s (torch.sum over {harness.READ_BYTES >> 30} GiB)")
    for r in range(args.rounds):
        cases = [("triton", run_triton)] + [(f"gluon/{per}", lambda j, per=per: run_gluon(j, per))
                                            for per in args.tiles_per_split]
        for label, fn in cases:
            it = itertools.count()
            us = harness.time_do_bench(lambda: fn(next(it) % len(qs)))
            gbps = s.bytes_per_call() / us / 1e3
            print(f"r{r} {label:10s} {us:8.2f} us  {gbps:7.1f} GB/s  {100 * gbps / read_gbps:.1f} % of read",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
