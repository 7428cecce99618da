"""Triton kernels for paged attention over head-major flash caches (SPEC §2.3, §3.7).

`prefill_kernel` (context_attention_fwd): program (g, t, i) computes BLOCK_Q query rows (tile T - 1 - t of
T; program (t, g, i), tile t, when there are more tiles than a grid's second axis holds) of request
R - 1 - i for HEADS query heads of one kv head (the rows of a tile are (query, head) pairs, so a K/V tile
loaded once serves every query head of its group), first over the cached keys, then over the dense
new keys, with an online softmax in base 2.
`decode_kernel` (the qlen == 1 requests of chunked_prefill_paged_decode): program (r, kvh, s) takes
split s of request r's visible keys for all query heads of kv head kvh; with one split it writes
the output, otherwise partial (max, sum, unnormalised output) rows that `combine_kernel` merges.

Keys outside the range a program can see are never loaded. Inside a tile, K of an invalid key (invalid
block, past the table or the context) is not loaded, and its V row is read from a page that exists
(its own, or block 0) and zeroed, so unused cache pages may hold anything, NaN included. Ints that vary per step (token, request and table sizes) are runtime
arguments; structural sizes and feature flags are constexprs (SPEC §4 h).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from .. import layout, platform
from ._launch import FastLauncher, launch_options  # noqa: F401  (ops use kernels.launch_options)
from . import early
from .early import TOUCH, early_load, pdl_open, pdl_wait, touch
from .fp8 import bf16_bits_rne, fp8_decode, fp8_encode

# How the output is stored (constexpr O_KIND)
O_NATIVE, O_BF16_BITS, O_FP8 = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Numerics:
    """Compile-time numeric choices of one call."""

    kv_fp8: int = layout.NOT_FP8      # fp8 format code of the cache, 0 for a float cache
    kv_sw: bool = False               # decode cache codes with the software codec
    dot_f32: bool = False             # dots in fp32 (the interpreter; fp32 q anywhere)
    o_kind: int = O_NATIVE
    o_fp8: int = layout.NOT_FP8       # fp8 format code of the output for O_FP8
    o_sw: bool = False                # encode the output with the software codec


def make_numerics(q_dtype, kv_fmt: layout.Fp8Format | None, o_dtype, target: platform.Target) -> Numerics:
    """Choose the conversions for q's dtype, the cache's fp8 format (or None) and the output dtype."""
    interpret = target.backend == "interpreter"
    o_fmt = layout.FP8_BY_DTYPE.get(o_dtype)
    if o_fmt is not None:
        o_kind, o_code, o_sw = O_FP8, o_fmt.code, not platform.native_fp8(target, o_fmt)
    elif o_dtype == torch.bfloat16 and interpret:
        o_kind, o_code, o_sw = O_BF16_BITS, layout.NOT_FP8, False
    else:
        o_kind, o_code, o_sw = O_NATIVE, layout.NOT_FP8, False
    fp8 = kv_fmt is not None
    return Numerics(kv_fp8=kv_fmt.code if fp8 else layout.NOT_FP8,
                    kv_sw=fp8 and not platform.native_fp8(target, kv_fmt),
                    dot_f32=interpret or q_dtype == torch.float32,
                    o_kind=o_kind, o_fp8=o_code, o_sw=o_sw)


def output_view(o_dtype, numerics: Numerics):
    """The dtype the launcher views the output as (fp8 as uint8, software-rounded bf16 as int16)."""
    if numerics.o_kind == O_FP8:
        return torch.uint8
    if numerics.o_kind == O_BF16_BITS:
        return torch.int16
    return o_dtype


def cache_view(cache_dtype):
    """fp8 caches are passed as uint8 codes."""
    return torch.uint8 if cache_dtype in layout.FP8_BY_DTYPE else cache_dtype


# --- shared device functions -------------------------------------------------------------------------
@triton.jit
def _block_ids(table_ptr, t_row, col, ok, t_s1, W, num_blocks, cache_base, page_bytes, TABLE_PTR: tl.constexpr):
    """Block ids of table columns `col` of the row at `t_row` (0 where invalid), and which keys are
    valid: `ok`, inside the table, and an id in [0, num_blocks) (a pointer table: a positive address
    of a page). The id does not depend on `ok`, so all keys of one column share it."""
    col_ok = col < W
    entry = tl.load(table_ptr + t_row + col * t_s1, mask=col_ok, other=-1).to(tl.int64)
    return _entry_block(entry, col_ok, ok, num_blocks, cache_base, page_bytes, TABLE_PTR)


@triton.jit
def _entry_block(entry, col_ok, ok, num_blocks, cache_base, page_bytes, TABLE_PTR: tl.constexpr):
    """(block id, 0 where invalid; valid & ok) of table entries (int64) read where col_ok: an id in [0, num_blocks),
    or a pointer table's positive page address (`_block_ids`)."""
    if TABLE_PTR:
        rel = entry - cache_base
        rel_ok = col_ok & (entry > 0) & (rel >= 0)
        blk = tl.where(rel_ok, rel, 0) // page_bytes
    else:
        rel_ok = col_ok & (entry >= 0)
        blk = entry
    valid = rel_ok & (blk < num_blocks)
    return tl.where(valid, blk, 0), valid & ok


@triton.jit
def _tile_block_ids(table_ptr, t_row, kp, k0, t_s1, W, num_blocks, cache_base, page_bytes, BS: tl.constexpr,
                    NB: tl.constexpr, TABLE_PTR: tl.constexpr):
    """`_block_ids` of the keys kp = k0 + arange(n) of a whole tile that spans NB blocks from the block of k0 (k0
    a multiple of BS, or of n inside one block): one scalar table load per block, and each key takes its block's
    id by selects, where the per-key lookup loads an entry for every key and moves the ids between layouts."""
    col0 = (t_row * 0).to(tl.int32) + k0 // BS      # tensors (interpreter: masks must be int1 tensors)
    zero = (kp - k0) * 0
    # `col0 >= 0` (always true) is the lookups' own mask: an int1 tensor where the interpreter needs one
    b0, ok0 = _block_ids(table_ptr, t_row, col0, col0 >= 0, t_s1, W, num_blocks, cache_base, page_bytes, TABLE_PTR)
    blk = zero + b0
    ok = (zero + ok0.to(tl.int32)) != 0
    if NB > 1:
        kb = (kp - k0) // BS
        for b in tl.static_range(1, NB):
            bb, okb = _block_ids(table_ptr, t_row, col0 + b, col0 >= 0, t_s1, W, num_blocks, cache_base,
                                 page_bytes, TABLE_PTR)
            blk = tl.where(kb == b, bb, blk)
            ok = tl.where(kb == b, okb.to(tl.int32), ok.to(tl.int32)) != 0
    return blk, ok


