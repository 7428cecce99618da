"""Where the paged attention's open targets stand on this GPU: `python -m benchmarks.probe_attention_parts`.

Two diagnostics (CUDA-graph replay over rotated inputs, each case checked against the float64 reference first):
- one request decoding over contexts of 16 .. 65536 keys (bf16 and fp8 caches): the time against the context, with
  the line through the longest contexts (its slope as GB/s, its intercept as the call's fixed cost), the best
  share of the read ceiling a call of that fixed cost can reach at 32768 keys, and what a plain read of the same
  bytes (`torch.sum` over rotated buffers, in a graph) reaches;
- the mixed step of the benchmark next to its two parts timed alone (its decodes, its prefills), since the two
  kernels cannot share an SM and their times add up.
Not a benchmark: `NOTES.md` cites its output.
"""
from __future__ import annotations

import argparse

import torch

from . import bench_attention as bench
from .harness import Workload, read_matmul_ceilings, rotation_sets, time_graph

LONG_CONTEXTS = (16, 8192, 16384, 32768, 65536)
FIT_FROM = 16384          # the line through the contexts from here on (each doubling adds only its bytes)


def _time(spec: bench.Spec, device, reps: int) -> tuple[float, str]:
    w = bench.build(spec, device)
    check = w.check()
    return min(time_graph(w, reps) for _ in range(2)), check


def plain_read_us(nbytes: int, device, reps: int) -> float:
    """Graph-replay time of `torch.sum` over `nbytes` of fp32, rotated through enough buffers to leave L2."""
    n = rotation_sets(nbytes, device)
    bufs = [torch.rand(nbytes // 4, device=device) for _ in range(n)]
    total = torch.empty((), device=device)
    return time_graph(Workload(lambda i: torch.sum(bufs[i], out=total), n, nbytes), reps)


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept us, slope us per key) of (keys, us) points."""
    n = len(points)
    mx = sum(k for k, _ in points) / n
    my = sum(u for _, u in points) / n
    slope = sum((k - mx) * (u - my) for k, u in points) / sum((k - mx) ** 2 for k, _ in points)
    return my - slope * mx, slope


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probe_attention_parts", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_attention_parts: needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    ceilings = read_matmul_ceilings(device)
    ceiling = ceilings["read_ceiling"]["gbps"]
    print(f"device {torch.cuda.get_device_name()}, read ceiling {ceiling:.1f} GB/s, bf16 matmul "
          f"{ceilings['matmul_ceiling']['tflops']:.1f} TFLOP/s")
    for fp8 in (False, True):
        kind = "fp8" if fp8 else "bf16"
        points = []
        for ctx in LONG_CONTEXTS:
            spec = bench.Spec(1, ctx, fp8)
            us, check = _time(spec, device, args.reps)
            points.append((ctx, us))
            pct = spec.bytes_per_call() / (us * 1e-6) / (ceiling * 1e9) * 100
            print(f"decode {kind} 1 x {ctx:6d}: {us:8.2f} us  {pct:5.1f} % of read  {check}", flush=True)
        intercept, slope = fit([pt for pt in points if pt[0] >= FIT_FROM])
        per_key = bench.Spec(1, 1, fp8).kv_bytes_per_token()
        transfer = bench.Spec(1, 32768, fp8).bytes_per_call() / (ceiling * 1e3)
        print(f"  fit over >= {FIT_FROM} keys: fixed {intercept:.2f} us + {per_key / slope / 1e3:.1f} GB/s; "
              f"at 32768 keys the transfer at the ceiling is {transfer:.2f} us, so this fixed cost allows at most "
              f"{transfer / (transfer + intercept) * 100:.1f} % of read")
        nbytes = bench.Spec(1, 32768, fp8).bytes_per_call()
        plain = plain_read_us(nbytes, device, args.reps)
        print(f"  a plain read of the same {nbytes / 1e6:.1f} MB (torch.sum): {plain:.2f} us = "
              f"{nbytes / plain / 1e3 / ceiling * 100:.1f} % of read", flush=True)
    mixed = bench.Spec(**bench.MIXED)
    parts = {"decodes alone": bench.Spec(mixed.decodes, mixed.decode_ctx),
             "prefills alone": bench.Spec(0, 0, prefills=mixed.prefills, new=mixed.new, cached=mixed.cached),
             "mixed step": mixed}
    times = {}
    for label, spec in parts.items():
        times[label], check = _time(spec, device, args.reps)
        floor = max(spec.bytes_per_call() / ceiling / 1e3, spec.flops() / ceilings["matmul_ceiling"]["tflops"] / 1e6)
        print(f"{label:<15} {spec.name:<40} {times[label]:8.2f} us  {times[label] / floor:5.2f}x its floor "
              f"({floor:.1f} us)  {check}", flush=True)
    print(f"  decodes + prefills alone {times['decodes alone'] + times['prefills alone']:.2f} us against the step's "
          f"{times['mixed step']:.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
