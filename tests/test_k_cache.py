"""quantize_and_insert_k_cache and dequantize_and_gather_k_cache (SPEC §2.1, §3.2, §4 a, b, d, h, i, l, §5)."""
import contextlib
import math
from fractions import Fraction

import pytest
import torch

import torch_dsv4_ops as d
from torch_dsv4_ops import layout, platform
from torch_dsv4_ops.kernels import k_cache as kernels
from torch_dsv4_ops.reference import k_cache as reference
from torch_dsv4_ops.testing import (assert_bitwise_equal, changed_mask, check_compile, check_cuda_graph,
                                    nonzero_share, patched_constants, random_bytes_, run_opcheck, sync_debug_error,
                                    triton_cache_entries)

INSERT = torch.ops.dsv4.quantize_and_insert_k_cache.default
GATHER = torch.ops.dsv4.dequantize_and_gather_k_cache.default
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
INT32_MIN = -2**31
BF16_MAX = torch.finfo(torch.bfloat16).max
FMTS = {False: layout.E4M3FN, True: layout.E4M3FNUZ}


# --- helpers ------------------------------------------------------------------------------------
def make_cache(base: torch.Tensor, nb: int, bs: int, stride: int, form: str) -> torch.Tensor:
    """A cache view into a flat byte buffer: "2d" [nb, stride] or "3d" [nb, bs, 584] with page stride."""
    pages = base[: nb * stride].view(nb, stride)
    if form == "2d":
        return pages
    return pages[:, : layout.ds_mla_block_bytes(bs)].view(nb, bs, layout.TOKEN_BYTES)


def oracle_exponent(a: float, fmt: layout.Fp8Format) -> int:
    """Independent oracle: the smallest integer e with FP8_MAX * 2**e >= max(a, fp32(1e-4)), exact."""
    floor = Fraction(torch.tensor(layout.UE8M0_FLOOR, dtype=torch.float32).item())
    a = max(Fraction(a), floor)
    e = math.frexp(float(a))[1] - 12
    while Fraction(fmt.ue8m0_max) * Fraction(2) ** e < a:
        e += 1
    assert not Fraction(fmt.ue8m0_max) * Fraction(2) ** (e - 1) >= a
    return e


def oracle_token(row: torch.Tensor, fmt: layout.Fp8Format) -> tuple[list, list, list]:
    """Independent per-token oracle (Python floats, the oracle exponent, torch's fp8 cast):
    (448 data codes, 128 RoPE bytes, 8 scale bytes)."""
    x = row.float()
    codes, scales = [], []
    for j in range(layout.NUM_QUANT_BLOCKS):
        blk = x[j * layout.QUANT_BLOCK:(j + 1) * layout.QUANT_BLOCK]
        finite = [abs(v) for v in blk.tolist() if not math.isnan(v)]
        amax = min(max(finite, default=0.0), torch.finfo(torch.float32).max)
        e = oracle_exponent(amax, fmt)
        scaled = (blk.double() * 2.0 ** -e).float()
        cast = scaled.clamp(-fmt.ue8m0_max, fmt.ue8m0_max).to(fmt.dtype).view(torch.uint8).tolist()
        nan = 0x80 if fmt is layout.E4M3FNUZ else 0x7F                 # one NaN code, any sign
        codes += [nan if math.isnan(v) else c for v, c in zip(scaled.tolist(), cast)]
        scales.append(min(max(e + layout.UE8M0_BIAS, 0), 255))
    rope = row[layout.NOPE_DIM:].contiguous().view(torch.uint8).tolist()
    return codes, rope, scales + [0]


def token_spans(bs: int, off: int):
    """(data byte range, scale byte range) of a token inside its page."""
    data = layout.ds_mla_data_offset(bs, off)
    scale = layout.ds_mla_scale_offset(bs, off)
    return (data, data + layout.TOKEN_DATA_BYTES), (scale, scale + layout.SCALE_BYTES)


def special_rows() -> torch.Tensor:
    """Rows of several magnitudes, fp8 rounding boundaries, amax exactly FP8_MAX*2**j (both
    flavours), zeros, NaN/inf and max bf16."""
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(layout.HEAD_DIM, generator=g) * m for m in (1e-3, 1.0, 100.0, 1e4)]
    r = torch.zeros(layout.HEAD_DIM)       # block 0: amax 448 (e = 0 OCP) with RNE midpoints
    r[:10] = torch.tensor([448.0, 1.0625, 1.1875, 17.0, 19.0, 232.0, 440.0, 2.0**-10, 3 * 2.0**-10, -1.0625])
    r[64:70] = torch.tensor([450.0, 1.0, -3.0, 5.0, 0.5, 2.0**-9])   # block 1: 450 (449 is not a bf16): e = 1 (§4 d)
    r[128] = 224.0                          # block 2: FNUZ FP8_MAX exactly
    r[192:194] = torch.tensor([224.0 * 2**5, -17.0])
    r[256] = -448.0 * 2**-20
    r[320], r[384] = 1e-4, 448.0 * 2**100
    rows.append(r)
    rows.append(torch.zeros(layout.HEAD_DIM))
    nan = torch.randn(layout.HEAD_DIM, generator=g)
    nan[3], nan[70], nan[130], nan[200], nan[201] = float("nan"), float("inf"), -float("inf"), float("nan"), float("inf")
    nan[260] = BF16_MAX
    nan[330] = -float("nan")
    nan[460] = float("nan")                 # RoPE NaN: copied bit for bit
    rows.append(nan)
    return torch.stack(rows).to(torch.bfloat16)


