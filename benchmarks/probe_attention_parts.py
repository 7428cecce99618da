"""Where the paged attention's open targets stand on this GPU: `python -m benchmarks.probe_attention_parts`.

Diagnostics (CUDA-graph replay over rotated inputs, each attention case checked against the float64 reference first):
- one request decoding over contexts of 16 .. 65536 keys (bf16 and fp8 caches): the time against the context, with
  the line through the longest contexts (its slope as GB/s, its intercept as the call's fixed cost), the best
  share of the read ceiling a call of that fixed cost can reach at 32768 keys; what a plain read of the same
  bytes reaches (`torch.sum` over rotated buffers, and a one-wave Triton read, each program summing one contiguous
  part, at the best of READ_GRIDS); the call's two kernels (the split decode, the combine of its partial rows)
  each replayed alone (`--reads-only`: this part only);
- one request over contexts of 4096 .. 32768 keys with the split count forced (`forced_decode_splits`) to the
  plan's and to each of SPLIT_COUNTS: what the plan's bound on the keys of a split costs a request too short to
  fill the GPU with splits of that size;
- the mixed step of the benchmark next to its two parts timed alone (its decodes, its prefills), since the two
  kernels cannot share an SM and their times add up.
Alone, instead of those: `--read-shapes`, the Triton read of the fp8 call's bytes in 4 KB pages shaped as the
decode's (its grid, pages a step, warps, the pages in place or through a page table: PAGE_READS); `--wide-splits`,
1 x 32768 past MAX_SPLITS (WIDE_SPLIT_COUNTS, a 256-row combine tile patched in); `--per-sm`, fp8 decodes whose
plans pass one wave at 9 programs an SM, with FP8_PROGRAMS_PER_SM patched to each of PER_SM_COUNTS. With any of
them, `--maxnreg N` caps the fp8-cache decode's registers at N and sets FP8_PROGRAMS_PER_SM to what N fits.
Not a benchmark: `NOTES.md` cites its output.
"""
from __future__ import annotations

import argparse
import contextlib

import torch
import triton
import triton.language as tl

import torch_dsv4_ops
from torch_dsv4_ops import platform
from torch_dsv4_ops.kernels import attention as kernels
from torch_dsv4_ops.ops import attention as ops
from torch_dsv4_ops.testing import patched_constants

from . import bench_attention as bench
from .harness import Workload, read_matmul_ceilings, rotation_sets, time_graph
from .probe_registers import programs_per_sm

LONG_CONTEXTS = (16, 8192, 16384, 32768, 65536)
FIT_FROM = 16384          # the line through the contexts from here on (each doubling adds only its bytes)
SPLIT_CONTEXTS = (4096, 8192, 16384, 32768)
SPLIT_COUNTS = (16, 32, 64, 128)
WIDE_SPLIT_COUNTS = (128, 132, 160, 176, 181)   # 1 x 32768 up to 181 splits (11 programs an SM)
PER_SM_COUNTS = (8, 9, 11, 12)      # FP8_PROGRAMS_PER_SM tried by --per-sm
PER_SM_CASES = ((2, 32768), (4, 16384), (16, 8192), (90, 4096), (64, 4096))   # fp8 decodes (requests, keys)
# (programs per SM, fp32 elements a step, warps) of the Triton read
READ_GRIDS = ((1, 8192, 8), (2, 8192, 8), (4, 4096, 8), (8, 2048, 4), (8, 4096, 8), (16, 2048, 4))
# (programs, or programs per SM when negative; fp32 elements a page; pages a step; warps; TABLE) of the paged read.
# The fp8 decode of 1 x 32768: 1024 programs of one warp, a 16-key tile = 4 KB of K and V a step (two in flight).
PAGE_READS = ((-16, 2048, 1, 4, 0), (1024, 1024, 1, 1, 0), (1024, 1024, 2, 1, 0), (1024, 1024, 4, 1, 0),
              (1024, 1024, 2, 2, 0), (1024, 1024, 1, 1, 1), (1024, 1024, 2, 1, 1), (1024, 1024, 1, 1, 2),
              (1024, 1024, 2, 1, 2), (-16, 1024, 2, 1, 0), (-16, 1024, 2, 1, 2))


