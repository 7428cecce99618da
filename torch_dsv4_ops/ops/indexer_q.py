"""Indexer Q ops of C4A layers (SPEC §3.9): `dsv4::fused_indexer_q_rope_quant`, `dsv4::pack_seq_triton` and
`dsv4::unpack_seq_triton`, each with an `_out` form (SPEC R1).

The Python entry points mirror vLLM's functions of the same names (argument order and defaults as SPEC §3.9);
`output_buffers` / `out` are the trailing arguments that let callers keep CUDA-graph addresses (SPEC §4 i).
"""
from __future__ import annotations

import math

import torch

from .. import layout, platform
from ..kernels import indexer_q as kernels
from ..library import register_op
from ..reference import indexer_q as reference
from ._checks import check_float, check_int, check_tensor, known
from ._plans import MISSING, PlanCache, signature

POSITION_DTYPES = (torch.int64, torch.int32)
COS_SIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
Q_OUT_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e4m3fnuz)
LENGTH_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2**31 - 1


# --- validation --------------------------------------------------------------------------------------------------
def check_q(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4) -> tuple:
    """Validate fused_indexer_q_rope_quant's inputs; return (T, H, max_pos)."""
    if not isinstance(use_fp4, bool):
        raise ValueError(f"use_fp4 must be a bool, got {use_fp4!r}")
    if use_fp4:
        raise NotImplementedError("fused_indexer_q_rope_quant: use_fp4=True (MXFP4 indexer queries) is not supported")
    check_tensor("index_q", index_q, ndim=3, dtypes=(torch.bfloat16,))
    device = index_q.device
    t, h, dim = index_q.shape
    if dim != layout.INDEXER_DIM or (known(h) and h < 1) or index_q.stride(2) != 1:
        raise ValueError(f"index_q must be [T, H >= 1, {layout.INDEXER_DIM}] with a contiguous last dim, got shape "
                         f"{tuple(index_q.shape)} and strides {index_q.stride()}")
    check_tensor("positions", positions, ndim=1, dtypes=POSITION_DTYPES, device=device)
    if known(positions.shape[0], t) and positions.shape[0] != t:
        raise ValueError(f"positions must have T = {t} entries (index_q's tokens), got {positions.shape[0]}")
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=COS_SIN_DTYPES, device=device)
    if cos_sin_cache.shape[1] != reference.ROPE_DIM or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be [max_pos, {reference.ROPE_DIM}] ([cos_0..cos_31, sin_0..sin_31] "
                         f"rows) with a contiguous last dim, got shape {tuple(cos_sin_cache.shape)} and strides "
                         f"{cos_sin_cache.stride()}")
    check_tensor("index_weights", index_weights, ndim=2, dtypes=WEIGHT_DTYPES, device=device)
    if known(*index_weights.shape, t, h) and tuple(index_weights.shape) != (t, h):
        raise ValueError(f"index_weights must be [T, H] = [{t}, {h}], got {tuple(index_weights.shape)}")
    check_float("softmax_scale", softmax_scale)
    check_float("head_scale", head_scale)
    return t, h, cos_sin_cache.shape[0]


def check_q_out(index_q, q_fp8, weights_out) -> layout.Fp8Format:
    """Validate the output buffers; return the fp8 format of the codes: a float8 buffer's own flavour, the
    platform e4m3 (SPEC R7) for a uint8 one."""
    t, h = index_q.shape[0], index_q.shape[1]
    check_tensor("q_fp8", q_fp8, ndim=3, dtypes=Q_OUT_DTYPES, device=index_q.device)
    if q_fp8.shape != index_q.shape or q_fp8.stride(2) != 1:
        raise ValueError(f"q_fp8 must be [T, H, {layout.INDEXER_DIM}] = {tuple(index_q.shape)} with a contiguous "
                         f"last dim, got shape {tuple(q_fp8.shape)} and strides {q_fp8.stride()}")
    check_tensor("weights_out", weights_out, ndim=2, dtypes=(torch.float32,), device=index_q.device)
    if known(*weights_out.shape, t, h) and tuple(weights_out.shape) != (t, h):
        raise ValueError(f"weights_out must be [T, H] = [{t}, {h}] float32, got {tuple(weights_out.shape)}")
    return q_format(q_fp8.dtype, index_q.device)


