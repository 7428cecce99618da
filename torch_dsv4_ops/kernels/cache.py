"""Triton kernel and launcher for the flash KV-cache writes (SPEC §3.1).

One kernel serves `reshape_and_cache_flash` (NHD or head-major) and `_diffkv`: each program
takes one token and a tile of heads, and writes that token's K tile and V tile. Every cache
address is `blk*S_BLK + off*S_OFF + h*S_H + (d // X)*S_DX + (d % X)*S_DI`, which covers NHD
(X = 1), head-major K (X = x) and head-major V (X = 1, D before the offset) with runtime strides.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import layout, platform
from .fp8 import bf16_bits_rne, fp8_decode, fp8_encode

# How a value reaches the cache (constexpr OUT_KIND)
COPY, FLOAT, BF16, FP8 = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class Codec:
    """Compile-time conversion from the input dtype to the cache's storage."""

    in_fp8: int = layout.NOT_FP8      # fp8 format code of the input, 0 for float input
    out_kind: int = COPY
    out_fp8: int = layout.NOT_FP8     # fp8 format code of the cache for FP8
    scaled: bool = False              # divide by the per-tensor scale (float input into fp8)
    sw_in: bool = False               # decode the input with the software codec
    sw_out: bool = False              # encode with the software codec


def make_codec(in_dtype, cache_dtype, fmt: layout.Fp8Format | None, target: platform.Target) -> Codec:
    """Choose the conversion for `in_dtype` -> cache (`fmt` from layout.resolve_kv_cache_format)."""
    in_fmt = layout.FP8_BY_DTYPE.get(in_dtype)
    sw_in = in_fmt is not None and not platform.native_fp8(target, in_fmt)
    in_code = in_fmt.code if in_fmt is not None else layout.NOT_FP8
    if fmt is not None:
        if in_fmt is fmt:
            return Codec(in_code, COPY)
        return Codec(in_code, FP8, fmt.code, in_fmt is None, sw_in, not platform.native_fp8(target, fmt))
    if in_dtype == cache_dtype:
        return Codec(in_code, COPY)
    return Codec(in_code, BF16 if cache_dtype == torch.bfloat16 else FLOAT, sw_in=sw_in)


@triton.jit
def _to_cache(x, scale, IN_FP8: tl.constexpr, OUT_KIND: tl.constexpr, OUT_FP8: tl.constexpr,
              SCALED: tl.constexpr, SW_IN: tl.constexpr, SW_OUT: tl.constexpr):
    if OUT_KIND == 0:
        return x
    if IN_FP8 != 0:
        xf = fp8_decode(x, IN_FP8, SW_IN)
    else:
        xf = x.to(tl.float32)
    if OUT_KIND == 1:
        return xf
    if OUT_KIND == 2:
        return bf16_bits_rne(xf)
    if SCALED:
        xf = tl.math.div_rn(xf, scale)
    return fp8_encode(xf, OUT_FP8, SW_OUT)


