"""Triton kernels and launchers for the fp8_ds_mla K cache (SPEC §2.1, §3.2).

* `quantize_insert_kernel`: grid (cdiv(N, TOKENS),), TOKENS tokens per program (`insert_tokens`).
  Its NoPE tile has one row per (token, quant block), [TOKENS*8, 64] with every 8th row masked, so
  the 7 UE8M0 exponents come from row maxima of |x| (read as bits, no log2); it stores 448 fp8 bytes,
  128 RoPE bytes and 8 scale bytes per token, every load before the first store.
* `dequant_gather_kernel`: grid (R, workers), workers = min(cdiv(W, BLOCK_T), MAX_WORKERS) from
  host ints only (BLOCK_T from `gather_block_t(W, target)`). Program (r, w) walks the rows i = w*BLOCK_T,
  w*BLOCK_T + workers*BLOCK_T, ... of request r below min(gl, W - offset), BLOCK_T tokens per
  step; the block-table entries of the next step are loaded before this step's stores. Decode windows on
  PDL targets touch their first step's pages before `gdc_wait` (`_gather_touch`, `gather_early`).

All cache addressing is int64 (`blk * block_stride`); token counts, strides, widths and `offset`
are runtime arguments; structural sizes (block size, dims, fp8 flavour) are constexprs.
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .. import layout, platform
from ..reference.k_cache import FP32_MAN_BITS, fp8_format, nan_code, ue8m0_constants
from ._launch import FastLauncher, launch_options  # noqa: F401  (ops use kernels.launch_options)
from . import early
from .early import SECTOR, TOUCH, early_load, pdl_open, pdl_wait, touch
from .fp8 import bf16_bits_rne, fp8_decode, fp8_encode

BLOCK_Q = triton.next_power_of_2(layout.NUM_QUANT_BLOCKS)   # 8 rows of the NoPE tile (7 used)
# Tile settings measured on an H100 (benchmarks/sweep_tiles.py, benchmarks/NOTES.md):
# insert: (from this many tokens on, tokens per program), largest first; one token per program below (latency)
INSERT_TILES = ((8192, 4), (1024, 2))
INSERT_MAX_WARPS = 2
BLOCK_T = 16                 # gather: tokens per loop step of one program for wide outputs (H200: 8 -> 16, NOTES.md)
BLOCK_T_NARROW = 2           # ... and for outputs of at most NARROW_WIDTH rows (decode windows)
BLOCK_T_EARLY = 8            # ... and for those where the kernel works before gdc_wait (gather_early)
NARROW_WIDTH = 512
GATHER_MAX_WARPS = 4
MAX_WORKERS = 512            # gather: programs per request, at most
FP32_MAX_BITS = 0x7F7FFFFF
FP32_INF_BITS = 0x7F800000


def fp32_bits(x: float) -> int:
    """The int32 bit pattern of fp32(x)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def ue8m0_bit_rule(fmt: layout.Fp8Format) -> tuple[int, int]:
    """(E_SHIFT, MANT_LIMIT) of the kernel's bit form of the frexp rule: for fp32 a >= 2**-126
    with exponent field E and mantissa field M, frexp gives k2 = E - 126 and m > m_max iff
    M > (2*m_max - 1) * 2**23, so e = E - E_SHIFT + (M > MANT_LIMIT), E_SHIFT = 126 + k_max."""
    m_max, k_max = ue8m0_constants(fmt)
    mant_limit = (2 * m_max - 1) * 2**FP32_MAN_BITS
    assert mant_limit == int(mant_limit)
    return layout.UE8M0_BIAS - 1 + k_max, int(mant_limit)


