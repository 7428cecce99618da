"""layout.py against SPEC §2's literal numbers, and platform.py's per-target tables."""
import pytest
import torch

from torch_dsv4_ops import layout, platform
from torch_dsv4_ops.platform import Target


def test_ds_mla_token_layout_numbers():
    assert (layout.NOPE_DIM, layout.ROPE_DIM, layout.QUANT_BLOCK, layout.NUM_QUANT_BLOCKS) == (448, 64, 64, 7)
    assert (layout.TOKEN_DATA_BYTES, layout.SCALE_BYTES, layout.TOKEN_BYTES) == (576, 8, 584)
    assert layout.INDEXER_TOKEN_BYTES == 132


def test_ds_mla_block_stride_worked_examples():
    """SPEC §2.1: bs 64 pads 37376 to 37440 = 65*576; bs 2 pads 1168 to 1728."""
    assert layout.ds_mla_block_bytes(64) == 37376 and layout.ds_mla_block_stride(64) == 37440
    assert layout.ds_mla_block_bytes(2) == 1168 and layout.ds_mla_block_stride(2) == 1728


def test_ds_mla_offsets_worked_examples():
    """SPEC §2.1: slot 70 (bs 64, stride 37440): data at 40896, scales at 74352; C128A slot 5 (bs 2,
    stride 1728): data at 4032, scales at 4616."""
    block, offset = divmod(70, 64)
    assert block * 37440 + layout.ds_mla_data_offset(64, offset) == 40896
    assert block * 37440 + layout.ds_mla_scale_offset(64, offset) == 74352
    block, offset = divmod(5, 2)
    assert block * 1728 + layout.ds_mla_data_offset(2, offset) == 4032
    assert block * 1728 + layout.ds_mla_scale_offset(2, offset) == 4616


def test_fp8_format_table_matches_torch():
    for fmt in layout.FP8_FORMATS:
        assert torch.finfo(fmt.dtype).max == fmt.max, fmt.name
        assert layout.FP8_BY_DTYPE[fmt.dtype] is fmt and layout.FP8_BY_CODE[fmt.code] is fmt
    assert layout.E4M3FNUZ.ue8m0_max == 224.0 and layout.E4M3FN.ue8m0_max == 448.0


@pytest.mark.parametrize("kv,cache,expected", [
    ("auto", torch.bfloat16, None), ("float", torch.float32, None), ("half", torch.float16, None),
    ("fp8", torch.uint8, layout.E4M3FN), ("fp8_e4m3", torch.float8_e4m3fnuz, layout.E4M3FNUZ),
    ("fp8_e5m2", torch.uint8, layout.E5M2), ("fp8_e5m2", torch.float8_e5m2, layout.E5M2),
])
def test_resolve_kv_cache_format(kv, cache, expected):
    assert layout.resolve_kv_cache_format(kv, cache) is expected


@pytest.mark.parametrize("kv,cache", [("fp4", torch.uint8), ("auto", torch.uint8), ("fp8", torch.bfloat16),
                                      ("fp8", torch.float8_e5m2), ("fp8_e5m2", torch.float8_e4m3fn),
                                      ("auto", torch.float8_e4m3fn)])
def test_resolve_kv_cache_format_rejects(kv, cache):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        layout.resolve_kv_cache_format(kv, cache)


def test_platform_e4m3_is_fnuz_only_on_gfx942():
    """SPEC R7."""
    assert platform.platform_e4m3(Target("hip", "gfx942", 64)) is layout.E4M3FNUZ
    for t in (Target("hip", "gfx950", 64), Target("cuda", 90), platform.INTERPRETER_TARGET):
        assert platform.platform_e4m3(t) is layout.E4M3FN


def test_target_capability_tables():
    sm80, sm89, sm90 = Target("cuda", 80), Target("cuda", 89), Target("cuda", 90)
    assert not platform.native_fp8(sm80, layout.E4M3FN) and platform.native_fp8(sm89, layout.E4M3FN)
    assert not any(platform.native_fp8(Target("cuda", a), layout.E4M3FNUZ) for a in (80, 89, 90, 100, 120))
    assert not platform.native_fp8(platform.INTERPRETER_TARGET, layout.E4M3FN)
    assert platform.fast_fp64(sm90) and platform.fast_fp64(sm80) and not platform.fast_fp64(sm89)
    assert platform.supports_pdl(sm90) and not platform.supports_pdl(sm89)
    assert not platform.supports_pdl(Target("hip", "gfx942", 64))


def test_num_warps_rules():
    assert platform.num_warps_for(Target("cuda", 90), 1024) == 4        # 8 elements per lane, 32 lanes
    assert platform.num_warps_for(Target("hip", "gfx942", 64), 1024) == 2   # 64-wide wavefronts
    assert platform.num_warps_for(Target("cuda", 90), 16) == 1
    assert platform.num_warps_for(Target("cuda", 90), 1 << 20) == 8
