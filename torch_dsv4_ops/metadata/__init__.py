"""Host planners and the SWA / indexer metadata builders (SPEC §3.5, §3.6)."""
from .planners import (
    get_dspark_swa_index_width,
    get_max_prefill_buffer_size,
    get_prefill_chunk_plan,
    split_decodes_and_prefills,
    split_indexer_prefill_chunks,
)
from .types import (
    BatchDescription,
    DeepseekSparseSWAMetadata,
    DeepSeekV32IndexerDecodeMetadata,
    DeepseekV32IndexerMetadata,
    DeepseekV32IndexerPrefillChunkMetadata,
    DeepseekV32IndexerPrefillMetadata,
)
from .chunks import build_prefill_chunk_metadata
from .builders import IndexerMetadataBuilder, SWAMetadataBuilder
