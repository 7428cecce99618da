"""Shared benchmark runner: timing methods, the copy ceiling, JSON output, plot and table.

A family module (`benchmarks/bench_<family>.py`) provides:

- ``FAMILY``: its name (the JSON is ``bench_<FAMILY>.json``);
- ``cases(quick, device) -> list[Case]``: what to time;
- optionally ``extras(device, quick) -> dict``: extra sections merged into the JSON
  (run before the cases, e.g. host overhead);
- optionally ``targets(doc) -> dict``: ``{name: {"target": str, "value": x, "pass": bool | None}}``.

On CUDA a case is timed either with ``triton.testing.do_bench`` (median) or by CUDA-graph replay (N
back-to-back calls captured in one graph, replays timed with CUDA events); `sized_case` takes graph
replay at every size, with a do_bench cross-check for large calls. Both rotate among the workload's
input sets so repeated calls do not sit in L2. On the CPU a case is timed by wall clock (a smoke run).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import itertools
import json
import math
import os
import platform as _platform
import statistics
import subprocess
import sys
import time
import traceback
from typing import Callable

import torch

MiB = 1 << 20
GiB = 1 << 30
ROTATE_BYTES = 256 * MiB       # inputs rotated through per timing: ~5x a 50-60 MB L2
COPY_BYTES_GPU = 2 * GiB       # size of the copy-ceiling buffer (read 2 GiB + write 2 GiB)
COPY_BYTES_CPU = 64 * MiB
GRAPH_CALLS = 100              # calls captured per graph for small sizes
GRAPH_CALLS_LARGE = 10         # ... for cases moving more than GRAPH_LARGE_BYTES per call
GRAPH_LARGE_BYTES = 32 * MiB

METHODS = {
    "do_bench": "median of triton.testing.do_bench(return_mode='median'; L2 flushed between calls), "
                "inputs rotated; time per call",
    "graph": "N back-to-back calls (inputs rotated) captured in one torch.cuda.CUDAGraph; median over "
             "samples of CUDA-event time of 5 replays / (5*N)",
    "wall": "CPU smoke run: median wall-clock time of single calls (time.perf_counter)",
}


@dataclasses.dataclass
class Workload:
    """Ready-to-run inputs for one case.

    run(i) runs the op once on input set i (0 <= i < nsets), without synchronizing.
    nbytes: bytes one call must move (inputs read once + outputs written once).
    check(): optional correctness check after timing; returns "ok" or a message.
    """

    run: Callable[[int], None]
    nsets: int
    nbytes: int
    check: Callable[[], str] | None = None


@dataclasses.dataclass
class Case:
    """One row of a benchmark: a name, its parameters and how to build and time it.

    build(device) -> Workload. method: "do_bench" or "graph" on CUDA (the CPU always uses
    "wall"). series: the plotted line this case belongs to (x = params["T"]), or None.
    crosscheck_graph / crosscheck_do_bench: also time the case by the other method, as a second opinion.
    """

    name: str
    build: Callable[[torch.device], Workload]
    params: dict
    method: str = "do_bench"
    series: str | None = None
    crosscheck_graph: bool = False
    crosscheck_do_bench: bool = False


GRAPH_MAX_BYTES = 64 * MiB     # sized_case: larger cases also get a do_bench cross-check


def sized_case(name: str, build: Callable[[torch.device], Workload], params: dict, nbytes: int,
               series: str | None = None) -> Case:
    """A case timed by CUDA-graph replay: back-to-back calls over rotated inputs, so each call reads its
    inputs from DRAM and writes back its predecessor's output, the steady state of a serving step. Cases
    moving more than GRAPH_MAX_BYTES are also timed by do_bench, whose flush (writing 256 MiB) leaves up to
    an L2 of dirty lines that the timed call then writes back besides its own (benchmarks/NOTES.md)."""
    return Case(name=name, build=build, params=params, method="graph", series=series,
                crosscheck_do_bench=nbytes > GRAPH_MAX_BYTES)


def rotation_sets(set_bytes: int, device: torch.device, cap: int = GRAPH_CALLS) -> int:
    """How many input sets of `set_bytes` to rotate through so that together they exceed L2.

    At least 2, at most `cap` (a graph of GRAPH_CALLS calls uses each set at least once); 2 on the CPU.
    """
    if device.type != "cuda":
        return 2
    return max(2, min(cap, math.ceil(ROTATE_BYTES / max(1, set_bytes))))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def time_do_bench(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median µs per call of `fn` by triton.testing.do_bench."""
    import triton.testing
    return 1e3 * float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def time_graph(w: Workload, n_calls: int, samples: int = 20, replays: int = 5) -> float:
    """Median µs per call: `n_calls` calls (rotating input sets) captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):             # warm up (compile, caches) outside the capture
        for i in range(max(3, w.nsets)):
            w.run(i % w.nsets)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            w.run(i % w.nsets)
    graph.replay()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()                         # keeps the GPU busy while the timed replays are queued
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / (replays * n_calls))
    del graph
    return statistics.median(per_call)


def graph_us_per_call(call: Callable[[int], object], n_calls: int = 100, replays: int = 10) -> float:
    """µs per call of `call(i)` for i < n_calls captured in one CUDA graph (replayed `replays` times,
    timed with events), after one eager warm-up call."""
    call(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * n_calls)


def time_wall(w: Workload, device: torch.device, samples: int = 5) -> float:
    """Median wall-clock µs of single calls (CPU smoke runs)."""
    w.run(0)
    sync(device)
    times = []
    for s in range(samples):
        t0 = time.perf_counter()
        w.run(s % w.nsets)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def time_rotating(w: Workload) -> float:
    """do_bench over the workload, one input set after another."""
    it = itertools.cycle(range(w.nsets))
    return time_do_bench(lambda: w.run(next(it)))


def host_us_per_call(fn: Callable[[], object], device: torch.device, calls: int = 2000, rounds: int = 5,
                     warmup: int = 200) -> float:
    """Median over `rounds` of host µs per call: `calls` calls, one synchronize at the end of each round."""
    return statistics.median(host_us_rounds({"fn": fn}, device, calls, rounds, warmup)["fn"])


def host_us_rounds(fns: dict[str, Callable[[], object]], device: torch.device, calls: int = 2000,
                   rounds: int = 5, warmup: int = 200) -> dict[str, list[float]]:
    """Host µs per call of each function, per round. The functions take turns within every round,
    so a slow phase of the host (a shared VM) falls on all of them alike and per-round ratios
    stay comparable."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    results = {name: [] for name in fns}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                sync(device)
                results[name].append(1e6 * (time.perf_counter() - t0) / calls)
    finally:
        if gc_was_enabled:
            gc.enable()
    return results


