"""Reference fp8_ds_mla K-cache ops (SPEC §2.1, §3.2, §4 a, b, d, l).

`quantize_and_insert_k_cache` writes bf16 K rows into the paged fp8_ds_mla cache (448 fp8 NoPE
bytes, 64 bf16 RoPE values, 7 UE8M0 exponent bytes + 1 zero byte per token);
`dequantize_and_gather_k_cache` reads them back into a bf16 workspace through a block table.
Arguments are those of the ops, already validated. Pure torch; imports nothing of the package but
`layout`.
"""
from __future__ import annotations

import math

import torch

from .. import layout

FP32_MAX = torch.finfo(torch.float32).max
FP32_MAN_BITS = 23


def fp8_format(use_fnuz: bool) -> layout.Fp8Format:
    """The e4m3 flavour of the cache: OCP e4m3fn (FP8_MAX 448) or FNUZ e4m3fnuz (FP8_MAX 224)."""
    return layout.E4M3FNUZ if use_fnuz else layout.E4M3FN


def ue8m0_constants(fmt: layout.Fp8Format) -> tuple[float, int]:
    """(m_max, k_max) = frexp(FP8_MAX): (0.875, 9) for OCP 448, (0.875, 8) for FNUZ 224.

    The smallest e with FP8_MAX * 2**e >= a = m * 2**k2 (frexp, m in [0.5, 1)) is
    e = k2 - k_max + (m > m_max), which is SPEC's `k2 - 8 - (m <= 0.875)` (OCP) and
    `k2 - 7 - (m <= 0.875)` (FNUZ).
    """
    m_max, k_max = math.frexp(fmt.ue8m0_max)
    return m_max, k_max


def floor_fp32() -> torch.Tensor:
    """fp32(1e-4), the amax floor."""
    return torch.tensor(layout.UE8M0_FLOOR, dtype=torch.float32)


def ue8m0_exponent(a: torch.Tensor, fmt: layout.Fp8Format) -> torch.Tensor:
    """Exact e = ceil(log2(a / FP8_MAX)) for fp32 a >= the floor (int32), by the frexp rule of §2.1."""
    m_max, k_max = ue8m0_constants(fmt)
    m, k2 = torch.frexp(a.float())
    return (k2.to(torch.int32) - k_max + (m > m_max).to(torch.int32)).to(torch.int32)


def block_amax(x: torch.Tensor) -> torch.Tensor:
    """a of §2.1 for fp32 blocks x [..., 64]: max|x| with NaN left out, floored at fp32(1e-4), and
    an infinite amax counted as the largest fp32 (which gives the same exponent as max bf16)."""
    ax = torch.where(x.isnan(), torch.zeros_like(x), x.abs())
    return torch.maximum(ax.amax(-1), floor_fp32().to(ax.device)).clamp(max=FP32_MAX)


def pow2_fp32(e: torch.Tensor) -> torch.Tensor:
    """2**e (fp32) for int32 e in [-126, 127], built from its bit pattern (exact)."""
    return ((e + layout.UE8M0_BIAS) << FP32_MAN_BITS).to(torch.int32).view(torch.float32)


def scale_of_byte(byte: torch.Tensor) -> torch.Tensor:
    """2**(byte - 127) (fp32) for UE8M0 bytes 0..255: bits byte << 23 (byte 255 gives inf); byte 0
    gives the subnormal 2**-127."""
    b = byte.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 1 << (FP32_MAN_BITS - 1)), b << FP32_MAN_BITS)
    return bits.view(torch.float32)


