"""Flash KV-cache writes (SPEC §3.1): `dsv4::reshape_and_cache_flash` and `_diffkv`.

The Python entry points mirror vLLM's `triton_reshape_and_cache_flash[_diffkv]` (names,
argument names and order); both names are exported.
"""
from __future__ import annotations

import math

import torch

from .. import layout, platform
from ..kernels import cache as kernels
from ..library import register_op
from ..reference import cache as reference
from ._checks import check_int32_extent, check_scale, check_shape, check_tensor
from ._plans import MISSING, PlanCache

INPUT_DTYPES = layout.FLOAT_CACHE_DTYPES + tuple(f.dtype for f in layout.FP8_FORMATS)
SLOT_DTYPES = (torch.int64, torch.int32)


def _check_tokens(key, value, slot_mapping, k_scale, v_scale, device) -> None:
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=SLOT_DTYPES, device=device)
    check_tensor("key", key, ndim=3, dtypes=INPUT_DTYPES, device=device)
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=device)
    num_tokens = slot_mapping.shape[0]
    for name, t in (("key", key), ("value", value)):
        if t.shape[0] < num_tokens:
            raise ValueError(f"{name} has {t.shape[0]} tokens, fewer than slot_mapping's {num_tokens}")
        check_int32_extent(name, t)
    if value.shape[1] != key.shape[1]:
        raise ValueError(f"value has {value.shape[1]} heads, key has {key.shape[1]}")
    check_scale("k_scale", k_scale, device)
    check_scale("v_scale", v_scale, device)


def _check_block_size(name: str, block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"{name} has block size {block_size}; it must be at least 1")


