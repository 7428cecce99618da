"""The indexer K cache of C4A layers (SPEC §2.2, §3.9): `dsv4::indexer_k_quant_and_cache` and
`dsv4::cp_gather_indexer_k_quant_cache`.

The Python entry points mirror vLLM's functions of the same names (argument names, order and defaults);
`use_fnuz` is this package's trailing keyword (SPEC §4 l).
"""
from __future__ import annotations

import torch

from .. import layout, platform
from ..kernels import indexer as kernels
from ..kernels.attention import device_multiprocessors
from ..library import register_op
from ..reference import indexer as reference
from ._checks import check_bool, check_tensor
from ._plans import MISSING, PlanCache, signature

SLOT_DTYPES = (torch.int64, torch.int32)
TABLE_DTYPES = (torch.int32, torch.int64)
SCALE_ALIGN = layout.INDEXER_SCALE_BYTES        # fp32 scales are stored as 4-byte words


def check_indexer_cache(name: str, cache, device=None) -> tuple[int, int, int]:
    """An indexer cache uint8 [nb, bs, 132] or [nb, bs, 1, 132] with any page stride >= bs*132 (a multiple of
    4); return (num_blocks, bs, page stride in bytes)."""
    check_tensor(name, cache, ndim=(3, 4), dtypes=(torch.uint8,), device=device)
    nb, bs = cache.shape[0], cache.shape[1]
    if cache.shape[-1] != layout.INDEXER_TOKEN_BYTES or bs < 1 or (cache.dim() == 4 and cache.shape[2] != 1):
        raise ValueError(f"{name} must be [num_blocks, block_size, {layout.INDEXER_TOKEN_BYTES}] (or "
                         f"[num_blocks, block_size, 1, {layout.INDEXER_TOKEN_BYTES}]), got shape {tuple(cache.shape)}")
    if cache.stride(-1) != 1 or (bs > 1 and cache.stride(1) != layout.INDEXER_TOKEN_BYTES):
        raise ValueError(f"{name} must have stride(1) = {layout.INDEXER_TOKEN_BYTES} and a last stride of 1, got "
                         f"strides {cache.stride()}")
    page = layout.indexer_block_bytes(bs)
    stride = cache.stride(0) if nb > 1 else page
    if stride < page or stride % SCALE_ALIGN:
        raise ValueError(f"{name}.stride(0) = {stride} bytes must be >= block_size*{layout.INDEXER_TOKEN_BYTES} = "
                         f"{page} and a multiple of {SCALE_ALIGN}")
    return nb, bs, stride


def check_cache_pointer(name: str, cache) -> None:
    """Real tensors only (fakes have no data): the fp32 scales need a 4-byte aligned page base."""
    if cache.data_ptr() % SCALE_ALIGN:
        raise ValueError(f"{name}: the data pointer must be a multiple of {SCALE_ALIGN} bytes")


def check_insert(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, use_fnuz) -> tuple[int, int, int]:
    """Validate indexer_k_quant_and_cache's arguments; return (num_blocks, bs, page stride)."""
    geometry = check_indexer_cache("kv_cache", kv_cache)
    device = kv_cache.device
    check_tensor("k", k, ndim=2, dtypes=(torch.bfloat16,), device=device)
    if k.shape[1] != layout.INDEXER_DIM or k.stride(1) != 1:
        raise ValueError(f"k must be [N_k, {layout.INDEXER_DIM}] with a contiguous last dim, got shape "
                         f"{tuple(k.shape)} and strides {k.stride()}")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=SLOT_DTYPES, device=device)
    if k.shape[0] < slot_mapping.shape[0]:
        raise ValueError(f"k has {k.shape[0]} rows, fewer than slot_mapping's {slot_mapping.shape[0]} tokens")
    if isinstance(quant_block_size, bool) or quant_block_size != layout.INDEXER_QUANT_BLOCK:
        raise ValueError(f"quant_block_size must be {layout.INDEXER_QUANT_BLOCK} (one scale per K row), got "
                         f"{quant_block_size!r}")
    if scale_fmt != layout.INDEXER_SCALE_FMT:
        raise ValueError(f"scale_fmt must be {layout.INDEXER_SCALE_FMT!r}, got {scale_fmt!r}")
    check_bool("use_fnuz", use_fnuz)
    return geometry


def _scale_layout(dst_scale) -> tuple[int, int]:
    """(bytes between rows, bytes between a scale's 4 bytes) of dst_scale [Nk, 4] uint8 or [Nk] fp32."""
    if dst_scale.dtype == torch.float32:
        return 4 * dst_scale.stride(0), 1
    return dst_scale.stride(0), dst_scale.stride(1)