def q_format(dtype: torch.dtype, device: torch.device) -> layout.Fp8Format:
    """The e4m3 flavour written into a q_fp8 buffer of `dtype` on `device`."""
    if dtype == torch.uint8:
        return platform.platform_e4m3(platform.target_for(device))
    return layout.FP8_BY_DTYPE[dtype]


def uniform_rows(name: str, t: torch.Tensor, lead: int) -> tuple[int, int]:
    """(D, element stride) of `t` seen as rows of D = prod(shape[lead:]) elements: the trailing dims must be one
    uniformly strided run (contiguous, or every stride a multiple of the last one, as for a transposed 2-D
    tensor)."""
    shape, strides = t.shape[lead:], t.stride()[lead:]
    dim = math.prod(shape)
    sized = [(n, s) for n, s in zip(shape, strides) if n != 1]
    step = sized[-1][1] if sized else 1
    expect = step
    for n, s in reversed(sized):
        if s != expect:
            raise ValueError(f"{name}: the dims after dim {lead - 1} must form one uniformly strided run of "
                             f"{dim} elements, got shape {tuple(t.shape)} and strides {t.stride()}")
        expect *= n
    if dim > 0 and (dim - 1) * abs(step) > INT32_MAX:
        raise NotImplementedError(f"{name}: one row spans {(dim - 1) * abs(step)} elements, over int32 offsets")
    return dim, step


def _check_data(name: str, t, device=None, ndim_min: int = 1) -> None:
    check_tensor(name, t, device=device)
    if t.dim() < ndim_min:
        raise ValueError(f"{name} must have at least {ndim_min} dims, got shape {tuple(t.shape)}")
    if t.dtype.is_complex or t.element_size() not in reference.INT_OF_SIZE:
        raise NotImplementedError(f"{name}: dtype {t.dtype} is not supported (real dtypes of 1, 2, 4 or 8 bytes)")


def check_pack(x, lengths, pad_value, max_len) -> tuple[int, int, int]:
    """Validate pack_seq_triton's inputs; return (D, x's element stride, the pad bit pattern)."""
    _check_data("x", x)
    check_tensor("lengths", lengths, ndim=1, dtypes=LENGTH_DTYPES, device=x.device)
    check_int("max_len", max_len, 0)
    if not isinstance(pad_value, (bool, int, float)):
        raise ValueError(f"pad_value must be a number, got {pad_value!r}")
    bits = reference.pad_pattern(pad_value, x.dtype)
    if bits is None:
        raise ValueError(f"pad_value {pad_value!r} is not representable in x's dtype {x.dtype}")
    dim, step = uniform_rows("x", x, 1)
    return dim, step, bits


def check_pack_out(x, lengths, max_len, out) -> int:
    """Validate pack_seq_triton's out [B, max_len, ...]; return its element stride."""
    check_tensor("out", out, dtypes=(x.dtype,), device=x.device)
    expected = (lengths.shape[0], max_len) + tuple(x.shape[1:])
    if known(*out.shape, *expected) and tuple(out.shape) != expected:
        raise ValueError(f"out must have shape [B, max_len, ...] = {expected}, got {tuple(out.shape)}")
    return uniform_rows("out", out, 2)[1]


def check_unpack(x, lengths, total) -> tuple[int, int]:
    """Validate unpack_seq_triton's inputs; return (D, x's element stride)."""
    _check_data("x", x, ndim_min=2)
    check_tensor("lengths", lengths, ndim=1, dtypes=LENGTH_DTYPES, device=x.device)
    if known(lengths.shape[0], x.shape[0]) and lengths.shape[0] != x.shape[0]:
        raise ValueError(f"lengths must have B = {x.shape[0]} entries (x's requests), got {lengths.shape[0]}")
    check_int("total", total, 0)
    return uniform_rows("x", x, 2)


def check_unpack_out(x, total, out) -> int:
    """Validate unpack_seq_triton's out [total, ...]; return its element stride."""
    check_tensor("out", out, dtypes=(x.dtype,), device=x.device)
    expected = (total,) + tuple(x.shape[2:])
    if known(*out.shape, *expected) and tuple(out.shape) != expected:
        raise ValueError(f"out must have shape [total, ...] = {expected}, got {tuple(out.shape)}")
    return uniform_rows("out", out, 1)[1]


# --- fused_indexer_q_rope_quant: implementations ---------------------------------------------------------------
_Q_PLANS = PlanCache()