def check_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
                e4m3=layout.E4M3FN):
    """Validate reshape_and_cache_flash's arguments; return (fp8 format or None, block size, slots)."""
    check_tensor("key_cache", key_cache, ndim=(4, 5), device=key_cache.device)
    device = key_cache.device
    _check_tokens(key, value, slot_mapping, k_scale, v_scale, device)
    check_tensor("value_cache", value_cache, ndim=4, dtypes=(key_cache.dtype,), device=device)
    heads, dim = key.shape[1], key.shape[2]
    if value.shape[2] != dim:
        raise ValueError(f"value head size {value.shape[2]} differs from key head size {dim}")
    nb = key_cache.shape[0]
    if key_cache.dim() == 4:
        bs = key_cache.shape[1]
        check_shape("key_cache", key_cache, (nb, bs, heads, dim), "[num_blocks, block_size, num_heads, head_size]")
        check_shape("value_cache", value_cache, (nb, bs, heads, dim),
                    "[num_blocks, block_size, num_heads, head_size]")
    else:
        bs, x = key_cache.shape[3], key_cache.shape[4]
        if x < 1 or dim % x:
            raise ValueError(f"key_cache.shape[4] (x = {x}) must divide the head size {dim}")
        check_shape("key_cache", key_cache, (nb, heads, dim // x, bs, x), "[num_blocks, num_heads, head_size/x, "
                    "block_size, x]")
        check_shape("value_cache", value_cache, (nb, heads, dim, bs), "[num_blocks, num_heads, head_size, block_size]")
    _check_block_size("key_cache", bs)
    fmt = layout.resolve_kv_cache_format(kv_cache_dtype, key_cache.dtype, e4m3)
    check_int32_extent("key_cache", key_cache)
    check_int32_extent("value_cache", value_cache)
    return fmt, bs, nb * bs


def check_flash_diffkv(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, e4m3=layout.E4M3FN):
    """Validate reshape_and_cache_flash_diffkv's arguments; return (fp8 format or None, block size, slots)."""
    check_tensor("kv_cache", kv_cache, ndim=4, device=kv_cache.device)
    _check_tokens(key, value, slot_mapping, k_scale, v_scale, kv_cache.device)
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    check_shape("kv_cache", kv_cache, (nb, bs, key.shape[1], key.shape[2] + value.shape[2]),
                "[num_blocks, block_size, num_heads, head_size_k + head_size_v]")
    _check_block_size("kv_cache", bs)
    fmt = layout.resolve_kv_cache_format(kv_cache_dtype, kv_cache.dtype, e4m3)
    check_int32_extent("kv_cache", kv_cache)
    return fmt, bs, nb * bs


def _plan(*, key, value, kc, vc, slot_mapping, fmt, block_size, num_slots, kgeo, vgeo, vc_start,
          head_major=False):
    """The kernel launch for these arguments' metadata (shapes, strides, dtypes, devices,
    kv_cache_dtype), never their values; None when there is nothing to write (R5). Head-major
    caches at prefill sizes go to `head_major_group_kernel` (consecutive tokens per program),
    everything else to `flash_cache_write_kernel` (one token per program)."""
    tokens, heads, dk, dv = slot_mapping.shape[0], key.shape[1], key.shape[2], value.shape[2]
    if tokens == 0 or heads == 0 or dk + dv == 0:
        return None
    device = kc.device
    target = platform.target_for(device)
    codec = kernels.make_codec(key.dtype, kc.dtype, fmt, target)
    in_view, cache_view = kernels.kernel_views(key.dtype, kc.dtype, codec)
    dtypes = (in_view or key.dtype, in_view or key.dtype, cache_view or kc.dtype, cache_view or kc.dtype,
              slot_mapping.dtype, torch.float32, torch.float32)
    if head_major and kernels.uses_group_kernel("head_major", tokens):
        meta = kernels.launch_options(kernels.group_constexprs(dk, dv, kgeo, vgeo, block_size, codec, target))
        ints = kernels.group_runtime_args(tokens, num_slots, slot_mapping.stride(0), key.stride(), value.stride(),
                                          kgeo, vgeo)
        return kernels.GROUP_LAUNCHER.bind(kernels.group_grid(tokens, heads), dtypes, ints, meta, device)
    meta = kernels.launch_options(kernels.constexprs(heads, dk, dv, kgeo, vgeo, block_size, codec, target))
    ints = kernels.runtime_args(num_slots, slot_mapping.stride(0), vc_start, key.stride(), value.stride(), kgeo, vgeo)
    return kernels.LAUNCHER.bind((tokens, -(-heads // meta["BLOCK_H"])), dtypes, ints, meta, device)


# Plans by argument signature. A signature holds every shape, stride, dtype and device the
# validator looks at, so validation and planning run once per signature and a call with a known
# signature only looks its plan up and launches (the eager host-time path).
_FLASH_PLANS = PlanCache()
_DIFFKV_PLANS = PlanCache()


def _flash_kernel(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    sig = (key.shape, key.stride(), value.shape, value.stride(), key_cache.shape, key_cache.stride(),
           value_cache.shape, value_cache.stride(), slot_mapping.shape, slot_mapping.stride(), k_scale.shape,
           v_scale.shape, key.dtype, value.dtype, key_cache.dtype, value_cache.dtype, slot_mapping.dtype,
           k_scale.dtype, v_scale.dtype, key.get_device(), value.get_device(), key_cache.get_device(),
           value_cache.get_device(), slot_mapping.get_device(), k_scale.get_device(), v_scale.get_device(),
           kv_cache_dtype)
    launch = _FLASH_PLANS.get(sig, MISSING)
    if launch is MISSING:
        e4m3 = platform.platform_e4m3(platform.target_for(key_cache.device))
        fmt, bs, num_slots = check_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                         k_scale, v_scale, e4m3)
        head_major = key_cache.dim() == 5
        if head_major:
            kgeo, vgeo = kernels.head_major_k_geometry(key_cache), kernels.head_major_v_geometry(value_cache)
        else:
            kgeo, vgeo = kernels.nhd_geometry(key_cache), kernels.nhd_geometry(value_cache)
        launch = _FLASH_PLANS.remember(sig, _plan(
            key=key, value=value, kc=key_cache, vc=value_cache, slot_mapping=slot_mapping, fmt=fmt, block_size=bs,
            num_slots=num_slots, kgeo=kgeo, vgeo=vgeo, vc_start=0, head_major=head_major))
    if launch is not None:
        launch(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def _flash_reference(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    check_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    reference.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                      k_scale, v_scale)


def _flash_fake(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    check_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def _diffkv_kernel(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    sig = (key.shape, key.stride(), value.shape, value.stride(), kv_cache.shape, kv_cache.stride(),
           slot_mapping.shape, slot_mapping.stride(), k_scale.shape, v_scale.shape, key.dtype, value.dtype,
           kv_cache.dtype, slot_mapping.dtype, k_scale.dtype, v_scale.dtype, key.get_device(), value.get_device(),
           kv_cache.get_device(), slot_mapping.get_device(), k_scale.get_device(), v_scale.get_device(),
           kv_cache_dtype)
    launch = _DIFFKV_PLANS.get(sig, MISSING)
    if launch is MISSING:
        e4m3 = platform.platform_e4m3(platform.target_for(kv_cache.device))
        fmt, bs, num_slots = check_flash_diffkv(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale,
                                                v_scale, e4m3)
        geo = kernels.nhd_geometry(kv_cache)
        launch = _DIFFKV_PLANS.remember(sig, _plan(
            key=key, value=value, kc=kv_cache, vc=kv_cache, slot_mapping=slot_mapping, fmt=fmt, block_size=bs,
            num_slots=num_slots, kgeo=geo, vgeo=geo, vc_start=kernels.diffkv_v_start(kv_cache, key.shape[2])))
    if launch is not None:
        launch(key, value, kv_cache, kv_cache, slot_mapping, k_scale, v_scale)


def _diffkv_reference(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    check_flash_diffkv(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    reference.reshape_and_cache_flash_diffkv(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def _diffkv_fake(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    check_flash_diffkv(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def _flash_examples():
    """Realistic inputs: 64 tokens, 8 KV heads of 128, block size 16, random slots with padding."""
    g = torch.Generator().manual_seed(0)
    tokens, heads, dim, bs, nb = 64, 8, 128, 16, 32
    key = torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16)
    value = torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16)
    slots = torch.randperm(nb * bs, generator=g)[:tokens]
    slots[::13] = -1
    scale = (key.float().abs().amax() / 64).reshape(1)
    nhd = (nb, bs, heads, dim)
    x = layout.head_major_x(torch.bfloat16)
    return {
        "bf16 auto NHD": (key, value, torch.zeros(nhd, dtype=torch.bfloat16), torch.zeros(nhd, dtype=torch.bfloat16),
                          slots, "auto", torch.ones(1), torch.ones(1)),
        "bf16->fp8 NHD": (key, value, torch.zeros(nhd, dtype=torch.uint8), torch.zeros(nhd, dtype=torch.uint8),
                          slots, "fp8", scale, scale),
        "bf16->e5m2 head-major": (key, value, torch.zeros(nb, heads, dim // x, bs, x, dtype=torch.uint8),
                                  torch.zeros(nb, heads, dim, bs, dtype=torch.uint8), slots, "fp8_e5m2", scale, scale),
    }


def _diffkv_examples():
    g = torch.Generator().manual_seed(1)
    tokens, heads, dk, dv, bs, nb = 64, 8, 192, 128, 16, 32
    key = torch.randn(tokens, heads, dk, generator=g).to(torch.bfloat16)
    value = torch.randn(tokens, heads, dv, generator=g).to(torch.bfloat16)
    slots = torch.randperm(nb * bs, generator=g)[:tokens]
    return {"bf16 auto": (key, value, torch.zeros(nb, bs, heads, dk + dv, dtype=torch.bfloat16), slots, "auto",
                          torch.ones(1), torch.ones(1))}


def check_flash_kv(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, kv_dim,
                   e4m3=layout.E4M3FN):
    """Validate reshape_and_cache_flash_kv's arguments; return (K cache view, V cache view, the
    results of check_flash)."""
    check_tensor("kv_cache", kv_cache, ndim=5, device=kv_cache.device)
    if kv_dim not in (0, 1):
        raise ValueError(f"kv_dim must be 0 or 1, got {kv_dim}")
    if kv_cache.shape[kv_dim] != 2:
        raise ValueError(f"kv_cache.shape[{kv_dim}] (kv_dim) must be 2 (K, V), got shape {tuple(kv_cache.shape)}")
    kc, vc = kv_cache.select(kv_dim, 0), kv_cache.select(kv_dim, 1)
    try:
        return kc, vc, check_flash(key, value, kc, vc, slot_mapping, kv_cache_dtype, k_scale, v_scale, e4m3)
    except ValueError as e:
        raise ValueError(str(e).replace("key_cache", f"kv_cache.select({kv_dim}, 0)")
                         .replace("value_cache", f"kv_cache.select({kv_dim}, 1)")) from None


def _kv_kernel(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, kv_dim=0):
    if kv_dim not in (0, 1) or kv_cache.dim() != 5 or kv_cache.shape[kv_dim] != 2:
        check_flash_kv(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, kv_dim)
    try:
        _flash_kernel(key, value, kv_cache.select(kv_dim, 0), kv_cache.select(kv_dim, 1), slot_mapping,
                      kv_cache_dtype, k_scale, v_scale)
    except ValueError:   # the same error, naming kv_cache's halves
        check_flash_kv(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, kv_dim)
        raise


def _kv_reference(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, kv_dim=0):
    kc, vc, _ = check_flash_kv(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, kv_dim)
    reference.reshape_and_cache_flash(key, value, kc, vc, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def _kv_fake(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, kv_dim=0):
    check_flash_kv(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, kv_dim)


def _kv_examples():
    """vLLM's flash layout [2, num_blocks, bs, H, D] and FlashInfer's [num_blocks, 2, bs, H, D]."""
    key, value, _, _, slots, _, _, _ = _flash_examples()["bf16 auto NHD"]
    nb, bs = 32, 16
    scale = (key.float().abs().amax() / 64).reshape(1)
    return {
        "bf16 auto [2, nb, bs, H, D]": (key, value, torch.zeros(2, nb, bs, *key.shape[1:], dtype=torch.bfloat16),
                                        slots, "auto", torch.ones(1), torch.ones(1), 0),
        "bf16->fp8 [nb, 2, bs, H, D]": (key, value, torch.zeros(nb, 2, bs, *key.shape[1:], dtype=torch.uint8),
                                        slots, "fp8", scale, scale, 1),
    }


_flash_op = register_op(
    "reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()",
    reference=_flash_reference, kernel=_flash_kernel, fake=_flash_fake, examples=_flash_examples)

_diffkv_op = register_op(
    "reshape_and_cache_flash_diffkv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()",
    reference=_diffkv_reference, kernel=_diffkv_kernel, fake=_diffkv_fake, examples=_diffkv_examples)

_kv_op = register_op(
    "reshape_and_cache_flash_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "str kv_cache_dtype, Tensor k_scale, Tensor v_scale, int kv_dim=0) -> ()",
    reference=_kv_reference, kernel=_kv_kernel, fake=_kv_fake, examples=_kv_examples)


def _scale(name: str, scale, like: torch.Tensor) -> torch.Tensor:
    """A scale given as a Python number (checked: finite and > 0) as a 1-element fp32 tensor on
    `like`'s device; a tensor is passed through unchecked (its value is on the device, R3)."""
    if isinstance(scale, torch.Tensor):
        return scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"{name} must be a 1-element float32 tensor or a Python float, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} must be finite and > 0, got {scale}")
    return torch.full((1,), float(scale), dtype=torch.float32, device=like.device)


def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
                            k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> None:
    """Write the first T = len(slot_mapping) tokens of `key`/`value` into a paged KV cache.

    key, value: [T_k >= T, H, D], fp16/bf16/fp32 (or fp8, stored without scaling), any strides.
    key_cache, value_cache: NHD [num_blocks, bs, H, D], or head-major K [num_blocks, H, D//x, bs, x]
    with V [num_blocks, H, D, bs]; any strides; dtype per `kv_cache_dtype` ("auto"/float names: the
    cache's own float dtype; "fp8"/"fp8_e4m3": uint8 = platform e4m3, or typed e4m3; "fp8_e5m2").
    slot_mapping: [T] int64/int32; token t goes to slot s = block*bs + offset; s < 0 or
    s >= num_blocks*bs skips the token. k_scale, v_scale: 1-element fp32 tensors, or Python floats
    (which must be finite and > 0); fp8 caches store saturate(x / scale) with RNE. A scale tensor
    is never read on the host: 0, negative, inf or NaN scales give IEEE x / scale, saturated
    (docs/ops/cache.md). Mutates key_cache and value_cache; returns None.

    Under torch.compile(dynamic=True), caches that are views of one buffer created inside the
    compiled function (kv_cache[0], kv_cache[1]) are mis-written by inductor (pytorch#198068):
    pass the buffer to `reshape_and_cache_flash_kv` instead.
    """
    if not isinstance(k_scale, torch.Tensor) or not isinstance(v_scale, torch.Tensor):
        k_scale, v_scale = _scale("k_scale", k_scale, key_cache), _scale("v_scale", v_scale, key_cache)
    _flash_op(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def reshape_and_cache_flash_diffkv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                                   slot_mapping: torch.Tensor, kv_cache_dtype: str,
                                   k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> None:
    """Write K [T_k, H, Dk] and V [T_k, H, Dv] into one cache [num_blocks, bs, H, Dk+Dv].

    K lands in kv_cache[..., :Dk] and V in kv_cache[..., Dk:]; slot and dtype rules are those of
    `reshape_and_cache_flash`. Mutates kv_cache; returns None.
    """
    _diffkv_op(key, value, kv_cache, slot_mapping, kv_cache_dtype, _scale("k_scale", k_scale, kv_cache),
               _scale("v_scale", v_scale, kv_cache))


def reshape_and_cache_flash_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor | float,
                               v_scale: torch.Tensor | float, kv_dim: int = 0) -> None:
    """`reshape_and_cache_flash` into one buffer holding both NHD caches along `kv_dim`.

    kv_cache: [2, num_blocks, bs, H, D] (kv_dim=0, vLLM's flash layout) or [num_blocks, 2, bs, H, D]
    (kv_dim=1, FlashInfer's); K goes to kv_cache.select(kv_dim, 0), V to .select(kv_dim, 1). The
    same write as passing those two views to `reshape_and_cache_flash`, but with one mutated
    argument, which torch.compile(dynamic=True) handles correctly (see that function's note).
    Mutates kv_cache; returns None.
    """
    _kv_op(key, value, kv_cache, slot_mapping, kv_cache_dtype, _scale("k_scale", k_scale, kv_cache),
           _scale("v_scale", v_scale, kv_cache), kv_dim)


triton_reshape_and_cache_flash = reshape_and_cache_flash
triton_reshape_and_cache_flash_diffkv = reshape_and_cache_flash_diffkv