def copy_ceiling(device: torch.device) -> dict:
    """Device-to-device copy bandwidth (bytes read + bytes written), measured now on `device`."""
    n = COPY_BYTES_GPU if device.type == "cuda" else COPY_BYTES_CPU
    us, how = _time_copy(n, device)
    free_memory(device)
    return {"bytes": 2 * n, "us": sig(us), "gbps": sig(2 * n / us / 1e3), "method": how}


def _time_copy(n: int, device: torch.device) -> tuple[float, str]:
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    if device.type == "cuda":
        return time_do_bench(lambda: dst.copy_(src), rep_ms=200), f"dst.copy_(src) of {n / GiB:g} GiB, do_bench median"
    us = time_wall(Workload(lambda i: dst.copy_(src), 1, 2 * n), device)
    return us, f"dst.copy_(src) of {n // MiB} MiB, wall clock (CPU)"


READ_BYTES = 2 * GiB          # size of the read-ceiling buffer
MATMUL_N = 8192               # the matmul ceiling: N^3 bf16


def nvidia_device(probe: str) -> torch.device | None:
    """The CUDA device for a probe of an NVIDIA-only path, or None (having said why) where there is none."""
    if not torch.cuda.is_available() or torch.version.hip:
        print(f"{probe}: needs an NVIDIA GPU")
        return None
    return torch.device("cuda")


@contextlib.contextmanager
def plan_rule_off(module, rule: str, off: bool = True):
    """Inside (when `off`), `module.<rule>`, a fast path's plan rule, answers False: an op planned there takes its
    portable kernel. Probes compare the two this way."""
    kept = getattr(module, rule)
    if off:
        setattr(module, rule, lambda *a, **kw: False)
    try:
        yield
    finally:
        setattr(module, rule, kept)