def _q_plan(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, q_fp8, weights_out,
            use_fp4):
    t, h, max_pos = check_q(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4)
    fmt = check_q_out(index_q, q_fp8, weights_out)
    if t * h == 0:
        return None
    target = platform.target_for(index_q.device)
    meta = kernels.launch_options(kernels.q_constexprs(fmt, target))
    ints = kernels.q_runtime_args(t * h, h, max_pos, softmax_scale, head_scale, positions.stride(0),
                                  index_q.stride()[:2], cos_sin_cache.stride(0), index_weights.stride(),
                                  q_fp8.stride()[:2], weights_out.stride())
    dtypes = (positions.dtype, torch.bfloat16, cos_sin_cache.dtype, index_weights.dtype, torch.uint8, torch.float32)
    return kernels.Q_LAUNCHER.bind(kernels.q_grid(t * h, target), dtypes, ints, meta, index_q.device)


def _q_run(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, q_fp8, weights_out,
           use_fp4) -> None:
    args = (positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, q_fp8, weights_out, use_fp4)
    sig = signature("q", args)
    launch = _Q_PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _Q_PLANS.remember(sig, _q_plan(*args))
    if launch is not None:
        launch(positions, index_q, cos_sin_cache, index_weights, q_fp8, weights_out)


def _q_new(index_q):
    q_fp8 = index_q.new_empty(index_q.shape, dtype=platform_e4m3_dtype(index_q.device))
    weights_out = index_q.new_empty(index_q.shape[:2], dtype=torch.float32)
    return q_fp8, weights_out


def platform_e4m3_dtype(device: torch.device) -> torch.dtype:
    """The float8 dtype of the functional op's q_fp8 on `device` (SPEC R7)."""
    return platform.platform_e4m3(platform.target_for(device)).dtype


def _q_kernel(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4=False):
    check_q(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4)
    q_fp8, weights_out = _q_new(index_q)
    _q_run(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, q_fp8, weights_out, use_fp4)
    return q_fp8, weights_out


def _q_reference(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4=False):
    check_q(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4)
    q_fp8, weights_out = _q_new(index_q)
    codes, w = reference.fused_indexer_q_rope_quant(positions, index_q, cos_sin_cache, index_weights, softmax_scale,
                                                    head_scale, q_format(q_fp8.dtype, q_fp8.device))
    q_fp8.view(torch.uint8).copy_(codes)
    weights_out.copy_(w)
    return q_fp8, weights_out


def _q_fake(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4=False):
    check_q(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4)
    return _q_new(index_q)


def _q_out_kernel(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, q_fp8, weights_out,
                  use_fp4=False):
    _q_run(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, q_fp8, weights_out, use_fp4)


def _q_out_reference(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, q_fp8,
                     weights_out, use_fp4=False):
    check_q(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4)
    fmt = check_q_out(index_q, q_fp8, weights_out)
    codes, w = reference.fused_indexer_q_rope_quant(positions, index_q, cos_sin_cache, index_weights, softmax_scale,
                                                    head_scale, fmt)
    q_fp8.view(torch.uint8).copy_(codes)
    weights_out.copy_(w)


def _q_out_fake(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, q_fp8, weights_out,
                use_fp4=False):
    check_q(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4)
    check_q_out(index_q, q_fp8, weights_out)


# --- pack / unpack: implementations -------------------------------------------------------------------------------
_PACK_PLANS = PlanCache()
_UNPACK_PLANS = PlanCache()


def _scalar_key(value) -> tuple:
    """A dict key for a scalar argument (NaN pads included: repr, not ==)."""
    return (type(value).__name__, repr(value))


def _pack_plan(x, lengths, pad_value, max_len, out):
    dim, step, bits = check_pack(x, lengths, pad_value, max_len)
    out_step = check_pack_out(x, lengths, max_len, out)
    requests = lengths.shape[0]
    if requests == 0 or max_len == 0 or dim == 0:
        return None
    target = platform.target_for(x.device)
    size = x.element_size()
    meta = kernels.launch_options(kernels.seq_constexprs(dim, size, target))
    ints = kernels.pack_runtime_args(x.shape[0], max_len, dim, bits, x.stride(0), step, lengths.stride(0),
                                     out.stride(0), out.stride(1), out_step)
    data = reference.INT_OF_SIZE[size]
    return kernels.PACK_LAUNCHER.bind((requests, kernels.seq_workers(max_len, dim, size)),
                                      (data, lengths.dtype, data), ints, meta, x.device)


