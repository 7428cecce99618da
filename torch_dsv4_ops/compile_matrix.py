"""Ahead-of-time compile matrix: build every kernel specialisation the ops launch, for every target in
`platform.MATRIX_TARGETS`, with `triton.compile` on a machine without a GPU.

    python -m torch_dsv4_ops.compile_matrix [--json PATH] [--targets sm_80 gfx942 ...] [--filter REGEX]
                                            [--scope full|ci] [--jobs N] [--cache-dir DIR] [--quiet]

Each kernel module listed in `MATRIX_MODULES` provides `matrix_cases(target) -> list[KernelCase]`
(kernels/matrix.py). Every case is compiled to PTX+cubin (CUDA) or AMDGCN+hsaco (HIP) in a process
pool; the fp8 conversion instructions of each result are recorded, so tests can check which fp8 path
(hardware casts or the software codec) each target really compiled. A case whose shared memory exceeds
`platform.shared_memory_limit` of its target fails: it compiles, but could not launch there. A probe also
compiles the hardware fp8 casts alone for each format and target, to check `platform.native_fp8` against Triton.

`--scope ci` (what the CPU suite runs, within CI's time budget) compiles every case on the targets of
`CI_FULL_TARGETS` (none at present) and, on the other targets, a covering subset of each `CI_COVER_MODULES`
module's cases (every codec, dtype, layout and size feature the flash-cache tests check per target, and every
case they name) plus the first case of every other kernel function; `--scope full` (the default, `make
compile-matrix`) compiles every case on every target.

Triton must not run in interpreter mode here: the CLI re-executes itself without TRITON_INTERPRET.
Exit status 1 if any case fails, or a format that `platform.native_fp8` calls native fails the probe.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
import traceback

import triton
import triton.language as tl

from . import layout, platform
from .kernels.fp8 import fp8_decode, fp8_encode
from .kernels.matrix import KernelCase, gpu_target

# Modules with `matrix_cases(target)`: adding a kernel module to the matrix is one line here.
MATRIX_MODULES = (
    "torch_dsv4_ops.kernels.cache",
    "torch_dsv4_ops.kernels.k_cache",
    "torch_dsv4_ops.kernels.sparse_index",
    "torch_dsv4_ops.kernels.metadata",
    "torch_dsv4_ops.kernels.attention",
    "torch_dsv4_ops.kernels.sparse_mla",
    "torch_dsv4_ops.kernels.indexer",
    "torch_dsv4_ops.kernels.indexer_q",
    "torch_dsv4_ops.kernels.mqa_logits",
    "torch_dsv4_ops.kernels.topk",
)

# --scope ci: every case on these targets; on every target, a covering subset of the flash-cache cases (whose
# codecs, dtypes and layouts the tests check per target) and one case of every other kernel function; within CI's
# 15 minutes on 2 cores. The list is empty since 2026-11-26: the full sets of sm_80, sm_90 and gfx942 were three
# quarters of the CI matrix (1913 of 2554 compile-seconds) when CI took 1796 s. The full matrix (`make
# compile-matrix`, or `--filter REGEX` for the changed kernels) runs before a kernel change lands
# (CONTRIBUTING.md).
CI_FULL_TARGETS: tuple[str, ...] = ()
CI_COVER_MODULES = ("torch_dsv4_ops.kernels.cache",)
# Cases tests/test_compile_matrix.py reads by name: always in the CI scope.
CI_NAMED_CASES = ("flash_nhd.bf16-fp8:u8.h8d128.bs16", "flash_nhd.bf16-fp8_e5m2:u8.h8d128.bs16",
                  "flash_nhd.e4m3fn-auto:fp32.h8d128.bs16")
SCOPES = ("full", "ci")

_FP8_INSTRUCTION = {
    "cuda": re.compile(r"\bcvt\.[\w.]*?(?:e4m3|e5m2)x2[\w.]*"),
    "hip": re.compile(r"\bv_cvt\w*?(?:fp8|bf8)\w*"),
}


def target_name(target: platform.Target) -> str:
    """'sm_90' for CUDA, the gfx name for HIP."""
    return f"sm_{target.arch}" if target.backend == "cuda" else str(target.arch)


TARGETS_BY_NAME = {target_name(t): t for t in platform.MATRIX_TARGETS}


@dataclasses.dataclass
class CaseResult:
    """The outcome of compiling one case for one target."""

    module: str
    name: str
    target: str
    ok: bool
    seconds: float
    error: str = ""
    num_warps: int = 0
    signature: dict = dataclasses.field(default_factory=dict)
    constexprs: dict = dataclasses.field(default_factory=dict)
    fp8_instructions: list = dataclasses.field(default_factory=list)   # fp8 cvt mnemonics in the PTX/AMDGCN
    shared: int = 0                                                     # bytes of shared memory (LDS) per program
    layout_conversions: int = 0                                         # ttg.convert_layout ops in the TTGIR


def compile_case(case: KernelCase, target: platform.Target):
    """`triton.compile` one case for `target`; returns triton's compiled kernel (asm in `.asm`)."""
    from triton.compiler import ASTSource
    src = ASTSource(fn=case.fn, signature=case.signature, constexprs=case.constexprs, attrs=case.attrs)
    return triton.compile(src, target=gpu_target(target), options={"num_warps": case.num_warps, **case.options})