def read_matmul_ceilings(device: torch.device) -> dict:
    """Read bandwidth (`torch.sum` over a 2 GiB fp32 buffer) and bf16 matmul throughput (8192^3
    torch.matmul), measured now on a GPU (the floors of the attention families); {} on the CPU."""
    if device.type != "cuda":
        return {}
    read_us = _time_read(device)
    free_memory(device)
    mm_us = _time_matmul(device)
    free_memory(device)
    return {"read_ceiling": {"bytes": READ_BYTES, "us": sig(read_us), "gbps": sig(READ_BYTES / read_us / 1e3),
                             "method": "torch.sum over a 2 GiB fp32 buffer, do_bench median"},
            "matmul_ceiling": {"tflops": sig(2 * MATMUL_N ** 3 / mm_us / 1e6),
                               "method": f"{MATMUL_N}^3 bf16 torch.matmul, do_bench median"}}


def add_floors(case: dict, nbytes: int, flops: int, read_gbps: float | None, tflops: float | None) -> bool:
    """Add byte_floor_us (nbytes / read ceiling), flop_floor_us (flops / matmul rate) and x_of_floor (time
    over the larger floor) to a timed case's dict; False (nothing added) without a time or the ceilings."""
    if not (case.get("us") and read_gbps and tflops):
        return False
    byte_floor, flop_floor = nbytes / read_gbps / 1e3, flops / tflops / 1e6
    case.update(byte_floor_us=sig(byte_floor), flop_floor_us=sig(flop_floor),
                x_of_floor=sig(case["us"] / max(byte_floor, flop_floor)))
    return True


def _time_read(device: torch.device) -> float:
    buf = torch.empty(READ_BYTES // 4, dtype=torch.float32, device=device).uniform_()
    return time_do_bench(lambda: buf.sum(), rep_ms=200)


def _time_matmul(device: torch.device) -> float:
    a = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16)
    b = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16)
    return time_do_bench(lambda: a @ b, rep_ms=200)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Running a family
# ---------------------------------------------------------------------------------------------
def environment(device: torch.device) -> dict:
    """Device name, library versions and the date (UTC), for the JSON header."""
    import triton
    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": _platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "git": _git_revision(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                   l2_bytes=getattr(props, "L2_cache_size", None), memory_bytes=props.total_memory)
    return env


def _git_revision(root: str | None = None) -> str | None:
    """The short commit of the checkout at root (default: this one), with "+dirty" where tracked files differ from
    it (a copied tree whose .git is older than its files reports its commit as dirty, not as the code that ran)."""
    try:
        root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

        def git(*args):
            return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=5).stdout.strip()

        rev = git("rev-parse", "--short", "HEAD")
        if rev and git("status", "--porcelain", "--untracked-files=no"):
            rev += "+dirty"
        return rev or None
    except Exception:
        return None


