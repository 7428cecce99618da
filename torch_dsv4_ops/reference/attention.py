"""Reference paged attention over head-major caches (SPEC §2.3, §3.7, §4 b, f, g, j).

`context_attention_fwd` (prefix prefill: cached context + dense new tokens) and
`chunked_prefill_paged_decode` (that, for requests with query_len >= 2, then a cache-only decode for
requests with query_len == 1). Arguments are those of the ops, already validated; both write into
`o`/`output` only the rows the spec allows and return None. A uint8 cache with an "fp8" string holds
the platform e4m3 of the CPU (e4m3fn). Pure torch, fp32 scores and accumulation; loops over requests
only. Every index value is treated as hostile: nothing is read or written out of range.
"""
from __future__ import annotations

import torch

from .. import layout

# scores per chunk of query rows ([Hq, rows, keys] fp32): bounds the memory of long requests
_CHUNK_ELEMENTS = 1 << 24


def block_ids(table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              is_block_table_ptr: bool) -> torch.Tensor:
    """Block ids of a block table [R, W] (int32/int64) as int64 [R, W], -1 where invalid.

    With `is_block_table_ptr` the entries are byte addresses: for ptr > 0,
    id = (ptr - k_cache.data_ptr()) // (k_cache.stride(0) * element_size) (floor division, so an
    address below the cache gives a negative id); ptr <= 0 is invalid. Ids outside
    [0, num_blocks) are invalid (num_blocks = the smaller of the two caches' shape[0]).
    """
    ids = table.long()
    if is_block_table_ptr:
        page = k_cache.stride(0) * k_cache.element_size()
        if page <= 0:   # degenerate (stride-0) cache: no address names a block
            ids = torch.full_like(ids, -1)
        else:
            ok = ids > 0
            ids = torch.where(ok, (torch.where(ok, ids, 0) - k_cache.data_ptr()) // page, -1)
    nb = min(k_cache.shape[0], v_cache.shape[0])
    return torch.where((ids >= 0) & (ids < nb), ids, -1)


def _cache_keys(kc, vc, fmt, k_scale, v_scale, ids, r, lo, hi, dtype):
    """Valid cached keys of request r at positions [lo, hi): (pos [n] int64, K, V [n, Hkv, D] fp32).

    SPEC §0 lookup with num_blocks known (already folded into `ids`); positions whose block is
    invalid are left out (they count as masked). fp8 entries read back as
    (float(fp8) * scale).to(dtype); other caches give their own values.
    """
    width = ids.shape[1]
    bs = vc.shape[3]
    hkv, d = vc.shape[1], vc.shape[2]
    hi = min(hi, width * bs)                        # columns past the width are invalid
    if r >= ids.shape[0] or hi <= lo:
        empty = torch.zeros(0, hkv, d, dtype=torch.float32, device=vc.device)
        return torch.zeros(0, dtype=torch.int64, device=vc.device), empty, empty
    pos = torch.arange(lo, hi, dtype=torch.int64, device=vc.device)
    blk = ids[r, pos // bs]
    keep = blk >= 0
    pos, blk = pos[keep], blk[keep]
    off = pos % bs
    k = kc[blk, :, :, off, :].reshape(pos.shape[0], hkv, d)    # K element (blk, off, h, i) at [blk, h, i//x, off, i%x]
    v = vc[blk, :, :, off]                                      # V element at [blk, h, i, off]
    if fmt is not None:
        k = (k.float() * k_scale.float().reshape(())).to(dtype)
        v = (v.float() * v_scale.float().reshape(())).to(dtype)
    return pos, k.float(), v.float()


def _attend(qf, qp, kf, vf, kp, sm_scale, alibi_slopes, sw, causal, sinks):
    """Attention of rows qf [M, Hq, D] fp32 at positions qp [M] over keys kf, vf [N, Hkv, D] fp32
    at positions kp [N] (all valid): [M, Hq, D] fp32, 0 for rows with no visible key."""
    m, hq, d = qf.shape
    n, hkv = kf.shape[0], kf.shape[1]
    g = hq // hkv
    out = torch.zeros(m, hq, d, dtype=torch.float32, device=qf.device)
    if n == 0:
        return out
    step = max(1, _CHUNK_ELEMENTS // max(1, hq * n))
    for a in range(0, m, step):
        q = qf[a:a + step]
        p_ = qp[a:a + step]
        rel = kp[None, :] - p_[:, None]                                   # kp - qp, [rows, N]
        vis = torch.ones_like(rel, dtype=torch.bool)
        if causal:
            vis &= rel <= 0
        if sw > 0:
            vis &= -rel < sw
        # scores [Hkv, G, rows, N]: q head h uses kv head h // G
        s = torch.einsum("mkgd,nkd->kgmn", q.reshape(-1, hkv, g, d), kf).reshape(hq, -1, n) * sm_scale
        if alibi_slopes is not None:
            s = s + alibi_slopes.float().reshape(hq, 1, 1) * rel.float()
        s = s.masked_fill(~vis, float("-inf"))
        mx = s.amax(-1)                                                   # [Hq, rows]
        if sinks is not None:
            sink = sinks.float().reshape(hq, 1).expand_as(mx)
            mx = torch.maximum(mx, sink)
        mx = torch.where(mx == float("-inf"), 0.0, mx)
        p = torch.exp(s - mx[..., None])
        den = p.sum(-1)
        if sinks is not None:
            den = den + torch.exp(sink - mx)
        acc = torch.einsum("kgmn,nkd->mkgd", p.reshape(hkv, g, -1, n), vf).reshape(-1, hq, d)
        acc = acc / den.transpose(0, 1)[..., None]
        any_vis = vis.any(-1)                                             # [rows]
        out[a:a + step] = torch.where(any_vis[:, None, None], acc, 0.0)
    return out


def _store(o, t0, t1, acc, out_scale):
    """o[t0:t1] = acc [rows, Hq, D] fp32 in o's dtype; fp8 output: fp8(clamp(acc * (1/scale), +-max))."""
    if out_scale is not None:
        inv = torch.reciprocal(out_scale.float().reshape(()))
        fmax = torch.finfo(o.dtype).max
        o[t0:t1] = (acc * inv).clamp(-fmax, fmax).to(o.dtype)
    else:
        o[t0:t1] = acc.to(o.dtype)


def _request(q, k, v, o, caches, ids, r, q0, qlen, seq, row_limit, sm_scale, alibi_slopes, sw, causal,
             out_scale, sinks):
    """One request: query rows m in [0, qlen) with m < row_limit and q0 + m in [0, T); dense keys
    k[q0 + j] (0 <= j < qlen, inside [0, T)) at positions ctx + j, cached keys below ctx, or all
    seq keys cached when k is None."""
    t = q.shape[0]
    ctx = seq - qlen
    m_lo, m_hi = max(0, -q0), min(qlen, row_limit, t - q0)
    if m_hi <= m_lo:
        return
    qp = ctx + torch.arange(m_lo, m_hi, dtype=torch.int64, device=q.device)
    # cached positions that can be visible to some row: [0, ncache), left of the causal / window bounds
    ncache = seq if k is None else ctx
    lo, hi = 0, ncache
    if causal:
        hi = min(hi, ctx + m_hi)                   # kp <= max qp
    if sw > 0:
        lo = max(lo, ctx + m_lo - sw + 1)          # qp - kp < sw for the smallest qp
    kp, kf, vf = _cache_keys(*caches, ids, r, lo, hi, q.dtype)
    if k is not None:
        j_lo, j_hi = max(0, -q0), min(qlen, k.shape[0] - q0)
        if j_hi > j_lo:
            kp = torch.cat([kp, ctx + torch.arange(j_lo, j_hi, dtype=torch.int64, device=q.device)])
            kf = torch.cat([kf, k[q0 + j_lo:q0 + j_hi].float()])
            vf = torch.cat([vf, v[q0 + j_lo:q0 + j_hi].float()])
    acc = _attend(q[q0 + m_lo:q0 + m_hi].float(), qp, kf, vf, kp, sm_scale, alibi_slopes, sw, causal, sinks)
    _store(o, q0 + m_lo, q0 + m_hi, acc, out_scale)


def _setup(q, kv_cache_dtype, k_cache, v_cache, table, k_scale, v_scale, sliding_window, sm_scale,
           is_block_table_ptr):
    fmt = layout.resolve_kv_cache_format(kv_cache_dtype, k_cache.dtype)
    kc, vc = k_cache, v_cache
    if fmt is not None:
        kc = kc.view(fmt.dtype) if kc.dtype == torch.uint8 else kc
        vc = vc.view(fmt.dtype) if vc.dtype == torch.uint8 else vc
    caches = (kc, vc, fmt, k_scale, v_scale)
    ids = block_ids(table, k_cache, v_cache, is_block_table_ptr)
    sw = sliding_window if sliding_window is not None and sliding_window > 0 else 0
    scale = q.shape[2] ** -0.5 if sm_scale is None else sm_scale
    return caches, ids, sw, scale


def context_attention_fwd(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len,
                          max_seq_len, max_input_len, k_scale, v_scale, alibi_slopes=None, sliding_window=None,
                          sm_scale=None, skip_decode=False, fp8_out_scale=None, sinks=None,
                          is_block_table_ptr=False, causal=True) -> None:
    """Prefix-prefill attention, SPEC §3.7.

    q [T, Hq, D] fp16/bf16/fp32; k, v [T, Hkv, D] (q's dtype) or both None (keys from the cache);
    o [T, Hq, D] q's dtype, or fp8 with `fp8_out_scale`. k_cache [nb, Hkv, D//x, bs, x], v_cache
    [nb, Hkv, D, bs] (q's float dtype, or uint8 / fp8 for fp8 strings). b_loc [R, W] block ids
    (int32/int64) or int64 addresses with `is_block_table_ptr`; b_start_loc [R+1], b_seq_len [R]
    int32. k_scale, v_scale, fp8_out_scale: 1-element fp32; alibi_slopes, sinks: [Hq] fp32.
    `max_seq_len` is not used. Every request with qlen >= 1 (>= 2 with `skip_decode`) writes its rows
    m < max_input_len that lie in [0, T); nothing else of `o` is touched.
    """
    caches, ids, sw, scale = _setup(q, kv_cache_dtype, k_cache, v_cache, b_loc, k_scale, v_scale,
                                    sliding_window, sm_scale, is_block_table_ptr)
    starts, seqs = b_start_loc.tolist(), b_seq_len.tolist()
    min_qlen = 2 if skip_decode else 1
    for r in range(min(len(starts) - 1, len(seqs))):
        q0, qlen = starts[r], starts[r + 1] - starts[r]      # exact (Python int) arithmetic
        if qlen < min_qlen:
            continue
        _request(q, k, v, o, caches, ids, r, q0, qlen, seqs[r], max_input_len, scale, alibi_slopes, sw,
                 causal, fp8_out_scale, sinks)


def chunked_prefill_paged_decode(query, key, value, output, kv_cache_dtype, key_cache, value_cache, block_table,
                                 query_start_loc, seq_lens, max_seq_len, max_query_len, k_scale, v_scale,
                                 alibi_slopes=None, sliding_window=None, sm_scale=None, output_scale=None,
                                 sinks=None, is_block_table_ptr=False, causal=True) -> None:
    """Mixed prefill + decode attention, SPEC §3.7, §4 f, j.

    Shapes and dtypes as in `context_attention_fwd` (query/key/value/output, key_cache/value_cache,
    block_table, query_start_loc [R+1], seq_lens [R], output_scale). If max_query_len > 1, the
    requests with qlen >= 2 go through `context_attention_fwd(..., skip_decode=True)` with every option;
    then each request with qlen == 1 (and max_query_len >= 1) attends from row qsl[r] (if in [0, T))
    at position seq_len - 1 over its seq_len cached keys (key/value are not read). Requests with
    qlen <= 0 write nothing.
    """
    if max_query_len > 1:
        context_attention_fwd(query, key, value, output, kv_cache_dtype, key_cache, value_cache, block_table,
                              query_start_loc, seq_lens, max_seq_len, max_query_len, k_scale, v_scale,
                              alibi_slopes, sliding_window, sm_scale, True, output_scale, sinks,
                              is_block_table_ptr, causal)
    if max_query_len < 1:
        return
    caches, ids, sw, scale = _setup(query, kv_cache_dtype, key_cache, value_cache, block_table, k_scale, v_scale,
                                    sliding_window, sm_scale, is_block_table_ptr)
    starts, seqs = query_start_loc.tolist(), seq_lens.tolist()
    for r in range(min(len(starts) - 1, len(seqs))):
        if starts[r + 1] - starts[r] != 1:
            continue
        _request(query, None, None, output, caches, ids, r, starts[r], 1, seqs[r], 1, scale, alibi_slopes, sw,
                 causal, output_scale, sinks)
