"""Every layout number of the DSV4 caches, in one place (SPEC §1, §2).

Kernels, fakes, references, tests and docs import these names; nothing else spells
448, 576 or 584. Pure Python and torch dtypes only: no device work here.
"""
from __future__ import annotations

import dataclasses

import torch

# --- DSV4 model dimensions (SPEC §1) ---------------------------------------------------------
HEAD_DIM = 512                   # MLA/SWA row; K == V
NOPE_DIM = 448                   # fp8-quantised dims [0, 448)
ROPE_DIM = HEAD_DIM - NOPE_DIM   # 64 bf16 dims [448, 512), stored as exact bits
SLIDING_WINDOW = 128
SWA_BLOCK_SIZE = 64
COMPRESSED_KERNEL_BLOCK = 256    # uncompressed tokens per compressed-cache kernel block
INDEX_TOPK = 512

# --- fp8_ds_mla K cache (SPEC §2.1) ------------------------------------------------------------
QUANT_BLOCK = 64                               # dims per UE8M0 scale
NUM_QUANT_BLOCKS = NOPE_DIM // QUANT_BLOCK     # 7 scale bytes per token
SCALE_BYTES = NUM_QUANT_BLOCKS + 1             # 7 exponent bytes + 1 zero byte
TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM     # 448 fp8 + 64 bf16 = 576
TOKEN_BYTES = TOKEN_DATA_BYTES + SCALE_BYTES   # 584 logical bytes per token
PAGE_ALIGN = TOKEN_DATA_BYTES                  # the engine pads pages to a multiple of 576
UE8M0_BIAS = 127
UE8M0_FLOOR = 1e-4                             # amax floor before the exponent (fp32)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ds_mla_block_bytes(block_size: int) -> int:
    """Logical bytes of one fp8_ds_mla page of `block_size` tokens (unpadded stride)."""
    return block_size * TOKEN_BYTES


def ds_mla_block_stride(block_size: int) -> int:
    """The serving engine's padded page stride, round_up(bs*584, 576): 37440 for bs 64, 1728 for bs 2."""
    return round_up(ds_mla_block_bytes(block_size), PAGE_ALIGN)


def ds_mla_data_offset(block_size: int, offset: int) -> int:
    """Byte offset of a token's 576 data bytes inside its page."""
    return offset * TOKEN_DATA_BYTES


def ds_mla_scale_offset(block_size: int, offset: int) -> int:
    """Byte offset of a token's 8 scale bytes inside its page."""
    return block_size * TOKEN_DATA_BYTES + offset * SCALE_BYTES


# --- Sparse MLA attention (SPEC §3.8) ------------------------------------------------------------
MLA_SOFTMAX_SCALE = HEAD_DIM ** -0.5       # default softmax scale of the sparse MLA ops
DS_MLA_CACHE_ALIGN = 8                     # page stride and data pointer: aligned vector loads of scales and RoPE


def ds_mla_block_size_of_pages(page_bytes: int) -> int:
    """bs of a 2-D [num_blocks, page_bytes] fp8_ds_mla cache: page_bytes // 584, exact for unpadded pages
    and for the engine's round_up(bs*584, 576) padding (less than 584 bytes)."""
    return page_bytes // TOKEN_BYTES


# --- Indexer K cache (SPEC §2.2) ---------------------------------------------------------------
INDEXER_DIM = 128
INDEXER_SCALE_BYTES = 4
INDEXER_TOKEN_BYTES = INDEXER_DIM + INDEXER_SCALE_BYTES   # 132
INDEXER_QUANT_BLOCK = INDEXER_DIM                         # one UE8M0 scale per K row
INDEXER_SCALE_FMT = "ue8m0"
INDEXER_HEADS = 64                                        # indexer query heads of the model (SPEC §1)
INDEXER_ROPE_DIM = 64                                     # Q RoPE on dims [64, 128): pairs (64+2i, 64+2i+1)
INDEXER_NOPE_DIM = INDEXER_DIM - INDEXER_ROPE_DIM         # dims [0, 64) pass through
INDEXER_ROPE_PAIRS = INDEXER_ROPE_DIM // 2                # cos_sin_cache rows: [cos_0..cos_31, sin_0..sin_31]


def indexer_block_bytes(block_size: int) -> int:
    """Logical bytes of one indexer-cache page of `block_size` tokens: bs*128 fp8 values, then bs fp32 scales."""
    return block_size * INDEXER_TOKEN_BYTES


def indexer_scale_offset(block_size: int, offset: int) -> int:
    """Byte offset of a token's fp32 scale inside its indexer-cache page."""
    return block_size * INDEXER_DIM + offset * INDEXER_SCALE_BYTES