def _pct(spec: bench.Spec, us: float, ceiling: float) -> float:
    """A call's bytes over `us` as a share of the read ceiling (GB/s), in %."""
    return spec.bytes_per_call() / (us * 1e-6) / (ceiling * 1e9) * 100


def _cell(label, spec: bench.Spec, device, reps: int, ceiling: float) -> str:
    """`label: us, % of read` of one timed call, with its check's message unless it is ok."""
    us, check = _time(spec, device, reps)
    return f"{label}: {us:.2f} us {_pct(spec, us, ceiling):.1f} %{'' if check == 'ok' else ' ' + check}"


def _time(spec: bench.Spec, device, reps: int) -> tuple[float, str]:
    w = bench.build(spec, device)
    check = w.check()
    return min(time_graph(w, reps) for _ in range(2)), check


def split_sweep(device, ceiling: float, reps: int) -> None:
    """One request's decode with the split count the plan picks, then forced to each of SPLIT_COUNTS."""
    for fp8 in (False, True):
        for ctx in SPLIT_CONTEXTS:
            spec = bench.Spec(1, ctx, fp8)
            geo = kernels.Geometry(bench.HQ, bench.HKV, bench.D, bench.BS, 16 // (1 if fp8 else 2), True)
            tiles = kernels.decode_tiles(geo, torch.bfloat16, fp8, platform.target_for(device))
            plan = kernels.decode_splits(1, bench.HKV, ctx, kernels.device_multiprocessors(device), tiles["per_sm"],
                                         tiles.get("at_most", False),
                                         tiles.get("split_keys", kernels.MIN_KEYS_PER_SPLIT))
            cells = []
            for splits in (None, *SPLIT_COUNTS):
                ops._CHUNKED_PLANS.clear()
                with contextlib.nullcontext() if splits is None else ops.forced_decode_splits(splits):
                    cells.append(_cell(f"plan {plan}" if splits is None else splits, spec, device, reps, ceiling))
            ops._CHUNKED_PLANS.clear()
            print(f"splits, decode {'fp8' if fp8 else 'bf16'} 1 x {ctx:5d}: " + " | ".join(cells), flush=True)


def plan_launches(spec: bench.Spec, device):
    """(sets, call, decode, combine) of a benchmark case: its rotated input sets (the op's arguments), and Workloads
    of the op, of its plan's decode launch alone and of its combine launch alone (None when the plan does not
    split) over them."""
    sets = bench.input_sets(spec, device)
    ops._CHUNKED_PLANS.clear()
    ops._chunked_kernel(*sets[0])        # the kernel path's plan (what the op runs on a GPU)
    (plan,) = ops._CHUNKED_PLANS.values()
    ops._CHUNKED_PLANS.clear()
    parts = [torch.empty(max(plan.workspace, 1), device=device) for _ in sets]

    def decode(i: int) -> None:       # k_scale stands for the absent output scale, ALiBi slopes and sinks
        query, _, _, output, _, key_cache, value_cache, table, qsl, seq_lens, _, _, k_scale, v_scale = sets[i]
        plan.decode(query, output, key_cache, value_cache, table, qsl, seq_lens, k_scale, v_scale, k_scale,
                    k_scale, k_scale, parts[i])

    def combine(i: int) -> None:
        output, qsl, k_scale = sets[i][3], sets[i][8], sets[i][12]
        plan.combine(output, qsl, k_scale, k_scale, parts[i])

    call = Workload(lambda i: torch_dsv4_ops.chunked_prefill_paged_decode(*sets[i]), len(sets), spec.bytes_per_call())
    return (sets, call, Workload(decode, len(sets), call.nbytes),
            Workload(combine, len(sets), 0) if plan.combine is not None else None)


def wide_split_sweep(device, ceiling: float, reps: int) -> None:
    """1 x 32768 forced to each of WIDE_SPLIT_COUNTS, with MAX_SPLITS 256 and a 256-row combine tile patched in."""
    with patched_constants(kernels, [ops._CHUNKED_PLANS], MAX_SPLITS=256, COMBINE_BLOCKS=(8, 32, 128, 256)):
        for fp8 in (False, True):
            spec = bench.Spec(1, 32768, fp8)
            cells = []
            for splits in WIDE_SPLIT_COUNTS:
                ops._CHUNKED_PLANS.clear()
                with ops.forced_decode_splits(splits):
                    cells.append(_cell(splits, spec, device, reps, ceiling))
            print(f"wide splits, decode {'fp8' if fp8 else 'bf16'} 1 x 32768: " + " | ".join(cells), flush=True)
            with ops.forced_decode_splits(WIDE_SPLIT_COUNTS[-1]):
                times = kernels_alone(spec, device, reps)
            print(f"  {WIDE_SPLIT_COUNTS[-1]} splits, each replayed alone: "
                  + ", ".join(f"{k} {v:.2f} us" for k, v in times.items()), flush=True)


def per_sm_sweep(device, ceiling: float, reps: int) -> None:
    """fp8 decodes of PER_SM_CASES and the fp8 mixed step with FP8_PROGRAMS_PER_SM set to each of PER_SM_COUNTS (the
    plan's one-wave bound on the split count; ptxas gives the benchmark's fp8 decode 208 registers on sm_90 under
    Triton 3.6, so 9 one-warp programs an SM, where the constant says 11)."""
    specs = [bench.Spec(r, c, True) for r, c in PER_SM_CASES] + [bench.Spec(**bench.MIXED, fp8=True)]
    for spec in specs:
        cells = []
        for per_sm in PER_SM_COUNTS:
            with patched_constants(kernels, [ops._CHUNKED_PLANS], FP8_PROGRAMS_PER_SM=per_sm):
                cells.append(_cell(per_sm, spec, device, reps, ceiling))
        print(f"programs an SM, {spec.name}: " + " | ".join(cells), flush=True)


def fp8_register_cap(maxnreg: int):
    """A `decode_constexprs` that also caps the fp8-cache decode's registers at `maxnreg` (Triton's `maxnreg`
    compile option; ptxas of the sm_90 build under Triton 3.6: 208 registers uncapped, 12 bytes of spill stores at
    168 or 160, 108 at 144): for `--maxnreg`, with FP8_PROGRAMS_PER_SM raised to what the cap fits."""
    original = kernels.decode_constexprs

    def decode_constexprs(*args, **kwargs):
        meta = original(*args, **kwargs)
        return dict(meta, maxnreg=maxnreg) if meta["KV_FP8"] != 0 else meta
    return decode_constexprs


def kernels_alone(spec: bench.Spec, device, reps: int) -> dict:
    """Graph-replay us of the call, of its decode kernel alone and of its combine alone (`plan_launches`)."""
    _, call, decode, combine = plan_launches(spec, device)
    times = {"call": time_graph(call, reps), "decode kernel": time_graph(decode, reps)}
    if combine is not None:
        times["combine kernel"] = time_graph(combine, reps)
    ops._CHUNKED_PLANS.clear()
    return times


def plain_read_us(nbytes: int, device, reps: int) -> float:
    """Graph-replay time of `torch.sum` over `nbytes` of fp32, rotated through enough buffers to leave L2."""
    n = rotation_sets(nbytes, device)
    bufs = [torch.rand(nbytes // 4, device=device) for _ in range(n)]
    total = torch.empty((), device=device)
    return time_graph(Workload(lambda i: torch.sum(bufs[i], dim=0, out=total), n, nbytes), reps)


@triton.jit
def _read_parts_kernel(x_ptr, out_ptr, per_program, BLOCK: tl.constexpr):
    """Program p: the sum of x[p * per_program : (p + 1) * per_program] (per_program a multiple of BLOCK)."""
    p = tl.program_id(0)
    base = x_ptr + p.to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, per_program, BLOCK):
        acc += tl.load(base + off + tl.arange(0, BLOCK))
    tl.store(out_ptr + p, tl.sum(acc))


def triton_read_us(nbytes: int, device, reps: int) -> tuple[float, str]:
    """The best graph-replay time of `_read_parts_kernel` over READ_GRIDS reading at least `nbytes` of fp32 (rounded
    up to whole steps), rotated as plain_read_us; and the grid that took it."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    n = rotation_sets(nbytes, device)
    best = None
    for per_sm, block, warps in READ_GRIDS:
        programs = per_sm * sms
        per_program = -(-nbytes // (4 * programs * block)) * block
        bufs = [torch.rand(per_program * programs, device=device) for _ in range(n)]
        out = torch.empty(programs, device=device)
        expect = float(bufs[0].double().sum())
        _read_parts_kernel[(programs,)](bufs[0], out, per_program, BLOCK=block, num_warps=warps)
        if abs(float(out.double().sum()) - expect) > 1e-3 * abs(expect):
            raise RuntimeError("the Triton read's sum is wrong")
        run = lambda i: _read_parts_kernel[(programs,)](bufs[i], out, per_program, BLOCK=block, num_warps=warps)
        us = time_graph(Workload(run, n, per_program * programs * 4), reps)
        if best is None or us < best[0]:
            best = (us, f"{per_sm} programs an SM, {block} elements a step, {warps} warps, "
                        f"{per_program * programs * 4 / 1e6:.1f} MB read")
        del bufs
    return best


@triton.jit
def _read_pages_kernel(x_ptr, table_ptr, out_ptr, pages_per_program, PAGE: tl.constexpr, STEP: tl.constexpr,
                       TABLE: tl.constexpr):
    """Program p: the sum of its pages_per_program pages of PAGE elements, STEP pages a step. TABLE 0: page j of
    the program is page p * pages_per_program + j of x; 1: the page that table[...] names, each step's entries
    loaded in the step (a dependent load before every page); 2: all the program's entries loaded before the loop
    (one dependent load at the start, as the decode's table chunk)."""
    p = tl.program_id(0)
    first = p.to(tl.int64) * pages_per_program
    acc = tl.zeros([STEP, PAGE], tl.float32)
    s = tl.arange(0, STEP)
    e = tl.arange(0, PAGE)
    if TABLE == 2:
        ids = tl.load(table_ptr + first + tl.arange(0, 64), mask=tl.arange(0, 64) < pages_per_program, other=0)
    for j in range(0, pages_per_program, STEP):
        if TABLE == 1:
            page = tl.load(table_ptr + first + j + s).to(tl.int64)
        elif TABLE == 2:
            page = tl.gather(ids, j + s, 0).to(tl.int64)
        else:
            page = first + j + s
        acc += tl.load(x_ptr + page[:, None] * PAGE + e[None, :])
    tl.store(out_ptr + p, tl.sum(tl.sum(acc, 1), 0))


def page_read_sweep(nbytes: int, device, reps: int, ceiling: float) -> None:
    """`_read_pages_kernel` over PAGE_READS, reading at least `nbytes` of fp32 in each shape."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    n = rotation_sets(nbytes, device)
    for programs, page, step, warps, table in PAGE_READS:
        programs = -programs * sms if programs < 0 else programs
        per_program = -(-nbytes // (4 * programs * page * step)) * step
        if table == 2 and per_program > 64:
            continue
        total = per_program * programs * page
        bufs = [torch.rand(total, device=device) for _ in range(n)]
        tables = [torch.randperm(per_program * programs, device=device, dtype=torch.int32) for _ in range(n)]
        out = torch.empty(programs, device=device)

        def run(i: int) -> None:
            _read_pages_kernel[(programs,)](bufs[i], tables[i], out, per_program, PAGE=page, STEP=step, TABLE=table,
                                            num_warps=warps)

        run(0)
        if abs(float(out.double().sum()) - float(bufs[0].double().sum())) > 1e-3 * total:
            raise RuntimeError("the paged read's sum is wrong")
        us = time_graph(Workload(run, n, total * 4), reps)
        print(f"  paged read: {programs} programs of {warps} warps, {per_program} pages of {page * 4} B, {step} a "
              f"step, table {table}: {us:.2f} us = {total * 4 / us / 1e3 / ceiling * 100:.1f} % of read "
              f"({total * 4 / 1e6:.1f} MB)", flush=True)
        del bufs, tables


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
    p.add_argument("--reads-only", action="store_true", help="the single-request decodes and the reads only")
    p.add_argument("--read-shapes", action="store_true", help="only the paged reads of the fp8 1 x 32768 bytes")
    p.add_argument("--per-sm", action="store_true",
                   help="only fp8 decodes of PER_SM_CASES and the fp8 mixed step with FP8_PROGRAMS_PER_SM patched")
    p.add_argument("--maxnreg", type=int, default=None,
                   help="cap the fp8-cache decode's registers (and set FP8_PROGRAMS_PER_SM to what fits) for the run")
    p.add_argument("--wide-splits", action="store_true",
                   help="only 1 x 32768 with MAX_SPLITS 256 (a 256-row combine tile) and WIDE_SPLIT_COUNTS forced")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_attention_parts: needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    ceilings = read_matmul_ceilings(device)
    ceiling = ceilings["read_ceiling"]["gbps"]
    print(f"device {torch.cuda.get_device_name()}, read ceiling {ceiling:.1f} GB/s, bf16 matmul "
          f"{ceilings['matmul_ceiling']['tflops']:.1f} TFLOP/s")
    if not args.maxnreg:
        return run_sections(args, device, ceiling, ceilings)
    per_sm = programs_per_sm(1, args.maxnreg, 0, 90)     # one-warp programs an sm_90 SM, by registers
    print(f"fp8-cache decode capped at {args.maxnreg} registers, FP8_PROGRAMS_PER_SM {per_sm}")
    with patched_constants(kernels, [ops._CHUNKED_PLANS], FP8_PROGRAMS_PER_SM=per_sm,
                           decode_constexprs=fp8_register_cap(args.maxnreg)):
        return run_sections(args, device, ceiling, ceilings)


def run_sections(args, device, ceiling: float, ceilings: dict) -> int:
    """The sections `args` asks for (see the module docstring)."""
    if args.per_sm:
        per_sm_sweep(device, ceiling, args.reps)
        return 0
    if args.wide_splits:
        wide_split_sweep(device, ceiling, args.reps)
        return 0
    if args.read_shapes:
        spec = bench.Spec(1, 32768, True)
        page_read_sweep(spec.decode_ctx * spec.kv_bytes_per_token(), device, args.reps, ceiling)
        return 0
    for fp8 in (False, True):
        kind = "fp8" if fp8 else "bf16"
        points = []
        for ctx in LONG_CONTEXTS:
            spec = bench.Spec(1, ctx, fp8)
            us, check = _time(spec, device, args.reps)
            points.append((ctx, us))
            pct = _pct(spec, us, ceiling)
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
        read, grid = triton_read_us(nbytes, device, args.reps)
        print(f"  a one-wave Triton read of the same bytes: {read:.2f} us = "
              f"{nbytes / read / 1e3 / ceiling * 100:.1f} % of read ({grid})", flush=True)
        times = kernels_alone(bench.Spec(1, 32768, fp8), device, args.reps)
        print("  1 x 32768, each replayed alone: " + ", ".join(f"{k} {v:.2f} us" for k, v in times.items()),
              flush=True)
    if args.reads_only:
        return 0
    split_sweep(device, ceiling, args.reps)
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