def check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> tuple[int, int, int]:
    """Validate cp_gather_indexer_k_quant_cache's arguments; return (num_blocks, bs, page stride)."""
    geometry = check_indexer_cache("kv_cache", kv_cache)
    device = kv_cache.device
    check_tensor("dst_k", dst_k, ndim=2, dtypes=(torch.uint8, torch.float8_e4m3fn, torch.float8_e4m3fnuz),
                 device=device)
    if dst_k.shape[1] != layout.INDEXER_DIM or dst_k.stride(1) != 1:
        raise ValueError(f"dst_k must be [Nk, {layout.INDEXER_DIM}] with a contiguous last dim, got shape "
                         f"{tuple(dst_k.shape)} and strides {dst_k.stride()}")
    rows = dst_k.shape[0]
    check_tensor("dst_scale", dst_scale, ndim=(1, 2), dtypes=(torch.uint8, torch.float32), device=device)
    if dst_scale.dtype == torch.float32:
        if dst_scale.dim() != 1 or dst_scale.shape[0] != rows or dst_scale.stride(0) != 1:
            raise ValueError(f"dst_scale of float32 must be a contiguous [Nk = {rows}], got shape "
                             f"{tuple(dst_scale.shape)} and strides {dst_scale.stride()}")
    elif dst_scale.dim() != 2 or tuple(dst_scale.shape) != (rows, layout.INDEXER_SCALE_BYTES) \
            or dst_scale.stride(1) != 1:
        raise ValueError(f"dst_scale of uint8 must be [Nk = {rows}, {layout.INDEXER_SCALE_BYTES}] with stride(1) = 1, "
                         f"got shape {tuple(dst_scale.shape)} and strides {dst_scale.stride()}")
    check_tensor("block_table", block_table, ndim=2, dtypes=TABLE_DTYPES, device=device)
    check_tensor("cu_seq_lens", cu_seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    if cu_seq_lens.shape[0] < 1:
        raise ValueError("cu_seq_lens must have B + 1 >= 1 entries, got none")
    return geometry


# --- kernels: plans keyed by argument signature --------------------------------------------------------------
_INSERT_PLANS = PlanCache()
_GATHER_PLANS = PlanCache()


def _insert_plan(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, use_fnuz):
    nb, bs, stride = check_insert(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, use_fnuz)
    check_cache_pointer("kv_cache", kv_cache)
    tokens = slot_mapping.shape[0]
    if tokens == 0:
        return None
    target = platform.target_for(kv_cache.device)
    programs, loop = kernels.insert_grid(tokens, device_multiprocessors(kv_cache.device), target)
    meta = kernels.launch_options(kernels.insert_constexprs(bs, use_fnuz, target, loop))
    ints = kernels.insert_runtime_args(tokens, k.stride(0), slot_mapping.stride(0), nb * bs, stride)
    return kernels.INSERT_LAUNCHER.bind((programs,), (torch.bfloat16, torch.uint8, slot_mapping.dtype), ints, meta,
                                        kv_cache.device)


def _insert_kernel(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, use_fnuz=False):
    args = (k, kv_cache, slot_mapping, quant_block_size, scale_fmt, use_fnuz)
    sig = signature("insert", args) + (kv_cache.data_ptr() % SCALE_ALIGN,)
    launch = _INSERT_PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _INSERT_PLANS.remember(sig, _insert_plan(*args))
    if launch is not None:
        launch(k, kv_cache, slot_mapping)


def _insert_reference(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, use_fnuz=False):
    check_insert(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, use_fnuz)
    check_cache_pointer("kv_cache", kv_cache)
    reference.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, use_fnuz)


def _insert_fake(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, use_fnuz=False):
    check_insert(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, use_fnuz)


def _gather_plan(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    nb, bs, stride = check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)
    requests, rows = cu_seq_lens.shape[0] - 1, dst_k.shape[0]
    if requests == 0 or rows == 0:
        return None
    target = platform.target_for(kv_cache.device)
    meta = kernels.launch_options(kernels.gather_constexprs(bs, target))
    ds_row, ds_byte = _scale_layout(dst_scale)
    ints = kernels.gather_runtime_args(rows, dst_k.stride(0), ds_row, ds_byte, block_table.stride(),
                                       block_table.shape[1], block_table.shape[0], nb, stride, cu_seq_lens.stride(0))
    dtypes = (torch.uint8, torch.uint8, torch.uint8, block_table.dtype, torch.int32)
    return kernels.GATHER_LAUNCHER.bind((requests, kernels.gather_workers(rows)), dtypes, ints, meta,
                                        kv_cache.device)


def _gather_kernel(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    args = (kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)
    sig = signature("gather", args)
    launch = _GATHER_PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _GATHER_PLANS.remember(sig, _gather_plan(*args))
    if launch is not None:
        launch(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)


def _gather_reference(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)
    reference.cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)


def _gather_fake(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)


# --- self-check examples ---------------------------------------------------------------------------------------
def example_cache(num_blocks: int, block_size: int, *, padded: bool = True, seed: int = 0, device="cpu"):
    """An indexer cache [nb, bs, 132] view (pages padded to a multiple of 576 bytes when `padded`) of random bytes."""
    g = torch.Generator(device=device).manual_seed(seed)
    page = layout.indexer_block_bytes(block_size)
    stride = layout.round_up(page, layout.PAGE_ALIGN) if padded else page
    raw = torch.randint(0, 256, (num_blocks, stride), dtype=torch.uint8, generator=g, device=device)
    return raw[:, :page].view(num_blocks, block_size, layout.INDEXER_TOKEN_BYTES)


