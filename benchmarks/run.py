"""Run the benchmarks: `python -m benchmarks.run --out DIR [--quick] [--families cache] [--device auto]`.

Writes DIR/bench_<family>.json (and .png where matplotlib is installed) per family and prints a
compact table last. Without a GPU (or with --device cpu) it runs a small smoke version on the CPU
reference implementation, timed by wall clock.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys

import torch

# One line per family: name -> module with FAMILY, cases(quick, device)[, extras, targets].
FAMILIES = {
    "cache": "benchmarks.bench_cache",
    "k_cache": "benchmarks.bench_k_cache",
    "sparse_index": "benchmarks.bench_sparse_index",
    "metadata": "benchmarks.bench_metadata",
    "attention": "benchmarks.bench_attention",
    "sparse_mla": "benchmarks.bench_sparse_mla",
    "indexer": "benchmarks.bench_indexer",
    "indexer_q": "benchmarks.bench_indexer_q",
    "mqa_logits": "benchmarks.bench_mqa_logits",
    "topk": "benchmarks.bench_topk",
}


def pick_device(choice: str) -> torch.device:
    """"auto": CUDA when present and Triton is not in interpreter mode, else the CPU."""
    from torch_dsv4_ops import platform
    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available() and not platform.INTERPRET:
        return torch.device("cuda", torch.cuda.current_device())
    if choice == "cuda":
        raise SystemExit("--device cuda: no CUDA device (or TRITON_INTERPRET=1 is set)")
    if platform.INTERPRET and torch.cuda.is_available():
        print("note: TRITON_INTERPRET=1 is set; benchmarking the CPU reference instead of the GPU", flush=True)
    return torch.device("cpu")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    """Parse arguments, run each family; return 1 if any step, case, correctness check or (on a GPU)
    target failed."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder for bench_<family>.json/.png")
    p.add_argument("--quick", action="store_true", help="fewer sizes and variants")
    p.add_argument("--families", nargs="+", default=list(FAMILIES),
                   help=f"families to run (space or comma separated): {', '.join(FAMILIES)}")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    args = p.parse_args(argv)
    families = [f for item in args.families for f in item.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; known: {list(FAMILIES)}")

    from benchmarks import harness
    import torch_dsv4_ops
    device = pick_device(args.device)
    signal.signal(signal.SIGTERM, _interrupt)   # `timeout`: still write the summary, plot and JSON
    failed = False
    for family in families:
        # On the CPU, time the reference even if TRITON_INTERPRET=1 selected the interpreted kernel.
        ctx = torch_dsv4_ops.cpu_implementation("reference") if device.type == "cpu" else contextlib.nullcontext()
        try:
            with ctx:
                doc = harness.run_family(importlib.import_module(FAMILIES[family]), device, args.quick, args.out)
            failed |= bool(doc["errors"]) or any("error" in c or c.get("check", "ok") != "ok" for c in doc["cases"])
            failed |= doc.get("all_targets_pass") is False
        except KeyboardInterrupt:
            print(f"family {family}: interrupted; stopping", flush=True)
            return 1
        except Exception:
            import traceback
            traceback.print_exc()
            print(f"family {family}: failed before finishing", flush=True)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
