"""`compact_warp_rows`: the top-k tile's compaction (the columns of the values >= a threshold, in column order, to
consecutive int16 slots) as one block of inline PTX per thread, on NVIDIA.

Triton's `tl.cumsum` over a register tile scans each register repetition across lanes (shuffles) and across warps
(shared memory), and holds every partial sum at once; on the 8192-column top-k tile (64 values per lane, 92
registers) that took about 1500 instructions a row, with the flags packed into bits by ptxas for lack of
registers (benchmarks/NOTES.md "Top-k: the compaction in PTX"). Here each warp owns a contiguous run of columns
(`warp_major_offsets`): warp w holds columns [w * R * 128, (w + 1) * R * 128), in R rows of 128 (32 lanes x 4
consecutive columns, one 16-byte load each), so a value's position is

    (values before its warp: the caller's `base`) + (earlier rows of its warp) + (lower lanes, same row)
    + (its own earlier columns, same row),

and inside a warp the counts go through warp shuffles only: the 4-column counts of 4 rows packed in one word (8
bits each: a lane's running count of a row is at most 128), one 5-step shuffle scan per 4 rows, the row totals
from lane 31. About 35 instructions per row of 4 values against about 95.

The register order this relies on (register k of a thread = row k // 4, column 4 * lane + k % 4 of the row) is
the one Triton 3.6 gives the 3-D load [W, R, 128] of 16-byte aligned rows (verified on the H100 by the GPU tests);
`compaction_available` keeps every other case on `tl.cumsum`. The guard is not hypothetical: Triton 3.9 orders
the two dims of equal contiguity the other way (the same load's TTGIR: `warpsPerCTA = [1, 4, 1], order = [2, 1,
0]`), so there the warps would hold interleaved rows, and a [R, W, 128] load would be the warp-major one.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._launch import triton_minor

LANE_COLUMNS = tl.constexpr(128)   # columns of one warp row: 32 lanes x 4
MAX_ROWS = 16                      # rows per warp (64 values per lane)
VERIFIED_TRITON = ("3.6",)         # the register order above was verified on a GPU with these versions


def compaction_available(version: str = triton.__version__) -> bool:
    """Whether the inline-PTX compaction may be used with this Triton version (see the module docstring)."""
    return triton_minor(version) in VERIFIED_TRITON


def compaction_asm(rows: int) -> tuple[str, str]:
    """(PTX, constraints) of `compact_warp_rows` for `rows` rows per warp (pack = 4 * rows values per thread).

    Operands, pack P = 4 * rows: outputs $0..$P-1 (unused zeros); inputs, P each: the int16 slot pointer (u64;
    first, as Triton's broadcast of the operands wants), the values x (f32 bits), the column to store (i32; only the
    first is read: the others are first + 128 * row + column), the threshold (f32 bits), the warp's base slot (i32);
    only the first of each broadcast input is read."""
    assert rows >= 1 and rows & (rows - 1) == 0 and rows <= MAX_ROWS, rows
    p = 4 * rows
    groups = (rows + 3) // 4
    ptr, x, col, thr, base = p, 2 * p, 3 * p, 4 * p, 5 * p
    lines = ["{",
             ".reg .pred %q, %v;",
             f".reg .b32 %f<{p}>, %w<{groups}>, %i<{groups}>, %t<{groups}>, %u<{groups}>, %s, %run, %pos, %c;",
             ".reg .b64 %a;"]
    for k in range(p):                         # -1 where x >= thr (NaN: 0)
        lines.append(f"set.ge.s32.f32 %f{k}, ${x + k}, ${thr};")
    for g in range(groups):                    # the group's 4-column counts, one byte per row (negated)
        for j in range(min(4, rows - 4 * g)):
            a = 4 * (4 * g + j)
            lines += [f"add.s32 %s, %f{a}, %f{a + 1};", f"add.s32 %s, %s, %f{a + 2};", f"add.s32 %s, %s, %f{a + 3};"]
            lines.append(f"mov.b32 %w{g}, %s;" if j == 0 else f"mad.lo.s32 %w{g}, %s, {1 << (8 * j)}, %w{g};")
        lines += [f"neg.s32 %w{g}, %w{g};", f"mov.b32 %i{g}, %w{g};"]
    for d in (1, 2, 4, 8, 16):                 # inclusive scan over the lanes
        for g in range(groups):
            lines.append(f"shfl.sync.up.b32 %u{g}|%v, %i{g}, {d}, 0, -1;")
            lines.append(f"@%v add.s32 %i{g}, %i{g}, %u{g};")
    for g in range(groups):
        lines.append(f"shfl.sync.idx.b32 %t{g}, %i{g}, 31, 31, -1;")    # the rows' warp totals
        lines.append(f"sub.s32 %i{g}, %i{g}, %w{g};")                     # exclusive: lanes below
    lines.append(f"mov.b32 %run, ${base};")
    for a in range(rows):
        g, j = divmod(a, 4)
        lines += [f"bfe.u32 %s, %i{g}, {8 * j}, 8;", "add.s32 %pos, %run, %s;"]
        if a < rows - 1:
            lines += [f"bfe.u32 %s, %t{g}, {8 * j}, 8;", "add.s32 %run, %run, %s;"]
        for e in range(4):
            k = 4 * a + e
            lines += [f"setp.ne.s32 %q, %f{k}, 0;",
                      f"mad.wide.u32 %a, %pos, 2, ${ptr};",
                      f"add.s32 %c, ${col}, {LANE_COLUMNS.value * a + e};",
                      "@%q st.global.b16 [%a], %c;"]
            if e < 3:
                lines.append(f"sub.s32 %pos, %pos, %f{k};")
    lines += [f"mov.b32 ${k}, 0;" for k in range(p)]
    lines.append("}")
    constraints = ",".join(["=r"] * p + ["l"] * p + ["r"] * 4 * p)
    return "\n".join(lines), constraints


_ASM = {rows: compaction_asm(rows) for rows in (1, 2, 4, 8, 16)}
ASM_1, CON_1 = tl.constexpr(_ASM[1][0]), tl.constexpr(_ASM[1][1])
ASM_2, CON_2 = tl.constexpr(_ASM[2][0]), tl.constexpr(_ASM[2][1])
ASM_4, CON_4 = tl.constexpr(_ASM[4][0]), tl.constexpr(_ASM[4][1])
ASM_8, CON_8 = tl.constexpr(_ASM[8][0]), tl.constexpr(_ASM[8][1])
ASM_16, CON_16 = tl.constexpr(_ASM[16][0]), tl.constexpr(_ASM[16][1])


@triton.jit
def warp_major_offsets(ROWS: tl.constexpr, WARPS: tl.constexpr):
    """[WARPS, ROWS, 128] tile positions w * ROWS * 128 + 128 * a + c (row-major: reshaped to 1-D they are
    0, 1, 2, ...). A load through them is laid out with warp w on dim 0 (Triton 3.6 orders the dims of equal
    contiguity by index, after the contiguous one), so warp w holds the positions [w * ROWS * 128,
    (w + 1) * ROWS * 128), and a thread's register k is row k // 4, column 4 * lane + k % 4."""
    w = tl.arange(0, WARPS)[:, None, None]
    a = tl.arange(0, ROWS)[None, :, None]
    c = tl.arange(0, LANE_COLUMNS)[None, None, :]
    return w * (ROWS * LANE_COLUMNS) + a * LANE_COLUMNS + c


