"""The framework-neutral metadata builders of SPEC §3.6: `SWAMetadataBuilder` and `IndexerMetadataBuilder`.

Each is constructed once with the engine's limits and reused every step. `build(batch)` runs in two
parts: a host part (validation, the decode/prefill split and every host int, read only from the
`*_cpu` tensors and the batch's ints) that raises `ValueError` before anything is written, then a
device part that writes persistent buffers with graph-safe ops only (no sync, no host-to-device
copy) and returns views of them.
"""
from __future__ import annotations

import operator
from typing import Callable, Sequence

import numpy as np
import torch

from ..ops._checks import check_tensor
from ..ops.metadata import (compute_dspark_noncausal_swa_indices_and_lens, compute_prefill_gather_lens,
                            compute_swa_indices_and_lens, get_compressed_slot_mapping, prepare_native_decode,
                            prepare_swa_decode, prepare_token_metadata, prepare_uniform_decode,
                            prepare_varlen_decode)
from .chunks import fill_chunk
from .planners import (get_dspark_swa_index_width, get_max_prefill_buffer_size, host_int,
                       split_decodes_and_prefills, split_indexer_prefill_chunks)
from .types import (DeepseekSparseSWAMetadata, DeepSeekV32IndexerDecodeMetadata, DeepseekV32IndexerMetadata,
                    DeepseekV32IndexerPrefillMetadata)

COMPRESS_RATIOS = (0, 1, 4, 128)
INT_DTYPES = (torch.int32, torch.int64)
I32 = (torch.int32,)


# --- construction-time checks --------------------------------------------------------------------
def _ratio(name: str, value) -> int:
    try:
        ratio = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        ratio = None
    if ratio not in COMPRESS_RATIOS:
        raise ValueError(f"{name} must be one of {COMPRESS_RATIOS}, got {value!r}")
    return ratio


