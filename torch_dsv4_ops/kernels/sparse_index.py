"""Triton kernels for the sparse index ops (SPEC §3.3).

Every kernel runs one program per output row (combine: up to ROW_PROGRAMS_PER_SM per SM, looping over
rows beyond that) and sweeps the row's columns in tiles of BLOCK contiguous int32 elements (vectorised
loads and stores). Decode rows are latency-bound, so two kernels try a guess first. c128a launches of at
most GUESS_ROWS rows load table row t's first tile beside token_to_req[t] and reload only when the guess
was wrong. combine skips the request search for a row t that is request t's only token over a
non-decreasing query_start_loc. Block-table lookups follow SPEC §0 `lookup` (negative entries, columns past
the width, out-of-range request ids and negative positions give -1); an int32 output is -1 where the int64
value is negative or past INT32_MAX. Power-of-two block sizes and spans (span >= block size) compute
slots in int32 with the int32 limit as a bound on the block id (`_slot_span`); other sizes use the
int64 formula. Token/request counts, strides, table shapes, M, N, widths and num_decode_tokens are
runtime ints; only block sizes, spans, window, top-k, ratio, tile sizes (SEARCH among them: how many
query_start_loc entries one vector holds) and flags are constexpr (§4 h). Every load is masked to its
tensor's extent whatever the index values (§4 b).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layout, platform
from ._launch import FastLauncher, launch_options  # noqa: F401  (ops use kernels.launch_options)
from .attention import device_multiprocessors
from . import early
from .early import TOUCH, pdl_open, pdl_wait, touch

SEARCH = 256              # combine, flashinfer: most query_start_loc entries one vector holds (one round)
MIN_SEARCH = 32           # ... and the fewest (a warp's width)

INT32_MAX = tl.constexpr(layout.INDEX_INT32_MAX)   # usable inside kernels
MAX_BLOCK = 1024          # columns per tile, at most
MIN_BLOCK = 16


def block_for(width: int) -> int:
    """Tile width (power of two, MIN_BLOCK..MAX_BLOCK) for rows of about `width` columns."""
    return max(MIN_BLOCK, min(MAX_BLOCK, triton.next_power_of_2(max(1, width))))


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    pdl_open(PDL, 0)
    pdl_wait(PDL, 0)


@triton.jit
def _touch_row(row_ptr, s1, n, BLOCK: tl.constexpr):
    """`touch` the 32-byte sectors of the first min(n, BLOCK) int32 elements row_ptr[0], row_ptr[s1], ... (each
    sector once where the row is contiguous)."""
    e = tl.arange(0, BLOCK // 8) * 8
    touch(row_ptr + e.to(tl.int64) * s1, e < n)


@triton.jit
def _i32(v):
    """int64 -> int32 output value: -1 where negative or past INT32_MAX."""
    return tl.where((v >= 0) & (v <= INT32_MAX), v, -1).to(tl.int32)


@triton.jit
def _table_row(r, bt_rows, bt_cols):
    """(columns readable, row read) of request id `r` (int64): no columns for an out-of-range request."""
    ok = (r >= 0) & (r < bt_rows)
    return tl.where(ok, bt_cols, 0), tl.where(ok, r, 0)


@triton.jit
def _lookup(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, p, BS: tl.constexpr):
    """SPEC §0 lookup for a scalar request id `r` (int64) and an int64 tensor of positions `p`;
    int64 slots or -1. The table is read only at [0, bt_rows) x [0, bt_cols)."""
    rlim, rr = _table_row(r, bt_rows, bt_cols)
    ok = p >= 0
    pp = tl.where(ok, p, 0)
    col = pp // BS
    ok = ok & (col < rlim)
    blk = tl.load(bt_ptr + rr * bt_s0 + tl.where(ok, col, 0) * bt_s1, mask=ok, other=-1).to(tl.int64)
    ok = ok & (blk >= 0)
    return tl.where(ok, blk * BS + pp % BS, -1)


@triton.jit
def _remap(v, BS: tl.constexpr, SPAN: tl.constexpr):
    if SPAN == BS:
        out = v
    else:
        vv = tl.where(v >= 0, v, 0)
        out = tl.where(v >= 0, (vv // BS) * SPAN + vv % BS, -1)
    return out


# --- int32 slots: power-of-two block sizes and spans, span >= block size --------------------------
@triton.jit
def _slot_span(blk, off, SPAN: tl.constexpr):
    """blk * SPAN + off as int32 for block ids `blk` (a table's dtype) and 0 <= off < SPAN, SPAN a power
    of two: -1 where blk < 0 or the value passes INT32_MAX (the int64 formula's _i32)."""
    if SPAN == 1:
        ok = blk >= 0
    elif blk.dtype == tl.int32:
        ok = blk.to(tl.uint32) < (2**31 // SPAN)
    else:
        ok = (blk >= 0) & (blk < 2**31 // SPAN)
    return tl.where(ok, blk.to(tl.int32) * SPAN + off, -1)


@triton.jit
def _remap_slots(v, BS: tl.constexpr, SPAN: tl.constexpr):
    """_i32(remap(v, BS, SPAN)) of int32 slots v."""
    if (BS & (BS - 1)) == 0 and (SPAN & (SPAN - 1)) == 0 and BS <= SPAN:
        if BS == SPAN:
            out = tl.where(v >= 0, v, -1)
        else:
            vv = tl.maximum(v, 0)
            out = tl.where(v >= 0, _slot_span(vv // BS, vv % BS, SPAN), -1)
    else:
        out = _i32(_remap(v.to(tl.int64), BS, SPAN))
    return out


@triton.jit
def _table_slots(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, p0, q, ok, BS: tl.constexpr, SPAN: tl.constexpr):
    """_i32(remap(lookup(bt, r, p0 + q, BS), BS, SPAN)) where `ok`, else -1: r an int64 request id, p0 an int64
    scalar >= 0 (or the literal 0), q int32 offsets. Power-of-two BS <= SPAN take int32 math on positions
    relative to p0's table column; other sizes the int64 formula."""
    if (BS & (BS - 1)) == 0 and (SPAN & (SPAN - 1)) == 0 and BS <= SPAN:
        rlim, rr = _table_row(r, bt_rows, bt_cols)
        col0 = p0 // BS
        p = (tl.cast(p0 % BS, tl.int32) + q).to(tl.uint32)     # a negative position: a column past any table
        col = p // BS
        ok = ok & (col < tl.minimum(tl.maximum(rlim - col0, 0), INT32_MAX).to(tl.uint32))
        blk = tl.load(bt_ptr + rr * bt_s0 + (col0 + col.to(tl.int64)) * bt_s1, mask=ok, other=-1)
        out = _slot_span(blk, (p % BS).to(tl.int32), SPAN)
    else:
        s = _lookup(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, tl.where(ok, p0 + q.to(tl.int64), -1), BS)
        out = _i32(_remap(s, BS, SPAN))
    return out


@triton.jit
def _table_slots_few(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, p0, q, ok, BS: tl.constexpr, SPAN: tl.constexpr,
                     NE: tl.constexpr):
    """_table_slots for offsets q within [0, (NE - 1) * BS]: NE scalar table loads and per-column selects
    instead of one gather per column. Power-of-two BS <= SPAN only."""
    rlim, rr = _table_row(r, bt_rows, bt_cols)
    col0 = p0 // BS
    lim = tl.minimum(tl.maximum(rlim - col0, 0), INT32_MAX).to(tl.int32)
    p = (tl.cast(p0 % BS, tl.int32) + q).to(tl.uint32)
    col = p // BS
    base = bt_ptr + rr * bt_s0 + col0 * bt_s1
    blk = tl.load(base, mask=lim > 0, other=-1)
    for k in tl.static_range(1, NE):
        e = tl.load(base + k * bt_s1, mask=lim > k, other=-1)
        blk = tl.where(col == k, e, blk)
    return tl.where(ok, _slot_span(blk, (p % BS).to(tl.int32), SPAN), -1)     # past the width: blk = -1


# --- compute_global_topk_indices_and_lens -------------------------------------------------------
@triton.jit
def _global_tile(v, c, K, bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, g_row, g_s1, BS: tl.constexpr):
    m = c < K
    g = _table_slots(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, 0, v, m, BS, BS)
    tl.store(g_row + c.to(tl.int64) * g_s1, g, mask=m)
    return (g >= 0).to(tl.int32)


@triton.jit
def global_topk_kernel(
    topk_ptr, t2r_ptr, bt_ptr, valid_ptr, g_ptr, lens_ptr,
    K, topk_s0, topk_s1, t2r_s, bt_rows, bt_cols, bt_s0, bt_s1, valid_s, g_s0, g_s1, lens_s,
    BS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    row = topk_ptr + t * topk_s0
    _pdl_start(PDL)
    # every load that needs no other load first: the request, the flag, the first tile of indices
    r = tl.load(t2r_ptr + t * t2r_s).to(tl.int64)
    valid = tl.load(valid_ptr + t * valid_s)
    v = tl.load(row + cols.to(tl.int64) * topk_s1, mask=cols < K, other=-1)
    g_row = g_ptr + t * g_s0
    count = _global_tile(v, cols, K, bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, g_row, g_s1, BS)
    for c0 in range(BLOCK, K, BLOCK):
        c = c0 + cols
        v = tl.load(row + c.to(tl.int64) * topk_s1, mask=c < K, other=-1)
        count += _global_tile(v, c, K, bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, g_row, g_s1, BS)
    n = tl.sum(count, axis=0)
    tl.store(lens_ptr + t * lens_s, tl.where(valid != 0, n, 0))


# --- combine_topk_swa_indices -------------------------------------------------------------------
@triton.jit
def _pick(vec, ks, k):
    """vec[k] of a vector held in registers (k a scalar index into it; 0 where no ks equals k)."""
    return tl.sum(tl.where(ks == k, vec, 0), axis=0)


@triton.jit
def _narrow_like(x, like):
    """An int64 scalar x (at least the minimum of like's dtype) as like's dtype, clamped to its maximum:
    `like <= x` keeps its truth."""
    if like.dtype == tl.int32:
        out = tl.minimum(x, INT32_MAX).to(tl.int32)
    else:
        out = x
    return out


@triton.jit
def _request_vectors(qsl_ptr, seq_ptr, gl_ptr, Rc, qsl_s, seq_s, gl_s, SEARCH: tl.constexpr):
    """qsl[0], and qsl[k], qsl[k + 1], seq_lens[k], gather_lens[k] for k < Rc <= SEARCH (0 past Rc)."""
    ks = tl.arange(0, SEARCH)
    m = ks < Rc
    base = tl.load(qsl_ptr)
    a0 = tl.load(qsl_ptr + ks * qsl_s, mask=m, other=0)
    a1 = tl.load(qsl_ptr + (ks + 1) * qsl_s, mask=m, other=0)
    seqv = tl.load(seq_ptr + ks * seq_s, mask=m, other=0)
    glv = tl.load(gl_ptr + ks * gl_s, mask=m, other=0)
    return base, a0, a1, seqv, glv


@triton.jit
def _request_pick(t, Rc, base, a0, a1, seqv, glv, SEARCH: tl.constexpr):
    """(b, qs, qe, seq, gl) of row t, int64, from _request_vectors: b is the last request with
    qs <= t < qe (the reference's last write), -1 when none covers t. Compared in the inputs' dtype."""
    ks = tl.arange(0, SEARCH)
    thr = _narrow_like(t + base.to(tl.int64), a0)      # qsl[k] - base <= t  <=>  qsl[k] <= thr
    b = tl.max(tl.where((ks < Rc) & (a0 <= thr) & (a1 > thr), ks, -1), axis=0)
    qs = _pick(a0, ks, b).to(tl.int64) - base
    qe = _pick(a1, ks, b).to(tl.int64) - base
    return b.to(tl.int64), qs, qe, _pick(seqv, ks, b).to(tl.int64), _pick(glv, ks, b).to(tl.int64)


@triton.jit
def _request_guess_or_pick(t, Rc, base, a0, a1, seqv, glv, qsl_ptr, seq_ptr, gl_ptr, qsl_s, seq_s, gl_s,
                           SEARCH: tl.constexpr):
    """_request_pick, without the search where row t is request t's only token (a decode batch) and
    query_start_loc is non-decreasing (then no later request covers t): request t's entries load as scalars
    beside the vectors, and the check costs one comparison per vector entry."""
    g_ok = t < Rc
    b64 = base.to(tl.int64)
    g_qs = tl.load(qsl_ptr + t * qsl_s, mask=g_ok, other=0).to(tl.int64) - b64
    g_qe = tl.load(qsl_ptr + (t + 1) * qsl_s, mask=g_ok, other=0).to(tl.int64) - b64
    g_seq = tl.load(seq_ptr + t * seq_s, mask=g_ok, other=0).to(tl.int64)
    g_gl = tl.load(gl_ptr + t * gl_s, mask=g_ok, other=0).to(tl.int64)
    fast = g_ok & (g_qs == t) & (g_qe == t + 1)
    if fast:
        fast = tl.min((a0 <= a1).to(tl.int32), axis=0) > 0      # entries past Rc are 0 <= 0
    if fast:
        b, qs, qe, seq, gl = t, g_qs, g_qe, g_seq, g_gl
    else:
        b, qs, qe, seq, gl = _request_pick(t, Rc, base, a0, a1, seqv, glv, SEARCH)
    return b, qs, qe, seq, gl


@triton.jit
def _request_two_rounds(t, qsl_ptr, seq_ptr, gl_ptr, Rc, seg, qsl_s, seq_s, gl_s, SEARCH: tl.constexpr):
    """(b, qs, qe, seq, gl) of row t for any Rc (qsl non-decreasing): pivots qsl[k*seg] pick a segment of
    seg entries, a count inside it gives b; b is -1 when t lies outside [qs, qe)."""
    ks = tl.arange(0, SEARCH)
    base = tl.load(qsl_ptr).to(tl.int64)
    piv = tl.load(qsl_ptr + ks.to(tl.int64) * seg * qsl_s, mask=ks * seg < Rc, other=0).to(tl.int64) - base
    lo = (tl.maximum(tl.sum(((piv <= t) & (ks * seg < Rc)).to(tl.int32), axis=0) - 1, 0)).to(tl.int64) * seg
    hi = tl.minimum(lo + seg, Rc)
    n_le = lo * 0
    for k0 in range(0, seg, SEARCH):
        k = lo + k0 + ks
        a = tl.load(qsl_ptr + k * qsl_s, mask=k < hi, other=0).to(tl.int64) - base
        n_le += tl.sum(((a <= t) & (k < hi)).to(tl.int32), axis=0)
    b = tl.maximum(lo + n_le - 1, 0)
    qs = tl.load(qsl_ptr + b * qsl_s).to(tl.int64) - base
    qe = tl.load(qsl_ptr + (b + 1) * qsl_s).to(tl.int64) - base
    seq = tl.load(seq_ptr + b * seq_s).to(tl.int64)
    gl = tl.load(gl_ptr + b * gl_s).to(tl.int64)
    return tl.where((t >= qs) & (t < qe), b, -1), qs, qe, seq, gl


@triton.jit
def _clamp32(x, hi):
    """An int64 column bound clamped to [0, hi] as int32."""
    return tl.minimum(tl.maximum(x, 0), hi).to(tl.int32)


@triton.jit
def _swa_cols(c, swa_lo, swa_n, swa_base):
    """The SWA value of columns c (int32): swa_base + c on [swa_lo, swa_lo + swa_n), else -1."""
    return tl.where((c - swa_lo).to(tl.uint32) < swa_n, swa_base + c, -1)


@triton.jit
def _combine_row(t, loc, b, qs, qe, seq, gl, topk_ptr, out_ptr, lens_ptr, M, N, width, topk_s0, topk_s1, out_s0,
                 out_s1, lens_s, WINDOW: tl.constexpr, RATIO: tl.constexpr, TOPK: tl.constexpr,
                 WRITE_UNCOVERED: tl.constexpr, BLOCK: tl.constexpr, SWA_BLOCK: tl.constexpr):
    """Row t of request b (-1: uncovered), `loc` its first tile of top-k indices."""
    cols = tl.arange(0, BLOCK)
    top_row = topk_ptr + t * topk_s0
    out_row = out_ptr + t * out_s0
    pos = seq - (qe - qs) + (t - qs)
    live = pos >= 0
    tk = tl.where(live, tl.minimum(tl.maximum(pos + 1, 0) // RATIO, TOPK), 0)
    sw = tl.where(live, tl.minimum(pos + 1, WINDOW), 0)
    # SPEC: column c < tk holds M*b + l for 0 <= l < N; column tk + i (i < sw) holds M*b + N + w,
    # w = pos - sw + 1 + i - (seq - gl), for w >= 0 and N + w < M; -1 elsewhere and wherever the value
    # is negative or past INT32_MAX. As int32 column/index limits of this row:
    mb = M * b
    top_lo = _clamp32(-mb, INT32_MAX)
    top_n = tl.maximum(_clamp32(tl.minimum(N, INT32_MAX - mb + 1), INT32_MAX) - top_lo, 0).to(tl.uint32)
    w0 = pos - sw + 1 - tk - (seq - gl)            # w of column c is w0 + c
    swa_base = mb + N + w0                          # the value of column c is swa_base + c
    swa_lo = _clamp32(tl.maximum(tl.maximum(-w0, -swa_base), tk), width)
    swa_hi = _clamp32(tl.minimum(tl.minimum(tk + sw, M - N - w0), INT32_MAX - swa_base + 1), width)
    swa_n = tl.maximum(swa_hi - swa_lo, 0).to(tl.uint32)
    top_base = mb.to(tl.int32)                      # wraps only where no column uses it
    swa_base = swa_base.to(tl.int32)
    tk32 = tk.to(tl.int32)
    if b >= 0:
        # columns [0, mixed_end): top-k where c < tk, else SWA; then SWA or -1 up to the row width
        mixed_end = 0
        if TOPK > 0:
            mixed_end = tl.maximum(tl.cdiv(tk32, BLOCK), 1) * BLOCK
            for c0 in range(0, mixed_end, BLOCK):
                c = c0 + cols
                if c0 > 0:
                    loc = tl.load(top_row + c.to(tl.int64) * topk_s1, mask=c < TOPK, other=-1)
                top = tl.where((loc - top_lo).to(tl.uint32) < top_n, top_base + loc, -1)
                val = tl.where(c < tk32, top, _swa_cols(c, swa_lo, swa_n, swa_base))
                if TOPK % BLOCK == 0:
                    tl.store(out_row + c.to(tl.int64) * out_s1, val)
                else:
                    tl.store(out_row + c.to(tl.int64) * out_s1, val, mask=c < width)
        sc = tl.arange(0, SWA_BLOCK)
        for c0 in range(mixed_end, width, SWA_BLOCK):
            c = c0 + sc
            tl.store(out_row + c.to(tl.int64) * out_s1, _swa_cols(c, swa_lo, swa_n, swa_base), mask=c < width)
        tl.store(lens_ptr + t * lens_s, (tk + sw).to(tl.int32))
    else:
        if WRITE_UNCOVERED:
            sc = tl.arange(0, SWA_BLOCK)
            for c0 in range(0, width, SWA_BLOCK):
                c = c0 + sc
                tl.store(out_row + c.to(tl.int64) * out_s1, tl.full((SWA_BLOCK,), -1, tl.int32), mask=c < width)
            tl.store(lens_ptr + t * lens_s, 0)


@triton.jit
def combine_kernel(
    topk_ptr, qsl_ptr, seq_ptr, gl_ptr, out_ptr, lens_ptr,
    T, Rc, seg, M, N, width, topk_s0, topk_s1, qsl_s, seq_s, gl_s, out_s0, out_s1, lens_s,
    WINDOW: tl.constexpr, RATIO: tl.constexpr, TOPK: tl.constexpr, WRITE_UNCOVERED: tl.constexpr,
    BLOCK: tl.constexpr, SWA_BLOCK: tl.constexpr, SEARCH: tl.constexpr, ONE_ROUND: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):
    # rows pid, pid + G, ... (G programs): the next row's first tile of top-k indices loads before this
    # row's stores; with Rc <= SEARCH the request vectors load once per program
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    pdl_open(PDL, EARLY)
    if PDL and EARLY & TOUCH:       # the first row's top-k tile and the request vectors
        if TOPK > 0:
            _touch_row(topk_ptr + pid.to(tl.int64) * topk_s0, topk_s1, TOPK, BLOCK)
        if ONE_ROUND:
            _touch_row(qsl_ptr, qsl_s, Rc + 1, SEARCH)
            _touch_row(seq_ptr, seq_s, Rc, SEARCH)
            _touch_row(gl_ptr, gl_s, Rc, SEARCH)
    pdl_wait(PDL, EARLY)
    if ONE_ROUND:
        base, a0, a1, seqv, glv = _request_vectors(qsl_ptr, seq_ptr, gl_ptr, Rc, qsl_s, seq_s, gl_s, SEARCH)
    loc = cols * 0 - 1
    if TOPK > 0:
        loc = tl.load(topk_ptr + pid.to(tl.int64) * topk_s0 + cols.to(tl.int64) * topk_s1, mask=cols < TOPK,
                      other=-1)
    for t0 in range(pid, T, G):
        t = tl.cast(t0, tl.int64)
        if TOPK > 0:
            loc_next = loc
            if t + G < T:
                loc_next = tl.load(topk_ptr + (t + G) * topk_s0 + cols.to(tl.int64) * topk_s1, mask=cols < TOPK,
                                   other=-1)
        if ONE_ROUND:
            b, qs, qe, seq, gl = _request_guess_or_pick(t, Rc, base, a0, a1, seqv, glv, qsl_ptr, seq_ptr, gl_ptr,
                                                        qsl_s, seq_s, gl_s, SEARCH)
        else:
            b, qs, qe, seq, gl = _request_two_rounds(t, qsl_ptr, seq_ptr, gl_ptr, Rc, seg, qsl_s, seq_s, gl_s,
                                                     SEARCH)
        _combine_row(t, loc, b, qs, qe, seq, gl, topk_ptr, out_ptr, lens_ptr, M, N, width, topk_s0, topk_s1, out_s0,
                     out_s1, lens_s, WINDOW, RATIO, TOPK, WRITE_UNCOVERED, BLOCK, SWA_BLOCK)
        if TOPK > 0:
            loc = loc_next


# --- build_flashinfer_mixed_sparse_indices ------------------------------------------------------
@triton.jit
def _fi_decode_slots(v, j, Kd, cbt_ptr, cbt_rows, cbt_cols, cbt_s0, cbt_s1, r, CBS: tl.constexpr,
                     CSPAN: tl.constexpr, LOCAL: tl.constexpr):
    """A decode row's compressed slots at columns j of its indices v."""
    if LOCAL:
        o = _table_slots(cbt_ptr, cbt_rows, cbt_cols, cbt_s0, cbt_s1, r, 0, v, j < Kd, CBS, CSPAN)
    else:
        o = tl.where(j < Kd, _remap_slots(v, CBS, CSPAN), -1)
    return o


@triton.jit
def _fi_decode_comp(v, j, Kd, P, row, Wswa, out_s1, cbt_ptr, cbt_rows, cbt_cols, cbt_s0, cbt_s1, r,
                    CBS: tl.constexpr, CSPAN: tl.constexpr, LOCAL: tl.constexpr):
    o = _fi_decode_slots(v, j, Kd, cbt_ptr, cbt_rows, cbt_cols, cbt_s0, cbt_s1, r, CBS, CSPAN, LOCAL)
    tl.store(row + (Wswa + j).to(tl.int64) * out_s1, o, mask=j < P)
    return (o >= 0).to(tl.int32)


@triton.jit
def _fi_prefill_comp(loc, j, kk, P, row, Wswa, out_s1, cbt_ptr, cbt_rows, cbt_cols, cbt_s0, cbt_s1, r,
                     CBS: tl.constexpr, CSPAN: tl.constexpr):
    s = _table_slots(cbt_ptr, cbt_rows, cbt_cols, cbt_s0, cbt_s1, r, 0, loc, j < kk, CBS, CSPAN)
    tl.store(row + (Wswa + j).to(tl.int64) * out_s1, s, mask=j < P)


@triton.jit
def flashinfer_kernel(
    dswa_ptr, dcomp_ptr, dlens_ptr, ptopk_ptr, qsl_ptr, seq_ptr, t2r_ptr, sbt_ptr, cbt_ptr, dvalid_ptr,
    out_ptr, lens_ptr,
    Td, Wswa, Kd, Kp, P, R,
    dswa_s0, dswa_s1, dcomp_s0, dcomp_s1, dlens_s, ptopk_s0, ptopk_s1, qsl_s, seq_s, t2r_s,
    sbt_rows, sbt_cols, sbt_s0, sbt_s1, cbt_rows, cbt_cols, cbt_s0, cbt_s1, dvalid_s, out_s0, out_s1, lens_s,
    SBS: tl.constexpr, SSPAN: tl.constexpr, CBS: tl.constexpr, CSPAN: tl.constexpr,
    WINDOW: tl.constexpr, RATIO: tl.constexpr, TOPK: tl.constexpr, LOCAL: tl.constexpr,
    HAS_DLENS: tl.constexpr, HAS_DVALID: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_P: tl.constexpr, SEARCH: tl.constexpr, ONE_ROUND: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cw = tl.arange(0, BLOCK_W)
    cp = tl.arange(0, BLOCK_P)
    is_dec = t < Td
    tp = tl.where(is_dec, 0, t - Td)
    td = tl.where(is_dec, t, 0)
    dswa_row = dswa_ptr + td * dswa_s0
    dcomp_row = dcomp_ptr + td * dcomp_s0
    ptopk_row = ptopk_ptr + tp * ptopk_s0
    # masks as tensors (interpreter): the decode inputs of a decode row, the prefill ones otherwise
    n_wswa = tl.where(is_dec, Wswa, 0)
    n_kd = tl.where(is_dec, Kd, 0)
    n_kp = tl.where(is_dec, 0, Kp)
    pdl_open(PDL, EARLY)
    if PDL and EARLY & TOUCH:       # the row's request id, the first tile of each index row, the request vectors
        touch(t2r_ptr + t * t2r_s, t >= 0)
        _touch_row(dswa_row, dswa_s1, n_wswa, BLOCK_W)
        _touch_row(dcomp_row, dcomp_s1, n_kd, BLOCK_P)
        _touch_row(ptopk_row, ptopk_s1, n_kp, BLOCK_P)
        if ONE_ROUND:
            _touch_row(qsl_ptr, qsl_s, tl.where(is_dec, 0, R + 1), SEARCH)
            _touch_row(seq_ptr, seq_s, tl.where(is_dec, 0, R), SEARCH)
    pdl_wait(PDL, EARLY)
    # the loads that need no other load: the request and the first tile of each index row
    r = tl.load(t2r_ptr + t * t2r_s).to(tl.int64)
    vw = tl.load(dswa_row + cw.to(tl.int64) * dswa_s1, mask=cw < n_wswa, other=-1)
    vp = tl.load(dcomp_row + cp.to(tl.int64) * dcomp_s1, mask=cp < n_kd, other=-1)
    loc = tl.load(ptopk_row + cp.to(tl.int64) * ptopk_s1, mask=cp < n_kp, other=-1)
    if HAS_DVALID:
        dvalid = tl.load(dvalid_ptr + td * dvalid_s, mask=is_dec, other=0)
    if HAS_DLENS:
        dlens = tl.load(dlens_ptr + td * dlens_s, mask=is_dec, other=0)
    if ONE_ROUND:                       # all of query_start_loc and seq_lens (R < SEARCH) for a prefill row
        ks = tl.arange(0, SEARCH)
        n_r = tl.where(is_dec, -1, R)
        qslv = tl.load(qsl_ptr + ks * qsl_s, mask=ks <= n_r, other=0)
        seqv = tl.load(seq_ptr + ks * seq_s, mask=ks < n_r, other=0)
    row = out_ptr + t * out_s0
    if is_dec:
        # the first compressed tile's table loads before any store
        o = _fi_decode_slots(vp, cp, Kd, cbt_ptr, cbt_rows, cbt_cols, cbt_s0, cbt_s1, r, CBS, CSPAN, LOCAL)
        tl.store(row + cw.to(tl.int64) * out_s1, _remap_slots(vw, SBS, SSPAN), mask=cw < Wswa)
        tl.store(row + (Wswa + cp).to(tl.int64) * out_s1, o, mask=cp < P)
        count = (o >= 0).to(tl.int32)
        for c0 in range(BLOCK_W, Wswa, BLOCK_W):
            c = c0 + cw
            v = tl.load(dswa_row + c.to(tl.int64) * dswa_s1, mask=c < Wswa, other=-1)
            tl.store(row + c.to(tl.int64) * out_s1, _remap_slots(v, SBS, SSPAN), mask=c < Wswa)
        for j0 in range(BLOCK_P, P, BLOCK_P):
            j = j0 + cp
            v = tl.load(dcomp_row + j.to(tl.int64) * dcomp_s1, mask=j < Kd, other=-1)
            count += _fi_decode_comp(v, j, Kd, P, row, Wswa, out_s1, cbt_ptr, cbt_rows, cbt_cols, cbt_s0, cbt_s1,
                                     r, CBS, CSPAN, LOCAL)
        if LOCAL:
            n = tl.sum(count, axis=0)
            if HAS_DVALID:
                n = tl.where(dvalid != 0, n, 0)
        else:
            if HAS_DLENS:
                n = dlens.to(tl.int32)
            else:
                n = (r * 0 + Kd).to(tl.int32)
        n = tl.where(Kd > 0, n, 0)
        tl.store(lens_ptr + t * lens_s, Wswa + n)
    else:
        # the first tiles' loads before their stores (a load after a store waits for it): the compressed part's
        # table entries first, as they need only r and the preloaded indices (loaded over the whole top-k width
        # so that they need not wait for the row's kk, and cut at kk after), then the window's few entries where
        # they load as scalars (they need the row's position; wider windows load theirs after the stores)
        comp = _table_slots(cbt_ptr, cbt_rows, cbt_cols, cbt_s0, cbt_s1, r, 0, loc, cp < n_kp, CBS, CSPAN)
        rok = (r >= 0) & (r < R)
        pos = r * 0 - 1                 # an out-of-range request: no window, no top-k
        if ONE_ROUND:                   # picked from the preloaded vectors: no load waits for r
            rk = tl.where(rok, r, -2).to(tl.int32)
            qs = _pick(qslv, ks, rk).to(tl.int64)
            qe = _pick(qslv, ks, rk + 1).to(tl.int64)
            seq = _pick(seqv, ks, rk).to(tl.int64)
            pos = tl.where(rok, seq - (qe - qs) + (t - qs), pos)
        elif rok:
            qs = tl.load(qsl_ptr + r * qsl_s).to(tl.int64)
            qe = tl.load(qsl_ptr + (r + 1) * qsl_s).to(tl.int64)
            seq = tl.load(seq_ptr + r * seq_s).to(tl.int64)
            pos = seq - (qe - qs) + (t - qs)
        sw = tl.minimum(tl.maximum(pos + 1, 0), WINDOW)
        s0 = tl.maximum(pos - sw + 1, 0)             # the window's first position (any value when sw = 0)
        tk = tl.minimum(tl.maximum(pos + 1, 0) // RATIO, TOPK)
        kk = tl.minimum(tk, Kp).to(tl.int32)
        sw32 = sw.to(tl.int32)
        first = 0
        if (SBS & (SBS - 1)) == 0 and (SSPAN & (SSPAN - 1)) == 0 and SBS <= SSPAN and BLOCK_W <= 4 * SBS \
                and WINDOW <= BLOCK_W:      # the window's few table entries as scalar loads
            s = _table_slots_few(sbt_ptr, sbt_rows, sbt_cols, sbt_s0, sbt_s1, r, s0, cw, cw < sw32, SBS, SSPAN,
                                 BLOCK_W // SBS + 1)
            tl.store(row + cw.to(tl.int64) * out_s1, s, mask=cw < Wswa)
            first = BLOCK_W
        tl.store(row + (Wswa + cp).to(tl.int64) * out_s1, tl.where(cp < kk, comp, -1), mask=cp < P)
        for j0 in range(BLOCK_P, P, BLOCK_P):
            j = j0 + cp
            lj = tl.load(ptopk_row + j.to(tl.int64) * ptopk_s1, mask=j < kk, other=-1)
            _fi_prefill_comp(lj, j, kk, P, row, Wswa, out_s1, cbt_ptr, cbt_rows, cbt_cols, cbt_s0, cbt_s1, r,
                             CBS, CSPAN)
        for c0 in range(first, Wswa, BLOCK_W):
            c = c0 + cw
            s = _table_slots(sbt_ptr, sbt_rows, sbt_cols, sbt_s0, sbt_s1, r, s0, c, c < sw32, SBS, SSPAN)
            tl.store(row + c.to(tl.int64) * out_s1, s, mask=c < Wswa)
        tl.store(lens_ptr + t * lens_s, (Wswa + tk).to(tl.int32))


# --- build_c128a_topk_metadata ------------------------------------------------------------------
@triton.jit
def _lookup_run(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, c0, n, BLOCK: tl.constexpr, BS: tl.constexpr):
    """_i32(lookup) of positions j = c0 .. c0 + BLOCK - 1 (valid below n; int32) for a scalar request id `r`,
    as a [BLOCK // BS, BS] tile (j row-major) with one table entry per tile row: contiguous table loads where
    the per-position lookup gathers. BS a power of two <= BLOCK, c0 a multiple of BLOCK."""
    NB: tl.constexpr = BLOCK // BS
    rlim, rr = _table_row(r, bt_rows, bt_cols)
    col = c0 // BS + tl.arange(0, NB)
    k = tl.arange(0, BS)
    j = col[:, None] * BS + k[None, :]
    row_ok = (col < tl.minimum(rlim, INT32_MAX).to(tl.int32)) & (col * BS < n)
    blk = tl.load(bt_ptr + rr * bt_s0 + col.to(tl.int64) * bt_s1, mask=row_ok, other=-1)
    ok = (j < n) & row_ok[:, None]
    return tl.where(ok, _slot_span(blk[:, None], k[None, :], BS), -1), j


@triton.jit
def c128a_kernel(
    pos_ptr, t2r_ptr, bt_ptr, slot_ptr, g_ptr, dlens_ptr, pf_ptr,
    Td, Wd, Wp, pos_s, t2r_s, bt_rows, bt_cols, bt_s0, bt_s1, slot_s, g_s0, g_s1, dlens_s, pf_s0, pf_s1,
    RATIO: tl.constexpr, BS: tl.constexpr, BLOCK: tl.constexpr, GUESS: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    _pdl_start(PDL)
    pos = tl.load(pos_ptr + t * pos_s).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if t < Td:
        r = tl.load(t2r_ptr + t * t2r_s).to(tl.int64)
        slot = tl.load(slot_ptr + t * slot_s)
        first = 0
        if GUESS:     # table row t's first tile, loaded beside r: decode token t is mostly request t's
            g, j = _lookup_run(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, t, 0, Wd, BLOCK, BS)
        n = tl.minimum(tl.maximum(pos + 1, 0) // RATIO, Wd).to(tl.int32)
        if GUESS:
            if r != t:
                g, j = _lookup_run(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, 0, n, BLOCK, BS)
            tl.store(g_ptr + t * g_s0 + j.to(tl.int64) * g_s1, tl.where(j < n, g, -1), mask=j < Wd)
            first = BLOCK
        for c0 in range(first, Wd, BLOCK):
            if (BS & (BS - 1)) == 0 and BS <= BLOCK:      # whole table entries per tile row
                g, j = _lookup_run(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, c0, n, BLOCK, BS)
            else:
                j = c0 + cols
                g = _table_slots(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, 0, j, j < n, BS, BS)
            tl.store(g_ptr + t * g_s0 + j.to(tl.int64) * g_s1, g, mask=j < Wd)
        tl.store(dlens_ptr + t * dlens_s, tl.where(slot >= 0, n, 0))
    else:
        n = tl.minimum(tl.maximum(pos + 1, 0) // RATIO, Wp).to(tl.int32)
        tp = t - Td
        for c0 in range(0, Wp, BLOCK):
            j = c0 + cols
            tl.store(pf_ptr + tp * pf_s0 + j.to(tl.int64) * pf_s1, tl.where(j < n, j, -1), mask=j < Wp)


# --- fill_short_context_topk_indices ------------------------------------------------------------
@triton.jit
def fill_short_kernel(
    topk_ptr, pos_ptr, topk_s0, topk_s1, pos_s,
    TOPK: tl.constexpr, RATIO: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    _pdl_start(PDL)
    n = tl.maximum((tl.load(pos_ptr + t * pos_s).to(tl.int64) + 1) // RATIO, 0)
    cols = tl.arange(0, BLOCK).to(tl.int64)
    for c0 in range(0, TOPK, BLOCK):
        j = c0 + cols
        tl.store(topk_ptr + t * topk_s0 + j * topk_s1, tl.where(j < n, j, -1).to(tl.int32), mask=j < TOPK)


GLOBAL_LAUNCHER = FastLauncher(global_topk_kernel)
COMBINE_LAUNCHER = FastLauncher(combine_kernel)
FLASHINFER_LAUNCHER = FastLauncher(flashinfer_kernel)
C128A_LAUNCHER = FastLauncher(c128a_kernel)
FILL_LAUNCHER = FastLauncher(fill_short_kernel)
LAUNCHERS = {"global": GLOBAL_LAUNCHER, "combine": COMBINE_LAUNCHER, "flashinfer": FLASHINFER_LAUNCHER,
             "c128a": C128A_LAUNCHER, "fill": FILL_LAUNCHER}


# --- constexprs and runtime arguments (shared by the ops and the compile matrix) ------------------
# int32 columns per lane (so warps per program) of each kernel, and the row counts from which a kernel takes one
# warp per row instead (its scalar work then is not repeated per warp; few rows are latency-bound and take more
# warps), or at most two (TWO_WARP_ROWS). Measured on an H100 (NOTES.md): global 1 warp from 2048 rows; flashinfer 2
# warps from 2048 rows (T = 4096 with its dependents launched late: 8.41 us on 4 warps, 7.50 on 2, 7.66 on 1).
PER_THREAD = {"global": 4, "combine": 16, "flashinfer": 4, "c128a": 4, "fill": 4}
ONE_WARP_ROWS = {"global": 2048}
TWO_WARP_ROWS = {"flashinfer": 2048}
ROW_PROGRAMS_PER_SM = 16    # combine: programs per SM; more rows than that loop, one row's loads ahead (H200, NOTES.md)
FLASHINFER_TOUCH_ROWS = 2048   # flashinfer: launches of at most this many rows touch their inputs early (flashinfer_early)
# c128a: launches of at most this many rows read table row t's first tile before token_to_req[t] arrives
# (one round of loads fewer when t is request t's token; a wasted tile read otherwise). Larger launches are
# bandwidth-bound and read only the entries they need.
GUESS_ROWS = 1024


def _warps(target: platform.Target, block: int, kernel: str, rows: int) -> int:
    if rows >= ONE_WARP_ROWS.get(kernel, rows + 1):
        return 1
    warps = platform.num_warps_for(target, block, per_thread=PER_THREAD[kernel])
    return min(warps, 2) if rows >= TWO_WARP_ROWS.get(kernel, rows + 1) else warps


def request_search(entries: int) -> tuple[int, bool]:
    """(SEARCH, ONE_ROUND) of a kernel that needs `entries` leading entries of query_start_loc (and the
    per-request vectors beside it): all of them in one vector of a power of two >= MIN_SEARCH when they
    number at most SEARCH (one round of loads), else SEARCH-wide steps."""
    if entries <= SEARCH:
        return max(MIN_SEARCH, triton.next_power_of_2(entries)), True
    return SEARCH, False



def global_constexprs(block_size: int, K: int, rows: int, target: platform.Target) -> dict:
    block = block_for(K)
    return dict(BS=block_size, BLOCK=block, PDL=platform.supports_pdl(target),
                num_warps=_warps(target, block, "global", rows))


def global_runtime_args(topk, t2r, bt, valid, g, lens) -> tuple:
    return (topk.shape[1], *topk.stride(), t2r.stride(0), bt.shape[0], bt.shape[1], *bt.stride(), valid.stride(0),
            *g.stride(), lens.stride(0))


def combine_constexprs(window_size: int, compress_ratio: int, topk: int, write_uncovered: bool, Rc: int, rows: int,
                       target: platform.Target) -> dict:
    block, swa_block = block_for(topk), block_for(window_size)
    search, one_round = request_search(Rc)      # qsl[k], qsl[k + 1], seq_lens[k], gather_lens[k] for k < Rc
    return dict(WINDOW=window_size, RATIO=compress_ratio, TOPK=topk, WRITE_UNCOVERED=write_uncovered, BLOCK=block,
                SWA_BLOCK=swa_block, SEARCH=search, ONE_ROUND=one_round, PDL=platform.supports_pdl(target),
                EARLY=early.flags(touch=early.use_early(target)),
                num_warps=_warps(target, max(block, swa_block), "combine", rows))


def row_programs(rows: int, device: torch.device) -> int:
    """Programs of a row-looping kernel: one per row up to ROW_PROGRAMS_PER_SM per multiprocessor."""
    return max(1, min(rows, ROW_PROGRAMS_PER_SM * device_multiprocessors(device)))


def combine_runtime_args(Tq: int, Rc: int, M: int, N: int, topk, qsl, seq, gl, out, lens) -> tuple:
    return (Tq, Rc, layout.cdiv(Rc, request_search(Rc)[0]), M, N, out.shape[1], *topk.stride(), qsl.stride(0),
            seq.stride(0), gl.stride(0), *out.stride(), lens.stride(0))


def flashinfer_constexprs(swa_block_size, swa_span, compressed_block_size, compressed_span, window_size,
                          compress_ratio, topk, local: bool, has_dlens: bool, has_dvalid: bool, wswa: int, P: int,
                          R: int, rows: int, target: platform.Target) -> dict:
    block_w, block_p = block_for(wswa), block_for(P)
    search, one_round = request_search(R + 1)   # qsl[k] for k <= R, seq_lens[k] for k < R
    return dict(SBS=swa_block_size, SSPAN=swa_span, CBS=compressed_block_size, CSPAN=compressed_span,
                WINDOW=window_size, RATIO=compress_ratio, TOPK=topk, LOCAL=local, HAS_DLENS=has_dlens,
                HAS_DVALID=has_dvalid, BLOCK_W=block_w, BLOCK_P=block_p, SEARCH=search, ONE_ROUND=one_round,
                PDL=platform.supports_pdl(target), EARLY=flashinfer_early(rows, target),
                num_warps=_warps(target, max(block_w, block_p), "flashinfer", rows))


def flashinfer_early(rows: int, target: platform.Target) -> int:
    """flashinfer_kernel's EARLY flags (`kernels/early.py`) on PDL targets: launches of at most FLASHINFER_TOUCH_ROWS
    rows touch their rows' first inputs before the wait; larger ones launch their dependents after it. H100 (NOTES.md,
    "Work before the wait"): T = 256 2.01 -> 1.95 us touched (2.14 late); T = 2048 (2 warps) 5.20 -> 4.38 us touched
    (4.80 late); T = 4096 (2 warps) 9.16 -> 7.50 us late (8.07 touched)."""
    if not early.use_early(target):
        return 0
    return early.flags(touch=True) if rows <= FLASHINFER_TOUCH_ROWS else early.flags(late=True)


def flashinfer_runtime_args(Td, Wswa, Kd, Kp, P, R, dswa, dcomp_strides, dlens_s, ptopk, qsl, seq, t2r, sbt, cbt,
                            dvalid_s, out, lens) -> tuple:
    return (Td, Wswa, Kd, Kp, P, R, *dswa.stride(), *dcomp_strides, dlens_s, *ptopk.stride(), qsl.stride(0),
            seq.stride(0), t2r.stride(0), sbt.shape[0], sbt.shape[1], *sbt.stride(), cbt.shape[0], cbt.shape[1],
            *cbt.stride(), dvalid_s, *out.stride(), lens.stride(0))


def c128a_constexprs(compress_ratio: int, block_size: int, width: int, rows: int, target: platform.Target) -> dict:
    block = block_for(width)
    guess = (block_size & (block_size - 1)) == 0 and block_size <= block and rows <= GUESS_ROWS
    return dict(RATIO=compress_ratio, BS=block_size, BLOCK=block, GUESS=guess, PDL=platform.supports_pdl(target),
                num_warps=_warps(target, block, "c128a", rows))


def c128a_runtime_args(Td, Wd, Wp, pos, t2r, bt, slot, g, dlens, pf) -> tuple:
    return (Td, Wd, Wp, pos.stride(0), t2r.stride(0), bt.shape[0], bt.shape[1], *bt.stride(), slot.stride(0),
            *g.stride(), dlens.stride(0), *pf.stride())


def fill_constexprs(topk: int, compress_ratio: int, rows: int, target: platform.Target) -> dict:
    block = block_for(topk)
    return dict(TOPK=topk, RATIO=compress_ratio, BLOCK=block, PDL=platform.supports_pdl(target),
                num_warps=_warps(target, block, "fill", rows))


def fill_runtime_args(topk_indices, positions) -> tuple:
    return (*topk_indices.stride(), positions.stride(0))


# --- compile matrix (torch_dsv4_ops.compile_matrix) -------------------------------------------
def _case(target, name, fn, tensors, ints, meta):
    from .matrix import kernel_case
    return kernel_case(target, name, fn, tensors, ints, meta)


def matrix_cases(target: platform.Target) -> list:
    """Specialisations of the five kernels the sparse index ops launch on `target`: DSV4 shapes
    (window 128, top-k 512/1024, ratios 4/128, bs 64/2), int32 and int64 block tables, the
    functional and out forms of combine, local/global decode indices and packed spans for
    FlashInfer. Ints are representative (runtime values, specialised only on ==1 and %16)."""
    from .matrix import Ptr, dedupe

    i32, i64, b8 = torch.int32, torch.int64, torch.bool
    cases = []
    for bt_dtype in (i32, i64):
        tag = "bt32" if bt_dtype == i32 else "bt64"
        for K, bs, rows in ((512, 64, 64), (1024, 64, 64), (512, 2, 64), (512, 64, 16384)):
            meta = global_constexprs(bs, K, rows, target)
            cases.append(_case(target, f"global_topk.K{K}.bs{bs}.rows{rows}.{tag}", global_topk_kernel,
                               (Ptr(i32), Ptr(i32), Ptr(bt_dtype), Ptr(b8), Ptr(i32), Ptr(i32)),
                               (K, K, 1, 1, 7, 33, 33, 1, 1, K, 1, 1), meta))
        fi_configs = [(topk, window, ratio, flags, span, 5, 64) for topk, window, ratio in
                      ((512, 128, 4), (1024, 128, 4), (0, 128, 1), (8192, 128, 128))
                      for flags in ((True, False, True), (False, True, False), (False, False, False))
                      for span in (None, 2)]
        fi_configs += [(512, 128, 4, (True, False, True), None, R, rows) for R, rows in
                       ((5, 4096), (SEARCH + 44, 64))]     # many rows; two rounds of loads
        for topk, window, ratio, (local, has_dlens, has_dvalid), span, R, rows in fi_configs:
            wswa, P = window, layout.flashinfer_compressed_width(topk, topk)
            sbs, cbs = 64, (256 // ratio if ratio > 1 else 64)
            sspan = sbs if span is None else sbs * span
            cspan = cbs if span is None else cbs * span
            meta = flashinfer_constexprs(sbs, sspan, cbs, cspan, window, ratio, topk, local, has_dlens, has_dvalid,
                                         wswa, P, R, rows, target)
            tensors = (Ptr(i32), Ptr(i32), Ptr(i32), Ptr(i32), Ptr(i32), Ptr(i32), Ptr(i32), Ptr(bt_dtype),
                       Ptr(bt_dtype), Ptr(b8), Ptr(i32), Ptr(i32))
            ints = (3, wswa, topk, topk, P, R, wswa, 1, topk, 1, 1, topk, 1, 1, 1, 1, 5, 33, 33, 1, 5, 33,
                    33, 1, 1, wswa + P, 1, 1)
            name = f"flashinfer.topk{topk}.w{window}.r{ratio}.{'local' if local else 'global'}" \
                   f"{'.dlens' if has_dlens else ''}{'.span' if span else ''}.R{R}.rows{rows}.{tag}"
            cases.append(_case(target, name, flashinfer_kernel, tensors, ints, meta))
        for rows in (64, 4096):         # with and without the token/request guess (GUESS_ROWS)
            meta = c128a_constexprs(128, 2, 8192, rows, target)
            cases.append(_case(target, f"c128a.r128.bs2.rows{rows}.{tag}", c128a_kernel,
                               (Ptr(i64), Ptr(i32), Ptr(bt_dtype), Ptr(i64), Ptr(i32), Ptr(i32), Ptr(i32)),
                               (3, 8192, 8192, 1, 1, 3, 4096, 4096, 1, 1, 8192, 1, 1, 8192, 1), meta))
    combine_configs = [(topk, window, ratio, wu, Rc, i32, 4096) for topk, window, ratio in
                       ((512, 128, 4), (1024, 128, 4), (0, 128, 1), (8192, 128, 128), (512, 100, 4))
                       for wu in (True, False) for Rc in (5, SEARCH + 44)]
    combine_configs.append((512, 128, 4, True, 200, i64, 4096))     # int64 qsl / seq_lens / gather_lens
    for topk, window, ratio, write_uncovered, Rc, req_dtype, rows in combine_configs:
        meta = combine_constexprs(window, ratio, topk, write_uncovered, Rc, rows, target)
        C = layout.combine_width(topk, window)
        name = f"combine.topk{topk}.w{window}.r{ratio}.{'fresh' if write_uncovered else 'out'}.Rc{Rc}" \
               f"{'.req64' if req_dtype == i64 else ''}"
        tensors = (Ptr(i32), Ptr(req_dtype), Ptr(req_dtype), Ptr(req_dtype), Ptr(i32), Ptr(i32))
        ints = (rows, Rc, layout.cdiv(Rc, request_search(Rc)[0]), 1000, 500, C, max(topk, 1), 1, 1, 1, 1, C, 1, 1)
        cases.append(_case(target, name, combine_kernel, tensors, ints, meta))
    for pos_dtype in (i32, i64):
        for topk, ratio in ((512, 4), (1024, 4), (8192, 128)):
            meta = fill_constexprs(topk, ratio, 64, target)
            cases.append(_case(target, f"fill_short.topk{topk}.r{ratio}.{'pos32' if pos_dtype == i32 else 'pos64'}",
                               fill_short_kernel, (Ptr(i32), Ptr(pos_dtype)), (topk, 1, 1), meta))
    return dedupe(cases)