def write_json(path: str, doc: dict) -> None:
    """Write `doc` atomically (a reader never sees half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def _error(e: BaseException) -> str:
    traceback.print_exc(file=sys.stderr)
    return f"{type(e).__name__}: {e}"[:2000]


def run_case(case: Case, device: torch.device, ceiling_gbps: float | None) -> dict:
    """Build, time and check one case; never raises (errors land in the record)."""
    rec = {"name": case.name, "series": case.series, "params": case.params,
           "method": case.method if device.type == "cuda" else "wall"}
    w = None
    try:
        torch.manual_seed(0)
        w = case.build(device)
        sync(device)
        rec.update(bytes=w.nbytes, nsets=w.nsets)
        if rec["method"] == "graph":
            rec["n_calls"] = GRAPH_CALLS if w.nbytes <= GRAPH_LARGE_BYTES else GRAPH_CALLS_LARGE
            us = time_graph(w, rec["n_calls"])
        elif rec["method"] == "do_bench":
            us = time_rotating(w)
        else:
            us = time_wall(w, device)
        sync(device)
        rec.update(_rates(w.nbytes, us, ceiling_gbps))
        if case.crosscheck_graph and device.type == "cuda":
            try:
                n = GRAPH_CALLS if w.nbytes <= GRAPH_LARGE_BYTES else GRAPH_CALLS_LARGE
                g_us = time_graph(w, n)
                rec["graph_crosscheck"] = {"n_calls": n, **_rates(w.nbytes, g_us, ceiling_gbps)}
            except Exception as e:
                rec["graph_crosscheck"] = {"error": _error(e)}
        if case.crosscheck_do_bench and device.type == "cuda":
            try:
                rec["do_bench_crosscheck"] = _rates(w.nbytes, time_rotating(w), ceiling_gbps)
            except Exception as e:
                rec["do_bench_crosscheck"] = {"error": _error(e)}
    except Exception as e:
        rec["error"] = _error(e)
    if w is not None and w.check is not None:
        try:
            rec["check"] = w.check()
            sync(device)
        except Exception as e:
            rec["check"] = "error: " + _error(e)
    del w
    free_memory(device)
    return rec


def _rates(nbytes: int, us: float, ceiling_gbps: float | None) -> dict:
    gbps = nbytes / us / 1e3
    out = {"us": sig(us), "gbps": sig(gbps)}
    if ceiling_gbps:
        out["pct_of_copy"] = sig(100 * gbps / ceiling_gbps)
    return out


def sig(x: float, digits: int = 5) -> float:
    """`x` rounded to `digits` significant digits (JSON stays readable, small values stay nonzero)."""
    return float(f"{x:.{digits}g}")


def run_family(module, device: torch.device, quick: bool, out_dir: str) -> dict:
    """Run one family's extras and cases, writing `out_dir/bench_<family>.json` after each step."""
    family = module.FAMILY
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"bench_{family}.json")
    doc = {"family": family, **environment(device), "quick": quick, "methods": METHODS,
           "copy_ceiling": None, "cases": [], "targets": {}, "all_targets_pass": None, "errors": []}
    write_json(path, doc)

    def step(label, fn):
        try:
            return fn()
        except Exception as e:
            doc["errors"].append(f"{label}: {_error(e)}")
            return None
        finally:
            write_json(path, doc)

    print(f"[{family}] device: {doc['device']}  torch {doc['torch']}  triton {doc['triton']}", flush=True)
    interrupted = False
    try:
        doc["copy_ceiling"] = step("copy_ceiling", lambda: copy_ceiling(device))
        ceiling = (doc["copy_ceiling"] or {}).get("gbps")
        print(f"[{family}] copy ceiling: {ceiling} GB/s", flush=True)
        if hasattr(module, "extras"):
            doc.update(step("extras", lambda: module.extras(device, quick)) or {})
        for case in step("cases", lambda: module.cases(quick, device)) or []:
            rec = run_case(case, device, ceiling)
            doc["cases"].append(rec)
            write_json(path, doc)
            print(f"[{family}] {format_case(rec)}", flush=True)
    except KeyboardInterrupt:       # Ctrl-C, or SIGTERM from `timeout` (run.py turns it into this)
        interrupted = True
        doc["errors"].append("interrupted: the remaining steps were skipped")
    if hasattr(module, "targets"):
        doc["targets"] = step("targets", lambda: module.targets(doc)) or {}
        if device.type != "cuda":
            for t in doc["targets"].values():
                t["pass"] = None
                t["note"] = "not checked: no GPU"
        verdicts = [t.get("pass") for t in doc["targets"].values()]
        doc["all_targets_pass"] = (False if False in verdicts else
                                   None if None in verdicts or not verdicts else True)
    write_json(path, doc)
    png = os.path.join(out_dir, f"bench_{family}.png")
    doc["plot"] = step("plot", lambda: plot_series(doc, png))
    write_json(path, doc)
    print_summary(doc, path)
    if interrupted:
        raise KeyboardInterrupt
    return doc