def _pack_run(x, lengths, pad_value, max_len, out) -> None:
    sig = signature("pack", (x, lengths, max_len, out)) + _scalar_key(pad_value)
    launch = _PACK_PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _PACK_PLANS.remember(sig, _pack_plan(x, lengths, pad_value, max_len, out))
    if launch is not None:
        launch(x, lengths, out)


def _pack_new(x, lengths, max_len):
    return x.new_empty((lengths.shape[0], max_len) + tuple(x.shape[1:]))


def _pack_kernel(x, lengths, pad_value, max_len):
    check_pack(x, lengths, pad_value, max_len)
    out = _pack_new(x, lengths, max_len)
    _pack_run(x, lengths, pad_value, max_len, out)
    return out


def _pack_reference(x, lengths, pad_value, max_len):
    check_pack(x, lengths, pad_value, max_len)
    out = _pack_new(x, lengths, max_len)
    reference.pack_seq(x, lengths, pad_value, max_len, out)
    return out


def _pack_fake(x, lengths, pad_value, max_len):
    check_pack(x, lengths, pad_value, max_len)
    return _pack_new(x, lengths, max_len)


def _pack_out_kernel(x, lengths, pad_value, max_len, out):
    _pack_run(x, lengths, pad_value, max_len, out)


def _pack_out_reference(x, lengths, pad_value, max_len, out):
    check_pack(x, lengths, pad_value, max_len)
    check_pack_out(x, lengths, max_len, out)
    reference.pack_seq(x, lengths, pad_value, max_len, out)


def _pack_out_fake(x, lengths, pad_value, max_len, out):
    check_pack(x, lengths, pad_value, max_len)
    check_pack_out(x, lengths, max_len, out)


def _unpack_plan(x, lengths, total, out):
    dim, step = check_unpack(x, lengths, total)
    out_step = check_unpack_out(x, total, out)
    if total == 0 or dim == 0:
        return None
    target = platform.target_for(x.device)
    size = x.element_size()
    requests, width = x.shape[0], x.shape[1]
    meta = kernels.launch_options(kernels.seq_constexprs(dim, size, target))
    ints = kernels.unpack_runtime_args(total, requests, width, dim, x.stride(0), x.stride(1), step, lengths.stride(0),
                                       out.stride(0), out_step)
    data = reference.INT_OF_SIZE[size]
    # rows per program: a request's L rows, or its share of the rows when lengths exceed L (zero fill)
    rows = max(width, total // (requests + 1))
    return kernels.UNPACK_LAUNCHER.bind((requests + 1, kernels.seq_workers(rows, dim, size)),
                                        (data, lengths.dtype, data), ints, meta, x.device)


def _unpack_run(x, lengths, total, out) -> None:
    sig = signature("unpack", (x, lengths, total, out))
    launch = _UNPACK_PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _UNPACK_PLANS.remember(sig, _unpack_plan(x, lengths, total, out))
    if launch is not None:
        launch(x, lengths, out)


def _unpack_new(x, total):
    return x.new_empty((total,) + tuple(x.shape[2:]))


def _unpack_kernel(x, lengths, total):
    check_unpack(x, lengths, total)
    out = _unpack_new(x, total)
    _unpack_run(x, lengths, total, out)
    return out


def _unpack_reference(x, lengths, total):
    check_unpack(x, lengths, total)
    out = _unpack_new(x, total)
    reference.unpack_seq(x, lengths, total, out)
    return out


def _unpack_fake(x, lengths, total):
    check_unpack(x, lengths, total)
    return _unpack_new(x, total)


def _unpack_out_kernel(x, lengths, total, out):
    _unpack_run(x, lengths, total, out)


def _unpack_out_reference(x, lengths, total, out):
    check_unpack(x, lengths, total)
    check_unpack_out(x, total, out)
    reference.unpack_seq(x, lengths, total, out)


def _unpack_out_fake(x, lengths, total, out):
    check_unpack(x, lengths, total)
    check_unpack_out(x, total, out)


# --- self-check examples ---------------------------------------------------------------------------------------
def q_example(tokens: int, heads: int, *, max_pos: int = 4096, seed: int = 0, cs_dtype=torch.float32,
              w_dtype=torch.float32, device="cpu"):
    """(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale): random queries of several
    magnitudes, a theta-10000 cos/sin cache of `max_pos` rows and two invalid positions (-1 and max_pos)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(tokens, heads, layout.INDEXER_DIM, generator=g)
         * torch.exp2(torch.randint(-8, 8, (tokens, heads, 1), generator=g).float())).to(torch.bfloat16)
    inv = 10000.0 ** (-torch.arange(reference.ROPE_PAIRS, dtype=torch.float64) / reference.ROPE_PAIRS)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    cs = torch.cat([ang.cos(), ang.sin()], 1).to(cs_dtype)
    pos = torch.randint(0, max_pos, (tokens,), generator=g)
    if tokens >= 3:
        pos[1], pos[tokens - 1] = -1, max_pos
    w = torch.randn(tokens, heads, generator=g).to(w_dtype)
    return tuple(a.to(device) for a in (pos, q, cs, w)) + (layout.INDEXER_DIM ** -0.5, heads ** -0.5)


def seq_example(lengths: list, row_shape: tuple, dtype=torch.float32, *, seed: int = 0, device="cpu"):
    """(x [sum(max(len, 0)) + 2, *row_shape] of random values of `dtype`, lengths int32)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(max(n, 0) for n in lengths) + 2
    x = torch.randn((t,) + tuple(row_shape), generator=g) * 100
    x = x.to(dtype) if dtype.is_floating_point else x.to(torch.int64).to(dtype)
    return x.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)


