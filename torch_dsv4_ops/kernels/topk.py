"""Triton kernel and launcher for `top_k_per_row_prefill` / `top_k_per_row_decode` (SPEC §3.9).

`topk_per_row_kernel`: grid (num_rows,), one program per row r. The row's candidates are the columns
[lo, hi) of `logits` (prefill: the clamped [ks, ke); decode: [0, clamp(len, 0, N))), L = hi - lo.

* L <= TOPK: the program writes [0, 1, ..., L-1, -1, ..., -1] into topk_indices[r, :TOPK] and reads no logit.
* L > TOPK: every logit becomes an order-preserving uint32 key (NaN -> 1, below -inf; -0.0 -> +0.0; lanes
  outside the range -> 0, never counted). The TOPK-th largest key T is found exactly, then `need` = TOPK -
  #(key > T) keys equal to T are taken, the lowest-indexed ones: a last sweep takes key > T, plus key == T while
  fewer than `need` equal keys precede, and stores column - lo at the output position given by the exclusive
  prefix count of taken keys: exactly TOPK indices, in ascending order.
  - A window of at most BLOCK columns (`_one_tile`, every row when N <= BLOCK) keeps its values in registers,
    as float32 (NaN outside the window): a threshold key t is compared as the value `_key_floor(t)`, so no key is
    formed per lane. The tile is the least of BLOCK, BLOCK / 2, BLOCK / 4 columns that holds the window
    (`_fitted_tile`, HALVINGS), and a window that fills it is loaded without masks. Counts over the whole tile
    (`_narrow`: thresholds stepping down from the largest key by 1, 2, 4, ... binades, then interpolated between
    the counts so far) narrow an interval holding T until at most LIMIT = 2 * TOPK - 1 keys are >= its low end.
    Those keys' positions go, in column order, to the row's own output slots (int16, two per slot) and come back
    with their keys as a short vector, on which `_short_search` finds T (interpolated bounds, and snaps to the
    keys present) and the last sweep runs. Ties that keep more than LIMIT keys >= T send the whole tile through
    the last sweep. COMPACT (NVIDIA, Triton 3.6, rows of aligned vectors): the tile is laid out warp-major and the
    positions are stored by one block of inline PTX per thread (`compact.compact_warp_rows`).
  - A longer window (`_streamed`, compiled only when N > BLOCK: STREAM) runs a radix select over BLOCK-column
    tiles read once per pass, each pass a tl.histogram of the candidates whose higher digits match so far
    (`radix_bits()`: 6 passes of 7 + 5 x 5 bits), carrying the histogram and the prefix counts across tiles.
* The row is read through a window that starts at the ALIGN-aligned column at or below lo (vector loads; the
  load mask is the row end only, the range is applied to the values).

Runtime: N (logits.shape[1]), every stride, next_n and B (seq_lens rows); constexpr: the mode (prefill,
decode with 2-D or 1-D seq_lens), TOPK, the tile sizes, HALVINGS, STREAM, ASM (the stores to computed positions as
inline PTX, `kernels/scatter.py`), WARPS, COMPACT and PDL (SPEC §4 h). No load or store reaches
outside the row's [0, N) columns or the tensors' rows (§4 b); offsets inside a row are int32 (the host checks
that (N - 1) * stride1 fits), row bases int64.
"""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from .. import layout, platform
from ._launch import FastLauncher, launch_options, triton_minor  # noqa: F401  (ops use launch_options)
from .early import pdl_open, pdl_wait
from .compact import LANE_COLUMNS, MAX_ROWS, compact_warp_rows, compaction_available, warp_major_offsets
from .scatter import scatter, use_asm

MODE_PREFILL, MODE_DECODE_2D, MODE_DECODE_1D = 0, 1, 2
MODE_NAMES = {MODE_PREFILL: "prefill", MODE_DECODE_2D: "decode2d", MODE_DECODE_1D: "decode1d"}