@triton.jit
def _write_tile(src_ptr, dst_ptr, t, dst_base, h, ok_h, scale_ptr,
                s_t, s_h, s_d, c_h, c_dx, c_di,
                D: tl.constexpr, X: tl.constexpr, BLOCK_D: tl.constexpr,
                IN_FP8: tl.constexpr, OUT_KIND: tl.constexpr, OUT_FP8: tl.constexpr, SCALED: tl.constexpr,
                SW_IN: tl.constexpr, SW_OUT: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    mask = ok_h[:, None] & (d < D)[None, :]
    x = tl.load(src_ptr + t * s_t + h[:, None] * s_h + d[None, :] * s_d, mask=mask)
    scale = 1.0
    if SCALED:
        scale = tl.load(scale_ptr)
    y = _to_cache(x, scale, IN_FP8, OUT_KIND, OUT_FP8, SCALED, SW_IN, SW_OUT)
    inner = h[:, None] * c_h + (d // X)[None, :] * c_dx + (d % X)[None, :] * c_di
    tl.store(dst_ptr + dst_base + inner, y, mask=mask)


@triton.jit
def flash_cache_write_kernel(
    key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, num_slots,
    k_st, k_sh, k_sd, v_st, v_sh, v_sd,
    kc_blk, kc_off, kc_h, kc_dx, kc_di,
    vc_blk, vc_off, vc_h, vc_dx, vc_di,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, XK: tl.constexpr, XV: tl.constexpr,
    BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IN_FP8: tl.constexpr, OUT_KIND: tl.constexpr, OUT_FP8: tl.constexpr, SCALED: tl.constexpr,
    SW_IN: tl.constexpr, SW_OUT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)        # every negative slot and every slot past the cache: skip
    slot = tl.where(valid, slot, 0)
    blk = slot // BS
    off = slot % BS
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok_h = h < tl.where(valid, H, 0)   # (h < H) & valid, kept a tensor-only mask for the interpreter
    _write_tile(key_ptr, kc_ptr, t, blk * kc_blk + off * kc_off, h, ok_h, k_scale_ptr,
                k_st, k_sh, k_sd, kc_h, kc_dx, kc_di,
                DK, XK, BLOCK_DK, IN_FP8, OUT_KIND, OUT_FP8, SCALED, SW_IN, SW_OUT)
    _write_tile(value_ptr, vc_ptr, t, blk * vc_blk + off * vc_off, h, ok_h, v_scale_ptr,
                v_st, v_sh, v_sd, vc_h, vc_dx, vc_di,
                DV, XV, BLOCK_DV, IN_FP8, OUT_KIND, OUT_FP8, SCALED, SW_IN, SW_OUT)


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """Element strides of one cache as (S_BLK, S_OFF, S_H, S_DX, S_DI) plus the inner width X."""

    strides: tuple[int, int, int, int, int]
    x: int = 1


def nhd_geometry(cache) -> CacheGeometry:
    """[nb, bs, H, D] (NHD or one half of a diffkv cache)."""
    s = cache.stride()
    return CacheGeometry((s[0], s[1], s[2], s[3], 0))


def head_major_k_geometry(cache) -> CacheGeometry:
    """[nb, H, D//x, bs, x]."""
    s = cache.stride()
    return CacheGeometry((s[0], s[3], s[1], s[2], s[4]), cache.shape[4])


def head_major_v_geometry(cache) -> CacheGeometry:
    """[nb, H, D, bs]."""
    s = cache.stride()
    return CacheGeometry((s[0], s[3], s[1], s[2], 0))


TILE_ELEMENTS = 2048   # elements of K (and of V) one program writes, at most


def tile_config(h: int, dk: int, dv: int, target: platform.Target) -> dict:
    """Tile sizes and warps for H heads of Dk/Dv dims."""
    block_dk, block_dv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    block_h = min(triton.next_power_of_2(h), max(1, TILE_ELEMENTS // max(block_dk, block_dv)))
    return dict(BLOCK_H=block_h, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
                num_warps=platform.num_warps_for(target, block_h * max(block_dk, block_dv)))


def constexprs(h, dk, dv, kgeo: CacheGeometry, vgeo: CacheGeometry, block_size, codec: Codec,
               target: platform.Target) -> dict:
    """The kernel's constexpr arguments (and num_warps), shared by the launcher and the compile matrix."""
    return dict(H=h, DK=dk, DV=dv, XK=kgeo.x, XV=vgeo.x, BS=block_size,
                IN_FP8=codec.in_fp8, OUT_KIND=codec.out_kind, OUT_FP8=codec.out_fp8, SCALED=codec.scaled,
                SW_IN=codec.sw_in, SW_OUT=codec.sw_out, **tile_config(h, dk, dv, target))


def launch(key, value, kc, vc, slot_mapping, k_scale, v_scale, num_slots: int,
           kgeo: CacheGeometry, vgeo: CacheGeometry, block_size: int, codec: Codec, target: platform.Target):
    """Write `slot_mapping.shape[0]` tokens. Tensors are the kernel views (fp8 as uint8, bf16 bits as int16)."""
    num_tokens = slot_mapping.shape[0]
    h, dk, dv = key.shape[1], key.shape[2], value.shape[2]
    meta = constexprs(h, dk, dv, kgeo, vgeo, block_size, codec, target)
    grid = (num_tokens, triton.cdiv(h, meta["BLOCK_H"]))
    flash_cache_write_kernel[grid](
        key, value, kc, vc, slot_mapping, k_scale, v_scale, num_slots,
        *key.stride(), *value.stride(), *kgeo.strides, *vgeo.strides, **meta)
