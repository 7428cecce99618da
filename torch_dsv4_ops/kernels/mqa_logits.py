"""Triton kernels for the indexer logits (SPEC §3.9): `fp8_fp4_mqa_logits` (prefill) and
`fp8_fp4_paged_mqa_logits` (decode), plus the zero fill of `get_paged_mqa_logits_metadata`.

Both logits kernels score a tile of BLOCK_N keys against a block of queries with one matrix product per
group of GQ queries x HC heads:

    S^T = K [BLOCK_N, D] @ Q^T [D, GQ*HC]    (fp32 accumulation)
    logits[q, n] = k_scale[n] * sum_h w[q, h] * relu(S^T[n, q*HC + h])

The heads are the MMA's N dimension, so the reduction over heads stays (mostly) inside each thread. The
product runs on fp8 tensor cores where the target has them for the operands' format (`fp8_mma`), else on
16-bit values decoded exactly by kernels/fp8.py (every e4m3 / e4m3fnuz value is a bf16 and an fp16; the paged
decode takes fp16, one hardware conversion per pair of codes where the target has fp8), and in fp32 ("ieee")
under the interpreter, whose 16-bit/fp8 arithmetic is wrong (CONVENTIONS.md).

* `mqa_logits_kernel`, grid (cdiv(M, BQ),): program p owns queries [BQ*blk, BQ*blk + BQ) with blk counted
  from the end (the longest causal ranges start first). Their Q (and weights) stay in registers/shared
  memory while the program walks the key tiles that intersect [min ks', max ke') of its queries; with
  `CLEAN` it also writes -inf over the tiles outside that union.
* `paged_mqa_logits_kernel`, grid (B, splits): program (b, s) owns all next_n x H query rows of request b
  and a contiguous run of key tiles. Where BLOCK_N divides the block size (`PAGE_TILE`: the DSV4 cache's 64),
  a tile is BLOCK_N contiguous rows of one page, found by one table entry, and the kernel pipelines in
  registers: tile t+1's codes (four per int32) and scales load while tile t is scored, and tile t+2's table
  entry one iteration earlier. Other block sizes look up each key's entry. Tiles past the request's longest
  row are never loaded (the last one reads the rest of its page, and stores none of it), and a key whose
  block-table lookup is invalid (SPEC §0: entry < 0 or >= num_blocks, column past the width) is never loaded
  and scores -inf.

Counts, strides, widths and max_model_len are runtime arguments; dims, head padding, tiles, block size,
fp8 formats and flags are constexprs (SPEC §4 h).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layout, platform
from ._launch import FastLauncher, launch_options  # noqa: F401  (ops use kernels.launch_options)
from .fp8 import fp8_decode

# constexpr DOT_MODE: fp8 MMA, decoded fp16 MMA, fp32 ieee (interpreter), decoded bf16 MMA
DOT_FP8, DOT_F16, DOT_F32, DOT_BF16 = 0, 1, 2, 3
PREFILL_DIMS = (32, 64, 128)
MIN_DOT = 16                             # the smallest M/N/K of a tl.dot

# Tiles, swept on an H100 (benchmarks/NOTES.md "Indexer logits"). QH: query rows (queries x padded heads) of
# one product.
PREFILL_TILE = dict(BLOCK_N=128, QH=256, num_warps=4, num_stages=2)
PREFILL_TILE_SMEM = 160 * 1024           # shared memory a program needs for PREFILL_TILE; below it, 128-row products
# Paged: 64-key tiles (one page of the DSV4 indexer cache), pipelined in registers by the kernel itself (one stage).
# An optional "maxnreg" caps the registers (the sweep's; 168 and 128 spilled and lost).
PAGED_TILE = dict(BLOCK_N=64, QH=128, num_warps=4, num_stages=1)
INTERPRETER_TILE = dict(BLOCK_N=16, QH=32, num_warps=4, num_stages=1)
PAGED_PROGRAMS_PER_SM = 8                # decode grid: about this many programs per SM
FILL_BLOCK = 128                         # metadata zero fill: elements per program


# NVIDIA parts whose fp8 MMA keeps fewer mantissa bits than fp32 in its accumulator (DeepSeek-V3 reports ~14 on
# Hopper). Measured on an H100 (NOTES.md): worst error 1.8e-3 of the row's max |logit| against SPEC's 1e-3, and
# 8e-4 at half the speed with a promotion every 32 products; the 16-bit product of the decoded fp8 values is exact
# and accumulates in fp32 (5e-7 with bf16), at 41 % of the fp8 matmul rate. These parts take the decoded path:
# bf16 for the prefill, fp16 for the paged decode (the hardware decodes two fp8 codes to fp16 in one instruction;
# bf16 goes through fp32, four per pair in the paged loop's SASS; yet the prefill measured 39.0 % of the fp8 rate
# with fp16 against 41.7 % with bf16).
FP8_MMA_SHORT_ACCUMULATOR = (89, 90)


def fp8_mma(target: platform.Target, fmt: layout.Fp8Format) -> bool:
    """Whether the logits multiply fp8 operands of format `fmt` on `target`'s tensor cores through tl.dot: NVIDIA
    sm_100+ (e4m3fn; sm_89/sm_90 have fp8 MMA but a short accumulator), gfx942 (e4m3fnuz), gfx950 (e4m3fn)."""
    if target.backend == "cuda":
        return isinstance(target.arch, int) and target.arch >= 89 and target.arch not in FP8_MMA_SHORT_ACCUMULATOR \
            and fmt is layout.E4M3FN
    if target.backend == "hip":
        arch = str(target.arch)
        if arch.startswith("gfx942"):
            return fmt is layout.E4M3FNUZ
        if arch.startswith("gfx950"):
            return fmt is layout.E4M3FN
    return False


def dot_mode(target: platform.Target, q_fmt: layout.Fp8Format, k_fmt: layout.Fp8Format,
             decoded: int = DOT_BF16) -> int:
    """The product path: fp8 MMA where `fp8_mma`, fp32 under the interpreter, else the codes decoded to `decoded`
    (DOT_BF16 or DOT_F16: both exact; the prefill measured faster in bf16 and the paged decode in fp16 on an H100)."""
    if target.backend == "interpreter":
        return DOT_F32
    return DOT_FP8 if q_fmt is k_fmt and fp8_mma(target, q_fmt) else decoded


# --- device helpers ---------------------------------------------------------------------------------------
@triton.jit
def _operand(codes, FMT: tl.constexpr, SW: tl.constexpr, DOT_MODE: tl.constexpr):
    """uint8 fp8 codes -> the dot operand: the fp8 type itself, or its exact value in fp16 / fp32 / bf16."""
    if DOT_MODE == 0:
        if FMT == 1:
            val = codes.to(tl.float8e4nv, bitcast=True)
        else:
            val = codes.to(tl.float8e4b8, bitcast=True)
    elif DOT_MODE == 1:
        val = fp8_decode(codes, FMT, SW, tl.float16)
    elif DOT_MODE == 3:
        val = fp8_decode(codes, FMT, SW).to(tl.bfloat16)
    else:
        val = fp8_decode(codes, FMT, SW)
    return val


@triton.jit
def _load_group(q_ptr, w_ptr, q_base, q_sq, q_sh, w_base, w_sq, w_sh, nq, H, g, c,
                GQ: tl.constexpr, HC: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, SW: tl.constexpr,
                DOT_MODE: tl.constexpr):
    """Query rows (queries g*GQ .. g*GQ+GQ, heads c*HC .. c*HC+HC) as the [GQ*HC, D] operand, and their
    weights [GQ*HC] fp32; rows of queries >= nq or heads >= H are zeros (weight 0)."""
    r = tl.arange(0, GQ * HC)
    qi = g * GQ + r // HC
    h = c * HC + r % HC
    ok = (qi < nq) & (h < H)
    qi64 = qi.to(tl.int64)
    d = tl.arange(0, D)
    codes = tl.load(q_ptr + (q_base + qi64 * q_sq + h * q_sh)[:, None] + d[None, :], mask=ok[:, None], other=0)
    w = tl.load(w_ptr + w_base + qi64 * w_sq + h * w_sh, mask=ok, other=0.0)
    return _operand(codes, FMT, SW, DOT_MODE), w


@triton.jit
def _group_logits(kt, qv, w, BLOCK_N: tl.constexpr, GQ: tl.constexpr, HC: tl.constexpr, DOT_MODE: tl.constexpr):
    """[BLOCK_N, GQ] = sum over the HC heads of w * relu(K Q^T) for one group (no key scale yet)."""
    if DOT_MODE == 2:
        s = tl.dot(kt, tl.trans(qv), input_precision="ieee")
    else:
        s = tl.dot(kt, tl.trans(qv))
    s = tl.maximum(s, 0.0) * w[None, :]
    return tl.sum(tl.reshape(s, (BLOCK_N, GQ, HC)), axis=2)


# --- prefill -----------------------------------------------------------------------------------------------------
@triton.jit
def mqa_logits_kernel(
    q_ptr, k_ptr, scale_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr,
    M, N, H, q_s0, q_s1, k_s0, sc_s0, w_s0, w_s1, ks_s0, ke_s0, o_s0,
    D: tl.constexpr, BQ: tl.constexpr, HC: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
    Q_FMT: tl.constexpr, Q_SW: tl.constexpr, K_FMT: tl.constexpr, K_SW: tl.constexpr, DOT_MODE: tl.constexpr,
    CLEAN: tl.constexpr,
):
    """See the module docstring. BQ queries per program (one group), CHUNKS head chunks of HC."""
    blk = tl.num_programs(0) - 1 - tl.program_id(0)
    m0 = blk.to(tl.int64) * BQ
    nq = M - m0
    qi = tl.arange(0, BQ)
    m_ok = qi < nq
    m = m0 + qi
    ks = tl.load(ks_ptr + m * ks_s0, mask=m_ok, other=0)
    ke = tl.load(ke_ptr + m * ke_s0, mask=m_ok, other=0)
    ks = tl.minimum(tl.maximum(ks, 0), N)
    ke = tl.minimum(tl.maximum(ke, ks), N)
    lo = tl.min(tl.where(m_ok, ks, N), axis=0)
    hi = tl.max(tl.where(m_ok, ke, 0), axis=0)
    t_lo = lo // BLOCK_N
    t_hi = tl.where(hi > lo, tl.cdiv(hi, BLOCK_N), t_lo)
    n_ar = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    out_rows = out_ptr + m * o_s0                                                  # [BQ]
    if CHUNKS == 1:
        qv, w = _load_group(q_ptr, w_ptr, m0 * q_s0, q_s0, q_s1, m0 * w_s0, w_s0, w_s1, nq, H, 0, 0,
                            BQ, HC, D, Q_FMT, Q_SW, DOT_MODE)
    for t in range(t_lo, t_hi):
        n = t * BLOCK_N + n_ar
        n_ok = n < N
        codes = tl.load(k_ptr + n.to(tl.int64)[:, None] * k_s0 + d[None, :], mask=n_ok[:, None], other=0)
        kt = _operand(codes, K_FMT, K_SW, DOT_MODE)
        sc = tl.load(scale_ptr + n * sc_s0, mask=n_ok, other=0.0)
        if CHUNKS == 1:
            acc = _group_logits(kt, qv, w, BLOCK_N, BQ, HC, DOT_MODE)
        else:
            acc = tl.zeros((BLOCK_N, BQ), tl.float32)
            for c in tl.static_range(CHUNKS):
                qc, wc = _load_group(q_ptr, w_ptr, m0 * q_s0, q_s0, q_s1, m0 * w_s0, w_s0, w_s1, nq, H, 0, c,
                                     BQ, HC, D, Q_FMT, Q_SW, DOT_MODE)
                acc += _group_logits(kt, qc, wc, BLOCK_N, BQ, HC, DOT_MODE)
        inside = (n[:, None] >= ks[None, :]) & (n[:, None] < ke[None, :])
        val = tl.where(inside, acc * sc[:, None], float("-inf"))
        tl.store(out_rows[None, :] + n[:, None], val, mask=n_ok[:, None] & m_ok[None, :])
    if CLEAN:
        ninf = tl.full((BLOCK_N, BQ), float("-inf"), tl.float32)
        for t in range(0, t_lo):
            n = t * BLOCK_N + n_ar
            tl.store(out_rows[None, :] + n[:, None], ninf, mask=(n < N)[:, None] & m_ok[None, :])
        for t in range(t_hi, tl.cdiv(N, BLOCK_N)):
            n = t * BLOCK_N + n_ar
            tl.store(out_rows[None, :] + n[:, None], ninf, mask=(n < N)[:, None] & m_ok[None, :])


@triton.jit
def _row_lens(ctx_ptr, b, jg, c_s0, c_s1, NEXT_N: tl.constexpr, LENS_2D: tl.constexpr):
    """Raw key counts of rows jg of request b (unclamped): context_lens[b, j], or ctx_b - next_n + j + 1."""
    ok = jg < NEXT_N
    if LENS_2D:
        lens = tl.load(ctx_ptr + b * c_s0 + jg * c_s1, mask=ok, other=0)
    else:
        lens = tl.load(ctx_ptr + b * c_s0 + jg * 0, mask=ok, other=0) - NEXT_N + 1 + jg
    return lens


# --- paged decode ------------------------------------------------------------------------------------------------
@triton.jit
def _page_entry(bt_ptr, b, bt_s0, bt_s1, t, t_hi, width, num_blocks, BLOCK_N: tl.constexpr, BS: tl.constexpr):
    """Block id (int64) of the page holding tile t (BLOCK_N divides BS), or -1: an invalid entry (< 0, >= num_blocks,
    column past the table's width) or a tile at or past t_hi (nothing is loaded)."""
    col = (t * BLOCK_N) // BS
    blk = tl.load(bt_ptr + b * bt_s0 + col * bt_s1, mask=(t < t_hi) & (col < width), other=-1).to(tl.int64)
    return tl.where((blk >= 0) & (blk < num_blocks), blk, -1)


@triton.jit
def _page_tile(cache_ptr, blk, t, page_stride, k_ar, BLOCK_N: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
               SCALE_BYTES: tl.constexpr):
    """Codes of tile t from page `blk` as int32 [BLOCK_N, D // 4] (4 codes each, packed: a quarter of the registers
    of uint8 codes) and its scales [BLOCK_N] (fp32); zeros when blk < 0. Keys past the request's length inside a
    valid page are read too (never stored)."""
    page = tl.maximum(blk, 0) * page_stride
    row = (t * BLOCK_N) % BS + k_ar
    page_ok = k_ar < tl.where(blk >= 0, BLOCK_N, 0)
    words = (cache_ptr + page + (row * D)[:, None]).to(tl.pointer_type(tl.int32)) + tl.arange(0, D // 4)[None, :]
    codes = tl.load(words, mask=page_ok[:, None], other=0)
    sc = tl.load((cache_ptr + page + BS * D + row * SCALE_BYTES).to(tl.pointer_type(tl.float32)), mask=page_ok,
                 other=0.0)
    return codes, sc


@triton.jit
def _unpack_codes(words, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """int32 [BLOCK_N, D // 4] of 4 little-endian codes each -> uint8 codes [BLOCK_N, D]."""
    even = tl.join((words & 0xFF).to(tl.uint8), ((words >> 16) & 0xFF).to(tl.uint8))       # codes 0, 2
    odd = tl.join(((words >> 8) & 0xFF).to(tl.uint8), ((words >> 24) & 0xFF).to(tl.uint8))   # codes 1, 3
    return tl.reshape(tl.join(even, odd), (BLOCK_N, D))      # [.., a, b] holds code 2a + b


@triton.jit
def _group_lens(ctx_ptr, b, g, max_len, c_s0, c_s1, NEXT_N: tl.constexpr, GQ: tl.constexpr, LENS_2D: tl.constexpr):
    """Clamped key counts [GQ] of the queries of group g of request b (0 past next_n)."""
    jg = g * GQ + tl.arange(0, GQ)
    return tl.where(jg < NEXT_N, tl.minimum(tl.maximum(_row_lens(ctx_ptr, b, jg, c_s0, c_s1, NEXT_N, LENS_2D), 0),
                                            max_len), 0)


@triton.jit
def _store_group(acc, sc, ok, k, len_g, out_ptr, row0, g, max_len, o_s0, NEXT_N: tl.constexpr, GQ: tl.constexpr):
    """Scaled logits [BLOCK_N keys, GQ queries] of group g: -inf for invalid keys and keys past a row's length."""
    jg = g * GQ + tl.arange(0, GQ)
    valid = ok[:, None] & (k[:, None] < len_g[None, :])
    val = tl.where(valid, acc * sc[:, None], float("-inf"))
    tl.store(out_ptr + (row0 + jg).to(tl.int64)[None, :] * o_s0 + k[:, None], val,
             mask=(k < max_len)[:, None] & (jg < NEXT_N)[None, :])


@triton.jit
def _score_tile(codes, sc, ok, k, qv, w, lens, qv1, w1, lens1, q_ptr, w_ptr, ctx_ptr, out_ptr, b, row0, q_base,
                max_len, H, q_s1, q_s2, w_s0, w_s1, c_s0, c_s1, o_s0, NEXT_N: tl.constexpr, GQ: tl.constexpr,
                HC: tl.constexpr, CHUNKS: tl.constexpr, GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                Q_FMT: tl.constexpr, Q_SW: tl.constexpr, K_FMT: tl.constexpr, K_SW: tl.constexpr,
                DOT_MODE: tl.constexpr, LENS_2D: tl.constexpr):
    """Logits of one key tile (keys k, valid where `ok`) for every query row of request b, stored to out. Up to two
    (group, chunk) products use the resident (qv, w) and (qv1, w1), with lens / lens1 the groups' key counts;
    more reload their query rows per tile."""
    kt = _operand(codes, K_FMT, K_SW, DOT_MODE)
    if GROUPS * CHUNKS <= 2:                   # resident: (group 0, chunk 0), and group 1 or chunk 1
        acc = _group_logits(kt, qv, w, BLOCK_N, GQ, HC, DOT_MODE)
        if CHUNKS == 2:
            acc += _group_logits(kt, qv1, w1, BLOCK_N, GQ, HC, DOT_MODE)
        _store_group(acc, sc, ok, k, lens, out_ptr, row0, 0, max_len, o_s0, NEXT_N, GQ)
        if GROUPS == 2:
            _store_group(_group_logits(kt, qv1, w1, BLOCK_N, GQ, HC, DOT_MODE), sc, ok, k, lens1, out_ptr, row0, 1,
                         max_len, o_s0, NEXT_N, GQ)
    else:
        for g in tl.static_range(GROUPS):
            acc = tl.zeros((BLOCK_N, GQ), tl.float32)
            for c in tl.static_range(CHUNKS):
                qc, wc = _load_group(q_ptr, w_ptr, q_base, q_s1, q_s2, row0 * w_s0, w_s0, w_s1, NEXT_N, H, g,
                                     c, GQ, HC, D, Q_FMT, Q_SW, DOT_MODE)
                acc += _group_logits(kt, qc, wc, BLOCK_N, GQ, HC, DOT_MODE)
            _store_group(acc, sc, ok, k, _group_lens(ctx_ptr, b, g, max_len, c_s0, c_s1, NEXT_N, GQ, LENS_2D),
                         out_ptr, row0, g, max_len, o_s0, NEXT_N, GQ)


@triton.jit
def paged_mqa_logits_kernel(
    q_ptr, cache_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr,
    max_len, H, num_blocks, page_stride, bt_width, bt_rows, tiles_per_split,
    q_s0, q_s1, q_s2, w_s0, w_s1, c_s0, c_s1, bt_s0, bt_s1, o_s0,
    NEXT_N: tl.constexpr, BQ: tl.constexpr, GQ: tl.constexpr, HC: tl.constexpr, CHUNKS: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, SCALE_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    Q_FMT: tl.constexpr, Q_SW: tl.constexpr, K_FMT: tl.constexpr, K_SW: tl.constexpr, DOT_MODE: tl.constexpr,
    LENS_2D: tl.constexpr, CLEAN: tl.constexpr, PAGE_TILE: tl.constexpr,
):
    """See the module docstring. The BQ (>= next_n) query rows of request b form BQ // GQ groups of GQ
    queries, each split into CHUNKS head chunks of HC."""
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    GROUPS: tl.constexpr = BQ // GQ
    j = tl.arange(0, BQ)
    j_ok = j < NEXT_N
    hi = tl.max(_group_lens(ctx_ptr, b, 0, max_len, c_s0, c_s1, NEXT_N, BQ, LENS_2D), axis=0)   # all BQ rows
    t0 = split * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(max_len, BLOCK_N))
    t_hi = tl.minimum(tl.maximum(tl.cdiv(hi, BLOCK_N), t0), t1)
    width = tl.where(b < bt_rows, bt_width, 0)                       # a request without a table row: no keys
    k_ar = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    row0 = b * NEXT_N
    q_base = b * q_s0
    # the query rows and weights of up to two (group, chunk) products stay resident (_score_tile reloads more)
    qv, w = _load_group(q_ptr, w_ptr, q_base, q_s1, q_s2, row0 * w_s0, w_s0, w_s1, NEXT_N, H, 0, 0,
                        GQ, HC, D, Q_FMT, Q_SW, DOT_MODE)
    lens0 = _group_lens(ctx_ptr, b, 0, max_len, c_s0, c_s1, NEXT_N, GQ, LENS_2D)
    if GROUPS * CHUNKS == 2:
        qv1, w1 = _load_group(q_ptr, w_ptr, q_base, q_s1, q_s2, row0 * w_s0, w_s0, w_s1, NEXT_N, H, GROUPS - 1,
                              CHUNKS - 1, GQ, HC, D, Q_FMT, Q_SW, DOT_MODE)
        lens1 = _group_lens(ctx_ptr, b, GROUPS - 1, max_len, c_s0, c_s1, NEXT_N, GQ, LENS_2D)
    else:
        qv1, w1, lens1 = qv, w, lens0
    if PAGE_TILE:
        # Software pipeline in registers (one Triton stage): tile t+1's codes and scales are loaded before
        # tile t is scored, and tile t+2's table entry one iteration earlier still.
        blk = _page_entry(bt_ptr, b, bt_s0, bt_s1, t0, t_hi, width, num_blocks, BLOCK_N, BS)
        blk_next = _page_entry(bt_ptr, b, bt_s0, bt_s1, t0 + 1, t_hi, width, num_blocks, BLOCK_N, BS)
        codes, sc = _page_tile(cache_ptr, blk, t0, page_stride, k_ar, BLOCK_N, BS, D, SCALE_BYTES)
        for t in range(t0, t_hi):
            blk_after = _page_entry(bt_ptr, b, bt_s0, bt_s1, t + 2, t_hi, width, num_blocks, BLOCK_N, BS)
            codes_next, sc_next = _page_tile(cache_ptr, blk_next, t + 1, page_stride, k_ar, BLOCK_N, BS, D,
                                             SCALE_BYTES)
            k = t * BLOCK_N + k_ar
            ok = (k < hi) & (k_ar < tl.where(blk >= 0, BLOCK_N, 0))
            _score_tile(_unpack_codes(codes, BLOCK_N, D), sc, ok, k, qv, w, lens0, qv1, w1, lens1, q_ptr, w_ptr,
                        ctx_ptr, out_ptr, b, row0, q_base, max_len, H, q_s1, q_s2, w_s0, w_s1, c_s0, c_s1, o_s0, NEXT_N,
                        GQ, HC, CHUNKS, GROUPS, D, BLOCK_N, Q_FMT, Q_SW, K_FMT, K_SW, DOT_MODE, LENS_2D)
            codes, sc, blk, blk_next = codes_next, sc_next, blk_next, blk_after
    else:
        for t in range(t0, t_hi):
            k = t * BLOCK_N + k_ar
            col = k // BS
            off = k % BS
            col_ok = (k < hi) & (col < width)
            blk = tl.load(bt_ptr + b * bt_s0 + col * bt_s1, mask=col_ok, other=-1).to(tl.int64)
            ok = col_ok & (blk >= 0) & (blk < num_blocks)
            page = tl.where(ok, blk, 0) * page_stride
            codes = tl.load(cache_ptr + (page + off * D)[:, None] + d[None, :], mask=ok[:, None], other=0)
            sc = tl.load((cache_ptr + page + BS * D + off * SCALE_BYTES).to(tl.pointer_type(tl.float32)), mask=ok,
                         other=0.0)
            _score_tile(codes, sc, ok, k, qv, w, lens0, qv1, w1, lens1, q_ptr, w_ptr, ctx_ptr, out_ptr, b, row0,
                        q_base, max_len, H, q_s1, q_s2, w_s0, w_s1, c_s0, c_s1, o_s0, NEXT_N, GQ, HC, CHUNKS, GROUPS,
                        D, BLOCK_N, Q_FMT, Q_SW, K_FMT, K_SW, DOT_MODE, LENS_2D)
    if CLEAN:
        for t in range(t_hi, t1):
            k = t * BLOCK_N + k_ar
            ninf = tl.full((BLOCK_N, BQ), float("-inf"), tl.float32)
            tl.store(out_ptr + (row0 + j).to(tl.int64)[None, :] * o_s0 + k[:, None], ninf,
                     mask=(k < max_len)[:, None] & j_ok[None, :])


# --- get_paged_mqa_logits_metadata ----------------------------------------------------------------------------
@triton.jit
def zero_fill_kernel(out_ptr, rows, s0, s1, COLS: tl.constexpr, BLOCK: tl.constexpr):
    """out[r, c] = 0 for r < rows, c < COLS (int32)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    r = i // COLS
    c = i % COLS
    tl.store(out_ptr + r * s0 + c * s1, tl.zeros((BLOCK,), tl.int32), mask=r < rows)


PREFILL_LAUNCHER = FastLauncher(mqa_logits_kernel)
PAGED_LAUNCHER = FastLauncher(paged_mqa_logits_kernel)
FILL_LAUNCHER = FastLauncher(zero_fill_kernel)


# --- host-side planning -----------------------------------------------------------------------------------------
def _tile(target: platform.Target, paged: bool) -> dict:
    if target.backend == "interpreter":
        return dict(INTERPRETER_TILE)
    if paged:
        return dict(PAGED_TILE)
    if platform.shared_memory_limit(target) < PREFILL_TILE_SMEM:
        # 256-row products of one head need 144 KB on sm_86 (99 KB) and 80 KB on gfx942 (64 KB); 128 rows 80 / 48 KB
        return dict(PREFILL_TILE, QH=128)
    return dict(PREFILL_TILE)


def head_split(heads: int, queries: int, qh: int) -> tuple[int, int, int]:
    """(GQ, HC, CHUNKS) for `queries` (a power of two) queries of `heads` heads and products of about `qh`
    rows: HC = heads padded to a power of two, cut into CHUNKS chunks when one query alone exceeds qh;
    GQ queries per product (a power of two dividing `queries`); GQ*HC >= MIN_DOT."""
    hp = triton.next_power_of_2(max(heads, 1))
    hc = min(hp, qh)
    chunks = hp // hc
    gq = max(1, min(queries, qh // hc))
    hc = max(hc, MIN_DOT // gq) if chunks == 1 else hc
    return gq, hc, chunks


def prefill_queries(heads: int, target: platform.Target) -> int:
    """BQ, the queries of one prefill program: enough to fill a product of QH rows (one if a query has more)."""
    tile = _tile(target, False)
    return max(1, tile["QH"] // triton.next_power_of_2(max(heads, 1)))


def prefill_constexprs(target: platform.Target, dim: int, heads: int, q_fmt, k_fmt, clean: bool) -> dict:
    """Constexprs (with num_warps/num_stages) of `mqa_logits_kernel`."""
    tile = _tile(target, False)
    bq = prefill_queries(heads, target)
    gq, hc, chunks = head_split(heads, bq, tile["QH"])
    return dict(D=dim, BQ=gq, HC=hc, CHUNKS=chunks, BLOCK_N=tile["BLOCK_N"],
                Q_FMT=q_fmt.code, Q_SW=not platform.native_fp8(target, q_fmt), K_FMT=k_fmt.code,
                K_SW=not platform.native_fp8(target, k_fmt), DOT_MODE=dot_mode(target, q_fmt, k_fmt), CLEAN=clean,
                num_warps=tile["num_warps"], num_stages=tile["num_stages"])


def prefill_runtime_args(m: int, n: int, heads: int, q_strides, k_s0: int, sc_s0: int, w_strides, ks_s0: int,
                         ke_s0: int, o_s0: int) -> tuple:
    """The int arguments after the 7 tensors (q, k as uint8; k_scale, weights fp32; ks, ke int32; out fp32)."""
    return (m, n, heads, q_strides[0], q_strides[1], k_s0, sc_s0, w_strides[0], w_strides[1], ks_s0, ke_s0, o_s0)


def paged_constexprs(target: platform.Target, next_n: int, heads: int, block_size: int, q_fmt, k_fmt,
                     lens_2d: bool, clean: bool) -> dict:
    """Constexprs (with num_warps/num_stages) of `paged_mqa_logits_kernel`."""
    tile = _tile(target, True)
    bq = triton.next_power_of_2(max(next_n, 1))
    gq, hc, chunks = head_split(heads, bq, tile["QH"])
    return dict(NEXT_N=next_n, BQ=bq, GQ=gq, HC=hc, CHUNKS=chunks, D=layout.INDEXER_DIM, BS=block_size,
                SCALE_BYTES=layout.INDEXER_SCALE_BYTES, BLOCK_N=tile["BLOCK_N"],
                Q_FMT=q_fmt.code, Q_SW=not platform.native_fp8(target, q_fmt), K_FMT=k_fmt.code,
                K_SW=not platform.native_fp8(target, k_fmt), DOT_MODE=dot_mode(target, q_fmt, k_fmt, DOT_F16),
                LENS_2D=lens_2d, CLEAN=clean, PAGE_TILE=block_size % tile["BLOCK_N"] == 0, num_warps=tile["num_warps"],
                num_stages=tile["num_stages"], **({"maxnreg": tile["maxnreg"]} if tile.get("maxnreg") else {}))


def paged_splits(batch: int, max_len: int, target: platform.Target, multiprocessor_count: int) -> tuple[int, int]:
    """(splits, tiles per split) of a decode call, from host ints only: about PAGED_PROGRAMS_PER_SM programs
    per SM over the B requests, each a contiguous run of key tiles."""
    tiles = layout.cdiv(max_len, _tile(target, True)["BLOCK_N"])
    want = layout.cdiv(PAGED_PROGRAMS_PER_SM * multiprocessor_count, max(batch, 1))
    per = layout.cdiv(tiles, max(1, min(want, tiles)))
    return layout.cdiv(tiles, per), per


def paged_runtime_args(max_len: int, heads: int, num_blocks: int, page_stride: int, bt_width: int, bt_rows: int,
                       tiles_per_split: int, q_strides, w_strides, c_strides, bt_strides, o_s0: int) -> tuple:
    """The int arguments after the 6 tensors (q, cache as uint8; weights fp32; context_lens int32; table; out)."""
    return (max_len, heads, num_blocks, page_stride, bt_width, bt_rows, tiles_per_split, q_strides[0],
            q_strides[1], q_strides[2], w_strides[0], w_strides[1], c_strides[0], c_strides[1], bt_strides[0],
            bt_strides[1], o_s0)


def fill_constexprs(target: platform.Target) -> dict:
    return dict(COLS=2, BLOCK=FILL_BLOCK, num_warps=platform.num_warps_for(target, FILL_BLOCK))


# --- compile matrix ---------------------------------------------------------------------------------------------
def _fmt(fnuz: bool) -> layout.Fp8Format:
    return layout.E4M3FNUZ if fnuz else layout.E4M3FN


def matrix_launch_prefill(target: platform.Target, dim: int, heads: int, q_fnuz: bool = False,
                          k_fnuz: bool = False, clean: bool = True):
    """What ops/mqa_logits.py passes to mqa_logits_kernel (M 4096, N 8192, contiguous tensors)."""
    from .matrix import Ptr

    meta = launch_options(prefill_constexprs(target, dim, heads, _fmt(q_fnuz), _fmt(k_fnuz), clean))
    m, n = 4096, 8192
    ints = prefill_runtime_args(m, n, heads, (heads * dim, dim), dim, 1, (heads, 1), 1, 1, n)
    name = (f"mqa_logits.prefill.d{dim}.h{heads}" + (".qfnuz" if q_fnuz else "") + (".kfnuz" if k_fnuz else "")
            + ("" if clean else ".dirty"))
    tensors = (Ptr(torch.uint8), Ptr(torch.uint8), Ptr(torch.float32), Ptr(torch.float32), Ptr(torch.int32),
               Ptr(torch.int32), Ptr(torch.float32))
    return name, tensors, ints, meta


def matrix_launch_paged(target: platform.Target, next_n: int, heads: int = 64, block_size: int = 64,
                        fnuz: bool = False, lens_2d: bool = True, clean: bool = True, table_dtype=torch.int32):
    """What ops/mqa_logits.py passes to paged_mqa_logits_kernel (B 64, max_model_len 16384, engine pages)."""
    from .matrix import Ptr

    meta = launch_options(paged_constexprs(target, next_n, heads, block_size, _fmt(fnuz), _fmt(fnuz), lens_2d,
                                           clean))
    d = layout.INDEXER_DIM
    max_len, width = 16384, 16384 // block_size
    stride = layout.round_up(layout.indexer_block_bytes(block_size), layout.PAGE_ALIGN)
    ints = paged_runtime_args(max_len, heads, 64 * width, stride, width, 64, 16, (next_n * heads * d, heads * d, d),
                              (heads, 1), (next_n, 1) if lens_2d else (1, 0), (width, 1), max_len)
    name = (f"mqa_logits.paged.n{next_n}.h{heads}.bs{block_size}" + (".fnuz" if fnuz else "")
            + ("" if lens_2d else ".lens1d") + ("" if clean else ".dirty")
            + ("" if table_dtype == torch.int32 else ".table64"))
    tensors = (Ptr(torch.uint8), Ptr(torch.uint8), Ptr(torch.float32), Ptr(torch.int32), Ptr(table_dtype),
               Ptr(torch.float32))
    return name, tensors, ints, meta


def matrix_launch_fill(target: platform.Target):
    from .matrix import Ptr

    return "mqa_logits.metadata_fill", (Ptr(torch.int32),), (133, 2, 1), launch_options(fill_constexprs(target))


def matrix_cases(target: platform.Target) -> list:
    """Every specialisation the logits ops launch on `target`: prefill D 32/64/128 with 64 heads, 1, 4 and
    256 heads (head chunks), OCP/FNUZ/mixed operands, clean or not; paged next_n 1/2/4 (one or several query
    groups), 64 and 1 heads, bs 64/16, FNUZ, 1-D lengths, int64 tables, clean or not; the metadata fill."""
    from .matrix import dedupe, kernel_case

    def case(fn, launch):
        name, tensors, ints, meta = launch
        return kernel_case(target, name, fn, tensors, ints, meta)

    prefill = [matrix_launch_prefill(target, dim, 64) for dim in PREFILL_DIMS]
    prefill += [matrix_launch_prefill(target, 128, h) for h in (1, 4, 256)]
    prefill += [matrix_launch_prefill(target, 128, 64, True, True), matrix_launch_prefill(target, 128, 64, True),
                matrix_launch_prefill(target, 64, 64, False, True, False),
                matrix_launch_prefill(target, 128, 64, clean=False)]
    paged = [matrix_launch_paged(target, n) for n in (1, 2, 4)]
    paged += [matrix_launch_paged(target, 1, heads=1), matrix_launch_paged(target, 2, block_size=16),
              matrix_launch_paged(target, 2, fnuz=True), matrix_launch_paged(target, 2, lens_2d=False),
              matrix_launch_paged(target, 2, clean=False), matrix_launch_paged(target, 2, table_dtype=torch.int64)]
    cases = [case(mqa_logits_kernel, launch) for launch in prefill]
    cases += [case(paged_mqa_logits_kernel, launch) for launch in paged]
    cases.append(case(zero_fill_kernel, matrix_launch_fill(target)))
    return dedupe(cases)