# ------------------------------------------------------------------------------------------------
# UE8M0 quantisation of rows (shared with the indexer cache, kernels/indexer.py)
# ------------------------------------------------------------------------------------------------
@triton.jit
def ue8m0_exponents(x, E_SHIFT: tl.constexpr, MANT_LIMIT: tl.constexpr, FLOOR_BITS: tl.constexpr):
    """The exact UE8M0 exponent e (int32) of each row of fp32 x [R, C]: NaN is left out of the amax
    (max is maxnum; a row of NaNs counts as 0), the fp32 1e-4 floor applies, inf counts as the largest
    fp32. The per-row amax is then read from its bit pattern."""
    a = tl.max(tl.abs(x), axis=1)
    a = tl.where(a == a, a, 0.0).to(tl.int32, bitcast=True)
    a = tl.minimum(tl.maximum(a, FLOOR_BITS), 0x7F7FFFFF)
    return (a >> 23) - E_SHIFT + ((a & 0x7FFFFF) > MANT_LIMIT).to(tl.int32)


@triton.jit
def ue8m0_codes(x, e, FMT: tl.constexpr, SW: tl.constexpr, FP8_MAX: tl.constexpr, BIAS: tl.constexpr,
                NAN_CODE: tl.constexpr, SAT: tl.constexpr):
    """fp8 codes of rows x [R, C] scaled by 2**-e (exact), clamped to +-FP8_MAX; NaN as NAN_CODE, any sign.
    SAT: the target's conversion does the clamp and the NaN code itself (`saturating_codes`)."""
    inv = ((BIAS - e) << 23).to(tl.float32, bitcast=True)               # 2**-e, a normal fp32
    y = x * inv[:, None]
    if SAT:
        codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))   # NaN passes through
        codes = fp8_encode(y, FMT, SW)
        codes = tl.where(y != y, NAN_CODE, codes)                       # one NaN code (docs/ops/k_cache.md §6.1)
    return codes


def saturating_codes(target: platform.Target, fmt: layout.Fp8Format) -> bool:
    """Whether `ue8m0_codes` may leave clamp and NaN code to the conversion: NVIDIA's e4m3 conversion
    (`cvt.rn.satfinite`) saturates to +-448 = FP8_MAX and writes every NaN as 0x7F = NAN_CODE."""
    return target.backend == "cuda" and platform.native_fp8(target, fmt) and fmt is layout.E4M3FN \
        and fmt.ue8m0_max == fmt.max


