"""Reference sparse index ops (SPEC §3.3, §0 `lookup`, §4 b, e).

Arguments are those of the ops, already validated. Every computation is int64; int32 outputs
hold -1 wherever the int64 value is negative or past INT32_MAX (`to_int32`). Outputs are written
into the tensors given (the op allocates fresh ones for the functional form).
"""
from __future__ import annotations

import torch

from .. import layout


def to_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 values as int32, -1 where negative or past INT32_MAX."""
    return torch.where((v >= 0) & (v <= layout.INDEX_INT32_MAX), v, -1).to(torch.int32)


def lookup(bt: torch.Tensor, r: torch.Tensor, p: torch.Tensor, bs: int) -> torch.Tensor:
    """SPEC §0 `lookup` (no num_blocks), broadcast over r and p; int64 slots or -1 (no int32 clamp)."""
    r, p = torch.broadcast_tensors(r.long(), p.long())
    rows, width = bt.shape
    if rows == 0 or width == 0:
        return torch.full_like(p, -1)
    ok = (r >= 0) & (r < rows) & (p >= 0)
    col = torch.where(ok, p, 0) // bs
    ok &= col < width
    blk = bt[torch.where(ok, r, 0), torch.where(ok, col, 0)].long()
    ok &= blk >= 0
    return torch.where(ok, blk * bs + torch.where(ok, p, 0) % bs, -1)


def remap(v: torch.Tensor, bs: int, span: int) -> torch.Tensor:
    """remap(v, bs, span) = (v // bs) * span + v % bs for v >= 0, else -1 (int64)."""
    ok = v >= 0
    w = torch.where(ok, v, 0)
    return torch.where(ok, (w // bs) * span + w % bs, -1)


def compute_global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table, block_size,
                                         is_valid_token, global_out, lens_out) -> None:
    """g[t, j] = lookup(bt, t2r[t], topk[t, j], bs); lens[t] = count(g[t] >= 0) if valid[t] else 0."""
    T = topk_indices.shape[0]
    r = token_to_req_indices[:T].long()[:, None]
    g = to_int32(lookup(block_table, r, topk_indices.long(), block_size))
    global_out.copy_(g)
    lens_out.copy_(torch.where(is_valid_token[:T], (g >= 0).sum(1), 0).to(torch.int32))


def _request_rows(qsl: torch.Tensor, rows: int):
    """(b, qs) per row t < rows: the last request b whose rebased range [qs, qe) holds t, or b = -1.
    Later requests win where ranges overlap, as in SPEC's loop over b."""
    q = qsl.long() - qsl[:1].long()
    t = torch.arange(rows, dtype=torch.int64)
    b = torch.full((rows,), -1, dtype=torch.int64)
    for i in range(q.shape[0] - 1):
        b = torch.where((t >= q[i]) & (t < q[i + 1]), i, b)
    bb = b.clamp(min=0)
    return b, q[bb] if q.numel() else torch.zeros_like(b), q[bb + 1] if q.numel() > 1 else torch.zeros_like(b)


def combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio,
                             topk, M, N, combined_out, lens_out, write_uncovered: bool) -> None:
    """SPEC §3.3 combine into `combined_out [>= Tq, row_width]`, `lens_out [>= Tq]`; rows no request
    covers are -1 / 0 when `write_uncovered` (fresh outputs), untouched otherwise."""
    Tq, width = topk_indices.shape[0], combined_out.shape[1]
    b, qs, qe = _request_rows(query_start_loc, Tq)
    covered = b >= 0
    bb = b.clamp(min=0)
    seq = seq_lens.long()[bb] if seq_lens.numel() else torch.zeros_like(b)
    gl = gather_lens.long()[bb] if gather_lens.numel() else torch.zeros_like(b)
    t = torch.arange(Tq, dtype=torch.int64)
    pos = seq - (qe - qs) + (t - qs)
    live = pos >= 0
    tk = torch.where(live, torch.clamp((pos + 1).clamp(min=0) // compress_ratio, max=topk), 0)
    sw = torch.where(live, torch.clamp(pos + 1, max=window_size), 0)
    gstart = seq - gl
    j = torch.arange(width, dtype=torch.int64)[None, :]
    base = M * bb[:, None]
    kcols = min(topk, topk_indices.shape[1], width)
    loc = torch.full((Tq, width), -1, dtype=torch.int64)
    loc[:, :kcols] = topk_indices[:, :kcols].long()
    top = torch.where((loc >= 0) & (loc < N), base + loc, -1)
    w = pos[:, None] - sw[:, None] + 1 + (j - tk[:, None]) - gstart[:, None]
    swa = torch.where((w >= 0) & (N + w < M), base + N + w, -1)
    row = torch.where(j < tk[:, None], top, torch.where(j < (tk + sw)[:, None], swa, -1))
    lens = (tk + sw).to(torch.int32)
    rows = covered if not write_uncovered else torch.ones_like(covered)
    row = torch.where(covered[:, None], row, -1)
    lens = torch.where(covered, lens, 0)
    combined_out[:Tq][rows] = to_int32(row)[rows]
    lens_out[:Tq][rows] = lens[rows]


def build_flashinfer_mixed_sparse_indices(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                                          prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices,
                                          swa_block_table, swa_block_size, compressed_block_table,
                                          compressed_block_size, window_size, compress_ratio, topk,
                                          decode_compressed_indices_are_local, decode_is_valid_token,
                                          swa_block_span, compressed_block_span, sparse_out, lens_out) -> None:
    """SPEC §3.3 into `sparse_out [>= Td+Tp, Wswa+P]`, `lens_out [>= Td+Tp]` (rows Td+Tp.. untouched)."""
    Td, Wswa = decode_swa_indices.shape
    Tp, Kp = prefill_topk_indices.shape
    P = sparse_out.shape[1] - Wswa
    cbt = swa_block_table if compressed_block_table is None else compressed_block_table
    sbs, cbs = swa_block_size, compressed_block_size
    sspan = sbs if swa_block_span is None else swa_block_span
    cspan = cbs if compressed_block_span is None else compressed_block_span
    t2r = token_to_req_indices.long()
    jp = torch.arange(P, dtype=torch.int64)[None, :]
    if Td:
        swa = remap(decode_swa_indices.long(), sbs, sspan)
        Kd = 0 if decode_compressed_indices is None else decode_compressed_indices.shape[1]
        comp = torch.full((Td, P), -1, dtype=torch.int64)
        if Kd == 0:
            length = torch.zeros(Td, dtype=torch.int64)
        elif decode_compressed_indices_are_local:
            v = lookup(cbt, t2r[:Td, None], decode_compressed_indices.long(), cbs)
            comp[:, :Kd] = remap(v, cbs, cspan)
            valid = torch.ones(Td, dtype=torch.bool) if decode_is_valid_token is None else decode_is_valid_token[:Td]
            length = torch.where(valid, (to_int32(comp[:, :Kd]) >= 0).sum(1), 0)
        else:
            comp[:, :Kd] = remap(decode_compressed_indices.long(), cbs, cspan)
            length = torch.full((Td,), Kd, dtype=torch.int64) if decode_compressed_topk_lens is None \
                else decode_compressed_topk_lens[:Td].long()
        sparse_out[:Td] = to_int32(torch.cat([swa, comp], 1))
        lens_out[:Td] = (Wswa + length).to(torch.int32)
    if Tp:
        t = torch.arange(Td, Td + Tp, dtype=torch.int64)
        r = t2r[Td:Td + Tp]
        R = min(query_start_loc.shape[0] - 1, seq_lens.shape[0])
        ok = (r >= 0) & (r < R)
        rr = torch.where(ok, r, 0)
        if R > 0:
            qs, qe, seq = query_start_loc.long()[rr], query_start_loc.long()[rr + 1], seq_lens.long()[rr]
            pos = torch.where(ok, seq - (qe - qs) + (t - qs), -1)
        else:
            pos = torch.full_like(t, -1)
        sw = torch.clamp(pos + 1, min=0, max=window_size)
        s0 = pos - sw + 1
        tk = torch.clamp((pos + 1).clamp(min=0) // compress_ratio, max=topk)
        c = torch.arange(Wswa, dtype=torch.int64)[None, :]
        swa = torch.where(c < sw[:, None], remap(lookup(swa_block_table, r[:, None], s0[:, None] + c, sbs), sbs,
                                                 sspan), -1)
        loc = torch.full((Tp, P), -1, dtype=torch.int64)
        kc = min(Kp, P)
        loc[:, :kc] = prefill_topk_indices[:, :kc].long()
        comp = remap(lookup(cbt, r[:, None], loc, cbs), cbs, cspan)
        comp = torch.where((jp < torch.clamp(tk, max=Kp)[:, None]) & (loc >= 0), comp, -1)
        sparse_out[Td:Td + Tp] = to_int32(torch.cat([swa, comp], 1))
        lens_out[Td:Td + Tp] = (Wswa + tk).to(torch.int32)


def build_c128a_topk_metadata(positions, compress_ratio, num_decode_tokens, token_to_req_indices, block_table,
                              block_size, slot_mapping, global_decode_buffer, decode_lens_buffer, prefill_buffer,
                              max_compressed_tokens) -> None:
    """SPEC §3.3: rows [0, Td) of the decode buffers and [0, T-Td) of the prefill buffer, columns < W."""
    T, Td = positions.shape[0], num_decode_tokens
    pos = positions.long()
    if Td:
        W = min(max_compressed_tokens, global_decode_buffer.shape[1])
        n = torch.clamp((pos[:Td] + 1).clamp(min=0) // compress_ratio, max=W)
        j = torch.arange(W, dtype=torch.int64)[None, :]
        g = lookup(block_table, token_to_req_indices[:Td].long()[:, None], j, block_size)
        global_decode_buffer[:Td, :W] = to_int32(torch.where(j < n[:, None], g, -1))
        decode_lens_buffer[:Td] = torch.where(slot_mapping[:Td] >= 0, n, 0).to(torch.int32)
    if T > Td:
        W = min(max_compressed_tokens, prefill_buffer.shape[1])
        n = torch.clamp((pos[Td:] + 1).clamp(min=0) // compress_ratio, max=W)
        j = torch.arange(W, dtype=torch.int64)[None, :]
        prefill_buffer[:T - Td, :W] = torch.where(j < n[:, None], j, -1).to(torch.int32)


def fill_short_context_topk_indices(topk_indices, positions, topk, compress_ratio) -> None:
    """topk_indices[t, j] = j if j < max((pos_t+1)//ratio, 0) else -1, for t < T, j < topk."""
    T = positions.shape[0]
    n = ((positions.long() + 1) // compress_ratio).clamp(min=0)
    j = torch.arange(topk, dtype=torch.int64)[None, :]
    topk_indices[:T, :topk] = torch.where(j < n[:, None], j, -1).to(topk_indices.dtype)
