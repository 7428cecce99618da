"""Reference indexer Q ops (SPEC §3.9, §4 b, d, i): `fused_indexer_q_rope_quant`, `pack_seq_triton` and
`unpack_seq_triton`.

`fused_indexer_q_rope_quant` applies GPT-J RoPE to the last 64 of the 128 dims of every (token, head) row of the
indexer queries, rounds the rotated values to bf16, quantises each row to fp8 with one exact UE8M0 scale 2**e and
folds that scale into the head weights. `pack_seq_triton` copies a flat [T, ...] token tensor into padded
per-request rows [B, max_len, ...]; `unpack_seq_triton` copies them back into [total, ...]. Arguments are those of
the ops, already validated. Pure torch; imports nothing of the package but `layout` (and the shared UE8M0 helpers
of reference/k_cache.py).
"""
from __future__ import annotations

import torch

from .. import layout
from .k_cache import pow2_fp32, ue8m0_quantize

ROPE_DIM, NOPE_DIM, ROPE_PAIRS = layout.INDEXER_ROPE_DIM, layout.INDEXER_NOPE_DIM, layout.INDEXER_ROPE_PAIRS


def fp32_scalar(value: float) -> torch.Tensor:
    """A Python float rounded to fp32 (RNE), as a 0-d fp32 tensor: the kernels receive scales as fp32 arguments."""
    return torch.tensor(value, dtype=torch.float32)


def rope_rows(index_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """index_q [T, H, 128] (bf16) with GPT-J RoPE on dims [64, 128), as fp32 [T, H, 128] holding bf16 values.

    cos, sin: [T, 32] fp32. Pair i = dims (64+2i, 64+2i+1) = (e, o): e' = e*cos_i - o*sin_i,
    o' = o*cos_i + e*sin_i, each product and sum rounded to fp32 (separate torch ops, no fused multiply-add),
    then rounded to bf16 (RNE).
    """
    x = index_q.float()
    e, o = x[..., NOPE_DIM::2], x[..., NOPE_DIM + 1::2]                # [T, H, 32]
    c, s = cos[:, None, :], sin[:, None, :]
    e2 = (e * c - o * s).to(torch.bfloat16).float()
    o2 = (o * c + e * s).to(torch.bfloat16).float()
    rope = torch.stack([e2, o2], -1).reshape(x.shape[0], x.shape[1], ROPE_DIM)
    return torch.cat([x[..., :NOPE_DIM], rope], -1)


def fused_indexer_q_rope_quant(positions, index_q, cos_sin_cache, index_weights, softmax_scale, head_scale,
                               fmt: layout.Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 codes [T, H, 128] uint8 of format `fmt`, weights_out [T, H] fp32).

    Per (t, h): RoPE as `rope_rows`, e = the exact UE8M0 exponent of max|row| over all 128 dims (1e-4 floor,
    FP8_MAX = fmt.ue8m0_max), codes = fp8(clamp(row * 2**-e)), weights_out = ((w * 2**e) * softmax_scale) *
    head_scale in fp32 (the scales rounded to fp32 first). A position outside [0, max_pos) gives zero codes and
    zero weights for its token.
    """
    t, h = index_q.shape[0], index_q.shape[1]
    max_pos = cos_sin_cache.shape[0]
    pos = positions.long()
    ok = (pos >= 0) & (pos < max_pos)
    if max_pos > 0:
        cs = cos_sin_cache[torch.where(ok, pos, torch.zeros_like(pos))].float()
    else:
        cs = torch.zeros(t, ROPE_DIM, dtype=torch.float32, device=index_q.device)
    row = rope_rows(index_q, cs[:, :ROPE_PAIRS], cs[:, ROPE_PAIRS:])
    codes, e = ue8m0_quantize(row, fmt)
    w = index_weights.float() * pow2_fp32(e)                           # exact: a power of two (up to overflow)
    w = (w * fp32_scalar(softmax_scale).to(w.device)) * fp32_scalar(head_scale).to(w.device)
    w = torch.where(w.isnan(), torch.full_like(w, float("nan")), w)    # one NaN bit pattern, 0x7FC00000
    codes = torch.where(ok[:, None, None], codes, torch.zeros_like(codes))
    w = torch.where(ok[:, None], w, torch.zeros_like(w))
    assert codes.shape == (t, h, layout.INDEXER_DIM)
    return codes, w


INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as the signed integer dtype of its element size (copies through it are bit for bit)."""
    return t.view(INT_OF_SIZE[t.element_size()])


def pad_pattern(pad_value, dtype: torch.dtype) -> int | None:
    """The bit pattern (a signed int of the element's width) of `pad_value` in `dtype`, or None when `dtype`
    cannot represent it exactly (e.g. -inf or 0.5 in an integer dtype, 0.1 in bf16, 1e6 in fp16)."""
    if dtype.is_floating_point:
        v = torch.tensor([float(pad_value)], dtype=torch.float64)
        t = v.to(dtype)
        back = t.double()
        same = bool(torch.equal(back, v)) or bool(v.isnan().all() and back.isnan().all())
        return int(bits_view(t)[0]) if same else None
    if isinstance(pad_value, float) and not pad_value.is_integer():
        return None
    if dtype == torch.bool:
        return int(pad_value) if int(pad_value) in (0, 1) else None
    info = torch.iinfo(dtype)
    if not info.min <= int(pad_value) <= info.max:
        return None
    return int(bits_view(torch.tensor([int(pad_value)], dtype=dtype))[0])


def request_starts(lengths: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums of max(lengths, 0), int64 [B]: where request b's rows start."""
    n = lengths.long().clamp(min=0)
    return torch.cumsum(n, 0) - n


def pack_seq(x: torch.Tensor, lengths: torch.Tensor, pad_value, max_len: int, out: torch.Tensor) -> None:
    """out [B, max_len, ...]: out[b, i] = x[start_b + i] for i < min(len_b, max_len) with start_b + i < T,
    pad_value everywhere else; bit for bit."""
    dst, src = bits_view(out), bits_view(x)
    dst.fill_(pad_pattern(pad_value, x.dtype))
    n_tok = x.shape[0]
    starts, n = request_starts(lengths).tolist(), lengths.long().clamp(min=0).tolist()
    for b, (start, count) in enumerate(zip(starts, n)):
        rows = max(0, min(count, max_len, n_tok - start))
        if rows:
            dst[b, :rows] = src[start:start + rows]


def unpack_seq(x: torch.Tensor, lengths: torch.Tensor, total: int, out: torch.Tensor) -> None:
    """out [total, ...]: out[start_b + i] = x[b, i] for i < min(len_b, L) with start_b + i < total; every other
    row of out is zero (all bits clear); bit for bit."""
    dst, src = bits_view(out), bits_view(x)
    dst.zero_()
    width = x.shape[1]
    starts, n = request_starts(lengths).tolist(), lengths.long().clamp(min=0).tolist()
    for b, (start, count) in enumerate(zip(starts, n)):
        rows = max(0, min(count, width, total - start))
        if rows:
            dst[start:start + rows] = src[b, :rows]