# ---------------------------------------------------------------------------------------------
# Plot and table
# ---------------------------------------------------------------------------------------------
def plot_series(doc: dict, path: str) -> str | None:
    """GB/s against T (log x) for every series, with the copy ceiling and 85% of it. Needs matplotlib."""
    series = {}
    for c in doc["cases"]:
        if c.get("series") and "gbps" in c and "T" in c["params"]:
            series.setdefault(c["series"], []).append(c)
    if not series:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot written", flush=True)
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, pts in series.items():
        pts = sorted(pts, key=lambda c: c["params"]["T"])
        line, = ax.plot([c["params"]["T"] for c in pts], [c["gbps"] for c in pts], "-", label=name)
        for method, marker in (("graph", "s"), ("do_bench", "o"), ("wall", "^")):
            sel = [c for c in pts if c["method"] == method]
            if sel:
                ax.plot([c["params"]["T"] for c in sel], [c["gbps"] for c in sel], marker,
                        color=line.get_color(), mfc="none" if method == "graph" else line.get_color())
    ceiling = (doc.get("copy_ceiling") or {}).get("gbps")
    if ceiling:
        ax.axhline(ceiling, color="k", lw=1, label=f"copy ceiling {ceiling:.0f} GB/s")
        ax.axhline(0.85 * ceiling, color="k", lw=1, ls="--", label="85% of copy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T (open squares: CUDA-graph replay; dots: do_bench)")
    ax.set_ylabel("achieved GB/s (bytes that must move)")
    ax.set_title(f"{doc['family']} on {doc['device']} (torch {doc['torch']}, triton {doc['triton']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.basename(path)


def targets_line(doc: dict) -> str:
    """The run's verdict on the family's own targets, in one line."""
    targets = doc.get("targets") or {}
    if not targets:
        return "targets: none defined"
    failed = [name for name, t in targets.items() if t.get("pass") is False]
    unjudged = [name for name, t in targets.items() if t.get("pass") is None]
    if doc.get("device_type") != "cuda":
        return f"targets: {len(targets)} not judged (no GPU; they are judged on a GPU run only)"
    if failed:
        return f"targets: FAIL {len(failed)} of {len(targets)}: {', '.join(failed)}"
    if unjudged:
        return f"targets: {len(targets) - len(unjudged)} pass, {len(unjudged)} not measured: {', '.join(unjudged)}"
    return f"targets: all {len(targets)} pass"


def _fmt(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def format_case(c: dict) -> str:
    """One table row for a case record."""
    if "error" in c:
        return f"{c['name']:<34} ERROR {c['error'][:160]}"
    row = (f"{c['name']:<34} {c['method']:<8} {_fmt(c.get('us'), '10.2f')} {_fmt(c.get('gbps'), '9.1f')} "
           f"{_fmt(c.get('pct_of_copy'), '6.1f')}  {str(c.get('check', '-'))[:40]}")
    for method in ("graph", "do_bench"):
        g = c.get(f"{method}_crosscheck")
        if g:
            row += f"  [{method}: {_fmt(g.get('us'), '.2f')} us {_fmt(g.get('pct_of_copy'), '.1f')}%]" if "us" in g \
                else f"  [{method}: {str(g.get('error'))[:60]}]"
    return row


def print_summary(doc: dict, path: str) -> None:
    """Print a compact table of the whole run (the device tool returns only the tail of the output)."""
    cc = doc.get("copy_ceiling") or {}
    print(f"\n==== summary: {doc['family']} on {doc['device']} (torch {doc['torch']}, triton {doc['triton']}, "
          f"{doc['date']}) ====")
    print(f"copy ceiling: {cc.get('gbps', '-')} GB/s ({cc.get('method', 'not measured')})")
    print(f"{'case':<34} {'method':<8} {'us':>10} {'GB/s':>9} {'%copy':>6}  check")
    for c in doc["cases"]:
        print(format_case(c))
    ho = doc.get("host_overhead")
    if ho:
        print(f"host overhead, T={ho.get('T')}, us/call (x vs {ho.get('baseline')}):")
        base = ho.get("us_per_call", {}).get(ho.get("baseline"))
        for k, v in ho.get("us_per_call", {}).items():
            ratio = f"{v / base:.2f}x" if base else "-"
            print(f"  {k:<44} {v:8.2f}  {ratio}")
        for k, v in ho.get("errors", {}).items():
            print(f"  {k:<44} ERROR {v[:100]}")
    if doc.get("graph_floor_us_per_call"):
        print(f"graph launch floor, us/call: {doc['graph_floor_us_per_call']}")
    for name, t in doc.get("targets", {}).items():
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t.get("pass")]
        print(f"target {name:<30} {verdict:<5} value={t.get('value')} (want {t.get('target')})")
    print(targets_line(doc))
    for e in doc.get("errors", []):
        print(f"error: {e[:300]}")
    print(f"json: {path}", flush=True)
