"""The sparse MLA prefill's sm_90 Gluon kernel against the Triton kernel (H100, Triton 3.6):
`python -m benchmarks.probe_gluon_sparse_mla_prefill [--rounds N]`.

On the benchmark's case (4096 tokens, 64 heads, 640 selected rows each from a 16384-row bf16 workspace, a sink) it
runs the op's plan (the Gluon kernel) and the op with the Gluon path switched off (the Triton kernel), checks that
the two agree, and times both by do_bench beside the bf16 matmul rate. How the kernel came to be:
benchmarks/NOTES.md, "Sparse MLA prefill in Gluon".
"""
from __future__ import annotations

import argparse
import sys

import torch

from torch_dsv4_ops import layout, platform
from torch_dsv4_ops.kernels import sparse_mla_gluon as gluon_kernels
from torch_dsv4_ops.ops import sparse_mla as ops

from . import bench_sparse_mla as bench, harness


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    dev = harness.nvidia_device("probe_gluon_sparse_mla_prefill")
    if dev is None:
        return 1
    tokens, rows, width, heads = bench.PREFILL_TOKENS, bench.PREFILL_WORKSPACE, bench.PREFILL_ROWS, 64
    g = torch.Generator(device=dev).manual_seed(4)
    kv = torch.randn(rows, 1, layout.HEAD_DIM, generator=g, device=dev).to(torch.bfloat16)
    q = torch.randn(tokens, heads, layout.HEAD_DIM, generator=g, device=dev).to(torch.bfloat16)
    idx = torch.rand(tokens, rows, generator=g, device=dev).argsort(1)[:, None, :width].int().contiguous()
    sink = torch.randn(heads, generator=g, device=dev)
    if not gluon_kernels.prefill_planned(platform.target_for(dev), heads, q.stride(), kv.stride(0)):
        print("probe_gluon_sparse_mla_prefill: the Gluon path is not planned here (needs sm_90 and Triton "
              + " or ".join(gluon_kernels.VERIFIED_TRITON) + ")")
        return 1
    outs = {}
    for path in ("gluon", "triton"):
        o, m, lse = torch.empty_like(q), torch.empty(tokens, heads, device=dev), torch.empty(tokens, heads, device=dev)
        with harness.plan_rule_off(gluon_kernels, "prefill_planned", off=path == "triton"):
            launch = ops._prefill_plan(q, kv, idx, layout.MLA_SOFTMAX_SCALE, sink, None, o, m, lse)

        def run(launch=launch, o=o, m=m, lse=lse):
            launch(q, kv, idx, idx, kv, idx, idx, sink, o, lse, m, lse)

        outs[path] = (run, o, m, lse)
    for run, *_ in outs.values():
        run()
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(outs["gluon"][1:], outs["triton"][1:])]
    print(f"gluon against triton: out {diffs[0]:.3g}, max_logits {diffs[1]:.3g}, lse {diffs[2]:.3g} (largest "
          "absolute difference)")
    rate = harness.read_matmul_ceilings(dev)["matmul_ceiling"]["tflops"]
    flops = 4 * heads * width * layout.HEAD_DIM * tokens
    print(f"bf16 matmul rate {rate} TFLOP/s; {flops / 1e9:.1f} GFLOP a call")
    for r in range(args.rounds):
        for path, (run, *_) in outs.items():
            us = harness.time_do_bench(run)
            print(f"r{r} {path:7s} {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s  "
                  f"{100 * flops / us / 1e6 / rate:.1f} % of the matmul rate", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