def fp8_instructions(compiled, target: platform.Target) -> list[str]:
    """The distinct fp8 conversion instructions in a compiled kernel's PTX or AMDGCN."""
    asm = compiled.asm.get("ptx" if target.backend == "cuda" else "amdgcn", "")
    if isinstance(asm, bytes):
        asm = asm.decode()
    return sorted(set(_FP8_INSTRUCTION[target.backend].findall(asm)))


def _error_text(exc: BaseException) -> str:
    """The exception and its causes, innermost (Triton's real message) first, at most ~4000 characters."""
    chain = []
    while exc is not None and len(chain) < 8:
        chain.append("".join(traceback.format_exception_only(type(exc), exc)).strip())
        exc = exc.__cause__ or exc.__context__
    text = "\n--- raised from ---\n".join(reversed(chain))
    return text if len(text) <= 4000 else text[:3000] + "\n...\n" + text[-1000:]


def error_summary(error: str) -> str:
    """One line of an error text: the innermost exception's message."""
    first = error.split("\n--- raised from ---\n")[0]
    lines = [ln.strip() for ln in first.splitlines() if ln.strip().strip("^")]
    return lines[-1][:200] if lines else ""


_CASES: dict = {}


def module_cases(module: str, target: platform.Target) -> dict[str, KernelCase]:
    """{name: case} of one kernel module for one target (cached per process)."""
    key = (module, target)
    if key not in _CASES:
        _CASES[key] = {c.name: c for c in importlib.import_module(module).matrix_cases(target)}
    return _CASES[key]


def run_case(module: str, target: str, name: str) -> CaseResult:
    """Compile one named case (the unit of work of the process pool)."""
    tgt = TARGETS_BY_NAME[target]
    case = module_cases(module, tgt)[name]
    result = CaseResult(module, name, target, False, 0.0, num_warps=case.num_warps,
                        signature=dict(case.signature), constexprs=dict(case.constexprs))
    start = time.perf_counter()
    try:
        compiled = compile_case(case, tgt)
        result.shared = int(compiled.metadata.shared)
        limit = platform.shared_memory_limit(tgt)
        if result.shared > limit:   # compiles, but would fail to launch ("out of resources")
            result.error = f"needs {result.shared} bytes of shared memory; {target} has {limit}"
        else:
            result.ok = True
        result.fp8_instructions = fp8_instructions(compiled, tgt)
        result.layout_conversions = str(compiled.asm.get("ttgir", "")).count("ttg.convert_layout")
    except Exception as exc:   # a failed compile is a result, not a crash
        result.error = _error_text(exc)
    result.seconds = time.perf_counter() - start
    return result


# --- hardware fp8 probe ----------------------------------------------------------------------

@triton.jit
def _fp8_probe_kernel(src_ptr, dst_ptr, FMT: tl.constexpr, ENCODE: tl.constexpr):
    i = tl.arange(0, 128)
    if ENCODE:
        tl.store(dst_ptr + i, fp8_encode(tl.load(src_ptr + i), FMT, False))
    else:
        tl.store(dst_ptr + i, fp8_decode(tl.load(src_ptr + i), FMT, False))


