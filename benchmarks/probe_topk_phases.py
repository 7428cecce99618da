"""Where a top-k row's time goes (GPU, NVIDIA only): `python -m benchmarks.probe_topk_phases`.

A copy of `kernels/topk.py` with `%clock64` read at the phase boundaries of the in-register path (`_one_tile`) is
loaded as a separate module and launched through Triton's public path on the benchmark's logits (decode 128 x 16384
and prefill 4096 x 8192, top-k 512, full rows). Each program writes its cycle counts after its top-k row, in 5 extra
int32 columns of a wider output; the probe prints their means per phase. Each stamp waits on a value of its phase
(the loads' maximum, the narrowed counts, the short vector's maximum, the threshold, the last sweep's counts), so a
phase's figure includes its stamp's own reduction. A diagnostic, not a benchmark: the figures are SM cycles of
one launch, not graph-replay microseconds.
"""
from __future__ import annotations

import pathlib
import sys
import tempfile

import torch

from torch_dsv4_ops import platform
from torch_dsv4_ops.kernels import topk as kernels

from . import bench_topk
from .ab_variants import load_kernel_source

PHASES = ("load + max", "narrow", "compact + read back", "short search", "last sweep")
STAMPS = len(PHASES)

_HELPERS = '''
@triton.jit
def _clock(dep):
    """%clock64 once `dep` (a scalar) is known."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep.to(tl.int32)], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _stamp(out_row, o_s1, k, t, t0, TOPK: tl.constexpr):
    tl.store(out_row + (TOPK + k) * o_s1, (t - t0).to(tl.int32))


'''

# (line of _one_tile, lines inserted after it); every anchor must occur exactly once
_EDITS = (
    ("    top = _key_of(",
     ["    t1 = _clock(top)"]),
    ("    lo, top, c_lo, c_hi, c_lo_w = _narrow(",
     ["    t2 = _clock(c_lo)"]),
    ("        tl.debug_barrier()                     # every slot is read before the selection overwrites it",
     ["        t3 = _clock(tl.max(key, 0))"]),
    ("        thr, above = _short_search(key, lo, top, c_lo, c_hi, TOPK, LIMIT)",
     ["        t4 = _clock(above)"]),
    ("        _select_store(key, col, inside, thr, TOPK - above, 0, 0, out_row, o_s1, TOPK, ASM)",
     ["        t5 = _clock(_last[0] + _last[1])"] +
     [f"        _stamp(out_row, o_s1, {k}, t{k + 1}, t0, TOPK)" for k in range(STAMPS)]),
)


def stamped_source() -> str:
    """kernels/topk.py with the clock reads and stores (raises if the kernel's text no longer matches)."""
    src = pathlib.Path(kernels.__file__).read_text()
    src = src.replace("@triton.jit\ndef _narrow(", _HELPERS + "@triton.jit\ndef _narrow(", 1)
    head = "    LIMIT: tl.constexpr = 2 * TOPK - 1 if 2 * TOPK - 1 < CAP else CAP\n"
    if src.count(head) != 1:
        raise RuntimeError("probe_topk_phases: _one_tile changed; update the probe's anchors")
    src = src.replace(head, head + "    t0 = _clock(n)\n")
    for anchor, lines in _EDITS:
        line = next((ln for ln in src.splitlines() if ln.startswith(anchor)), None)
        if line is None or src.count(line + "\n") != 1:
            raise RuntimeError(f"probe_topk_phases: no unique line {anchor.strip()!r}; update the probe's anchors")
        stamped = line.replace("_select_store(", "_last = _select_store(", 1)     # its counts time the sweep
        src = src.replace(line + "\n", stamped + "\n" + "".join(x + "\n" for x in lines))
    return src


def load_stamped(directory: str):
    """The stamped copy as module torch_dsv4_ops.kernels._topk_stamped (its relative imports resolve)."""
    return load_kernel_source("_topk_stamped", stamped_source(), directory)


def phase_cycles(module, op: str, rows: int, cols: int, topk: int = 512) -> list:
    """Mean cycles per phase over the rows of one launch (after two warm-up launches)."""
    dev = torch.device("cuda")
    logits = bench_topk.logits_like(rows, cols, dev, 0)
    out = torch.full((rows, topk + STAMPS), -1, dtype=torch.int32, device=dev)
    full = torch.full((rows,), cols, dtype=torch.int32, device=dev)
    if op == "decode":
        mode, a, b, a_strides, b_s0, next_n, n_seq = module.MODE_DECODE_1D, full, full, (1, 0), 1, 1, rows
    else:
        mode, a, b, a_strides, b_s0, next_n, n_seq = module.MODE_PREFILL, torch.zeros_like(full), full, (1, 0), 1, 1, 0
    meta = module.launch_options(module.constexprs(mode, cols, topk, platform.target_for(dev)))
    ints = module.runtime_args(cols, logits.stride(0), logits.stride(1), a_strides, b_s0, out.stride(), next_n, n_seq)
    for _ in range(3):
        module.topk_per_row_kernel[(rows,)](logits, a, b, out, *ints, **meta)
    torch.cuda.synchronize()
    cum = out[:, topk:].double().mean(0).tolist()
    return [c - p for c, p in zip(cum, [0.0] + cum[:-1])]


def main() -> int:
    if not torch.cuda.is_available() or torch.version.hip:
        print("probe_topk_phases: needs an NVIDIA GPU (%clock64)")
        return 1
    with tempfile.TemporaryDirectory() as d:
        module = load_stamped(d)
        for op, rows, cols in (("decode", 128, 16384), ("prefill", 4096, 8192)):
            cycles = phase_cycles(module, op, rows, cols)
            print(f"{op} {rows} x {cols}: mean cycles per phase: "
                  + ", ".join(f"{n} {c:.0f}" for n, c in zip(PHASES, cycles)) + f"; total {sum(cycles):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