TILE_MAX = 16384          # columns held in registers per program; longer windows stream in tiles of this size.
#                           At most 16384: the two 16-bit prefix counts packed in one int32 stay exact
TILE_MIN = 128
OUT_BLOCK_MAX = 1024      # output columns per store step of the L <= TOPK path
ALIGN = 16                # the window of a row starts at a multiple of ALIGN columns (vector loads)
PER_THREAD = 64           # keys per lane of the in-register path: sets the warps of a tile (H100 sweep, NOTES.md)
STREAM_PER_THREAD = 16    # keys per lane of a streamed tile
MAX_WARPS = {"cuda": 32, "hip": 8, "interpreter": 8}
# Register cap of in-register tiles of at most REG_CAP_WARPS warps (NVIDIA): 5 programs per SM instead of 2 (255
# registers). H100, prefill 4096 x 8192 causal / full: 83.3 / 97.3 us at 88, 83.3 / 99.0 at 84, 80.1-80.6 /
# 95.4-95.9 at 92, 83.3 / 100.7 at 96 (NOTES.md "Top-k on float values").
REG_CAP = {"cuda": 92}
# With COMPACT: 4 programs per SM at 128 registers; full / causal prefill rows 85.8 / 82.0 us against 100.1 / 88.8
# at 92 (spills) and 88.7 / 93.1 at 104 (NOTES.md "Top-k: the compaction in PTX")
COMPACT_REG_CAP = {"cuda": 128}
REG_CAP_WARPS = 4
MAX_HALVINGS = 2          # a window of at most a half / a quarter of the tile runs on a tile of that size
INLINE_COMPACTION = True  # COMPACT where the target and Triton version allow it (`compact.py`; 0 for an A/B)
KEY_SIGN = tl.constexpr(0x80000000)
NEG_INF_KEY = tl.constexpr(0x007FFFFF)   # the key of -inf
# tl.histogram's mask argument (recent Triton); without it, lanes outside the candidates count in bin 0 and are
# subtracted there
HIST_MASK = tl.constexpr("mask" in inspect.signature(tl.histogram).parameters)


@triton.jit
def _key_of(x):
    """uint32 keys ordering float32 values: NaN -> 1 (below -inf, whose key is 2**23 - 1), -0.0 -> the key of
    +0.0, negatives -> ~bits, non-negatives -> bits | 2**31."""
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, ~bits, bits | KEY_SIGN)
    key = tl.where(x == 0.0, KEY_SIGN, key)
    return tl.where(x != x, 1, key)


@triton.jit
def _key_floor(t):
    """The least float32 whose key is >= t, for a uint32 key t >= 2: -inf up to the key of -inf, NaN (no value is
    >= NaN) above the key of +inf. So x >= _key_floor(t) <=> key(x) >= t for every value x."""
    bits = tl.where(t >= KEY_SIGN, t ^ KEY_SIGN, ~t)
    return tl.where(t <= NEG_INF_KEY, float("-inf"), bits.to(tl.float32, bitcast=True))


@triton.jit
def _live(j, start, n):
    """j - start in [0, n)."""
    return (j - start).to(tl.uint32) < n.to(tl.uint32)


@triton.jit
def _load_row(row_ptr, j, s1, cols):
    """float32 values of the window's positions j (j < cols: inside the row), masked by j < cols only (uniform over
    aligned runs: vector loads); the window's range is applied by the callers."""
    return tl.load(row_ptr + j * s1, mask=j < cols, other=0.0).to(tl.float32)


@triton.jit
def _load_keys(row_ptr, j, start, n, s1, cols):
    """(uint32 keys, live) of the window's positions j, live where j - start is in [0, n); a lane outside
    [start, start + n) has key 0."""
    x = _load_row(row_ptr, j, s1, cols)
    live = _live(j, start, n)
    return tl.where(live, _key_of(x), 0), live


@triton.jit
def _load_values(row_ptr, j, start, n, s1, cols):
    """float32 values of the window's positions j, NaN outside [start, start + n) (NaN is >= no threshold, so those
    lanes never count)."""
    x = _load_row(row_ptr, j, s1, cols)
    # not `_live`: a common subexpression with a later `_load_keys` would keep a predicate per lane alive between
    return tl.where((j >= start) & (j < start + n), x, float("nan"))


@triton.jit
def _digit_histogram(key, live, prefix, SHIFT: tl.constexpr, WIDTH: tl.constexpr, FIRST: tl.constexpr):
    """Histogram (2**WIDTH bins) of digit (key >> SHIFT) & (2**WIDTH - 1) over the live keys whose bits above
    SHIFT + WIDTH equal `prefix` (all live keys when FIRST). Without HIST_MASK the other lanes count in bin 0."""
    if FIRST:
        cand = live
    else:
        cand = live & ((key >> (SHIFT + WIDTH)) == prefix)
    digit = ((key >> SHIFT) & ((1 << WIDTH) - 1)).to(tl.int32)
    if HIST_MASK:
        return tl.histogram(digit, 1 << WIDTH, mask=cand)
    else:
        return tl.histogram(tl.where(cand, digit, 0), 1 << WIDTH)