# --- literal worked example (SPEC §2.1) ---------------------------------------------------------
def _example_k(device):
    k = torch.zeros(1, layout.HEAD_DIM, dtype=torch.bfloat16, device=device)
    k[0, 0], k[0, 1], k[0, 2], k[0, 448] = 1.0, 0.1, -0.3, 1.5
    return k


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize("use_fnuz", [False, True])
def test_worked_example(device, impl, use_fnuz):
    if impl == "reference" and device.type != "cpu":
        pytest.skip("the reference is the CPU implementation")
    def ctx():
        return d.cpu_implementation("reference") if impl == "reference" else contextlib.nullcontext()
    k = _example_k(device)
    assert k[0, :3].tolist() == [1.0, 0.10009765625, -0.30078125]
    cache = torch.full((3, 37440), 0xA5, dtype=torch.uint8, device=device)
    with ctx():
        d.quantize_and_insert_k_cache(k, cache, torch.tensor([70], device=device), 64, True, use_fnuz)
    flat = cache.cpu().view(-1)
    assert flat[40896:40899].tolist() == [0x78, 0x5D, 0xEA]
    assert flat[40899:40896 + 448].tolist() == [0] * 445
    assert flat[41344:41346].tolist() == [0xC0, 0x3F] and flat[41346:41472].tolist() == [0] * 126
    if use_fnuz:
        assert flat[74352:74360].tolist() == [120] + [106] * 6 + [0]
    else:
        assert flat[74352:74360].tolist() == [0x77] + [0x69] * 6 + [0]
        assert [119, 105] == [0x77, 0x69]
    written = torch.zeros_like(flat, dtype=torch.bool)
    written[40896:41472] = True
    written[74352:74360] = True
    assert (flat[~written] == 0xA5).all(), "bytes of other tokens and the padding are untouched"
    # dequantisation: 0.1015625 and -0.3125, RoPE 1.5 exact
    out = torch.full((1, 3, layout.HEAD_DIM), 7.0, dtype=torch.bfloat16, device=device)
    with ctx():
        d.dequantize_and_gather_k_cache(out, cache, torch.tensor([71], dtype=torch.int32, device=device),
                                        torch.tensor([1], dtype=torch.int32, device=device),
                                        torch.tensor([[5, 1]], dtype=torch.int32, device=device), 64, 2, use_fnuz)
    row = out[0, 2].cpu()
    assert row[:3].tolist() == [1.0, 0.1015625, -0.3125] and row[448].item() == 1.5
    assert (row[3:448] == 0).all() and (row[449:] == 0).all()
    assert (out[0, :2].cpu() == 7.0).all()


def test_worked_example_c128a(device):
    """bs 2, block_stride 1728: slot 5 has its data at 4032 and its scales at 4616."""
    assert layout.ds_mla_block_stride(2) == 1728 and layout.ds_mla_block_stride(64) == 37440
    cache = torch.full((4, 1728), 0xA5, dtype=torch.uint8, device=device)
    d.quantize_and_insert_k_cache(_example_k(device), cache, torch.tensor([5], device=device), 2)
    flat = cache.cpu().view(-1)
    assert flat[4032:4035].tolist() == [0x78, 0x5D, 0xEA] and flat[4032 + 448:4032 + 450].tolist() == [0xC0, 0x3F]
    assert flat[4616:4624].tolist() == [0x77] + [0x69] * 6 + [0]
    changed = (flat != 0xA5).nonzero().flatten()
    assert changed.min() >= 4032 and changed.max() < 4624
    assert flat[4032 + 576:4616].eq(0xA5).all()


# --- UE8M0 against an independent oracle --------------------------------------------------------
def _ue8m0_values(fmt):
    vals = []
    for j in range(-30, 121):
        a = fmt.ue8m0_max * 2.0**j
        if a > BF16_MAX:
            continue
        b = torch.tensor([a], dtype=torch.bfloat16)
        up, down = (b.view(torch.int16) + 1).view(torch.bfloat16), (b.view(torch.int16) - 1).view(torch.bfloat16)
        vals += [b.item(), up.item(), down.item()]
    vals += [0.0, 1e-4, 9.99e-5, 1.0001e-4, BF16_MAX, 2.0**-133]
    return vals


@pytest.mark.parametrize("use_fnuz", [False, True])
def test_ue8m0_reference_matches_fraction_oracle(use_fnuz):
    fmt = FMTS[use_fnuz]
    vals = [v for v in _ue8m0_values(fmt) if math.isfinite(v)]
    a = torch.tensor(vals, dtype=torch.float32)
    got = reference.ue8m0_exponent(reference.block_amax(a[:, None]), fmt).tolist()
    expected = [oracle_exponent(v, fmt) for v in vals]
    assert got == expected
    # literal anchors: 448 -> 0, 449 -> 1 (§4 d), the floor -> -22 (OCP) / -21 (FNUZ)
    lit = reference.ue8m0_exponent(torch.tensor([448.0, 449.0, 1e-4, 224.0, 225.0]), fmt).tolist()
    assert lit == ([0, 1, -22, -1, 0] if not use_fnuz else [1, 2, -21, 0, 1])
    byte = [min(max(e + 127, 0), 255) for e in got]
    lo, hi = (105, 247) if not use_fnuz else (106, 248)
    assert min(byte) == lo and max(byte) == hi


