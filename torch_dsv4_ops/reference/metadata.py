"""Reference metadata ops (SPEC §3.4, §0 `lookup`, §4 b, k).

Arguments are those of the ops, already validated. Every computation is int64; int32 outputs hold
-1 wherever a slot is negative or past INT32_MAX. Outputs are written into the tensors given (the
op allocates fresh ones for the functional form). `query_start_loc` is assumed non-decreasing;
where it is not, the ops still stay inside their tensors but rows may differ from this reference.
"""
from __future__ import annotations

import torch

from .sparse_index import lookup, to_int32


def _requests(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, n: int):
    """(qs, q, prefix) of requests [0, n) as int64 vectors."""
    qsl = query_start_loc.long()
    qs = qsl[:n]
    q = qsl[1:n + 1] - qs
    return qs, q, seq_lens[:n].long() - q


def get_compressed_slot_mapping(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio,
                                out) -> None:
    """SPEC §3.4: out[:] = -1, then row qsl[b] + i (below num_tokens and len(out)) of request b gets
    lookup(bt, b, pos // ratio, bs) when (pos + 1) % ratio == 0 and pos >= 0, else -1."""
    out.fill_(-1)
    R = min(block_table.shape[0], seq_lens.shape[0], query_start_loc.shape[0] - 1)
    limit = min(num_tokens, out.shape[0])
    qs, q, prefix = _requests(query_start_loc, seq_lens, max(R, 0))
    for b in range(max(R, 0)):
        i = torch.arange(max(int(q[b]), 0), dtype=torch.int64)
        row = qs[b] + i
        keep = (row >= 0) & (row < limit)
        pos = prefix[b] + i
        ok = (pos >= 0) & ((pos + 1) % compress_ratio == 0)
        slot = lookup(block_table, torch.tensor(b), torch.where(ok, pos // compress_ratio, -1), block_size)
        out[row[keep]] = slot[keep].to(out.dtype)


def _token_rows(rows, token_offset, query_start_loc, seq_lens, token_to_req_indices, is_valid_token):
    """(r, valid, prefix, q, qs, pos) of output rows [0, rows): token t = token_offset + i."""
    t = torch.arange(token_offset, token_offset + rows, dtype=torch.int64)
    r = token_to_req_indices[token_offset:token_offset + rows].long()
    R = min(query_start_loc.shape[0] - 1, seq_lens.shape[0])
    ok = (r >= 0) & (r < R) & is_valid_token[token_offset:token_offset + rows].bool()
    rr = torch.where(ok, r, 0)
    if R > 0:
        qsl = query_start_loc.long()
        qs, q = qsl[rr], qsl[rr + 1] - qsl[rr]
        prefix = seq_lens.long()[rr] - q
    else:
        qs = q = prefix = torch.zeros_like(t)
    pos = prefix + (t - qs)
    return rr, ok & (pos >= 0), prefix, q, pos


def compute_swa_indices_and_lens(swa_indices, swa_lens, window_size, query_start_loc, seq_lens,
                                 token_to_req_indices, is_valid_token, block_table, block_size, token_offset,
                                 noncausal: bool = False) -> None:
    """SPEC §3.4, causal (`compute_swa_indices_and_lens`) or DSpark non-causal: rows [0, len(swa_lens))
    of `swa_indices [rows, W]` (a [rows, 1, W] buffer is passed as its [rows, W] view)."""
    rows, W = swa_indices.shape[0], swa_indices.shape[-1]
    r, ok, prefix, q, pos = _token_rows(rows, token_offset, query_start_loc, seq_lens, token_to_req_indices,
                                        is_valid_token)
    if noncausal:
        start = torch.clamp(prefix - window_size, min=0)
        n = torch.clamp(prefix + q - start, min=0, max=W)
    else:
        start = torch.clamp(pos - window_size + 1, min=0)
        n = pos + 1 - start
    n = torch.where(ok, n, 0)
    c = torch.arange(W, dtype=torch.int64)[None, :]
    idx = lookup(block_table, r[:, None], start[:, None] + c, block_size)
    swa_indices.view(rows, W).copy_(to_int32(torch.where(c < n[:, None], idx, -1)))
    swa_lens[:rows] = n.to(swa_lens.dtype)


def compute_prefill_gather_lens(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out) -> None:
    """SPEC §3.4: out[i] = q[r] + clamp(prefix[r], 0, window - 1), r = num_decodes + i."""
    _, q, prefix = _requests(query_start_loc, seq_lens, num_decodes + num_prefills)
    out[:num_prefills] = (q + prefix.clamp(min=0, max=window_size - 1))[num_decodes:].to(out.dtype)


def _copy_table_rows(expanded_block_table, rows: int, block_table, r: torch.Tensor) -> None:
    """expanded[i, :w] = block_table[r[i], :w] (w the smaller width), -1 past w; r < 0 gives
    column 0 = 0 and -1 elsewhere (a padding row)."""
    w = min(block_table.shape[1], expanded_block_table.shape[1])
    fill = torch.full((rows, expanded_block_table.shape[1]), -1, dtype=torch.int64)
    pad = r < 0
    fill[:, :w] = block_table[r.clamp(min=0), :w].long() if block_table.shape[0] else -1
    fill[pad] = -1
    fill[pad, :1] = 0
    expanded_block_table[:rows] = fill.to(expanded_block_table.dtype)


def prepare_uniform_decode(seq_lens, decode_seq_lens, block_table, expanded_block_table, decode_lens,
                           max_decode_len, num_decode_tokens) -> None:
    """SPEC §3.4: row idx < num_decode_tokens of request idx // L, j = idx % L:
    decode_seq_lens = max(seq - L + j + 1, 0), the request's table row, decode_lens = 1."""
    L, n = max_decode_len, num_decode_tokens
    idx = torch.arange(n, dtype=torch.int64)
    r, j = idx // L, idx % L
    decode_seq_lens[:n] = (seq_lens.long()[r] - L + j + 1).clamp(min=0).to(decode_seq_lens.dtype)
    _copy_table_rows(expanded_block_table, n, block_table, r)
    decode_lens[:n] = 1


def prepare_varlen_decode(query_start_loc, seq_lens, block_table, decode_seq_lens, expanded_block_table, decode_lens,
                          decode_indices, num_decodes, num_decode_tokens) -> None:
    """Ragged decode flatten (SPEC §3.6.2 step 3): row qsl[b] + j of decode request b < num_decodes
    (j < dl_b) gets decode_seq_lens = max(seq_b - dl_b + j + 1, 0), request b's table row and
    decode_indices = b; rows from E = qsl[nd] - qsl[0] to num_decode_tokens are padding
    (decode_seq_lens 0, table row [0, -1, ...], decode_indices nd + (row - E)); decode_lens = 1."""
    nd, n = num_decodes, num_decode_tokens
    qsl = query_start_loc.long()
    row = torch.arange(n, dtype=torch.int64)
    r = torch.full((n,), -1, dtype=torch.int64)
    base = qsl[0]
    for b in range(nd):
        r = torch.where((row >= qsl[b] - base) & (row < qsl[b + 1] - base), b, r)
    rr = r.clamp(min=0)
    qs, dl = qsl[rr] - base, qsl[rr + 1] - qsl[rr]
    sl = (seq_lens.long()[rr] - dl + (row - qs) + 1).clamp(min=0)
    decode_seq_lens[:n] = torch.where(r >= 0, sl, 0).to(decode_seq_lens.dtype)
    _copy_table_rows(expanded_block_table, n, block_table, r)
    decode_lens[:n] = 1
    E = qsl[nd] - base
    decode_indices[:n] = torch.where(r >= 0, r, nd + row - E).to(decode_indices.dtype)


def local_count(x: torch.Tensor, dcp_rank: int, dcp_world_size: int, interleave: int) -> torch.Tensor:
    """SPEC §3.4 `local(x)`: the entries of x interleaved entries this DCP rank holds (x without DCP)."""
    if dcp_world_size <= 1:
        return x
    base = (x // interleave // dcp_world_size) * interleave
    return base + torch.clamp(x - base * dcp_world_size - dcp_rank * interleave, min=0, max=interleave)


def build_prefill_chunk_metadata(query_start_loc, uncompressed_seq_lens, compressed_seq_lens, start_idx, end_idx,
                                 query_start, query_end, compress_ratio, dcp_rank, dcp_world_size,
                                 cp_kv_cache_interleave_size, cu_seq_lens, cu_seqlen_ks, cu_seqlen_ke,
                                 token_to_seq) -> None:
    """SPEC §3.4 step 2 and 4 for requests [start_idx, end_idx) and chunk-relative query rows
    [query_start, query_end): cu_seq_lens[:n+1], ks/ke[:query_end-query_start], and all of
    token_to_seq (entries past cu_seq_lens[n] are -1). Negative compressed lengths count as 0."""
    n = end_idx - start_idx
    comp = compressed_seq_lens[start_idx:end_idx].long().clamp(min=0)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(comp, 0)
    cu_seq_lens[:n + 1] = cu.to(cu_seq_lens.dtype)
    args = (dcp_rank, dcp_world_size, cp_kv_cache_interleave_size)
    row_start = torch.zeros(n + 1, dtype=torch.int64)
    row_start[1:] = torch.cumsum(local_count(comp, *args), 0)
    qsl = query_start_loc[start_idx:end_idx + 1].long()
    qsl = qsl - qsl[0]
    rows = query_end - query_start
    for b in range(n):
        qlen = int(qsl[b + 1] - qsl[b])
        o = torch.arange(max(qlen, 0), dtype=torch.int64)
        a = qsl[b] + o - query_start
        keep = (a >= 0) & (a < rows)
        x = (uncompressed_seq_lens[start_idx + b].long() - qlen + 1 + o).clamp(min=0) // compress_ratio
        cu_seqlen_ks[a[keep]] = row_start[b].to(cu_seqlen_ks.dtype)
        cu_seqlen_ke[a[keep]] = (row_start[b] + local_count(x, *args))[keep].to(cu_seqlen_ke.dtype)
    k = torch.arange(token_to_seq.shape[0], dtype=torch.int64)
    token_to_seq.copy_((torch.searchsorted(cu[1:], k, right=True)).where(k < cu[n], -1).to(token_to_seq.dtype))


def prepare_token_metadata(query_start_loc, slot_mapping, token_to_req_indices, is_valid_token) -> None:
    """Rows t < len(slot_mapping): token_to_req_indices[t] = the request b with qsl[b] <= t < qsl[b+1]
    (0 where there is none: padding rows), is_valid_token[t] = slot_mapping[t] >= 0."""
    T = slot_mapping.shape[0]
    qsl = query_start_loc.long()
    t = torch.arange(T, dtype=torch.int64)
    r = torch.zeros(T, dtype=torch.int64)
    for b in range(qsl.shape[0] - 1):
        r = torch.where((t >= qsl[b]) & (t < qsl[b + 1]), b, r)
    token_to_req_indices[:T] = r.to(token_to_req_indices.dtype)
    is_valid_token[:T] = slot_mapping >= 0


def prepare_native_decode(query_start_loc, seq_lens, decode_lens, decode_seq_lens, num_decodes, max_decode_len,
                          compress_ratio) -> None:
    """Decode request b < num_decodes, j < L = max_decode_len: decode_lens[b] = query_len[b],
    decode_seq_lens[b*L + j] = max(seq_b - L + 1 + j, 0) // compress_ratio."""
    nd, L = num_decodes, max_decode_len
    qsl = query_start_loc.long()
    decode_lens[:nd] = (qsl[1:nd + 1] - qsl[:nd]).to(decode_lens.dtype)
    j = torch.arange(L, dtype=torch.int64)[None, :]
    ctx = (seq_lens[:nd].long()[:, None] - L + 1 + j).clamp(min=0) // compress_ratio
    decode_seq_lens[:nd * L] = ctx.reshape(-1).to(decode_seq_lens.dtype)


def prepare_swa_decode(swa_indices, swa_lens, token_to_req_indices, is_valid_token, window_size, query_start_loc,
                       seq_lens, slot_mapping, block_table, block_size, num_decode_tokens, noncausal) -> None:
    """The SWA builder's decode work in one op: `prepare_token_metadata`, then the (causal or DSpark)
    SWA rows of tokens [0, num_decode_tokens) and swa_lens[num_decode_tokens:] = 0."""
    prepare_token_metadata(query_start_loc, slot_mapping, token_to_req_indices, is_valid_token)
    ndt = num_decode_tokens
    rows = swa_indices[:, 0] if swa_indices.dim() == 3 else swa_indices
    compute_swa_indices_and_lens(rows[:ndt], swa_lens[:ndt], window_size,
                                 query_start_loc, seq_lens, token_to_req_indices, is_valid_token, block_table,
                                 block_size, 0, noncausal=noncausal)
    swa_lens[ndt:] = 0
