"""Reference flash KV-cache writes (SPEC §3.1, §4 a-c).

Arguments are those of the ops, already validated; `e4m3` is the platform e4m3 format that a
uint8 cache with kv_cache_dtype "fp8" holds (OCP on CPU; the test oracle passes the GPU's).
"""
from __future__ import annotations

import torch

from .. import layout


def encode(x: torch.Tensor, cache_dtype: torch.dtype, fmt: layout.Fp8Format | None,
           scale: torch.Tensor) -> torch.Tensor:
    """enc() of SPEC §3.1: values of `x` as the cache stores them (fp8 results as uint8 codes)."""
    in_fmt = layout.FP8_BY_DTYPE.get(x.dtype)
    if fmt is None:
        return x.float().to(cache_dtype) if in_fmt is not None else x.to(cache_dtype)
    if in_fmt is fmt:
        return x.view(torch.uint8)
    if in_fmt is not None:
        xf = x.float()
    else:
        xf = x.float() / scale.float().reshape(())   # IEEE fp32 division, §4 c
    return xf.clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8)


def _cache_view(cache: torch.Tensor, fmt: layout.Fp8Format | None) -> torch.Tensor:
    return cache.view(torch.uint8) if fmt is not None else cache


def _valid_slots(slot_mapping: torch.Tensor, num_tokens: int, num_slots: int):
    slots = slot_mapping[:num_tokens].long()
    tokens = ((slots >= 0) & (slots < num_slots)).nonzero().flatten()
    return tokens, slots[tokens]


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
                            e4m3: layout.Fp8Format = layout.E4M3FN) -> None:
    """NHD caches [nb, bs, H, D], or head-major K [nb, H, D//x, bs, x] + V [nb, H, D, bs]."""
    fmt = layout.resolve_kv_cache_format(kv_cache_dtype, key_cache.dtype, e4m3)
    head_major = key_cache.dim() == 5
    bs = key_cache.shape[3] if head_major else key_cache.shape[1]
    tokens, slots = _valid_slots(slot_mapping, slot_mapping.shape[0], key_cache.shape[0] * bs)
    blk, off = slots // bs, slots % bs
    k = encode(key[tokens], key_cache.dtype, fmt, k_scale)
    v = encode(value[tokens], value_cache.dtype, fmt, v_scale)
    kc, vc = _cache_view(key_cache, fmt), _cache_view(value_cache, fmt)
    if head_major:
        n, h, d = k.shape
        x = key_cache.shape[4]
        kc[blk, :, :, off, :] = k.reshape(n, h, d // x, x)
        vc[blk, :, :, off] = v
    else:
        kc[blk, off] = k
        vc[blk, off] = v


def reshape_and_cache_flash_diffkv(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
                                   e4m3: layout.Fp8Format = layout.E4M3FN) -> None:
    """kv_cache [nb, bs, H, Dk+Dv]: K into [..., :Dk], V into [..., Dk:]."""
    fmt = layout.resolve_kv_cache_format(kv_cache_dtype, kv_cache.dtype, e4m3)
    bs = kv_cache.shape[1]
    dk = key.shape[2]
    tokens, slots = _valid_slots(slot_mapping, slot_mapping.shape[0], kv_cache.shape[0] * bs)
    blk, off = slots // bs, slots % bs
    cache = _cache_view(kv_cache, fmt)
    cache[blk, off, :, :dk] = encode(key[tokens], kv_cache.dtype, fmt, k_scale)
    cache[blk, off, :, dk:] = encode(value[tokens], kv_cache.dtype, fmt, v_scale)
