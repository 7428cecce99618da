"""Reference sparse MLA attention over fp8_ds_mla caches and a bf16 workspace (SPEC §2.1, §3.8, §4 b).

`flash_mla_with_kvcache` (decode: rows dequantised from one or two paged fp8 caches) and
`flash_mla_sparse_fwd` (prefill: rows of a gathered bf16 workspace). Arguments are those of the ops,
already validated. Every index is treated as hostile: an entry outside [0, rows) or past the row's
length selects nothing, and no row outside the selected set is read. Scores and sums in float64.
"""
from __future__ import annotations

import torch

from .. import layout
from .k_cache import dequantize_rows, fp8_format, pages


def cache_pages(k_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the cache as [num_blocks, bs*584] uint8 pages, bs) for any accepted form of an fp8_ds_mla cache:
    [nb, bs, 584], [nb, bs, 1, 584] or [nb, page_bytes] (bs = page_bytes // 584); uint8, int8 or fp8."""
    raw = k_cache.view(torch.uint8)
    if raw.dim() == 2:
        bs = layout.ds_mla_block_size_of_pages(raw.shape[1])
    else:
        bs = raw.shape[1]
    return pages(raw, bs), bs


def _selected(indices: torch.Tensor, lengths: torch.Tensor | None, batch: torch.Tensor, rows: int) -> torch.Tensor:
    """[T, W] bool: entry i of token t is selected when i < clamp(lengths[batch[t]], 0, W) and
    0 <= indices[t, i] < rows."""
    width = indices.shape[1]
    sel = (indices >= 0) & (indices < rows)
    if lengths is not None:
        n = lengths.long()[batch].clamp(0, width)
        sel &= torch.arange(width, device=indices.device)[None, :] < n[:, None]
    return sel


def _dequantized(k_cache: torch.Tensor, slots: torch.Tensor, use_fnuz: bool) -> torch.Tensor:
    """bf16 rows [n, 512] of valid slots (int64) of an fp8_ds_mla cache, dequantised as §2.1."""
    pg, bs = cache_pages(k_cache)
    blk, off = slots // bs, slots % bs
    data = pg[blk[:, None], off[:, None] * layout.TOKEN_DATA_BYTES + torch.arange(layout.TOKEN_DATA_BYTES)]
    scale = pg[blk[:, None], layout.ds_mla_scale_offset(bs, 0) + off[:, None] * layout.SCALE_BYTES
               + torch.arange(layout.SCALE_BYTES)]
    return dequantize_rows(data, scale, fp8_format(use_fnuz))


def attend(q: torch.Tensor, rows: torch.Tensor, scale: float, sink: torch.Tensor | None):
    """One token: q [H, 512], its selected rows [n, 512] (any float dtype), sink [H] or None ->
    (out [H, 512] float64, max_logits [H], lse [H]).

    out = sum e^(s-m) row / (sum e^(s-m) + e^(z-m)) with m the max of the scores (the sink is folded in
    after, so z = +inf gives 0 and z = NaN gives NaN); no row: out 0, lse +inf, max_logits -inf."""
    h = q.shape[0]
    if rows.shape[0] == 0:
        inf = torch.full((h,), float("inf"), dtype=torch.float64)
        return torch.zeros(h, layout.HEAD_DIM, dtype=torch.float64), -inf, inf
    kv = rows.double()
    s = scale * (q.double() @ kv.T)                                      # [H, n]
    m = s.amax(1)
    p = torch.exp(s - m[:, None])
    l_sum = p.sum(1)
    denom = l_sum if sink is None else l_sum + torch.exp(sink.double() - m)
    return (p @ kv) / denom[:, None], m, m + torch.log(l_sum)


def flash_mla_with_kvcache(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
                           extra_topk_length, softmax_scale, use_fnuz=False, extra_use_fnuz=False):
    """q [B, s_q, Hq, 512] bf16 -> (out [B, s_q, Hq, 512] bf16, lse [B, Hq, s_q] fp32)."""
    b_count, s_q, hq, _ = q.shape
    tokens = b_count * s_q
    batch = torch.arange(tokens, device=q.device) // max(s_q, 1)
    sources = [(k_cache, indices, topk_length, use_fnuz)]
    if extra_k_cache is not None:
        sources.append((extra_k_cache, extra_indices, extra_topk_length, extra_use_fnuz))
    chosen = []
    for cache, idx, lengths, fnuz in sources:
        flat = idx.reshape(tokens, idx.shape[-1]).long()
        pg, bs = cache_pages(cache)
        chosen.append((cache, flat, _selected(flat, lengths, batch, pg.shape[0] * bs), fnuz))
    out = torch.zeros(tokens, hq, layout.HEAD_DIM, dtype=torch.float64)
    lse = torch.empty(tokens, hq, dtype=torch.float64)
    qf = q.reshape(tokens, hq, layout.HEAD_DIM)
    for t in range(tokens):
        rows = [_dequantized(cache, flat[t][sel[t]], fnuz) for cache, flat, sel, fnuz in chosen]
        out[t], _, lse[t] = attend(qf[t], torch.cat(rows), softmax_scale, attn_sink)
    return (out.to(torch.bfloat16).reshape(q.shape),
            lse.float().reshape(b_count, s_q, hq).transpose(1, 2).contiguous())


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, attn_sink=None, topk_length=None):
    """q [Tq, Hq, 512] bf16, kv [Skv, 1, 512] bf16 -> (out [Tq, Hq, 512] bf16, max_logits [Tq, Hq] fp32,
    lse [Tq, Hq] fp32)."""
    tokens, hq, _ = q.shape
    flat = indices.reshape(tokens, indices.shape[-1]).long()
    sel = _selected(flat, topk_length, torch.arange(tokens, device=q.device), kv.shape[0])
    rows = kv.reshape(kv.shape[0], layout.HEAD_DIM)
    out = torch.zeros(tokens, hq, layout.HEAD_DIM, dtype=torch.float64)
    mx = torch.empty(tokens, hq, dtype=torch.float64)
    lse = torch.empty(tokens, hq, dtype=torch.float64)
    for t in range(tokens):
        out[t], mx[t], lse[t] = attend(q[t], rows[flat[t][sel[t]]], sm_scale, attn_sink)
    return out.to(torch.bfloat16), mx.float(), lse.float()
