"""Triton kernels for sparse MLA attention (SPEC §2.1, §3.8): decode over fp8_ds_mla caches and
prefill over a bf16 workspace, one kernel for both.

`sparse_mla_kernel`, program (t, hb, s): query row t (= (b, j) of B x s_q, or a prefill token), the
BLOCK_H heads of head block hb, split s of the row's selected index positions. The heads are the M
dimension of both dots, so every selected row is loaded and dequantised once per (row, head block)
(once per row for Hq <= MAX_BLOCK_H; a decode call of at most SMALL_DECODE_ROWS rows takes blocks of
MIN_BLOCK_H heads, so that its programs cover the GPU, `small_decode`). Each step takes BLOCK_N positions
of the concatenated list [main indices[:len] | extra indices[:len_extra]], loads the valid rows as one
[BLOCK_N, 512] tile (NoPE codes times their UE8M0 scale, RoPE bf16 bits; exact, §2.1) and runs an online
softmax in base 2. Decode rows of at least HALF_TILE_STEPS steps (`half_tiles`: sm_90 and the interpreter) take the
rows as two [BLOCK_N, 256] tiles with an accumulator each (`_step_halves`).
A row whose index is invalid is not loaded. Unsplit, the program writes out/lse (and max_logits);
split, it writes (max, sum, unnormalised output) partials that `combine_kernel` merges, adding the sink.

The sink never enters the running max: out = acc / (l + 2^(z - m)), so z = +inf gives 0, z = NaN gives
NaN, and an empty set (l = 0) gives out 0, lse +inf, max_logits -inf.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import layout, platform
from ..reference.k_cache import fp8_format
from ._launch import FastLauncher, launch_options  # noqa: F401  (ops use kernels.launch_options)
from .attention import device_multiprocessors  # noqa: F401  (ops plan splits with it)
from .attention import _online_weights, _softmax_step, write_out
from .early import pdl_open, pdl_wait
from .fp8 import fp8_decode

SOURCE_FP8, SOURCE_BF16 = 0, 1     # constexpr SOURCE: paged fp8_ds_mla caches (decode), bf16 rows (prefill)
MAX_BLOCK_H = 64                   # heads per program (the acc tile [64, 512] fp32 fills the registers)
MIN_BLOCK_H = 16                   # a dot's smallest M
MAX_SPLITS = 32
PROGRAMS_PER_SM = 1               # one 8-warp program fills an SM's registers (acc [64, 512] fp32)
MIN_TILES_PER_SPLIT = 1
SMALL_DECODE_ROWS = 4             # decode calls of at most this many query rows: 16-head blocks, 32-row steps
SMEM_64_ROW_STEPS = 200 * 1024    # shared memory (bytes) that 64-head blocks with 64-row steps need on NVIDIA (sm_90)
SMEM_64_HEADS = 160 * 1024        # ... with 32-row steps (sm_80); below it (sm_86/89/120: 99 KB), 32-head blocks
# Decode rows of at least HALF_TILE_STEPS steps take each step's rows as two [BLOCK_N, D/2] tiles (`_step_halves`):
# H100, C4A B = 64 70.7 -> 63.5 us, B = 256 204 -> 181 us, B = 1 8.6 -> 8.3 us; SWA-only B = 256 (2 steps) lost,
# 53 -> 62 us (NOTES.md "Sparse MLA decode in two halves"). Measured on sm_90 only; the
# interpreter takes it too, so that the CPU tests run it.
HALF_TILE_STEPS = 4


@triton.jit
def _fp8_rows(cache_ptr, slot, ok, page_stride, BS: tl.constexpr, FMT: tl.constexpr, SW: tl.constexpr,
              BLOCK_N: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, QB: tl.constexpr,
              DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, DOT_DTYPE: tl.constexpr,
              Q0: tl.constexpr = 0, NQB: tl.constexpr = 0):
    """[BLOCK_N, NQB * QB] rows (in DOT_DTYPE) of slots `slot` (int64, valid where ok) of an fp8_ds_mla cache:
    quant blocks [Q0, Q0 + NQB) of each row (NQB = 0: all D // QB), dequantised exactly (codes x 2^(byte - 127)
    for dims < NOPE, RoPE bf16 bits above; every value is a bf16); zeros where not ok. The tile is built as
    [BLOCK_N, NQB, QB] so that each quant block's scale is computed once and broadcast."""
    NB: tl.constexpr = D // QB if NQB == 0 else NQB
    s = tl.where(ok, slot, 0)
    blk = s // BS
    off = s % BS
    page = blk * page_stride
    data = page + off * DATA_BYTES                                        # [N] byte offsets (int64)
    qb = Q0 + tl.arange(0, NB)
    col = qb[:, None] * QB + tl.arange(0, QB)[None, :]                    # [NB, QB] dims
    nope = qb < NOPE // QB
    ok3 = ok[:, None, None]
    codes = tl.load(cache_ptr + data[:, None, None] + col[None, :, :], mask=ok3 & nope[None, :, None], other=0)
    # the token's 8 scale bytes as one word (pointer and page stride are multiples of 8), so that the pipeliner
    # copies it asynchronously with the codes
    tl.static_assert(SCALE_BYTES == 8)
    sword_ptr = (cache_ptr + page + BS * DATA_BYTES + off * SCALE_BYTES).to(tl.pointer_type(tl.int64))
    sword = tl.load(sword_ptr, mask=ok, other=0)
    sbytes = ((sword[:, None] >> (8 * qb[None, :]).to(tl.int64)) & 0xFF).to(tl.int32)
    # 2^(byte - 127) from its bits; byte 0 is the subnormal 2^-127
    scale = tl.where(sbytes == 0, 1 << 22, sbytes << 23).to(tl.float32, bitcast=True)
    nope_val = fp8_decode(codes, FMT, SW) * scale[:, :, None]
    tl.static_assert(D - NOPE == QB)
    if Q0 + NB > NOPE // QB:
        # RoPE bf16 bits: one quant block wide, broadcast into the last block of the tile
        rope_ptr = (cache_ptr + data + NOPE).to(tl.pointer_type(tl.int16))
        rope = tl.load(rope_ptr[:, None] + tl.arange(0, QB)[None, :], mask=ok[:, None], other=0)
        rope_val = (rope.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        val = tl.where(nope[None, :, None], nope_val, rope_val[:, None, :]).to(DOT_DTYPE)
    else:
        val = nope_val.to(DOT_DTYPE)
    return tl.reshape(val, (BLOCK_N, NB * QB))


@triton.jit
def _selected_slots(idx_row, i_s2, pos, n_sel, num_rows):
    """Slots (int64) at positions `pos` of one index list, and which are rows to load: among its n_sel selected
    positions and in [0, num_rows)."""
    in_len = pos < n_sel
    slot = tl.load(idx_row + pos * i_s2, mask=in_len, other=-1).to(tl.int64)
    return slot, in_len & (slot >= 0) & (slot < num_rows)


@triton.jit
def _step(q, m_i, l_i, acc, idx_row, i_s2, pos, n_sel, num_rows, src_ptr, page_stride, d, scale,
          SOURCE: tl.constexpr, BS: tl.constexpr, FMT: tl.constexpr, SW: tl.constexpr, BLOCK_N: tl.constexpr,
          D: tl.constexpr, NOPE: tl.constexpr, QB: tl.constexpr, DATA_BYTES: tl.constexpr,
          SCALE_BYTES: tl.constexpr, DOT_F32: tl.constexpr):
    """Positions `pos` of one index list (n_sel of them selected): load the valid rows and update the
    online softmax (m_i, l_i, acc) of the head rows q."""
    slot, ok = _selected_slots(idx_row, i_s2, pos, n_sel, num_rows)
    DOT_DTYPE: tl.constexpr = tl.float32 if DOT_F32 else tl.bfloat16
    if SOURCE == 0:
        kv = _fp8_rows(src_ptr, slot, ok, page_stride, BS, FMT, SW, BLOCK_N, D, NOPE, QB, DATA_BYTES, SCALE_BYTES,
                       DOT_DTYPE)
    else:
        kv = tl.load(src_ptr + (tl.where(ok, slot, 0) * page_stride)[:, None] + d[None, :], mask=ok[:, None],
                     other=0).to(DOT_DTYPE)
    if DOT_F32:
        s = tl.dot(q, tl.trans(kv), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kv))
    return _softmax_step(s * scale, ok[None, :], kv, m_i, l_i, acc, 1.0, DOT_F32, False, True)


