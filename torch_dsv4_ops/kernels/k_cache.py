"""Triton kernels and launchers for the fp8_ds_mla K cache (SPEC §2.1, §3.2).

* `quantize_insert_kernel`: grid (N,), one program per token. It loads the slot and the token's
  bf16 row (NoPE as a [8, 64] tile whose row 7 is masked, RoPE as 128 raw bytes), computes the 7
  UE8M0 exponents from the fp32 bit patterns (no log2), and stores 448 fp8 bytes, 128 RoPE bytes
  and 8 scale bytes with byte-wide contiguous stores (vectorised to 16 B where the page stride is a
  multiple of 16).
* `dequant_gather_kernel`: grid (R, workers), workers = min(cdiv(W, BLOCK_T), MAX_WORKERS) from
  host ints only. Program (r, w) walks the rows i = w*BLOCK_T, w*BLOCK_T + workers*BLOCK_T, ...
  of request r below min(gl, W - offset), BLOCK_T tokens per step, every load of a step before its
  stores.

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
from .fp8 import bf16_bits_rne, fp8_decode, fp8_encode

if platform.INTERPRET:   # the interpreter has no grid dependency control; PDL is False there
    gdc_wait = gdc_launch_dependents = None
else:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BLOCK_Q = triton.next_power_of_2(layout.NUM_QUANT_BLOCKS)   # 8 rows of the NoPE tile (7 used)
BLOCK_T = 4                  # gather: tokens per loop step of one program
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
# quantize_and_insert_k_cache
# ------------------------------------------------------------------------------------------------
@triton.jit
def quantize_insert_kernel(
    k_ptr, cache_ptr, slot_ptr, k_stride, slot_stride, num_slots, block_stride,
    BS: tl.constexpr, NOPE: tl.constexpr, ROPE_BYTES: tl.constexpr, QB: tl.constexpr, NQ: tl.constexpr,
    BLOCK_Q: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, FMT: tl.constexpr,
    SW: tl.constexpr, FP8_MAX: tl.constexpr, E_SHIFT: tl.constexpr, MANT_LIMIT: tl.constexpr,
    FLOOR_BITS: tl.constexpr, BIAS: tl.constexpr, NAN_CODE: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    q = tl.arange(0, BLOCK_Q)
    d = tl.arange(0, QB)
    q_ok = q < NQ
    col = q[:, None] * QB + d[None, :]                                  # NoPE dim of the tile
    tile_ok = q_ok[:, None] & (d < QB)[None, :]
    rb = tl.arange(0, ROPE_BYTES)
    # all loads first: the slot, the NoPE tile, the RoPE bytes (token t < N is always inside k)
    slot = tl.load(slot_ptr + t * slot_stride).to(tl.int64)
    row = k_ptr + t * k_stride
    x = tl.load(row + col, mask=tile_ok, other=0.0).to(tl.float32)
    rope = tl.load(row.to(tl.pointer_type(tl.uint8)) + 2 * NOPE + rb)
    # UE8M0 exponent per quant block, exactly, from bit patterns: |x| as int bits orders like |x|
    mag = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    mag = tl.where(mag > 0x7F800000, 0, mag)                            # NaN is left out of amax
    a = tl.max(mag, axis=1)
    a = tl.maximum(a, FLOOR_BITS)                                       # the fp32 1e-4 floor
    a = tl.minimum(a, 0x7F7FFFFF)                                       # inf counts as the largest fp32
    e = (a >> 23) - E_SHIFT + ((a & 0x7FFFFF) > MANT_LIMIT).to(tl.int32)
    inv = ((BIAS - e) << 23).to(tl.float32, bitcast=True)               # 2**-e, a normal fp32
    y = x * inv[:, None]                                                # exact
    y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))   # NaN passes through
    codes = fp8_encode(y, FMT, SW)
    codes = tl.where(y != y, NAN_CODE, codes)                          # one NaN code, any sign (docs §6.1)
    byte = tl.minimum(tl.maximum(e + BIAS, 0), 255)
    byte = tl.where(q_ok, byte, 0).to(tl.uint8)                         # byte 7 = 0
    valid = (slot >= 0) & (slot < num_slots)                            # every other slot: skip
    slot = tl.where(valid, slot, 0)
    blk = slot // BS
    off = slot % BS
    page = cache_ptr + blk * block_stride
    data = page + off * DATA_BYTES
    lim = tl.where(valid, NQ, 0)                                        # tensor-only masks (interpreter)
    tl.store(data + col, codes, mask=(q < lim)[:, None] & (d < QB)[None, :])
    tl.store(data + NOPE + rb, rope, mask=rb < tl.where(valid, ROPE_BYTES, 0))
    sc = page + BS * DATA_BYTES + off * SCALE_BYTES
    tl.store(sc + q, byte, mask=q < tl.where(valid, SCALE_BYTES, 0))


def _codec(use_fnuz: bool, target: platform.Target) -> dict:
    fmt = fp8_format(use_fnuz)
    e_shift, mant_limit = ue8m0_bit_rule(fmt)
    return dict(FMT=fmt.code, SW=not platform.native_fp8(target, fmt), FP8_MAX=fmt.ue8m0_max, E_SHIFT=e_shift,
                MANT_LIMIT=mant_limit, FLOOR_BITS=fp32_bits(layout.UE8M0_FLOOR), BIAS=layout.UE8M0_BIAS,
                NAN_CODE=nan_code(fmt))


def _layout_constexprs(block_size: int) -> dict:
    return dict(BS=block_size, NOPE=layout.NOPE_DIM, ROPE_BYTES=2 * layout.ROPE_DIM, QB=layout.QUANT_BLOCK,
                NQ=layout.NUM_QUANT_BLOCKS, BLOCK_Q=BLOCK_Q, DATA_BYTES=layout.TOKEN_DATA_BYTES,
                SCALE_BYTES=layout.SCALE_BYTES)


def insert_constexprs(block_size: int, use_fnuz: bool, target: platform.Target) -> dict:
    """Constexprs (and num_warps) of `quantize_insert_kernel`, shared by the launcher and the matrix."""
    return dict(**_layout_constexprs(block_size), **_codec(use_fnuz, target), PDL=platform.supports_pdl(target),
                num_warps=platform.num_warps_for(target, BLOCK_Q * layout.QUANT_BLOCK))



def insert_runtime_args(k_stride: int, slot_stride: int, num_slots: int, block_stride: int) -> tuple:
    """The int arguments after the 3 tensors (k as bf16, cache as uint8, slot_mapping)."""
    return (k_stride, slot_stride, num_slots, block_stride)


# ------------------------------------------------------------------------------------------------
# dequantize_and_gather_k_cache
# ------------------------------------------------------------------------------------------------
@triton.jit
def dequant_gather_kernel(
    out_ptr, cache_ptr, seq_ptr, gather_ptr, bt_ptr, seq_stride, gather_stride, out_s0, out_s1, bt_s0, bt_s1,
    bt_width, num_blocks, block_stride, width, offset,
    BS: tl.constexpr, NOPE: tl.constexpr, ROPE_BYTES: tl.constexpr, QB: tl.constexpr, NQ: tl.constexpr,
    BLOCK_Q: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, FMT: tl.constexpr,
    SW: tl.constexpr, HAS_GATHER: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1)
    step = tl.num_programs(1) * BLOCK_T
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.load(seq_ptr + r * seq_stride).to(tl.int64)
    if HAS_GATHER:
        gl = tl.load(gather_ptr + r * gather_stride).to(tl.int64)
    else:
        gl = seq
    gl = tl.maximum(gl, 0)
    start = seq - gl
    n = tl.minimum(gl, width - offset)                  # rows past out's width are skipped (§4 b)
    tt = tl.arange(0, BLOCK_T)
    q = tl.arange(0, BLOCK_Q)
    d = tl.arange(0, QB)
    rb = tl.arange(0, ROPE_BYTES)
    col = q[:, None] * QB + d[None, :]
    q_ok3 = (q < NQ)[None, :, None] & (d < QB)[None, None, :]
    out_row0 = out_ptr + r * out_s0
    for i0 in range(w * BLOCK_T, n, step):
        i = i0 + tt
        live = i < n
        pos = start + i
        colb = tl.where(pos >= 0, pos, 0) // BS
        ok = live & (pos >= 0) & (colb < bt_width)
        blk = tl.load(bt_ptr + r * bt_s0 + colb * bt_s1, mask=ok, other=-1).to(tl.int64)
        ok = ok & (blk >= 0) & (blk < num_blocks)
        blk = tl.where(ok, blk, 0)
        off = tl.where(pos >= 0, pos, 0) % BS
        page = cache_ptr + blk * block_stride
        data = page + off * DATA_BYTES                                       # [BLOCK_T] pointers
        okq = q_ok3 & ok[:, None, None]
        codes = tl.load(data[:, None, None] + col[None, :, :], mask=okq, other=0)
        sbytes = tl.load(page[:, None] + BS * DATA_BYTES + off[:, None] * SCALE_BYTES + q[None, :],
                         mask=(q < NQ)[None, :] & ok[:, None], other=0).to(tl.int32)
        rope = tl.load(data[:, None] + NOPE + rb[None, :], mask=ok[:, None] & (rb < ROPE_BYTES)[None, :], other=0)
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


def gather_constexprs(block_size: int, use_fnuz: bool, has_gather: bool, target: platform.Target) -> dict:
    """Constexprs (and num_warps) of `dequant_gather_kernel`."""
    codec = _codec(use_fnuz, target)
    return dict(**_layout_constexprs(block_size), FMT=codec["FMT"], SW=codec["SW"], HAS_GATHER=has_gather,
                BLOCK_T=BLOCK_T, PDL=platform.supports_pdl(target),
                num_warps=platform.num_warps_for(target, BLOCK_T * BLOCK_Q * layout.QUANT_BLOCK))


def gather_workers(width: int) -> int:
    """Programs per request: enough for one BLOCK_T step each over `width` rows, at most MAX_WORKERS
    (a function of out's shape only, so a captured graph fits every later call)."""
    return max(1, min(layout.cdiv(width, BLOCK_T), MAX_WORKERS))


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
                         padded: bool = True):
    """What ops/k_cache.py passes to `quantize_insert_kernel` for one call on `target`: (case name,
    tensors as `matrix.Ptr`, ints, constexprs with num_warps). 2 blocks, contiguous k and slots."""
    from .matrix import Ptr

    stride = layout.ds_mla_block_stride(block_size) if padded else layout.ds_mla_block_bytes(block_size)
    meta = launch_options(insert_constexprs(block_size, use_fnuz, target))
    tensors = (Ptr(torch.bfloat16), Ptr(torch.uint8), Ptr(slot_dtype))
    ints = insert_runtime_args(layout.HEAD_DIM, 1, 2 * block_size, stride)
    name = f"k_cache_insert.bs{block_size}.{'fnuz' if use_fnuz else 'ocp'}" \
        + ("" if slot_dtype == torch.int64 else ".slot32") + ("" if padded else ".unpadded")
    return name, tensors, ints, meta


