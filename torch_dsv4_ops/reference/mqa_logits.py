"""Reference indexer logits (SPEC §3.9): `fp8_fp4_mqa_logits` (prefill, contiguous fp8 keys) and
`fp8_fp4_paged_mqa_logits` (decode, keys in the paged indexer cache of §2.2).

    logits[m, n] = k_scale[n] * sum_h weights[m, h] * relu(<q[m, h], k[n]>)

on the exact fp8 values, accumulated in fp32. Outside a row's key range a logit is -inf (the reference always
writes the clean form). Arguments are those of the ops, already validated, plus the fp8 format of each fp8
operand (`layout.Fp8Format`). Pure torch.
"""
from __future__ import annotations

import torch

from .. import layout
from .indexer import indexer_pages
from .k_cache import lookup

ROW_ELEMENTS = 1 << 22     # fp32 scores [rows, H, N] per chunk: bounds the reference's memory


def fp8_values(codes: torch.Tensor, fmt: layout.Fp8Format) -> torch.Tensor:
    """fp8 codes (uint8 or a float8 tensor of the same bytes) -> their exact fp32 values."""
    return codes.view(torch.uint8).view(fmt.dtype).float()


def _scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q [R, H, D], k [N, D] fp32 values, w [R, H] -> [R, N] = sum_h w * relu(q k^T) in fp32."""
    s = torch.einsum("rhd,nd->rhn", q, k).clamp_min_(0)
    return torch.einsum("rhn,rh->rn", s, w)


def fp8_fp4_mqa_logits(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, q_fmt, k_fmt,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """q [M, H, D], k [N, D] fp8; k_scale [N] or [N, 1] fp32; weights [M, H] fp32; ks/ke [M] int32.
    Returns (or writes into `out`) logits [M, N] fp32, -inf outside [ks', ke')."""
    m_rows, heads, _ = q.shape
    n = k.shape[0]
    out = torch.empty(m_rows, n, dtype=torch.float32, device=q.device) if out is None else out
    if m_rows == 0 or n == 0:
        return out
    kv = fp8_values(k, k_fmt)
    scale = k_scale.reshape(n).float()
    ks = cu_seqlen_ks.long().clamp(0, n)
    ke = torch.maximum(cu_seqlen_ke.long(), ks).clamp(max=n)
    cols = torch.arange(n, device=q.device)
    step = max(1, ROW_ELEMENTS // max(1, heads * n))
    for lo in range(0, m_rows, step):
        hi = min(m_rows, lo + step)
        s = _scores(fp8_values(q[lo:hi], q_fmt), kv, weights[lo:hi].float()) * scale[None, :]
        inside = (cols[None, :] >= ks[lo:hi, None]) & (cols[None, :] < ke[lo:hi, None])
        out[lo:hi] = torch.where(inside, s, torch.full_like(s, float("-inf")))
    return out


def row_lengths(context_lens: torch.Tensor, next_n: int, max_model_len: int) -> torch.Tensor:
    """[B, next_n] int64 valid key counts: context_lens [B, n] as is, or [B] as ctx_b - n + j + 1 for row j;
    clamped to [0, max_model_len]."""
    if context_lens.dim() == 2:
        lens = context_lens.long()
    else:
        lens = context_lens.long()[:, None] - next_n + 1 + torch.arange(next_n, device=context_lens.device)
    return lens.clamp(0, max_model_len)


def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, max_model_len, q_fmt, k_fmt,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, n, H, 128] fp8; kv_cache the indexer cache ([nb, bs, 132] or [nb, bs, 1, 132] uint8, any page
    stride); weights [B*n, H]; context_lens [B, n] or [B]; block_tables [>= 0 rows, W]. Row b*n + j of the
    logits [B*n, max_model_len] holds keys k < lens[b, j] whose page lookup is valid; -inf elsewhere."""
    batch, next_n, heads, dim = q.shape
    out = torch.empty(batch * next_n, max_model_len, dtype=torch.float32, device=q.device) if out is None else out
    if batch * next_n == 0 or max_model_len == 0:
        return out
    out.fill_(float("-inf"))
    pages, bs = indexer_pages(kv_cache.view(torch.uint8))
    nb = kv_cache.shape[0]
    lens = row_lengths(context_lens, next_n, max_model_len)
    scale_base = layout.indexer_scale_offset(bs, 0)
    for b in range(batch):
        length = int(lens[b].max())
        if length == 0:
            continue
        pos = torch.arange(length, dtype=torch.int64, device=q.device)
        if b < block_tables.shape[0]:
            slot = lookup(block_tables, b, pos, bs, nb)
        else:
            slot = torch.full_like(pos, -1)
        ok = slot >= 0
        blk, off = (torch.where(ok, slot, 0) // bs)[:, None], (torch.where(ok, slot, 0) % bs)[:, None]
        codes = pages[blk, off * dim + torch.arange(dim, device=q.device)]
        scale_bytes = pages[blk, scale_base + off * layout.INDEXER_SCALE_BYTES
                            + torch.arange(layout.INDEXER_SCALE_BYTES, device=q.device)]
        scale = scale_bytes.contiguous().view(torch.float32).reshape(length)
        keys = torch.where(ok[:, None], fp8_values(codes, k_fmt), torch.zeros((), device=q.device))
        rows = slice(b * next_n, (b + 1) * next_n)
        s = _scores(fp8_values(q[b], q_fmt), keys, weights[rows].float()) * torch.where(ok, scale, 0.0)[None, :]
        valid = ok[None, :] & (pos[None, :] < lens[b][:, None])
        out[rows, :length] = torch.where(valid, s, torch.full_like(s, float("-inf")))
    return out
