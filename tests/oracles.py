"""Independent oracles shared by the indexer test files, written from SPEC in plain Python (never with the
package's code): e4m3 from its definition, the exact UE8M0 exponent over fractions, SPEC §0 `lookup` with the
cache's num_blocks."""
from __future__ import annotations

import bisect
import math
import struct
from fractions import Fraction


class E4M3:
    """e4m3 from its definition: OCP e4m3fn (bias 7, 0x7F/0xFF NaN, -0 = 0x80) or FNUZ e4m3fnuz (bias 8,
    0x80 the only NaN, no -0); encode = clamp to the UE8M0 recipe's FP8_MAX (448 / 224), then RNE."""

    def __init__(self, fnuz: bool):
        self.fnuz = fnuz
        self.bias = 8 if fnuz else 7
        self.fp8_max = 224.0 if fnuz else 448.0
        self.nan = 0x80 if fnuz else 0x7F
        self.values = [self.decode(c) for c in range(0x80 if fnuz else 0x7F)]   # code i >= 0 has value values[i]
        assert all(a < b for a, b in zip(self.values, self.values[1:]))
        assert self.fp8_max in self.values

    def decode(self, code: int) -> float:
        if (self.fnuz and code == 0x80) or (not self.fnuz and code & 0x7F == 0x7F):
            return math.nan
        e, m = (code >> 3) & 0xF, code & 7
        mag = m / 8 * 2.0 ** (1 - self.bias) if e == 0 else (1 + m / 8) * 2.0 ** (e - self.bias)
        return -mag if code & 0x80 else mag

    def encode(self, v: float) -> int:
        if math.isnan(v):
            return self.nan                     # one NaN code whatever the sign (docs/ops/k_cache.md §6.1)
        a = min(abs(v), self.fp8_max)
        i = bisect.bisect_left(self.values, a)
        if self.values[i] != a:
            mid = (self.values[i - 1] + self.values[i]) / 2      # exact: dyadic values
            i = i - 1 if a < mid or (a == mid and (i - 1) % 2 == 0) else i   # ties to the even mantissa
        if math.copysign(1.0, v) < 0:
            return 0 if (self.fnuz and i == 0) else i | 0x80
        return i


FMT = {False: E4M3(False), True: E4M3(True)}
FP32_FLOOR = Fraction(struct.unpack("<f", struct.pack("<f", 1e-4))[0])
FP32_MAX = Fraction(struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0])


def oracle_exponent(amax: float, fp8_max: float) -> int:
    """The smallest integer e with FP8_MAX * 2**e >= a, a = max(amax, fp32(1e-4)) (inf: the largest fp32)."""
    a = FP32_MAX if math.isinf(amax) else max(Fraction(amax), FP32_FLOOR)
    e = math.floor(math.log2(float(a) / fp8_max)) - 3
    assert Fraction(fp8_max) * Fraction(2) ** e < a
    while Fraction(fp8_max) * Fraction(2) ** e < a:
        e += 1
    return e


def oracle_lookup(table: list, b: int, c: int, bs: int, nb: int) -> int:
    """SPEC §0 lookup with the cache's num_blocks."""
    if not 0 <= b < len(table) or c < 0:
        return -1
    col = c // bs
    if col >= len(table[b]):
        return -1
    blk = table[b][col]
    return -1 if blk < 0 or blk >= nb else blk * bs + c % bs