@triton.jit
def _radix_step(hist, skipped, total, k, prefix, WIDTH: tl.constexpr):
    """From a digit histogram of `total` candidates (plus `skipped` stray counts in bin 0 without HIST_MASK):
    the digit b holding the k-th largest candidate. Returns (#candidates with digit b, k - #(digit > b),
    (prefix << WIDTH) | b)."""
    bins = tl.arange(0, 1 << WIDTH)
    if not HIST_MASK:
        hist -= tl.where(bins == 0, skipped, 0)
    at_least = total - tl.cumsum(hist, 0) + hist          # candidates with digit >= b
    b = tl.max(tl.where(at_least >= k, bins, 0), 0)
    above = tl.sum(tl.where(bins > b, hist, 0), 0)
    at = tl.sum(tl.where(bins == b, hist, 0), 0)
    return at, k - above, (prefix << WIDTH) | b.to(tl.uint32)


@triton.jit
def _select_store(key, j, live, thr, need, g_run, e_run, out_row, o_s1, TOPK: tl.constexpr, ASM: tl.constexpr):
    """Store j at its output position for the taken lanes of one tile (key > thr, or key == thr among the first
    `need` such keys of the row); g_run / e_run: keys > thr / == thr in earlier tiles. Returns the new counts."""
    greater = live & (key > thr)
    equal = live & (key == thr)
    packed = (greater.to(tl.int32) << 16) | equal.to(tl.int32)     # one scan for both counts (<= 2**14 each)
    before = tl.cumsum(packed, 0) - packed
    e_before = e_run + (before & 0xFFFF)
    g_before = g_run + (before >> 16)
    pos = g_before + tl.minimum(e_before, need)
    take = (greater | (equal & (e_before < need))) & (pos < TOPK)
    scatter(out_row + pos.to(tl.int64) * o_s1, j.to(tl.int32), take, ASM)
    return g_run + tl.sum(greater.to(tl.int32), 0), e_run + tl.sum(equal.to(tl.int32), 0)


@triton.jit
def _drop(d, span):
    """A float distance d below top + 1 as a uint32 in [1, span - 1] (span >= 2 keys in [lo, top])."""
    return tl.minimum(tl.minimum(tl.maximum(d, 1.0), span.to(tl.float32)).to(tl.uint32), span - 1)