def _q_examples():
    return {"T 24, H 16, fp32 cos/sin, fp32 weights": q_example(24, 16),
            "T 9, H 5, bf16 cos/sin, bf16 weights, int32 positions":
                (lambda a: (a[0].int(),) + a[1:])(q_example(9, 5, seed=1, cs_dtype=torch.bfloat16,
                                                            w_dtype=torch.bfloat16))}


def _q_out_examples():
    args = q_example(11, 8, seed=2, cs_dtype=torch.float16)
    q, _ = args[1], args[3]
    return {"uint8 codes (platform e4m3)": args + (torch.zeros(q.shape, dtype=torch.uint8),
                                                   torch.zeros(q.shape[:2]), False)}


def _pack_examples():
    x, lens = seq_example([3, 0, -2, 5, 2], (4, 8), seed=3)
    xi, lens_i = seq_example([2, 4, 1], (6,), torch.int32, seed=4)
    return {"fp32 [T, 4, 8], max_len 4, pad -inf": (x, lens, -math.inf, 4),
            "int32 [T, 6], int64 lengths, pad -1": (xi, lens_i.long(), -1, 3)}


def _pack_out_examples():
    x, lens = seq_example([1, 3, 2], (16,), torch.bfloat16, seed=5)
    return {"bf16 into a padded out": (x, lens, 0.5, 3, torch.zeros(3, 3, 16, dtype=torch.bfloat16))}


def _unpack_examples():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 3, 2, 8, generator=g)
    return {"fp32 [4, 3, 2, 8], one length past L, total past the sum":
            (x, torch.tensor([3, 1, 5, -1], dtype=torch.int32), 10)}


def _unpack_out_examples():
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-1000, 1000, (3, 2, 512), generator=g).to(torch.int32)
    return {"int32 topk rows": (x, torch.tensor([2, 1, 2]), 5, torch.zeros(5, 512, dtype=torch.int32))}


_Q_ARGS = "Tensor positions, Tensor index_q, Tensor cos_sin_cache, Tensor index_weights, float softmax_scale, " \
          "float head_scale"
_q_op = register_op(f"fused_indexer_q_rope_quant({_Q_ARGS}, bool use_fp4=False) -> (Tensor, Tensor)",
                    reference=_q_reference, kernel=_q_kernel, fake=_q_fake, examples=_q_examples)
_q_out_op = register_op(f"fused_indexer_q_rope_quant_out({_Q_ARGS}, Tensor(a!) q_fp8, Tensor(b!) weights_out, "
                        "bool use_fp4=False) -> ()",
                        reference=_q_out_reference, kernel=_q_out_kernel, fake=_q_out_fake, examples=_q_out_examples)
_pack_op = register_op("pack_seq_triton(Tensor x, Tensor lengths, Scalar pad_value, SymInt max_len) -> Tensor",
                       reference=_pack_reference, kernel=_pack_kernel, fake=_pack_fake, examples=_pack_examples)
_pack_out_op = register_op("pack_seq_triton_out(Tensor x, Tensor lengths, Scalar pad_value, SymInt max_len, "
                           "Tensor(a!) out) -> ()",
                           reference=_pack_out_reference, kernel=_pack_out_kernel, fake=_pack_out_fake,
                           examples=_pack_out_examples)