def matrix_launch_gather(target: platform.Target, block_size: int, use_fnuz: bool, has_gather: bool,
                         table_dtype=torch.int32, width: int = 128, offset: int = 5):
    """What ops/k_cache.py passes to `dequant_gather_kernel` (16 requests, 4-block tables)."""
    from .matrix import Ptr

    nb, cols = 64, 4
    meta = launch_options(gather_constexprs(block_size, use_fnuz, has_gather, target))
    tensors = (Ptr(torch.bfloat16), Ptr(torch.uint8), Ptr(torch.int32), Ptr(torch.int32), Ptr(table_dtype))
    ints = gather_runtime_args(1, 1 if has_gather else 0, (width * layout.HEAD_DIM, layout.HEAD_DIM), (cols, 1),
                               cols, nb, layout.ds_mla_block_stride(block_size), width, offset)
    name = f"k_cache_gather.bs{block_size}.{'fnuz' if use_fnuz else 'ocp'}" + (".gl" if has_gather else "") \
        + ("" if table_dtype == torch.int32 else ".table64")
    return name, tensors, ints, meta


def _matrix_case(target, kernel, launch):
    from .matrix import KernelCase, specialise

    name, tensors, ints, meta = launch
    meta = {k: v for k, v in meta.items() if k not in ("num_warps", "launch_pdl")}
    num_warps = launch[3]["num_warps"]
    signature, consts, attrs = specialise(kernel, tensors + ints, meta, target)
    return KernelCase(name, kernel, signature, consts, num_warps, attrs)


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
            for has_gather in (False, True):
                for table in (torch.int32, torch.int64):
                    cases.append(_matrix_case(target, dequant_gather_kernel,
                                              matrix_launch_gather(target, bs, fnuz, has_gather, table)))
    return dedupe(cases)