@triton.jit
def _q_dims(q_row, h, q_s2, head_ok, D0: tl.constexpr, WIDTH: tl.constexpr, DOT_F32: tl.constexpr):
    """Dims [D0, D0 + WIDTH) of heads h of one query row (zeros for heads not in head_ok), in fp32 where DOT_F32."""
    q = tl.load(q_row + h[:, None] * q_s2 + (D0 + tl.arange(0, WIDTH))[None, :], mask=head_ok[:, None], other=0)
    if DOT_F32:
        q = q.to(tl.float32)
    return q


@triton.jit
def _step_halves(q0, q1, m_i, l_i, acc0, acc1, idx_row, i_s2, pos, n_sel, num_rows, src_ptr, page_stride, scale,
                 BS: tl.constexpr, FMT: tl.constexpr, SW: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                 NOPE: tl.constexpr, QB: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """`_step` over an fp8_ds_mla cache with the row's dims in two halves: the scores' product of the first half
    can run while the second half is dequantised, and a half's tile at a time is live in registers. acc0 / acc1:
    output dims [0, D/2) / [D/2, D)."""
    slot, ok = _selected_slots(idx_row, i_s2, pos, n_sel, num_rows)
    DOT_DTYPE: tl.constexpr = tl.float32 if DOT_F32 else tl.bfloat16
    HB: tl.constexpr = D // QB // 2
    kv0 = _fp8_rows(src_ptr, slot, ok, page_stride, BS, FMT, SW, BLOCK_N, D, NOPE, QB, DATA_BYTES, SCALE_BYTES,
                    DOT_DTYPE, 0, HB)
    kv1 = _fp8_rows(src_ptr, slot, ok, page_stride, BS, FMT, SW, BLOCK_N, D, NOPE, QB, DATA_BYTES, SCALE_BYTES,
                    DOT_DTYPE, HB, HB)
    if DOT_F32:
        s = tl.dot(q1, tl.trans(kv1), tl.dot(q0, tl.trans(kv0), input_precision="ieee"), input_precision="ieee")
    else:
        s = tl.dot(q1, tl.trans(kv1), tl.dot(q0, tl.trans(kv0)))
    m_new, l_i, p, alpha = _online_weights(tl.where(ok[None, :], s * scale, float("-inf")), m_i, l_i)
    if DOT_F32:
        acc0 = acc0 * alpha[:, None] + tl.dot(p, kv0, input_precision="ieee")
        acc1 = acc1 * alpha[:, None] + tl.dot(p, kv1, input_precision="ieee")
    else:
        acc0 = acc0 * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), kv0)
        acc1 = acc1 * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), kv1)
    return m_new, l_i, acc0, acc1


