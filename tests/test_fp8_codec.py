"""Bit-exactness of the fp8/bf16 conversions in kernels/fp8.py.

The software codec runs everywhere (under Triton's interpreter on CPU, compiled on a GPU); on a GPU
the hardware casts that `platform.native_fp8` calls native are held to the same oracle. Expected
codes come from torch's casts and, for round-to-nearest-even ties, from an exact `Fraction` oracle
that shares no code with either.
"""
import bisect
import functools
import math
from fractions import Fraction

import pytest
import torch
import triton
import triton.language as tl

from torch_dsv4_ops import layout, platform
from torch_dsv4_ops.kernels.fp8 import bf16_bits_rne, fp8_decode, fp8_encode

FORMATS = layout.FP8_FORMATS
BLOCK = 8192


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, FMT: tl.constexpr, SW: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(out_ptr + i, fp8_encode(tl.load(x_ptr + i, mask=mask), FMT, SW), mask=mask)


@triton.jit
def _decode_kernel(code_ptr, out_ptr, n, FMT: tl.constexpr, SW: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(out_ptr + i, fp8_decode(tl.load(code_ptr + i, mask=mask), FMT, SW), mask=mask)


@triton.jit
def _bf16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(out_ptr + i, bf16_bits_rne(tl.load(x_ptr + i, mask=mask)), mask=mask)


def _grid(n):
    return (triton.cdiv(n, BLOCK),)


def encode(x: torch.Tensor, fmt: layout.Fp8Format, sw: bool) -> torch.Tensor:
    """fp32 values -> uint8 codes through `fp8_encode`."""
    x = x.float().contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _encode_kernel[_grid(x.numel())](x, out, x.numel(), FMT=fmt.code, SW=sw, BLOCK=BLOCK)
    return out


def decode(codes: torch.Tensor, fmt: layout.Fp8Format, sw: bool) -> torch.Tensor:
    """uint8 codes -> fp32 values through `fp8_decode`."""
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    _decode_kernel[_grid(codes.numel())](codes, out, codes.numel(), FMT=fmt.code, SW=sw, BLOCK=BLOCK)
    return out


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 values -> int16 bf16 patterns through `bf16_bits_rne`."""
    out = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    _bf16_kernel[_grid(x.numel())](x, out, x.numel(), BLOCK=BLOCK)
    return out


@pytest.fixture(params=["software", "hardware"])
def sw(request, device):
    """The codec path: the software codec always; the hardware casts only on a GPU that has them."""
    if request.param == "hardware" and device.type != "cuda":
        pytest.skip("hardware fp8 casts need a GPU (the interpreter's fp8 casts are known to be wrong)")
    return request.param == "software"


def _need_path(fmt, sw, device):
    if not sw and not platform.native_fp8(platform.target_for(device), fmt):
        pytest.skip(f"{fmt.name} is not native on this GPU; kernels use the software codec there")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().view(torch.int32)


def _finite_bf16_as_fp32(device) -> torch.Tensor:
    """Every finite bf16 value (65280 of the 65536 patterns), as fp32."""
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return x[torch.isfinite(x)].to(device)


# --- an exact oracle (no torch casts) --------------------------------------------------------

def _fraction_value(code: int, fmt: layout.Fp8Format) -> Fraction | None:
    """The exact value of a non-negative code (sign bit clear), or None for NaN/inf codes."""
    e, m = code >> fmt.man_bits, code & ((1 << fmt.man_bits) - 1)
    if fmt is layout.E4M3FN and code == 0x7F:
        return None
    if fmt is layout.E5M2 and e == 31:
        return None
    if e == 0:
        return Fraction(m, 1 << fmt.man_bits) * Fraction(2) ** (1 - fmt.bias)
    return (1 + Fraction(m, 1 << fmt.man_bits)) * Fraction(2) ** (e - fmt.bias)


@functools.lru_cache(maxsize=None)
def _positive_grid(fmt):
    """(values, codes) of every finite non-negative code, in increasing order."""
    pairs = [(v, c) for c in range(0x80) if (v := _fraction_value(c, fmt)) is not None]
    assert [c for _, c in pairs] == sorted(c for _, c in pairs) and pairs == sorted(pairs)
    assert pairs[-1][0] == Fraction(fmt.max)
    return [v for v, _ in pairs], [c for _, c in pairs]


def _oracle_code(x: float, fmt) -> int:
    """RNE of the exact value of `x` to the nearest finite value (ties to the even code), saturating at +-max."""
    values, codes = _positive_grid(fmt)
    a = abs(Fraction(x))
    if a >= values[-1]:
        code = codes[-1]
    else:
        i = bisect.bisect_right(values, a) - 1          # values[i] <= a < values[i + 1]
        below, above = a - values[i], values[i + 1] - a
        if below != above:
            code = codes[i] if below < above else codes[i + 1]
        else:
            code = codes[i] if codes[i] % 2 == 0 else codes[i + 1]
    if math.copysign(1.0, x) < 0 and (code != 0 or fmt is not layout.E4M3FNUZ):
        code |= 0x80
    return code


# --- (a) decode ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_decode_all_256_codes(fmt, sw, device):
    _need_path(fmt, sw, device)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    got = decode(codes, fmt, sw).cpu()
    want = codes.cpu().view(fmt.dtype).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(_bits(got[finite]), _bits(want[finite]))       # bit-equal: -0.0 and inf included
    # the exact oracle agrees on every finite non-negative code
    for code in range(0x80):
        value = _fraction_value(code, fmt)
        if value is not None:
            assert Fraction(got[code].item()) == value, hex(code)


# --- (b), (c) encode -------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_encode_every_finite_bf16_value(fmt, sw, device):
    """Clamped to +-max first, as the recipes do, every finite bf16 value encodes as torch casts it."""
    _need_path(fmt, sw, device)
    x = _finite_bf16_as_fp32(device).clamp(-fmt.max, fmt.max)
    got = encode(x, fmt, sw).cpu()
    want = x.cpu().to(fmt.dtype).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), hex(got[i].item()), hex(want[i].item())) for i in bad[:10].tolist()]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_encode_saturates_without_clamping(fmt, sw, device):
    """Values past the largest finite value, and +-inf, give the +-max code (never NaN or inf)."""
    _need_path(fmt, sw, device)
    x = _finite_bf16_as_fp32("cpu")
    big = x[x.abs() > fmt.max]
    extra = torch.tensor([math.inf, -math.inf, 3.4028234663852886e38, -3.4028234663852886e38,
                          fmt.max * 1.0001, -fmt.max * 1.0001, math.nextafter(fmt.max, math.inf)])
    x = torch.cat([big, extra, torch.rand(4096) * 1e6 + fmt.max]).to(device)
    got = encode(x, fmt, sw).cpu()
    max_code = torch.tensor([fmt.max]).to(fmt.dtype).view(torch.uint8).item()
    want = torch.where(x.cpu() > 0, max_code, max_code | 0x80).to(torch.uint8)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_encode_rounds_ties_to_even(fmt, sw, device):
    """Exact midpoints between neighbouring fp8 values (subnormal ones and the one above zero
    included), the values themselves and their fp32 neighbours, against the Fraction oracle and torch."""
    _need_path(fmt, sw, device)
    values, _ = _positive_grid(fmt)
    points = set()
    for lo, hi in zip(values, values[1:]):
        mid = float((lo + hi) / 2)
        assert Fraction(mid) == (lo + hi) / 2                   # midpoints are exact in fp32
        for v in (float(lo), mid):
            f32 = torch.tensor(v, dtype=torch.float32)
            points.update([v, torch.nextafter(f32, torch.tensor(math.inf)).item(),
                           torch.nextafter(f32, torch.tensor(-math.inf)).item()])
    points = sorted(p for p in points if p >= 0 and p <= fmt.max)
    x = torch.tensor(points + [-p for p in points], dtype=torch.float32)
    got = encode(x.to(device), fmt, sw).cpu()
    want = torch.tensor([_oracle_code(v, fmt) for v in x.tolist()], dtype=torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), hex(got[i].item()), hex(want[i].item())) for i in bad[:10].tolist()]
    assert torch.equal(x.to(fmt.dtype).view(torch.uint8), want)   # torch's cast agrees with the oracle


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_negative_zero(fmt, sw, device):
    """-0 and negative values that round to zero keep the sign bit, except in FNUZ (no -0: 0x80 is NaN)."""
    _need_path(fmt, sw, device)
    x = torch.tensor([0.0, -0.0, -1e-30, -float(_positive_grid(fmt)[0][1]) / 2, -1e-45], device=device)
    got = encode(x, fmt, sw).cpu().tolist()
    zero = 0x00 if fmt is layout.E4M3FNUZ else 0x80
    assert got == [0x00, zero, zero, zero, zero]
    assert torch.equal(torch.tensor(got, dtype=torch.uint8), x.cpu().to(fmt.dtype).view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_nan_encodes_to_nan(fmt, sw, device):
    """NaN (either sign) encodes to a NaN code of the format, never to a saturated finite code."""
    _need_path(fmt, sw, device)
    codes = encode(torch.tensor([math.nan, -math.nan], device=device), fmt, sw).cpu()
    assert torch.isnan(codes.view(fmt.dtype).float()).all(), codes


# --- (e) bf16 ----------------------------------------------------------------------------------

def test_bf16_bits_rne_matches_torch(device):
    """About 200k fp32 values: random finite bit patterns, normal samples at many scales, exact
    bf16 ties, values next to ties, the overflow edge and +-inf round as torch's cast does."""
    g = torch.Generator().manual_seed(0)
    patterns = torch.randint(-2**31, 2**31, (80000,), generator=g, dtype=torch.int64).to(torch.int32)
    patterns = patterns.view(torch.float32)
    normal = torch.randn(40000, generator=g) * torch.exp2(torch.randint(-130, 128, (40000,), generator=g).float())
    bf16 = torch.randint(-2**15, 2**15, (40000,), generator=g, dtype=torch.int32).to(torch.int16)
    ties = (bf16.to(torch.int32) << 16 | 0x8000).view(torch.float32)            # exactly halfway
    near = torch.cat([ties.view(torch.int32) + 1, ties.view(torch.int32) - 1]).view(torch.float32)
    edge = torch.tensor([3.3895313892515355e38, 3.3961775292304957e38, 3.4028234663852886e38, math.inf,
                         -math.inf, 0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38])
    x = torch.cat([patterns, normal, ties, near, edge])
    x = x[~torch.isnan(x)]
    assert x.numel() > 200000
    got = bf16_bits(x.to(device)).cpu()
    assert torch.equal(got, x.to(torch.bfloat16).view(torch.int16))


def test_bf16_bits_rne_nan_stays_nan(device):
    x = torch.tensor([0x7FC00000, 0x7F800001, -0x00400000, 0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    got = bf16_bits(x.to(device)).cpu().view(torch.bfloat16)
    assert torch.isnan(got.float()).all()
