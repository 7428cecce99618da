"""DSV4 fp8_ds_mla K cache (SPEC §2.1, §3.2): `dsv4::quantize_and_insert_k_cache` and
`dsv4::dequantize_and_gather_k_cache`.

The Python entry points mirror vLLM's functions of the same names (argument names, order and
defaults); `use_fnuz` is this package's trailing argument (SPEC §4 l).
"""
from __future__ import annotations

import torch

from .. import layout, platform
from ..kernels import k_cache as kernels
from ..library import register_op
from ..reference import k_cache as reference
from ._checks import check_bool, check_tensor
from ._plans import MISSING, PlanCache

SLOT_DTYPES = (torch.int64, torch.int32)
TABLE_DTYPES = (torch.int32, torch.int64)
LEN_DTYPES = (torch.int32,)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_k_cache(k_cache, block_size: int) -> tuple[int, int]:
    """Validate an fp8_ds_mla cache of either tensor form (§2.1) for `block_size`; return
    (num_blocks, block_stride in bytes)."""
    check_tensor("k_cache", k_cache, ndim=(2, 3), dtypes=(torch.uint8,))
    _check_int("block_size", block_size, 1)
    page = layout.ds_mla_block_bytes(block_size)
    nb = k_cache.shape[0]
    if k_cache.dim() == 3:
        if k_cache.shape[1] != block_size or k_cache.shape[2] != layout.TOKEN_BYTES:
            raise ValueError(f"k_cache of shape {tuple(k_cache.shape)} is not [num_blocks, block_size={block_size}, "
                             f"{layout.TOKEN_BYTES}] (or use the 2-D form [num_blocks, >= block_size*"
                             f"{layout.TOKEN_BYTES}])")
        if k_cache.stride(2) != 1 or (block_size > 1 and k_cache.stride(1) != layout.TOKEN_BYTES):
            raise ValueError(f"k_cache [num_blocks, bs, {layout.TOKEN_BYTES}] must have stride(1) = "
                             f"{layout.TOKEN_BYTES} and stride(2) = 1, got strides {k_cache.stride()}")
    else:
        if k_cache.shape[1] < page:
            raise ValueError(f"k_cache pages of {k_cache.shape[1]} bytes are too small for block_size {block_size}: "
                             f"need >= block_size*{layout.TOKEN_BYTES} = {page}")
        if k_cache.shape[1] > 1 and k_cache.stride(1) != 1:
            raise ValueError(f"k_cache [num_blocks, page bytes] must have stride(1) = 1, got {k_cache.stride(1)}")
    block_stride = k_cache.stride(0) if nb > 1 else page
    if block_stride < page:
        raise ValueError(f"k_cache.stride(0) = {block_stride} bytes is smaller than a page of block_size "
                         f"{block_size}: block_size*{layout.TOKEN_BYTES} = {page}")
    return nb, block_stride


def check_insert(k, k_cache, slot_mapping, block_size=64, is_ue8m0=True, use_fnuz=False) -> tuple[int, int]:
    """Validate quantize_and_insert_k_cache's arguments; return (num_slots, block_stride)."""
    nb, block_stride = check_k_cache(k_cache, block_size)
    device = k_cache.device
    check_bool("is_ue8m0", is_ue8m0)
    if not is_ue8m0:
        raise ValueError("is_ue8m0=False is not supported: the fp8_ds_mla cache stores UE8M0 scales")
    check_bool("use_fnuz", use_fnuz)
    check_tensor("k", k, ndim=2, dtypes=(torch.bfloat16,), device=device)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=SLOT_DTYPES, device=device)
    if k.shape[1] != layout.HEAD_DIM:
        raise ValueError(f"k must be [N_k, {layout.HEAD_DIM}], got shape {tuple(k.shape)}")
    if k.stride(1) != 1:
        raise ValueError(f"k must have inner stride 1, got strides {k.stride()}")
    if k.shape[0] < slot_mapping.shape[0]:
        raise ValueError(f"k has {k.shape[0]} rows, fewer than slot_mapping's {slot_mapping.shape[0]} tokens")
    return nb * block_size, block_stride


def check_gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz=False):
    """Validate dequantize_and_gather_k_cache's arguments; return (num_blocks, block_stride)."""
    nb, block_stride = check_k_cache(k_cache, block_size)
    device = k_cache.device
    _check_int("offset", offset, 0)
    check_bool("use_fnuz", use_fnuz)
    check_tensor("out", out, ndim=3, dtypes=(torch.bfloat16,), device=device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=LEN_DTYPES, device=device)
    r = seq_lens.shape[0]
    if gather_lens is not None:
        check_tensor("gather_lens", gather_lens, ndim=1, dtypes=LEN_DTYPES, device=device)
        if gather_lens.shape[0] != r:
            raise ValueError(f"gather_lens has {gather_lens.shape[0]} entries, seq_lens has {r}")
    check_tensor("block_table", block_table, ndim=2, dtypes=TABLE_DTYPES, device=device)
    if block_table.shape[0] < r:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, fewer than the {r} requests of seq_lens")
    if out.shape[0] < r or out.shape[2] != layout.HEAD_DIM:
        raise ValueError(f"out must be [>= R={r}, W, {layout.HEAD_DIM}], got shape {tuple(out.shape)}")
    if out.stride(2) != 1:
        raise ValueError(f"out must have stride(2) = 1, got strides {out.stride()}")
    return nb, block_stride