def _insert_examples():
    """20 K rows of several magnitudes (2 slots skipped) into a padded bs 64 cache (OCP) and a bs 16 one (FNUZ)."""
    g = torch.Generator().manual_seed(5)
    n = 20
    k = (torch.randn(n + 3, layout.INDEXER_DIM, generator=g)
         * torch.exp2(torch.randint(-12, 12, (n + 3, 1), generator=g).float())).to(torch.bfloat16)
    slots = torch.randperm(3 * 64, generator=g)[:n]
    slots[[4, 9]] = torch.tensor([-1, 3 * 64])
    return {"bs64 OCP padded pages": (k, example_cache(3, 64), slots, layout.INDEXER_QUANT_BLOCK,
                                      layout.INDEXER_SCALE_FMT, False),
            "bs16 FNUZ, int32 slots (most past the cache)": (k, example_cache(4, 16, padded=False), slots.int(),
                                       layout.INDEXER_QUANT_BLOCK, layout.INDEXER_SCALE_FMT, True)}


def _gather_examples():
    """3 requests (9, 0 and 70 entries) from a written bs 16 cache, -1 and out-of-range table entries, a short
    destination (rows past it skipped); fp32 and uint8 scale buffers."""
    g = torch.Generator().manual_seed(6)
    cache = example_cache(8, 16, seed=1)
    k = torch.randn(8 * 16, layout.INDEXER_DIM, generator=g).to(torch.bfloat16)
    reference.indexer_k_quant_and_cache(k, cache, torch.arange(8 * 16), layout.INDEXER_QUANT_BLOCK,
                                        layout.INDEXER_SCALE_FMT)
    table = torch.tensor([[3, 0, -1, 2, 7], [1, 1, 1, 1, 1], [5, 9, 4, -3, 6]], dtype=torch.int32)
    cu = torch.tensor([0, 9, 9, 79], dtype=torch.int32)
    rows = 75
    return {"fp32 scales": (cache, torch.zeros(rows, layout.INDEXER_DIM, dtype=torch.uint8), torch.zeros(rows),
                            table, cu),
            "uint8 scales, int64 table": (cache, torch.zeros(rows, layout.INDEXER_DIM, dtype=torch.uint8),
                                          torch.zeros(rows, layout.INDEXER_SCALE_BYTES, dtype=torch.uint8),
                                          table.long(), cu)}


_insert_op = register_op(
    "indexer_k_quant_and_cache(Tensor k, Tensor(a!) kv_cache, Tensor slot_mapping, int quant_block_size, "
    "str scale_fmt, bool use_fnuz=False) -> ()",
    reference=_insert_reference, kernel=_insert_kernel, fake=_insert_fake, examples=_insert_examples)
_gather_op = register_op(
    "cp_gather_indexer_k_quant_cache(Tensor kv_cache, Tensor(a!) dst_k, Tensor(b!) dst_scale, Tensor block_table, "
    "Tensor cu_seq_lens) -> ()",
    reference=_gather_reference, kernel=_gather_kernel, fake=_gather_fake, examples=_gather_examples)


def indexer_k_quant_and_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              quant_block_size: int, scale_fmt: str, *, use_fnuz: bool = False) -> None:
    """Quantise the indexer's compressed K rows into its paged fp8 cache (SPEC §2.2, §3.9).

    k: [N_k, 128] bf16 (last dim contiguous; rows past N are ignored). kv_cache: uint8 [num_blocks, bs, 132]
    (or [num_blocks, bs, 1, 132]), any page stride(0) >= bs*132 that is a multiple of 4. slot_mapping: [N] int64
    (or int32); slot s = block*bs + offset, s < 0 or s >= num_blocks*bs skips the token. Per token: e = the exact
    UE8M0 exponent of max(max|x|, 1e-4) for FP8_MAX 448 (224 with use_fnuz), 128 fp8 e4m3 codes of x * 2**-e
    (e4m3fnuz with use_fnuz) at page + off*128, and the fp32 value 2**e at page + bs*128 + 4*off.
    quant_block_size must be 128 and scale_fmt "ue8m0". Mutates kv_cache; returns None.
    """
    _insert_op(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, use_fnuz)


def cp_gather_indexer_k_quant_cache(kv_cache: torch.Tensor, dst_k: torch.Tensor, dst_scale: torch.Tensor,
                                    block_table: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
    """Copy each request's cached indexer K entries into contiguous rows (SPEC §3.9).

    kv_cache: as `indexer_k_quant_and_cache`. dst_k: [Nk, 128] uint8 or fp8 (last dim contiguous). dst_scale:
    [Nk, 4] uint8 (the fp32 bytes) or a contiguous [Nk] fp32. block_table: [>= B, W] int32/int64 block ids.
    cu_seq_lens: [B + 1] int32. Row cu[b] + c (c < cu[b+1] - cu[b]) receives entry c of request b (its codes and
    scale, bit for bit), or zeros when its block is invalid (entry < 0 or >= num_blocks, past the table);
    rows outside [0, Nk) are skipped and other rows are untouched. Mutates dst_k and dst_scale; returns None.
    """
    _gather_op(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)
