"""`build_prefill_chunk_metadata` (SPEC §3.4): host sizes from the CPU copies, then one device op
(`fill_prefill_chunk_metadata`) writing cu_seq_lens, ks/ke and token_to_seq.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..ops.metadata import fill_prefill_chunk_metadata
from ..reference.metadata import local_count
from .types import DeepseekV32IndexerPrefillChunkMetadata


def _local(x: int, rank: int, world: int, interleave: int) -> int:
    """SPEC §3.4 `local(x)`: how many of x interleaved entries DCP rank `rank` holds."""
    base = (x // interleave // world) * interleave
    return base + min(max(x - base * world - rank * interleave, 0), interleave)


def _buffer(out, i: int, name: str, n: int) -> torch.Tensor:
    t = out[i]
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
        raise ValueError(f"out[{i}] ({name}) must be a 1-D int32 tensor")
    if t.shape[0] < n:
        raise ValueError(f"out[{i}] ({name}) has {t.shape[0]} entries, fewer than the {n} needed")
    return t[:n]


def fill_chunk(start: int, end: int, qs0: int, qs1: int, token_base: int, total: int, comp_host: Sequence[int],
               query_start_loc: torch.Tensor, uncompressed_seq_lens: torch.Tensor,
               compressed_seq_lens: torch.Tensor, block_table: torch.Tensor, compress_ratio: int,
               skip_kv_gather: bool, dcp_rank: int, dcp_world_size: int, interleave: int,
               cu: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, token_to_seq: torch.Tensor,
               local_cu: torch.Tensor | None = None) -> DeepseekV32IndexerPrefillChunkMetadata:
    """The device part of one chunk, into buffers already sliced to [n+1], [qs1-qs0], [qs1-qs0],
    [total] (validated host values; `token_base` = qsl_cpu[start], `comp_host` the chunk's host
    compressed lengths, read only under DCP). Not a public entry point."""
    n = end - start
    fill_prefill_chunk_metadata(query_start_loc, uncompressed_seq_lens, compressed_seq_lens, start, end, qs0, qs1,
                                max(compress_ratio, 1), dcp_rank, dcp_world_size, interleave, cu, ks, ke,
                                token_to_seq)
    local_total = max_local_total = total
    if dcp_world_size > 1:
        # Device: this rank's cumsum of local(compressed) with torch ops (temporaries are allocated).
        # Host: this rank's total and the largest total over ranks, from the CPU copies (upper bounds).
        count = local_count(compressed_seq_lens[start:end].clamp(min=0), dcp_rank, dcp_world_size, interleave)
        if local_cu is None:
            local_cu = torch.empty(n + 1, dtype=torch.int32, device=cu.device)
        local_cu[:1].zero_()
        torch.cumsum(count, 0, dtype=torch.int32, out=local_cu[1:n + 1])
        comp = [max(int(c), 0) for c in comp_host]
        per_rank = [sum(_local(c, r, dcp_world_size, interleave) for c in comp) for r in range(dcp_world_size)]
        local_total, max_local_total = per_rank[dcp_rank], max(per_rank)
    else:
        local_cu = cu
    return DeepseekV32IndexerPrefillChunkMetadata(
        block_table=block_table[start:end], cu_seqlen_ks=ks, cu_seqlen_ke=ke, cu_seq_lens=cu,
        token_to_seq=token_to_seq, total_seq_lens=total, token_start=token_base + qs0, token_end=token_base + qs1,
        num_reqs=n, skip_kv_gather=bool(skip_kv_gather) or qs0 > 0, local_cu_seq_lens=local_cu,
        local_total_seq_lens=local_total, max_local_total_seq_lens=max_local_total)


def build_prefill_chunk_metadata(start_idx: int, end_idx: int, query_start_loc: torch.Tensor,
                                 query_start_loc_cpu: torch.Tensor, uncompressed_seq_lens: torch.Tensor,
                                 compressed_seq_lens: torch.Tensor, compressed_seq_lens_cpu: torch.Tensor,
                                 block_table: torch.Tensor, compress_ratio: int, query_slice: slice | None = None,
                                 skip_kv_gather: bool = False, dcp_rank: int = 0, dcp_world_size: int = 1,
                                 cp_kv_cache_interleave_size: int = 1, *, out=None
                                 ) -> DeepseekV32IndexerPrefillChunkMetadata | None:
    """Indexer metadata of prefill requests [start_idx, end_idx) (global indices), SPEC §3.4.

    query_start_loc [R+1] and its CPU copy; uncompressed_seq_lens, compressed_seq_lens [>= end_idx]
    (device) and compressed_seq_lens_cpu [>= end_idx] (CPU, may be an upper bound); block_table
    [R, width]. `query_slice` selects chunk-relative query rows [qs0, qs1) (default: all). Host ints
    come from the CPU copies only; the device work is one `fill_prefill_chunk_metadata` call.
    Returns None when the chunk's host total of compressed tokens is 0.

    `out = (cu_seq_lens, cu_seqlen_ks, cu_seqlen_ke, token_to_seq)`: 1-D int32 buffers at least
    [n+1], [qs1-qs0], [qs1-qs0], [total] long; the result holds views of their leading entries and
    nothing is allocated. Under DCP, a fifth buffer ([n+1] int32) receives `local_cu_seq_lens`
    (allocated when absent), computed on the device with torch ops (which allocate temporaries);
    `local_total_seq_lens` (this rank) and `max_local_total_seq_lens` (the largest over ranks) are
    host sums of `local(x)` over the CPU lengths. Without DCP every local_* field equals its global one.
    """
    for name, v in (("start_idx", start_idx), ("end_idx", end_idx), ("compress_ratio", compress_ratio),
                    ("dcp_rank", dcp_rank), ("dcp_world_size", dcp_world_size),
                    ("cp_kv_cache_interleave_size", cp_kv_cache_interleave_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an int, got {type(v).__name__}")
    R = query_start_loc_cpu.shape[0] - 1
    if not 0 <= start_idx <= end_idx <= R:
        raise ValueError(f"start_idx/end_idx must satisfy 0 <= {start_idx} <= {end_idx} <= R = {R} "
                         "(query_start_loc_cpu)")
    if compressed_seq_lens_cpu.shape[0] < end_idx:
        raise ValueError(f"compressed_seq_lens_cpu has {compressed_seq_lens_cpu.shape[0]} entries, fewer than "
                         f"end_idx = {end_idx}")
    comp = compressed_seq_lens_cpu[start_idx:end_idx]
    total = int(comp.sum())
    if total <= 0:
        return None
    n = end_idx - start_idx
    token_base = int(query_start_loc_cpu[start_idx])
    qlen = int(query_start_loc_cpu[end_idx]) - token_base
    if query_slice is None:
        qs0, qs1 = 0, qlen
    else:
        qs0 = 0 if query_slice.start is None else query_slice.start
        qs1 = qlen if query_slice.stop is None else query_slice.stop
        if query_slice.step not in (None, 1) or not 0 <= qs0 <= qs1 <= qlen:
            raise ValueError(f"query_slice {query_slice} must be a step-1 range inside [0, {qlen}]")
    rows = qs1 - qs0
    local_cu = None
    if out is None:
        device = query_start_loc.device
        cu, ks, ke, t2s = (torch.empty(k, dtype=torch.int32, device=device) for k in (n + 1, rows, rows, total))
    else:
        if len(out) not in (4, 5):
            raise ValueError("out must be (cu_seq_lens, cu_seqlen_ks, cu_seqlen_ke, token_to_seq[, local_cu_seq_lens])")
        cu, ks, ke, t2s = (_buffer(out, i, name, k) for i, (name, k) in
                           enumerate((("cu_seq_lens", n + 1), ("cu_seqlen_ks", rows), ("cu_seqlen_ke", rows),
                                      ("token_to_seq", total))))
        if len(out) == 5 and dcp_world_size > 1:
            local_cu = _buffer(out, 4, "local_cu_seq_lens", n + 1)
    return fill_chunk(start_idx, end_idx, qs0, qs1, token_base, total, comp.tolist() if dcp_world_size > 1 else (),
                      query_start_loc, uncompressed_seq_lens, compressed_seq_lens, block_table, compress_ratio,
                      skip_kv_gather, dcp_rank, dcp_world_size, cp_kv_cache_interleave_size, cu, ks, ke, t2s,
                      local_cu)