# ------------------------------------------------------------------------------------------------
# quantize_and_insert_k_cache
# ------------------------------------------------------------------------------------------------
@triton.jit
def quantize_insert_kernel(
    k_ptr, cache_ptr, slot_ptr, n_tokens, k_stride, slot_stride, num_slots, block_stride,
    BS: tl.constexpr, NOPE: tl.constexpr, ROPE_BYTES: tl.constexpr, QB: tl.constexpr, NQ: tl.constexpr,
    BLOCK_Q: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, FMT: tl.constexpr,
    SW: tl.constexpr, FP8_MAX: tl.constexpr, E_SHIFT: tl.constexpr, MANT_LIMIT: tl.constexpr,
    FLOOR_BITS: tl.constexpr, BIAS: tl.constexpr, NAN_CODE: tl.constexpr, SAT: tl.constexpr, TOKENS: tl.constexpr,
    PDL: tl.constexpr,
):
    # Rows of the NoPE tile are (token, quant block) pairs: row j is block j % BLOCK_Q of token
    # j // BLOCK_Q, so the UE8M0 amax is a row reduction and every row's 64 codes are contiguous.
    first = tl.program_id(0).to(tl.int64) * TOKENS
    pdl_open(PDL, 0)
    pdl_wait(PDL, 0)
    j = tl.arange(0, TOKENS * BLOCK_Q)
    q = j % BLOCK_Q
    t = first + j // BLOCK_Q                                            # token of row j
    d = tl.arange(0, QB)
    live = t < n_tokens
    t = tl.where(live, t, 0)
    tt = first + tl.arange(0, TOKENS)                                   # tokens, for the RoPE tile
    live_t = tt < n_tokens
    tt = tl.where(live_t, tt, 0)
    rb = tl.arange(0, ROPE_BYTES)
    # all loads first: slots, the NoPE tile, the RoPE bytes
    slot = tl.load(slot_ptr + t * slot_stride, mask=live, other=-1).to(tl.int64)
    slot_t = tl.load(slot_ptr + tt * slot_stride, mask=live_t, other=-1).to(tl.int64)
    x = tl.load(k_ptr + t[:, None] * k_stride + (q * QB)[:, None] + d[None, :],
                mask=((q < NQ) & live)[:, None] & (d < QB)[None, :], other=0.0).to(tl.float32)
    rope_src = k_ptr.to(tl.pointer_type(tl.uint8)) + (tt * k_stride * 2 + 2 * NOPE)[:, None] + rb[None, :]
    rope = tl.load(rope_src, mask=live_t[:, None] & (rb < ROPE_BYTES)[None, :])
    e = ue8m0_exponents(x, E_SHIFT, MANT_LIMIT, FLOOR_BITS)
    codes = ue8m0_codes(x, e, FMT, SW, FP8_MAX, BIAS, NAN_CODE, SAT)
    byte = tl.minimum(tl.maximum(e + BIAS, 0), 255)
    byte = tl.where(q < NQ, byte, 0).to(tl.uint8)                       # byte 7 = 0
    # every negative slot and every slot past the cache: skip (tensor-only masks, for the interpreter)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    page = cache_ptr + (slot // BS) * block_stride
    off = slot % BS
    tl.store((page + off * DATA_BYTES + q * QB)[:, None] + d[None, :], codes,
             mask=(valid & (q < NQ))[:, None] & (d < QB)[None, :])
    tl.store(page + BS * DATA_BYTES + off * SCALE_BYTES + q, byte, mask=valid & (q < SCALE_BYTES))
    valid_t = (slot_t >= 0) & (slot_t < num_slots)
    slot_t = tl.where(valid_t, slot_t, 0)
    rope_dst = cache_ptr + (slot_t // BS) * block_stride + (slot_t % BS) * DATA_BYTES + NOPE
    tl.store(rope_dst[:, None] + rb[None, :], rope, mask=valid_t[:, None] & (rb < ROPE_BYTES)[None, :])


def ue8m0_codec(fmt: layout.Fp8Format, target: platform.Target) -> dict:
    """Constexprs of `ue8m0_exponents` / `ue8m0_codes` for format `fmt` on `target` (every UE8M0 writer)."""
    e_shift, mant_limit = ue8m0_bit_rule(fmt)
    return dict(FMT=fmt.code, SW=not platform.native_fp8(target, fmt), FP8_MAX=fmt.ue8m0_max, E_SHIFT=e_shift,
                MANT_LIMIT=mant_limit, FLOOR_BITS=fp32_bits(layout.UE8M0_FLOOR), BIAS=layout.UE8M0_BIAS,
                NAN_CODE=nan_code(fmt), SAT=saturating_codes(target, fmt))


def _layout_constexprs(block_size: int) -> dict:
    return dict(BS=block_size, NOPE=layout.NOPE_DIM, ROPE_BYTES=2 * layout.ROPE_DIM, QB=layout.QUANT_BLOCK,
                NQ=layout.NUM_QUANT_BLOCKS, BLOCK_Q=BLOCK_Q, DATA_BYTES=layout.TOKEN_DATA_BYTES,
                SCALE_BYTES=layout.SCALE_BYTES)


def insert_tokens(n_tokens: int) -> int:
    """Tokens per program of `quantize_insert_kernel` for a call of `n_tokens` tokens."""
    return next((tokens for start, tokens in INSERT_TILES if n_tokens >= start), 1)


def insert_constexprs(block_size: int, use_fnuz: bool, target: platform.Target, tokens: int = 1) -> dict:
    """Constexprs (and num_warps) of `quantize_insert_kernel`, shared by the launcher and the matrix."""
    warps = min(INSERT_MAX_WARPS, platform.num_warps_for(target, tokens * BLOCK_Q * layout.QUANT_BLOCK))
    return dict(**_layout_constexprs(block_size), **ue8m0_codec(fp8_format(use_fnuz), target), TOKENS=tokens,
                PDL=platform.supports_pdl(target), num_warps=warps)


def insert_runtime_args(n_tokens: int, k_stride: int, slot_stride: int, num_slots: int, block_stride: int) -> tuple:
    """The int arguments after the 3 tensors (k as bf16, cache as uint8, slot_mapping)."""
    return (n_tokens, k_stride, slot_stride, num_slots, block_stride)


# ------------------------------------------------------------------------------------------------
# dequantize_and_gather_k_cache
# ------------------------------------------------------------------------------------------------
@triton.jit
def _gather_lengths(seq_ptr, gather_ptr, r, seq_stride, gather_stride, width, offset, HAS_GATHER: tl.constexpr,
                    EARLY: tl.constexpr = False):
    """(start, n) of request r: its first gathered position seq - gl and its rows min(gl, W - offset) (§4 b), gl
    clamped at 0. EARLY: read by `early_load`, before `gdc_wait`."""
    if EARLY:
        seq = early_load(seq_ptr + r * seq_stride, r >= 0).to(tl.int64)
        gl = early_load(gather_ptr + r * gather_stride, r >= 0).to(tl.int64) if HAS_GATHER else seq
    else:
        seq = tl.load(seq_ptr + r * seq_stride).to(tl.int64)
        gl = tl.load(gather_ptr + r * gather_stride).to(tl.int64) if HAS_GATHER else seq
    gl = tl.maximum(gl, 0)
    return seq - gl, tl.minimum(gl, width - offset)


@triton.jit
def _gather_rows(bt_ptr, r, i, n, start, bt_s0, bt_s1, bt_width, num_blocks, BS: tl.constexpr,
                 EARLY: tl.constexpr = False):
    """Rows i (< n) of request r: (page block id, offset in the page, source valid) per row; one
    masked block-table load (`early_load` where EARLY). Invalid sources (negative position, past the table,
    entry < 0 or >= num_blocks) read block 0 and are masked."""
    pos = start + i
    pos0 = tl.where(pos >= 0, pos, 0)
    colb = pos0 // BS
    ok = (i < n) & (pos >= 0) & (colb < bt_width)
    if EARLY:
        blk = early_load(bt_ptr + r * bt_s0 + colb * bt_s1, ok).to(tl.int64)
    else:
        blk = tl.load(bt_ptr + r * bt_s0 + colb * bt_s1, mask=ok, other=-1).to(tl.int64)
    ok = ok & (blk >= 0) & (blk < num_blocks)
    return tl.where(ok, blk, 0), pos0 % BS, ok


@triton.jit
def _gather_touch(cache_ptr, seq_ptr, gather_ptr, bt_ptr, r, i0, seq_stride, gather_stride, bt_s0, bt_s1, bt_width,
                  num_blocks, block_stride, width, offset, BS: tl.constexpr, DATA_BYTES: tl.constexpr,
                  SCALE_BYTES: tl.constexpr, HAS_GATHER: tl.constexpr, BLOCK_T: tl.constexpr,
                  TOUCHES: tl.constexpr):
    """Before `gdc_wait` (`kernels/early.py`): the lengths and table entries of rows i0 .. i0 + BLOCK_T by
    `early_load` (the kernel's own `_gather_lengths` and `_gather_rows`), then one `touch` per 32-byte sector of
    their pages (data, then scale bytes): a vector of TOUCHES (`gather_touches`) elements, one sector each. Nothing
    here reaches the output."""
    start, n = _gather_lengths(seq_ptr, gather_ptr, r, seq_stride, gather_stride, width, offset, HAS_GATHER, True)
    SECTORS: tl.constexpr = triton.cdiv(DATA_BYTES, SECTOR) + 1
    e = tl.arange(0, TOUCHES)
    k = e % SECTORS
    i = tl.where(e < BLOCK_T * SECTORS, i0 + e // SECTORS, n)           # lanes past the step's sectors: no row
    blk, off, ok = _gather_rows(bt_ptr, r, i, n, start, bt_s0, bt_s1, bt_width, num_blocks, BS, True)
    at = tl.minimum(k * SECTOR, DATA_BYTES - 1) + off * DATA_BYTES
    at = tl.where(k == SECTORS - 1, BS * DATA_BYTES + off * SCALE_BYTES, at)
    touch(cache_ptr + blk * block_stride + at, ok)


@triton.jit
def dequant_gather_kernel(
    out_ptr, cache_ptr, seq_ptr, gather_ptr, bt_ptr, seq_stride, gather_stride, out_s0, out_s1, bt_s0, bt_s1,
    bt_width, num_blocks, block_stride, width, offset,
    BS: tl.constexpr, NOPE: tl.constexpr, ROPE_BYTES: tl.constexpr, QB: tl.constexpr, NQ: tl.constexpr,
    BLOCK_Q: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, FMT: tl.constexpr,
    SW: tl.constexpr, HAS_GATHER: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    TOUCHES: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1)
    step = tl.num_programs(1) * BLOCK_T
    pdl_open(PDL, EARLY)
    if PDL and EARLY & TOUCH:
        _gather_touch(cache_ptr, seq_ptr, gather_ptr, bt_ptr, r, w * BLOCK_T, seq_stride, gather_stride, bt_s0, bt_s1,
                      bt_width, num_blocks, block_stride, width, offset, BS, DATA_BYTES, SCALE_BYTES, HAS_GATHER,
                      BLOCK_T, TOUCHES)
    pdl_wait(PDL, EARLY)
    start, n = _gather_lengths(seq_ptr, gather_ptr, r, seq_stride, gather_stride, width, offset, HAS_GATHER)
    tt = tl.arange(0, BLOCK_T)
    q = tl.arange(0, BLOCK_Q)
    d = tl.arange(0, QB)
    rb = tl.arange(0, ROPE_BYTES)
    col = q[:, None] * QB + d[None, :]
    q_ok3 = (q < NQ)[None, :, None] & (d < QB)[None, None, :]
    out_row0 = out_ptr + r * out_s0
    # software pipeline: the table entries of the next step are loaded before this step's stores
    blk, off, ok = _gather_rows(bt_ptr, r, w * BLOCK_T + tt, n, start, bt_s0, bt_s1, bt_width, num_blocks, BS)
    for i0 in range(w * BLOCK_T, n, step):
        i = i0 + tt
        live = i < n
        page = cache_ptr + blk * block_stride
        data = page + off * DATA_BYTES                                       # [BLOCK_T] pointers
        okq = q_ok3 & ok[:, None, None]
        codes = tl.load(data[:, None, None] + col[None, :, :], mask=okq, other=0)
        sbytes = tl.load(page[:, None] + BS * DATA_BYTES + off[:, None] * SCALE_BYTES + q[None, :],
                         mask=(q < NQ)[None, :] & ok[:, None], other=0).to(tl.int32)
        rope = tl.load(data[:, None] + NOPE + rb[None, :], mask=ok[:, None] & (rb < ROPE_BYTES)[None, :], other=0)
        blk, off, ok = _gather_rows(bt_ptr, r, i + step, n, start, bt_s0, bt_s1, bt_width, num_blocks, BS)
        # 2**(byte - 127) from its bits; byte 0 is the subnormal 2**-127, byte 255 is inf
        scale = tl.where(sbytes == 0, 1 << 22, sbytes << 23).to(tl.float32, bitcast=True)
        vals = fp8_decode(codes, FMT, SW) * scale[:, :, None]
        bits = bf16_bits_rne(vals)
        bits = tl.where(okq, bits, 0)                                   # invalid source: zeros
        dst = out_row0 + (offset + i).to(tl.int64) * out_s1                 # bf16 row pointers
        dst16 = dst.to(tl.pointer_type(tl.int16))
        tl.store(dst16[:, None, None] + col[None, :, :], bits, mask=q_ok3 & live[:, None, None])
        dst8 = dst.to(tl.pointer_type(tl.uint8))
        tl.store(dst8[:, None] + 2 * NOPE + rb[None, :], rope, mask=live[:, None] & (rb < ROPE_BYTES)[None, :])


def gather_early(width: int, target: platform.Target) -> int:
    """`dequant_gather_kernel`'s EARLY flags (`kernels/early.py`): for outputs of at most NARROW_WIDTH rows (decode
    windows) on PDL targets, its first rows' pages touched before the wait and its dependents launched after it
    (H100, 16 x 128: 3.41 -> 2.86 us with 8 rows per program, NOTES.md "Work before the wait"); none elsewhere."""
    return early.flags(touch=True, late=True) if early.use_early(target) and width <= NARROW_WIDTH else 0


def gather_touches(block_t: int) -> int:
    """TOUCHES of `_gather_touch`: a power of two of 32-byte sectors that holds block_t rows' data and scale sectors."""
    return triton.next_power_of_2(block_t * (layout.cdiv(layout.TOKEN_DATA_BYTES, int(SECTOR.value)) + 1))


def gather_block_t(width: int, target: platform.Target) -> int:
    """Tokens per loop step of `dequant_gather_kernel` for an output of `width` rows per request."""
    if width > NARROW_WIDTH:
        return BLOCK_T
    return BLOCK_T_EARLY if gather_early(width, target) else BLOCK_T_NARROW


def gather_constexprs(block_size: int, use_fnuz: bool, has_gather: bool, target: platform.Target,
                      width: int) -> dict:
    """Constexprs (and num_warps) of `dequant_gather_kernel` for an output of `width` rows per request."""
    codec = ue8m0_codec(fp8_format(use_fnuz), target)
    block_t = gather_block_t(width, target)
    warps = min(GATHER_MAX_WARPS, platform.num_warps_for(target, block_t * BLOCK_Q * layout.QUANT_BLOCK))
    return dict(**_layout_constexprs(block_size), FMT=codec["FMT"], SW=codec["SW"], HAS_GATHER=has_gather,
                BLOCK_T=block_t, PDL=platform.supports_pdl(target), EARLY=gather_early(width, target),
                TOUCHES=gather_touches(block_t), num_warps=warps)


def gather_workers(width: int, target: platform.Target) -> int:
    """Programs per request: enough for one step each over `width` rows, at most MAX_WORKERS (a
    function of out's shape and the target only, so a captured graph fits every later call)."""
    return max(1, min(layout.cdiv(width, gather_block_t(width, target)), MAX_WORKERS))


def gather_runtime_args(seq_stride: int, gather_stride: int, out_strides, bt_strides, bt_width: int,
                        num_blocks: int, block_stride: int, width: int, offset: int) -> tuple:
    """The int arguments after the 5 tensors (out as bf16, cache uint8, seq_lens, gather_lens or
    seq_lens again, block_table)."""
    return (seq_stride, gather_stride, out_strides[0], out_strides[1], bt_strides[0], bt_strides[1], bt_width, num_blocks, block_stride,
            width, offset)


INSERT_LAUNCHER = FastLauncher(quantize_insert_kernel)
GATHER_LAUNCHER = FastLauncher(dequant_gather_kernel)


# --- compile matrix (torch_dsv4_ops.compile_matrix) -------------------------------------------
_MATRIX_BLOCK_SIZES = (64, 2)        # SWA/C4A and C128A pages


def matrix_launch_insert(target: platform.Target, block_size: int, use_fnuz: bool, slot_dtype=torch.int64,
                         padded: bool = True, tokens: int = 3):
    """What ops/k_cache.py passes to `quantize_insert_kernel` for one call on `target`: (case name,
    tensors as `matrix.Ptr`, ints, constexprs with num_warps). 2 blocks, contiguous k and slots."""
    from .matrix import Ptr

    stride = layout.ds_mla_block_stride(block_size) if padded else layout.ds_mla_block_bytes(block_size)
    per_program = insert_tokens(tokens)
    meta = launch_options(insert_constexprs(block_size, use_fnuz, target, per_program))
    tensors = (Ptr(torch.bfloat16), Ptr(torch.uint8), Ptr(slot_dtype))
    ints = insert_runtime_args(tokens, layout.HEAD_DIM, 1, 2 * block_size, stride)
    name = f"k_cache_insert.bs{block_size}.{'fnuz' if use_fnuz else 'ocp'}" \
        + ("" if slot_dtype == torch.int64 else ".slot32") + ("" if padded else ".unpadded") \
        + ("" if per_program == 1 else f".t{per_program}")
    return name, tensors, ints, meta


def matrix_launch_gather(target: platform.Target, block_size: int, use_fnuz: bool, has_gather: bool,
                         table_dtype=torch.int32, width: int = 128, offset: int = 5):
    """What ops/k_cache.py passes to `dequant_gather_kernel` (16 requests, 4-block tables)."""
    from .matrix import Ptr

    nb, cols = 64, 4
    meta = launch_options(gather_constexprs(block_size, use_fnuz, has_gather, target, width))
    tensors = (Ptr(torch.bfloat16), Ptr(torch.uint8), Ptr(torch.int32), Ptr(torch.int32), Ptr(table_dtype))
    ints = gather_runtime_args(1, 1 if has_gather else 0, (width * layout.HEAD_DIM, layout.HEAD_DIM), (cols, 1),
                               cols, nb, layout.ds_mla_block_stride(block_size), width, offset)
    name = f"k_cache_gather.bs{block_size}.{'fnuz' if use_fnuz else 'ocp'}" + (".gl" if has_gather else "") \
        + ("" if table_dtype == torch.int32 else ".table64") + f".w{width}"
    return name, tensors, ints, meta


def _matrix_case(target, kernel, launch):
    from .matrix import kernel_case

    name, tensors, ints, meta = launch
    return kernel_case(target, name, kernel, tensors, ints, meta)


def matrix_cases(target: platform.Target) -> list:
    """Every specialisation the k_cache ops launch on `target`: both page sizes x OCP/FNUZ; insert
    with int64/int32 slots and unpadded pages; gather with/without gather_lens and int32/int64 tables."""
    from .matrix import dedupe

    cases = []
    for bs in _MATRIX_BLOCK_SIZES:
        for fnuz in (False, True):
            cases.append(_matrix_case(target, quantize_insert_kernel, matrix_launch_insert(target, bs, fnuz)))
            cases.append(_matrix_case(target, quantize_insert_kernel,
                                      matrix_launch_insert(target, bs, fnuz, slot_dtype=torch.int32)))
            cases.append(_matrix_case(target, quantize_insert_kernel,
                                      matrix_launch_insert(target, bs, fnuz, padded=False)))
            for start, _ in INSERT_TILES:       # the several-tokens tiles of large calls
                cases.append(_matrix_case(target, quantize_insert_kernel,
                                          matrix_launch_insert(target, bs, fnuz, tokens=start)))
            for has_gather in (False, True):
                for table in (torch.int32, torch.int64):
                    for width in (128, 8192):
                        cases.append(_matrix_case(target, dequant_gather_kernel,
                                                  matrix_launch_gather(target, bs, fnuz, has_gather, table, width)))
    return dedupe(cases)
