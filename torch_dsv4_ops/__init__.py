"""torch_dsv4_ops: DeepSeek-V4 attention plumbing as `torch.ops.dsv4.*` custom ops.

Importing the package registers every op; the host planners and metadata builders (plain Python
over the ops) are importable from here too. Each op has a Triton kernel (CUDA and ROCm), a
pure-torch CPU reference and a fake, so it runs eagerly, under torch.compile(fullgraph=True)
and in CUDA graphs. docs/ops/ specifies the behaviour of every op.
"""
from . import layout, platform
from .library import OPS, cpu_implementation
from .ops.cache import (
    reshape_and_cache_flash,
    reshape_and_cache_flash_diffkv,
    reshape_and_cache_flash_kv,
    triton_reshape_and_cache_flash,
    triton_reshape_and_cache_flash_diffkv,
)
from .ops.sparse_index import (
    build_c128a_topk_metadata,
    build_flashinfer_mixed_sparse_indices,
    combine_topk_swa_indices,
    compute_global_topk_indices_and_lens,
    fill_short_context_topk_indices,
)
from .ops.k_cache import (
    dequantize_and_gather_k_cache,
    quantize_and_insert_k_cache,
)
from .ops.attention import (
    chunked_prefill_paged_decode,
    context_attention_fwd,
)
from .ops.metadata import (
    compute_dspark_noncausal_swa_indices_and_lens,
    compute_prefill_gather_lens,
    compute_swa_indices_and_lens,
    fill_prefill_chunk_metadata,
    get_compressed_slot_mapping,
    prepare_native_decode,
    prepare_swa_decode,
    prepare_token_metadata,
    prepare_uniform_decode,
    prepare_varlen_decode,
)
from .ops.indexer import (
    cp_gather_indexer_k_quant_cache,
    indexer_k_quant_and_cache,
)
from .ops.indexer_q import (
    fused_indexer_q_rope_quant,
    pack_seq_triton,
    unpack_seq_triton,
)
from .ops.mqa_logits import (
    fp8_fp4_mqa_logits,
    fp8_fp4_paged_mqa_logits,
    get_paged_mqa_logits_metadata,
)
from .ops.topk import (
    top_k_per_row_decode,
    top_k_per_row_prefill,
)
from .ops.sparse_mla import (
    flash_mla_sparse_fwd,
    flash_mla_with_kvcache,
    get_mla_metadata,
    sparse_mla_workspace_size,
)
from .metadata import (
    BatchDescription,
    DeepseekSparseSWAMetadata,
    DeepSeekV32IndexerDecodeMetadata,
    DeepseekV32IndexerMetadata,
    DeepseekV32IndexerPrefillChunkMetadata,
    DeepseekV32IndexerPrefillMetadata,
    IndexerMetadataBuilder,
    SWAMetadataBuilder,
    build_prefill_chunk_metadata,
    get_dspark_swa_index_width,
    get_max_prefill_buffer_size,
    get_prefill_chunk_plan,
    split_decodes_and_prefills,
    split_indexer_prefill_chunks,
)

__version__ = "0.1.0"

__all__ = [
    "OPS", "cpu_implementation", "layout", "platform",
    "reshape_and_cache_flash", "reshape_and_cache_flash_diffkv", "reshape_and_cache_flash_kv",
    "triton_reshape_and_cache_flash", "triton_reshape_and_cache_flash_diffkv",
    "quantize_and_insert_k_cache", "dequantize_and_gather_k_cache",
    "build_c128a_topk_metadata", "build_flashinfer_mixed_sparse_indices", "combine_topk_swa_indices",
    "compute_global_topk_indices_and_lens", "fill_short_context_topk_indices",
    "get_compressed_slot_mapping", "compute_swa_indices_and_lens", "compute_dspark_noncausal_swa_indices_and_lens",
    "compute_prefill_gather_lens", "prepare_uniform_decode", "prepare_varlen_decode", "fill_prefill_chunk_metadata",
    "prepare_token_metadata", "prepare_swa_decode", "prepare_native_decode",
    "context_attention_fwd", "chunked_prefill_paged_decode",
    "flash_mla_with_kvcache", "flash_mla_sparse_fwd", "get_mla_metadata", "sparse_mla_workspace_size",
    "indexer_k_quant_and_cache", "cp_gather_indexer_k_quant_cache",
    "fused_indexer_q_rope_quant", "pack_seq_triton", "unpack_seq_triton",
    "fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "get_paged_mqa_logits_metadata",
    "top_k_per_row_prefill", "top_k_per_row_decode",
    "split_decodes_and_prefills", "split_indexer_prefill_chunks", "get_prefill_chunk_plan",
    "get_dspark_swa_index_width", "get_max_prefill_buffer_size", "build_prefill_chunk_metadata",
    "BatchDescription", "DeepseekSparseSWAMetadata", "DeepSeekV32IndexerDecodeMetadata", "DeepseekV32IndexerMetadata",
    "DeepseekV32IndexerPrefillChunkMetadata", "DeepseekV32IndexerPrefillMetadata", "SWAMetadataBuilder",
    "IndexerMetadataBuilder",
]