# --- fp8 formats (SPEC §2.1, §2.3, §4 c) -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """One 8-bit float format: its torch dtype, field widths and saturation bound."""

    code: int            # constexpr passed to kernels (0 is reserved for "not fp8")
    name: str
    dtype: torch.dtype
    exp_bits: int
    man_bits: int
    bias: int
    max: float           # largest finite value; every conversion clamps to +-max first
    ue8m0_max: float     # FP8_MAX inside the UE8M0 recipe (224 for FNUZ, SPEC §2.1)


E4M3FN = Fp8Format(1, "e4m3fn", torch.float8_e4m3fn, 4, 3, 7, 448.0, 448.0)
E4M3FNUZ = Fp8Format(2, "e4m3fnuz", torch.float8_e4m3fnuz, 4, 3, 8, 240.0, 224.0)
E5M2 = Fp8Format(3, "e5m2", torch.float8_e5m2, 5, 2, 15, 57344.0, 57344.0)
FP8_FORMATS = (E4M3FN, E4M3FNUZ, E5M2)
FP8_BY_DTYPE = {f.dtype: f for f in FP8_FORMATS}
FP8_BY_CODE = {f.code: f for f in FP8_FORMATS}
NOT_FP8 = 0

# --- Flash (generic paged) caches (SPEC §2.3) --------------------------------------------------
FLOAT_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# kv_cache_dtype strings whose cache holds its own (16- or 32-bit float) dtype
NON_FP8_KV_CACHE_DTYPES = ("auto", "float16", "half", "bfloat16", "float32", "float")
E4M3_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
E5M2_KV_CACHE_DTYPES = ("fp8_e5m2",)


def head_major_x(dtype: torch.dtype) -> int:
    """The conventional inner width x of a head-major K cache: 16 bytes of elements."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def resolve_kv_cache_format(kv_cache_dtype: str, cache_dtype: torch.dtype,
                            platform_e4m3: Fp8Format = E4M3FN) -> Fp8Format | None:
    """The fp8 format a flash cache stores (SPEC §2.3), or None for a cache of its own float dtype.

    Raises ValueError for an unknown string, a uint8 cache with a non-fp8 string, or a cache dtype
    the string does not allow.
    """
    if kv_cache_dtype in NON_FP8_KV_CACHE_DTYPES:
        if cache_dtype not in FLOAT_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a float16/bfloat16/float32 cache, "
                             f"got a {cache_dtype} cache (use an fp8 kv_cache_dtype for fp8 or uint8 caches)")
        return None
    if kv_cache_dtype in E4M3_KV_CACHE_DTYPES:
        if cache_dtype == torch.uint8:
            return platform_e4m3
        if cache_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            return FP8_BY_DTYPE[cache_dtype]
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a uint8, float8_e4m3fn or float8_e4m3fnuz "
                         f"cache, got {cache_dtype}")
    if kv_cache_dtype in E5M2_KV_CACHE_DTYPES:
        if cache_dtype in (torch.uint8, torch.float8_e5m2):
            return E5M2
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a uint8 or float8_e5m2 cache, got {cache_dtype}")
    raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; expected one of "
                     f"{NON_FP8_KV_CACHE_DTYPES + E4M3_KV_CACHE_DTYPES + E5M2_KV_CACHE_DTYPES}")


# --- Sparse index ops (SPEC §3.3) ----------------------------------------------------------------
COMBINE_COLUMN_ALIGN = 128       # combine_topk_swa_indices: C = round_up(topk + window_size, 128) (FlashMLA tiling)
FLASHINFER_COLUMN_ALIGN = 4      # build_flashinfer_mixed_sparse_indices: P = round_up(max(topk, Kd), 4) (16-byte rows)
C128A_MAX_COMPRESSED_TOKENS = 8192   # max_position_embeddings // 128
INDEX_INT32_MAX = 2**31 - 1      # int32 index outputs hold -1 where the int64 value is past this


def combine_width(topk: int, window_size: int) -> int:
    """Columns of combine_topk_swa_indices' fresh output."""
    return round_up(topk + window_size, COMBINE_COLUMN_ALIGN)


def flashinfer_compressed_width(topk: int, kd: int) -> int:
    """P, the compressed columns of build_flashinfer_mixed_sparse_indices' rows."""
    return round_up(max(topk, kd), FLASHINFER_COLUMN_ALIGN)


# --- Metadata (SPEC §3.4, §3.6) --------------------------------------------------------------------
DSPARK_WIDTH_ALIGN = 64                     # DSpark SWA rows: round_up(window + num_spec, 64) columns
PREFILL_BUFFER_TOKENS_PER_MODEL_LEN = 40    # indexer: max_prefill_buffer_size = max_model_len * 40