# --- kernels: plans keyed by argument signature (see ops/cache.py) -------------------------------
_INSERT_PLANS = PlanCache()
_GATHER_PLANS = PlanCache()


def _insert_plan(k, k_cache, slot_mapping, block_size, is_ue8m0, use_fnuz):
    num_slots, block_stride = check_insert(k, k_cache, slot_mapping, block_size, is_ue8m0, use_fnuz)
    tokens = slot_mapping.shape[0]
    if tokens == 0:
        return None
    target = platform.target_for(k_cache.device)
    per_program = kernels.insert_tokens(tokens)
    meta = kernels.launch_options(kernels.insert_constexprs(block_size, use_fnuz, target, per_program))
    ints = kernels.insert_runtime_args(tokens, k.stride(0), slot_mapping.stride(0), num_slots, block_stride)
    return kernels.INSERT_LAUNCHER.bind((layout.cdiv(tokens, per_program),), (torch.bfloat16, torch.uint8,
                                        slot_mapping.dtype), ints, meta, k_cache.device)


def _insert_kernel(k, k_cache, slot_mapping, block_size=64, is_ue8m0=True, use_fnuz=False):
    sig = (k.shape, k.stride(), k_cache.shape, k_cache.stride(), slot_mapping.shape, slot_mapping.stride(), k.dtype,
           k_cache.dtype, slot_mapping.dtype, k.get_device(), k_cache.get_device(), slot_mapping.get_device(),
           block_size, is_ue8m0, use_fnuz)
    launch = _INSERT_PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _INSERT_PLANS.remember(sig, _insert_plan(k, k_cache, slot_mapping, block_size, is_ue8m0,
                                                            use_fnuz))
    if launch is not None:
        launch(k, k_cache, slot_mapping)


def _insert_reference(k, k_cache, slot_mapping, block_size=64, is_ue8m0=True, use_fnuz=False):
    check_insert(k, k_cache, slot_mapping, block_size, is_ue8m0, use_fnuz)
    reference.quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size, is_ue8m0, use_fnuz)


def _insert_fake(k, k_cache, slot_mapping, block_size=64, is_ue8m0=True, use_fnuz=False):
    check_insert(k, k_cache, slot_mapping, block_size, is_ue8m0, use_fnuz)


def _gather_plan(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz):
    nb, block_stride = check_gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz)
    requests, width = seq_lens.shape[0], out.shape[1]
    if requests == 0 or offset >= width:
        return None
    target = platform.target_for(k_cache.device)
    has_gather = gather_lens is not None
    meta = kernels.launch_options(kernels.gather_constexprs(block_size, use_fnuz, has_gather, target, width))
    ints = kernels.gather_runtime_args(seq_lens.stride(0), gather_lens.stride(0) if has_gather else 0,
                                       out.stride(), block_table.stride(), block_table.shape[1], nb, block_stride,
                                       width, offset)
    dtypes = (torch.bfloat16, torch.uint8, seq_lens.dtype, seq_lens.dtype, block_table.dtype)
    grid = (requests, kernels.gather_workers(width, target))
    return kernels.GATHER_LAUNCHER.bind(grid, dtypes, ints, meta, k_cache.device)


def _gather_kernel(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz=False):
    has_gather = gather_lens is not None
    sig = (out.shape, out.stride(), k_cache.shape, k_cache.stride(), seq_lens.shape, seq_lens.stride(),
           block_table.shape, block_table.stride(), out.dtype, k_cache.dtype, seq_lens.dtype, block_table.dtype,
           out.get_device(), k_cache.get_device(), seq_lens.get_device(), block_table.get_device(),
           (gather_lens.shape, gather_lens.stride(), gather_lens.dtype, gather_lens.get_device())
           if has_gather else None, block_size, offset, use_fnuz)
    launch = _GATHER_PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _GATHER_PLANS.remember(sig, _gather_plan(out, k_cache, seq_lens, gather_lens, block_table,
                                                            block_size, offset, use_fnuz))
    if launch is not None:
        launch(out, k_cache, seq_lens, gather_lens if has_gather else seq_lens, block_table)


def _gather_reference(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz=False):
    check_gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz)
    reference.dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
                                            use_fnuz)


def _gather_fake(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz=False):
    check_gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz)


