"""Reference `top_k_per_row_prefill` / `top_k_per_row_decode` (SPEC §3.9, "Points settled").

Row r of `logits` (read through the explicit stride0/stride1) has the candidates [lo, hi), L = hi - lo:
prefill lo = clamp(ks, 0, N), hi = clamp(ke, lo, N); decode lo = 0, hi = clamp(len, 0, N) with len =
seq_lens[b, j] (2-D) or seq_lens[b] - next_n + j + 1 (1-D), r = b*next_n + j, and len = 0 when b has no
seq_lens row. topk_indices[r, :topk] receives [0..L-1, -1...] when L <= topk, else the positions (column - lo)
of the topk largest logits in ascending order: NaN ranks below -inf, -0.0 equals +0.0, ties go to the lowest
columns. Columns past topk and rows past num_rows are untouched. Arguments are those of the ops, already
validated. Pure torch.
"""
from __future__ import annotations

import torch

SIGN = 1 << 31
MASK32 = (1 << 32) - 1


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2**32) whose order ranks the values of x (any float dtype, widened to fp32):
    NaN -> 0, -0.0 and +0.0 -> 2**31, otherwise the IEEE bits with negatives reversed."""
    x = x.float()
    bits = x.view(torch.int32).long() & MASK32
    key = torch.where(bits >= SIGN, MASK32 - bits, bits | SIGN)
    key = torch.where(x == 0, torch.full_like(key, SIGN), key)
    return torch.where(x.isnan(), torch.zeros_like(key), key)


def prefill_ranges(cu_seqlen_ks, cu_seqlen_ke, num_rows: int, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) int64 [num_rows]: [ks, ke) clamped to the row [0, n_cols)."""
    lo = cu_seqlen_ks[:num_rows].long().clamp(0, n_cols)
    hi = torch.maximum(cu_seqlen_ke[:num_rows].long().clamp(max=n_cols), lo)
    return lo, hi


def decode_ranges(next_n: int, seq_lens, num_rows: int, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) int64 [num_rows]: [0, len) clamped to the row, len = 0 for rows past seq_lens' requests."""
    r = torch.arange(num_rows, device=seq_lens.device)
    b, j = r // next_n, r % next_n
    has = b < seq_lens.shape[0]
    if seq_lens.shape[0] == 0:
        length = torch.zeros_like(r)
    elif seq_lens.dim() == 2:
        length = seq_lens[torch.where(has, b, 0), j].long()
    else:
        length = seq_lens[torch.where(has, b, 0)].long() - next_n + j + 1
    hi = torch.where(has, length, 0).clamp(0, n_cols)
    return torch.zeros_like(hi), hi


def top_k_rows(rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [R, topk] of rows [R, N] with candidate ranges [lo, hi) (see the module docstring)."""
    num_rows, n_cols = rows.shape
    cols = torch.arange(n_cols, device=rows.device)
    inside = (cols >= lo[:, None]) & (cols < hi[:, None])
    keys = torch.where(inside, order_keys(rows), -1)           # outside the range: below every key
    if n_cols < topk:
        keys = torch.cat([keys, keys.new_full((num_rows, topk - n_cols), -1)], 1)
    # stable: equal keys keep ascending column order, so ties at the threshold go to the lowest columns
    best = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :topk]
    chosen = best.sort(dim=1).values - lo[:, None]
    length = (hi - lo)[:, None]
    ramp = torch.arange(topk, device=rows.device).expand(num_rows, topk)
    short = torch.where(ramp < length, ramp, -1)
    return torch.where(length <= topk, short, chosen).to(torch.int32)


def logits_rows(logits: torch.Tensor, num_rows: int, stride0: int, stride1: int) -> torch.Tensor:
    """The [num_rows, N] view of logits' storage that the explicit strides describe."""
    return torch.as_strided(logits, (num_rows, logits.shape[1]), (stride0, stride1), logits.storage_offset())


def top_k_per_row_prefill(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, stride0, stride1,
                          topk) -> None:
    if num_rows == 0:
        return
    lo, hi = prefill_ranges(cu_seqlen_ks, cu_seqlen_ke, num_rows, logits.shape[1])
    topk_indices[:num_rows, :topk] = top_k_rows(logits_rows(logits, num_rows, stride0, stride1), lo, hi, topk)


def top_k_per_row_decode(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1, topk) -> None:
    if num_rows == 0:
        return
    lo, hi = decode_ranges(next_n, seq_lens, num_rows, logits.shape[1])
    topk_indices[:num_rows, :topk] = top_k_rows(logits_rows(logits, num_rows, stride0, stride1), lo, hi, topk)
