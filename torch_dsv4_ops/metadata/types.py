"""The dataclasses of SPEC §3.4 and §3.6: the builders' input (`BatchDescription`) and their outputs.

Tensors named `*_cpu` live on the host; every other tensor lives on the device. The builders return
views of their persistent buffers (SPEC §3.6), so a field stays valid until the next `build`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .planners import get_prefill_chunk_plan as _get_prefill_chunk_plan


@dataclass
class BatchDescription:
    """One step's batch, ordered decodes first (SPEC §3.6). For vLLM's `CommonAttentionMetadata`,
    `block_table_tensor` is `block_table`; any object with these attributes works."""

    query_start_loc: torch.Tensor              # [R+1] int32, device
    query_start_loc_cpu: torch.Tensor          # [R+1] int32, CPU
    seq_lens: torch.Tensor                     # [R] int32, device (exact)
    seq_lens_cpu_upper_bound: torch.Tensor     # [R] int32, CPU, >= seq_lens (exact for prefills)
    block_table: torch.Tensor                  # [R, width] int32, device (this group's own table)
    slot_mapping: torch.Tensor                 # [T_pad] int64, device; negative = padding
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    positions: torch.Tensor | None = None      # [T_pad] int64 (C128A metadata)
    is_prefilling: torch.Tensor | None = None  # [R] bool, CPU
    causal: bool = True                        # False only for the DSpark draft block


@dataclass
class DeepseekSparseSWAMetadata:
    """What `SWAMetadataBuilder.build` returns (SPEC §3.6.1). T_pad = len(slot_mapping)."""

    block_table: torch.Tensor                              # [R, width] int32 (the batch's)
    slot_mapping: torch.Tensor                             # [T_pad] int64 (the batch's)
    block_size: int
    seq_lens: torch.Tensor | None = None                   # [R] int32
    query_start_loc: torch.Tensor | None = None            # [R+1] int32
    query_start_loc_cpu: torch.Tensor | None = None        # [R+1] int32, CPU

    is_valid_token: torch.Tensor | None = None             # [T_pad] bool
    token_to_req_indices: torch.Tensor | None = None       # [T_pad] int32
    decode_swa_indices: torch.Tensor | None = None         # [ndt, 1, decode_swa_width] int32
    decode_swa_lens: torch.Tensor | None = None            # [ndt] int32
    decode_swa_width: int = 0                              # window, or W_nc when non-causal (DSpark)
    prefill_swa_indices: torch.Tensor | None = None        # [npt, 1, window] int32 (global slots); None if npt = 0
    prefill_swa_lens: torch.Tensor | None = None           # [npt] int32; None if npt = 0

    num_decodes: int = 0
    num_prefills: int = 0
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    max_decode_query_len: int = 1

    prefill_seq_lens: torch.Tensor | None = None           # [np] int32 = seq_lens[nd:]
    prefill_seq_lens_cpu: torch.Tensor | None = None       # [np] int32, CPU = seq_lens_cpu_upper_bound[nd:]
    prefill_gather_lens: torch.Tensor | None = None        # [np] int32
    prefill_query_lens_cpu: torch.Tensor | None = None     # [np] int32, CPU
    prefill_window_size: int = 0
    prefill_max_model_len: int = 0
    prefill_max_num_batched_tokens: int = 0

    # per-step consumer plug points, fresh on each build (SPEC §3.6.1)
    flashinfer_sparse_index_cache: dict[str, Any] = field(default_factory=dict)
    scheduler_state: dict[str, Any] = field(default_factory=dict)

    def get_prefill_chunk_plan(self, compress_ratio: int, prefill_chunk_size: int = 4
                               ) -> list[tuple[int, int, int, int]]:
        """`get_prefill_chunk_plan` (SPEC §3.5) over this step's prefills: [(cs, ce, chunk_N, chunk_M)],
        `[]` without prefills."""
        if self.num_prefills == 0:
            return []
        return _get_prefill_chunk_plan(self.prefill_seq_lens_cpu, self.prefill_query_lens_cpu,
                                       self.prefill_window_size, self.prefill_max_model_len,
                                       self.prefill_max_num_batched_tokens, compress_ratio, prefill_chunk_size)


@dataclass
class DeepseekV32IndexerPrefillChunkMetadata:
    """One indexer prefill chunk (SPEC §3.4 `build_prefill_chunk_metadata`): requests
    [start, start + num_reqs), query rows [token_start, token_end) of the step. All tensors int32."""

    block_table: torch.Tensor                     # [num_reqs, width]
    cu_seqlen_ks: torch.Tensor                    # [token_end - token_start]; local row bounds under DCP
    cu_seqlen_ke: torch.Tensor                    # [token_end - token_start]
    cu_seq_lens: torch.Tensor                     # [num_reqs + 1]
    token_to_seq: torch.Tensor                    # [total_seq_lens]
    total_seq_lens: int
    token_start: int
    token_end: int
    num_reqs: int
    skip_kv_gather: bool = False
    local_cu_seq_lens: torch.Tensor | None = None  # [num_reqs + 1]; cu_seq_lens without DCP
    local_total_seq_lens: int = 0
    max_local_total_seq_lens: int = 0


@dataclass
class DeepseekV32IndexerPrefillMetadata:
    chunks: list[DeepseekV32IndexerPrefillChunkMetadata]


@dataclass
class DeepSeekV32IndexerDecodeMetadata:
    """Indexer decode metadata (SPEC §3.6.2 step 3). `seq_lens` is always 2-D int32: (B, L) on the
    native multi-token path, (B, 1) otherwise."""

    block_table: torch.Tensor                     # [B, width] int32
    seq_lens: torch.Tensor                        # [B, L] or [B, 1] int32
    decode_lens: torch.Tensor                     # [B] int32
    requires_padding: bool
    schedule_metadata: torch.Tensor | None
    global_seq_lens: torch.Tensor | None = None
    indices: torch.Tensor | None = None           # [ndt] int32 with supports_varlen, else None


@dataclass
class DeepseekV32IndexerMetadata:
    """What `IndexerMetadataBuilder.build` returns (SPEC §3.6.2 step 4)."""

    seq_lens: torch.Tensor                        # [R] int32 (the batch's)
    max_seq_len: int
    slot_mapping: torch.Tensor                    # [num_actual_tokens] int64 compressed slots, or the batch's
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode: DeepSeekV32IndexerDecodeMetadata | None = None
    prefill: DeepseekV32IndexerPrefillMetadata | None = None