# --- self-check examples ---------------------------------------------------------------------------
def _example_cache(num_blocks: int, block_size: int) -> torch.Tensor:
    """A padded-stride cache (the serving engine's round_up(bs*584, 576)) of random bytes."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (num_blocks, layout.ds_mla_block_stride(block_size)), dtype=torch.uint8,
                         generator=g)


def _insert_examples():
    """16 tokens of bf16 K (2 of them skipped), SWA/C4A (bs 64) and C128A (bs 2, FNUZ) caches."""
    g = torch.Generator().manual_seed(3)
    tokens = 16
    k = (torch.randn(tokens + 2, layout.HEAD_DIM, generator=g) * 4).to(torch.bfloat16)   # N_k > N (DP padding)
    slots64 = torch.randperm(3 * 64, generator=g)[:tokens]
    slots64[[3, 11]] = torch.tensor([-1, 3 * 64])
    slots2 = torch.randperm(12 * 2, generator=g)[:tokens]
    return {
        "bs64 OCP padded pages": (k, _example_cache(3, 64), slots64, 64, True, False),
        "bs2 FNUZ [nb, bs, 584] padded": (k, _example_cache(12, 2)[:, :layout.ds_mla_block_bytes(2)]
                                          .view(12, 2, layout.TOKEN_BYTES), slots2, 2, True, True),
    }


def _gather_examples():
    """A bs 16 cache filled by the writer; 3 requests, window gather with an offset, invalid entries."""
    g = torch.Generator().manual_seed(4)
    bs, nb = 16, 6
    cache = _example_cache(nb, bs)
    k = (torch.randn(nb * bs, layout.HEAD_DIM, generator=g) * 2).to(torch.bfloat16)
    reference.quantize_and_insert_k_cache(k, cache, torch.arange(nb * bs), bs)
    table = torch.tensor([[4, 0, 2, -1], [1, 5, -7, 3], [3, 100, 2, 0]], dtype=torch.int32)
    seq = torch.tensor([40, 20, 33], dtype=torch.int32)
    out = torch.zeros(3, 12, layout.HEAD_DIM, dtype=torch.bfloat16)
    return {
        "window gl [5,8,12] offset 2": (out, cache, seq, torch.tensor([5, 8, 12], dtype=torch.int32), table, bs, 2,
                                        False),
        "whole sequences, int64 table": (torch.zeros(3, 48, layout.HEAD_DIM, dtype=torch.bfloat16), cache, seq, None,
                                         table.long(), bs, 0, False),
    }


_insert_op = register_op(
    "quantize_and_insert_k_cache(Tensor k, Tensor(a!) k_cache, Tensor slot_mapping, int block_size=64, "
    "bool is_ue8m0=True, bool use_fnuz=False) -> ()",
    reference=_insert_reference, kernel=_insert_kernel, fake=_insert_fake, examples=_insert_examples)

_gather_op = register_op(
    "dequantize_and_gather_k_cache(Tensor(a!) out, Tensor k_cache, Tensor seq_lens, Tensor? gather_lens, "
    "Tensor block_table, int block_size, int offset, bool use_fnuz=False) -> ()",
    reference=_gather_reference, kernel=_gather_kernel, fake=_gather_fake, examples=_gather_examples)


def quantize_and_insert_k_cache(k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                block_size: int = 64, is_ue8m0: bool = True, use_fnuz: bool = False) -> None:
    """Quantise bf16 K rows into a paged fp8_ds_mla cache (SPEC §2.1, §3.2).

    k: [N_k, 512] bf16, inner stride 1, any row stride (N_k >= N; rows past N are ignored).
    k_cache: uint8 [num_blocks, block_size, 584] or [num_blocks, >= block_size*584], with any page
    stride(0) >= block_size*584 (the engine pads to round_up(bs*584, 576)).
    slot_mapping: [N] int64 (or int32); token t goes to slot s = block*block_size + offset; s < 0 or
    s >= num_blocks*block_size skips the token. Each token stores 448 fp8 e4m3 NoPE bytes
    (per 64 dims scaled by 2**-e, e = ceil(log2(max(amax, 1e-4) / FP8_MAX)) exactly), 64 bf16 RoPE
    values bit for bit, 7 UE8M0 bytes e + 127 and a zero byte. use_fnuz=False: OCP e4m3fn,
    FP8_MAX 448; use_fnuz=True: e4m3fnuz, FP8_MAX 224 (any device). is_ue8m0 must be True.
    Bytes of other tokens and the page padding are never touched. Mutates k_cache; returns None.
    """
    _insert_op(k, k_cache, slot_mapping, block_size, is_ue8m0, use_fnuz)


def dequantize_and_gather_k_cache(out: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor,
                                  gather_lens: torch.Tensor | None, block_table: torch.Tensor, block_size: int,
                                  offset: int, use_fnuz: bool = False) -> None:
    """Gather the last gather_lens[r] tokens of each request from an fp8_ds_mla cache into bf16 rows.

    out: [>= R, W, 512] bf16, stride(2) = 1. k_cache: either form of `quantize_and_insert_k_cache`.
    seq_lens, gather_lens: [R] int32 (gather_lens None gathers whole sequences). block_table:
    [>= R, width] int32 or int64, any strides. Rows offset .. offset+gl-1 of out[r] receive
    positions seq_lens[r]-gl .. seq_lens[r]-1 (gl = max(gather_lens[r], 0)), dequantised exactly
    (bf16(fp8 * 2**(byte-127)); RoPE dims bit for bit). Positions with no valid block (negative,
    past the table, entries < 0 or >= num_blocks) give zero rows; rows at or past W are skipped;
    all other rows of out are untouched. Mutates out; returns None.
    """
    _gather_op(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, use_fnuz)