def probe_fp8(target: str, fmt_code: int, encode: bool) -> dict:
    """Whether the hardware fp32 <-> fp8 cast of one format compiles for `target`."""
    from triton.compiler import ASTSource
    tgt, fmt = TARGETS_BY_NAME[target], layout.FP8_BY_CODE[fmt_code]
    sig = {"src_ptr": "*fp32" if encode else "*u8", "dst_ptr": "*u8" if encode else "*fp32",
           "FMT": "constexpr", "ENCODE": "constexpr"}
    out = dict(target=target, format=fmt.name, direction="encode" if encode else "decode",
               native=platform.native_fp8(tgt, fmt), ok=False, error="", instructions=[])
    try:
        src = ASTSource(fn=_fp8_probe_kernel, signature=sig, constexprs={"FMT": fmt_code, "ENCODE": encode})
        compiled = triton.compile(src, target=gpu_target(tgt), options={"num_warps": 1})
        out.update(ok=True, instructions=fp8_instructions(compiled, tgt))
    except Exception as exc:
        out["error"] = _error_text(exc)
    return out


# --- runner ------------------------------------------------------------------------------------

def cache_case_features(name: str, case: KernelCase) -> set:
    """What the flash-cache tests check per target, as features of one case: its codec, key and cache dtypes,
    slot dtype and stride kind, K layout (x), diffkv, odd heads/dims, block size 544, HIP's >2 GiB variant
    and its kernel function."""
    c, s = case.constexprs, case.signature
    return {("codec", c["IN_FP8"], c["OUT_KIND"], c["OUT_FP8"], c["SCALED"]), ("key", s["key_ptr"]),
            ("kc", s["kc_ptr"]), ("slot", s["slot_ptr"]), ("slot_stride", s["slot_stride"]), ("xk", c["XK"]),
            ("diffkv", c["DK"] != c["DV"]), ("odd", c.get("H") == 13 and c["DK"] == 80), ("bs544", c["BS"] == 544),
            ("bigcache", name.endswith(".bigcache")), ("fn", case.fn.__name__)}


def covering_cases(cases: dict) -> list[str]:
    """The names in CI_NAMED_CASES, then cases chosen greedily (the most features not yet covered, first in
    order on ties) until the subset has every feature (`cache_case_features`) of the whole set."""
    features = {name: cache_case_features(name, case) for name, case in cases.items()}
    chosen = [name for name in CI_NAMED_CASES if name in cases]
    have = set().union(*(features[name] for name in chosen))
    want = set().union(*features.values())
    while have != want:
        best = max(features, key=lambda name: len(features[name] - have))
        chosen.append(best)
        have |= features[best]
    return chosen


def scoped_cases(module: str, target: platform.Target, scope: str = "full") -> list[str]:
    """Names of the cases of `module` that `scope` compiles on `target` (see the module docstring)."""
    cases = module_cases(module, target)
    if scope == "full" or target_name(target) in CI_FULL_TARGETS:
        return list(cases)
    if module in CI_COVER_MODULES:
        return covering_cases(cases)
    first = {}
    for name, case in cases.items():
        first.setdefault(case.fn.__name__, name)
    return list(first.values())


def _tasks(targets, pattern: str | None = None, scope: str = "full") -> list[tuple[str, str, str]]:
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    match = re.compile(pattern).search if pattern else (lambda name: True)
    return [(module, target_name(t), name) for t in targets for module in MATRIX_MODULES
            for name in scoped_cases(module, t, scope) if match(name)]


