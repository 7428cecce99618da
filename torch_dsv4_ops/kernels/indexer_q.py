"""Triton kernels and launchers of the indexer Q ops (SPEC §3.9).

* `indexer_q_rope_quant_kernel`: grid (cdiv(T*H, ROWS),). Program p handles the (token, head) rows
  r = p*ROWS .. p*ROWS + ROWS - 1 of the flattened [T*H] rows (t = r // H, h = r % H). It loads every
  position, q row (two [ROWS, 64] bf16 halves), cos/sin row ([ROWS, 32] each) and weight first, then applies
  GPT-J RoPE to the second half in fp32 (pairs split from the loaded tile, no strided loads), rounds to bf16
  (RNE, bit form), takes the exact UE8M0 exponent of the whole row (the bit rule of kernels/k_cache.py) and
  stores 128 fp8 codes and the folded fp32 weight. Launched with `enable_fp_fusion=False`: the RoPE products
  are rounded to fp32 before the sum, as in the reference (no contraction into FMA).
* `pack_seq_kernel`: grid (B, workers). Program (b, w) computes start_b (the exclusive prefix sum of
  max(lengths, 0), loaded in chunks of BLOCK_B) and writes rows i = w*ROWS, w*ROWS + workers*ROWS, ...
  < max_len of out[b]: x[start_b + i] where i < len_b and start_b + i < T, the pad bit pattern elsewhere.
* `unpack_seq_kernel`: grid (B + 1, workers). Program (b < B, w) writes rows start_b + i (i < len_b,
  start_b + i < total) of out: x[b, i] for i < L, zeros for L <= i < len_b; program (B, w) zero-fills the
  rows [sum of lengths, total). So every row of out [0, total) is written exactly once.

Pack/unpack copy bit patterns (tensors viewed as int8/16/32/64), rows of D elements with a runtime element
stride. Counts, strides, D, max_len/total and the pad pattern are runtime arguments; tile sizes, the fp8 format
and the dtypes are the only specialisations (SPEC §4 h).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layout, platform
from ..reference.indexer_q import INT_OF_SIZE, NOPE_DIM, ROPE_DIM, ROPE_PAIRS
from ._launch import FastLauncher, launch_options  # noqa: F401  (ops use kernels.launch_options)
from .fp8 import bf16_bits_rne
from .k_cache import ue8m0_codec, ue8m0_codes, ue8m0_exponents

# Tile settings (to be tuned on the GPU with benchmarks/bench_indexer_q.py)
Q_ROWS = 16                  # (token, head) rows per program: 4 KB of bf16 q in flight (swept on an H100)
Q_MAX_WARPS = 4
PACK_TILE_BYTES = 4096       # bytes of one pack/unpack step [ROWS, BLOCK_D]
PACK_NARROW_BYTES = 256      # rows of at most this many bytes use the narrow tile (16 rows x 256 B)
PACK_WIDE_BYTES = 2048       # ... longer rows the wide one (2 rows x 2048 B per step)
PACK_BLOCK_B = 256           # lengths summed per step of the in-kernel prefix sum
PACK_MAX_WORKERS = 64        # programs per request, at most


# ------------------------------------------------------------------------------------------------
# fused_indexer_q_rope_quant
# ------------------------------------------------------------------------------------------------
@triton.jit
def _bf16_round(x):
    """fp32 -> the fp32 value of its bf16 rounding (RNE), in bit form (the interpreter's cast truncates)."""
    return (bf16_bits_rne(x).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def indexer_q_rope_quant_kernel(
    pos_ptr, q_ptr, cs_ptr, w_ptr, out_ptr, wo_ptr, n_rows, heads, max_pos, softmax_scale, head_scale,
    pos_s, q_s0, q_s1, cs_s0, w_s0, w_s1, out_s0, out_s1, wo_s0, wo_s1,
    NOPE: tl.constexpr, PAIRS: tl.constexpr, FMT: tl.constexpr, SW: tl.constexpr, FP8_MAX: tl.constexpr,
    E_SHIFT: tl.constexpr, MANT_LIMIT: tl.constexpr, FLOOR_BITS: tl.constexpr, BIAS: tl.constexpr,
    NAN_CODE: tl.constexpr, SAT: tl.constexpr, ROWS: tl.constexpr,
):
    tl.static_assert(NOPE == 2 * PAIRS)                                 # 64 pass-through dims, 64 RoPE dims
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = r < n_rows
    r = tl.where(live, r, 0)
    t = r // heads
    h = r % heads
    d = tl.arange(0, NOPE)
    i = tl.arange(0, PAIRS)
    # every load first: positions, the q row halves, cos/sin rows, weights
    pos = tl.load(pos_ptr + t * pos_s, mask=live, other=-1).to(tl.int64)
    ok = live & (pos >= 0) & (pos < max_pos)
    pos = tl.where(ok, pos, 0)
    q_row = q_ptr + t * q_s0 + h * q_s1
    nope = tl.load(q_row[:, None] + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    rope = tl.load(q_row[:, None] + NOPE + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    cs_row = cs_ptr + pos * cs_s0
    cos = tl.load(cs_row[:, None] + i[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    sin = tl.load(cs_row[:, None] + PAIRS + i[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + t * w_s0 + h * w_s1, mask=live, other=0.0).to(tl.float32)
    # GPT-J pairs (64+2i, 64+2i+1) = (e, o), split from the loaded tile
    e, o = tl.split(tl.reshape(rope, (ROWS, PAIRS, 2)))
    e2 = _bf16_round(e * cos - o * sin)
    o2 = _bf16_round(o * cos + e * sin)
    rope = tl.reshape(tl.join(e2, o2), (ROWS, NOPE))
    # the UE8M0 exponent is monotonic in the amax: that of the whole row is the larger of the halves'
    ex = tl.maximum(ue8m0_exponents(nope, E_SHIFT, MANT_LIMIT, FLOOR_BITS),
                    ue8m0_exponents(rope, E_SHIFT, MANT_LIMIT, FLOOR_BITS))
    c_nope = ue8m0_codes(nope, ex, FMT, SW, FP8_MAX, BIAS, NAN_CODE, SAT)
    c_rope = ue8m0_codes(rope, ex, FMT, SW, FP8_MAX, BIAS, NAN_CODE, SAT)
    scale = ((ex + BIAS) << 23).to(tl.float32, bitcast=True)           # 2**e, a normal fp32
    wo = ((w * scale) * softmax_scale) * head_scale
    wo = tl.where(wo != wo, float("nan"), wo)                          # one NaN bit pattern, 0x7FC00000
    # an invalid position: zero codes and zero weight
    c_nope = tl.where(ok[:, None], c_nope, 0).to(tl.uint8)
    c_rope = tl.where(ok[:, None], c_rope, 0).to(tl.uint8)
    wo = tl.where(ok, wo, 0.0)
    out_row = out_ptr + t * out_s0 + h * out_s1
    tl.store(out_row[:, None] + d[None, :], c_nope, mask=live[:, None])
    tl.store(out_row[:, None] + NOPE + d[None, :], c_rope, mask=live[:, None])
    tl.store(wo_ptr + t * wo_s0 + h * wo_s1, wo, mask=live)


Q_LAUNCHER = FastLauncher(indexer_q_rope_quant_kernel)


def q_rows(target: platform.Target) -> tuple[int, int]:
    """(rows per program, num_warps) of the Q kernel on `target`: the tile plan, one place to tune it."""
    return Q_ROWS, min(Q_MAX_WARPS, platform.num_warps_for(target, Q_ROWS * layout.INDEXER_DIM))


def q_constexprs(fmt: layout.Fp8Format, target: platform.Target) -> dict:
    """Constexprs, num_warps and launch options of `indexer_q_rope_quant_kernel` for fp8 format `fmt`."""
    rows, warps = q_rows(target)
    return dict(NOPE=NOPE_DIM, PAIRS=ROPE_PAIRS, **ue8m0_codec(fmt, target), ROWS=rows, num_warps=warps,
                enable_fp_fusion=False)


def q_grid(n_rows: int, target: platform.Target) -> tuple:
    return (layout.cdiv(n_rows, q_rows(target)[0]),)


def q_runtime_args(n_rows, heads, max_pos, softmax_scale, head_scale, pos_s, q_strides, cs_s0, w_strides,
                   out_strides, wo_strides) -> tuple:
    """The scalar arguments after the 6 tensors (positions, index_q as bf16, cos_sin_cache, index_weights,
    q_fp8 as uint8, weights_out); the scales as Python floats (fp32 arguments)."""
    return (n_rows, heads, max_pos, float(softmax_scale), float(head_scale), pos_s, q_strides[0], q_strides[1],
            cs_s0, w_strides[0], w_strides[1], out_strides[0], out_strides[1], wo_strides[0], wo_strides[1])


# ------------------------------------------------------------------------------------------------
# pack_seq_triton / unpack_seq_triton
# ------------------------------------------------------------------------------------------------
@triton.jit
def _request_start(len_ptr, b, len_s, BLOCK_B: tl.constexpr):
    """sum(max(lengths[j], 0) for j < b) in int64."""
    acc = tl.zeros((BLOCK_B,), dtype=tl.int64)
    j = tl.arange(0, BLOCK_B)
    for j0 in range(0, b, BLOCK_B):
        n = tl.load(len_ptr + (j0 + j) * len_s, mask=(j0 + j) < b, other=0).to(tl.int64)
        acc += tl.maximum(n, 0)
    return tl.sum(acc, axis=0)


@triton.jit(do_not_specialize=["pad"])
def pack_seq_kernel(
    x_ptr, len_ptr, out_ptr, n_tok, max_len, dim, pad, x_s0, x_sd, len_s, out_s0, out_s1, out_sd,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1)
    step = tl.num_programs(1) * ROWS
    start = _request_start(len_ptr, b, len_s, BLOCK_B)
    n = tl.maximum(tl.load(len_ptr + b * len_s).to(tl.int64), 0)
    n = tl.minimum(n, n_tok - start)                                   # source rows past x: padding
    k = tl.arange(0, ROWS)
    dd = tl.arange(0, BLOCK_D)
    for i0 in range(w * ROWS, max_len, step):
        i = i0 + k
        src_ok = i < n
        src = tl.where(src_ok, start + i, 0)
        row_ok = i < max_len
        for d0 in range(0, dim, BLOCK_D):
            d = d0 + dd
            d_ok = d < dim
            v = tl.load(x_ptr + src[:, None] * x_s0 + d[None, :] * x_sd, mask=src_ok[:, None] & d_ok[None, :])
            v = tl.where(src_ok[:, None], v, pad.to(v.dtype))
            tl.store(out_ptr + b * out_s0 + i[:, None] * out_s1 + d[None, :] * out_sd, v,
                     mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def unpack_seq_kernel(
    x_ptr, len_ptr, out_ptr, total, n_req, width, dim, x_s0, x_s1, x_sd, len_s, out_s0, out_sd,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1)
    step = tl.num_programs(1) * ROWS
    start = _request_start(len_ptr, b, len_s, BLOCK_B)
    is_req = b < n_req
    n = tl.load(len_ptr + tl.where(is_req, b, 0) * len_s, mask=is_req, other=0).to(tl.int64)
    # a request's rows [start, start + len); program b = n_req: the uncovered tail [start, total)
    n = tl.where(is_req, tl.maximum(n, 0), total - start)
    n = tl.minimum(n, total - start)                                   # rows >= total: skipped
    data = tl.where(is_req, width, 0)
    k = tl.arange(0, ROWS)
    dd = tl.arange(0, BLOCK_D)
    for i0 in range(w * ROWS, n, step):
        i = i0 + k
        row_ok = i < n
        src_ok = row_ok & (i < data)
        src = tl.where(src_ok, i, 0)
        dst = tl.where(row_ok, start + i, 0)
        for d0 in range(0, dim, BLOCK_D):
            d = d0 + dd
            d_ok = d < dim
            v = tl.load(x_ptr + tl.where(is_req, b, 0) * x_s0 + src[:, None] * x_s1 + d[None, :] * x_sd,
                        mask=src_ok[:, None] & d_ok[None, :], other=0)
            tl.store(out_ptr + dst[:, None] * out_s0 + d[None, :] * out_sd, v, mask=row_ok[:, None] & d_ok[None, :])


PACK_LAUNCHER = FastLauncher(pack_seq_kernel)
UNPACK_LAUNCHER = FastLauncher(unpack_seq_kernel)


def seq_tile(dim: int, element_size: int) -> tuple[int, int]:
    """(ROWS, BLOCK_D) of a pack/unpack step for rows of `dim` elements: the narrow tile for rows of at most
    PACK_NARROW_BYTES, else the wide one; each step moves at most PACK_TILE_BYTES."""
    row_bytes = PACK_NARROW_BYTES if dim * element_size <= PACK_NARROW_BYTES else PACK_WIDE_BYTES
    block_d = row_bytes // element_size
    return PACK_TILE_BYTES // row_bytes, block_d


def seq_constexprs(dim: int, element_size: int, target: platform.Target) -> dict:
    rows, block_d = seq_tile(dim, element_size)
    warps = platform.num_warps_for(target, PACK_TILE_BYTES // 16, per_thread=1)   # one 16-byte vector per lane
    return dict(ROWS=rows, BLOCK_D=block_d, BLOCK_B=PACK_BLOCK_B, num_warps=min(4, warps))


def seq_workers(rows: int, dim: int, element_size: int) -> int:
    """Programs per request for up to `rows` rows per request (host ints only)."""
    return max(1, min(layout.cdiv(rows, seq_tile(dim, element_size)[0]), PACK_MAX_WORKERS))


def pack_runtime_args(n_tok, max_len, dim, pad, x_s0, x_sd, len_s, out_s0, out_s1, out_sd) -> tuple:
    """The int arguments after the 3 tensors (x and out as the int dtype of their element size, lengths)."""
    return (n_tok, max_len, dim, pad, x_s0, x_sd, len_s, out_s0, out_s1, out_sd)


def unpack_runtime_args(total, n_req, width, dim, x_s0, x_s1, x_sd, len_s, out_s0, out_sd) -> tuple:
    """The int arguments after the 3 tensors (x and out as the int dtype of their element size, lengths)."""
    return (total, n_req, width, dim, x_s0, x_s1, x_sd, len_s, out_s0, out_sd)


# ------------------------------------------------------------------------------------------------
# compile matrix
# ------------------------------------------------------------------------------------------------
Q_MATRIX_HEADS = 64
SEQ_MATRIX_DIMS = {"narrow": 64, "wide": 1024}         # bytes per row of the matrix's pack/unpack cases


def matrix_launch_q(target: platform.Target, fmt: layout.Fp8Format, pos_dtype=torch.int64,
                    cs_dtype=torch.float32, w_dtype=torch.float32):
    """What ops/indexer_q.py passes to indexer_q_rope_quant_kernel for contiguous tensors (T 37, H 64)."""
    from .matrix import Ptr

    t, h, dim = 37, Q_MATRIX_HEADS, layout.INDEXER_DIM
    meta = launch_options(q_constexprs(fmt, target))
    ints = q_runtime_args(t * h, h, 4096, 128 ** -0.5, 64 ** -0.5, 1, (h * dim, dim), ROPE_DIM, (h, 1),
                          (h * dim, dim), (h, 1))
    name = (f"indexer_q.{fmt.name}.pos{torch.iinfo(pos_dtype).bits}.cs-{str(cs_dtype)[6:]}"
            f".w-{str(w_dtype)[6:]}")
    tensors = (Ptr(pos_dtype), Ptr(torch.bfloat16), Ptr(cs_dtype), Ptr(w_dtype), Ptr(torch.uint8),
               Ptr(torch.float32))
    return name, tensors, ints, meta


def matrix_launch_seq(target: platform.Target, kind: str, tile: str, element_size: int, len_dtype=torch.int32):
    """What ops/indexer_q.py passes to pack_seq_kernel / unpack_seq_kernel (contiguous [.., D] rows of
    SEQ_MATRIX_DIMS[tile] bytes, 8 requests of up to 3 rows)."""
    from .matrix import Ptr

    dim = SEQ_MATRIX_DIMS[tile] // element_size
    meta = launch_options(seq_constexprs(dim, element_size, target))
    if kind == "pack":
        ints = pack_runtime_args(20, 3, dim, -7, dim, 1, 1, 3 * dim, dim, 1)
    else:
        ints = unpack_runtime_args(20, 8, 3, dim, 3 * dim, dim, 1, 1, dim, 1)
    name = f"{kind}_seq.{tile}.i{8 * element_size}.len{torch.iinfo(len_dtype).bits}"
    data = Ptr(INT_OF_SIZE[element_size])
    return name, (data, Ptr(len_dtype), data), ints, meta


def matrix_cases(target: platform.Target) -> list:
    """Every specialisation the indexer Q ops launch on `target`: the Q kernel for both e4m3 flavours (the
    platform's, and the other through a typed output buffer), int64/int32 positions, fp32/bf16/fp16 cos/sin
    caches and fp32/bf16 weights; pack and unpack for 1-, 2-, 4- and 8-byte elements, both tiles and
    int32/int64 lengths."""
    from .matrix import dedupe, kernel_case

    def case(fn, launch):
        name, tensors, ints, meta = launch
        return kernel_case(target, name, fn, tensors, ints, meta)

    cases = []
    for fmt in (layout.E4M3FN, layout.E4M3FNUZ):
        for pos in (torch.int64, torch.int32):
            for cs in (torch.float32, torch.bfloat16, torch.float16):
                for w in (torch.float32, torch.bfloat16):
                    cases.append(case(indexer_q_rope_quant_kernel, matrix_launch_q(target, fmt, pos, cs, w)))
    for kind, fn in (("pack", pack_seq_kernel), ("unpack", unpack_seq_kernel)):
        for tile in SEQ_MATRIX_DIMS:
            for size in INT_OF_SIZE:
                for lens in (torch.int32, torch.int64):
                    cases.append(case(fn, matrix_launch_seq(target, kind, tile, size, lens)))
    return dedupe(cases)
