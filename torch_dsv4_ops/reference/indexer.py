"""Reference indexer K-cache ops (SPEC §2.2, §3.9, §4 a, b, d).

`indexer_k_quant_and_cache` quantises bf16 K rows [N, 128] into the paged indexer cache (per page: bs x 128
fp8 values, then bs fp32 scales 2**e, e the exact UE8M0 exponent of the row); `cp_gather_indexer_k_quant_cache`
copies the cached values and scales of each request's entries into contiguous rows. Arguments are those of the
ops, already validated. Pure torch.
"""
from __future__ import annotations

import torch

from .. import layout
from .k_cache import fp8_format, lookup, pow2_fp32, ue8m0_quantize


def indexer_pages(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the cache as [num_blocks, bs*132] uint8 pages, bs) of an indexer cache [nb, bs, 132] or [nb, bs, 1, 132]."""
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    stride = kv_cache.stride(0) if nb > 1 else layout.indexer_block_bytes(bs)
    return torch.as_strided(kv_cache, (nb, layout.indexer_block_bytes(bs)), (stride, 1)), bs


def quantize_rows(k: torch.Tensor, use_fnuz: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows [n, 128] -> (fp8 codes [n, 128] uint8, scales 2**e [n] fp32), one UE8M0 scale per row (§2.2)."""
    q, e = ue8m0_quantize(k.float(), fp8_format(use_fnuz))
    return q, pow2_fp32(e)


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, use_fnuz=False) -> None:
    """k [N_k, 128] bf16; token t (< N = slot_mapping's length) goes to slot s, skipped if s < 0 or past the cache."""
    pg, bs = indexer_pages(kv_cache.view(torch.uint8))
    slots = slot_mapping.long()
    keep = ((slots >= 0) & (slots < kv_cache.shape[0] * bs)).nonzero().flatten()
    if keep.numel() == 0:
        return
    s = slots[keep]
    blk, off = s // bs, s % bs
    codes, scales = quantize_rows(k[keep], use_fnuz)
    pg[blk[:, None], off[:, None] * layout.INDEXER_DIM + torch.arange(layout.INDEXER_DIM)] = codes
    scale_cols = layout.indexer_scale_offset(bs, 0) + off[:, None] * layout.INDEXER_SCALE_BYTES \
        + torch.arange(layout.INDEXER_SCALE_BYTES)
    pg[blk[:, None], scale_cols] = scales.view(torch.uint8).reshape(-1, layout.INDEXER_SCALE_BYTES)


def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> None:
    """Row cu[b] + c of dst_k (and of dst_scale) receives entry c < cu[b+1] - cu[b] of request b, bit for bit
    (zeros for an invalid source); destination rows outside [0, dst_k.shape[0]) are skipped."""
    pg, bs = indexer_pages(kv_cache.view(torch.uint8))
    nb, rows = kv_cache.shape[0], dst_k.shape[0]
    out_k = dst_k.view(torch.uint8)
    out_s = dst_scale.view(torch.uint8).reshape(dst_scale.shape[0], layout.INDEXER_SCALE_BYTES)
    cu = cu_seq_lens.long().tolist()
    for b in range(len(cu) - 1):
        first, end = max(-cu[b], 0), min(cu[b + 1] - cu[b], rows - cu[b])   # entries whose row is in [0, rows)
        if end <= first:
            continue
        c = torch.arange(first, end, dtype=torch.int64)
        dst = cu[b] + c
        s = lookup(block_table, b, c, bs, nb) if b < block_table.shape[0] else torch.full_like(c, -1)
        ok = s >= 0
        codes = torch.zeros(c.shape[0], layout.INDEXER_DIM, dtype=torch.uint8)
        scales = torch.zeros(c.shape[0], layout.INDEXER_SCALE_BYTES, dtype=torch.uint8)
        if ok.any():
            blk, off = (s[ok] // bs)[:, None], (s[ok] % bs)[:, None]
            codes[ok] = pg[blk, off * layout.INDEXER_DIM + torch.arange(layout.INDEXER_DIM)]
            scales[ok] = pg[blk, layout.indexer_scale_offset(bs, 0) + off * layout.INDEXER_SCALE_BYTES
                            + torch.arange(layout.INDEXER_SCALE_BYTES)]
        out_k[dst] = codes
        out_s[dst] = scales
