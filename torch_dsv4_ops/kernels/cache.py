"""Triton kernels and launchers for the flash KV-cache writes (SPEC §3.1).

`flash_cache_write_kernel` serves NHD caches and `_diffkv`: each program takes one token and a tile
of heads, and writes that token's K tile and V tile. Every cache address is
`blk*S_BLK + off*S_OFF + h*S_H + (d // X)*S_DX + (d % X)*S_DI`, which covers NHD (X = 1), head-major
K (X = x) and head-major V (X = 1, D before the offset) with runtime strides.
`head_major_group_kernel` serves head-major caches from GROUP_MIN_TOKENS tokens on: each program
takes GROUP_TOKENS consecutive tokens of one head, so that a prefill's run of slots leaves as
contiguous rows (full sectors).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import layout, platform
from ._launch import FastLauncher, launch_options  # noqa: F401  (ops use kernels.launch_options)
from .fp8 import bf16_bits_rne, fp8_decode, fp8_encode

if platform.INTERPRET:   # the interpreter has no grid dependency control; PDL is False there
    gdc_wait = gdc_launch_dependents = None
else:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

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
    div64: bool = False               # x / scale as fp32(x * fp64(1 / scale)) (exact, see _to_cache)


def make_codec(in_dtype, cache_dtype, fmt: layout.Fp8Format | None, target: platform.Target) -> Codec:
    """Choose the conversion for `in_dtype` -> cache (`fmt` from layout.resolve_kv_cache_format)."""
    in_fmt = layout.FP8_BY_DTYPE.get(in_dtype)
    sw_in = in_fmt is not None and not platform.native_fp8(target, in_fmt)
    in_code = in_fmt.code if in_fmt is not None else layout.NOT_FP8
    if fmt is not None:
        if in_fmt is fmt:
            return Codec(in_code, COPY)
        scaled = in_fmt is None
        return Codec(in_code, FP8, fmt.code, scaled, sw_in, not platform.native_fp8(target, fmt),
                     scaled and platform.fast_fp64(target))
    if in_dtype == cache_dtype:
        return Codec(in_code, COPY)
    return Codec(in_code, BF16 if cache_dtype == torch.bfloat16 else FLOAT, sw_in=sw_in)


def kernel_views(in_dtype: torch.dtype, cache_dtype: torch.dtype, codec: Codec):
    """The dtypes the launcher views (input, cache) as: fp8 as uint8, bf16 written by the software
    RNE as int16; None keeps the tensor's own dtype."""
    in_view = torch.uint8 if in_dtype in layout.FP8_BY_DTYPE else None
    if codec.out_kind == BF16:
        return in_view, torch.int16
    return in_view, (torch.uint8 if cache_dtype in layout.FP8_BY_DTYPE else None)


def diffkv_v_start(kv_cache, dk: int) -> int:
    """Element offset of V inside a diffkv cache row: V is the same cache, Dk elements in."""
    return dk * kv_cache.stride(3)


@triton.jit
def _to_cache(x, scale, IN_FP8: tl.constexpr, OUT_KIND: tl.constexpr, OUT_FP8: tl.constexpr,
              SCALED: tl.constexpr, DIV64: tl.constexpr, SW_IN: tl.constexpr, SW_OUT: tl.constexpr):
    # one return at the end: compiled Triton rejects an early return followed by more code
    if OUT_KIND == 0:
        y = x
    else:
        if IN_FP8 != 0:
            xf = fp8_decode(x, IN_FP8, SW_IN)
        else:
            xf = x.to(tl.float32)
        if OUT_KIND == 1:
            y = xf
        elif OUT_KIND == 2:
            y = bf16_bits_rne(xf)
        else:
            if SCALED:
                if DIV64:
                    # scale holds fp64(1/s) = RN64(1/s). fp32(x * 1/s) == RN32(x / s) for all fp32 x, s:
                    # the fp64 product is within 2**-52 (relative) of x/s, while x/s is never within
                    # 2**-49 of an fp32 rounding midpoint m (x = s*m would need an odd 25-bit
                    # significand in x; otherwise x - s*m is a nonzero multiple of 2**(ea+eb), which
                    # is >= 2**-49 * s*m). No per-element division, so no serialised slow paths.
                    xf = (xf.to(tl.float64) * scale).to(tl.float32)
                else:
                    xf = tl.math.div_rn(xf, scale)
            y = fp8_encode(xf, OUT_FP8, SW_OUT)
    return y