def _device(device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


# --- per-step batch checks (host values only) ----------------------------------------------------
def _tensor(name: str, t, ndim: int, dtypes, device: torch.device | None) -> torch.Tensor:
    """`check_tensor`; with device None, a CPU tensor of any integer dtype."""
    check_tensor(name, t, ndim=ndim, dtypes=dtypes, device=device)
    if device is None:
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got one on {t.device}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{name} must have an integer dtype, got {t.dtype}")
    return t


def _check_batch(batch, device: torch.device, max_tokens: int, max_seqs: int, table_width: int | None):
    """Validate every field the builders read; return (R, T_pad, qsl, query lens), the last two as
    int64 numpy arrays (vectorised: a 256-request step costs a few µs here, not tens).

    Raises ValueError naming the first inconsistent field. Reads host values only."""
    qsl_cpu = _tensor("query_start_loc_cpu", batch.query_start_loc_cpu, 1, None, None)
    if qsl_cpu.shape[0] < 1:
        raise ValueError("query_start_loc_cpu must hold R+1 >= 1 entries")
    qsl = qsl_cpu.numpy().astype(np.int64)
    R = len(qsl) - 1
    if R > max_seqs:
        raise ValueError(f"query_start_loc_cpu holds R = {R} requests, more than max_num_seqs = {max_seqs}")
    if qsl[0] != 0:
        raise ValueError(f"query_start_loc_cpu must start at 0, got {qsl[0]}")
    q = np.diff(qsl)
    longest = int(q.max()) if R else 0
    if R and q.min() < 0:
        raise ValueError("query_start_loc_cpu must be non-decreasing")
    if _tensor("query_start_loc", batch.query_start_loc, 1, I32, device).shape[0] != R + 1:
        raise ValueError(f"query_start_loc has {batch.query_start_loc.shape[0]} entries, query_start_loc_cpu "
                         f"{R + 1}")
    if _tensor("seq_lens", batch.seq_lens, 1, I32, device).shape[0] != R:
        raise ValueError(f"seq_lens has {batch.seq_lens.shape[0]} entries, expected R = {R}")
    if _tensor("seq_lens_cpu_upper_bound", batch.seq_lens_cpu_upper_bound, 1, None, None).shape[0] != R:
        raise ValueError(f"seq_lens_cpu_upper_bound has {batch.seq_lens_cpu_upper_bound.shape[0]} entries, "
                         f"expected R = {R}")
    bt = _tensor("block_table", batch.block_table, 2, INT_DTYPES, device)
    if bt.shape[0] < R:
        raise ValueError(f"block_table has {bt.shape[0]} rows, fewer than R = {R}")
    if table_width is not None and bt.shape[1] > table_width:
        raise ValueError(f"block_table has {bt.shape[1]} columns, more than block_table_width = {table_width}")
    T_pad = _tensor("slot_mapping", batch.slot_mapping, 1, INT_DTYPES, device).shape[0]
    if T_pad > max_tokens:
        raise ValueError(f"slot_mapping holds T_pad = {T_pad} tokens, more than max_num_batched_tokens = "
                         f"{max_tokens}")
    T = host_int("num_actual_tokens", batch.num_actual_tokens, 0)
    if T != int(qsl[-1]) or T > T_pad:
        raise ValueError(f"num_actual_tokens = {T} must equal query_start_loc_cpu[-1] = {qsl[-1]} and be at most "
                         f"len(slot_mapping) = {T_pad}")
    if host_int("max_query_len", batch.max_query_len, 0) < longest:
        raise ValueError(f"max_query_len = {batch.max_query_len} is below the longest query ({longest})")
    host_int("max_seq_len", batch.max_seq_len, 0)
    positions = getattr(batch, "positions", None)
    if positions is not None and _tensor("positions", positions, 1, INT_DTYPES, device).shape[0] < T:
        raise ValueError(f"positions has {positions.shape[0]} entries, fewer than num_actual_tokens = {T}")
    return R, T_pad, qsl, q


def _split(batch, R: int, q: np.ndarray, threshold: int, require_uniform: bool = False
           ) -> tuple[int, int, int, int]:
    """`split_decodes_and_prefills(batch, threshold, require_uniform)` (SPEC §3.5), answering its two
    all-decode cases from the validated host lists (the steady decode step) and asking it otherwise."""
    if R and (not require_uniform or threshold <= 1) and batch.max_query_len <= threshold:
        return R, 0, batch.num_actual_tokens, 0
    if R and require_uniform and q[0] <= threshold and bool(((q == q[0]) | (q == 0)).all()):
        return R, 0, batch.num_actual_tokens, 0
    return split_decodes_and_prefills(batch, threshold, require_uniform=require_uniform)


_GRAPH_NOTE = """
    CUDA graphs: `build` is a host part (validation, split, host ints) then a device part (buffer
    writes only: no sync, no allocation of outputs, no host-to-device copy). Capture a graph around
    `build(batch)` (after one eager build to compile kernels); for a later step whose host values
    give the same host part (same R, T_pad, split and, for the indexer, the same decode query
    lengths and prefill chunk plan), copy its device tensors (query_start_loc, seq_lens,
    block_table, slot_mapping) into the captured batch's tensors and replay: the returned metadata
    (views of the persistent buffers) then describes the new step.
"""


class SWAMetadataBuilder:
    __doc__ = """Per-step SWA metadata (SPEC §3.6.1); one instance reused across steps.

    Buffers (int32 unless noted, Tmax = max_num_batched_tokens): token_to_req_indices [Tmax],
    is_valid_token [Tmax] bool, decode_swa_indices / prefill_swa_indices [Tmax, 1, window],
    decode_swa_lens / prefill_swa_lens [Tmax], prefill_gather_lens [max_num_seqs], and with
    use_dspark decode_swa_indices_noncausal [Tmax, 1, W_nc].
    """ + _GRAPH_NOTE

    def __init__(self, *, max_num_batched_tokens: int, max_num_seqs: int, window_size: int, max_model_len: int,
                 block_size: int = 64, compress_ratios: Sequence[int] = (1,), num_speculative_tokens: int = 0,
                 parallel_drafting: bool = False, use_dspark: bool = False, device):
        self.max_num_batched_tokens = Tmax = host_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        self.max_num_seqs = host_int("max_num_seqs", max_num_seqs, 1)
        self.window_size = host_int("window_size", window_size, 1)
        self.max_model_len = host_int("max_model_len", max_model_len, 1)
        self.block_size = host_int("block_size", block_size, 1)
        self.compress_ratios = tuple(_ratio("compress_ratios", r) for r in compress_ratios)
        self.num_speculative_tokens = host_int("num_speculative_tokens", num_speculative_tokens, 0)
        self.parallel_drafting = bool(parallel_drafting)
        self.use_dspark = bool(use_dspark)
        self.device = dev = _device(device)
        self.decode_threshold = 1 + (2 if self.parallel_drafting else 1) * self.num_speculative_tokens

        i32 = dict(dtype=torch.int32, device=dev)
        self.token_to_req_indices = torch.zeros(Tmax, **i32)
        self.decode_swa_indices = torch.zeros(Tmax, 1, self.window_size, **i32)
        self.decode_swa_lens = torch.zeros(Tmax, **i32)
        self.prefill_swa_indices = torch.zeros(Tmax, 1, self.window_size, **i32)
        self.prefill_swa_lens = torch.zeros(Tmax, **i32)
        self.is_valid_token = torch.zeros(Tmax, dtype=torch.bool, device=dev)
        self.prefill_gather_lens = torch.zeros(self.max_num_seqs, **i32)
        self.noncausal_index_width = 0
        self.decode_swa_indices_noncausal = None
        if self.use_dspark:
            self.noncausal_index_width = get_dspark_swa_index_width(self.window_size, self.num_speculative_tokens)
            self.decode_swa_indices_noncausal = torch.zeros(Tmax, 1, self.noncausal_index_width, **i32)

    # --- host part --------------------------------------------------------------------------------
    def _plan(self, batch):
        R, T_pad, qsl, q = _check_batch(batch, self.device, self.max_num_batched_tokens, self.max_num_seqs, None)
        causal = batch.causal
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be a bool, got {causal!r}")
        if not causal and not self.use_dspark:
            raise ValueError("causal=False (the DSpark draft block) needs a builder constructed with use_dspark=True")
        split = _split(batch, R, q, self.decode_threshold)
        return R, T_pad, q, causal, split

    # --- device part --------------------------------------------------------------------------------
    def build(self, batch) -> DeepseekSparseSWAMetadata:
        """SWA metadata of one step (SPEC §3.6.1). `batch`: a BatchDescription (or any object with its
        attributes), ordered decodes first; never modified. Returns views of this builder's buffers."""
        R, T_pad, q, causal, (nd, np_, ndt, npt) = self._plan(batch)
        qsl_dev, seq_lens, bt = batch.query_start_loc, batch.seq_lens, batch.block_table

        t2r = self.token_to_req_indices[:T_pad]
        valid = self.is_valid_token[:T_pad]
        window = self.window_size
        if causal:
            dec_buf, width = self.decode_swa_indices, window
        else:
            dec_buf, width = self.decode_swa_indices_noncausal, self.noncausal_index_width
        if ndt:
            # steps 2-4 in one launch: token_to_req, is_valid_token, the decode rows, lens[ndt:] = 0
            prepare_swa_decode(dec_buf, self.decode_swa_lens, self.token_to_req_indices, self.is_valid_token, window,
                               qsl_dev, seq_lens, batch.slot_mapping, bt, self.block_size, ndt, not causal)
        elif T_pad:
            prepare_token_metadata(qsl_dev, batch.slot_mapping, self.token_to_req_indices, self.is_valid_token)
        dec_idx, dec_lens = dec_buf[:ndt], self.decode_swa_lens[:ndt]
        pre_idx = pre_lens = None
        if npt:
            pre_idx, pre_lens = self.prefill_swa_indices[:npt], self.prefill_swa_lens[:npt]
            compute_swa_indices_and_lens(pre_idx, pre_lens, window, qsl_dev, seq_lens, t2r, valid, bt,
                                         self.block_size, ndt)

        md = DeepseekSparseSWAMetadata(
            block_table=bt, slot_mapping=batch.slot_mapping, block_size=self.block_size, seq_lens=seq_lens,
            query_start_loc=qsl_dev, query_start_loc_cpu=batch.query_start_loc_cpu, is_valid_token=valid,
            token_to_req_indices=t2r, decode_swa_indices=dec_idx, decode_swa_lens=dec_lens,
            decode_swa_width=width, prefill_swa_indices=pre_idx, prefill_swa_lens=pre_lens, num_decodes=nd,
            num_prefills=np_, num_decode_tokens=ndt, num_prefill_tokens=npt,
            max_decode_query_len=min(batch.max_query_len, self.decode_threshold))
        if np_:
            md.prefill_gather_lens = compute_prefill_gather_lens(seq_lens, qsl_dev, nd, np_, window,
                                                                 out=self.prefill_gather_lens)
            md.prefill_seq_lens = seq_lens[nd:]
            md.prefill_seq_lens_cpu = batch.seq_lens_cpu_upper_bound[nd:]
            md.prefill_query_lens_cpu = torch.from_numpy(q[nd:].astype(np.int32))
            md.prefill_window_size = window
            md.prefill_max_model_len = self.max_model_len
            md.prefill_max_num_batched_tokens = self.max_num_batched_tokens
        return md

    def update_draft_decode_metadata(self, md: DeepseekSparseSWAMetadata) -> None:
        """Speculative drafting step: re-run the decode kernel that built `md` (causal, or DSpark when
        `md` holds the non-causal buffer) on md's buffers with md's current seq_lens, then clear
        md's per-step dicts (SPEC §3.6.1, §4 k)."""
        ndt = md.num_decode_tokens
        if ndt:
            idx = md.decode_swa_indices
            nc = self.decode_swa_indices_noncausal
            noncausal = nc is not None and (idx.data_ptr() == nc.data_ptr() or (
                idx.data_ptr() != self.decode_swa_indices.data_ptr() and md.decode_swa_width != self.window_size))
            op = compute_dspark_noncausal_swa_indices_and_lens if noncausal else compute_swa_indices_and_lens
            op(idx, md.decode_swa_lens, self.window_size, md.query_start_loc, md.seq_lens, md.token_to_req_indices,
               md.is_valid_token, md.block_table, self.block_size, 0)
        md.flashinfer_sparse_index_cache.clear()
        md.scheduler_state.clear()


def _default_supports_native_decode(n: int) -> bool:
    return n in (1, 2)


class IndexerMetadataBuilder:
    __doc__ = """Per-step indexer metadata (SPEC §3.6.2); one instance reused across steps.

    Buffers (int32 unless noted; Tmax = max_num_batched_tokens, D = max(Tmax, max_num_seqs * next_n)):
    decode_lens, decode_seq_lens, decode_indices, expanded_seq_lens [D] (SPEC: [Tmax]; D also covers
    the native (nd, L) view and qlen-0 decode rows), arange [D], expanded_block_table
    [Tmax, block_table_width], compressed_slot_mapping [Tmax] int64, `schedule` (shape of one
    decode_schedule_fn result, probed once at construction) when decode_schedule_fn is given, and
    the prefill chunk buffers: compressed_seq_lens [max_num_seqs], chunk_cu_seq_lens
    [2 * max_num_seqs], chunk_cu_seqlen_ks / chunk_cu_seqlen_ke [Tmax] (chunk rows at their prefill
    token offset) and chunk_token_to_seq [max_prefill_buffer_size]. Consecutive chunks of one request
    range share cu_seq_lens / token_to_seq (same values). A step whose distinct request ranges need
    more than max_prefill_buffer_size token_to_seq entries in all gets fresh tensors for the chunks
    that do not fit (the only allocation in `build`; prefill steps are not graph-captured in practice).
    `decode_schedule_fn` must return a device tensor of the probed shape on every call (ValueError
    otherwise, raised after the decode writes: a plug-in error, not a batch error).
    """ + _GRAPH_NOTE

    def __init__(self, *, max_num_batched_tokens: int, max_num_seqs: int, block_table_width: int, max_model_len: int,
                 compress_ratio: int = 4, storage_block_size: int = 64, num_speculative_tokens: int = 0,
                 supports_native_decode: Callable[[int], bool] = _default_supports_native_decode,
                 supports_varlen: bool = False, max_prefill_buffer_size: int | None = None,
                 max_logits_bytes: int = 512 * 2**20,
                 decode_schedule_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None, device):
        self.max_num_batched_tokens = Tmax = host_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        self.max_num_seqs = S = host_int("max_num_seqs", max_num_seqs, 1)
        self.block_table_width = host_int("block_table_width", block_table_width, 1)
        self.max_model_len = host_int("max_model_len", max_model_len, 1)
        self.compress_ratio = _ratio("compress_ratio", compress_ratio)
        self.storage_block_size = host_int("storage_block_size", storage_block_size, 1)
        self.num_speculative_tokens = host_int("num_speculative_tokens", num_speculative_tokens, 0)
        self.supports_varlen = bool(supports_varlen)
        self.max_prefill_buffer_size = (get_max_prefill_buffer_size(self.max_model_len)
                                        if max_prefill_buffer_size is None
                                        else host_int("max_prefill_buffer_size", max_prefill_buffer_size, 1))
        self.max_logits_bytes = host_int("max_logits_bytes", max_logits_bytes, 4)
        self.decode_schedule_fn = decode_schedule_fn
        self.device = dev = _device(device)

        self.next_n = self.decode_threshold = next_n = 1 + self.num_speculative_tokens
        self.use_flattening = not supports_native_decode(next_n)
        self._native = [L <= 1 or bool(supports_native_decode(L)) for L in range(next_n + 1)]
        self._require_uniform = not (self.use_flattening or self.supports_varlen)

        i32 = dict(dtype=torch.int32, device=dev)
        D = max(Tmax, S * next_n)
        self.decode_lens = torch.zeros(D, **i32)
        self.decode_seq_lens = torch.zeros(D, **i32)
        self.decode_indices = torch.zeros(D, **i32)
        self.expanded_seq_lens = torch.zeros(D, **i32)
        self.arange = torch.arange(D, **i32)
        self.expanded_block_table = torch.zeros(Tmax, self.block_table_width, **i32)
        self.compressed_slot_mapping = torch.full((Tmax,), -1, dtype=torch.int64, device=dev)
        self.compressed_seq_lens = torch.zeros(S, **i32)
        self.chunk_cu_seq_lens = torch.zeros(2 * S, **i32)
        self.chunk_cu_seqlen_ks = torch.zeros(Tmax, **i32)
        self.chunk_cu_seqlen_ke = torch.zeros(Tmax, **i32)
        self.chunk_token_to_seq = torch.zeros(self.max_prefill_buffer_size, **i32)
        self.schedule = None
        if decode_schedule_fn is not None:
            probe = decode_schedule_fn(torch.zeros(1, 1, **i32), self.storage_block_size)
            if not isinstance(probe, torch.Tensor) or probe.device != dev:
                raise ValueError(f"decode_schedule_fn must return a tensor on {dev}")
            self.schedule = torch.zeros_like(probe)

    # --- host part --------------------------------------------------------------------------------
    def _plan(self, batch):
        R, T_pad, qsl, q = _check_batch(batch, self.device, self.max_num_batched_tokens, self.max_num_seqs,
                                        self.block_table_width)
        split = nd, np_, ndt, npt = _split(batch, R, q, self.next_n, self._require_uniform)

        decode = None
        if nd:
            dl = q[:nd]
            L, Lmin = int(dl.max()), int(dl.min())
            native = self._require_uniform and L <= self.next_n and self._native[L]
            uniform = not native and not self.supports_varlen and Lmin == L and nd * L == ndt and ndt > 0
            decode = (L, Lmin, native, uniform)

        chunks = []
        if np_:
            ratio = self.compress_ratio
            seq_cpu = batch.seq_lens_cpu_upper_bound.tolist()
            comp = [s // ratio for s in seq_cpu] if ratio > 1 else seq_cpu
            specs = split_indexer_prefill_chunks(comp[nd:], q[nd:].tolist(), self.max_prefill_buffer_size,
                                                 self.max_logits_bytes, request_offset=nd)
            cu_off = t2s_off = 0
            prev = None
            for rs, qs in specs:
                start, end = rs.start, rs.stop
                total = sum(comp[start:end])
                if total <= 0:
                    continue
                if (start, end) != prev:
                    prev = (start, end)
                    cu_at, cu_off = cu_off, cu_off + end - start + 1
                    if t2s_off + total <= self.max_prefill_buffer_size:
                        t2s_at, t2s_off = t2s_off, t2s_off + total
                    else:
                        t2s_at = None          # allocate (see the class docstring)
                if cu_off > self.chunk_cu_seq_lens.shape[0]:
                    raise ValueError("query_start_loc_cpu: prefill chunks need more cu_seq_lens entries than "
                                     "2 * max_num_seqs")
                ks_at = int(qsl[start]) + qs.start - ndt
                chunks.append((start, end, qs.start, qs.stop, int(qsl[start]), total, comp[start:end], cu_at, t2s_at,
                               ks_at))
        return R, T_pad, split, decode, chunks

    # --- device part --------------------------------------------------------------------------------
    def build(self, batch) -> DeepseekV32IndexerMetadata:
        """Indexer metadata of one step (SPEC §3.6.2). `batch`: a BatchDescription (or any object with
        its attributes), ordered decodes first; never modified. Returns views of this builder's
        buffers (and of the batch's tensors)."""
        R, T_pad, (nd, np_, ndt, npt), decode_plan, chunk_plan = self._plan(batch)
        qsl, seq_lens, bt = batch.query_start_loc, batch.seq_lens, batch.block_table
        ratio = self.compress_ratio

        if ratio > 1:
            slot_mapping = get_compressed_slot_mapping(batch.num_actual_tokens, qsl, seq_lens, bt,
                                                       self.storage_block_size, ratio,
                                                       out=self.compressed_slot_mapping)
        else:
            slot_mapping = batch.slot_mapping

        prefill = None
        if np_:
            comp = seq_lens
            if ratio > 1:
                comp = torch.floor_divide(seq_lens, ratio, out=self.compressed_seq_lens[:R])
            chunks = []
            for start, end, qs0, qs1, base, total, comp_host, cu_at, t2s_at, ks_at in chunk_plan:
                rows = qs1 - qs0
                t2s = (self.chunk_token_to_seq[t2s_at:t2s_at + total] if t2s_at is not None
                       else torch.empty(total, dtype=torch.int32, device=self.device))
                chunks.append(fill_chunk(start, end, qs0, qs1, base, total, comp_host, qsl, seq_lens, comp, bt,
                                         ratio, qs0 > 0, 0, 1, 1,
                                         self.chunk_cu_seq_lens[cu_at:cu_at + end - start + 1],
                                         self.chunk_cu_seqlen_ks[ks_at:ks_at + rows],
                                         self.chunk_cu_seqlen_ke[ks_at:ks_at + rows], t2s))
            prefill = DeepseekV32IndexerPrefillMetadata(chunks)

        decode = None
        if nd:
            decode = self._decode(batch, nd, ndt, *decode_plan)
        return DeepseekV32IndexerMetadata(seq_lens=seq_lens, max_seq_len=batch.max_seq_len, slot_mapping=slot_mapping,
                                          num_decodes=nd, num_decode_tokens=ndt, num_prefills=np_,
                                          num_prefill_tokens=npt, decode=decode, prefill=prefill)

    def _decode(self, batch, nd: int, ndt: int, L: int, Lmin: int, native: bool, uniform: bool
                ) -> DeepSeekV32IndexerDecodeMetadata:
        qsl, seq_lens, bt = batch.query_start_loc, batch.seq_lens, batch.block_table
        ratio = self.compress_ratio
        divided = False
        if native:
            requires_padding = Lmin != L
            block_table, decode_lens = bt[:nd], self.decode_lens[:nd]
            if self.next_n > 1:
                # decode_lens and the (nd, L) context lengths, already divided by the ratio: one launch
                prepare_native_decode(qsl, seq_lens, self.decode_lens, self.decode_seq_lens, nd, L, max(ratio, 1))
                seq, in_buffer, divided = self.decode_seq_lens[:nd * L].view(nd, L), True, True
            else:
                torch.sub(qsl[1:nd + 1], qsl[:nd], out=self.decode_lens[:nd])
                seq, in_buffer = seq_lens[:nd], False
        else:
            requires_padding = False
            if uniform:
                prepare_uniform_decode(seq_lens, self.decode_seq_lens, bt, self.expanded_block_table,
                                       self.decode_lens, L, ndt)
            elif ndt:
                prepare_varlen_decode(qsl, seq_lens, bt, self.decode_seq_lens, self.expanded_block_table,
                                      self.decode_lens, self.decode_indices, nd, ndt)
            self.decode_seq_lens[ndt:].zero_()
            seq, in_buffer = self.decode_seq_lens[:ndt], True
            block_table, decode_lens = self.expanded_block_table[:ndt], self.decode_lens[:ndt]

        if ratio > 1 and not divided:
            if in_buffer:
                seq.floor_divide_(ratio)
            else:
                torch.floor_divide(seq, ratio, out=self.expanded_seq_lens[:nd])
                self.expanded_seq_lens[nd:ndt].zero_()
                seq = self.expanded_seq_lens[:ndt]
        if seq.dim() == 1:
            seq = seq.unsqueeze(1)
        schedule = None
        if self.decode_schedule_fn is not None:
            result = self.decode_schedule_fn(seq, self.storage_block_size)
            if result.shape != self.schedule.shape:
                raise ValueError(f"decode_schedule_fn returned shape {tuple(result.shape)}, expected "
                                 f"{tuple(self.schedule.shape)} (the probe's at construction)")
            schedule = self.schedule.copy_(result)
        return DeepSeekV32IndexerDecodeMetadata(
            block_table=block_table, seq_lens=seq, decode_lens=decode_lens, requires_padding=requires_padding,
            schedule_metadata=schedule, indices=self.decode_indices[:ndt] if self.supports_varlen else None)
