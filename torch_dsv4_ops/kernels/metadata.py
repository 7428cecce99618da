"""Triton kernels for the metadata ops (SPEC §3.4).

Block-table lookups are SPEC §0 `lookup` (`sparse_index._lookup`): negative entries, columns past
the width, out-of-range request ids and negative positions give -1, int64 arithmetic, int32
outputs -1 past INT32_MAX. Token and request counts, strides, table widths, offsets, slice bounds
and buffer lengths are runtime ints (§4 h); only block sizes, ratios, windows, flags and tile sizes
are constexpr. Every load and store is masked to its tensor's extent whatever the index values
(§4 b). `query_start_loc` is taken to be non-decreasing: the per-request programs of
`compressed_slot_kernel` and the request count of `varlen_decode_kernel` rely on it (hostile
values still stay in bounds).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layout, platform
from ._launch import FastLauncher, launch_options  # noqa: F401  (ops use kernels.launch_options)
from .sparse_index import _i32, _lookup, _pdl_start, block_for

SEARCH = 256        # query_start_loc / length entries one program reads at once
ROW_BLOCK = 256     # rows per tile of the 1-D kernels (slot mapping, gather lens, chunk metadata)


# --- get_compressed_slot_mapping ----------------------------------------------------------------
@triton.jit
def compressed_slot_kernel(
    qsl_ptr, seq_ptr, bt_ptr, out_ptr,
    Rq, R, limit, out_len, qsl_s, seq_s, bt_rows, bt_cols, bt_s0, bt_s1, out_s,
    BS: tl.constexpr, RATIO: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """Programs [0, Rq) write request p's rows [qsl[p], qsl[p+1]) below `limit`; programs Rq.. fill
    a BLOCK-row tile of out with -1 wherever no request row lies (before qsl[0], from qsl[Rq], or
    from `limit` on)."""
    p = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK).to(tl.int64)
    _pdl_start(PDL)
    if p < Rq:
        qs = tl.load(qsl_ptr + p * qsl_s).to(tl.int64)
        qe = tl.load(qsl_ptr + (p + 1) * qsl_s).to(tl.int64)
        seq = tl.load(seq_ptr + p * seq_s, mask=p < R, other=0).to(tl.int64)
        prefix = seq - (qe - qs)
        r = tl.where(p < R, p, -1)        # rows of requests past the table or seq_lens stay -1
        lo = tl.maximum(qs, 0)
        hi = tl.minimum(qe, limit)
        for r0 in range(lo, hi, BLOCK):
            row = r0 + rows
            pos = prefix + (row - qs)
            ok = (pos >= 0) & ((pos + 1) % RATIO == 0)
            slot = _lookup(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, tl.where(ok, pos // RATIO, -1), BS)
            tl.store(out_ptr + row * out_s, slot, mask=row < hi)
    else:
        first = tl.load(qsl_ptr).to(tl.int64)
        last = tl.load(qsl_ptr + Rq * qsl_s).to(tl.int64)
        row = (p - Rq) * BLOCK + rows
        none = (row < first) | (row >= last) | (row >= limit)
        tl.store(out_ptr + row * out_s, tl.full((BLOCK,), -1, tl.int64), mask=none & (row < out_len))


# --- compute_swa_indices_and_lens and the DSpark non-causal variant ------------------------------
@triton.jit
def _swa_row(r, valid, t, R, W, qsl_ptr, seq_ptr, bt_ptr, row, lens_at, qsl_s, seq_s, bt_rows, bt_cols, bt_s0,
             bt_s1, idx_s1, WINDOW: tl.constexpr, BS: tl.constexpr, NONCAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    """One SWA row (SPEC §3.4) of token t of request r: W columns at `row`, its length at `lens_at`."""
    cols = tl.arange(0, BLOCK).to(tl.int64)
    ok = valid & (r >= 0) & (r < R)
    rr = tl.where(ok, r, 0)
    qs = tl.load(qsl_ptr + rr * qsl_s, mask=ok, other=0).to(tl.int64)
    qe = tl.load(qsl_ptr + (rr + 1) * qsl_s, mask=ok, other=0).to(tl.int64)
    seq = tl.load(seq_ptr + rr * seq_s, mask=ok, other=0).to(tl.int64)
    prefix = seq - (qe - qs)
    pos = prefix + (t - qs)
    ok = ok & (pos >= 0)
    if NONCAUSAL:
        start = tl.maximum(prefix - WINDOW, 0)
        n = tl.minimum(tl.maximum(seq - start, 0), W)
    else:
        start = tl.maximum(pos - WINDOW + 1, 0)
        n = pos + 1 - start
    n = tl.where(ok, n, 0)
    for c0 in range(0, W, BLOCK):
        c = c0 + cols
        slot = _lookup(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, rr, tl.where(c < n, start + c, -1), BS)
        tl.store(row + c * idx_s1, _i32(slot), mask=c < W)
    tl.store(lens_at, n.to(tl.int32))


@triton.jit
def swa_kernel(
    t2r_ptr, valid_ptr, qsl_ptr, seq_ptr, bt_ptr, idx_ptr, lens_ptr,
    token_offset, R, W, t2r_s, valid_s, qsl_s, seq_s, bt_rows, bt_cols, bt_s0, bt_s1, idx_s0, idx_s1, lens_s,
    WINDOW: tl.constexpr, BS: tl.constexpr, NONCAUSAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    t = token_offset + i
    _pdl_start(PDL)
    r = tl.load(t2r_ptr + t * t2r_s).to(tl.int64)
    valid = tl.load(valid_ptr + t * valid_s) != 0
    _swa_row(r, valid, t, R, W, qsl_ptr, seq_ptr, bt_ptr, idx_ptr + i * idx_s0, lens_ptr + i * lens_s, qsl_s,
             seq_s, bt_rows, bt_cols, bt_s0, bt_s1, idx_s1, WINDOW, BS, NONCAUSAL, BLOCK)


@triton.jit
def swa_decode_kernel(
    qsl_ptr, seq_ptr, slot_ptr, bt_ptr, t2r_ptr, valid_ptr, idx_ptr, lens_ptr,
    Rq, R, T, ndt, W, n_lens, qsl_s, seq_s, slot_s, bt_rows, bt_cols, bt_s0, bt_s1, t2r_s, valid_s, idx_s0, idx_s1,
    lens_s,
    WINDOW: tl.constexpr, BS: tl.constexpr, NONCAUSAL: tl.constexpr, BLOCK: tl.constexpr, SEARCH: tl.constexpr,
    ROWS: tl.constexpr, PDL: tl.constexpr,
):
    """Programs [0, T): token i's request (the count of qsl[1..Rq] <= i; 0 outside [qsl[0], qsl[Rq])) and
    validity, and for i < ndt its SWA row. Programs T..: ROWS-row tiles of swa_lens[ndt:] set to 0."""
    p = tl.program_id(0).to(tl.int64)
    _pdl_start(PDL)
    if p < T:
        ks = tl.arange(0, SEARCH).to(tl.int64)
        first = tl.load(qsl_ptr).to(tl.int64)
        last = tl.load(qsl_ptr + Rq * qsl_s).to(tl.int64)
        slot = tl.load(slot_ptr + p * slot_s)
        b = p * 0
        for k0 in range(0, Rq, SEARCH):
            k = k0 + ks
            a = tl.load(qsl_ptr + (k + 1) * qsl_s, mask=k < Rq, other=0).to(tl.int64)
            b += tl.sum(((a <= p) & (k < Rq)).to(tl.int64), axis=0)
        r = tl.where((p >= first) & (p < last), b, 0)
        valid = slot >= 0
        tl.store(t2r_ptr + p * t2r_s, r.to(tl.int32))
        tl.store(valid_ptr + p * valid_s, valid)
        if p < ndt:
            _swa_row(r, valid, p, R, W, qsl_ptr, seq_ptr, bt_ptr, idx_ptr + p * idx_s0, lens_ptr + p * lens_s,
                     qsl_s, seq_s, bt_rows, bt_cols, bt_s0, bt_s1, idx_s1, WINDOW, BS, NONCAUSAL, BLOCK)
    else:
        rows = ndt + (p - T) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        tl.store(lens_ptr + rows * lens_s, tl.zeros((ROWS,), tl.int32), mask=rows < n_lens)


# --- compute_prefill_gather_lens ------------------------------------------------------------------
@triton.jit
def gather_lens_kernel(
    seq_ptr, qsl_ptr, out_ptr,
    num_decodes, num_prefills, window, seq_s, qsl_s, out_s,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = i < num_prefills
    r = num_decodes + i
    _pdl_start(PDL)
    qs = tl.load(qsl_ptr + r * qsl_s, mask=m, other=0).to(tl.int64)
    qe = tl.load(qsl_ptr + (r + 1) * qsl_s, mask=m, other=0).to(tl.int64)
    seq = tl.load(seq_ptr + r * seq_s, mask=m, other=0).to(tl.int64)
    q = qe - qs
    tl.store(out_ptr + i * out_s, (q + tl.minimum(tl.maximum(seq - q, 0), window - 1)).to(tl.int32), mask=m)


# --- prepare_uniform_decode / prepare_varlen_decode -----------------------------------------------
@triton.jit
def _table_row(bt_ptr, bt_s0, bt_s1, r, w, ebt_row, ebt_s1, EW, cols, BLOCK: tl.constexpr):
    """expanded row = block_table[r, :w], -1 past w; r < 0: [0, -1, -1, ...]."""
    src = bt_ptr + tl.maximum(r, 0) * bt_s0
    wr = tl.where(r >= 0, w, 0)
    for c0 in range(0, EW, BLOCK):
        c = c0 + cols
        v = tl.load(src + c * bt_s1, mask=c < wr, other=-1)
        v = tl.where((r < 0) & (c == 0), 0, v)
        tl.store(ebt_row + c * ebt_s1, v.to(ebt_row.dtype.element_ty), mask=c < EW)


@triton.jit
def uniform_decode_kernel(
    seq_ptr, dsl_ptr, bt_ptr, ebt_ptr, dl_ptr,
    L, w, EW, seq_s, dsl_s, bt_s0, bt_s1, ebt_s0, ebt_s1, dl_s,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    idx = tl.program_id(0).to(tl.int64)
    r = idx // L
    j = idx % L
    cols = tl.arange(0, BLOCK).to(tl.int64)
    _pdl_start(PDL)
    seq = tl.load(seq_ptr + r * seq_s).to(tl.int64)
    _table_row(bt_ptr, bt_s0, bt_s1, r, w, ebt_ptr + idx * ebt_s0, ebt_s1, EW, cols, BLOCK)
    tl.store(dsl_ptr + idx * dsl_s, tl.maximum(seq - L + j + 1, 0).to(tl.int32))
    tl.store(dl_ptr + idx * dl_s, 1)


@triton.jit
def varlen_decode_kernel(
    qsl_ptr, seq_ptr, bt_ptr, dsl_ptr, ebt_ptr, dl_ptr, di_ptr,
    nd, w, EW, qsl_s, seq_s, bt_s0, bt_s1, dsl_s, ebt_s0, ebt_s1, dl_s, di_s,
    BLOCK: tl.constexpr, SEARCH: tl.constexpr, PDL: tl.constexpr,
):
    """Row `row` of the flattened decodes: its request b is the count of qsl[1..nd] - qsl[0] <= row
    (b == nd: a padding row past E = qsl[nd] - qsl[0])."""
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, SEARCH).to(tl.int64)
    cols = tl.arange(0, BLOCK).to(tl.int64)
    _pdl_start(PDL)
    base = tl.load(qsl_ptr).to(tl.int64)
    b = row * 0
    for k0 in range(0, nd, SEARCH):
        k = k0 + ks
        a = tl.load(qsl_ptr + (k + 1) * qsl_s, mask=k < nd, other=0).to(tl.int64) - base
        b += tl.sum(((a <= row) & (k < nd)).to(tl.int64), axis=0)
    real = b < nd
    bb = tl.where(real, b, 0)
    qs = tl.load(qsl_ptr + bb * qsl_s, mask=real, other=0).to(tl.int64) - base
    qe = tl.load(qsl_ptr + (bb + 1) * qsl_s, mask=real, other=0).to(tl.int64) - base
    seq = tl.load(seq_ptr + bb * seq_s, mask=real, other=0).to(tl.int64)
    e = tl.load(qsl_ptr + nd * qsl_s).to(tl.int64) - base
    _table_row(bt_ptr, bt_s0, bt_s1, tl.where(real, b, -1), w, ebt_ptr + row * ebt_s0, ebt_s1, EW, cols, BLOCK)
    sl = tl.maximum(seq - (qe - qs) + (row - qs) + 1, 0)
    tl.store(dsl_ptr + row * dsl_s, tl.where(real, sl, 0).to(tl.int32))
    tl.store(dl_ptr + row * dl_s, 1)
    tl.store(di_ptr + row * di_s, tl.where(real, b, nd + row - e).to(tl.int32))


# --- prepare_token_metadata / prepare_native_decode ------------------------------------------------
@triton.jit
def token_metadata_kernel(
    qsl_ptr, slot_ptr, t2r_ptr, valid_ptr,
    Rq, T, qsl_s, slot_s, t2r_s, valid_s,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """Programs [0, Rq) write request p's token_to_req rows [qsl[p], qsl[p+1]) below T; programs Rq..
    each take a BLOCK-row tile: token_to_req 0 where no request row lies, and is_valid_token."""
    p = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK).to(tl.int64)
    _pdl_start(PDL)
    if p < Rq:
        lo = tl.maximum(tl.load(qsl_ptr + p * qsl_s).to(tl.int64), 0)
        hi = tl.minimum(tl.load(qsl_ptr + (p + 1) * qsl_s).to(tl.int64), T)
        for r0 in range(lo, hi, BLOCK):
            row = r0 + rows
            tl.store(t2r_ptr + row * t2r_s, tl.zeros((BLOCK,), tl.int32) + p.to(tl.int32), mask=row < hi)
    else:
        first = tl.load(qsl_ptr).to(tl.int64)
        last = tl.load(qsl_ptr + Rq * qsl_s).to(tl.int64)
        row = (p - Rq) * BLOCK + rows
        m = row < T
        slot = tl.load(slot_ptr + row * slot_s, mask=m, other=-1)
        tl.store(t2r_ptr + row * t2r_s, tl.zeros((BLOCK,), tl.int32), mask=m & ((row < first) | (row >= last)))
        tl.store(valid_ptr + row * valid_s, slot >= 0, mask=m)


@triton.jit
def native_decode_kernel(
    qsl_ptr, seq_ptr, dl_ptr, dsl_ptr,
    nd, L, qsl_s, seq_s, dl_s, dsl_s,
    RATIO: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """A tile of BLOCK flattened (request, j) rows: i = b * L + j."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = i < nd * L
    b = i // L
    j = i % L
    _pdl_start(PDL)
    seq = tl.load(seq_ptr + b * seq_s, mask=m, other=0).to(tl.int64)
    first = m & (j == 0)
    qs = tl.load(qsl_ptr + b * qsl_s, mask=first, other=0)
    qe = tl.load(qsl_ptr + (b + 1) * qsl_s, mask=first, other=0)
    tl.store(dsl_ptr + i * dsl_s, (tl.maximum(seq - L + 1 + j, 0) // RATIO).to(tl.int32), mask=m)
    tl.store(dl_ptr + b * dl_s, (qe - qs).to(tl.int32), mask=first)


# --- build_prefill_chunk_metadata (device part) ---------------------------------------------------
@triton.jit
def _local(x, rank, world, inter, DCP: tl.constexpr):
    """SPEC §3.4 local(x) under DCP (world, rank, interleave); x without DCP."""
    if DCP:
        base = (x // inter // world) * inter
        out = base + tl.minimum(tl.maximum(x - base * world - rank * inter, 0), inter)
    else:
        out = x
    return out


@triton.jit
def prefill_chunk_kernel(
    qsl_ptr, useq_ptr, cseq_ptr, cu_ptr, ks_ptr, ke_ptr, tts_ptr,
    start, n, qs0, rows, tts_len, rank, world, inter, qsl_s, useq_s, cseq_s, cu_s, ks_s, ke_s, tts_s,
    RATIO: tl.constexpr, DCP: tl.constexpr, BLOCK: tl.constexpr, SEARCH: tl.constexpr, PDL: tl.constexpr,
):
    """Program b: request start + b. Its row start (global and local under DCP) is the sum of the
    compressed lengths before it (negative lengths count 0); it writes cu_seq_lens[b+1] (and [0]),
    its query rows of ks/ke, its token_to_seq range; the last program writes -1 after cu[n]."""
    b = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, SEARCH).to(tl.int64)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    _pdl_start(PDL)
    q0 = tl.load(qsl_ptr + start * qsl_s).to(tl.int64)
    qs = tl.load(qsl_ptr + (start + b) * qsl_s).to(tl.int64) - q0
    qe = tl.load(qsl_ptr + (start + b + 1) * qsl_s).to(tl.int64) - q0
    useq = tl.load(useq_ptr + (start + b) * useq_s).to(tl.int64)
    comp = tl.maximum(tl.load(cseq_ptr + (start + b) * cseq_s).to(tl.int64), 0)
    cu = b * 0
    row_start = b * 0
    for k0 in range(0, b, SEARCH):
        k = k0 + ks
        c = tl.maximum(tl.load(cseq_ptr + (start + k) * cseq_s, mask=k < b, other=0).to(tl.int64), 0)
        cu += tl.sum(c, axis=0)
        row_start += tl.sum(_local(c, rank, world, inter, DCP), axis=0)
    tl.store(cu_ptr + (b + 1) * cu_s, (cu + comp).to(tl.int32))
    if b == 0:
        tl.store(cu_ptr, 0)
    qlen = qe - qs
    o_lo = tl.maximum(qs0 - qs, 0)
    o_hi = tl.minimum(qlen, qs0 + rows - qs)
    for o0 in range(o_lo, o_hi, BLOCK):
        o = o0 + offs
        m = o < o_hi
        a = qs + o - qs0
        x = tl.maximum(useq - qlen + 1 + o, 0) // RATIO
        tl.store(ks_ptr + a * ks_s, tl.zeros((BLOCK,), tl.int32) + row_start.to(tl.int32), mask=m)
        tl.store(ke_ptr + a * ke_s, (row_start + _local(x, rank, world, inter, DCP)).to(tl.int32), mask=m)
    t_hi = tl.minimum(cu + comp, tts_len)
    for k0 in range(cu, t_hi, BLOCK):
        k = k0 + offs
        tl.store(tts_ptr + k * tts_s, tl.zeros((BLOCK,), tl.int32) + b.to(tl.int32), mask=k < t_hi)
    if b == n - 1:
        for k0 in range(cu + comp, tts_len, BLOCK):
            k = k0 + offs
            tl.store(tts_ptr + k * tts_s, tl.full((BLOCK,), -1, tl.int32), mask=k < tts_len)


SLOT_LAUNCHER = FastLauncher(compressed_slot_kernel)
SWA_LAUNCHER = FastLauncher(swa_kernel)
GATHER_LENS_LAUNCHER = FastLauncher(gather_lens_kernel)
UNIFORM_LAUNCHER = FastLauncher(uniform_decode_kernel)
VARLEN_LAUNCHER = FastLauncher(varlen_decode_kernel)
CHUNK_LAUNCHER = FastLauncher(prefill_chunk_kernel)
TOKEN_LAUNCHER = FastLauncher(token_metadata_kernel)
SWA_DECODE_LAUNCHER = FastLauncher(swa_decode_kernel)
NATIVE_LAUNCHER = FastLauncher(native_decode_kernel)
LAUNCHERS = {"slot": SLOT_LAUNCHER, "swa": SWA_LAUNCHER, "gather_lens": GATHER_LENS_LAUNCHER,
             "uniform": UNIFORM_LAUNCHER, "varlen": VARLEN_LAUNCHER, "chunk": CHUNK_LAUNCHER,
             "token": TOKEN_LAUNCHER, "native": NATIVE_LAUNCHER, "swa_decode": SWA_DECODE_LAUNCHER}


# --- constexprs and runtime arguments (shared by the ops and the compile matrix) ------------------
def _warps(target: platform.Target, block: int) -> int:
    return platform.num_warps_for(target, block, per_thread=4)


def _common(block: int, target: platform.Target) -> dict:
    return dict(BLOCK=block, PDL=platform.supports_pdl(target), num_warps=_warps(target, block))


def slot_constexprs(block_size: int, compress_ratio: int, target: platform.Target) -> dict:
    return dict(BS=block_size, RATIO=compress_ratio, **_common(ROW_BLOCK, target))


def slot_grid(Rq: int, out_len: int) -> int:
    return Rq + layout.cdiv(out_len, ROW_BLOCK)


def slot_runtime_args(Rq, R, limit, qsl, seq, bt, out) -> tuple:
    return (Rq, R, limit, out.shape[0], qsl.stride(0), seq.stride(0), bt.shape[0], bt.shape[1], *bt.stride(),
            out.stride(0))


def swa_constexprs(window_size: int, block_size: int, noncausal: bool, width: int, target: platform.Target) -> dict:
    return dict(WINDOW=window_size, BS=block_size, NONCAUSAL=noncausal, **_common(block_for(width), target))


def swa_runtime_args(token_offset, R, W, t2r, valid, qsl, seq, bt, idx_strides, lens) -> tuple:
    return (token_offset, R, W, t2r.stride(0), valid.stride(0), qsl.stride(0), seq.stride(0), bt.shape[0],
            bt.shape[1], *bt.stride(), *idx_strides, lens.stride(0))


def gather_lens_constexprs(target: platform.Target) -> dict:
    return _common(ROW_BLOCK, target)


def gather_lens_runtime_args(num_decodes, num_prefills, window_size, seq, qsl, out) -> tuple:
    return (num_decodes, num_prefills, window_size, seq.stride(0), qsl.stride(0), out.stride(0))


def decode_constexprs(expanded_width: int, target: platform.Target, varlen: bool) -> dict:
    meta = _common(block_for(expanded_width), target)
    if varlen:
        meta["SEARCH"] = SEARCH
    return meta


def uniform_runtime_args(L, seq, dsl, bt, ebt, dl) -> tuple:
    return (L, min(bt.shape[1], ebt.shape[1]), ebt.shape[1], seq.stride(0), dsl.stride(0), *bt.stride(),
            *ebt.stride(), dl.stride(0))


def varlen_runtime_args(nd, qsl, seq, bt, dsl, ebt, dl, di) -> tuple:
    return (nd, min(bt.shape[1], ebt.shape[1]), ebt.shape[1], qsl.stride(0), seq.stride(0), *bt.stride(),
            dsl.stride(0), *ebt.stride(), dl.stride(0), di.stride(0))


def chunk_constexprs(compress_ratio: int, dcp: bool, target: platform.Target) -> dict:
    return dict(RATIO=compress_ratio, DCP=dcp, SEARCH=SEARCH, **_common(ROW_BLOCK, target))


def chunk_runtime_args(start, n, qs0, rows, rank, world, inter, qsl, useq, cseq, cu, ks, ke, tts) -> tuple:
    return (start, n, qs0, rows, tts.shape[0], rank, world, inter, qsl.stride(0), useq.stride(0), cseq.stride(0),
            cu.stride(0), ks.stride(0), ke.stride(0), tts.stride(0))


def token_constexprs(target: platform.Target) -> dict:
    return _common(ROW_BLOCK, target)


def token_grid(Rq: int, T: int) -> int:
    return Rq + layout.cdiv(T, ROW_BLOCK)


def token_runtime_args(Rq, T, qsl, slot, t2r, valid) -> tuple:
    return (Rq, T, qsl.stride(0), slot.stride(0), t2r.stride(0), valid.stride(0))


def swa_decode_constexprs(window_size: int, block_size: int, noncausal: bool, width: int,
                          target: platform.Target) -> dict:
    return dict(swa_constexprs(window_size, block_size, noncausal, width, target), SEARCH=SEARCH, ROWS=ROW_BLOCK)


def swa_decode_grid(T: int, ndt: int, n_lens: int) -> int:
    return T + layout.cdiv(max(n_lens - ndt, 0), ROW_BLOCK)


def swa_decode_runtime_args(Rq, R, T, ndt, W, qsl, seq, slot, bt, t2r, valid, idx_strides, lens) -> tuple:
    return (Rq, R, T, ndt, W, lens.shape[0], qsl.stride(0), seq.stride(0), slot.stride(0), bt.shape[0], bt.shape[1],
            *bt.stride(), t2r.stride(0), valid.stride(0), *idx_strides, lens.stride(0))


def native_constexprs(compress_ratio: int, target: platform.Target) -> dict:
    return dict(RATIO=max(compress_ratio, 1), **_common(ROW_BLOCK, target))


def native_runtime_args(nd, L, qsl, seq, dl, dsl) -> tuple:
    return (nd, L, qsl.stride(0), seq.stride(0), dl.stride(0), dsl.stride(0))


# --- compile matrix (torch_dsv4_ops.compile_matrix) -------------------------------------------
def _case(target, name, fn, tensors, ints, meta):
    from .matrix import kernel_case
    return kernel_case(target, name, fn, tensors, ints, meta)


def matrix_cases(target: platform.Target) -> list:
    """Specialisations of the nine metadata kernels on `target`: DSV4 shapes (window 128, DSpark
    widths 192/576, ratios 4/128 with storage bs 64/2, SWA bs 64), int32 and int64 block tables,
    int32 and int64 query_start_loc/seq_lens, DCP on and off. Ints are representative."""
    from .matrix import Ptr, dedupe

    i32, i64, b8 = torch.int32, torch.int64, torch.bool
    cases = []
    for bt_dtype in (i32, i64):
        tag = "bt32" if bt_dtype == i32 else "bt64"
        for ratio, bs in ((4, 64), (128, 2)):
            meta = slot_constexprs(bs, ratio, target)
            cases.append(_case(target, f"compressed_slot.r{ratio}.bs{bs}.{tag}", compressed_slot_kernel,
                               (Ptr(i32), Ptr(i32), Ptr(bt_dtype), Ptr(i64)),
                               (5, 5, 300, 300, 1, 1, 5, 33, 33, 1, 1), meta))
        for noncausal, window, width in ((False, 128, 128), (True, 128, 192), (True, 512, 576)):
            meta = swa_constexprs(window, layout.SWA_BLOCK_SIZE, noncausal, width, target)
            cases.append(_case(target, f"swa.w{window}.W{width}{'.noncausal' if noncausal else ''}.{tag}",
                               swa_kernel, (Ptr(i32), Ptr(b8), Ptr(i32), Ptr(i32), Ptr(bt_dtype), Ptr(i32),
                                            Ptr(i32)),
                               (3, 5, width, 1, 1, 1, 1, 5, 33, 33, 1, width, 1, 1), meta))
        for width in (256, 4096):
            meta = decode_constexprs(width, target, False)
            cases.append(_case(target, f"uniform_decode.W{width}.{tag}", uniform_decode_kernel,
                               (Ptr(i32), Ptr(i32), Ptr(bt_dtype), Ptr(bt_dtype), Ptr(i32)),
                               (2, width, width, 1, 1, width, 1, width, 1, 1), meta))
            meta = decode_constexprs(width, target, True)
            cases.append(_case(target, f"varlen_decode.W{width}.{tag}", varlen_decode_kernel,
                               (Ptr(i32), Ptr(i32), Ptr(bt_dtype), Ptr(i32), Ptr(bt_dtype), Ptr(i32), Ptr(i32)),
                               (5, width, width, 1, 1, width, 1, 1, width, 1, 1, 1), meta))
    for slot_dtype in (i32, i64):
        cases.append(_case(target, f"token_metadata.slot{32 if slot_dtype == i32 else 64}", token_metadata_kernel,
                           (Ptr(i32), Ptr(slot_dtype), Ptr(i32), Ptr(b8)), (5, 300, 1, 1, 1, 1),
                           token_constexprs(target)))
        for bt_dtype in (i32, i64):
            for noncausal, window, width in ((False, 128, 128), (True, 128, 192)):
                cases.append(_case(
                    target, f"swa_decode.w{window}.W{width}{'.noncausal' if noncausal else ''}."
                            f"slot{32 if slot_dtype == i32 else 64}.bt{32 if bt_dtype == i32 else 64}",
                    swa_decode_kernel, (Ptr(i32), Ptr(i32), Ptr(slot_dtype), Ptr(bt_dtype), Ptr(i32), Ptr(b8),
                                        Ptr(i32), Ptr(i32)),
                    (5, 5, 300, 10, width, 8192, 1, 1, 1, 5, 33, 33, 1, 1, 1, width, 1, 1),
                    swa_decode_constexprs(window, layout.SWA_BLOCK_SIZE, noncausal, width, target)))
    for len_dtype in (i32, i64):
        tag = "len32" if len_dtype == i32 else "len64"
        for ratio in (1, 4, 128):
            cases.append(_case(target, f"native_decode.r{ratio}.{tag}", native_decode_kernel,
                               (Ptr(i32), Ptr(len_dtype), Ptr(i32), Ptr(i32)), (5, 2, 1, 1, 1, 1),
                               native_constexprs(ratio, target)))
        cases.append(_case(target, f"gather_lens.{tag}", gather_lens_kernel, (Ptr(len_dtype), Ptr(i32), Ptr(i32)),
                           (3, 4, 128, 1, 1, 1), gather_lens_constexprs(target)))
        for ratio, dcp in ((4, False), (128, False), (4, True)):
            cases.append(_case(target, f"prefill_chunk.r{ratio}{'.dcp' if dcp else ''}.{tag}", prefill_chunk_kernel,
                               (Ptr(i32), Ptr(len_dtype), Ptr(len_dtype), Ptr(i32), Ptr(i32), Ptr(i32), Ptr(i32)),
                               (3, 4, 0, 100, 50, 0, 2 if dcp else 1, 1, 1, 1, 1, 1, 1, 1, 1),
                               chunk_constexprs(ratio, dcp, target)))
    return dedupe(cases)