@triton.jit
def _load_tile(src_ptr, t, h, h_ok, s_t, s_h, s_d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    return tl.load(src_ptr + t * s_t + h[:, None] * s_h + d[None, :] * s_d, mask=h_ok[:, None] & (d < D)[None, :])


@triton.jit
def _store_tile(dst_ptr, dst_base, y, h, store_ok, c_h, c_dx, c_di, D: tl.constexpr, X: tl.constexpr,
                BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    inner = h[:, None] * c_h + (d // X)[None, :] * c_dx + (d % X)[None, :] * c_di
    tl.store(dst_ptr + dst_base + inner, y, mask=store_ok[:, None] & (d < D)[None, :])


@triton.jit
def flash_cache_write_kernel(
    key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, num_slots, slot_stride, vc_start,
    k_st, k_sh, k_sd, v_st, v_sh, v_sd,
    kc_blk, kc_off, kc_h, kc_dx, kc_di,
    vc_blk, vc_off, vc_h, vc_dx, vc_di,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, XK: tl.constexpr, XV: tl.constexpr,
    BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IN_FP8: tl.constexpr, OUT_KIND: tl.constexpr, OUT_FP8: tl.constexpr, SCALED: tl.constexpr,
    DIV64: tl.constexpr, SW_IN: tl.constexpr, SW_OUT: tl.constexpr, PDL: tl.constexpr,
):
    # Every load is issued before any store: a load after a store cannot be hoisted above it (the
    # compiler must assume they alias), which would put two memory round trips on the path.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    if PDL:
        # launched with programmatic dependent launch: let the next kernel start launching, and wait
        # for the previous one (its writes visible, its reads done) before touching memory
        gdc_launch_dependents()
        gdc_wait()
    slot = tl.load(slot_ptr + t * slot_stride).to(tl.int64)
    # token t < T is always inside key/value: their loads need not wait for the slot
    k = _load_tile(key_ptr, t, h, h_ok, k_st, k_sh, k_sd, DK, BLOCK_DK)
    v = _load_tile(value_ptr, t, h, h_ok, v_st, v_sh, v_sd, DV, BLOCK_DV)
    k_scale = 1.0
    v_scale = 1.0
    if SCALED:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        if DIV64:   # the one IEEE division per program (see _to_cache)
            k_scale = 1.0 / k_scale.to(tl.float64)
            v_scale = 1.0 / v_scale.to(tl.float64)
    valid = (slot >= 0) & (slot < num_slots)        # every negative slot and every slot past the cache: skip
    slot = tl.where(valid, slot, 0)
    blk = slot // BS
    off = slot % BS
    store_ok = h < tl.where(valid, H, 0)            # h_ok & valid, as a tensor-only mask (interpreter)
    k = _to_cache(k, k_scale, IN_FP8, OUT_KIND, OUT_FP8, SCALED, DIV64, SW_IN, SW_OUT)
    v = _to_cache(v, v_scale, IN_FP8, OUT_KIND, OUT_FP8, SCALED, DIV64, SW_IN, SW_OUT)
    _store_tile(kc_ptr, blk * kc_blk + off * kc_off, k, h, store_ok, kc_h, kc_dx, kc_di, DK, XK, BLOCK_DK)
    _store_tile(vc_ptr, vc_start + blk * vc_blk + off * vc_off, v, h, store_ok, vc_h, vc_dx, vc_di, DV, XV,
                BLOCK_DV)


@triton.jit
def _group_slots(slot_ptr, tok, T, slot_stride, num_slots):
    """(slots, valid) of tokens `tok`: a slot counts only for a token < T with 0 <= slot < num_slots (0 where not)."""
    slot = tl.load(slot_ptr + tok * slot_stride, mask=tok < T, other=-1).to(tl.int64)
    valid = (tok < T) & (slot >= 0) & (slot < num_slots)
    return tl.where(valid, slot, 0), valid


@triton.jit
def head_major_group_kernel(
    key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, T, num_slots, slot_stride,
    k_st, k_sh, k_sd, v_st, v_sh, v_sd,
    kc_blk, kc_off, kc_h, kc_dx, kc_di,
    vc_blk, vc_off, vc_h, vc_dx, vc_di,
    DK: tl.constexpr, DV: tl.constexpr, XK: tl.constexpr, BS: tl.constexpr, TOK: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PACKED: tl.constexpr, SUB: tl.constexpr,
    IN_FP8: tl.constexpr, OUT_KIND: tl.constexpr, OUT_FP8: tl.constexpr, SCALED: tl.constexpr,
    DIV64: tl.constexpr, SW_IN: tl.constexpr, SW_OUT: tl.constexpr, PDL: tl.constexpr,
):
    """Head-major caches: program (g, h) writes head h of the TOK consecutive input tokens g*TOK.. .

    In a head-major cache a token's V values sit `block_size` elements apart (and its K values in
    x-element pieces), so one token's writes are partial sectors. Consecutive tokens of one block are
    adjacent instead: when the group's slots are one run inside one block starting at a multiple of TOK
    slots (a prefill), V rows of TOK tokens and K rows of TOK*x elements are stored as contiguous,
    aligned runs (vector stores, full sectors); otherwise the group goes SUB tokens at a time, each
    element to its own slot's address."""
    g = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    t = tl.arange(0, TOK)
    tok = g * TOK + t
    tok_ok = tok < T
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    slot, valid = _group_slots(slot_ptr, tok, T, slot_stride, num_slots)
    k = tl.load(key_ptr + tok[:, None] * k_st + h * k_sh + dk[None, :] * k_sd,
                mask=tok_ok[:, None] & (dk < DK)[None, :])
    v = tl.load(value_ptr + tok[:, None] * v_st + h * v_sh + dv[None, :] * v_sd,
                mask=tok_ok[:, None] & (dv < DV)[None, :])
    k_scale = 1.0
    v_scale = 1.0
    if SCALED:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        if DIV64:
            k_scale = 1.0 / k_scale.to(tl.float64)
            v_scale = 1.0 / v_scale.to(tl.float64)
    dx = tl.arange(0, BLOCK_DK // XK)
    # the group is one run inside one block, at a multiple of TOK slots (every run of a whole block when
    # BS == TOK): slot[i] = slot[0] + i for every i, all valid. Its V rows of TOK elements then start
    # aligned and leave as vector stores.
    s0 = tl.sum(tl.where(t == 0, slot, 0), axis=0)
    shift = slot - t
    run = (tl.sum(valid.to(tl.int32), axis=0) == TOK) & (tl.min(shift, axis=0) == s0) & \
        (tl.max(shift, axis=0) == s0) & (s0 % BS + TOK <= BS) & (s0 % TOK == 0)
    if PACKED and run:
        # rearranged before the conversion: the transposes move input-width elements, not fp8 bytes
        k3 = tl.permute(tl.reshape(k, (TOK, BLOCK_DK // XK, XK)), (1, 0, 2))                   # [DX, TOK, XK]
        k2 = tl.reshape(_to_cache(k3, k_scale, IN_FP8, OUT_KIND, OUT_FP8, SCALED, DIV64, SW_IN, SW_OUT),
                        (BLOCK_DK // XK, TOK * XK))
        v2 = _to_cache(tl.trans(v), v_scale, IN_FP8, OUT_KIND, OUT_FP8, SCALED, DIV64, SW_IN, SW_OUT)  # [DV, TOK]
        blk0 = s0 // BS
        off0 = (s0 % BS // TOK) * TOK       # == s0 % BS; written so that the compiler sees it divisible by TOK
        j = tl.arange(0, TOK * XK)
        tl.store(kc_ptr + blk0 * kc_blk + h * kc_h + dx[:, None] * kc_dx + off0 * XK + j[None, :], k2,
                 mask=((dx[:, None] * XK + j[None, :] % XK) < DK))
        tl.store(vc_ptr + blk0 * vc_blk + h * vc_h + dv[:, None] * vc_dx + (off0 + t)[None, :], v2,
                 mask=(dv < DV)[:, None])
    else:
        # SUB tokens at a time, their rows read again (from L1/L2): 64-bit addresses for all TOK tokens would
        # also bound the run branch's programs (ptxas, sm_90, bf16 into fp8: 168 registers -> 96)
        u = tl.arange(0, SUB)
        di = tl.arange(0, XK)
        k_in = (dx[:, None, None] * XK + di[None, None, :]) < DK
        for c in range(TOK // SUB):
            tok_c = g * TOK + c * SUB + u
            slot_c, ok = _group_slots(slot_ptr, tok_c, T, slot_stride, num_slots)
            k_sub = tl.load(key_ptr + tok_c[:, None] * k_st + h * k_sh + dk[None, :] * k_sd,
                            mask=ok[:, None] & (dk < DK)[None, :])
            v_sub = tl.load(value_ptr + tok_c[:, None] * v_st + h * v_sh + dv[None, :] * v_sd,
                            mask=ok[:, None] & (dv < DV)[None, :])
            k_sub = tl.permute(tl.reshape(k_sub, (SUB, BLOCK_DK // XK, XK)), (1, 0, 2))           # [DX, SUB, XK]
            k_sub = _to_cache(k_sub, k_scale, IN_FP8, OUT_KIND, OUT_FP8, SCALED, DIV64, SW_IN, SW_OUT)
            v_sub = _to_cache(tl.trans(v_sub), v_scale, IN_FP8, OUT_KIND, OUT_FP8, SCALED, DIV64, SW_IN, SW_OUT)
            blk_c = slot_c // BS
            off_c = slot_c % BS
            tl.store(kc_ptr + (blk_c * kc_blk + off_c * kc_off)[None, :, None] + h * kc_h
                     + dx[:, None, None] * kc_dx + di[None, None, :] * kc_di, k_sub, mask=k_in & ok[None, :, None])
            tl.store(vc_ptr + (blk_c * vc_blk + off_c * vc_off)[None, :] + h * vc_h + dv[:, None] * vc_dx, v_sub,
                     mask=(dv < DV)[:, None] & ok[None, :])


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
    block_dk, block_dv = max(1, triton.next_power_of_2(dk)), max(1, triton.next_power_of_2(dv))   # D = 0: masked
    block_h = min(triton.next_power_of_2(h), max(1, TILE_ELEMENTS // max(block_dk, block_dv)))
    return dict(BLOCK_H=block_h, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
                num_warps=platform.num_warps_for(target, block_h * max(block_dk, block_dv)))


def constexprs(h, dk, dv, kgeo: CacheGeometry, vgeo: CacheGeometry, block_size, codec: Codec,
               target: platform.Target) -> dict:
    """The kernel's constexpr arguments (and num_warps), shared by the launcher and the compile matrix."""
    return dict(H=h, DK=dk, DV=dv, XK=kgeo.x, XV=vgeo.x, BS=block_size,
                IN_FP8=codec.in_fp8, OUT_KIND=codec.out_kind, OUT_FP8=codec.out_fp8, SCALED=codec.scaled,
                DIV64=codec.div64, SW_IN=codec.sw_in, SW_OUT=codec.sw_out, PDL=platform.supports_pdl(target),
                **tile_config(h, dk, dv, target))



GROUP_TOKENS = 16          # head-major caches: consecutive input tokens one program writes (one head)
FALLBACK_TOKENS = 8        # ... of which this many at a time when they are not one run (H200, benchmarks/NOTES.md)
GROUP_MIN_TOKENS = 256     # ... from this many tokens on (prefill sizes); fewer go one token per program
# ... on this many warps, by the cache's K piece width x (16 B / element size; measured on an H100 with
# prefill-pattern writes, benchmarks/NOTES.md): fp8 caches 2, 16-bit caches 1; other caches by tile size
GROUP_WARPS_BY_X = {16: 2, 8: 1}


def uses_group_kernel(layout_name: str, tokens: int) -> bool:
    """Whether a write of `tokens` tokens into a cache of `layout_name` launches `head_major_group_kernel`
    (a host decision from shapes, so graph-safe)."""
    return layout_name == "head_major" and tokens >= GROUP_MIN_TOKENS


def group_constexprs(dk, dv, kgeo: CacheGeometry, vgeo: CacheGeometry, block_size, codec: Codec,
                     target: platform.Target) -> dict:
    """`head_major_group_kernel`'s constexprs (and num_warps). PACKED: the cache rows are contiguous
    (K: offset stride x, inner stride 1; V: offset stride 1), so a run of slots is a run of addresses."""
    x = kgeo.x
    block_dk = max(triton.next_power_of_2(max(dk, 1)), x)
    block_dv = triton.next_power_of_2(max(dv, 1))
    packed = kgeo.strides[1] == x and kgeo.strides[4] == 1 and vgeo.strides[1] == 1
    if GROUP_TOKENS % FALLBACK_TOKENS:
        raise ValueError(f"FALLBACK_TOKENS ({FALLBACK_TOKENS}) must divide GROUP_TOKENS ({GROUP_TOKENS})")
    return dict(DK=dk, DV=dv, XK=x, BS=block_size, TOK=GROUP_TOKENS, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
                PACKED=packed, SUB=FALLBACK_TOKENS, IN_FP8=codec.in_fp8, OUT_KIND=codec.out_kind,
                OUT_FP8=codec.out_fp8, SCALED=codec.scaled, DIV64=codec.div64, SW_IN=codec.sw_in, SW_OUT=codec.sw_out,
                PDL=platform.supports_pdl(target),
                num_warps=group_warps(x, GROUP_TOKENS * max(block_dk, block_dv), target))


def group_warps(x: int, tile_elements: int, target: platform.Target) -> int:
    """Warps of `head_major_group_kernel` for a cache of K piece width `x` and a tile of that many elements."""
    by_size = platform.num_warps_for(target, tile_elements)
    return min(GROUP_WARPS_BY_X.get(x, by_size), by_size)


def group_runtime_args(tokens: int, num_slots: int, slot_stride: int, key_strides, value_strides,
                       kgeo: CacheGeometry, vgeo: CacheGeometry) -> tuple:
    """`head_major_group_kernel`'s int arguments, in order, after the 7 tensors."""
    return (tokens, num_slots, slot_stride, *key_strides, *value_strides, *kgeo.strides, *vgeo.strides)


def group_grid(tokens: int, heads: int) -> tuple[int, int]:
    return (-(-tokens // GROUP_TOKENS), heads)


TENSOR_ARGS = ("key", "value", "kc", "vc", "slot_mapping", "k_scale", "v_scale")   # the first 7 parameters


def runtime_args(num_slots: int, slot_stride: int, vc_start: int, key_strides, value_strides,
                 kgeo: CacheGeometry, vgeo: CacheGeometry) -> tuple:
    """The kernel's int arguments, in order, after the 7 tensors (fp8 tensors as uint8 views, bf16
    caches written by the software RNE as int16 views)."""
    return (num_slots, slot_stride, vc_start, *key_strides, *value_strides, *kgeo.strides, *vgeo.strides)


LAUNCHER = FastLauncher(flash_cache_write_kernel)
GROUP_LAUNCHER = FastLauncher(head_major_group_kernel)


# --- compile matrix (torch_dsv4_ops.compile_matrix) -------------------------------------------

_MATRIX_INPUTS = (torch.bfloat16, torch.float16, torch.float32,
                  torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)
_MATRIX_CACHES = (("auto", torch.bfloat16), ("auto", torch.float16), ("auto", torch.float32),
                  ("fp8", torch.uint8), ("fp8", torch.float8_e4m3fn), ("fp8", torch.float8_e4m3fnuz),
                  ("fp8_e5m2", torch.uint8), ("fp8_e5m2", torch.float8_e5m2))
# (input, kv_cache_dtype, cache): one codec of each kind and cache element width (1, 2, 4 bytes) ...
_MATRIX_GEOMETRY_CODECS = ((torch.bfloat16, "auto", torch.bfloat16), (torch.float16, "auto", torch.bfloat16),
                           (torch.bfloat16, "auto", torch.float32), (torch.bfloat16, "fp8", torch.uint8))
# ... and the other fp8 paths (e5m2 encode, fp8 copy, fp8 decode), on fewer geometries
_MATRIX_FP8_CODECS = ((torch.float32, "fp8_e5m2", torch.uint8), (torch.float8_e4m3fn, "fp8", torch.uint8),
                      (torch.float8_e5m2, "auto", torch.bfloat16))
# (op, layout, H, Dk, Dv, block size)
_MATRIX_GEOMETRIES = (("flash", "nhd", 13, 80, 80, 16), ("flash", "head_major", 8, 128, 128, 16),
                      ("flash", "head_major", 13, 80, 80, 544), ("diffkv", "nhd", 8, 192, 128, 64),
                      ("diffkv", "nhd", 13, 80, 48, 16))


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("float8_", "").replace("bfloat16", "bf16") \
        .replace("float16", "fp16").replace("float32", "fp32").replace("uint8", "u8")


def matrix_launch(target: platform.Target, op: str, layout_name: str, in_dtype, kv_cache_dtype: str, cache_dtype,
                  h: int, dk: int, dv: int, bs: int, slot_dtype=torch.int64, slot_stride: int = 1,
                  aligned: bool = True, big_cache: bool = False, tokens: int = 3):
    """What ops/cache.py passes to the kernel for one call on `target`: (case name, the 7 tensor
    arguments as `matrix.Ptr`, the int arguments, the constexprs with num_warps).

    op "flash" (layout "nhd" or "head_major") or "diffkv"; `tokens` tokens (head-major from
    GROUP_MIN_TOKENS on: `head_major_group_kernel`); 4 blocks of `bs` slots. aligned=False:
    key and value are packed[:, 1:1+H*Dk] and packed[:, 1+H*Dk:] of one [T, H*(Dk+Dv)+1] buffer
    (unaligned pointers, odd token strides). big_cache: the cache is over 2 GiB (no AMD buffer ops).
    """
    from .matrix import Ptr

    fmt = layout.resolve_kv_cache_format(kv_cache_dtype, cache_dtype, platform.platform_e4m3(target))
    codec = make_codec(in_dtype, cache_dtype, fmt, target)
    in_view, cache_view = kernel_views(in_dtype, cache_dtype, codec)
    in_view, cache_view = in_view or in_dtype, cache_view or cache_dtype
    nb, vc_start = 4, 0
    if layout_name == "head_major":
        x = layout.head_major_x(cache_dtype)
        kgeo = head_major_k_geometry(torch.empty((nb, h, dk // x, bs, x), dtype=cache_dtype, device="meta"))
        vgeo = head_major_v_geometry(torch.empty((nb, h, dv, bs), dtype=cache_dtype, device="meta"))
    elif op == "diffkv":    # V is the same cache, starting Dk elements into each row
        kv = torch.empty((nb, bs, h, dk + dv), dtype=cache_dtype, device="meta")
        kgeo = vgeo = nhd_geometry(kv)
        vc_start = diffkv_v_start(kv, dk)
    else:
        kgeo = nhd_geometry(torch.empty((nb, bs, h, dk), dtype=cache_dtype, device="meta"))
        vgeo = nhd_geometry(torch.empty((nb, bs, h, dv), dtype=cache_dtype, device="meta"))
    row = h * (dk + dv) + 1
    # torch's contiguous strides (a zero-size dim counts as 1), or rows of one packed buffer
    k_strides = torch.empty((4, h, dk), device="meta").stride() if aligned else (row, max(dk, 1), 1)
    v_strides = torch.empty((4, h, dv), device="meta").stride() if aligned else (row, max(dv, 1), 1)
    tensors = (Ptr(in_view, aligned), Ptr(in_view, aligned), Ptr(cache_view, small=not big_cache),
               Ptr(cache_view, small=not big_cache), Ptr(slot_dtype), Ptr(torch.float32), Ptr(torch.float32))
    assert len(tensors) == len(TENSOR_ARGS)
    if uses_group_kernel(layout_name, tokens):
        meta = group_constexprs(dk, dv, kgeo, vgeo, bs, codec, target)
        ints = group_runtime_args(tokens, nb * bs, slot_stride, k_strides, v_strides, kgeo, vgeo)
    else:
        meta = constexprs(h, dk, dv, kgeo, vgeo, bs, codec, target)
        ints = runtime_args(nb * bs, slot_stride, vc_start, k_strides, v_strides, kgeo, vgeo)
    name = f"{op}_{layout_name}.{_short(in_dtype)}-{kv_cache_dtype}:{_short(cache_dtype)}.h{h}d{dk}" \
        + (f"x{dv}" if dv != dk else "") + f".bs{bs}" + ("" if slot_dtype == torch.int64 else ".slot32") \
        + ("" if slot_stride == 1 else f".slotstride{slot_stride}") + ("" if aligned else ".unaligned") \
        + (".bigcache" if big_cache else "") + (".group" if uses_group_kernel(layout_name, tokens) else "")
    return name, tensors, ints, meta


def _matrix_case(target: platform.Target, *spec, **options):
    """`matrix_launch` as a compile-matrix case: what Triton's runtime would specialise on."""
    from .matrix import kernel_case

    name, tensors, ints, meta = matrix_launch(target, *spec, **options)
    fn = head_major_group_kernel if uses_group_kernel(spec[1], options.get("tokens", 3)) \
        else flash_cache_write_kernel
    return kernel_case(target, name, fn, tensors, ints, meta)


def matrix_cases(target: platform.Target) -> list:
    """Specialisations of `flash_cache_write_kernel` the flash-cache ops launch on `target`.

    Every input dtype x cache kind (NHD, H 8, D 128); head-major, odd head counts/dims, a
    non-power-of-two block size and diffkv (Dk != Dv) for one codec of each kind; int32 and strided
    slots, unaligned strided inputs, >2 GiB caches and diffkv with Dv = 0 for the copy and fp8 paths.
    Duplicates dropped.
    """
    from .matrix import dedupe

    cases = [_matrix_case(target, "flash", "nhd", i, s, c, 8, 128, 128, 16)
             for i in _MATRIX_INPUTS for s, c in _MATRIX_CACHES]
    cases += [_matrix_case(target, op, lay, i, s, c, h, dk, dv, bs)
              for i, s, c in _MATRIX_GEOMETRY_CODECS for op, lay, h, dk, dv, bs in _MATRIX_GEOMETRIES]
    cases += [_matrix_case(target, op, lay, i, s, c, h, dk, dv, bs)
              for i, s, c in _MATRIX_FP8_CODECS for op, lay, h, dk, dv, bs in _MATRIX_GEOMETRIES[1::3]]
    for i, s, c in _MATRIX_GEOMETRY_CODECS[::3]:    # bf16 copy and bf16 -> platform fp8
        cases += [_matrix_case(target, "flash", "nhd", i, s, c, 8, 128, 128, 16, slot_dtype=torch.int32),
                  _matrix_case(target, "flash", "nhd", i, s, c, 8, 128, 128, 16, slot_stride=2),
                  _matrix_case(target, "flash", "nhd", i, s, c, 8, 128, 128, 16, aligned=False),
                  _matrix_case(target, "diffkv", "nhd", i, s, c, 13, 80, 48, 16, aligned=False),
                  _matrix_case(target, "flash", "head_major", i, s, c, 8, 128, 128, 16, big_cache=True),
                  _matrix_case(target, "diffkv", "nhd", i, s, c, 8, 128, 0, 16)]      # Dv = 0: a masked V tile
    # head-major prefill sizes: the group kernel, for every codec and head-major geometry
    cases += [_matrix_case(target, op, lay, i, s, c, h, dk, dv, bs, tokens=GROUP_MIN_TOKENS)
              for i, s, c in _MATRIX_GEOMETRY_CODECS + _MATRIX_FP8_CODECS
              for op, lay, h, dk, dv, bs in _MATRIX_GEOMETRIES if lay == "head_major"]
    return dedupe(cases)
