"""Triton kernels for the sparse index ops (SPEC §3.3).

Every kernel runs one program per output row and sweeps the row's columns in tiles of BLOCK
contiguous int32 elements (vectorised loads and stores). Block-table lookups follow SPEC §0
`lookup` (negative entries, columns past the width, out-of-range request ids and negative
positions give -1) with int64 arithmetic; an int32 output is -1 where the int64 value is negative
or past INT32_MAX. Token/request counts, strides, table shapes, M, N, widths and
num_decode_tokens are runtime ints; only block sizes, spans, window, top-k, ratio, tile sizes and
flags are constexpr (§4 h). Every load is masked to its tensor's extent whatever the index values
(§4 b).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layout, platform
from ._launch import FastLauncher, launch_options  # noqa: F401  (ops use kernels.launch_options)

if platform.INTERPRET:   # the interpreter has no grid dependency control; PDL is False there
    gdc_wait = gdc_launch_dependents = None
else:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INT32_MAX = layout.INDEX_INT32_MAX
MAX_BLOCK = 1024          # columns per tile, at most
MIN_BLOCK = 16


def block_for(width: int) -> int:
    """Tile width (power of two, MIN_BLOCK..MAX_BLOCK) for rows of about `width` columns."""
    return max(MIN_BLOCK, min(MAX_BLOCK, triton.next_power_of_2(max(1, width))))


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _i32(v):
    """int64 -> int32 output value: -1 where negative or past INT32_MAX."""
    return tl.where((v >= 0) & (v <= 2147483647), v, -1).to(tl.int32)


@triton.jit
def _lookup(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, p, BS: tl.constexpr):
    """SPEC §0 lookup for a scalar request id `r` (int64) and an int64 tensor of positions `p`;
    int64 slots or -1. The table is read only at [0, bt_rows) x [0, bt_cols)."""
    rlim = tl.where((r >= 0) & (r < bt_rows), bt_cols, 0)      # no columns for an out-of-range request
    rr = tl.where((r >= 0) & (r < bt_rows), r, 0)
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


# --- compute_global_topk_indices_and_lens -------------------------------------------------------
@triton.jit
def global_topk_kernel(
    topk_ptr, t2r_ptr, bt_ptr, valid_ptr, g_ptr, lens_ptr,
    K, topk_s0, topk_s1, t2r_s, bt_rows, bt_cols, bt_s0, bt_s1, valid_s, g_s0, g_s1, lens_s,
    BS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    _pdl_start(PDL)
    r = tl.load(t2r_ptr + t * t2r_s).to(tl.int64)
    valid = tl.load(valid_ptr + t * valid_s)
    cols = tl.arange(0, BLOCK)
    count = tl.zeros((BLOCK,), dtype=tl.int32)
    for c0 in range(0, K, BLOCK):
        c = c0 + cols
        m = c < K
        v = tl.load(topk_ptr + t * topk_s0 + c * topk_s1, mask=m, other=-1).to(tl.int64)
        g = _i32(_lookup(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, v, BS))
        tl.store(g_ptr + t * g_s0 + c * g_s1, g, mask=m)
        count += (m & (g >= 0)).to(tl.int32)
    n = tl.sum(count, axis=0)
    tl.store(lens_ptr + t * lens_s, tl.where(valid != 0, n, 0))


# --- combine_topk_swa_indices -------------------------------------------------------------------
@triton.jit
def combine_kernel(
    topk_ptr, qsl_ptr, seq_ptr, gl_ptr, out_ptr, lens_ptr,
    Rc, n_iter, M, N, width, topk_s0, topk_s1, qsl_s, seq_s, gl_s, out_s0, out_s1, lens_s,
    WINDOW: tl.constexpr, RATIO: tl.constexpr, TOPK: tl.constexpr, WRITE_UNCOVERED: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    _pdl_start(PDL)
    base = tl.load(qsl_ptr).to(tl.int64)
    # the last request b with qs[b] <= t (qsl non-decreasing): upper bound over qsl[0:Rc], minus one
    lo = t * 0
    hi = lo + Rc
    for _ in range(n_iter):
        mid = (lo + hi) // 2
        a = tl.load(qsl_ptr + mid * qsl_s).to(tl.int64) - base
        active = lo < hi
        lo = tl.where(active & (a <= t), mid + 1, lo)
        hi = tl.where(active & (a > t), mid, hi)
    b = tl.maximum(lo - 1, 0)
    qs = tl.load(qsl_ptr + b * qsl_s).to(tl.int64) - base
    qe = tl.load(qsl_ptr + (b + 1) * qsl_s).to(tl.int64) - base
    covered = (t >= qs) & (t < qe)
    seq = tl.load(seq_ptr + b * seq_s).to(tl.int64)
    gl = tl.load(gl_ptr + b * gl_s).to(tl.int64)
    pos = seq - (qe - qs) + (t - qs)
    live = pos >= 0
    tk = tl.where(live, tl.minimum(tl.maximum(pos + 1, 0) // RATIO, TOPK), 0)
    sw = tl.where(live, tl.minimum(pos + 1, WINDOW), 0)
    gstart = seq - gl
    mb = M * b
    cols = tl.arange(0, BLOCK)
    if covered:
        for c0 in range(0, width, BLOCK):
            c = (c0 + cols).to(tl.int64)
            m = c < width
            loc = tl.load(topk_ptr + t * topk_s0 + c * topk_s1, mask=c < tk, other=-1).to(tl.int64)
            top = tl.where((loc >= 0) & (loc < N), mb + loc, -1)
            w = pos - sw + 1 + (c - tk) - gstart
            swa = tl.where((w >= 0) & (N + w < M), mb + N + w, -1)
            v = tl.where(c < tk, top, tl.where(c < tk + sw, swa, -1))
            tl.store(out_ptr + t * out_s0 + c * out_s1, _i32(v), mask=m)
        tl.store(lens_ptr + t * lens_s, (tk + sw).to(tl.int32))
    else:
        if WRITE_UNCOVERED:
            for c0 in range(0, width, BLOCK):
                c = c0 + cols
                tl.store(out_ptr + t * out_s0 + c * out_s1, tl.full((BLOCK,), -1, tl.int32), mask=c < width)
            tl.store(lens_ptr + t * lens_s, 0)


# --- build_flashinfer_mixed_sparse_indices ------------------------------------------------------
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
    BLOCK_W: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    _pdl_start(PDL)
    r = tl.load(t2r_ptr + t * t2r_s).to(tl.int64)
    cw = tl.arange(0, BLOCK_W).to(tl.int64)
    cp = tl.arange(0, BLOCK_P).to(tl.int64)
    row = out_ptr + t * out_s0
    if t < Td:
        for c0 in range(0, Wswa, BLOCK_W):
            c = c0 + cw
            m = c < Wswa
            v = tl.load(dswa_ptr + t * dswa_s0 + c * dswa_s1, mask=m, other=-1).to(tl.int64)
            tl.store(row + c * out_s1, _i32(_remap(v, SBS, SSPAN)), mask=m)
        count = tl.zeros((BLOCK_P,), dtype=tl.int32)
        for j0 in range(0, P, BLOCK_P):
            j = j0 + cp
            v = tl.load(dcomp_ptr + t * dcomp_s0 + j * dcomp_s1, mask=j < Kd, other=-1).to(tl.int64)
            if LOCAL:
                v = _lookup(cbt_ptr, cbt_rows, cbt_cols, cbt_s0, cbt_s1, r, v, CBS)
            o = tl.where(j < Kd, _i32(_remap(v, CBS, CSPAN)), -1)
            tl.store(row + (Wswa + j) * out_s1, o, mask=j < P)
            count += (o >= 0).to(tl.int32)
        if LOCAL:
            n = tl.sum(count, axis=0)
            if HAS_DVALID:
                n = tl.where(tl.load(dvalid_ptr + t * dvalid_s) != 0, n, 0)
        else:
            if HAS_DLENS:
                n = tl.load(dlens_ptr + t * dlens_s).to(tl.int32)
            else:
                n = (r * 0 + Kd).to(tl.int32)
        n = tl.where(Kd > 0, n, 0)
        tl.store(lens_ptr + t * lens_s, Wswa + n)
    else:
        rok = (r >= 0) & (r < R)
        pos = r * 0 - 1                 # an out-of-range request: no window, no top-k
        if rok:
            qs = tl.load(qsl_ptr + r * qsl_s).to(tl.int64)
            qe = tl.load(qsl_ptr + (r + 1) * qsl_s).to(tl.int64)
            seq = tl.load(seq_ptr + r * seq_s).to(tl.int64)
            pos = seq - (qe - qs) + (t - qs)
        sw = tl.minimum(tl.maximum(pos + 1, 0), WINDOW)
        s0 = pos - sw + 1
        tk = tl.minimum(tl.maximum(pos + 1, 0) // RATIO, TOPK)
        for c0 in range(0, Wswa, BLOCK_W):
            c = c0 + cw
            s = _lookup(sbt_ptr, sbt_rows, sbt_cols, sbt_s0, sbt_s1, r, tl.where(c < sw, s0 + c, -1), SBS)
            tl.store(row + c * out_s1, _i32(_remap(s, SBS, SSPAN)), mask=c < Wswa)
        kk = tl.minimum(tk, Kp)
        tp = t - Td
        for j0 in range(0, P, BLOCK_P):
            j = j0 + cp
            loc = tl.load(ptopk_ptr + tp * ptopk_s0 + j * ptopk_s1, mask=j < kk, other=-1).to(tl.int64)
            s = _lookup(cbt_ptr, cbt_rows, cbt_cols, cbt_s0, cbt_s1, r, loc, CBS)
            tl.store(row + (Wswa + j) * out_s1, _i32(_remap(s, CBS, CSPAN)), mask=j < P)
        tl.store(lens_ptr + t * lens_s, (Wswa + tk).to(tl.int32))


# --- build_c128a_topk_metadata ------------------------------------------------------------------
@triton.jit
def c128a_kernel(
    pos_ptr, t2r_ptr, bt_ptr, slot_ptr, g_ptr, dlens_ptr, pf_ptr,
    Td, Wd, Wp, pos_s, t2r_s, bt_rows, bt_cols, bt_s0, bt_s1, slot_s, g_s0, g_s1, dlens_s, pf_s0, pf_s1,
    RATIO: tl.constexpr, BS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    _pdl_start(PDL)
    pos = tl.load(pos_ptr + t * pos_s).to(tl.int64)
    cols = tl.arange(0, BLOCK).to(tl.int64)
    if t < Td:
        r = tl.load(t2r_ptr + t * t2r_s).to(tl.int64)
        slot = tl.load(slot_ptr + t * slot_s)
        n = tl.minimum(tl.maximum(pos + 1, 0) // RATIO, Wd)
        for c0 in range(0, Wd, BLOCK):
            j = c0 + cols
            g = _lookup(bt_ptr, bt_rows, bt_cols, bt_s0, bt_s1, r, tl.where(j < n, j, -1), BS)
            tl.store(g_ptr + t * g_s0 + j * g_s1, _i32(g), mask=j < Wd)
        tl.store(dlens_ptr + t * dlens_s, tl.where(slot >= 0, n, 0).to(tl.int32))
    else:
        n = tl.minimum(tl.maximum(pos + 1, 0) // RATIO, Wp)
        tp = t - Td
        for c0 in range(0, Wp, BLOCK):
            j = c0 + cols
            tl.store(pf_ptr + tp * pf_s0 + j * pf_s1, tl.where(j < n, j, -1).to(tl.int32), mask=j < Wp)


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
def _warps(target: platform.Target, block: int) -> int:
    return platform.num_warps_for(target, block, per_thread=4)



def global_constexprs(block_size: int, K: int, target: platform.Target) -> dict:
    block = block_for(K)
    return dict(BS=block_size, BLOCK=block, PDL=platform.supports_pdl(target), num_warps=_warps(target, block))


def global_runtime_args(topk, t2r, bt, valid, g, lens) -> tuple:
    return (topk.shape[1], *topk.stride(), t2r.stride(0), bt.shape[0], bt.shape[1], *bt.stride(), valid.stride(0),
            *g.stride(), lens.stride(0))


def combine_constexprs(window_size: int, compress_ratio: int, topk: int, write_uncovered: bool,
                       target: platform.Target) -> dict:
    block = block_for(layout.combine_width(topk, window_size))
    return dict(WINDOW=window_size, RATIO=compress_ratio, TOPK=topk, WRITE_UNCOVERED=write_uncovered, BLOCK=block,
                PDL=platform.supports_pdl(target), num_warps=_warps(target, block))


def combine_runtime_args(Rc: int, M: int, N: int, topk, qsl, seq, gl, out, lens) -> tuple:
    return (Rc, max(Rc, 1).bit_length(), M, N, out.shape[1], *topk.stride(), qsl.stride(0), seq.stride(0),
            gl.stride(0), *out.stride(), lens.stride(0))


def flashinfer_constexprs(swa_block_size, swa_span, compressed_block_size, compressed_span, window_size,
                          compress_ratio, topk, local: bool, has_dlens: bool, has_dvalid: bool, wswa: int, P: int,
                          target: platform.Target) -> dict:
    block_w, block_p = block_for(wswa), block_for(P)
    return dict(SBS=swa_block_size, SSPAN=swa_span, CBS=compressed_block_size, CSPAN=compressed_span,
                WINDOW=window_size, RATIO=compress_ratio, TOPK=topk, LOCAL=local, HAS_DLENS=has_dlens,
                HAS_DVALID=has_dvalid, BLOCK_W=block_w, BLOCK_P=block_p, PDL=platform.supports_pdl(target),
                num_warps=_warps(target, max(block_w, block_p)))


def flashinfer_runtime_args(Td, Wswa, Kd, Kp, P, R, dswa, dcomp_strides, dlens_s, ptopk, qsl, seq, t2r, sbt, cbt,
                            dvalid_s, out, lens) -> tuple:
    return (Td, Wswa, Kd, Kp, P, R, *dswa.stride(), *dcomp_strides, dlens_s, *ptopk.stride(), qsl.stride(0),
            seq.stride(0), t2r.stride(0), sbt.shape[0], sbt.shape[1], *sbt.stride(), cbt.shape[0], cbt.shape[1],
            *cbt.stride(), dvalid_s, *out.stride(), lens.stride(0))


def c128a_constexprs(compress_ratio: int, block_size: int, width: int, target: platform.Target) -> dict:
    block = block_for(width)
    return dict(RATIO=compress_ratio, BS=block_size, BLOCK=block, PDL=platform.supports_pdl(target),
                num_warps=_warps(target, block))


def c128a_runtime_args(Td, Wd, Wp, pos, t2r, bt, slot, g, dlens, pf) -> tuple:
    return (Td, Wd, Wp, pos.stride(0), t2r.stride(0), bt.shape[0], bt.shape[1], *bt.stride(), slot.stride(0),
            *g.stride(), dlens.stride(0), *pf.stride())


def fill_constexprs(topk: int, compress_ratio: int, target: platform.Target) -> dict:
    block = block_for(topk)
    return dict(TOPK=topk, RATIO=compress_ratio, BLOCK=block, PDL=platform.supports_pdl(target),
                num_warps=_warps(target, block))


def fill_runtime_args(topk_indices, positions) -> tuple:
    return (*topk_indices.stride(), positions.stride(0))


# --- compile matrix (torch_dsv4_ops.compile_matrix) -------------------------------------------
def _case(target, name, fn, tensors, ints, meta):
    from .matrix import KernelCase, specialise

    meta = dict(meta)
    num_warps = meta.pop("num_warps")
    signature, consts, attrs = specialise(fn, tuple(tensors) + tuple(ints), meta, target)
    return KernelCase(name, fn, signature, consts, num_warps, attrs)


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
        for K, bs in ((512, 64), (1024, 64), (512, 2)):
            meta = global_constexprs(bs, K, target)
            cases.append(_case(target, f"global_topk.K{K}.bs{bs}.{tag}", global_topk_kernel,
                               (Ptr(i32), Ptr(i32), Ptr(bt_dtype), Ptr(b8), Ptr(i32), Ptr(i32)),
                               (K, K, 1, 1, 7, 33, 33, 1, 1, K, 1, 1), meta))
        for topk, window, ratio in ((512, 128, 4), (1024, 128, 4), (0, 128, 1), (8192, 128, 128)):
            for local, has_dlens, has_dvalid in ((True, False, True), (False, True, False), (False, False, False)):
                wswa, P = window, layout.flashinfer_compressed_width(topk, topk)
                for span in (None, 2):
                    sbs, cbs = 64, (256 // ratio if ratio > 1 else 64)
                    sspan = sbs if span is None else sbs * span
                    cspan = cbs if span is None else cbs * span
                    meta = flashinfer_constexprs(sbs, sspan, cbs, cspan, window, ratio, topk, local, has_dlens,
                                                 has_dvalid, wswa, P, target)
                    tensors = (Ptr(i32), Ptr(i32), Ptr(i32), Ptr(i32), Ptr(i32), Ptr(i32), Ptr(i32), Ptr(bt_dtype),
                               Ptr(bt_dtype), Ptr(b8), Ptr(i32), Ptr(i32))
                    ints = (3, wswa, topk, topk, P, 5, wswa, 1, topk, 1, 1, topk, 1, 1, 1, 1, 5, 33, 33, 1, 5, 33,
                            33, 1, 1, wswa + P, 1, 1)
                    name = f"flashinfer.topk{topk}.w{window}.r{ratio}.{'local' if local else 'global'}" \
                           f"{'.dlens' if has_dlens else ''}{'.span' if span else ''}.{tag}"
                    cases.append(_case(target, name, flashinfer_kernel, tensors, ints, meta))
        meta = c128a_constexprs(128, 2, 8192, target)
        cases.append(_case(target, f"c128a.r128.bs2.{tag}", c128a_kernel,
                           (Ptr(i64), Ptr(i32), Ptr(bt_dtype), Ptr(i64), Ptr(i32), Ptr(i32), Ptr(i32)),
                           (3, 8192, 8192, 1, 1, 3, 4096, 4096, 1, 1, 8192, 1, 1, 8192, 1), meta))
    for topk, window, ratio in ((512, 128, 4), (1024, 128, 4), (0, 128, 1), (8192, 128, 128), (512, 100, 4)):
        for write_uncovered in (True, False):
            meta = combine_constexprs(window, ratio, topk, write_uncovered, target)
            C = layout.combine_width(topk, window)
            cases.append(_case(target, f"combine.topk{topk}.w{window}.r{ratio}.{'fresh' if write_uncovered else 'out'}",
                               combine_kernel, (Ptr(i32),) * 6,
                               (5, 3, 1000, 500, C, max(topk, 1), 1, 1, 1, 1, C, 1, 1), meta))
    for pos_dtype in (i32, i64):
        for topk, ratio in ((512, 4), (1024, 4), (8192, 128)):
            meta = fill_constexprs(topk, ratio, target)
            cases.append(_case(target, f"fill_short.topk{topk}.r{ratio}.{'pos32' if pos_dtype == i32 else 'pos64'}",
                               fill_short_kernel, (Ptr(i32), Ptr(pos_dtype)), (topk, 1, 1), meta))
    return dedupe(cases)