@pytest.mark.parametrize("use_fnuz", [False, True])
def test_ue8m0_kernel_bytes_match_oracle(device, use_fnuz):
    """The op's scale bytes for a = FP8_MAX*2**j (j in [-30, 120], finite in bf16) and their bf16
    neighbours, one value per quant block, equal the oracle's e + 127."""
    fmt = FMTS[use_fnuz]
    vals = _ue8m0_values(fmt)
    n = -(-len(vals) // layout.NUM_QUANT_BLOCKS)
    vals += [0.0] * (n * layout.NUM_QUANT_BLOCKS - len(vals))
    k = torch.zeros(n, layout.HEAD_DIM)
    v = torch.tensor(vals).view(n, layout.NUM_QUANT_BLOCKS)
    k[:, :layout.NOPE_DIM].view(n, layout.NUM_QUANT_BLOCKS, layout.QUANT_BLOCK)[:, :, 5] = v
    k[:, :layout.NOPE_DIM].view(n, layout.NUM_QUANT_BLOCKS, layout.QUANT_BLOCK)[:, :, 9] = -v / 3
    k = k.to(torch.bfloat16)
    bs = 4
    nb = -(-n // bs)
    cache = torch.zeros(nb, layout.ds_mla_block_bytes(bs), dtype=torch.uint8, device=device)
    d.quantize_and_insert_k_cache(k.to(device), cache, torch.arange(n, device=device), bs, True, use_fnuz)
    pages = cache.cpu()
    for t in range(n):
        _, (s0, s1) = token_spans(bs, t % bs)
        got = pages[t // bs, s0:s1].tolist()
        expected = [oracle_exponent(k[t, 64 * j + 5].float().abs().item(), fmt) + 127
                    for j in range(layout.NUM_QUANT_BLOCKS)] + [0]
        assert got == expected, (t, got, expected)


# --- insert exactness sweep ---------------------------------------------------------------------
def _insert_case(bs, padded, form, use_fnuz, seed, slot_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    rows = special_rows()
    n = rows.shape[0] + 3
    k = torch.cat([rows, (torch.randn(4, layout.HEAD_DIM, generator=g) * 3).to(torch.bfloat16)])  # N_k = N + 1
    nb = max(3, -(-(n + 2) // bs))
    stride = layout.ds_mla_block_stride(bs) if padded else layout.ds_mla_block_bytes(bs)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    hostile = [-2, INT64_MIN, nb * bs] if slot_dtype == torch.int64 else [-2, INT32_MIN, nb * bs]
    slots[torch.randperm(n, generator=g)[:3]] = torch.tensor(hostile)
    base = random_bytes_(torch.empty(nb * stride, dtype=torch.uint8), g)
    return k, slots.to(slot_dtype), base, nb, stride


@pytest.mark.parametrize("use_fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("form", ["2d", "3d"])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("bs", [2, 16, 64])
def test_insert_exact(device, bs, padded, form, use_fnuz):
    seed = bs * 7 + padded * 3 + (form == "3d") + 11 * use_fnuz
    k, slots, base, nb, stride = _insert_case(bs, padded, form, use_fnuz, seed,
                                              torch.int32 if seed % 2 else torch.int64)
    dev_base = base.clone().to(device)
    d.quantize_and_insert_k_cache(k.to(device), make_cache(dev_base, nb, bs, stride, form), slots.to(device), bs,
                                  True, use_fnuz)
    ref_base = base.clone()
    reference.quantize_and_insert_k_cache(k, make_cache(ref_base, nb, bs, stride, form), slots, bs, True, use_fnuz)
    got = dev_base.cpu()
    assert_bitwise_equal(got, ref_base, "whole allocation, kernel vs reference")
    # independent oracle: written tokens hold the oracle's bytes, every other byte its sentinel
    fmt = FMTS[use_fnuz]
    pages = got.view(nb, stride)
    expected = base.clone().view(nb, stride)
    for t, s in enumerate(slots.tolist()):
        if not 0 <= s < nb * bs:
            continue
        codes, rope, scales = oracle_token(k[t], fmt)
        (d0, d1), (s0, s1) = token_spans(bs, s % bs)
        expected[s // bs, d0:d1] = torch.tensor(codes + rope, dtype=torch.uint8)
        expected[s // bs, s0:s1] = torch.tensor(scales, dtype=torch.uint8)
    assert_bitwise_equal(pages, expected, "whole allocation, kernel vs independent oracle")
    assert nonzero_share(pages) > 0.5


@pytest.mark.parametrize("use_fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("tile", [t for _, t in kernels.INSERT_TILES])
def test_insert_several_tokens_per_program(device, tile, use_fnuz):
    """A large-call tile (several tokens per program, INSERT_TILES) on a small call: a token count that is not
    a multiple of it (a part-filled last program), hostile slots among the tokens, bit-exact."""
    from torch_dsv4_ops.ops import k_cache as ops_k_cache

    with patched_constants(kernels, [ops_k_cache._INSERT_PLANS], INSERT_TILES=((0, tile),)):
        k, slots, base, nb, stride = _insert_case(16, True, "2d", use_fnuz, 5 + use_fnuz)
        if slots.shape[0] % tile == 0:
            slots = slots[:-1]
        assert kernels.insert_tokens(slots.shape[0]) == tile and (slots < 0).any()
        dev_base = base.clone().to(device)
        d.quantize_and_insert_k_cache(k.to(device), make_cache(dev_base, nb, 16, stride, "2d"), slots.to(device),
                                      16, True, use_fnuz)
        ref_base = base.clone()
        reference.quantize_and_insert_k_cache(k, make_cache(ref_base, nb, 16, stride, "2d"), slots, 16, True,
                                              use_fnuz)
        assert_bitwise_equal(dev_base.cpu(), ref_base, "whole allocation, kernel vs reference")


def test_insert_nan_inf_documented_result(device):
    """NaN is left out of amax and stored as the positive NaN code; inf counts as the largest fp32 (byte
    247 OCP / 248 FNUZ) and saturates to +-FP8_MAX; max bf16 gives byte 247 too (docs/ops/k_cache.md)."""
    k = torch.zeros(2, layout.HEAD_DIM)
    k[:, 64], k[:, 65], k[:, 66] = float("inf"), -float("inf"), 1.0
    k[:, 128] = BF16_MAX
    k = k.to(torch.bfloat16)
    k[:, 1] = 2.0
    k[:, 0] = torch.tensor(0x7FC0, dtype=torch.int16).view(torch.bfloat16)         # +NaN
    k[:, 2] = torch.tensor(-64, dtype=torch.int16).view(torch.bfloat16)            # 0xFFC0: -NaN
    for use_fnuz, nan_pos, inf_code, byte_inf in ((False, 0x7F, 0x7E, 247), (True, 0x80, 0x7E, 248)):
        cache = torch.zeros(1, layout.ds_mla_block_bytes(2), dtype=torch.uint8, device=device)
        d.quantize_and_insert_k_cache(k.to(device), cache, torch.tensor([0, 1], device=device), 2, True, use_fnuz)
        c = cache.cpu()[0]
        assert (k[0, 2].view(torch.int16) < 0).item()              # a NaN with the sign bit set ...
        assert c[0].item() == nan_pos and c[2].item() == nan_pos   # ... is stored as the positive NaN code too
        assert c[1].item() == 0x78      # 2.0 * 2**-e: OCP 256 (e = -7), FNUZ 128 (e = -6)
        assert c[64].item() == inf_code and c[65].item() == inf_code | 0x80 and c[66].item() == 0
        scales = c[2 * layout.TOKEN_DATA_BYTES:2 * layout.TOKEN_DATA_BYTES + 8].tolist()
        assert scales[1] == byte_inf and scales[2] == byte_inf
        assert scales[0] == (127 - 7 if not use_fnuz else 127 - 6)


def test_insert_hostile_slots_write_nothing(device):
    nb, bs = 2, 16
    base = torch.full((nb, layout.ds_mla_block_bytes(bs)), 0x5A, dtype=torch.uint8)
    k = torch.randn(5, layout.HEAD_DIM).to(torch.bfloat16)
    for slots in (torch.tensor([-1, -2, INT64_MIN, nb * bs, INT64_MAX]),
                  torch.tensor([-1, -2, INT32_MIN, nb * bs, 2**31 - 1], dtype=torch.int32)):
        cache = base.clone().to(device)
        d.quantize_and_insert_k_cache(k.to(device), cache, slots.to(device), bs)
        assert torch.equal(cache.cpu(), base)


def test_insert_strided_inputs(device):
    """k with a padded row stride, slot_mapping with stride 2, N_k > N, a cache slice of a bigger buffer."""
    g = torch.Generator().manual_seed(9)
    bs, nb = 16, 3
    big = (torch.randn(9, 700, generator=g) * 5).to(torch.bfloat16)
    k = big[:, 100:100 + layout.HEAD_DIM]
    slots = torch.randperm(nb * bs, generator=g)[:16].view(8, 2)[:, 0]
    base = random_bytes_(torch.empty(nb + 1, layout.ds_mla_block_stride(bs), dtype=torch.uint8), g)
    dev = base.clone().to(device)
    d.quantize_and_insert_k_cache(k.to(device), dev[1:], slots.to(device), bs)
    ref = base.clone()
    reference.quantize_and_insert_k_cache(k, ref[1:], slots, bs)
    assert_bitwise_equal(dev.cpu(), ref, "strided inputs")


# --- round trip bounds --------------------------------------------------------------------------
@pytest.mark.parametrize("use_fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("n", [1, 4, 8, 17])
def test_round_trip_bounds(device, n, use_fnuz):
    g = torch.Generator().manual_seed(n)
    bs = 16 if n % 2 else 64
    mags = torch.tensor([1e-3, 1.0, 100.0])
    rows = torch.randn(n, layout.HEAD_DIM, generator=g)
    const = torch.randint(0, 3, (n,), generator=g)
    signs = torch.randint(0, 2, (n, layout.HEAD_DIM), generator=g) * 2 - 1
    rows = torch.where((torch.arange(n) % 2 == 0)[:, None], signs * mags[const][:, None], rows)
    k = rows.to(torch.bfloat16)
    nb = -(-n // bs) + 1
    cache = torch.zeros(nb, layout.ds_mla_block_stride(bs), dtype=torch.uint8, device=device)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    d.quantize_and_insert_k_cache(k.to(device), cache, slots.to(device), bs, True, use_fnuz)
    # a one-request block table that maps position p to slot p (identity), then gather the slots
    table = torch.arange(nb, dtype=torch.int32)[None]
    full = torch.zeros(1, nb * bs, layout.HEAD_DIM, dtype=torch.bfloat16, device=device)
    d.dequantize_and_gather_k_cache(full, cache, torch.tensor([nb * bs], dtype=torch.int32, device=device), None,
                                    table.to(device), bs, 0, use_fnuz)
    out = full.cpu()[0, slots]
    x, xh = k.float(), out.float()
    assert torch.equal(out[:, layout.NOPE_DIM:].view(torch.int16), k[:, layout.NOPE_DIM:].view(torch.int16))
    fmt = FMTS[use_fnuz]
    bound_mul = 16 if not use_fnuz else 8
    xb = x[:, :layout.NOPE_DIM].view(n, layout.NUM_QUANT_BLOCKS, layout.QUANT_BLOCK)
    eb = xh[:, :layout.NOPE_DIM].view(n, layout.NUM_QUANT_BLOCKS, layout.QUANT_BLOCK)
    for t in range(n):
        for j in range(layout.NUM_QUANT_BLOCKS):
            scale = 2.0 ** oracle_exponent(xb[t, j].abs().max().item(), fmt)
            assert (xb[t, j] - eb[t, j]).abs().max().item() <= bound_mul * scale
    big = x.abs() > 0.01
    big[:, layout.NOPE_DIM:] = False
    assert ((xh - x).abs()[big] / x.abs()[big]).max().item() < 0.15


# --- gather -------------------------------------------------------------------------------------
class GatherCase:
    """A cache written (by the reference writer) with one known K row per (request, position), random
    physical blocks, -10**6 in unused table entries, random bytes everywhere else."""

    def __init__(self, seq, bs=64, use_fnuz=False, seed=0, form="2d", padded=True, table_dtype=torch.int32,
                 extra_cols=1):
        g = torch.Generator().manual_seed(seed)
        self.seq, self.bs, self.use_fnuz = seq, bs, use_fnuz
        blocks = [-(-max(s, 0) // bs) for s in seq]
        self.nb = sum(blocks) + 2
        self.stride = layout.ds_mla_block_stride(bs) if padded else layout.ds_mla_block_bytes(bs)
        self.base = random_bytes_(torch.empty(self.nb * self.stride, dtype=torch.uint8), g)
        self.cache = make_cache(self.base, self.nb, bs, self.stride, form)
        perm = torch.randperm(self.nb, generator=g).tolist()
        width = max(blocks) + extra_cols
        self.table = torch.full((len(seq) + 1, width), -10**6, dtype=table_dtype)
        self.k = {}
        for r, s in enumerate(seq):
            for c in range(blocks[r]):
                self.table[r, c] = perm.pop()
            if s <= 0:
                continue
            rows = (torch.randn(s, layout.HEAD_DIM, generator=g) * (r + 1)).to(torch.bfloat16)
            slots = torch.tensor([int(self.table[r, p // bs]) * bs + p % bs for p in range(s)])
            reference.quantize_and_insert_k_cache(rows, self.cache, slots, bs, True, use_fnuz)
            self.k[r] = rows
        self.seq_t = torch.tensor(seq, dtype=torch.int32)

    def expected_row(self, r, p):
        """Independent of the gather: quantise and dequantise the K row written at position p."""
        data, scales = reference.quantize_rows(self.k[r][p:p + 1], FMTS[self.use_fnuz])
        return reference.dequantize_rows(data, scales, FMTS[self.use_fnuz])[0]

    def run(self, device, out, gather_lens, offset, table=None):
        out_dev = out.clone().to(device)
        gl = None if gather_lens is None else torch.tensor(gather_lens, dtype=torch.int32).to(device)
        d.dequantize_and_gather_k_cache(out_dev, self.cache.to(device), self.seq_t.to(device), gl,
                                        (self.table if table is None else table).to(device), self.bs, offset,
                                        self.use_fnuz)
        ref = out.clone()
        reference.dequantize_and_gather_k_cache(ref, self.cache, self.seq_t, None if gl is None else gl.cpu(),
                                                self.table if table is None else table, self.bs, offset,
                                                self.use_fnuz)
        assert_bitwise_equal(out_dev.cpu(), ref, "gather, kernel vs reference")
        return out_dev.cpu()


def _poisoned_out(r, w):
    return random_bytes_(torch.empty(r, w, layout.HEAD_DIM, dtype=torch.bfloat16), torch.Generator().manual_seed(w))


@pytest.mark.parametrize("use_fnuz", [False, True], ids=["ocp", "fnuz"])
def test_gather_example_whole_sequences(device, use_fnuz):
    """seq = [9, 23, 7], gather_lens None, offset 0: rows 0..seq-1 receive positions 0..seq-1."""
    case = GatherCase([9, 23, 7], bs=64, use_fnuz=use_fnuz, seed=1)
    out = _poisoned_out(3, 26)
    got = case.run(device, out, None, 0)
    for r, s in enumerate([9, 23, 7]):
        for i in range(s):
            assert_bitwise_equal(got[r, i], case.expected_row(r, i), f"req {r} row {i}")
        assert_bitwise_equal(got[r, s:], out[r, s:], f"req {r} rows past seq untouched")


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("form", ["2d", "3d"])
def test_gather_example_window_offset(device, table_dtype, form):
    """seq = [19, 8, 257], gather = [6, 8, 129], offset 5, W = offset + max_gather + 3 = 137:
    request 0 rows 5..10 <- positions 13..18, request 1 rows 5..12 <- 0..7, request 2 rows
    5..133 <- 128..256; every other row untouched."""
    case = GatherCase([19, 8, 257], bs=64, seed=2, form=form, table_dtype=table_dtype, padded=form == "2d")
    W = 5 + 129 + 3
    assert W == 137
    out = _poisoned_out(3, W)
    got = case.run(device, out, [6, 8, 129], 5)
    expect = out.clone()
    for r, rows, first in ((0, range(5, 11), 13), (1, range(5, 13), 0), (2, range(5, 134), 128)):
        for i, row in enumerate(rows):
            expect[r, row] = case.expected_row(r, first + i)
    assert_bitwise_equal(got, expect, "literal rows")


def test_gather_hostile(device):
    """Table entries < 0 / >= num_blocks / INT32_MIN give zero rows; gather_lens > seq_lens gives
    zeros for the negative positions; rows past out's width are skipped; positions past a table's
    columns give zero rows; offset >= W writes nothing; negative lengths write nothing."""
    bs = 16
    case = GatherCase([40, 20, 5], bs=bs, seed=3, extra_cols=2)
    table = case.table.clone()
    table[0, 1] = case.nb            # positions 16..31 of request 0: past the cache
    table[1, 0] = INT32_MIN          # positions 0..15 of request 1
    table[0, 2] = -1                 # positions 32..39
    out = _poisoned_out(4, 12)
    # request 0: gl 30 -> positions 10..39, rows 2.. only up to W = 12 -> positions 10..19
    # request 1: gl 25 > seq 20 -> positions -5..19: rows 2..6 zeros, 7..11 -> positions 0..4 (invalid block: zeros)
    # request 2: gl -3 -> nothing
    got = case.run(device, out, [30, 25, -3], 2, table=table)
    expect = out.clone()
    for i, p in enumerate(range(10, 20)):
        expect[0, 2 + i] = case.expected_row(0, p) if p < 16 else 0
    expect[1, 2:12] = 0
    assert_bitwise_equal(got, expect, "hostile")
    # offset at / past W: nothing written; R rows of out beyond seq_lens untouched (out has 4 rows, R = 3)
    for offset in (12, 40):
        assert_bitwise_equal(case.run(device, out, [30, 25, 3], offset, table=table), out, f"offset {offset}")
    # a table narrower than the sequence: request 0's positions 32..39 lie past its 2 columns (zeros)
    narrow = table[:, :2].contiguous()
    got = case.run(device, out, [10, 0, 0], 2, table=narrow)     # request 0 rows 2..11 <- positions 30..39
    assert_bitwise_equal(got[0, 2:12], torch.zeros(10, layout.HEAD_DIM, dtype=torch.bfloat16), "past the table")
    assert_bitwise_equal(got[1:], out[1:], "gather_lens 0: nothing")
    # negative seq_lens with gather_lens None: nothing
    case.seq_t = torch.tensor([-4, 0, 5], dtype=torch.int32)
    got = case.run(device, out, None, 0, table=table)
    assert_bitwise_equal(got[:2], out[:2], "negative/zero lengths")
    assert_bitwise_equal(got[3], out[3], "row past R")


def test_gather_programs_walk_several_steps(device):
    """Wide outputs (more than NARROW_WIDTH rows: BLOCK_T rows a step) on at most 2 programs a request, so that each
    program walks many steps with the next step's table entries loaded ahead of its stores: an invalid table entry
    mid-walk, gather lengths that end inside a step, an offset; bit-exact with the reference (`GatherCase.run`)."""
    from torch_dsv4_ops.ops import k_cache as ops_k_cache

    with patched_constants(kernels, [ops_k_cache._GATHER_PLANS], MAX_WORKERS=2):
        width = kernels.NARROW_WIDTH + 37
        target = platform.target_for(torch.device(device))
        assert kernels.gather_workers(width, target) == 2
        assert width > 4 * kernels.gather_block_t(width, target)
        case = GatherCase([width + 20, 301], bs=16, seed=9)
        table = case.table.clone()
        table[0, 7] = -1                 # positions 112..127 of request 0: zero rows
        got = case.run(device, _poisoned_out(2, width), [width - 3, 301], 3, table=table)
        assert_bitwise_equal(got[0, 3 + 112 - 23], torch.zeros(layout.HEAD_DIM, dtype=torch.bfloat16), "bad entry")


def test_gather_table_width_zero_and_empty(device):
    case = GatherCase([3, 2], bs=2, seed=4)
    out = _poisoned_out(2, 4)
    got = case.run(device, out, None, 1, table=torch.empty(2, 0, dtype=torch.int32))
    expect = out.clone()
    expect[0, 1:4] = 0
    expect[1, 1:3] = 0
    assert_bitwise_equal(got, expect, "width-0 table: zeros")
    # R = 0: nothing launched
    empty = torch.empty(0, dtype=torch.int32, device=device)
    out_dev = out.clone().to(device)
    d.dequantize_and_gather_k_cache(out_dev, case.cache.to(device), empty, None, case.table.to(device), 2, 0)
    assert_bitwise_equal(out_dev.cpu(), out, "R = 0")


def test_gather_strided_metadata(device):
    """Block table with a padded row stride and a column stride, seq/gather lens with stride 2,
    out with a padded row stride and padded requests."""
    case = GatherCase([33, 17], bs=16, seed=6, extra_cols=2)
    tbl = case.table
    big = torch.full((tbl.shape[1] + 1, tbl.shape[0] * 2), -5, dtype=torch.int64)
    big[:tbl.shape[1], ::2] = tbl.T.long()
    table = big[:tbl.shape[1], ::2].T                   # strides (2, 2*rows)
    seq2 = torch.tensor([33, 0, 17, 0], dtype=torch.int32)[::2]
    gl2 = torch.tensor([20, 0, 17, 0], dtype=torch.int32)[::2]
    out = random_bytes_(torch.empty(3, 24, layout.HEAD_DIM + 8, dtype=torch.bfloat16))[:, :, :layout.HEAD_DIM]
    dev_t = torch.empty(3, 24, layout.HEAD_DIM + 8, dtype=torch.bfloat16, device=device)[:, :, :layout.HEAD_DIM]
    dev_t.copy_(out)
    d.dequantize_and_gather_k_cache(dev_t, case.cache.to(device), seq2.to(device), gl2.to(device), table.to(device),
                                    16, 3)
    ref = out.clone()
    reference.dequantize_and_gather_k_cache(ref, case.cache, seq2, gl2, table, 16, 3)
    assert_bitwise_equal(dev_t.cpu(), ref, "strided metadata")
    for i in range(20):
        assert_bitwise_equal(ref[0, 3 + i], case.expected_row(0, 13 + i), "row")


# --- bad input ------------------------------------------------------------------------------------
def _insert_args():
    k = torch.zeros(4, layout.HEAD_DIM, dtype=torch.bfloat16)
    return dict(k=k, k_cache=torch.zeros(2, layout.ds_mla_block_bytes(16), dtype=torch.uint8),
                slot_mapping=torch.arange(4), block_size=16, is_ue8m0=True, use_fnuz=False)


INSERT_BAD = [
    (lambda a: a.update(k=a["k"].float()), "k"),
    (lambda a: a.update(k=torch.zeros(4, 448, dtype=torch.bfloat16)), "k"),
    (lambda a: a.update(k=torch.zeros(layout.HEAD_DIM, 4, dtype=torch.bfloat16).T), "k"),
    (lambda a: a.update(k=torch.zeros(2, layout.HEAD_DIM, dtype=torch.bfloat16)), "k"),
    (lambda a: a.update(slot_mapping=torch.arange(4).float()), "slot_mapping"),
    (lambda a: a.update(slot_mapping=torch.zeros(2, 2, dtype=torch.int64)), "slot_mapping"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :-1]), "k_cache"),
    (lambda a: a.update(k_cache=torch.zeros(4, 16 * 584 // 2, dtype=torch.uint8).view(2, -1)[:, :16 * 584 - 8]),
     "k_cache"),
    (lambda a: a.update(k_cache=torch.zeros(2, 16, 584, dtype=torch.int8)), "k_cache"),
    (lambda a: a.update(k_cache=torch.zeros(2, 8, 584, dtype=torch.uint8)), "k_cache"),
    (lambda a: a.update(k_cache=torch.zeros(2, 16, 576, dtype=torch.uint8)), "k_cache"),
    (lambda a: a.update(k_cache=torch.zeros(2, 584, 16, dtype=torch.uint8).transpose(1, 2)), "k_cache"),
    (lambda a: a.update(k_cache=torch.zeros(3, 10000, dtype=torch.uint8).view(-1)[:2 * 9000].view(2, 9000)
                        .as_strided((2, 16 * 584), (9000, 1))), "k_cache"),
    (lambda a: a.update(k_cache=torch.zeros(2, 16 * 584, dtype=torch.uint8).as_strided((2, 16 * 584), (100, 1))),
     "k_cache"),
    (lambda a: a.update(block_size=0), "block_size"),
    (lambda a: a.update(is_ue8m0=False), "is_ue8m0"),
]


@pytest.mark.parametrize("mutate,word", INSERT_BAD, ids=range(len(INSERT_BAD)))
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_insert_bad_input(mutate, word, impl):
    args = _insert_args()
    mutate(args)
    before = args["k_cache"].clone()
    with _ctx(torch.device("cpu"), impl), pytest.raises(ValueError, match=word):
        d.quantize_and_insert_k_cache(**args)
    assert torch.equal(args["k_cache"], before), "cache untouched on error"


def _gather_args():
    return dict(out=torch.zeros(2, 8, layout.HEAD_DIM, dtype=torch.bfloat16),
                k_cache=torch.zeros(2, layout.ds_mla_block_bytes(16), dtype=torch.uint8),
                seq_lens=torch.tensor([3, 4], dtype=torch.int32), gather_lens=None,
                block_table=torch.zeros(2, 2, dtype=torch.int32), block_size=16, offset=0, use_fnuz=False)


GATHER_BAD = [
    (lambda a: a.update(out=a["out"].float()), "out"),
    (lambda a: a.update(out=torch.zeros(2, 8, 448, dtype=torch.bfloat16)), "out"),
    (lambda a: a.update(out=torch.zeros(1, 8, layout.HEAD_DIM, dtype=torch.bfloat16)), "out"),
    (lambda a: a.update(out=torch.zeros(2, layout.HEAD_DIM, 8, dtype=torch.bfloat16).transpose(1, 2)), "out"),
    (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens"),
    (lambda a: a.update(gather_lens=torch.tensor([1], dtype=torch.int32)), "gather_lens"),
    (lambda a: a.update(gather_lens=torch.tensor([1, 2]).float()), "gather_lens"),
    (lambda a: a.update(block_table=torch.zeros(1, 2, dtype=torch.int32)), "block_table"),
    (lambda a: a.update(block_table=torch.zeros(2, 2, dtype=torch.int16)), "block_table"),
    (lambda a: a.update(block_table=torch.zeros(2, dtype=torch.int32)), "block_table"),
    (lambda a: a.update(offset=-1), "offset"),
    (lambda a: a.update(block_size=0), "block_size"),
    (lambda a: a.update(block_size=32), "k_cache"),
    (lambda a: a.update(k_cache=torch.zeros(2, 16, 584, dtype=torch.float32)), "k_cache"),
]


@pytest.mark.parametrize("mutate,word", GATHER_BAD, ids=range(len(GATHER_BAD)))
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_gather_bad_input(mutate, word, impl):
    args = _gather_args()
    mutate(args)
    before = args["out"].clone()
    with _ctx(torch.device("cpu"), impl), pytest.raises(ValueError, match=word):
        d.dequantize_and_gather_k_cache(**args)
    assert torch.equal(args["out"], before)


@pytest.mark.gpu
def test_bad_input_device_mismatch():
    args = _insert_args()
    args["k_cache"] = args["k_cache"].cuda()
    with pytest.raises(ValueError, match="k"):
        d.quantize_and_insert_k_cache(**args)
    g = _gather_args()
    g["out"] = g["out"].cuda()
    g["k_cache"] = g["k_cache"].cuda()
    g["seq_lens"] = g["seq_lens"].cuda()
    with pytest.raises(ValueError, match="block_table"):
        d.dequantize_and_gather_k_cache(**g)


# --- composition --------------------------------------------------------------------------------
def _opcheck_insert_args(device, use_fnuz):
    g = torch.Generator().manual_seed(8)
    k = (torch.randn(4, layout.HEAD_DIM, generator=g) * 3).to(torch.bfloat16).to(device)
    cache = torch.zeros(3, layout.ds_mla_block_stride(2), dtype=torch.uint8, device=device)
    return (k, cache, torch.tensor([5, -1, 0, 2], device=device), 2, True, use_fnuz)


def _opcheck_gather_args(device, gathered):
    case = GatherCase([5, 3], bs=2, seed=10)
    gl = torch.tensor([3, 2], dtype=torch.int32, device=device) if gathered else None
    return (torch.zeros(2, 6, layout.HEAD_DIM, dtype=torch.bfloat16, device=device), case.cache.to(device),
            case.seq_t.to(device), gl, case.table.to(device), 2, 1, False)


def _ctx(device, impl):
    if impl == "reference" and device.type != "cpu":
        pytest.skip("the reference is the CPU implementation")
    if impl == "triton" and device.type == "cpu" and not platform.INTERPRET:
        pytest.skip("CPU tensors run the Triton kernel only under the interpreter")
    return d.cpu_implementation(impl) if device.type == "cpu" else contextlib.nullcontext()


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("use_fnuz", [False, True])
def test_opcheck_insert(device, impl, use_fnuz):
    with _ctx(device, impl):
        # k gets a padded row stride (inner stride must stay 1); the cache layout is the op's contract
        run_opcheck(INSERT, _opcheck_insert_args(device, use_fnuz), layouts=("contiguous", "padded"),
                    permute=lambda i, t: i == 0)


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("gathered", [False, True])
def test_opcheck_gather(device, impl, gathered):
    with _ctx(device, impl):
        run_opcheck(GATHER, _opcheck_gather_args(device, gathered), layouts=("contiguous", "padded"),
                    permute=lambda i, t: i in (0, 4))
        run_opcheck(GATHER, _opcheck_gather_args(device, gathered), layouts=("permuted",),
                    permute=lambda i, t: i == 4)


def test_compile_insert_no_recompile(device):
    bs, nb = 2, 8

    def step(k, cache, slots):
        d.quantize_and_insert_k_cache(k, cache, slots, bs)
        return cache

    inputs = []
    for n in (3, 5, 9):
        g = torch.Generator().manual_seed(n)
        inputs.append(((torch.randn(n + 1, layout.HEAD_DIM, generator=g) * 2).to(torch.bfloat16).to(device),
                       torch.zeros(nb, layout.ds_mla_block_stride(bs), dtype=torch.uint8, device=device),
                       torch.randperm(nb * bs, generator=g)[:n].to(device)))
    counted = device.type == "cuda"
    before = triton_cache_entries(kernels.quantize_insert_kernel) if counted else None
    check_compile(step, inputs)
    if counted:
        assert triton_cache_entries(kernels.quantize_insert_kernel) - before <= 1


def test_compile_gather_no_recompile(device):
    case = GatherCase([7, 5, 9, 4, 6], bs=2, seed=12)

    def step(out, cache, seq, gl, table):
        d.dequantize_and_gather_k_cache(out, cache, seq, gl, table, 2, 1)
        return out

    inputs = []
    for r, w in ((2, 7), (3, 9), (5, 11)):   # W never equal to the table width 6 (duck sizing)
        inputs.append((torch.zeros(r, w, layout.HEAD_DIM, dtype=torch.bfloat16, device=device), case.cache.to(device),
                       case.seq_t[:r].to(device), torch.tensor([3, 5, 2, 4, 6][:r], dtype=torch.int32).to(device),
                       case.table[:r].to(device)))
    counted = device.type == "cuda"
    before = triton_cache_entries(kernels.dequant_gather_kernel) if counted else None
    check_compile(step, inputs)
    if counted:
        assert triton_cache_entries(kernels.dequant_gather_kernel) - before <= 1


# --- GPU only -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("use_fnuz", [False, True])
def test_cuda_graph_insert_and_gather(use_fnuz):
    """Capture insert + gather; replay with new K, slots, lengths and table values equals eager."""
    bs, nb, n, r, w = 64, 40, 300, 4, 200

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        k = (torch.randn(n, layout.HEAD_DIM, generator=g) * (seed + 1)).to(torch.bfloat16)
        slots = torch.randperm(nb * bs, generator=g)[:n]
        slots[::17] = -1
        cache = random_bytes_(torch.empty(nb, layout.ds_mla_block_stride(bs), dtype=torch.uint8), g)
        seq = torch.randint(0, 6 * bs, (r,), generator=g, dtype=torch.int32)
        gl = torch.randint(-2, w + 20, (r,), generator=g, dtype=torch.int32)
        table = torch.randint(-3, nb + 3, (r, 6), generator=g, dtype=torch.int32)
        out = random_bytes_(torch.empty(r, w, layout.HEAD_DIM, dtype=torch.bfloat16), g)
        return [t.cuda() for t in (k, cache, slots, out, seq, gl, table)]

    def step(k, cache, slots, out, seq, gl, table):
        d.quantize_and_insert_k_cache(k, cache, slots, bs, True, use_fnuz)
        d.dequantize_and_gather_k_cache(out, cache, seq, gl, table, bs, 7, use_fnuz)

    check_cuda_graph(step, inputs(0), [inputs(1), inputs(2)])


@pytest.mark.gpu
@pytest.mark.parametrize("use_fnuz", [False, True])
def test_benchmark_sized_exact(use_fnuz):
    """T = 65536 insert (bs 64, random slots, padded pages) and 16 x 2048-token gathers, against the reference."""
    g = torch.Generator().manual_seed(21)
    t, bs = 65536, 64
    nb = t // bs              # every slot written (a permutation), so the gathers read written tokens only
    k = (torch.randn(t, layout.HEAD_DIM, generator=g) * 4).to(torch.bfloat16)
    slots = torch.randperm(nb * bs, generator=g)
    cache = random_bytes_(torch.empty(nb, layout.ds_mla_block_stride(bs), dtype=torch.uint8), g)
    dev, k_dev, slots_dev = cache.cuda(), k.cuda(), slots.cuda()
    with sync_debug_error():
        d.quantize_and_insert_k_cache(k_dev, dev, slots_dev, bs, True, use_fnuz)
    reference.quantize_and_insert_k_cache(k, cache, slots, bs, True, use_fnuz)
    assert_bitwise_equal(dev.cpu(), cache, "insert T=65536")
    r, s = 16, 2048
    table = torch.randperm(nb, generator=g)[: r * s // bs].view(r, s // bs).int()
    seq = torch.full((r,), s, dtype=torch.int32)
    out = torch.zeros(r, s, layout.HEAD_DIM, dtype=torch.bfloat16)
    out_dev, seq_dev, table_dev = out.cuda(), seq.cuda(), table.cuda()
    with sync_debug_error():
        d.dequantize_and_gather_k_cache(out_dev, dev, seq_dev, None, table_dev, bs, 0, use_fnuz)
    reference.dequantize_and_gather_k_cache(out, cache, seq, None, table, bs, 0, use_fnuz)
    assert_bitwise_equal(out_dev.cpu(), out, "gather 16 x 2048")


@pytest.mark.gpu
def test_sync_free_and_stream_order():
    """No host sync (first and later calls), and the gather sees the insert's writes in stream order
    (programmatic dependent launch on sm_90+) inside a graph."""
    bs, nb = 64, 8
    k = torch.randn(64, layout.HEAD_DIM, device="cuda").to(torch.bfloat16)
    cache = torch.zeros(nb, layout.ds_mla_block_stride(bs), dtype=torch.uint8, device="cuda")
    slots = torch.arange(64, device="cuda") + 128
    table = torch.tensor([[2, 3]], dtype=torch.int32, device="cuda")
    seq = torch.tensor([64], dtype=torch.int32, device="cuda")
    out = torch.zeros(1, 64, layout.HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    snapshot = torch.empty_like(out)

    def step():
        k.mul_(-1)
        d.quantize_and_insert_k_cache(k, cache, slots, bs)
        d.dequantize_and_gather_k_cache(out, cache, seq, None, table, bs, 0)
        snapshot.copy_(out)

    with sync_debug_error():
        step()
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        before = k.clone()
        graph.replay()
        torch.cuda.synchronize()
        data, scales = reference.quantize_rows((-before).cpu(), layout.E4M3FN)
        expected = reference.dequantize_rows(data, scales, layout.E4M3FN)
        assert_bitwise_equal(snapshot[0].cpu(), expected, "gather after insert")