@triton.jit
def _narrow(x, top, n, TOPK: tl.constexpr, LIMIT: tl.constexpr, WARPS: tl.constexpr, COMPACT: tl.constexpr):
    """Narrow an interval [lo, top] of uint32 keys holding T, the TOPK-th largest key of the n > TOPK live lanes of
    a register tile of float32 values x (NaN outside the window), by counting over the whole tile, until at most
    LIMIT keys are >= lo > 1 or lo == top. The interval starts at [1, top] (top: the largest key). A window of at
    most LIMIT keys counts once at key 2 (does it hold TOPK keys other than NaN?). Otherwise thresholds step down
    from the top by one binade (2**23 keys), then 2, 4, ... binades, until one holds TOPK keys; from there on each
    count aims, by interpolation, at (TOPK + LIMIT) / 2 keys, with a halving after any count that did not halve
    the interval. Returns (lo, top, #(key >= lo), #(key > top)): uint32, uint32, int32, int32 scalars, and with
    COMPACT (x loaded through `warp_major_offsets`) #(key >= lo) of each warp's columns, [WARPS] int32, valid once
    lo > 1."""
    AIM: tl.constexpr = (TOPK + LIMIT) // 2
    ROWS: tl.constexpr = x.shape[0] // (WARPS * LANE_COLUMNS)
    lo = top * 0 + 1                           # key 0 is never a candidate, so T >= 1
    c_lo = n                                   # #(key >= lo): every live lane
    c_lo_w = tl.zeros([WARPS], tl.int32)
    c_hi = n * 0                               # #(key > top)
    step = top * 0 + (1 << 23)                 # downward from the top, one binade, then doubling
    halve = n < 0
    while (lo < top) & ((c_lo > LIMIT) | (lo == 1)):
        span = top - lo + 1
        if c_lo <= LIMIT:
            mid = lo + 1
        elif step > 0:
            mid = tl.where(step < span, top + 1 - step, lo + span // 2)
        elif halve:
            mid = lo + span // 2
        else:
            mid = top + 1 - _drop((AIM - c_hi).to(tl.float32) / (c_lo - c_hi).to(tl.float32) * span.to(tl.float32),
                                  span)
        counted = (x >= _key_floor(mid)).to(tl.int32)
        if COMPACT:
            c_w = tl.sum(tl.sum(tl.reshape(counted, [WARPS, ROWS, LANE_COLUMNS]), 1), 1)
            c = tl.sum(c_w, 0)
        else:
            c_w = c_lo_w
            c = tl.sum(counted, 0)
        up = c >= TOPK
        lo = tl.where(up, mid, lo)
        c_lo = tl.where(up, c, c_lo)
        c_lo_w = tl.where(up, c_w, c_lo_w)
        top = tl.where(up, top, mid - 1)
        c_hi = tl.where(up, c_hi, c)
        halve = (step == 0) & ~halve & (top - lo + 1 > span // 2)
        step = tl.where(up, 0, tl.where(step < (1 << 31), step * 2, step))    # interpolation once one holds TOPK
    return lo, top, c_lo, c_hi, c_lo_w


@triton.jit
def _min_max(a_lo, a_hi, b_lo, b_hi):
    return tl.minimum(a_lo, b_lo), tl.maximum(a_hi, b_hi)


@triton.jit
def _short_search(x, lo, top, c_lo, c_hi, TOPK: tl.constexpr, LIMIT: tl.constexpr):
    """(T, #(x > T)) for a short vector x of keys holding every key >= lo (at most LIMIT; 0 in unused lanes), T in
    [lo, top] the TOPK-th largest, c_lo = #(x >= lo), c_hi = #(x > top) (uint32 keys, int32 counts).
    A counting pass puts NT bounds around the interpolated position of T (one interval's worth of keys apart) and
    counts x against them in one int32 sum of NT fields (a count <= LIMIT fits FIELD bits): 3 bounds for
    LIMIT < 1024, else 2. A snapping pass moves lo up to the least key >= lo and top down to the greatest key
    <= top (one reduction of both); it ends the search when T is one of them (c_lo == TOPK: the least;
    c_hi == TOPK - 1: the greatest) and follows any counting pass that did not halve the interval (ties)."""
    FIELD: tl.constexpr = LIMIT.bit_length()
    NT: tl.constexpr = 3 if FIELD <= 10 else 2
    MASK: tl.constexpr = (1 << FIELD) - 1
    snap = (c_lo == TOPK) | (c_hi == TOPK - 1)
    while lo < top:
        if snap:
            least, greatest = tl.reduce((tl.where(x >= lo, x, 0xFFFFFFFF), tl.where(x <= top, x, 0)), 0, _min_max)
            lo = tl.where(c_hi == TOPK - 1, greatest, least)
            top = tl.where(c_lo == TOPK, least, greatest)
            snap = False
        else:
            span = top - lo + 1
            end = top + 1
            width = span.to(tl.float32) / (c_lo - c_hi).to(tl.float32)
            drop = ((TOPK - c_hi).to(tl.float32) - 0.5) / (c_lo - c_hi).to(tl.float32) * span.to(tl.float32)
            packed = tl.zeros(x.shape, tl.int32)
            for i in tl.static_range(NT):
                t = end - _drop(drop + (NT // 2 - i) * width, span)
                packed += tl.where(x >= t, 1 << (FIELD * i), 0)
            counts = tl.sum(packed, 0)
            new_lo = lo
            for i in tl.static_range(NT - 1, -1, -1):
                t = end - _drop(drop + (NT // 2 - i) * width, span)
                c = (counts >> (FIELD * i)) & MASK
                first = (c >= TOPK) & (new_lo == lo)       # descending: the highest bound holding TOPK keys ...
                top = tl.where(c >= TOPK, top, t - 1)      # ... and the lowest one short of them
                c_hi = tl.where(c >= TOPK, c_hi, c)
                c_lo = tl.where(first, c, c_lo)
                new_lo = tl.where(first, t, new_lo)
            lo = new_lo
            snap = (top - lo + 1 > span // 2) | (c_lo == TOPK) | (c_hi == TOPK - 1)
    return lo, c_hi


@triton.jit
def _half_slots(out_row, p, o_s1):
    """int16 slot p >= 0 of an output row: two per int32 output slot, whatever the row's stride."""
    out16 = out_row.to(tl.pointer_type(tl.int16))
    if o_s1 == 1:                              # a contiguous row (the stride 1 specialises to a constant)
        ptr = out16 + p
    else:
        q = p.to(tl.uint32)
        ptr = out16 + ((q >> 1).to(tl.int64) * (2 * o_s1) + (q & 1))
    return ptr


@triton.jit
def _one_tile(row, TILE: tl.constexpr, start, n, s1, cols, out_row, o_s1, TOPK: tl.constexpr, CAP: tl.constexpr,
              ASM: tl.constexpr, WARPS: tl.constexpr, COMPACT: tl.constexpr):
    """A window of at most TILE columns (positions j < TILE, candidates j - start in [0, n)), values in registers
    as float32 (NaN outside the window; a threshold key t becomes the value `_key_floor(t)`).

    1. `_narrow` until at most LIMIT = min(2 * TOPK - 1, CAP) keys are >= lo.
    2. Their positions, in column order, go to the row's own output as int16 (2 * TOPK slots; a barrier orders
       the stores before the loads), and come back as a CAP-lane vector with their keys (read again from the row).
       COMPACT: the tile is loaded through `warp_major_offsets` (each warp holds consecutive columns) and
       `compact_warp_rows` stores them (inline PTX); otherwise a `tl.cumsum` of the flags gives each its slot.
    3. `_short_search` finds T on that vector, and the selection (`_select_store`) scans it, not the whole tile.
    When ties leave more than LIMIT keys >= T, T = lo = top and the whole tile is scanned."""
    LIMIT: tl.constexpr = 2 * TOPK - 1 if 2 * TOPK - 1 < CAP else CAP
    if COMPACT:
        ROWS: tl.constexpr = TILE // (WARPS * LANE_COLUMNS)
        offs3 = warp_major_offsets(ROWS, WARPS)
        if (start == 0) & (n == TILE):
            x3 = tl.load(row + offs3 * s1).to(tl.float32)          # the whole tile: no masks
        else:
            x3 = _load_values(row, offs3, start, n, s1, cols)
        x = tl.reshape(x3, [TILE])
        offs = tl.reshape(offs3, [TILE])
    else:
        offs = tl.arange(0, TILE)
        if (start == 0) & (n == TILE):
            x = tl.load(row + offs * s1).to(tl.float32)            # the whole tile: no masks
        else:
            x = _load_values(row, offs, start, n, s1, cols)
    top = _key_of(tl.max(x, 0))                # max ignores NaN lanes (maxnum); all NaN: key 1
    lo, top, c_lo, c_hi, c_lo_w = _narrow(x, top, n, TOPK, LIMIT, WARPS, COMPACT)
    if (c_lo <= LIMIT) & (lo > 1):
        if COMPACT:
            tl.static_assert(o_s1 == 1, "the compaction's int16 slots need a contiguous output row")
            before = tl.cumsum(c_lo_w, 0) - c_lo_w
            base = tl.reshape(tl.broadcast_to(before[:, None, None], [WARPS, ROWS, LANE_COLUMNS]), [TILE])
            compact_warp_rows(x, _key_floor(lo), offs - start, base, out_row.to(tl.pointer_type(tl.int16)), ROWS)
        else:
            flag = (x >= _key_floor(lo)).to(tl.int32)
            pos = tl.cumsum(flag, 0) - flag
            scatter(_half_slots(out_row, pos, o_s1), (offs - start).to(tl.int16), flag != 0, ASM)
        tl.debug_barrier()
        p = tl.arange(0, CAP)
        inside = p < c_lo
        col = tl.load(_half_slots(out_row, p, o_s1), mask=inside, other=0).to(tl.int32)
        key = _load_keys(row, tl.where(inside, col + start, cols), start, n, s1, cols)[0]
        tl.debug_barrier()                     # every slot is read before the selection overwrites it
        thr, above = _short_search(key, lo, top, c_lo, c_hi, TOPK, LIMIT)
        _select_store(key, col, inside, thr, TOPK - above, 0, 0, out_row, o_s1, TOPK, ASM)
    else:
        if COMPACT:
            # the row read again in Triton's own layout: the scan of a tile in the warp-major one goes through
            # shared memory and holds the whole tile in registers twice
            offs = tl.arange(0, TILE)
            x = _load_values(row, offs, start, n, s1, cols)
        live = _live(offs, start, n)           # keys from x: reading the row again would keep its addresses
        _select_store(tl.where(live, _key_of(x), 0), offs - start, live, lo, TOPK - c_hi, 0, 0, out_row, o_s1, TOPK,
                      ASM)


@triton.jit
def _fitted_tile(row, start, n, s1, cols, out_row, o_s1, TOPK: tl.constexpr, CAP: tl.constexpr, ASM: tl.constexpr,
                 BLOCK: tl.constexpr, HALVINGS: tl.constexpr, WARPS: tl.constexpr, COMPACT: tl.constexpr):
    """`_one_tile` over the least of BLOCK, BLOCK / 2, ..., BLOCK / 2**HALVINGS (HALVINGS <= 2) columns that holds
    the window [0, start + n) (start + n <= BLOCK): a short row costs what its length needs."""
    if HALVINGS >= 2:
        if start + n <= BLOCK // 4:
            _one_tile(row, BLOCK // 4, start, n, s1, cols, out_row, o_s1, TOPK, CAP, ASM, WARPS, COMPACT)
        elif start + n <= BLOCK // 2:
            _one_tile(row, BLOCK // 2, start, n, s1, cols, out_row, o_s1, TOPK, CAP, ASM, WARPS, COMPACT)
        else:
            _one_tile(row, BLOCK, start, n, s1, cols, out_row, o_s1, TOPK, CAP, ASM, WARPS, COMPACT)
    elif HALVINGS == 1:
        if start + n <= BLOCK // 2:
            _one_tile(row, BLOCK // 2, start, n, s1, cols, out_row, o_s1, TOPK, CAP, ASM, WARPS, COMPACT)
        else:
            _one_tile(row, BLOCK, start, n, s1, cols, out_row, o_s1, TOPK, CAP, ASM, WARPS, COMPACT)
    else:
        _one_tile(row, BLOCK, start, n, s1, cols, out_row, o_s1, TOPK, CAP, ASM, WARPS, COMPACT)


@triton.jit
def _tiles_histogram(row, offs, start, n, s1, cols, prefix, SHIFT: tl.constexpr, WIDTH: tl.constexpr,
                     FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """_digit_histogram over a window longer than one tile, BLOCK columns at a time."""
    hist = tl.zeros([1 << WIDTH], tl.int32)
    for c0 in range(0, start + n, BLOCK):
        j = c0 + offs
        key, live = _load_keys(row, j, start, n, s1, cols)
        hist += _digit_histogram(key, live, prefix, SHIFT, WIDTH, FIRST)
    return hist


@triton.jit
def _streamed(row, offs, start, n, s1, cols, out_row, o_s1, TOPK: tl.constexpr, BLOCK: tl.constexpr,
              RADIX: tl.constexpr, ASM: tl.constexpr):
    """A longer window: a radix select (32 // RADIX histogram passes) over BLOCK-column tiles read once per pass,
    then one more sweep that stores."""
    PASSES: tl.constexpr = 32 // RADIX
    FIRST: tl.constexpr = 32 - RADIX * (PASSES - 1)
    k = n * 0 + TOPK                           # keys still to take at or below the current prefix
    total = n                                  # candidates: live keys whose digits so far equal the prefix
    prefix = tl.zeros((), tl.uint32)
    padded = tl.cdiv(start + n, BLOCK) * BLOCK
    for p in tl.static_range(PASSES):
        if p == 0:
            hist = _tiles_histogram(row, offs, start, n, s1, cols, prefix, 32 - FIRST, FIRST, True, BLOCK)
            total, k, prefix = _radix_step(hist, padded - total, total, k, prefix, FIRST)
        else:
            hist = _tiles_histogram(row, offs, start, n, s1, cols, prefix, (PASSES - 1 - p) * RADIX, RADIX, False,
                                    BLOCK)
            total, k, prefix = _radix_step(hist, padded - total, total, k, prefix, RADIX)
    g_run = n * 0
    e_run = n * 0
    for c0 in range(0, start + n, BLOCK):
        j = c0 + offs
        key, live = _load_keys(row, j, start, n, s1, cols)
        g_run, e_run = _select_store(key, j - start, live, prefix, k, g_run, e_run, out_row, o_s1, TOPK, ASM)


@triton.jit(do_not_specialize=("n_seq",))
def topk_per_row_kernel(
    logits_ptr, a_ptr, b_ptr, out_ptr, n_cols, l_s0, l_s1, a_s0, a_s1, b_s0, o_s0, o_s1, next_n, n_seq,
    MODE: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr, ALIGN: tl.constexpr,
    RADIX: tl.constexpr, CAP: tl.constexpr, HALVINGS: tl.constexpr, STREAM: tl.constexpr, ASM: tl.constexpr,
    WARPS: tl.constexpr, COMPACT: tl.constexpr, PDL: tl.constexpr,
):
    """Prefill: a = cu_seqlen_ks, b = cu_seqlen_ke. Decode: a = b = seq_lens ([B, next_n] or [B]).
    STREAM: the row is wider than BLOCK, so a window may need the streaming path."""
    r = tl.program_id(0).to(tl.int64)
    pdl_open(PDL, 0)
    pdl_wait(PDL, 0)
    if MODE == 0:
        ks = tl.load(a_ptr + r * a_s0).to(tl.int64)
        ke = tl.load(b_ptr + r * b_s0).to(tl.int64)
        lo = tl.minimum(tl.maximum(ks, 0), n_cols)
        hi = tl.minimum(tl.maximum(ke, lo), n_cols)
    else:
        req = r // next_n
        jj = r - req * next_n
        has = req < n_seq                      # a row past seq_lens' requests has no candidates
        req = tl.where(has, req, 0)
        if MODE == 1:
            ln = tl.load(a_ptr + req * a_s0 + jj * a_s1, mask=has, other=0).to(tl.int64)
        else:
            ln = tl.load(a_ptr + req * a_s0, mask=has, other=0).to(tl.int64) - next_n + jj + 1
        ln = tl.where(has, ln, 0)
        hi = tl.minimum(tl.maximum(ln, 0), n_cols)
        lo = hi * 0
    n = (hi - lo).to(tl.int32)
    out_row = out_ptr + r * o_s0
    if n <= TOPK:
        for c0 in range(0, TOPK, OUT_BLOCK):
            j = c0 + tl.arange(0, OUT_BLOCK)
            tl.store(out_row + j.to(tl.int64) * o_s1, tl.where(j < n, j, -1), mask=j < TOPK)
    else:
        # window position j = column - base; the candidates are positions [start, start + n)
        base = (lo // ALIGN) * ALIGN
        start = (lo - base).to(tl.int32)
        row = logits_ptr + r * l_s0 + base * l_s1
        cols = n_cols - base                   # positions inside the row
        if STREAM:
            if start + n <= BLOCK:
                _fitted_tile(row, start, n, l_s1, cols, out_row, o_s1, TOPK, CAP, ASM, BLOCK, HALVINGS, WARPS,
                             COMPACT)
            else:
                _streamed(row, tl.arange(0, BLOCK), start, n, l_s1, cols, out_row, o_s1, TOPK, BLOCK, RADIX, ASM)
        else:
            _fitted_tile(row, start, n, l_s1, cols, out_row, o_s1, TOPK, CAP, ASM, BLOCK, HALVINGS, WARPS, COMPACT)


LAUNCHER = FastLauncher(topk_per_row_kernel)


# --- host-side planning (shared by the ops and the compile matrix) ----------------------------------------------
def tile_for(n_cols: int) -> int:
    """Columns per tile: the row width rounded up to a power of two, TILE_MIN..TILE_MAX (shape only)."""
    return max(TILE_MIN, min(TILE_MAX, triton.next_power_of_2(max(1, n_cols))))


def radix_bits(version: str = triton.__version__) -> int:
    """Digit width of the streaming path's radix select: 5 bits (6 passes, 128 then 32 bins) on every Triton
    version. Measured on an H100 with Triton 3.6 (benchmarks/NOTES.md "Top-k"): decode 128 x 16384 took 35 us with
    5-bit digits and 1.5 ms with 10-bit ones (3.6 counts with warp ballots, at a cost that grows with the bin
    count). Triton 3.7+ counts with shared-memory atomics, where wider digits could pay; that is not verified on a
    GPU here, so the measured schedule is used everywhere. `version` is kept for the test of this rule."""
    triton_minor(version)
    return 5


def num_warps(target: platform.Target, block: int, stream: bool = False) -> int:
    """About PER_THREAD (STREAM_PER_THREAD where rows may stream) keys per lane, 1..MAX_WARPS[backend] warps (a
    power of two)."""
    warps = max(1, block // ((STREAM_PER_THREAD if stream else PER_THREAD) * target.warp_size))
    return min(MAX_WARPS.get(target.backend, 8), 1 << (warps.bit_length() - 1))


def halvings(block: int, short: int, lanes: int) -> int:
    """How many times a tile of `block` columns may halve (at most MAX_HALVINGS) and still hold the short vector
    (`short` keys) and a key per lane."""
    h = 0
    while h < MAX_HALVINGS and block >> (h + 1) >= max(short, lanes):
        h += 1
    return h


def compact_rows(block: int, warps: int, halvings_: int) -> bool:
    """Whether every tile of the plan (block, block / 2, ... block / 2**halvings_) has 1, 2, 4, 8 or 16 rows of
    `LANE_COLUMNS` per warp: the shapes `compact_warp_rows` has."""
    lane_columns = LANE_COLUMNS.value
    rows = [(block >> h) // (warps * lane_columns) for h in range(halvings_ + 1)]
    return all(1 <= r <= MAX_ROWS and (block >> h) == r * warps * lane_columns for h, r in enumerate(rows))


def constexprs(mode: int, n_cols: int, topk: int, target: platform.Target, aligned: bool = True) -> dict:
    """The kernel's constexprs and launch options. `aligned`: the logits rows are 16-byte aligned vectors (base
    pointer and stride0 multiples of 16 bytes and elements, stride1 == 1, N a multiple of 16) and topk_indices'
    stride1 is 1: the conditions of COMPACT besides the target and Triton version."""
    block = tile_for(n_cols)
    stream = n_cols > block
    warps = num_warps(target, block, stream)
    short = min(2 * triton.next_power_of_2(topk), block)
    halvings_ = halvings(block, short, warps * target.warp_size)
    compact = bool(INLINE_COMPACTION and aligned and use_asm(target) and compaction_available()
                   and target.warp_size == 32 and compact_rows(block, warps, halvings_))
    caps = COMPACT_REG_CAP if compact else REG_CAP
    cap = caps.get(target.backend) if not stream and warps <= REG_CAP_WARPS else None
    return dict(MODE=mode, TOPK=topk, BLOCK=block, OUT_BLOCK=min(OUT_BLOCK_MAX, triton.next_power_of_2(topk)),
                ALIGN=ALIGN, RADIX=radix_bits(), CAP=short, HALVINGS=halvings_, STREAM=stream, ASM=use_asm(target),
                WARPS=warps, COMPACT=compact, PDL=platform.supports_pdl(target), num_warps=warps,
                **({"maxnreg": cap} if cap else {}))


def runtime_args(n_cols: int, stride0: int, stride1: int, a_strides, b_s0: int, out_strides, next_n: int,
                 n_seq: int) -> tuple:
    """The int arguments after the 4 tensors (logits, a, b, topk_indices); a_strides = (a_s0, a_s1)."""
    return (n_cols, stride0, stride1, a_strides[0], a_strides[1], b_s0, out_strides[0], out_strides[1], next_n,
            n_seq)


# --- compile matrix ---------------------------------------------------------------------------------------------
def matrix_launch(target: platform.Target, mode: int, dtype=torch.float32, n_cols: int = 16384,
                  topk: int = layout.INDEX_TOPK):
    """What ops/topk.py passes to topk_per_row_kernel for a contiguous logits [rows, n_cols] of `dtype`, a
    contiguous int32 topk_indices [rows, topk] and (decode) 64 requests with next_n 2."""
    from .matrix import Ptr

    meta = launch_options(constexprs(mode, n_cols, topk, target))
    if mode == MODE_PREFILL:
        ints = runtime_args(n_cols, n_cols, 1, (1, 0), 1, (topk, 1), 1, 0)
    else:
        ints = runtime_args(n_cols, n_cols, 1, (2, 1) if mode == MODE_DECODE_2D else (1, 0), 0, (topk, 1), 2, 64)
    name = f"topk.{MODE_NAMES[mode]}.{str(dtype).split('.')[-1]}.k{topk}.tile{meta['BLOCK']}" + \
        (".stream" if meta["STREAM"] else "")
    return name, (Ptr(dtype), Ptr(torch.int32), Ptr(torch.int32), Ptr(torch.int32)), ints, meta


def matrix_cases(target: platform.Target) -> list:
    """Every tile size (prefill, top-k 512); each mode at the 16384 tile and on rows of 4 tiles (the streaming
    path); top-k 1024 and 2048 at the 16384 and 8192 tiles. Ints are representative (specialised only on == 1 and
    % 16)."""
    from .matrix import dedupe, kernel_case

    def case(launch):
        name, tensors, ints, meta = launch
        return kernel_case(target, name, topk_per_row_kernel, tensors, ints,
                           {k: v for k, v in meta.items() if k != "launch_pdl"})

    cases = []
    tile = TILE_MIN
    while tile <= TILE_MAX:
        cases.append(case(matrix_launch(target, MODE_PREFILL, n_cols=tile)))
        tile *= 2
    for mode in (MODE_PREFILL, MODE_DECODE_2D, MODE_DECODE_1D):
        cases.append(case(matrix_launch(target, mode)))
        cases.append(case(matrix_launch(target, mode, n_cols=4 * TILE_MAX)))
    for topk in (1024, 2048):
        for n_cols in (16384, 8192):
            cases.append(case(matrix_launch(target, MODE_DECODE_1D, n_cols=n_cols, topk=topk)))
    return dedupe(cases)