@triton.jit
def compact_warp_rows(x, thr, col, base, slots, ROWS: tl.constexpr):
    """Store `col` (int32, < 2**15) to consecutive int16 `slots` for the values x >= thr (float32), in position
    order, on a tile whose positions are `warp_major_offsets(ROWS, WARPS)` reshaped to 1-D (x, col: 1-D, the same
    order). `base` (int32, per value): the slots taken by the warps before the value's own. `col` must be
    first + 128 * row + column of a lane's values, as `warp_major_offsets` gives."""
    zero = tl.zeros(x.shape, tl.int32)
    slots = slots + zero                       # Triton 3.6 broadcasts pointers with ints only: floats go as bits
    x = x.to(tl.int32, bitcast=True)
    thr = thr.to(tl.int32, bitcast=True) + zero
    if ROWS == 1:
        tl.inline_asm_elementwise(ASM_1, CON_1, [slots, x, col, thr, base], dtype=tl.int32, is_pure=False, pack=4)
    elif ROWS == 2:
        tl.inline_asm_elementwise(ASM_2, CON_2, [slots, x, col, thr, base], dtype=tl.int32, is_pure=False, pack=8)
    elif ROWS == 4:
        tl.inline_asm_elementwise(ASM_4, CON_4, [slots, x, col, thr, base], dtype=tl.int32, is_pure=False, pack=16)
    elif ROWS == 8:
        tl.inline_asm_elementwise(ASM_8, CON_8, [slots, x, col, thr, base], dtype=tl.int32, is_pure=False, pack=32)
    else:
        tl.static_assert(ROWS == 16, "compact_warp_rows: 1, 2, 4, 8 or 16 rows per warp")
        tl.inline_asm_elementwise(ASM_16, CON_16, [slots, x, col, thr, base], dtype=tl.int32, is_pure=False,
                                  pack=64)