def ue8m0_quantize(x: torch.Tensor, fmt: layout.Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 blocks x [..., C] -> (fp8 codes [..., C] uint8, exact UE8M0 exponents e [...] int32): each block
    scaled by 2**-e (exact), clamped to +-FP8_MAX, rounded to fmt."""
    e = ue8m0_exponent(block_amax(x), fmt)
    y = x * pow2_fp32(-e)[..., None]                                   # exact: a power of two
    q = y.clamp(-fmt.ue8m0_max, fmt.ue8m0_max).to(fmt.dtype).view(torch.uint8)
    # NaN is stored as the format's positive NaN code whatever its sign: hardware conversions drop
    # the sign of a NaN, so this is the one result every platform gives (docs/ops/k_cache.md §6.1)
    return torch.where(y.isnan(), torch.tensor(nan_code(fmt), dtype=torch.uint8), q), e


def quantize_rows(k: torch.Tensor, fmt: layout.Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows [n, 512] -> (data [n, 576] uint8, scales [n, 8] uint8) exactly as §2.1 stores them."""
    n = k.shape[0]
    x = k[:, :layout.NOPE_DIM].float().reshape(n, layout.NUM_QUANT_BLOCKS, layout.QUANT_BLOCK)
    q, e = ue8m0_quantize(x, fmt)
    q = q.reshape(n, layout.NOPE_DIM)
    rope = k[:, layout.NOPE_DIM:].contiguous().view(torch.uint8).reshape(n, 2 * layout.ROPE_DIM)
    byte = (e + layout.UE8M0_BIAS).clamp(0, 255).to(torch.uint8)
    pad = torch.zeros(n, layout.SCALE_BYTES - layout.NUM_QUANT_BLOCKS, dtype=torch.uint8, device=k.device)
    return torch.cat([q, rope], 1), torch.cat([byte, pad], 1)


def dequantize_rows(data: torch.Tensor, scales: torch.Tensor, fmt: layout.Fp8Format) -> torch.Tensor:
    """(data [n, 576], scales [n, 8]) uint8 -> bf16 rows [n, 512]: out[64j+i] = bf16(float(q) *
    2**(byte_j - 127)), RoPE dims the stored bits."""
    n = data.shape[0]
    q = data[:, :layout.NOPE_DIM].contiguous().view(fmt.dtype).float()
    q = q.reshape(n, layout.NUM_QUANT_BLOCKS, layout.QUANT_BLOCK)
    nope = (q * scale_of_byte(scales[:, :layout.NUM_QUANT_BLOCKS])[..., None]).to(torch.bfloat16)
    rope = data[:, layout.NOPE_DIM:].contiguous().view(torch.bfloat16).reshape(n, layout.ROPE_DIM)
    return torch.cat([nope.reshape(n, layout.NOPE_DIM), rope], 1)


def pages(k_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache as [num_blocks, bs*584] uint8 pages (either tensor form of §2.1), a view."""
    nb = k_cache.shape[0]
    stride = k_cache.stride(0) if nb > 1 else layout.ds_mla_block_bytes(block_size)
    return torch.as_strided(k_cache, (nb, layout.ds_mla_block_bytes(block_size)), (stride, 1))


def _token_index(block_size: int, off: torch.Tensor):
    """Byte columns inside a page of each token's data [n, 576] and scale bytes [n, 8]."""
    data = off[:, None] * layout.TOKEN_DATA_BYTES + torch.arange(layout.TOKEN_DATA_BYTES, device=off.device)
    scale = block_size * layout.TOKEN_DATA_BYTES + off[:, None] * layout.SCALE_BYTES \
        + torch.arange(layout.SCALE_BYTES, device=off.device)
    return data, scale


def nan_code(fmt: layout.Fp8Format) -> int:
    """The code a NaN element is stored as: the format's NaN with the sign bit clear."""
    return 0x80 if fmt is layout.E4M3FNUZ else 0x7F


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size=64, is_ue8m0=True, use_fnuz=False) -> None:
    """k [N_k, 512] bf16; slot_mapping [N]; token t goes to slot s (skipped if s < 0 or past the cache)."""
    fmt = fp8_format(use_fnuz)
    pg = pages(k_cache, block_size)
    slots = slot_mapping.long()
    keep = ((slots >= 0) & (slots < k_cache.shape[0] * block_size)).nonzero().flatten()
    if keep.numel() == 0:
        return
    s = slots[keep]
    blk, off = s // block_size, s % block_size
    data, scales = quantize_rows(k[keep], fmt)
    dcol, scol = _token_index(block_size, off)
    pg[blk[:, None], dcol] = data
    pg[blk[:, None], scol] = scales


def lookup(block_table: torch.Tensor, r: int, pos: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """SPEC §0 `lookup` for request r at positions `pos` (int64), with the cache's num_blocks: slots, or -1."""
    width = block_table.shape[1]
    col = torch.where(pos >= 0, pos, torch.zeros_like(pos)) // block_size
    ok = (pos >= 0) & (col < width)
    blk = torch.full_like(pos, -1)
    if width > 0:
        blk = block_table[r, col.clamp(max=width - 1)].long()
    ok &= (blk >= 0) & (blk < num_blocks)
    return torch.where(ok, blk * block_size + torch.where(pos >= 0, pos, torch.zeros_like(pos)) % block_size,
                       torch.full_like(pos, -1))


def dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
                                  use_fnuz=False) -> None:
    """Rows offset .. offset+gl-1 of out[r] receive the last gl tokens of request r (zeros for
    invalid sources); rows past out's width are skipped, all other rows are untouched."""
    fmt = fp8_format(use_fnuz)
    pg = pages(k_cache, block_size)
    nb, width = k_cache.shape[0], out.shape[1]
    seq = seq_lens.long().tolist()
    gat = seq if gather_lens is None else gather_lens.long().tolist()
    for r in range(len(seq)):
        gl = max(gat[r], 0)
        n = min(gl, width - offset)
        if n <= 0:
            continue
        pos = seq[r] - gl + torch.arange(n, dtype=torch.int64, device=out.device)
        s = lookup(block_table, r, pos, block_size, nb)
        ok = s >= 0
        rows = torch.zeros(n, layout.HEAD_DIM, dtype=torch.bfloat16, device=out.device)
        if ok.any():
            sv = s[ok]
            dcol, scol = _token_index(block_size, sv % block_size)
            blk = (sv // block_size)[:, None]
            rows[ok] = dequantize_rows(pg[blk, dcol], pg[blk, scol], fmt)
        out[r, offset:offset + n] = rows
