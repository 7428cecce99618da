"""fp8 and bf16 conversions for Triton kernels: hardware casts where the target has them, and a
bit-exact software codec (integer operations, round-to-nearest-even, saturating) where it does not.

Format codes are `layout.Fp8Format.code`: 1 = e4m3fn (OCP), 2 = e4m3fnuz (FNUZ), 3 = e5m2 (OCP).
Codes travel as uint8 bit patterns; caches and fp8 inputs are passed to kernels as uint8 views.
Which path a kernel takes is a constexpr (`SW`) chosen by `platform.native_fp8`.
"""
import triton
import triton.language as tl


@triton.jit
def _rne_shift_right(p, shift):
    """p / 2**shift rounded to nearest even, for int32 p >= 0 and 1 <= shift <= 25."""
    q = p >> shift
    rem = p & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(tl.int32)


@triton.jit
def _encode_sw(x, MAN: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr,
               NAN_CODE: tl.constexpr, SIGNED_ZERO: tl.constexpr):
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    mag = tl.minimum(mag, MAX_BITS)                      # saturate (inf too) at the largest finite
    exp = (mag >> 23) - 127
    normal = exp >= 1 - BIAS
    # normal: the fp32 pattern re-biased; subnormal: the 24-bit significand, shifted further
    p = tl.where(normal, mag - ((127 - BIAS) << 23), (mag & 0x7FFFFF) | 0x800000)
    shift = tl.where(normal, 23 - MAN, tl.minimum(23 - MAN + (1 - BIAS) - exp, 25))
    code = _rne_shift_right(p, shift)
    if SIGNED_ZERO:
        code = tl.where(is_nan, NAN_CODE, code) | (sign << 7)
    else:
        code = tl.where(code == 0, 0, code | (sign << 7))
        code = tl.where(is_nan, NAN_CODE, code)
    return code.to(tl.uint8)


@triton.jit
def _decode_sw(code, MAN: tl.constexpr, BIAS: tl.constexpr, FMT: tl.constexpr, SUB_SCALE: tl.constexpr):
    c = code.to(tl.int32) & 0xFF
    sign = c >> 7
    mag = c & 0x7F
    e = mag >> MAN
    m = mag & ((1 << MAN) - 1)
    normal = (((e - BIAS + 127) << 23) | (m << (23 - MAN))).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, m.to(tl.float32) * SUB_SCALE, normal)   # subnormal: m * 2**(1-BIAS-MAN), exact
    if FMT == 1:
        val = tl.where(mag == 0x7F, float("nan"), val)
    elif FMT == 3:
        val = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), val)
    # the sign as a bit: compiled `-val` is 0 - val, which turns -0 into +0
    val = (val.to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)
    if FMT == 2:
        val = tl.where(c == 0x80, float("nan"), val)
    return val


@triton.jit
def fp8_encode(x, FMT: tl.constexpr, SW: tl.constexpr):
    """fp32 tensor -> uint8 codes of format FMT, RNE, saturating to the format's finite range.

    Callers clamp first where the recipe says so; this saturates anyway (inf -> +-max).
    """
    if SW:
        if FMT == 1:
            code = _encode_sw(x, 3, 7, 0x43E00000, 0x7F, True)      # max 448
        elif FMT == 2:
            code = _encode_sw(x, 3, 8, 0x43700000, 0x80, False)     # max 240, no -0, NaN = 0x80
        else:
            code = _encode_sw(x, 2, 15, 0x47600000, 0x7F, True)     # max 57344
    else:
        # PropagateNan.ALL: NaN stays NaN, as in the software path and the reference
        if FMT == 1:
            y = tl.clamp(x, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)
        elif FMT == 2:
            y = tl.clamp(x, -240.0, 240.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4b8)
        else:
            y = tl.clamp(x, -57344.0, 57344.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e5)
        code = y.to(tl.uint8, bitcast=True)
    return code


@triton.jit
def fp8_decode(code, FMT: tl.constexpr, SW: tl.constexpr, OUT: tl.constexpr = tl.float32):
    """uint8 codes of format FMT -> exact fp32 values, or OUT values: every e4m3, e4m3fnuz and e5m2 value is
    also a bf16 and an fp16 value, and natively fp8 -> fp16 is one conversion per pair of codes."""
    if SW:
        if FMT == 1:
            val = _decode_sw(code, 3, 7, 1, 0.001953125)        # 2**-9
        elif FMT == 2:
            val = _decode_sw(code, 3, 8, 2, 0.0009765625)       # 2**-10
        else:
            val = _decode_sw(code, 2, 15, 3, 1.52587890625e-05)  # 2**-16
        val = val.to(OUT)
    else:
        if FMT == 1:
            val = code.to(tl.float8e4nv, bitcast=True).to(OUT)
        elif FMT == 2:
            val = code.to(tl.float8e4b8, bitcast=True).to(OUT)
        else:
            val = code.to(tl.float8e5, bitcast=True).to(OUT)
    return val


@triton.jit
def bf16_bits_rne(x):
    """fp32 tensor -> int16 bit patterns of bf16, round-to-nearest-even (NaN -> quiet NaN).

    Used instead of `.to(tl.bfloat16)`, which truncates under Triton's interpreter.
    """
    bits = x.to(tl.int32, bitcast=True)
    hi = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    hi = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits >> 16) | 0x40, hi)
    return hi.to(tl.int16)