@triton.jit
def _codes(x, KV_FP8: tl.constexpr, KV_SW: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Cache values in the dot dtype. fp8 codes are converted unscaled, exactly (every e4m3/e5m2 value
    is a bf16 and an fp16 value); the per-tensor scales multiply the scores and the probabilities."""
    if KV_FP8 != 0 and DOT_DTYPE == tl.float16:
        y = fp8_decode(x, KV_FP8, KV_SW, tl.float16)
    elif KV_FP8 != 0:
        y = fp8_decode(x, KV_FP8, KV_SW).to(DOT_DTYPE)
    else:
        y = x.to(DOT_DTYPE)
    return y


@triton.jit
def _online_weights(s, m_i, l_i):
    """One online-softmax update (base 2) of the running max m_i and sum l_i [M] by scores s [M, N]: (new max,
    new sum, weights p [M, N], the old state's factor alpha [M])."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _softmax_step(s, vis, v, m_i, l_i, acc, p_scale, DOT_F32: tl.constexpr, P_SCALED: tl.constexpr,
                  MASKED: tl.constexpr):
    """One online-softmax step (base 2): scores s [M, N] (already scaled by log2 e), masked by vis where
    MASKED, values v [N, D] in the dot dtype, multiplied by p_scale (the V scale of an fp8 cache) when
    P_SCALED."""
    if MASKED:
        s = tl.where(vis, s, float("-inf"))
    m_new, l_i, p, alpha = _online_weights(s, m_i, l_i)
    if P_SCALED:
        p = p * p_scale
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _to_f16_rows(q):
    """Rows of bf16 q as fp16 times a power of two per row (largest |element| in [2^14, 2^15)), and the
    inverse powers [M, 1]. Exact for elements at least 2^-31 of their row's largest; smaller ones move by
    under 2^-39 of it, far below the fp32 accumulator's own rounding. NaN and inf stay; rows whose largest
    is below 2^-112 (all-zero rows too) get 2^126."""
    qf = q.to(tl.float32)
    e = (tl.max(tl.abs(qf), 1).to(tl.int32, bitcast=True) >> 23) & 0xFF    # the biased exponent of the row max
    e = tl.minimum(tl.maximum(e, 15), 254)
    up = ((268 - e) << 23).to(tl.float32, bitcast=True)                     # 2^(14 - (e - 127))
    down = ((e - 14) << 23).to(tl.float32, bitcast=True)
    return (qf * up[:, None]).to(tl.float16), down[:, None]


@triton.jit
def _scores(q, kt, DOT_F32: tl.constexpr):
    if DOT_F32:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    return s


@triton.jit
def _cache_tile(kc_ptr, vc_ptr, kp, key_ok, blk, kvh, d, num_blocks,
                kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2,
                D: tl.constexpr, BS: tl.constexpr, X: tl.constexpr, K_STD: tl.constexpr, V_RUN: tl.constexpr,
                KV_FP8: tl.constexpr, KV_SW: tl.constexpr, DOT_DTYPE: tl.constexpr, K_GROUPS: tl.constexpr,
                WHOLE: tl.constexpr):
    """K^T [BLOCK_D, N] and V [N, BLOCK_D] of keys kp (in blocks blk) from head-major caches; keys
    not in key_ok are zeros. V_RUN > 0: the tile's keys are runs of V_RUN consecutive
    offsets of one block each, starting at multiples of V_RUN elements (vector loads of V). WHOLE: key_ok
    is the blocks' validity alone (every key of the tile inside the range), so it is uniform over each run
    and V's load zero-fills the invalid keys itself (no pass over V in registers)."""
    k_raw, v = _cache_loads(kc_ptr, vc_ptr, kp, key_ok, blk, kvh, d, num_blocks, kc_s0, kc_s1, kc_s2, kc_s3,
                            vc_s0, vc_s1, vc_s2, D, BS, X, K_STD, V_RUN, K_GROUPS, WHOLE)
    return _cache_values(k_raw, v, key_ok, KV_FP8, KV_SW, DOT_DTYPE, K_STD, K_GROUPS, not WHOLE)


@triton.jit
def _cache_values(k_raw, v, key_ok, KV_FP8: tl.constexpr, KV_SW: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  K_STD: tl.constexpr, K_GROUPS: tl.constexpr, ZERO_V: tl.constexpr):
    """K^T [BLOCK_D, N] and V [N, BLOCK_D] in the dot dtype from `_cache_loads`' raw tiles (ZERO_V: V rows of
    keys not in key_ok zeroed here)."""
    if K_STD and K_GROUPS:
        BLOCK_N: tl.constexpr = k_raw.shape[1]
        kt = tl.reshape(tl.permute(k_raw, (0, 2, 1)), (k_raw.shape[0] * k_raw.shape[2], BLOCK_N))
    else:
        kt = k_raw
    if ZERO_V:
        if tl.min(key_ok.to(tl.int32), 0) == 0:   # a tile with an invalid key (the last one, as a rule)
            v = tl.where(key_ok[:, None], v, 0)
    kt = _codes(kt, KV_FP8, KV_SW, DOT_DTYPE)
    v = _codes(v, KV_FP8, KV_SW, DOT_DTYPE)
    return kt, v


@triton.jit
def _cache_loads(kc_ptr, vc_ptr, kp, key_ok, blk, kvh, d, num_blocks,
                 kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2,
                 D: tl.constexpr, BS: tl.constexpr, X: tl.constexpr, K_STD: tl.constexpr, V_RUN: tl.constexpr,
                 K_GROUPS: tl.constexpr, V_KEYS: tl.constexpr):
    """The loads of `_cache_tile`, as loaded: K as [d group, key, x] (K_STD and K_GROUPS) or [BLOCK_D, N], V as
    [N, BLOCK_D]. V_KEYS: V is masked by key_ok too (zeros for invalid keys; key_ok must be uniform over each V_RUN
    run for vector loads)."""
    off = (kp % BS).to(tl.int32)
    d_ok = d < D
    if K_STD and K_GROUPS:
        # stride(3) == x, stride(4) == 1: load [d group, key, x] so that a warp's lanes run along the keys of
        # one d group (x-element pieces of consecutive keys are adjacent: whole 32-byte sectors per request;
        # the decode kernel's choice: the prefill's larger dot tiles measured slower with it)
        BLOCK_D: tl.constexpr = d.shape[0]
        dg = tl.arange(0, BLOCK_D // X)
        dx = tl.arange(0, X)
        kt = tl.load(kc_ptr + (blk * kc_s0 + kvh * kc_s1 + off * X)[None, :, None] + (dg * kc_s2)[:, None, None]
                     + dx[None, None, :], mask=(dg < D // X)[:, None, None] & key_ok[None, :, None], other=0)
    else:
        if K_STD:   # x-element runs the compiler can vectorise
            k_in = (d // X)[:, None] * kc_s2 + (off * X)[None, :] + (d % X)[:, None]
        else:
            k_in = (d // X)[:, None] * kc_s2 + (off * kc_s3)[None, :] + (d % X)[:, None]
        kt = tl.load(kc_ptr + (blk * kc_s0 + kvh * kc_s1)[None, :] + k_in, mask=d_ok[:, None] & key_ok[None, :],
                     other=0)
    v_row = blk * vc_s0 + kvh * vc_s1 + off
    # no per-key mask (a mask that varies along a run prevents vector loads): every key's address is
    # inside a page (an invalid key's block is 0, which exists when num_blocks > 0), and invalid keys
    # are zeroed after the load, so NaN in pages outside the context never reaches the output
    v_d_ok = d < tl.where(num_blocks > 0, D, 0)
    if V_RUN > 0:   # the block id comes from a load, so the compiler cannot see these runs itself
        v_row = tl.max_contiguous(tl.multiple_of(v_row, V_RUN), V_RUN)
    if V_KEYS:
        v_ok = key_ok[:, None] & v_d_ok[None, :]
    else:
        v_ok = v_d_ok[None, :]
    v = tl.load(vc_ptr + v_row[:, None] + d[None, :] * vc_s2, mask=v_ok, other=0)
    return kt, v


@triton.jit
def _visible(qp, kp, key_ok, row_ok, CAUSAL: tl.constexpr, SW: tl.constexpr):
    """[M, N] mask: row valid, key valid, causal (kp <= qp) and inside the window (qp - kp < SW)."""
    vis = row_ok[:, None] & key_ok[None, :]
    if CAUSAL:
        vis = vis & (kp[None, :] <= qp[:, None])
    if SW > 0:
        vis = vis & (qp[:, None] - kp[None, :] < SW)
    return vis


@triton.jit
def write_out(ptrs, out, mask, o_scale_ptr, O_KIND: tl.constexpr, O_FP8: tl.constexpr, O_SW: tl.constexpr):
    """Store fp32 `out` as the output kind: O_FP8 codes of out / scale, bf16 bits rounded in software (ptrs
    to int16), or the pointers' own dtype."""
    if O_KIND == 2:
        inv = 1.0 / tl.load(o_scale_ptr)
        tl.store(ptrs, fp8_encode(out * inv, O_FP8, O_SW), mask=mask)
    elif O_KIND == 1:
        tl.store(ptrs, bf16_bits_rne(out), mask=mask)
    else:
        tl.store(ptrs, out.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _store_out(o_ptr, o_rows, h, d, row_ok, acc, l_i, o_scale_ptr, o_s1, o_s2, D: tl.constexpr, O_KIND: tl.constexpr,
               O_FP8: tl.constexpr, O_SW: tl.constexpr):
    """acc / l (0 where no key was visible) into rows o_rows (element offsets) of heads h."""
    out = tl.where((l_i > 0)[:, None], acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    ptrs = o_ptr + o_rows[:, None] + (h * o_s1)[:, None] + d[None, :] * o_s2
    write_out(ptrs, out, row_ok[:, None] & (d < D)[None, :], o_scale_ptr, O_KIND, O_FP8, O_SW)


@triton.jit
def _init_rows(sinks_ptr, h, row_ok, BLOCK_M: tl.constexpr, SINKS: tl.constexpr):
    """Running max and sum of each row: the sink's logit (base 2) and exp(0) = 1, or -inf and 0."""
    if SINKS:
        sink = tl.load(sinks_ptr + h, mask=row_ok, other=float("-inf")) * 1.4426950408889634
        m_i = sink
        l_i = tl.where(sink == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
    return m_i, l_i


@triton.jit
def _cache_step(q, m_i, l_i, acc, qp, row_ok, kp, in_range, scale, slope, p_scale,
                table_ptr, t_row, t_s1, W, num_blocks, cache_base, page_bytes, kc_ptr, vc_ptr, kvh, d,
                kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2,
                D: tl.constexpr, BS: tl.constexpr, X: tl.constexpr, K_STD: tl.constexpr, V_RUN: tl.constexpr,
                TABLE_PTR: tl.constexpr, KV_FP8: tl.constexpr, KV_SW: tl.constexpr, DOT_DTYPE: tl.constexpr,
                DOT_F32: tl.constexpr, CAUSAL: tl.constexpr, SW: tl.constexpr, ALIBI: tl.constexpr,
                P_SCALED: tl.constexpr, K_GROUPS: tl.constexpr, MASK: tl.constexpr, WHOLE: tl.constexpr,
                k0=0, TILE_BLOCKS: tl.constexpr = 0):
    """One tile of cached keys kp (those in_range; WHOLE: in_range is a true scalar, see `_cache_tile`): their
    blocks (TILE_BLOCKS > 0: a whole tile of that many blocks from key k0 on, `_tile_block_ids`), K and V, the
    scores (times `scale`, plus ALiBi), the mask (MASK as in `_tile_update`), and the online-softmax update of
    (m_i, l_i, acc)."""
    if TILE_BLOCKS > 0:
        blk, key_ok = _tile_block_ids(table_ptr, t_row, kp, k0, t_s1, W, num_blocks, cache_base, page_bytes, BS,
                                      TILE_BLOCKS, TABLE_PTR)
    else:
        blk, key_ok = _block_ids(table_ptr, t_row, kp // BS, in_range, t_s1, W, num_blocks, cache_base, page_bytes,
                                 TABLE_PTR)
    kt, v = _cache_tile(kc_ptr, vc_ptr, kp, key_ok, blk, kvh, d, num_blocks, kc_s0, kc_s1, kc_s2, kc_s3, vc_s0,
                        vc_s1, vc_s2, D, BS, X, K_STD, V_RUN, KV_FP8, KV_SW, DOT_DTYPE, K_GROUPS, WHOLE)
    return _tile_update(q, kt, v, m_i, l_i, acc, qp, row_ok, kp, key_ok, scale, slope, p_scale, DOT_F32, CAUSAL, SW,
                        ALIBI, P_SCALED, MASK)


@triton.jit
def _tile_update(q, kt, v, m_i, l_i, acc, qp, row_ok, kp, key_ok, scale, slope, p_scale, DOT_F32: tl.constexpr,
                 CAUSAL: tl.constexpr, SW: tl.constexpr, ALIBI: tl.constexpr, P_SCALED: tl.constexpr,
                 MASK: tl.constexpr):
    """The scores of a loaded tile (K^T kt, V v of keys kp, valid in key_ok; times `scale`, plus ALiBi), the
    mask, and the online-softmax update of (m_i, l_i, acc). MASK 2: rows, keys, causal and window (`_visible`);
    1: keys only, for tiles whose valid keys every row may see (rows outside row_ok are never stored); 0: none."""
    s = _scores(q, kt, DOT_F32) * scale
    if ALIBI:
        s += slope[:, None] * (kp - qp[:, None]).to(tl.float32)
    if MASK == 2:
        vis = _visible(qp, kp, key_ok, row_ok, CAUSAL, SW)
    else:
        vis = key_ok[None, :]
    return _softmax_step(s, vis, v, m_i, l_i, acc, p_scale, DOT_F32, P_SCALED, MASK != 0)


@triton.jit
def _cache_loop(q, m_i, l_i, acc, qp, row_ok, t_lo, t_hi, s_hi, scale, slope, p_scale,
                table_ptr, t_row, t_s1, W, num_blocks, cache_base, page_bytes, kc_ptr, vc_ptr, kvh, d,
                kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2,
                D: tl.constexpr, BS: tl.constexpr, X: tl.constexpr, K_STD: tl.constexpr, V_RUN: tl.constexpr,
                BLOCK_N: tl.constexpr, TABLE_PTR: tl.constexpr, KV_FP8: tl.constexpr, KV_SW: tl.constexpr,
                DOT_DTYPE: tl.constexpr, DOT_F32: tl.constexpr, CAUSAL: tl.constexpr, SW: tl.constexpr,
                ALIBI: tl.constexpr, P_SCALED: tl.constexpr, K_GROUPS: tl.constexpr, LOOP: tl.constexpr,
                CHUNK: tl.constexpr, CHUNK_COLS: tl.constexpr, MASK: tl.constexpr, TILE_IDS: tl.constexpr = False):
    """The online softmax over cached-key tiles [t_lo, t_hi) (keys below s_hi). LOOP (module constants):
    LOOP_PIPELINE, Triton's pipeline with each tile's block ids loaded in its own iteration (the pipeline then
    issues a tile's copies only once its table load has returned); LOOP_TABLE_CHUNKS, the block ids of CHUNK
    tiles (CHUNK_COLS table columns) loaded before those tiles' loop, in which no load feeds an address, so that
    Triton's pipeline issues the K/V copies stages ahead. MASK as in `_tile_update`."""
    n = tl.arange(0, BLOCK_N)
    # TILE_IDS: whole tiles of LOOP_PIPELINE load one table entry per block where a tile spans at most
    # MAX_TILE_BLOCKS blocks (`_tile_block_ids`)
    TILE_BLOCKS: tl.constexpr = (BLOCK_N // BS if BLOCK_N % BS == 0 and BLOCK_N // BS <= MAX_TILE_BLOCKS
                                 else 1 if BS % BLOCK_N == 0 else 0) if TILE_IDS else 0
    # tiles whose keys all lie below s_hi, then the last one (the only one with keys past the range)
    whole_hi = tl.minimum(tl.maximum(s_hi // BLOCK_N, t_lo), t_hi)
    if LOOP == 1:   # LOOP_TABLE_CHUNKS
        cc = tl.arange(0, CHUNK_COLS)
        for c0 in range(t_lo, whole_hi, CHUNK):
            col0 = (c0 * BLOCK_N) // BS
            ids, ids_ok = _block_ids(table_ptr, t_row, col0 + cc, cc >= 0, t_s1, W, num_blocks, cache_base,
                                     page_bytes, TABLE_PTR)
            ids = tl.where(ids_ok, ids, -1)     # the block id of each column, -1 where invalid
            for it in range(c0, tl.minimum(c0 + CHUNK, whole_hi)):
                kp = it * BLOCK_N + n
                g = tl.gather(ids, kp // BS - col0, 0)
                if V_RUN > 0:   # one block per run: V's mask is uniform over its vector loads
                    g = tl.max_constancy(g, V_RUN)
                key_ok = g >= 0
                blk = tl.maximum(g, 0)
                kt, v = _cache_tile(kc_ptr, vc_ptr, kp, key_ok, blk, kvh, d, num_blocks, kc_s0, kc_s1, kc_s2,
                                    kc_s3, vc_s0, vc_s1, vc_s2, D, BS, X, K_STD, V_RUN, KV_FP8, KV_SW, DOT_DTYPE,
                                    K_GROUPS, True)
                m_i, l_i, acc = _tile_update(q, kt, v, m_i, l_i, acc, qp, row_ok, kp, key_ok, scale, slope,
                                             p_scale, DOT_F32, CAUSAL, SW, ALIBI, P_SCALED, MASK)
    else:
        for it in range(t_lo, whole_hi):
            m_i, l_i, acc = _cache_step(q, m_i, l_i, acc, qp, row_ok, it * BLOCK_N + n, it >= 0, scale, slope,
                                        p_scale, table_ptr, t_row, t_s1, W, num_blocks, cache_base, page_bytes,
                                        kc_ptr, vc_ptr, kvh, d, kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2, D,
                                        BS, X, K_STD, V_RUN, TABLE_PTR, KV_FP8, KV_SW, DOT_DTYPE, DOT_F32, CAUSAL,
                                        SW, ALIBI, P_SCALED, K_GROUPS, MASK, True, it * BLOCK_N, TILE_BLOCKS)
    for it in range(whole_hi, t_hi):
        kp = it * BLOCK_N + n
        m_i, l_i, acc = _cache_step(q, m_i, l_i, acc, qp, row_ok, kp, kp < s_hi, scale, slope, p_scale,
                                    table_ptr, t_row, t_s1, W, num_blocks, cache_base, page_bytes, kc_ptr,
                                    vc_ptr, kvh, d, kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2, D, BS, X,
                                    K_STD, V_RUN, TABLE_PTR, KV_FP8, KV_SW, DOT_DTYPE, DOT_F32, CAUSAL, SW, ALIBI,
                                    P_SCALED, K_GROUPS, MASK, False)
    return m_i, l_i, acc


@triton.jit
def _dense_step(q, m_i, l_i, acc, j, j_hi, m, row_ok, q0, kvh, d, scale, slope, k_ptr, v_ptr, k_s0, k_s1, k_s2,
                v_s0, v_s1, v_s2, D: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_F32: tl.constexpr,
                CAUSAL: tl.constexpr, SW: tl.constexpr, ALIBI: tl.constexpr, MASK: tl.constexpr):
    """One tile of dense new keys j (token q0 + j, valid below j_hi and from token 0) for rows m. Dense key j
    and row m compare by index (positions ctx + j and ctx + m: no int64). MASK 0: every key of the tile is
    valid and visible to every row (nothing is masked, not even the loads)."""
    if MASK == 0:
        key_ok = j >= 0
        k_mask = (d < D)[:, None]
        v_mask = (d < D)[None, :]
    else:
        key_ok = (j < j_hi) & (q0 + j >= 0)
        k_mask = (d < D)[:, None] & key_ok[None, :]
        v_mask = key_ok[:, None] & (d < D)[None, :]
    kt = tl.load(k_ptr + ((q0 + j) * k_s0 + kvh * k_s1)[None, :] + d[:, None] * k_s2, mask=k_mask,
                 other=0).to(DOT_DTYPE)
    v = tl.load(v_ptr + ((q0 + j) * v_s0 + kvh * v_s1)[:, None] + d[None, :] * v_s2, mask=v_mask,
                other=0).to(DOT_DTYPE)
    return _tile_update(q, kt, v, m_i, l_i, acc, m, row_ok, j, key_ok, scale, slope, 1.0, DOT_F32, CAUSAL, SW, ALIBI,
                        False, MASK)


# --- prefill -------------------------------------------------------------------------------------------
@triton.jit
def prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, kc_ptr, vc_ptr, table_ptr, qsl_ptr, seq_ptr, k_scale_ptr, v_scale_ptr,
    o_scale_ptr, alibi_ptr, sinks_ptr,
    T, max_input_len, sm_scale, W, num_blocks, cache_base, page_bytes,
    q_s0, q_s1, q_s2, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, o_s0, o_s1, o_s2,
    kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2, t_s0, t_s1, seq_s,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, X: tl.constexpr, K_STD: tl.constexpr,
    V_RUN: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SW: tl.constexpr, CAUSAL: tl.constexpr, ALIBI: tl.constexpr, SINKS: tl.constexpr,
    KV_CACHE: tl.constexpr, MIN_QLEN: tl.constexpr, TABLE_PTR: tl.constexpr,
    KV_FP8: tl.constexpr, KV_SW: tl.constexpr, DOT_F32: tl.constexpr, O_KIND: tl.constexpr, O_FP8: tl.constexpr,
    O_SW: tl.constexpr, TILE_IDS: tl.constexpr, TILES_LAST_FIRST: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * HEADS
    DOT_DTYPE: tl.constexpr = tl.float32 if DOT_F32 else q_ptr.dtype.element_ty
    # one request's programs are adjacent in launch order, so they run together and read its K/V tiles from
    # L2 rather than each from memory. TILES_LAST_FIRST (prefill_grid): program (g, t, i) with the request's last
    # q tiles (the most keys under a causal mask) first, each beside its head groups, so that the shorter tiles
    # fill in behind them as SMs free up; else program (t, g, i), q tiles in order
    if TILES_LAST_FIRST:
        tile = tl.num_programs(1) - 1 - tl.program_id(1)
        grp = tl.program_id(0)
    else:
        tile = tl.program_id(0)
        grp = tl.program_id(1)
    PARTS: tl.constexpr = (GROUP + HEADS - 1) // HEADS
    kvh = grp // PARTS
    hg = (grp % PARTS) * HEADS
    # the last request first: a serving batch puts its decodes (which this kernel skips) before its prefills,
    # so the programs with work launch first and the ones that exit at once fill in behind them
    r = (tl.num_programs(2) - 1 - tl.program_id(2)).to(tl.int64)

    q0 = tl.load(qsl_ptr + r).to(tl.int64)
    qlen = tl.load(qsl_ptr + r + 1).to(tl.int64) - q0
    seq = tl.load(seq_ptr + r * seq_s).to(tl.int64)
    ctx = seq - qlen
    qlen = tl.where(qlen >= MIN_QLEN, qlen, 0)          # requests this call does not process: no rows
    if tile * BLOCK_Q >= tl.minimum(qlen, max_input_len):
        return                                          # no row of this program is in the request
    t_row = r * t_s0

    i = tl.arange(0, BLOCK_M)
    m = tile * BLOCK_Q + i // HEADS
    hl = hg + i % HEADS
    h = kvh * GROUP + hl
    tok = q0 + m
    row_ok = (m < qlen) & (m < max_input_len) & (hl < GROUP) & (tok >= 0) & (tok < T)
    # positions in int32: a query position below -1 sees what -1 sees (no cached key when causal; every
    # key inside a window), and ALiBi needs causal, so clamping changes no result; masked rows may clamp
    qp = tl.minimum(tl.maximum(ctx + m, -1), 2147483647).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + (tok * q_s0 + h * q_s1)[:, None] + d[None, :] * q_s2, mask=row_ok[:, None] & (d < D)[None, :],
                other=0).to(DOT_DTYPE)
    scale = sm_scale * 1.4426950408889634
    cache_scale = scale
    v_scale = 1.0
    if KV_FP8 != 0:
        cache_scale = scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    slope = 0.0
    if ALIBI:
        slope = tl.load(alibi_ptr + h, mask=row_ok, other=0) * 1.4426950408889634
    m_i, l_i = _init_rows(sinks_ptr, h, row_ok, BLOCK_M, SINKS)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    # the rows' positions bound the keys: [lowest visible, highest visible]
    m_first = tile * BLOCK_Q
    m_last = tl.minimum(m_first + BLOCK_Q, tl.minimum(qlen, max_input_len)) - 1
    any_row = m_last >= m_first
    # cached keys: positions [0, ctx), or [0, seq) when K/V come from the cache only
    hi = seq if KV_CACHE else ctx
    hi = tl.minimum(hi, W * BS)                          # past the table every key is invalid
    if CAUSAL:
        hi = tl.minimum(hi, ctx + m_last + 1)
    lo = 0
    if SW > 0:
        lo = tl.maximum(ctx + m_first - SW + 1, 0)
    # a negative range (hostile lengths: seq < qlen) is empty; negative positions would index the table before
    # its row (tile starts round toward zero), and an int64 one below INT32_MIN would wrap in the cast below
    hi = tl.maximum(tl.where(any_row, hi, 0), 0)
    n = tl.arange(0, BLOCK_N)
    # tile indices, not key offsets, drive the loop: start = it * BLOCK_N is then known to the
    # compiler as a multiple of BLOCK_N, so a block's run of keys is contiguous (vector loads)
    hi = hi.to(tl.int32)                                 # positions < W * BS <= INT32_MAX (validated)
    lo = tl.minimum(lo, hi).to(tl.int32)
    # without a window, a cached key below ctx is visible to every row (all rows sit at ctx or later): the
    # tiles need only the keys' own validity (KV_CACHE: the cache holds the new keys too, causal applies)
    CACHE_MASK: tl.constexpr = 2 if KV_CACHE or SW > 0 else 1
    m_i, l_i, acc = _cache_loop(q, m_i, l_i, acc, qp, row_ok, lo // BLOCK_N, tl.cdiv(hi, BLOCK_N), hi, cache_scale,
                                slope, v_scale, table_ptr, t_row, t_s1, W, num_blocks, cache_base, page_bytes, kc_ptr,
                                vc_ptr, kvh, d, kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2, D, BS, X, K_STD, V_RUN,
                                BLOCK_N, TABLE_PTR, KV_FP8, KV_SW, DOT_DTYPE, DOT_F32, CAUSAL, SW, ALIBI, KV_FP8 != 0,
                                False, 0, 1, 1, CACHE_MASK, TILE_IDS)

    if not KV_CACHE:
        # dense new keys j (position ctx + j, token q0 + j); rows outside [0, T) are masked
        j_hi = tl.minimum(qlen, T - q0)
        if CAUSAL:
            j_hi = tl.minimum(j_hi, m_last + 1)
        j_lo = tl.maximum(-q0, 0)
        if SW > 0:
            j_lo = tl.maximum(j_lo, m_first - SW + 1)
        j_hi = tl.where(any_row, j_hi, 0).to(tl.int32)     # j < T
        j_lo = tl.minimum(j_lo, j_hi).to(tl.int32)
        # whole tiles of keys every row sees (below the first row when causal; no window; from key 0) take no
        # mask; the rest (the diagonal, the tail) the full one
        full_end = j_lo // BLOCK_N
        if SW == 0:
            j_all = j_hi
            if CAUSAL:
                j_all = tl.minimum(j_all, m_first)
            full_end = tl.where(j_lo == 0, j_all // BLOCK_N, full_end)
        for it in range(j_lo // BLOCK_N, full_end):
            m_i, l_i, acc = _dense_step(q, m_i, l_i, acc, it * BLOCK_N + n, j_hi, m, row_ok, q0, kvh, d, scale, slope,
                                        k_ptr, v_ptr, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, D, DOT_DTYPE, DOT_F32,
                                        CAUSAL, SW, ALIBI, 0)
        for it in range(full_end, tl.cdiv(j_hi, BLOCK_N)):
            m_i, l_i, acc = _dense_step(q, m_i, l_i, acc, it * BLOCK_N + n, j_hi, m, row_ok, q0, kvh, d, scale, slope,
                                        k_ptr, v_ptr, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, D, DOT_DTYPE, DOT_F32,
                                        CAUSAL, SW, ALIBI, 2)

    _store_out(o_ptr, tok * o_s0, h, d, row_ok, acc, l_i, o_scale_ptr, o_s1, o_s2, D, O_KIND, O_FP8, O_SW)


# --- decode ----------------------------------------------------------------------------------------------
@triton.jit
def _decode_request(qsl_ptr, seq_ptr, r, T, seq_s, EARLY: tl.constexpr = False):
    """(is_decode, q0, seq) of request r: a query of length 1 at token q0 in [0, T), its sequence length seq
    (int64). EARLY: read by `early_load`, before `gdc_wait`."""
    if EARLY:
        q0 = early_load(qsl_ptr + r, r >= 0).to(tl.int64)
        qlen = early_load(qsl_ptr + r + 1, r >= 0).to(tl.int64) - q0
        seq = early_load(seq_ptr + r * seq_s, r >= 0).to(tl.int64)
    else:
        q0 = tl.load(qsl_ptr + r).to(tl.int64)
        qlen = tl.load(qsl_ptr + r + 1).to(tl.int64) - q0
        seq = tl.load(seq_ptr + r * seq_s).to(tl.int64)
    return (qlen == 1) & (q0 >= 0) & (q0 < T), q0, seq


@triton.jit
def _split_tiles(is_decode, seq, split, splits, W, BS: tl.constexpr, BLOCK_N: tl.constexpr, SW: tl.constexpr):
    """Split `split` of `splits` of a decode's visible keys [lo, hi): tiles [t_lo, t_hi) of BLOCK_N keys (tile-aligned
    chunks), and s_hi, the end of its keys (int32)."""
    hi = tl.minimum(seq, W * BS)
    lo = 0
    if SW > 0:
        lo = tl.maximum(seq - SW, 0)
    # positions < W * BS <= INT32_MAX (validated); a negative length is an empty range (`prefill_kernel`)
    hi = tl.maximum(tl.where(is_decode, hi, 0), 0).to(tl.int32)
    lo = tl.minimum(lo, hi).to(tl.int32)
    first = lo // BLOCK_N
    tiles = tl.maximum(tl.cdiv(hi, BLOCK_N) - first, 0)
    per_split = tl.cdiv(tiles, splits)
    t_lo = first + split * per_split
    t_hi = tl.minimum(t_lo + per_split, first + tiles)
    return t_lo, t_hi, tl.minimum(t_hi * BLOCK_N, hi)


@triton.jit
def _early_blocks(table_ptr, t_row, kp, s_hi, t_s1, W, num_blocks, cache_base, page_bytes, BS: tl.constexpr,
                  TABLE_PTR: tl.constexpr):
    """`_block_ids` of keys kp (valid below s_hi) read by `early_load`, before `gdc_wait`: (block id, valid)."""
    col_ok = (kp < s_hi) & (kp // BS < W)
    entry = early_load(table_ptr + t_row + (kp // BS) * t_s1, col_ok)
    return _entry_block(entry.to(tl.int64), col_ok, col_ok, num_blocks, cache_base, page_bytes, TABLE_PTR)


@triton.jit
def _decode_touch(qsl_ptr, seq_ptr, table_ptr, kc_ptr, vc_ptr, r, kvh, split, splits, T, W, num_blocks, cache_base,
                  page_bytes, t_row, t_s1, seq_s, kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2, D: tl.constexpr,
                  BLOCK_D: tl.constexpr, BS: tl.constexpr, X: tl.constexpr, K_STD: tl.constexpr,
                  BLOCK_N: tl.constexpr, SW: tl.constexpr, TABLE_PTR: tl.constexpr, LOOP: tl.constexpr,
                  CHUNK_COLS: tl.constexpr, TILES: tl.constexpr):
    """Before `gdc_wait` (kernels/early.py): the program's request, split and block ids by `early_load` (the
    kernel's own `_decode_request` and `_split_tiles`; LOOP_TABLE_CHUNKS: the first chunk's table columns, as the
    loop loads them), then a `touch` of the sectors of K and V (kv head kvh) of its first TILES tiles:
    K by pieces of X codes, two keys a sector; V by dims, a run of up to 16 keys each. Nothing here reaches the
    output; every touched address lies in a valid block of the caches (keys below s_hi, which excludes negative
    positions, as in the kernel's loop)."""
    is_decode, q0, seq = _decode_request(qsl_ptr, seq_ptr, r, T, seq_s, True)
    t_lo, t_hi, s_hi = _split_tiles(is_decode, seq, split, splits, W, BS, BLOCK_N, SW)
    k_lo = t_lo * BLOCK_N
    if LOOP == 1:   # LOOP_TABLE_CHUNKS: the columns of the loop's first table load
        cc = tl.arange(0, CHUNK_COLS)
        early_load(table_ptr + t_row + ((k_lo // BS) + cc) * t_s1, (t_hi > t_lo) & ((k_lo // BS) + cc < W))
    KEYS: tl.constexpr = TILES * BLOCK_N
    tl.static_assert(KEYS >= 16)
    kp = k_lo + tl.arange(0, KEYS // 2) * 2              # K: every other key (X = 16 fp8 codes: two keys a sector)
    g = tl.arange(0, BLOCK_D // X)
    blk, ok = _early_blocks(table_ptr, t_row, kp, s_hi, t_s1, W, num_blocks, cache_base, page_bytes, BS, TABLE_PTR)
    off = kp % BS
    if K_STD:
        k_at = blk * kc_s0 + kvh * kc_s1 + off * X
    else:
        k_at = blk * kc_s0 + kvh * kc_s1 + off * kc_s3
    touch(kc_ptr + k_at[:, None] + (g * kc_s2)[None, :], ok[:, None] & (g * X < D)[None, :])
    kv = k_lo + tl.arange(0, KEYS // 16) * 16            # V: the first key of each 16-key run
    d = tl.arange(0, BLOCK_D)
    blk, ok = _early_blocks(table_ptr, t_row, kv, s_hi, t_s1, W, num_blocks, cache_base, page_bytes, BS, TABLE_PTR)
    v_at = blk * vc_s0 + kvh * vc_s1 + kv % BS
    touch(vc_ptr + v_at[:, None] + (d * vc_s2)[None, :], ok[:, None] & (d < D)[None, :])


@triton.jit
def decode_kernel(
    q_ptr, o_ptr, kc_ptr, vc_ptr, table_ptr, qsl_ptr, seq_ptr, k_scale_ptr, v_scale_ptr, o_scale_ptr,
    alibi_ptr, sinks_ptr, part_ptr,
    T, sm_scale, W, num_blocks, cache_base, page_bytes,
    q_s0, q_s1, q_s2, o_s0, o_s1, o_s2, kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2, t_s0, t_s1, seq_s,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, X: tl.constexpr, K_STD: tl.constexpr,
    V_RUN: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    SW: tl.constexpr, ALIBI: tl.constexpr, SINKS: tl.constexpr, TABLE_PTR: tl.constexpr,
    KV_FP8: tl.constexpr, KV_SW: tl.constexpr, DOT_F32: tl.constexpr, O_KIND: tl.constexpr, O_FP8: tl.constexpr,
    O_SW: tl.constexpr, LOOP: tl.constexpr, CHUNK: tl.constexpr, CHUNK_COLS: tl.constexpr, K_GROUPS: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr = 0, TOUCH_TILES: tl.constexpr = 0,
):
    """Program (r, kvh, s): split s of the visible keys of decode request r (query length 1), for the
    GROUP query heads of kv head kvh (rows padded to BLOCK_H). LOOP, CHUNK, CHUNK_COLS: the cached-key loop
    (`_cache_loop`). K_GROUPS:
    K loads as [d group, key, x] (`_cache_loads`), else as K^T [BLOCK_D, N]. PDL (sm_90+): launched as a
    programmatic dependent, it waits for its predecessor's writes before its first load; EARLY (kernels/early.py,
    `decode_tiles`' `early`): with TOUCH, its first TOUCH_TILES tiles' sectors are touched before that wait
    (`_decode_touch`)."""
    # fp8 caches: fp16 dots (codes convert to fp16 in one instruction per pair; bf16 q is rescaled, below)
    DOT_DTYPE: tl.constexpr = tl.float32 if DOT_F32 else tl.float16 if KV_FP8 != 0 else q_ptr.dtype.element_ty
    r = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)     # a runtime count (SPEC §4 h); SPLIT: whether there is more than one
    t_row = r * t_s0
    pdl_open(PDL, EARLY)
    if PDL and EARLY & TOUCH:
        _decode_touch(qsl_ptr, seq_ptr, table_ptr, kc_ptr, vc_ptr, r, kvh, split, splits, T, W, num_blocks,
                      cache_base, page_bytes, t_row, t_s1, seq_s, kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2, D,
                      BLOCK_D, BS, X, K_STD, BLOCK_N, SW, TABLE_PTR, LOOP, CHUNK_COLS, TOUCH_TILES)
    pdl_wait(PDL, EARLY)
    is_decode, q0, seq = _decode_request(qsl_ptr, seq_ptr, r, T, seq_s)

    hl = tl.arange(0, BLOCK_H)
    h = kvh * GROUP + hl
    row_ok = hl < tl.where(is_decode, GROUP, 0)       # a tensor mask (interpreter)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + q0 * q_s0 + (h * q_s1)[:, None] + d[None, :] * q_s2, mask=row_ok[:, None] & (d < D)[None, :],
                other=0)
    qp = tl.zeros((BLOCK_H,), tl.int32) + tl.maximum(seq - 1, -1).to(tl.int32)   # seq <= INT32_MAX
    scale = sm_scale * 1.4426950408889634
    if KV_FP8 != 0:
        scale = scale * tl.load(k_scale_ptr)
    if DOT_DTYPE == tl.float16 and q_ptr.dtype.element_ty != tl.float16:
        q, q_exp = _to_f16_rows(q)
        scale = scale * q_exp          # [BLOCK_H, 1]
    else:
        q = q.to(DOT_DTYPE)
    slope = 0.0
    if ALIBI:
        slope = tl.load(alibi_ptr + h, mask=row_ok, other=0) * 1.4426950408889634
    if not SPLIT:
        m_i, l_i = _init_rows(sinks_ptr, h, row_ok, BLOCK_H, SINKS)
    else:   # the sink joins in combine_kernel
        m_i, l_i = _init_rows(sinks_ptr, h, row_ok, BLOCK_H, False)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)

    t_lo, t_hi, s_hi = _split_tiles(is_decode, seq, split, splits, W, BS, BLOCK_N, SW)
    m_i, l_i, acc = _cache_loop(q, m_i, l_i, acc, qp, row_ok, t_lo, t_hi, s_hi, scale, slope, 1.0, table_ptr, t_row,
                                t_s1, W, num_blocks, cache_base, page_bytes, kc_ptr, vc_ptr, kvh, d, kc_s0, kc_s1, kc_s2,
                                kc_s3, vc_s0, vc_s1, vc_s2, D, BS, X, K_STD, V_RUN, BLOCK_N, TABLE_PTR, KV_FP8, KV_SW,
                                DOT_DTYPE, DOT_F32, False, SW, ALIBI, False, K_GROUPS, LOOP, CHUNK, CHUNK_COLS, 2)
    if KV_FP8 != 0:   # every V of this sum has the one scale
        acc = acc * tl.load(v_scale_ptr)

    if not SPLIT:
        _store_out(o_ptr, q0 * o_s0 + tl.zeros((BLOCK_H,), tl.int64), h, d, row_ok, acc, l_i, o_scale_ptr, o_s1,
                   o_s2, D, O_KIND, O_FP8, O_SW)
    else:
        # partial row (r, h, split): [max, sum, acc[0:D]] in fp32, BLOCK_D + 2 wide
        rows = ((r * GROUP * tl.num_programs(1) + h) * splits + split) * (BLOCK_D + 2)
        tl.store(part_ptr + rows, m_i, mask=row_ok)
        tl.store(part_ptr + rows + 1, l_i, mask=row_ok)
        tl.store(part_ptr + rows[:, None] + 2 + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def combine_kernel(
    o_ptr, qsl_ptr, o_scale_ptr, sinks_ptr, part_ptr, T, Hq, splits, o_s0, o_s1, o_s2,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, DPARTS: tl.constexpr, SINKS: tl.constexpr,
    O_KIND: tl.constexpr, O_FP8: tl.constexpr, O_SW: tl.constexpr, PDL: tl.constexpr,
):
    """Program (r, h, c): merge the `splits` (<= BLOCK_S) partial rows of decode request r, head h, exactly (the sink
    joins here), and write part c of DPARTS of the output row. PDL: its launch overlaps the decode kernel's, and it
    waits for the partials before reading them. The partials' loads do not wait for the request's metadata (every
    request has its rows in the workspace; a request that is not a decode stores nothing)."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    BLOCK_DD: tl.constexpr = BLOCK_D // DPARTS
    d = tl.program_id(2) * BLOCK_DD + tl.arange(0, BLOCK_DD)
    pdl_open(PDL, 0)
    pdl_wait(PDL, 0)
    q0 = tl.load(qsl_ptr + r).to(tl.int64)
    qlen = tl.load(qsl_ptr + r + 1).to(tl.int64) - q0
    sp = tl.arange(0, BLOCK_S)
    ok = sp < splits
    rows = ((r * Hq + h) * splits + sp) * (BLOCK_D + 2)
    m_s = tl.load(part_ptr + rows, mask=ok, other=float("-inf"))
    l_s = tl.load(part_ptr + rows + 1, mask=ok, other=0.0)
    acc_s = tl.load(part_ptr + rows[:, None] + 2 + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0)
    is_decode = (qlen == 1) & (q0 >= 0) & (q0 < T)
    m = tl.max(m_s, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + h + tl.zeros((1,), tl.int32)) * 1.4426950408889634
        m = tl.maximum(m, tl.max(sink, 0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(m_s - m_safe)
    l_sum = tl.sum(l_s * w, 0)
    if SINKS:
        l_sum += tl.sum(tl.exp2(sink - m_safe), 0)
    acc = tl.sum(acc_s * w[:, None], 0)
    out = tl.where(l_sum > 0, acc / tl.where(l_sum > 0, l_sum, 1.0), 0.0)
    write_out(o_ptr + q0 * o_s0 + h * o_s1 + d * o_s2, out, d < tl.where(is_decode, D, 0), o_scale_ptr, O_KIND,
              O_FP8, O_SW)


PREFILL_LAUNCHER = FastLauncher(prefill_kernel)
DECODE_LAUNCHER = FastLauncher(decode_kernel)
COMBINE_LAUNCHER = FastLauncher(combine_kernel)


# --- host-side planning ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Geometry:
    """Structural sizes of a call: heads, head size, cache block size and K layout."""

    hq: int
    hkv: int
    d: int
    bs: int
    x: int
    k_std: bool          # k_cache.stride(3) == x and stride(4) == 1 (the allocation's own layout)
    v_align: int = 0     # gcd of v_cache.stride(0) and stride(1) when stride(3) == 1, else 0

    def v_run(self, block_n: int) -> int:
        """V_RUN of a BLOCK_N-key tile: keys come in runs of min(bs, BLOCK_N) offsets of one block
        (one divides the other) whose first element is a multiple of that many elements; 0 if not."""
        run = min(self.bs, block_n)
        if run < 2 or run & (run - 1) or (block_n % self.bs and self.bs % block_n) or not self.v_align \
                or self.v_align % run:
            return 0
        return run

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    @property
    def block_d(self) -> int:
        return max(16, triton.next_power_of_2(self.d))


@dataclasses.dataclass(frozen=True)
class Features:
    """Feature flags of a call (constexprs)."""

    sliding_window: int = 0      # 0: none
    causal: bool = True
    alibi: bool = False
    sinks: bool = False
    kv_cache: bool = False       # k = v = None: every key from the cache
    table_ptr: bool = False


def _pow2_at_most(n: int, cap: int) -> int:
    return min(triton.next_power_of_2(max(n, 1)), cap)


def prefill_tiles(geo: Geometry, q_dtype, target: platform.Target, kv_fp8: bool = False) -> dict:
    """Tile constexprs and warps of prefill_kernel: BLOCK_Q queries x HEADS heads of one group per program
    (`tile_ids`: one table load per block of a whole cached tile, `_tile_block_ids`)."""
    tile_ids = True
    if target.backend == "interpreter":
        block_m, block_n, warps, stages = 16, 16, 4, 1
    elif geo.block_d > 128 or q_dtype == torch.float32:
        block_m, block_n, warps, stages, tile_ids = 64, 32, 4, 2, False
    elif target.backend == "cuda" and target.arch >= 90 and platform.shared_memory_limit(target) >= WIDE_PREFILL_SMEM:
        # benchmarks/NOTES.md (H100, 2026-11-27): with one table load per block, 4 x 512 on 2048 cached 283 us,
        # against 348 us for the per-key lookups at 128 x 64 (4 warps, 2 stages), their best. fp8 caches take 2
        # stages: at 3, triton 3.6 built a PV dot that read shared memory out of bounds (compute-sanitizer, the
        # test case combo-alibi-sw1-ptr-fp8-D24)
        block_m, block_n, warps, stages = 256, 64, 8, 2 if kv_fp8 else 3
    else:   # benchmarks/sweep_attention.py --prefill-only (H100, 2026-11-26): 4 x 512 on 2048 cached 349 us, against
        # 374 us at 128 x 32 (4 warps), 424 at 128 x 128 (8 warps), 477 at 128 x 64 (8 warps); the per-block table
        # loads measured slower at this tile (532 us, H100, triton 3.6)
        block_m, block_n, warps, stages, tile_ids = 128, 64, 4, 2, False
    heads = _pow2_at_most(geo.group, block_m)
    return dict(HEADS=heads, BLOCK_Q=block_m // heads, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                tile_ids=tile_ids)


MAX_GRID_YZ = 65535     # a launch grid's second and third axes hold at most this many programs


def tiles_last_first(tiles: dict, max_input_len: int) -> bool:
    """Whether the prefill grid puts q tiles on its second axis, last tile first (TILES_LAST_FIRST): whenever
    they fit there (4 x 512 new on 2048 cached, H100: prefill 282 -> 272 us, mixed step 466 -> 445 us)."""
    return layout.cdiv(max_input_len, tiles["BLOCK_Q"]) <= MAX_GRID_YZ


def prefill_grid(requests: int, geo: Geometry, tiles: dict, max_input_len: int, last_first: bool) -> tuple:
    """(head groups, q tiles, requests) when `last_first` (the plan's `tiles_last_first`, also its constexpr
    TILES_LAST_FIRST), else (q tiles, head groups, requests)."""
    n_q, groups = layout.cdiv(max_input_len, tiles["BLOCK_Q"]), geo.hkv * layout.cdiv(geo.group, tiles["HEADS"])
    return (groups, n_q, requests) if last_first else (n_q, groups, requests)


def decode_tiles(geo: Geometry, q_dtype, kv_fp8: bool, target: platform.Target) -> dict:
    """BLOCK_H rows (the group's query heads, padded to a dot's minimum of 16) and BLOCK_N keys per step.

    benchmarks/sweep_attention.py --decode-only (H100, 2026-11-25): small programs, several per SM, hide one
    another's load latency. fp8 caches (benchmarks/NOTES.md, 2026-11-27): 16-key tiles on one warp in the
    table-chunk loop (LOOP_TABLE_CHUNKS, 3 stages: two tiles' copies in flight), 174 registers on sm_90, so 11
    programs per SM, and the split count keeps the grid within them (`at_most`): 64 x 4096 72 -> 80 % (90.5 % with
    the combine's tile sized to the split count), 256 x 1024 76 -> 91 %, 1 x 32768 44 -> 63 % of the read
    ceiling. Float caches of at most 128 dims with groups of at most FLOAT_CHUNK_MAX_ROWS heads take the same loop
    on 2 stages (one tile's copies in flight), 249 registers, so 8 programs per SM (`--chunks`, H200, 2026-11-28):
    bf16 64 x 4096 380 -> 274 us, 256 x 1024 372 -> 275 us, 1 x 32768 60.9 -> 55.0 us against the register-prefetch
    loop they had taken before (removed; on an H100 the table-chunk loop at 3 stages had been within 2 % of it, and
    77.5 -> 71.4 % at 1 x 32768: NOTES.md "The mixed step's SM-time" item 6). `per_sm`: the programs per SM the
    split count aims at (decode_splits; with `at_most`, the most it allows). `chunk`: (CHUNK, CHUNK_COLS) of the
    table-chunk loop (table_chunk). `pdl`: launched as a programmatic dependent (sm_90+). `combine_parts`: the
    combine's programs per (request, head), at most (combine_parts; 1 when absent). fp8 caches take 4 (NOTES.md,
    2026-11-27: 1 x 32768 33.9 -> 33.3 us; 2 parts lost), and so do float caches in that loop (as swept);
    the interpreter takes them too, so that the CPU suite runs them. `early`: the EARLY flags (kernels/early.py);
    fp8 caches on PDL targets touch their first DECODE_TOUCH_TILES tiles before the wait and launch the combine
    after it (NOTES.md, 2026-11-27: 1 x 32768 33.4 -> 31.2 us, 1 x 8192 21.4 -> 15.3 us; float caches lost).
    `split_keys`: the fewest keys a split takes (decode_splits; MIN_KEYS_PER_SPLIT when absent); the table-chunk
    loop's programs are cheap enough that a request too short to fill the GPU with 256-key splits gains from
    shorter ones (probe_attention_parts, H200, 2026-11-28: 1 x 8192 bf16 28.7 -> 19.2 us at 32, fp8 14.8 -> 12.5
    us at 128)."""
    tiles = _decode_tiles(geo, q_dtype, kv_fp8, target)
    if tiles.get("loop") == LOOP_TABLE_CHUNKS and target.backend != "interpreter" and tiles["num_warps"] != 1:
        # one warp keeps the block ids' tl.gather in warp shuffles; across warps it goes through shared memory,
        # which under Triton 3.6's 3-stage pipeline read out of bounds (compute-sanitizer, 4-warp prefill probe)
        raise RuntimeError("internal: LOOP_TABLE_CHUNKS runs on one warp per program")
    return dict(tiles, pdl=platform.supports_pdl(target))


def _decode_tiles(geo: Geometry, q_dtype, kv_fp8: bool, target: platform.Target) -> dict:
    block_h = max(16, triton.next_power_of_2(geo.group))
    chunks = kv_fp8 or block_h <= FLOAT_CHUNK_MAX_ROWS
    if target.backend == "interpreter":      # the loops of a GPU, so that the CPU suite runs them
        return dict(BLOCK_H=block_h, BLOCK_N=16, num_warps=4, num_stages=1, per_sm=PROGRAMS_PER_SM,
                    loop=LOOP_TABLE_CHUNKS if chunks else LOOP_PIPELINE, chunk=table_chunk(geo.bs, 16, target),
                    combine_parts=MAX_COMBINE_PARTS)
    if geo.block_d > 128 or q_dtype == torch.float32:
        # 2 stages need 147 KB at fp32 x 256 dims on sm_86 (99 KB) and 67.5 KB on gfx942 (64 KB); 1 stage 80 / 32 KB
        stages = 2 if platform.shared_memory_limit(target) >= WIDE_TWO_STAGE_SMEM else 1
        return dict(BLOCK_H=block_h, BLOCK_N=32, num_warps=4, num_stages=stages, per_sm=PROGRAMS_PER_SM // 2)
    if chunks:
        return dict(BLOCK_H=block_h, BLOCK_N=16, num_warps=1, num_stages=3 if kv_fp8 else 2,
                    per_sm=FP8_PROGRAMS_PER_SM if kv_fp8 else FLOAT_CHUNK_PROGRAMS_PER_SM, at_most=True,
                    split_keys=FP8_CHUNK_SPLIT_KEYS if kv_fp8 else FLOAT_CHUNK_SPLIT_KEYS,
                    loop=LOOP_TABLE_CHUNKS, chunk=table_chunk(geo.bs, 16, target), combine_parts=MAX_COMBINE_PARTS,
                    early=early.flags(touch=True, late=True) if kv_fp8 and early.use_early(target) else 0)
    return dict(BLOCK_H=block_h, BLOCK_N=64, num_warps=2, num_stages=2, per_sm=PROGRAMS_PER_SM)


LOOP_PIPELINE, LOOP_TABLE_CHUNKS = 0, 1   # the cached-key loops of `_cache_loop` (on a GPU, the second on one
                                         # warp per program: decode_tiles)
MAX_TILE_BLOCKS = tl.constexpr(8)   # LOOP_PIPELINE: whole tiles of at most this many blocks load an entry per block
DECODE_TOUCH_TILES = 4        # decode EARLY & TOUCH: tiles touched before the wait (TOUCH_TILES, `_decode_touch`)
TABLE_CHUNK_TILES = 64         # LOOP_TABLE_CHUNKS: tiles per chunk on a GPU, at most (the interpreter: 2)
TABLE_CHUNK_COLS = 128         # ... and table columns per chunk, at most (a vector of block ids in registers)
FLOAT_CHUNK_MAX_ROWS = 16      # decode: float caches take the table-chunk loop for groups of at most this many heads
WIDE_PREFILL_SMEM = 200 * 1024    # prefill: the 256 x 64 tile (160 KB at 3 stages) on sm_90+ programs of this much
                                  # shared memory (sm_90, sm_100; not sm_80's 163 KB, where it was never timed)
WIDE_TWO_STAGE_SMEM = 160 * 1024   # decode of fp32 or > 128 dims: 2 stages where a program has this much shared memory
MIN_KEYS_PER_SPLIT = 256       # keys per split, at least (decode_splits), unless the tiles say otherwise:
FLOAT_CHUNK_SPLIT_KEYS = 32     # ... float caches in the table-chunk loop
FP8_CHUNK_SPLIT_KEYS = 128      # ... fp8 caches in the table-chunk loop
MAX_SPLITS = 128
COMBINE_BLOCKS = (8, 32, MAX_SPLITS)   # the combine's partial rows per program (combine_block)
MAX_COMBINE_PARTS = 4         # the combine's programs per (request, head) for fp8 caches, at most (combine_parts)
COMBINE_PART_ELEMENTS = 4096
PROGRAMS_PER_SM = 4            # decode programs per SM the split count aims at (more: no faster, H100)
FP8_PROGRAMS_PER_SM = 11       # fp8 caches: the programs of 174 registers an sm_90 SM holds at once (2026-11-27;
                               # since: 208 registers, 9 an SM, under Triton 3.6, 168 and 12 under 3.7-3.9: NOTES.md
                               # "Shorter splits for a short request" items 7-8, where a change waits on a GPU run)
FLOAT_CHUNK_PROGRAMS_PER_SM = 8   # float caches in the table-chunk loop: 249 registers (sm_90, Triton 3.6; 216-222
                                  # and 9 an SM under 3.7-3.9)


def table_chunk(bs: int, block_n: int, target: platform.Target) -> tuple[int, int]:
    """(CHUNK, CHUNK_COLS) of LOOP_TABLE_CHUNKS: tiles per chunk, and a power of two of table columns that holds a
    chunk's columns (n consecutive keys span at most (n - 1) // bs + 2 blocks), at most TABLE_CHUNK_COLS."""
    most = 2 if target.backend == "interpreter" else TABLE_CHUNK_TILES
    chunk = max(1, min(most, (TABLE_CHUNK_COLS - 1) * bs // block_n))
    return chunk, triton.next_power_of_2((chunk * block_n - 1) // bs + 2)


def device_multiprocessors(device: torch.device) -> int:
    """SMs (CUs) of a GPU device (its current index when none is given); the interpreter's 4 on the CPU."""
    if device.type != "cuda":
        return multiprocessors(None)
    return multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def multiprocessors(device_index: int | None) -> int:
    """Streaming multiprocessors (CUs) of a GPU; 4 for the interpreter (small test grids)."""
    if device_index is None:
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(requests: int, hkv: int, max_keys: int, multiprocessor_count: int, per_sm: int,
                  at_most: bool = False, min_keys: int = MIN_KEYS_PER_SPLIT) -> int:
    """How many parts to split each decode request's keys into (flash-decoding), from host ints only:
    enough (request x kv head) programs for `per_sm` (decode_tiles) per multiprocessor, or with `at_most` as
    many as stay within `per_sm` per multiprocessor (one wave); at least `min_keys` (decode_tiles' `split_keys`)
    keys per part, at most MAX_SPLITS parts."""
    programs = max(requests * hkv, 1)
    slots = per_sm * multiprocessor_count
    want = slots // programs if at_most else layout.cdiv(slots, programs)
    return max(1, min(want, layout.cdiv(max(max_keys, 1), min_keys), MAX_SPLITS))


def numeric_constexprs(numerics: Numerics) -> dict:
    return dict(KV_FP8=numerics.kv_fp8, KV_SW=numerics.kv_sw, DOT_F32=numerics.dot_f32, O_KIND=numerics.o_kind,
                O_FP8=numerics.o_fp8, O_SW=numerics.o_sw)


def prefill_constexprs(geo: Geometry, feats: Features, numerics: Numerics, tiles: dict, min_qlen: int,
                       last_first: bool = True) -> dict:
    return dict(D=geo.d, BLOCK_D=geo.block_d, BS=geo.bs, X=geo.x, K_STD=geo.k_std, TILES_LAST_FIRST=last_first,
                V_RUN=geo.v_run(tiles["BLOCK_N"]), GROUP=geo.group, HEADS=tiles["HEADS"], BLOCK_Q=tiles["BLOCK_Q"], BLOCK_N=tiles["BLOCK_N"],
                SW=feats.sliding_window, CAUSAL=feats.causal, ALIBI=feats.alibi, SINKS=feats.sinks,
                KV_CACHE=feats.kv_cache, MIN_QLEN=min_qlen, TABLE_PTR=feats.table_ptr, TILE_IDS=tiles["tile_ids"],
                **numeric_constexprs(numerics), num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])


def decode_constexprs(geo: Geometry, feats: Features, numerics: Numerics, tiles: dict, splits: int) -> dict:
    chunk, chunk_cols = tiles.get("chunk", (1, 1))
    return dict(D=geo.d, BLOCK_D=geo.block_d, BS=geo.bs, X=geo.x, K_STD=geo.k_std,
                V_RUN=geo.v_run(tiles["BLOCK_N"]), GROUP=geo.group, BLOCK_H=tiles["BLOCK_H"],
                BLOCK_N=tiles["BLOCK_N"],
                SPLIT=splits > 1, SW=feats.sliding_window,
                ALIBI=feats.alibi, SINKS=feats.sinks, TABLE_PTR=feats.table_ptr, **numeric_constexprs(numerics),
                LOOP=tiles.get("loop", LOOP_PIPELINE), CHUNK=chunk, CHUNK_COLS=chunk_cols,
                K_GROUPS=tiles.get("k_groups", True),
                PDL=tiles.get("pdl", False), EARLY=tiles.get("early", 0),
                TOUCH_TILES=DECODE_TOUCH_TILES, num_warps=tiles["num_warps"],
                num_stages=tiles["num_stages"])


def combine_block(splits: int) -> int:
    """BLOCK_S of the combine: the smallest of COMBINE_BLOCKS that holds `splits` partial rows (a [BLOCK_S,
    BLOCK_D] tile of 128 rows for 2 splits cost 20 us at 64 x 4096 against one of 64 rows, H100)."""
    return next(b for b in COMBINE_BLOCKS if b >= splits)


def combine_constexprs(geo: Geometry, feats: Features, numerics: Numerics, target: platform.Target,
                       splits: int, max_parts: int = 1) -> dict:
    # a warp per 1024 of a program's [BLOCK_S, BLOCK_D // DPARTS] fp32 partials (a single warp spilled at 64 x 128)
    block_s = combine_block(splits)
    parts = combine_parts(block_s, geo.block_d, max_parts)
    return dict(D=geo.d, BLOCK_D=geo.block_d, BLOCK_S=block_s, DPARTS=parts,
                SINKS=feats.sinks, O_KIND=numerics.o_kind, O_FP8=numerics.o_fp8, O_SW=numerics.o_sw,
                PDL=platform.supports_pdl(target),
                num_warps=max(1, min(8, block_s * geo.block_d // parts // 1024)))


def combine_parts(block_s: int, block_d: int, max_parts: int) -> int:
    """Programs per (request, head) of the combine, each merging BLOCK_D // parts output columns: one per
    COMBINE_PART_ELEMENTS of the [BLOCK_S, BLOCK_D] partials, at most `max_parts` (the decode tiles'
    `combine_parts`), at least 16 columns each."""
    parts = 1
    while (parts < max_parts and block_s * block_d // parts > COMBINE_PART_ELEMENTS
           and block_d // (2 * parts) >= 16):
        parts *= 2
    return parts


def combine_grid(requests: int, geo: Geometry, meta: dict) -> tuple:
    """(requests, query heads, column parts) of combine_kernel for its constexprs `meta`."""
    return requests, geo.hq, meta["DPARTS"]


def partial_elements(requests: int, geo: Geometry, splits: int) -> int:
    """fp32 elements of the decode workspace: one [max, sum, acc] row per (request, head, split)."""
    return requests * geo.hq * splits * (geo.block_d + 2)


# --- compile matrix ---------------------------------------------------------------------------------------
_FP8_CACHE = {"auto": None, "e4m3": layout.E4M3FN, "e5m2": layout.E5M2}


def _matrix_numerics(target, q_dtype, kv: str, o_dtype) -> tuple[Numerics, layout.Fp8Format | None]:
    fmt = _FP8_CACHE[kv]
    if kv == "e4m3":
        fmt = platform.platform_e4m3(target)
    return make_numerics(q_dtype, fmt, o_dtype, target), fmt


def _matrix_tensors(q_dtype, o_view, kv_fmt, table_dtype, prefill: bool):
    from .matrix import Ptr

    cache = Ptr(torch.uint8 if kv_fmt is not None else q_dtype)
    f32 = Ptr(torch.float32)
    head = (Ptr(q_dtype),) + ((Ptr(q_dtype), Ptr(q_dtype)) if prefill else ()) + (Ptr(o_view),)
    return head + (cache, cache, Ptr(table_dtype), Ptr(torch.int32), Ptr(torch.int32), f32, f32, f32, f32, f32) \
        + (() if prefill else (f32,))


def _cache_strides(geo: Geometry, nb: int) -> tuple:
    kc = (geo.hkv * geo.d * geo.bs, geo.d * geo.bs, geo.bs * geo.x, geo.x)
    vc = (geo.hkv * geo.d * geo.bs, geo.d * geo.bs, geo.bs)
    return kc, vc


def matrix_launch_prefill(target, name, q_dtype, kv, o_dtype, geo: Geometry, feats: Features, min_qlen=1,
                          table_dtype=torch.int32, last_first=True):
    """What ops/attention.py passes to prefill_kernel for one call on `target` (contiguous tensors,
    17 tokens, 3 requests, 64 blocks, a 4-column table)."""
    numerics, fmt = _matrix_numerics(target, q_dtype, kv, o_dtype)
    tiles = prefill_tiles(geo, q_dtype, target, fmt is not None)
    meta = launch_options(prefill_constexprs(geo, feats, numerics, tiles, min_qlen, last_first))
    tokens, nb, cols = 17, 64, 4
    q_st = (geo.hq * geo.d, geo.d, 1)
    kv_st = (geo.hkv * geo.d, geo.d, 1) if not feats.kv_cache else q_st
    kc, vc = _cache_strides(geo, nb)
    elem = 1 if fmt is not None else torch.empty((), dtype=q_dtype).element_size()
    ints = (tokens, 9, geo.d ** -0.5, cols, nb, 2**40 if feats.table_ptr else 0, kc[0] * elem, *q_st, *kv_st,
            *kv_st, *q_st, *kc, *vc, cols, 1, 1)
    return name, _matrix_tensors(q_dtype, output_view(o_dtype, numerics), fmt, table_dtype, True), ints, meta


def matrix_launch_decode(target, name, q_dtype, kv, o_dtype, geo: Geometry, feats: Features, splits=1,
                         table_dtype=torch.int32):
    """What ops/attention.py passes to decode_kernel (3 requests, 64 blocks, a 4-column table)."""
    numerics, fmt = _matrix_numerics(target, q_dtype, kv, o_dtype)
    tiles = decode_tiles(geo, q_dtype, fmt is not None, target)
    meta = launch_options(decode_constexprs(geo, feats, numerics, tiles, splits))
    tokens, nb, cols = 17, 64, 4
    q_st = (geo.hq * geo.d, geo.d, 1)
    kc, vc = _cache_strides(geo, nb)
    elem = 1 if fmt is not None else torch.empty((), dtype=q_dtype).element_size()
    ints = (tokens, geo.d ** -0.5, cols, nb, 2**40 if feats.table_ptr else 0, kc[0] * elem, *q_st, *q_st, *kc, *vc,
            cols, 1, 1)
    return name, _matrix_tensors(q_dtype, output_view(o_dtype, numerics), fmt, table_dtype, False), ints, meta


def matrix_launch_combine(target, name, q_dtype, o_dtype, geo: Geometry, feats: Features, splits: int,
                          max_parts: int = 1):
    """What ops/attention.py passes to combine_kernel."""
    from .matrix import Ptr

    numerics, _ = _matrix_numerics(target, q_dtype, "auto", o_dtype)
    meta = launch_options(combine_constexprs(geo, feats, numerics, target, splits, max_parts))
    f32 = Ptr(torch.float32)
    tensors = (Ptr(output_view(o_dtype, numerics)), Ptr(torch.int32), f32, f32, f32)
    return name, tensors, (17, geo.hq, splits, geo.hq * geo.d, geo.d, 1), meta


def _matrix_geometries():
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    e4m3 = torch.float8_e4m3fn
    def g(hq, hkv, d, bs, x, k_std):
        return Geometry(hq, hkv, d, bs, x, k_std, math.gcd(hkv * d * bs, d * bs))

    prefill = [
        ("prefill.bf16.d128.g4.bs16", bf16, "auto", bf16, g(32, 8, 128, 16, 8, True), Features(), 1),
        ("prefill.f16.d64.g1.bs16.sw16.sinks", f16, "auto", f16, g(8, 8, 64, 16, 8, True),
         Features(sliding_window=16, sinks=True), 1),
        ("prefill.f32.d64.g8.bs32.alibi", f32, "auto", f32, g(64, 8, 64, 32, 4, True), Features(alibi=True), 1),
        ("prefill.bf16.e4m3.d128.g4.bs16.fp8out.skip", bf16, "e4m3", e4m3, g(32, 8, 128, 16, 16, True),
         Features(), 2),
        ("prefill.bf16.e5m2.d256.g8.bs544.cache.noncausal.ptr", bf16, "e5m2", bf16, g(64, 8, 256, 544, 16, True),
         Features(causal=False, kv_cache=True, table_ptr=True), 1),
        ("prefill.f16.e4m3.d80.g64.bs16", f16, "e4m3", f16, g(64, 1, 80, 16, 16, True), Features(), 1),
    ]
    decode = [
        ("decode.bf16.d128.g4.bs16", bf16, "auto", bf16, g(32, 8, 128, 16, 8, True), Features(), 1),
        ("decode.bf16.d128.g4.bs16.split", bf16, "auto", bf16, g(32, 8, 128, 16, 8, True), Features(), 33),
        ("decode.bf16.e4m3.d128.g4.bs16.fp8out", bf16, "e4m3", e4m3, g(32, 8, 128, 16, 16, True), Features(), 1),
        # the benchmark's fp8 decode (its registers set how many programs an SM holds: benchmarks/probe_registers.py)
        ("decode.bf16.e4m3.d128.g4.bs16.split", bf16, "e4m3", bf16, g(32, 8, 128, 16, 16, True), Features(), 2),
        ("decode.f16.e5m2.d64.g8.bs32.sw.alibi.sinks.split", f16, "e5m2", f16, g(64, 8, 64, 32, 16, True),
         Features(sliding_window=128, alibi=True, sinks=True), 4),
        ("decode.f32.d256.g1.bs544.ptr", f32, "auto", f32, g(8, 8, 256, 544, 4, True), Features(table_ptr=True), 1),
        ("decode.bf16.d128.g64.bs16", bf16, "auto", bf16, g(64, 1, 128, 16, 8, True), Features(), 1),
        # fp8 with a head size below a power of two: the early touches (`_decode_touch`) mask their dims
        ("decode.bf16.e4m3.d24.g2.bs16.sw.alibi.ptr.split", bf16, "e4m3", bf16, g(4, 2, 24, 16, 16, True),
         Features(sliding_window=1, alibi=True, table_ptr=True), 3),
    ]
    combine = [
        ("combine.bf16.d128.s33.sinks", bf16, bf16, g(32, 8, 128, 16, 8, True), Features(sinks=True), 33, 1),
        ("combine.fp8out.d64.s4", f16, e4m3, g(64, 8, 64, 32, 16, True), Features(), 4, 1),
        ("combine.f32.d256.s20", f32, f32, g(8, 8, 256, 544, 4, True), Features(), 20, 1),
        ("combine.bf16.d128.s128.parts", bf16, bf16, g(32, 8, 128, 16, 8, True), Features(), 128, MAX_COMBINE_PARTS),
    ]
    return prefill, decode, combine


def matrix_cases(target: platform.Target) -> list:
    """Specialisations of the three attention kernels on `target`: q fp16/bf16/fp32, float and fp8
    (e4m3, e5m2) caches, fp8 output, GQA 1/4/8/64, head sizes 64/80/128/256, block sizes 16/32/544,
    each feature flag, split and unsplit decode."""
    from .matrix import dedupe, kernel_case

    def case(fn, launch):
        name, tensors, ints, meta = launch
        return kernel_case(target, f"attention.{name}", fn, tensors, ints, meta)

    prefill, decode, combine = _matrix_geometries()
    cases = [case(prefill_kernel, matrix_launch_prefill(target, n, q, kv, o, geo, f, min_qlen))
             for n, q, kv, o, geo, f, min_qlen in prefill]
    n, q, kv, o, geo, f, min_qlen = prefill[0]      # more q tiles than a grid's second axis holds
    cases.append(case(prefill_kernel, matrix_launch_prefill(target, n + ".tiles_in_order", q, kv, o, geo, f, min_qlen,
                                                            last_first=False)))
    cases += [case(decode_kernel, matrix_launch_decode(target, n, q, kv, o, geo, f, s))
              for n, q, kv, o, geo, f, s in decode]
    cases += [case(combine_kernel, matrix_launch_combine(target, n, q, o, geo, f, s, parts))
              for n, q, o, geo, f, s, parts in combine]
    return dedupe(cases)