_unpack_op = register_op("unpack_seq_triton(Tensor x, Tensor lengths, SymInt total) -> Tensor",
                         reference=_unpack_reference, kernel=_unpack_kernel, fake=_unpack_fake,
                         examples=_unpack_examples)
_unpack_out_op = register_op("unpack_seq_triton_out(Tensor x, Tensor lengths, SymInt total, Tensor(a!) out) -> ()",
                             reference=_unpack_out_reference, kernel=_unpack_out_kernel, fake=_unpack_out_fake,
                             examples=_unpack_out_examples)


# --- public API -------------------------------------------------------------------------------------------------
def fused_indexer_q_rope_quant(positions: torch.Tensor, index_q: torch.Tensor, cos_sin_cache: torch.Tensor,
                               index_weights: torch.Tensor, softmax_scale: float, head_scale: float,
                               use_fp4: bool = False, output_buffers=None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE + per-(token, head) UE8M0 fp8 quantisation of the indexer queries, the q scale folded into the head
    weights (SPEC §3.9).

    positions: [T] int64/int32. index_q: [T, H, 128] bf16 (H >= 1, last dim contiguous, any other strides).
    cos_sin_cache: [max_pos, 64] fp32/bf16/fp16, rows [cos_0..cos_31, sin_0..sin_31], last dim contiguous.
    index_weights: [T, H] fp32 or bf16, any strides. Per (t, h): GPT-J RoPE on pair i = dims (64+2i, 64+2i+1) in
    fp32, each result rounded to bf16; e = the exact UE8M0 exponent of max|row| over all 128 dims (1e-4 floor,
    FP8_MAX 448, or 224 for e4m3fnuz); q_fp8 = e4m3(row * 2**-e); weights_out = ((w * 2**e) * softmax_scale) *
    head_scale in fp32 (the scales rounded to fp32). A position outside [0, max_pos) gives a zero q_fp8 row and
    zero weights. use_fp4=True raises NotImplementedError.
    Returns (q_fp8 [T, H, 128] platform e4m3 (float8_e4m3fn; float8_e4m3fnuz on gfx942), weights_out [T, H]
    fp32). output_buffers=(q_fp8, weights_out) are written and returned instead: q_fp8 uint8 (platform e4m3
    codes) or a float8 e4m3 tensor (its own flavour), last dim contiguous; weights_out fp32, any strides.
    """
    if output_buffers is None:
        return _q_op(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, use_fp4)
    q_fp8, weights_out = output_buffers
    _q_out_op(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale, q_fp8, weights_out,
              use_fp4)
    return q_fp8, weights_out


def pack_seq_triton(x: torch.Tensor, lengths: torch.Tensor, pad_value: float = -math.inf, *, max_len: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack the tokens of B requests into padded rows: [T, ...] -> [B, max_len, ...] (SPEC §3.9).

    x: [T, ...] of any real dtype; the dims after the first form one uniformly strided run (e.g. contiguous),
    any stride(0). lengths: [B] int32/int64 on x's device; request b's rows start at the exclusive prefix sum
    of max(lengths, 0) (computed on the device). out[b, i] = x[start_b + i] for i < min(len_b, max_len) with
    start_b + i < T, pad_value elsewhere (bit for bit). pad_value must be exactly representable in x's dtype
    (ValueError otherwise, e.g. -inf for an integer tensor). max_len: a host int (no device sync). out: an
    optional [B, max_len, ...] buffer of x's dtype to write and return.
    """
    if out is None:
        return _pack_op(x, lengths, pad_value, max_len)
    _pack_out_op(x, lengths, pad_value, max_len, out)
    return out


def unpack_seq_triton(x: torch.Tensor, lengths: torch.Tensor, *, total: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Unpack padded per-request rows back into a flat token tensor: [B, L, ...] -> [total, ...] (SPEC §3.9).

    x: [B, L, ...] of any real dtype (the dims after the second one uniformly strided run, any other strides).
    lengths: [B] int32/int64 on x's device. out[start_b + i] = x[b, i] for i < min(len_b, L) with
    start_b + i < total (start_b: the exclusive prefix sum of max(lengths, 0), on the device); every other row
    of out is zero (all bits clear). total: a host int. out: an optional [total, ...] buffer of x's dtype.
    """
    if out is None:
        return _unpack_op(x, lengths, total)
    _unpack_out_op(x, lengths, total, out)
    return out