def default_jobs() -> int:
    """The CPUs this process may run on (not the host's count), at most 16."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, 16))


def run_matrix(targets=platform.MATRIX_TARGETS, jobs: int | None = None, pattern: str | None = None,
               scope: str = "full"):
    """Compile every case of `scope` (whose name matches the regex `pattern`) for every target in a process
    pool of `jobs` workers (default: `default_jobs()`); returns (case results, fp8 probe results).

    The Triton cache directory in the environment is used as is (the CLI points it at a fresh
    temporary directory, so every case really compiles).
    """
    tasks = _tasks(targets, pattern, scope)
    if not tasks:
        raise ValueError(f"no matrix case matches {pattern!r}")
    probes = [(target_name(t), f.code, enc) for t in targets for f in layout.FP8_FORMATS for enc in (True, False)]
    jobs = max(1, min(jobs or default_jobs(), len(tasks)))
    ctx = multiprocessing.get_context("spawn")   # never fork a process that has imported torch
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        futures = [pool.submit(run_case, *task) for task in tasks]
        probe_futures = [pool.submit(probe_fp8, *p) for p in probes]
        results = [f.result() for f in futures]
        probe_results = [f.result() for f in probe_futures]
    return results, probe_results


def probe_contradictions(probes: list[dict]) -> list[dict]:
    """Probes where `platform.native_fp8` says native but the hardware cast does not compile."""
    return [p for p in probes if p["native"] and not p["ok"]]


def _print_report(results, probes, wall: float, jobs: int, quiet: bool) -> None:
    width = max([len(r.name) for r in results] + [6])
    if not quiet:
        print(f"{'kernel':<{width}}  {'target':<7} {'result':<6} {'seconds':>7}")
    for r in results:
        if not quiet or not r.ok:
            print(f"{r.name:<{width}}  {r.target:<7} {'ok' if r.ok else 'FAIL':<6} {r.seconds:7.2f}")
            if not r.ok:
                print(f"    {error_summary(r.error)}")
    print("\nhardware fp8 casts (probe): target, format, direction -> compiles / platform.native_fp8")
    for p in probes:
        detail = " ".join(p["instructions"]) if p["ok"] else error_summary(p["error"])
        flag = "   <-- platform.native_fp8 says native" if p["native"] and not p["ok"] else ""
        print(f"  {p['target']:<7} {p['format']:<9} {p['direction']:<6} -> {'ok' if p['ok'] else 'FAIL':<4} / "
              f"{'native' if p['native'] else 'software':<8}  {detail}{flag}")
    counts = {}
    for r in results:
        counts[r.target] = counts.get(r.target, 0) + 1
    failed = sum(not r.ok for r in results)
    per_target = ", ".join(f"{t}: {n}" for t, n in counts.items())
    print(f"\n{len(results)} compiles over {len(counts)} targets ({per_target}), "
          f"{failed} failed, {len(probe_contradictions(probes))} probe contradictions; "
          f"wall {wall:.1f} s with {jobs} jobs ({sum(r.seconds for r in results):.1f} s compiling)")


def _reexec_without_interpreter(argv) -> None:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    os.execve(sys.executable, [sys.executable, "-m", "torch_dsv4_ops.compile_matrix", *argv], env)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m torch_dsv4_ops.compile_matrix", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write every result (and the fp8 probe) as JSON")
    parser.add_argument("--targets", nargs="+", choices=list(TARGETS_BY_NAME), default=list(TARGETS_BY_NAME))
    parser.add_argument("--filter", metavar="REGEX", help="only the cases whose name matches REGEX")
    parser.add_argument("--scope", choices=SCOPES, default="full",
                        help="full: every case on every target; ci: the CPU suite's subset (module docstring)")
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="worker processes (default: usable CPUs)")
    parser.add_argument("--cache-dir", help="Triton cache directory (default: a fresh temporary one)")
    parser.add_argument("--quiet", action="store_true", help="print only failures and the summary")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        _reexec_without_interpreter(argv)
    targets = [TARGETS_BY_NAME[n] for n in args.targets]
    with tempfile.TemporaryDirectory(prefix="dsv4-compile-matrix-") as tmp:
        os.environ["TRITON_CACHE_DIR"] = args.cache_dir or tmp
        jobs = max(1, args.jobs)
        start = time.perf_counter()
        results, probes = run_matrix(targets, jobs, args.filter, args.scope)
        wall = time.perf_counter() - start
    _print_report(results, probes, wall, jobs, args.quiet)
    if args.json:
        import torch
        payload = dict(triton=triton.__version__, torch=torch.__version__, jobs=jobs, wall_seconds=wall,
                       targets=args.targets, scope=args.scope, modules=list(MATRIX_MODULES),
                       results=[dataclasses.asdict(r) for r in results], fp8_probe=probes)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 1 if any(not r.ok for r in results) or probe_contradictions(probes) else 0


if __name__ == "__main__":
    sys.exit(main())