@triton.jit
def _finish(acc, m_i, l_i, sink_ptr, h, head_ok, SINKS: tl.constexpr):
    """(out rows, lse, max_logits) of finished running state (base-2 max m_i, sum l_i), the sink added."""
    denom = l_i
    if SINKS:
        z = tl.load(sink_ptr + h, mask=head_ok, other=float("-inf")) * 1.4426950408889634
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        denom = l_i + tl.exp2(z - m_safe)
    empty = l_i == 0
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, denom)[:, None])
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    mx = m_i * 0.6931471805599453
    return out, lse, mx


@triton.jit
def _store_rows(o_ptr, o_off, d, head_ok, out, O_BITS: tl.constexpr):
    """out [H, D] fp32 as bf16 at element offsets o_off [H, 1] (+ d); O_BITS (the interpreter, whose fp32 ->
    bf16 truncates): rounded in software."""
    ptrs = o_ptr + o_off + d[None, :]
    if O_BITS:
        write_out(ptrs.to(tl.pointer_type(tl.int16)), out, head_ok[:, None], o_ptr, 1, 0, False)
    else:
        write_out(ptrs, out, head_ok[:, None], o_ptr, 0, 0, False)


@triton.jit
def sparse_mla_kernel(
    q_ptr, src_ptr, idx_ptr, len_ptr, x_src_ptr, x_idx_ptr, x_len_ptr, sink_ptr, o_ptr, lse_ptr, max_ptr, part_ptr,
    s_q, Hq, sm_scale, width, x_width, num_rows, x_num_rows, page_stride, x_page_stride, ml_base,
    q_s0, q_s1, q_s2, i_s0, i_s1, i_s2, x_s0, x_s1, x_s2, len_s, x_len_s, o_s0, o_s1, o_s2,
    lse_s0, lse_s1, lse_s2, max_s0, max_s1,
    SOURCE: tl.constexpr, BS: tl.constexpr, FMT: tl.constexpr, SW: tl.constexpr,
    EXTRA: tl.constexpr, X_BS: tl.constexpr, X_FMT: tl.constexpr, X_SW: tl.constexpr,
    HAS_LEN: tl.constexpr, HAS_X_LEN: tl.constexpr, SINKS: tl.constexpr, SPLIT: tl.constexpr,
    WRITE_MAX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr,
    QB: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, DOT_F32: tl.constexpr,
    O_BITS: tl.constexpr, HALVES: tl.constexpr,
):
    """Program (t, hb, s); see the module docstring. Strides are in elements of each tensor (bytes for
    caches: page_stride; rows for the bf16 source: page_stride is its row stride)."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    b = t // s_q
    j = t % s_q
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = h < Hq
    d = tl.arange(0, D)
    q_row = q_ptr + b * q_s0 + j * q_s1
    scale = sm_scale * 1.4426950408889634

    n_main = width
    if HAS_LEN:
        n_main = tl.minimum(tl.maximum(tl.load(len_ptr + b * len_s), 0), width)
    tiles_main = tl.cdiv(n_main, BLOCK_N)
    tiles = tiles_main
    n_x = 0
    if EXTRA:
        n_x = x_width
        if HAS_X_LEN:
            n_x = tl.minimum(tl.maximum(tl.load(x_len_ptr + b * x_len_s), 0), x_width)
        tiles += tl.cdiv(n_x, BLOCK_N)
    per_split = tl.cdiv(tiles, splits)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, tiles)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    n = tl.arange(0, BLOCK_N)
    idx_row = idx_ptr + b * i_s0 + j * i_s1
    if HALVES:
        q0 = _q_dims(q_row, h, q_s2, head_ok, 0, D // 2, DOT_F32)
        q1 = _q_dims(q_row, h, q_s2, head_ok, D // 2, D // 2, DOT_F32)
        acc0 = tl.zeros((BLOCK_H, D // 2), tl.float32)
        acc1 = tl.zeros((BLOCK_H, D // 2), tl.float32)
        for it in range(t_lo, tl.minimum(t_hi, tiles_main)):
            m_i, l_i, acc0, acc1 = _step_halves(q0, q1, m_i, l_i, acc0, acc1, idx_row, i_s2, it * BLOCK_N + n,
                                                n_main, num_rows, src_ptr, page_stride, scale, BS, FMT, SW, BLOCK_N,
                                                D, NOPE, QB, DATA_BYTES, SCALE_BYTES, DOT_F32)
        if EXTRA:
            x_row = x_idx_ptr + b * x_s0 + j * x_s1
            for it in range(tl.maximum(t_lo, tiles_main), t_hi):
                m_i, l_i, acc0, acc1 = _step_halves(q0, q1, m_i, l_i, acc0, acc1, x_row, x_s2,
                                                    (it - tiles_main) * BLOCK_N + n, n_x, x_num_rows, x_src_ptr,
                                                    x_page_stride, scale, X_BS, X_FMT, X_SW, BLOCK_N, D, NOPE, QB,
                                                    DATA_BYTES, SCALE_BYTES, DOT_F32)
        acc = tl.reshape(tl.permute(tl.join(acc0, acc1), (0, 2, 1)), (BLOCK_H, D))   # [acc0 | acc1]
    else:
        q = _q_dims(q_row, h, q_s2, head_ok, 0, D, DOT_F32)
        acc = tl.zeros((BLOCK_H, D), tl.float32)
        for it in range(t_lo, tl.minimum(t_hi, tiles_main)):
            m_i, l_i, acc = _step(q, m_i, l_i, acc, idx_row, i_s2, it * BLOCK_N + n, n_main, num_rows, src_ptr,
                                  page_stride, d, scale, SOURCE, BS, FMT, SW, BLOCK_N, D, NOPE, QB, DATA_BYTES,
                                  SCALE_BYTES, DOT_F32)
        if EXTRA:
            x_row = x_idx_ptr + b * x_s0 + j * x_s1
            for it in range(tl.maximum(t_lo, tiles_main), t_hi):
                m_i, l_i, acc = _step(q, m_i, l_i, acc, x_row, x_s2, (it - tiles_main) * BLOCK_N + n, n_x,
                                      x_num_rows, x_src_ptr, x_page_stride, d, scale, SOURCE, X_BS, X_FMT, X_SW,
                                      BLOCK_N, D, NOPE, QB, DATA_BYTES, SCALE_BYTES, DOT_F32)

    if SPLIT:
        # partials of (t, h, split): acc at ((t*Hq + h)*splits + split)*D, (max, sum) at ml_base + 2*that row
        prow = (t * Hq + h) * splits + split
        tl.store(part_ptr + prow[:, None] * D + d[None, :], acc, mask=head_ok[:, None])
        tl.store(part_ptr + ml_base + 2 * prow, m_i, mask=head_ok)
        tl.store(part_ptr + ml_base + 2 * prow + 1, l_i, mask=head_ok)
    else:
        out, lse, mx = _finish(acc, m_i, l_i, sink_ptr, h, head_ok, SINKS)
        _store_rows(o_ptr, b * o_s0 + j * o_s1 + h[:, None] * o_s2, d, head_ok, out, O_BITS)
        tl.store(lse_ptr + b * lse_s0 + h * lse_s1 + j * lse_s2, lse, mask=head_ok)
        if WRITE_MAX:
            tl.store(max_ptr + t * max_s0 + h * max_s1, mx, mask=head_ok)


@triton.jit
def combine_kernel(
    sink_ptr, o_ptr, lse_ptr, part_ptr, s_q, Hq, splits, ml_base, o_s0, o_s1, o_s2, lse_s0, lse_s1, lse_s2,
    BLOCK_S: tl.constexpr, D: tl.constexpr, SINKS: tl.constexpr, O_BITS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (t, h): merge the `splits` (<= BLOCK_S) partials of row t, head h exactly (one [BLOCK_S, D]
    tile), add the sink, write out and lse. PDL (sm_90+): launched as a programmatic dependent of the decode kernel
    (its launch overlaps the decode's end), it waits for the partials before its first load."""
    pdl_open(PDL, 0)
    pdl_wait(PDL, 0)
    t = tl.program_id(0).to(tl.int64)
    b = t // s_q
    j = t % s_q
    h = tl.program_id(1) + tl.zeros((1,), tl.int32)
    head_ok = h < Hq
    sp = tl.arange(0, BLOCK_S)
    ok = sp < splits
    prow = (t * Hq + h) * splits + sp                                     # [S]
    m_s = tl.load(part_ptr + ml_base + 2 * prow, mask=ok, other=float("-inf"))
    l_s = tl.load(part_ptr + ml_base + 2 * prow + 1, mask=ok, other=0.0)
    d = tl.arange(0, D)
    a = tl.load(part_ptr + prow[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    m = tl.max(m_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(m_s - m_safe)
    l_i = tl.sum(l_s * w, 0) + tl.zeros((1,), tl.float32)
    acc = tl.sum(a * w[:, None], 0)[None, :]
    out, lse, _ = _finish(acc, m + tl.zeros((1,), tl.float32), l_i, sink_ptr, h, head_ok, SINKS)
    _store_rows(o_ptr, b * o_s0 + j * o_s1 + h[:, None] * o_s2, d, head_ok, out, O_BITS)
    tl.store(lse_ptr + b * lse_s0 + h * lse_s1 + j * lse_s2, lse, mask=head_ok)


SPARSE_LAUNCHER = FastLauncher(sparse_mla_kernel)
COMBINE_LAUNCHER = FastLauncher(combine_kernel)


# --- host-side planning ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Source:
    """One source of rows: a paged fp8_ds_mla cache (block size, fp8 flavour) or bf16 rows (bs 0)."""

    bs: int = 0
    fnuz: bool = False


def small_decode(rows: int) -> bool:
    """A decode call of `rows` (B·s_q) query rows takes the latency plan: heads in blocks of MIN_BLOCK_H and
    32-row steps, so that its few rows still spread over the GPU (H100, NOTES.md "Sparse MLA at small batches")."""
    return rows <= SMALL_DECODE_ROWS


def max_block_h(target: platform.Target) -> int:
    """The most heads per program: MAX_BLOCK_H, or 32 where a program has 99 KB of shared memory (sm_86/89/120)."""
    small_smem = target.backend == "cuda" and platform.shared_memory_limit(target) < SMEM_64_HEADS
    return 32 if small_smem else MAX_BLOCK_H


def block_h(hq: int, target: platform.Target, small: bool = False) -> int:
    """Heads per program: Hq padded to a power of two, at least MIN_BLOCK_H, at most `max_block_h` (MIN_BLOCK_H
    for a `small_decode`)."""
    cap = MIN_BLOCK_H if small else max_block_h(target)
    return min(cap, max(MIN_BLOCK_H, triton.next_power_of_2(max(hq, 1))))


def head_blocks(hq: int, target: platform.Target, small: bool = False) -> int:
    return layout.cdiv(max(hq, 1), block_h(hq, target, small))


def tiles(target: platform.Target, prefill: bool, small: bool = False, split: bool = True) -> dict:
    """BLOCK_N rows per step, warps and stages (`small`: a `small_decode`; `split`: a decode launch of split
    partials), within the target's shared memory (the compile matrix checks each case against it)."""
    if target.backend == "interpreter":
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    if small and not prefill:
        # H100 (NOTES.md, "Sparse MLA at small batches"): twice the splits of shorter steps, no pipelining
        return dict(BLOCK_N=32, num_warps=8, num_stages=1)
    smem = platform.shared_memory_limit(target)
    if target.backend == "hip":
        # 64 KB of LDS on CDNA2/3 holds one 64-row stage at 64 heads; CDNA4 has 160 KB
        return dict(BLOCK_N=64, num_warps=8, num_stages=2 if smem >= SMEM_64_HEADS else 1)
    if smem < SMEM_64_HEADS:
        return dict(BLOCK_N=32, num_warps=4, num_stages=1)       # 32-head blocks: 96 KB on sm_86
    if smem < SMEM_64_ROW_STEPS or (prefill and target.arch != 90):
        return dict(BLOCK_N=32, num_warps=8, num_stages=1)       # sm_80: 128 KB; sm_100 prefill (2 stages: 257 KB)
    # H100 sweeps (benchmarks/NOTES.md, "Sparse MLA" and "Sparse MLA: the scale word"): 64 x 8 warps beat
    # 32/16 rows and 4/16 warps; 3 stages win for unsplit decode launches only (measured on sm_90)
    deep = target.arch == 90 and not (prefill or split)
    return dict(BLOCK_N=64, num_warps=8, num_stages=3 if deep else 2)


def max_splits(rows: int, hq: int, multiprocessor_count: int, target: platform.Target) -> int:
    """The most parts a decode row's selection is split into, from shapes, the target and the SM count: as many
    as keep the programs within one wave of PROGRAMS_PER_SM per multiprocessor (a partial second wave
    would double the time of the first), at least 1, at most MAX_SPLITS."""
    programs = max(rows * head_blocks(hq, target, small_decode(rows)), 1)
    return max(1, min(PROGRAMS_PER_SM * multiprocessor_count // programs, MAX_SPLITS))


def decode_splits(rows: int, hq: int, positions: int, block_n: int, multiprocessor_count: int,
                  target: platform.Target) -> int:
    """Splits of a decode call: `max_splits`, and at least MIN_TILES_PER_SPLIT tiles of the `positions`
    (main + extra index columns) per split."""
    per = layout.cdiv(max(positions, 1), block_n * MIN_TILES_PER_SPLIT)
    return max(1, min(max_splits(rows, hq, multiprocessor_count, target), per))


def workspace_elements(rows: int, hq: int, splits: int) -> tuple[int, int]:
    """(fp32 elements of the split partials, the offset of the (max, sum) pairs): acc rows of D, then pairs."""
    n = rows * hq * splits
    return n * (layout.HEAD_DIM + 2), n * layout.HEAD_DIM


def half_tiles(target: platform.Target, prefill: bool, positions: int, block_n: int) -> bool:
    """Whether a decode launch over rows of `positions` selected positions (main + extra width) takes the
    two-half steps (`HALF_TILE_STEPS`)."""
    measured = target.backend == "interpreter" or (target.backend == "cuda" and target.arch == 90)
    return measured and not prefill and positions >= HALF_TILE_STEPS * block_n


def constexprs(target: platform.Target, main: Source, extra: Source | None, has_len: bool, has_x_len: bool,
               sinks: bool, split: bool, hq: int, prefill: bool, small: bool = False, positions: int = 0) -> dict:
    """Constexprs (with num_warps/num_stages) of `sparse_mla_kernel` (`small`: a `small_decode`; `positions`: the
    index columns of a row, main + extra)."""
    interpret = target.backend == "interpreter"
    small = small and not prefill
    tile = tiles(target, prefill, small, split)

    def codec(src: Source) -> tuple[int, bool]:
        fmt = fp8_format(src.fnuz)
        return fmt.code, not platform.native_fp8(target, fmt)

    fmt, sw = codec(main) if main.bs else (0, False)
    x = extra or Source(main.bs, main.fnuz)
    x_fmt, x_sw = codec(x) if x.bs else (0, False)
    return dict(SOURCE=SOURCE_BF16 if prefill else SOURCE_FP8, BS=main.bs or 1, FMT=fmt, SW=sw,
                EXTRA=extra is not None, X_BS=x.bs or 1, X_FMT=x_fmt, X_SW=x_sw, HAS_LEN=has_len,
                HAS_X_LEN=has_x_len and extra is not None, SINKS=sinks, SPLIT=split, WRITE_MAX=prefill,
                BLOCK_H=block_h(hq, target, small), BLOCK_N=tile["BLOCK_N"], D=layout.HEAD_DIM, NOPE=layout.NOPE_DIM,
                QB=layout.QUANT_BLOCK, DATA_BYTES=layout.TOKEN_DATA_BYTES, SCALE_BYTES=layout.SCALE_BYTES,
                DOT_F32=interpret, O_BITS=interpret, HALVES=half_tiles(target, prefill, positions, tile["BLOCK_N"]),
                num_warps=tile["num_warps"], num_stages=tile["num_stages"])


def combine_constexprs(target: platform.Target, sinks: bool, splits: int) -> dict:
    """The combine tile holds the call's split count padded to a power of two (a function of shapes); PDL where the
    target has programmatic dependent launch."""
    block_s = triton.next_power_of_2(splits)
    return dict(BLOCK_S=block_s, D=layout.HEAD_DIM, SINKS=sinks, O_BITS=target.backend == "interpreter",
                PDL=platform.supports_pdl(target), num_warps=4 if block_s <= 8 else 8)


# --- compile matrix ---------------------------------------------------------------------------------------
def matrix_launch(target: platform.Target, name: str, hq: int, main: Source, extra: Source | None = None,
                  has_len: bool = True, sinks: bool = True, split: bool = False, prefill: bool = False,
                  small: bool = False):
    """What ops/sparse_mla.py passes to sparse_mla_kernel for one call (B 4, s_q 1, contiguous tensors)."""
    from .matrix import Ptr

    rows, width, x_width, nb = 4, 640 if not extra else 128, 512, 16
    meta = launch_options(constexprs(target, main, extra, has_len, has_len, sinks, split, hq, prefill, small,
                                     width + (x_width if extra else 0)))
    d = layout.HEAD_DIM
    src = Ptr(torch.bfloat16) if prefill else Ptr(torch.uint8)
    tensors = (Ptr(torch.bfloat16), src, Ptr(torch.int32), Ptr(torch.int32), src, Ptr(torch.int32),
               Ptr(torch.int32), Ptr(torch.float32), Ptr(torch.bfloat16), Ptr(torch.float32), Ptr(torch.float32),
               Ptr(torch.float32))
    page = d if prefill else layout.ds_mla_block_stride(main.bs)
    x_page = layout.ds_mla_block_stride(extra.bs) if extra else page
    _, ml_base = workspace_elements(rows, hq, 4)
    ints = (1, hq, layout.MLA_SOFTMAX_SCALE, width, x_width if extra else width, nb * max(main.bs, 1),
            nb * (extra.bs if extra else max(main.bs, 1)), page, x_page, ml_base,
            hq * d, hq * d, d, width, width, 1, x_width, x_width, 1, 1, 1, hq * d, hq * d, d, hq, 1, hq, hq, 1)
    return name, tensors, ints, meta


def matrix_launch_combine(target: platform.Target, name: str, hq: int, sinks: bool, splits: int = 4):
    from .matrix import Ptr

    meta = launch_options(combine_constexprs(target, sinks, splits))
    tensors = (Ptr(torch.float32), Ptr(torch.bfloat16), Ptr(torch.float32), Ptr(torch.float32))
    d = layout.HEAD_DIM
    _, ml_base = workspace_elements(4, hq, 4)
    return name, tensors, (1, hq, splits, ml_base, hq * d, hq * d, d, hq, 1, hq), meta


def matrix_cases(target: platform.Target) -> list:
    """Specialisations of the sparse MLA kernels on `target`: decode SWA-only (bs 64), C4A (extra bs 64),
    C128A (extra bs 2), FNUZ and mixed flavours, with/without lengths and sinks, split and unsplit; 64,
    128 and 16 heads; the small-batch tile; prefill over bf16 rows; the combine kernel."""
    from .matrix import dedupe, kernel_case

    def case(fn, launch):
        name, tensors, ints, meta = launch
        return kernel_case(target, f"sparse_mla.{name}", fn, tensors, ints, meta)

    swa, swa_fnuz, c128 = Source(64), Source(64, True), Source(2)
    launches = [
        matrix_launch(target, "decode.swa.h64", 64, swa, has_len=False, sinks=False),
        matrix_launch(target, "decode.c4a.h64.split", 64, swa, Source(64), split=True),
        matrix_launch(target, "decode.c4a.h64.split.small", 64, swa, Source(64), split=True, small=True),
        matrix_launch(target, "decode.c4a.h64", 64, swa, Source(64)),
        matrix_launch(target, "decode.c128a.h128.fnuz", 128, swa_fnuz, c128),
        matrix_launch(target, "decode.c4a.h16.mixed.split", 16, swa, Source(64, True), split=True),
        matrix_launch(target, "prefill.h64", 64, Source(), prefill=True),
        matrix_launch(target, "prefill.h128.nolen.nosink", 128, Source(), has_len=False, sinks=False,
                      prefill=True),
    ]
    cases = [case(sparse_mla_kernel, launch) for launch in launches]
    cases += [case(combine_kernel, matrix_launch_combine(target, f"combine.h{hq}.s{splits}", hq, sinks, splits))
              for hq, sinks, splits in ((64, True, 4), (16, False, 32), (128, True, 2))]
    return dedupe(cases)
