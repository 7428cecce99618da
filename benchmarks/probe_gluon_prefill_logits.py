"""The prefill indexer logits' sm_90 Gluon kernel against the Triton kernel, per setting (H100, Triton 3.6):
`python -m benchmarks.probe_gluon_prefill_logits [--settings GQ,WARPS,MAXNREG ...]`.

On the benchmark's case (M = 4096 queries x N = 8192 keys, 64 heads, D 128, full and causal ranges) it runs the
op with the Gluon path switched off (the Triton kernel) and `kernels/mqa_logits_gluon.py`'s prefill kernel at each
setting (queries per program, warps, register cap; 0 = no cap; the first default is the op's plan), checks that
each agrees with the Triton kernel, and times all by do_bench beside the fp8 matmul rate. How the kernel came to
be: benchmarks/NOTES.md, "Prefill indexer logits in Gluon".
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton

from torch_dsv4_ops import layout, platform
from torch_dsv4_ops.kernels import mqa_logits_gluon as gluon_kernels
from torch_dsv4_ops.kernels._launch import PointerAs
from torch_dsv4_ops.ops import mqa_logits as ops

from . import bench_mqa_logits as bench, harness

DEFAULT_SETTINGS = [f"{gluon_kernels.PREFILL_QUERIES},{gluon_kernels.PREFILL_WARPS},{gluon_kernels.PREFILL_MAXNREG}",
                    "4,4,0", "4,4,160", "2,4,168", "2,4,128", "4,8,0", "2,8,0", "1,4,0"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS)
    args = p.parse_args(argv)
    dev = harness.nvidia_device("probe_gluon_prefill_logits")
    if dev is None:
        return 1
    if not gluon_kernels.prefill_planned(platform.target_for(dev), bench.HEADS, bench.DIM, bench.DIM, layout.E4M3FN,
                                         layout.E4M3FN):
        print("probe_gluon_prefill_logits: the Gluon path is not planned here (needs sm_90 and Triton "
              + " or ".join(gluon_kernels.VERIFIED_TRITON) + ")")
        return 1
    torch.manual_seed(0)
    m, n = bench.PREFILL_MN
    q = bench._codes((m, bench.HEADS, bench.DIM), dev)
    k = bench._codes((n, bench.DIM), dev)
    scale = torch.exp2(torch.randint(-8, 0, (n,), device=dev).float())
    w = torch.randn(m, bench.HEADS, device=dev) / 8
    i = torch.arange(m, device=dev, dtype=torch.int32)
    out_triton = torch.empty(m, n, device=dev)
    out = torch.empty_like(out_triton)
    rate = bench.fp8_matmul_ceiling(dev)["tflops"]
    print(f"fp8 matmul rate {rate} TFLOP/s (torch._scaled_mm {bench.FP8_MATMUL_N}^2 e4m3)")
    for ranges in ("full", "causal"):
        ks, ke = (torch.zeros_like(i), torch.full_like(i, n)) if ranges == "full" else (torch.zeros_like(i),
                                                                                         n - m + i + 1)
        flops = bench.Spec("prefill", ranges, m=m, n=n).flops()
        with harness.plan_rule_off(gluon_kernels, "prefill_planned"):      # the op's plan of its Triton kernel
            triton_launch = ops._prefill_plan(q, k, scale, w, ks, ke, True, out_triton, False)

        def run_triton():
            triton_launch(q, k, scale, w, ks, ke, out_triton)

        def report(label, fn):
            us = harness.time_do_bench(fn)
            tflops = flops / us / 1e6
            print(f"{ranges:6s} {label:14s} {us:8.1f} us  {tflops:6.1f} TFLOP/s  {100 * tflops / rate:.1f} % of fp8 "
                  "matmul", flush=True)

        run_triton()
        report("triton", run_triton)
        finite = out_triton.isfinite()
        row_max = out_triton.where(finite, 0.0).abs().amax(1, keepdim=True)
        for setting in args.settings:
            gq, warps, regs = (int(x) for x in setting.split(","))
            meta = dict(GQ=gq, CLEAN=True, num_warps=warps, **({"maxnreg": regs} if regs else {}))

            def run_gluon(meta=meta, gq=gq):
                gluon_kernels.mqa_logits_gluon_kernel[(triton.cdiv(m, gq),)](
                    q.view(torch.uint8), PointerAs(k, torch.int32), scale, w, ks, ke, out, m, n, q.stride(0),
                    q.stride(1), k.stride(0) // 4, scale.stride(0), w.stride(0), w.stride(1), ks.stride(0),
                    ke.stride(0), out.stride(0), **meta)

            out.fill_(7.0)
            run_gluon()
            err = ((out - out_triton).abs() / row_max).where(finite, 0.0).max().item()
            same_inf = bool((finite == out.isfinite()).all())
            print(f"{ranges:6s} gluon {setting}: largest difference from the Triton kernel {err:.2g} of the row's max "
                  f"|logit|; -inf where its: {same_inf}")
            report(f"gluon {setting}", run_gluon)
    return 0


if __name__ == "__main__":
    sys.exit(main())
