"""fused_indexer_q_rope_quant, pack_seq_triton and unpack_seq_triton (SPEC §3.9, §4 b, d, h, i, §5).

Every expected value comes from the plain-Python oracle below: exact RoPE arithmetic with `fractions` and
IEEE round-to-nearest-even to fp32 and bf16 written out here, an e4m3 codec built from the format definitions,
the UE8M0 exponent as the smallest e with FP8_MAX * 2**e >= a, and list-based pack/unpack over bit patterns. The
package's reference is checked against the oracle like the kernel, never used as one (except on GPU-only
benchmark-sized cases and for NaN/inf rows, where the literal codes are asserted too).
"""
import math
import struct
from fractions import Fraction

import pytest
import torch

from oracles import FMT, oracle_exponent
from torch_dsv4_ops import layout
from torch_dsv4_ops.kernels import indexer_q as kernels
from torch_dsv4_ops.ops import indexer_q as ops
from torch_dsv4_ops.ops.indexer_q import fused_indexer_q_rope_quant, pack_seq_triton, unpack_seq_triton
from torch_dsv4_ops.testing import (as_bytes, assert_bitwise_equal, check_compile, check_cuda_graph, implementation,
                                    nonzero_share, patched_constants, poison_, random_bytes_, sync_debug_error)

Q_OP = torch.ops.dsv4.fused_indexer_q_rope_quant.default
Q_OUT = torch.ops.dsv4.fused_indexer_q_rope_quant_out.default
PACK, PACK_OUT = torch.ops.dsv4.pack_seq_triton.default, torch.ops.dsv4.pack_seq_triton_out.default
UNPACK, UNPACK_OUT = torch.ops.dsv4.unpack_seq_triton.default, torch.ops.dsv4.unpack_seq_triton_out.default
DIM, ROPE, PAIRS = 128, 64, 32                  # SPEC §3.9: 128 dims, RoPE on the last 64 (32 GPT-J pairs)
INT64_MIN, INT32_MIN, INT32_MAX = -2**63, -2**31, 2**31 - 1
IMPLS = ["reference", "kernel"]
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


# --- independent oracle: IEEE rounding, e4m3, UE8M0 ---------------------------------------------------------------
def round_float(v: float, man: int, emin: int = -126, emax: int = 127) -> float:
    """v (a double, or an exact Fraction) rounded to nearest-even into a binary float with `man` fraction bits
    (fp32: 23, bf16: 7), subnormals below 2**emin, +-inf past the largest finite. Zeros and non-finite values
    pass through."""
    if isinstance(v, float) and (v == 0 or not math.isfinite(v)):
        return v
    fr = Fraction(v)
    if fr == 0:
        return 0.0
    sign, a = (-1 if fr < 0 else 1), abs(fr)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    ulp = Fraction(2) ** (max(e, emin) - man)
    n, rem = divmod(a, ulp)
    if rem > ulp / 2 or (rem == ulp / 2 and n % 2 == 1):
        n += 1
    res = n * ulp
    return sign * math.inf if res >= Fraction(2) ** (emax + 1) else sign * float(res)


def f32(v) -> float:
    return round_float(v, 23)


def bf16(v) -> float:
    return round_float(v, 7)


def ieee_add(a: float, b: float) -> float:
    """fp32 a + b (fp32 operands), exactly rounded; an exact zero is -0 only when both operands are -0."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return a + b
    s = Fraction(a) + Fraction(b)
    if s == 0:
        return -0.0 if (math.copysign(1, a) < 0 and math.copysign(1, b) < 0) else 0.0
    return f32(s)


def oracle_q(pos: list, q: list, cs: list, w: list, softmax_scale: float, head_scale: float, fnuz: bool):
    """(codes [T][H][128], weights_out [T][H]) from Python lists: q[t][h] 128 floats (bf16 values), cs[p] 64
    floats, w[t][h] floats."""
    fmt, ss, hs = FMT[fnuz], f32(softmax_scale), f32(head_scale)
    codes, weights = [], []
    for t, p in enumerate(pos):
        if not 0 <= p < len(cs):
            codes.append([[0] * DIM for _ in q[t]])
            weights.append([0.0] * len(q[t]))
            continue
        cos, sin = cs[p][:PAIRS], cs[p][PAIRS:]
        crow, wrow = [], []
        for h, x in enumerate(q[t]):
            row = list(x[:ROPE])
            for i in range(PAIRS):
                e, o = x[ROPE + 2 * i], x[ROPE + 2 * i + 1]
                row.append(bf16(ieee_add(f32(e * cos[i]), -f32(o * sin[i]))))      # products exact in double
                row.append(bf16(ieee_add(f32(o * cos[i]), f32(e * sin[i]))))
            amax = max((abs(v) for v in row if not math.isnan(v)), default=0.0)
            ex = oracle_exponent(amax, fmt.fp8_max)
            crow.append([fmt.encode(v * 2.0 ** -ex) for v in row])
            wrow.append(f32(f32(f32(w[t][h] * 2.0 ** ex) * ss) * hs))
        codes.append(crow)
        weights.append(wrow)
    return codes, weights


def rope_table(max_pos: int, dtype=torch.float32, theta: float = 10000.0) -> torch.Tensor:
    """A [max_pos, 64] cos/sin cache ([cos_0..cos_31, sin_0..sin_31] rows), angles p * theta**(-i/32)."""
    inv = theta ** (-torch.arange(PAIRS, dtype=torch.float64) / PAIRS)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    return torch.cat([ang.cos(), ang.sin()], 1).to(dtype)


def random_q(t: int, h: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(t, h, DIM, generator=g)
            * torch.exp2(torch.randint(-10, 10, (t, h, 1), generator=g).float())).to(torch.bfloat16)


def expected_q(pos, q, cs, w, ss, hs, fnuz):
    codes, weights = oracle_q(pos.tolist(), q.float().tolist(), cs.float().tolist(), w.float().tolist(), ss, hs,
                              fnuz)
    return torch.tensor(codes, dtype=torch.uint8).view(q.shape), torch.tensor(weights, dtype=torch.float32)


def test_oracle_self_check():
    """The oracle against literal values, so a broken oracle cannot make the exact tests vacuous."""
    assert f32(1 / 3) == struct.unpack("<f", struct.pack("<f", 1 / 3))[0]
    assert bf16(f32(1 / 3)) == 0.333984375 and bf16(1.00390625) == 1.0 and bf16(1.01171875) == 1.015625
    assert f32(2.0 ** -149 * 0.75) == 2.0 ** -149 and f32(3.5e38) == math.inf and f32(-2.0 ** -151) == -0.0
    assert math.copysign(1, ieee_add(-0.0, -0.0)) < 0 and math.copysign(1, ieee_add(-0.0, 0.0)) > 0
    assert ieee_add(1.0, 2.0 ** -24) == 1.0 and ieee_add(1.0, 2.0 ** -23 + 2.0 ** -40) == 1.0 + 2.0 ** -23
    ocp, fnuz = FMT[False], FMT[True]
    assert [ocp.encode(v) for v in (448.0, 1.0, -0.5, 2.0, 1e9, -0.0, math.nan)] == \
        [0x7E, 0x38, 0xB0, 0x40, 0x7E, 0x80, 0x7F]
    assert [fnuz.encode(v) for v in (224.0, 1.0, 0.5, -0.0, math.nan, -math.inf)] == [0x7E, 0x40, 0x38, 0, 0x80, 0xFE]
    assert [oracle_exponent(v, 448.0) for v in (448.0, 450.0, 0.0, math.inf)] == [0, 1, -22, 120]
    assert [oracle_exponent(v, 224.0) for v in (224.0, 448.0, 0.0)] == [0, 1, -21]


# --- fused_indexer_q_rope_quant: literal worked example ----------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_q_worked_example(device, impl):
    """cos/sin rows: row 0 = identity (cos 1, sin 0); row 1 = a quarter turn of pair 0 (cos_0 0, sin_0 1) and
    cos_1 = fp32(1/3), sin_1 = 0. One head, w = 2, softmax_scale 0.5, head_scale 0.25.
    * token 0 (position 1): q[0] = 448, q[64] = 1, q[65] = -2, q[66] = 1 -> pair 0: e' = 1*0 - (-2)*1 = 2,
      o' = -2*0 + 1*1 = 1; pair 1: e' = bf16(fp32(1/3)) = 0.333984375. amax 448:
      OCP e = 0: codes[0, 64, 65, 66] = 0x7E (448), 0x40 (2), 0x38 (1), 0x2B (0.34375); weight 2*0.5*0.25 = 0.25.
      FNUZ buffer (FP8_MAX 224) e = 1: 224 -> 0x7E, 1 -> 0x40, 0.5 -> 0x38, 0.1669921875 -> 0x2B (0.171875);
      weight 0.5.
    * token 1 (position 0): q[5] = -0.0, q[64] = bf16(3e-5) = 126 * 2**-22, the rest 0: amax under the 1e-4
      floor, e = -22 (OCP) / -21 (FNUZ): q[5] -> 0x80 (OCP -0) / 0x00 (FNUZ has no -0); q[64] -> 126 (OCP) / 63
      (FNUZ), both rounding to 0x70 (128 / 64); weight 2**-22 / 4 (OCP), 2**-21 / 4 (FNUZ).
    * tokens 2 (position -1) and 3 (position 2 = max_pos): zero codes and zero weights."""
    cs = torch.zeros(2, ROPE)
    cs[0, :PAIRS] = 1.0
    cs[1, 0], cs[1, PAIRS], cs[1, 1] = 0.0, 1.0, 1 / 3
    q = torch.zeros(4, 1, DIM)
    q[0, 0, 0], q[0, 0, 64], q[0, 0, 65], q[0, 0, 66] = 448.0, 1.0, -2.0, 1.0
    q[1, 0, 5], q[1, 0, 64] = -0.0, 3e-5
    q[2:, 0, :] = 7.0
    q = q.to(torch.bfloat16)
    pos = torch.tensor([1, 0, -1, 2])
    w = torch.full((4, 1), 2.0)
    assert bf16(3e-5) == 126 * 2.0 ** -22
    for dtype, fnuz in ((torch.uint8, False), (torch.float8_e4m3fn, False), (torch.float8_e4m3fnuz, True)):
        q_fp8 = poison_(torch.empty(4, 1, DIM, dtype=dtype, device=device))
        w_out = torch.full((4, 1), -5.0, device=device)
        with implementation(impl, device):
            got_q, got_w = fused_indexer_q_rope_quant(pos.to(device), q.to(device), cs.to(device), w.to(device), 0.5,
                                                      0.25, output_buffers=(q_fp8, w_out))
        assert got_q is q_fp8 and got_w is w_out
        codes, wts = q_fp8.cpu().view(torch.uint8)[:, 0], w_out.cpu()[:, 0].tolist()
        if not fnuz:
            assert codes[0, [0, 64, 65, 66]].tolist() == [0x7E, 0x40, 0x38, 0x2B]
            assert codes[1, [5, 64]].tolist() == [0x80, 0x70] and wts[:2] == [0.25, 2.0 ** -22 / 4]
        else:
            assert codes[0, [0, 64, 65, 66]].tolist() == [0x7E, 0x40, 0x38, 0x2B]
            assert codes[1, [5, 64]].tolist() == [0x00, 0x70] and wts[:2] == [0.5, 2.0 ** -21 / 4]
        others = torch.ones(DIM, dtype=torch.bool)
        others[[0, 64, 65, 66]] = False
        assert codes[0, others].eq(0).all() and codes[2:].eq(0).all() and wts[2:] == [0.0, 0.0]
        assert codes[1, [i for i in range(DIM) if i not in (5, 64)]].eq(0).all()
        # the same values from the oracle (which the random tests rely on)
        e_codes, e_w = expected_q(pos, q, cs, w, 0.5, 0.25, fnuz)
        assert torch.equal(codes, e_codes[:, 0]) and e_w[:, 0].tolist() == wts


# --- exactness against the oracle ------------------------------------------------------------------------------------
Q_CASES = {
    # name: (T, H, cos/sin dtype, weights dtype, positions dtype, strided inputs, output form)
    "t7-h5-fp32-fp32-i64-contig-functional": (7, 5, torch.float32, torch.float32, torch.int64, False, "functional"),
    "t3-h16-bf16-bf16-i32-strided-uint8": (3, 16, torch.bfloat16, torch.bfloat16, torch.int32, True, "uint8"),
    "t12-h1-fp16-fp32-i64-strided-float8": (12, 1, torch.float16, torch.float32, torch.int64, True, "float8"),
    "t5-h3-fp32-bf16-i32-contig-fnuz": (5, 3, torch.float32, torch.bfloat16, torch.int32, False, "fnuz"),
}


def q_inputs(t, h, cs_dtype, w_dtype, pos_dtype, strided, seed, max_pos=300):
    """Random inputs with hostile positions (-1, INT_MIN, max_pos, max_pos + 5 where T allows) and, when
    `strided`, every input a non-contiguous view of a NaN-filled buffer (so a stray read shows)."""
    g = torch.Generator().manual_seed(seed)
    q = random_q(t, h, g)
    cs = rope_table(max_pos, cs_dtype) * (1 + 0.01 * torch.randn(max_pos, ROPE, generator=g)).to(cs_dtype)
    pos = torch.randint(0, max_pos, (t,), generator=g)
    hostile = [-1, INT32_MIN if pos_dtype == torch.int32 else INT64_MIN, max_pos, max_pos + 5]
    for i, p in zip(range(1, t, 2), hostile):
        pos[i] = p
    pos = pos.to(pos_dtype)
    w = torch.randn(t, h, generator=g).to(w_dtype)
    if strided:
        qb = torch.full((t, h + 1, DIM + 8), float("nan"), dtype=torch.bfloat16)
        qb[:, :h, 4:4 + DIM] = q
        q = qb[:, :h, 4:4 + DIM]
        cb = torch.full((max_pos, ROPE + 16), float("nan"), dtype=cs_dtype)
        cb[:, :ROPE] = cs
        cs = cb[:, :ROPE]
        w = w.t().contiguous().t()
        pb = torch.zeros(t, 2, dtype=pos_dtype)
        pb[:, 0] = pos
        pos = pb[:, 0]
    return pos, q, cs, w


@pytest.mark.parametrize("case", list(Q_CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_q_exact(device, impl, case):
    t, h, cs_dtype, w_dtype, pos_dtype, strided, form = Q_CASES[case]
    seed = len(case) + 3 * t + h
    pos, q, cs, w = q_inputs(t, h, cs_dtype, w_dtype, pos_dtype, strided, seed)
    # the model's scales, and head scales that are not powers of two (the association order then matters)
    ss, hs = layout.INDEXER_DIM ** -0.5, {7: 64 ** -0.5, 3: 0.3, 12: 1 / 7, 5: 16 ** -0.5 * 1.1}[t]
    dtype = {"functional": torch.uint8, "uint8": torch.uint8, "float8": torch.float8_e4m3fn,
             "fnuz": torch.float8_e4m3fnuz}[form]
    fnuz = ops.q_format(dtype, torch.device(device)) is layout.E4M3FNUZ
    assert fnuz == (form == "fnuz") or device.type == "cuda"
    exp_codes, exp_w = expected_q(pos, q, cs, w, ss, hs, fnuz)
    args = [a.to(device) for a in (pos, q, cs, w)] + [ss, hs]
    with implementation(impl, device):
        if form == "functional":
            got_q, got_w = fused_indexer_q_rope_quant(*args)
            assert got_q.dtype == ops.platform_e4m3_dtype(device) and got_q.is_contiguous()
            assert got_w.dtype == torch.float32
        else:
            # buffers with padded rows and a transposed weights_out, poisoned
            qb = poison_(torch.empty(t, h, DIM + 16, dtype=dtype, device=device))
            wb = torch.full((h, t + 3), -7.0, device=device)
            got_q, got_w = fused_indexer_q_rope_quant(*args, output_buffers=(qb[:, :, 8:8 + DIM], wb[:, :t].t()))
            guard = qb.view(torch.uint8)
            assert guard[:, :, :8].eq(0xA5).all() and guard[:, :, 8 + DIM:].eq(0xA5).all()
            assert wb[:, t:].eq(-7.0).all()
    assert_bitwise_equal(got_q.cpu().view(torch.uint8), exp_codes, f"{case}: q_fp8 vs oracle")
    assert_bitwise_equal(got_w.cpu().contiguous(), exp_w, f"{case}: weights_out vs oracle")
    assert nonzero_share(exp_codes) > 0.5


@pytest.mark.parametrize("fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("impl", IMPLS)
def test_q_ue8m0_edges(device, impl, fnuz):
    """amax = 448 * 2**j (= 224 * 2**(j+1)) for j in [-30, 100] and its bf16 neighbours, 0 and around the 1e-4
    floor, max bf16, placed in the NoPE or the RoPE half (identity rope: cos 1, sin 0); w = 1 and both scales 1,
    so weights_out = 2**e exactly. SPEC §4 d: amax 448 gives e = 0, the next bf16 above gives e = 1 (OCP)."""
    g = torch.Generator().manual_seed(11)
    amaxes = []
    for j in range(-30, 101, 3):
        b = torch.tensor([448.0 * 2.0 ** j]).bfloat16().view(torch.int16)
        amaxes += [(b + k).view(torch.bfloat16).item() for k in (-1, 0, 1)]
    amaxes += [0.0, 1e-4, 9.9e-5, torch.finfo(torch.bfloat16).max]
    n = len(amaxes)
    h = 4
    t = -(-n // h)
    a = torch.tensor(amaxes + [1.0] * (t * h - n))
    rows = (torch.rand(t * h, DIM, generator=g) * 2 - 1) * a[:, None]
    col = torch.randint(0, DIM, (t * h,), generator=g)
    rows[torch.arange(t * h), col] = a * (torch.randint(0, 2, (t * h,), generator=g) * 2 - 1)
    q = rows.to(torch.bfloat16).view(t, h, DIM)
    cs = torch.cat([torch.ones(1, PAIRS), torch.zeros(1, PAIRS)], 1)
    pos, w = torch.zeros(t, dtype=torch.int64), torch.ones(t, h)
    exp_codes, exp_w = expected_q(pos, q, cs, w, 1.0, 1.0, fnuz)
    qb = torch.empty(t, h, DIM, dtype=torch.float8_e4m3fnuz if fnuz else torch.uint8, device=device)
    wb = torch.empty(t, h, device=device)
    with implementation(impl, device):
        fused_indexer_q_rope_quant(pos.to(device), q.to(device), cs.to(device), w.to(device), 1.0, 1.0,
                                   output_buffers=(qb, wb))
    assert_bitwise_equal(qb.cpu().view(torch.uint8), exp_codes, "UE8M0 edge rows")
    assert_bitwise_equal(wb.cpu(), exp_w, "2**e of the edge rows")
    i448 = 3 * 10 + 1                                                   # j = 0
    assert amaxes[i448] == 448.0 and amaxes[i448 + 1] == 450.0
    assert exp_w.view(-1)[i448].item() == (1.0 if not fnuz else 2.0)
    assert exp_w.view(-1)[i448 + 1].item() == (2.0 if not fnuz else 4.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_q_nan_inf(device, impl):
    """NaN is left out of the amax and stored as the positive NaN code (0x7F OCP); +-inf saturate to 0x7E/0xFE
    with e = 120 (inf counts as the largest fp32); a NaN weight stays NaN. Kernel vs reference bit for bit, plus
    the literal codes."""
    g = torch.Generator().manual_seed(12)
    q = random_q(3, 2, g)
    q[0, 0, 3], q[0, 0, 70] = float("nan"), float("nan")
    q[0, 1, 10], q[0, 1, 100] = float("inf"), -float("inf")
    q[1, 0, :] = float("nan")
    cs = rope_table(8)
    pos = torch.tensor([0, 3, 7])
    w = torch.randn(3, 2, generator=g)
    w[2, 1] = float("nan")
    with implementation("reference", torch.device("cpu")):
        ref_q, ref_w = fused_indexer_q_rope_quant(pos, q, cs, w, 0.5, 0.125)
    with implementation(impl, device):
        got_q, got_w = fused_indexer_q_rope_quant(pos.to(device), q.to(device), cs.to(device), w.to(device), 0.5,
                                                  0.125)
    assert_bitwise_equal(got_q.cpu().view(torch.uint8), ref_q.view(torch.uint8), "NaN/inf codes")
    assert_bitwise_equal(got_w.cpu(), ref_w, "NaN/inf weights")
    c = ref_q.view(torch.uint8)
    assert c[0, 0, 3] == 0x7F and c[0, 0, 70] == 0x7F and c[1, 0].eq(0x7F).all()
    assert c[0, 1, 10] == 0x7E and c[0, 1, 100] == 0xFE and ref_w[0, 1].item() == w[0, 1].item() * 2.0 ** 120 / 16
    assert ref_w[2, 1].view(torch.int32).item() == 0x7FC00000        # NaN weights: one bit pattern
    # the finite rows agree with the oracle too
    e_codes, e_w = expected_q(pos[2:], q[2:, :1], cs, w[2:, :1], 0.5, 0.125, False)
    assert torch.equal(c[2:, :1], e_codes) and torch.equal(ref_w[2:, :1], e_w)


@pytest.mark.parametrize("impl", IMPLS)
def test_q_empty(device, impl):
    """T = 0: correctly shaped empty outputs, nothing launched (SPEC R5); max_pos = 0: every position invalid."""
    with implementation(impl, device):
        q_fp8, w = fused_indexer_q_rope_quant(torch.zeros(0, dtype=torch.int64, device=device),
                                              torch.zeros(0, 4, DIM, dtype=torch.bfloat16, device=device),
                                              torch.zeros(5, ROPE, device=device), torch.zeros(0, 4, device=device),
                                              1.0, 1.0)
        assert q_fp8.shape == (0, 4, DIM) and w.shape == (0, 4)
        q_fp8, w = fused_indexer_q_rope_quant(torch.tensor([0, 3], device=device),
                                              torch.ones(2, 3, DIM, dtype=torch.bfloat16, device=device),
                                              torch.zeros(0, ROPE, device=device), torch.ones(2, 3, device=device),
                                              1.0, 1.0)
    assert q_fp8.cpu().view(torch.uint8).eq(0).all() and w.cpu().eq(0).all()


def _q_args(device):
    return dict(positions=torch.zeros(3, dtype=torch.int64, device=device),
                index_q=torch.zeros(3, 2, DIM, dtype=torch.bfloat16, device=device),
                cos_sin_cache=torch.zeros(10, ROPE, device=device), index_weights=torch.zeros(3, 2, device=device),
                softmax_scale=0.1, head_scale=0.2)


Q_BAD = [
    (lambda a, dev: a.update(index_q=a["index_q"].float()), "index_q"),
    (lambda a, dev: a.update(index_q=torch.zeros(3, 2, 64, dtype=torch.bfloat16, device=dev)), "index_q"),
    (lambda a, dev: a.update(index_q=torch.zeros(3, 0, DIM, dtype=torch.bfloat16, device=dev)), "index_q"),
    (lambda a, dev: a.update(index_q=torch.zeros(3, DIM, 2, dtype=torch.bfloat16, device=dev).transpose(1, 2)),
     "index_q"),
    (lambda a, dev: a.update(index_q=torch.zeros(3, 2 * DIM, dtype=torch.bfloat16, device=dev)), "index_q"),
    (lambda a, dev: a.update(positions=a["positions"].float()), "positions"),
    (lambda a, dev: a.update(positions=torch.zeros(4, dtype=torch.int64, device=dev)), "positions"),
    (lambda a, dev: a.update(positions=torch.zeros(3, 1, dtype=torch.int64, device=dev)), "positions"),
    (lambda a, dev: a.update(cos_sin_cache=torch.zeros(10, 32, device=dev)), "cos_sin_cache"),
    (lambda a, dev: a.update(cos_sin_cache=torch.zeros(10, ROPE, dtype=torch.float64, device=dev)), "cos_sin_cache"),
    (lambda a, dev: a.update(cos_sin_cache=torch.zeros(ROPE, 10, device=dev).t()), "cos_sin_cache"),
    (lambda a, dev: a.update(index_weights=torch.zeros(3, 3, device=dev)), "index_weights"),
    (lambda a, dev: a.update(index_weights=torch.zeros(3, 2, dtype=torch.float16, device=dev)), "index_weights"),
]


@pytest.mark.parametrize("mutate,word", Q_BAD, ids=range(len(Q_BAD)))
@pytest.mark.parametrize("impl", IMPLS)
def test_q_bad_input(device, impl, mutate, word):
    args = _q_args(device)
    mutate(args, device)
    with implementation(impl, device), pytest.raises(ValueError, match=rf"\b{word}\b"):
        fused_indexer_q_rope_quant(**args)


Q_OUT_BAD = [
    (lambda dev: (torch.zeros(3, 2, DIM, dtype=torch.int8, device=dev), torch.zeros(3, 2, device=dev)), "q_fp8"),
    (lambda dev: (torch.zeros(3, 2, 64, dtype=torch.uint8, device=dev), torch.zeros(3, 2, device=dev)), "q_fp8"),
    (lambda dev: (torch.zeros(3, DIM, 2, dtype=torch.uint8, device=dev).transpose(1, 2), torch.zeros(3, 2, device=dev)),
     "q_fp8"),
    (lambda dev: (torch.zeros(3, 2, DIM, dtype=torch.float8_e5m2, device=dev), torch.zeros(3, 2, device=dev)),
     "q_fp8"),
    (lambda dev: (torch.zeros(3, 2, DIM, dtype=torch.uint8, device=dev), torch.zeros(3, 2, 1, device=dev)),
     "weights_out"),
    (lambda dev: (torch.zeros(3, 2, DIM, dtype=torch.uint8, device=dev), torch.zeros(2, 3, device=dev)),
     "weights_out"),
    (lambda dev: (torch.zeros(3, 2, DIM, dtype=torch.uint8, device=dev),
                  torch.zeros(3, 2, dtype=torch.bfloat16, device=dev)), "weights_out"),
]


@pytest.mark.parametrize("buffers,word", Q_OUT_BAD, ids=range(len(Q_OUT_BAD)))
@pytest.mark.parametrize("impl", IMPLS)
def test_q_bad_output_buffers(device, impl, buffers, word):
    bufs = buffers(device)
    before = [b.cpu().clone() for b in bufs]
    with implementation(impl, device), pytest.raises(ValueError, match=rf"\b{word}\b"):
        fused_indexer_q_rope_quant(**_q_args(device), output_buffers=bufs)
    assert all(torch.equal(b.cpu(), c) for b, c in zip(bufs, before)), "buffers untouched on error"


@pytest.mark.parametrize("impl", IMPLS)
def test_q_fp4_not_implemented(device, impl):
    with implementation(impl, device), pytest.raises(NotImplementedError, match="use_fp4"):
        fused_indexer_q_rope_quant(**_q_args(device), use_fp4=True)


# --- pack / unpack ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_seq_worked_example(device, impl):
    """x rows 10, 11, ..., 16 (T = 7); lengths [2, 0, -1, 3, 4] -> starts [0, 2, 2, 2, 5].
    pack, max_len 3, pad -inf: [[10, 11, -inf], [-inf]*3, [-inf]*3, [12, 13, 14], [15, 16, -inf]] (request 4's
    third row would be x row 7, past T: padding).
    unpack of that, total 11: request 4 covers rows 5..8 with L = 3 packed rows (15, 16, -inf) and a zero
    row 8 (i = 3 >= L); rows 9 and 10 are past the lengths' sum: zeros."""
    x = torch.arange(10, 17, dtype=torch.float32)[:, None]
    lens = torch.tensor([2, 0, -1, 3, 4], dtype=torch.int32)
    inf = -math.inf
    with implementation(impl, device):
        packed = pack_seq_triton(x.to(device), lens.to(device), max_len=3)
        flat = unpack_seq_triton(packed, lens.to(device), total=11)
    assert packed.cpu()[:, :, 0].tolist() == [[10, 11, inf], [inf] * 3, [inf] * 3, [12, 13, 14], [15, 16, inf]]
    assert flat.cpu()[:, 0].tolist() == [10, 11, 12, 13, 14, 15, 16, inf, 0, 0, 0]


def oracle_pack(xb: list, lens: list, max_len: int, pad_bits: int, row: int) -> list:
    """[B][max_len][row] bit patterns."""
    out, start = [], 0
    for n in lens:
        n = max(n, 0)
        out.append([xb[start + i] if i < n and start + i < len(xb) else [pad_bits] * row for i in range(max_len)])
        start += n
    return out


def oracle_unpack(xb: list, lens: list, total: int, row: int) -> list:
    """[total][row] bit patterns; uncovered rows zero."""
    out, start = [[0] * row for _ in range(total)], 0
    for b, n in enumerate(lens):
        n = max(n, 0)
        for i in range(min(n, len(xb[b]))):
            if start + i < total:
                out[start + i] = xb[b][i]
        start += n
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_OF_SIZE[t.element_size()])


SEQ_CASES = {
    # name: (dtype, row shape, lengths, max_len, layout of x, pad)
    "fp32-row3-neg-lengths": (torch.float32, (3,), [4, -3, 0, 6, 2], 5, "contiguous", -math.inf),
    "bf16-2x5-past-T": (torch.bfloat16, (2, 5), [3, 2, INT32_MAX, 4], 3, "contiguous", 0.5),
    "fp16-wide-row": (torch.float16, (700,), [2, 1, 3], 2, "padded", -math.inf),
    "int64-transposed": (torch.int64, (9,), [1, 5, 3], 4, "transposed", -2**40),
    "int32-scalar-rows": (torch.int32, (), [7, 0, 30, 2], 32, "strided", -1),
    "uint8-row16": (torch.uint8, (16,), [5, 5], 6, "contiguous", 255),
    "bool-row4": (torch.bool, (4,), [2, 3], 3, "contiguous", True),
    "e4m3-row32-nan-pad": (torch.float8_e4m3fn, (32,), [3, 1], 2, "contiguous", math.nan),
    "fp32-row600-two-column-steps": (torch.float32, (600,), [5, 1, 4], 5, "contiguous", -1.0),
}


def seq_input(dtype, shape, t, lay, g):
    """x [t, *shape]: random values (NaNs with payloads for floats), in the requested memory layout."""
    raw = random_bytes_(torch.empty((t,) + shape, dtype=dtype), g) if dtype != torch.bool else \
        torch.randint(0, 2, (t,) + shape, generator=g).bool()
    if lay == "padded":
        return raw if not shape else torch.cat([raw, raw[..., :5]], -1)[..., :shape[-1]]
    if lay == "transposed":
        return raw.t().contiguous().t()
    if lay == "strided":
        return torch.stack([raw, raw], 1)[:, 0]
    return raw


@pytest.mark.parametrize("case", list(SEQ_CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_pack_unpack_exact(device, impl, case):
    dtype, shape, lens, max_len, lay, pad = SEQ_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    t = sum(max(n, 0) for n in lens if n < 1000) - 1                    # one row short of the lengths' sum
    x = seq_input(dtype, shape, t, lay, g)
    row = math.prod(shape)
    xb = bits(x).reshape(t, row).tolist()
    pad_bits = int(bits(torch.tensor([pad]).to(dtype))[0]) if dtype.is_floating_point else \
        int(bits(torch.tensor([pad], dtype=dtype))[0])
    lengths = torch.tensor(lens, dtype=torch.int32 if len(lens) % 2 else torch.int64)
    out = poison_(torch.empty((len(lens), max_len) + shape, dtype=dtype, device=device))
    with implementation(impl, device):
        got = pack_seq_triton(x.to(device), lengths.to(device), pad, max_len=max_len)
        got_out = pack_seq_triton(x.to(device), lengths.to(device), pad, max_len=max_len, out=out)
    assert got_out is out
    expected = torch.tensor(oracle_pack(xb, lens, max_len, pad_bits, row), dtype=INT_OF_SIZE[x.element_size()])
    for what, res in (("functional", got), ("out", out)):
        assert res.shape == (len(lens), max_len) + shape and res.dtype == dtype
        assert_bitwise_equal(bits(res.cpu()).reshape(len(lens), max_len, row), expected, f"{case} pack {what}")
    # unpack the packed rows back (total: past the sum, and short of it)
    packed = expected.view(dtype).reshape((len(lens), max_len) + shape)
    pk = bits(packed).reshape(len(lens), max_len, row).tolist()
    for total in (t + 4, max(t - 3, 0)):
        ub = poison_(torch.empty((total + 2,) + shape, dtype=dtype, device=device))
        with implementation(impl, device):
            res = unpack_seq_triton(packed.to(device), lengths.to(device), total=total, out=ub[:total])
            fresh = unpack_seq_triton(packed.to(device), lengths.to(device), total=total)
        exp_u = torch.tensor(oracle_unpack(pk, lens, total, row), dtype=INT_OF_SIZE[x.element_size()])
        exp_u = exp_u.reshape(total, row)
        for what, r in (("out", res), ("functional", fresh)):
            assert_bitwise_equal(bits(r.cpu()).reshape(total, row), exp_u, f"{case} unpack total={total} {what}")
        if dtype != torch.bool:
            assert as_bytes(ub.cpu()[total:]).eq(0xA5).all(), "rows past total untouched"


def _steps_past_one(case: str) -> bool:
    dtype, shape, _, max_len, _, _ = SEQ_CASES[case]
    return max_len > kernels.seq_tile(math.prod(shape), dtype.itemsize)[0]


@pytest.mark.parametrize("case", [c for c in SEQ_CASES if _steps_past_one(c)])
def test_pack_unpack_one_program_walks_every_step(device, case):
    """PACK_MAX_WORKERS = 1: each request's one program walks all its rows a step at a time (the loop past its first
    step, which only calls longer than a step per program take otherwise), narrow and wide rows (the wide row also
    takes two column steps); PACK_BLOCK_B = 2: the requests' start offsets summed over several steps (otherwise
    only past 256 requests); the exact test's checks."""
    with patched_constants(kernels, [ops._PACK_PLANS, ops._UNPACK_PLANS], PACK_MAX_WORKERS=1, PACK_BLOCK_B=2):
        test_pack_unpack_exact(device, "kernel", case)


@pytest.mark.parametrize("impl", IMPLS)
def test_unpack_lengths_past_width_and_round_trip(device, impl):
    """len_b > L: rows L..len_b-1 of the request are zero; B = 0 with total > 0: all zeros; pack then unpack
    with lengths <= max_len and total = sum gives x back."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2, 6, generator=g)
    lens = torch.tensor([4, 2, 3])
    with implementation(impl, device):
        out = unpack_seq_triton(x.to(device), lens.to(device), total=9).cpu()
        empty = unpack_seq_triton(torch.zeros(0, 2, 6, device=device), torch.zeros(0, dtype=torch.int64,
                                                                                   device=device), total=3).cpu()
        y = torch.randn(10, 3, 4, generator=g).to(torch.bfloat16)
        ylens = torch.tensor([3, 1, 4, 0, 2], dtype=torch.int32)
        back = unpack_seq_triton(pack_seq_triton(y.to(device), ylens.to(device), max_len=4), ylens.to(device),
                                 total=10).cpu()
    assert torch.equal(out[0:2], x[0]) and out[2:4].eq(0).all() and torch.equal(out[4:6], x[1])
    assert torch.equal(out[6:8], x[2]) and out[8].eq(0).all()
    assert empty.shape == (3, 6) and empty.eq(0).all()
    assert torch.equal(back, y)


@pytest.mark.parametrize("impl", IMPLS)
def test_seq_empty(device, impl):
    """B = 0, max_len = 0, T = 0 and total = 0: correctly shaped outputs (T = 0: all padding)."""
    with implementation(impl, device):
        a = pack_seq_triton(torch.zeros(5, 3, device=device), torch.zeros(0, dtype=torch.int32, device=device),
                            max_len=4)
        b = pack_seq_triton(torch.zeros(5, 3, device=device), torch.tensor([2, 3], device=device), max_len=0)
        c = pack_seq_triton(torch.zeros(0, 3, device=device), torch.tensor([2, 3], device=device), -1.0, max_len=2)
        d = unpack_seq_triton(torch.ones(2, 3, 4, device=device), torch.tensor([2, 3], device=device), total=0)
    assert a.shape == (0, 4, 3) and b.shape == (2, 0, 3) and d.shape == (0, 4)
    assert c.shape == (2, 2, 3) and c.cpu().eq(-1.0).all()


SEQ_BAD = [
    (lambda dev: pack_seq_triton(torch.zeros(4, 2, dtype=torch.int32, device=dev), torch.ones(2, device=dev,
                                                                                              dtype=torch.int32),
                                 max_len=2), "pad_value"),
    (lambda dev: pack_seq_triton(torch.zeros(4, 2, dtype=torch.bfloat16, device=dev),
                                 torch.ones(2, dtype=torch.int32, device=dev), 0.1, max_len=2), "pad_value"),
    (lambda dev: pack_seq_triton(torch.zeros(4, 2, dtype=torch.int8, device=dev),
                                 torch.ones(2, dtype=torch.int32, device=dev), 200, max_len=2), "pad_value"),
    (lambda dev: pack_seq_triton(torch.zeros(4, 2, device=dev), torch.ones(2, device=dev), max_len=2), "lengths"),
    (lambda dev: pack_seq_triton(torch.zeros(4, 2, device=dev), torch.ones(2, 1, dtype=torch.int32, device=dev),
                                 max_len=2), "lengths"),
    (lambda dev: pack_seq_triton(torch.zeros(4, 2, device=dev), torch.ones(2, dtype=torch.int32, device=dev),
                                 max_len=-1), "max_len"),
    (lambda dev: pack_seq_triton(torch.zeros(4, 2, 3, device=dev).transpose(1, 2),
                                 torch.ones(2, dtype=torch.int32, device=dev), max_len=2), "x"),
    (lambda dev: pack_seq_triton(torch.zeros(4, 2, device=dev), torch.ones(2, dtype=torch.int32, device=dev),
                                 max_len=2, out=torch.zeros(2, 3, 2, device=dev)), "out"),
    (lambda dev: pack_seq_triton(torch.zeros(4, 2, device=dev), torch.ones(2, dtype=torch.int32, device=dev),
                                 max_len=2, out=torch.zeros(2, 2, 2, dtype=torch.float16, device=dev)), "out"),
    (lambda dev: unpack_seq_triton(torch.zeros(4, device=dev), torch.ones(4, dtype=torch.int32, device=dev),
                                   total=3), "x"),
    (lambda dev: unpack_seq_triton(torch.zeros(4, 2, device=dev), torch.ones(3, dtype=torch.int32, device=dev),
                                   total=3), "lengths"),
    (lambda dev: unpack_seq_triton(torch.zeros(4, 2, device=dev), torch.ones(4, dtype=torch.int32, device=dev),
                                   total=-2), "total"),
    (lambda dev: unpack_seq_triton(torch.zeros(4, 2, 3, device=dev), torch.ones(4, dtype=torch.int32, device=dev),
                                   total=3, out=torch.zeros(3, 2, device=dev)), "out"),
]


@pytest.mark.parametrize("call,word", SEQ_BAD, ids=range(len(SEQ_BAD)))
@pytest.mark.parametrize("impl", IMPLS)
def test_seq_bad_input(device, impl, call, word):
    with implementation(impl, device), pytest.raises(ValueError, match=rf"\b{word}\b"):
        call(device)


@pytest.mark.parametrize("impl", IMPLS)
def test_seq_complex_not_implemented(device, impl):
    with implementation(impl, device), pytest.raises(NotImplementedError, match="x"):
        pack_seq_triton(torch.zeros(3, 2, dtype=torch.complex64, device=device),
                        torch.ones(1, dtype=torch.int32, device=device), 0.0, max_len=2)


# --- composition ----------------------------------------------------------------------------------------------------
def _variants(args):
    """The inputs as given, and with index_q's token/head dims swapped in memory, padded rows, transposed 2-D
    weights and a stride-2 positions vector."""
    pos, q, cs, w = args[:4]
    yield args
    q2 = q.transpose(0, 1).contiguous().transpose(0, 1)
    w2 = w.t().contiguous().t()
    p2 = torch.stack([pos, pos], 1)[:, 0]
    cs2 = torch.cat([cs, cs[:, :8]], 1)[:, :ROPE]
    yield (p2, q2, cs2, w2) + tuple(args[4:])


@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck_q(device, impl):
    from torch_dsv4_ops.ops.indexer_q import q_example

    args = q_example(6, 3, max_pos=64, seed=5, device=device)
    with implementation(impl, device):
        for case in _variants(args):
            torch.library.opcheck(Q_OP, case)
            # uint8 buffers: opcheck's test_schema cannot compare float8 tensors on CPU
            bufs = (torch.zeros(6, 3, DIM, dtype=torch.uint8, device=device), torch.zeros(6, 3, device=device))
            torch.library.opcheck(Q_OUT, tuple(case) + bufs + (False,))
            bufs = (torch.zeros(3, 6, DIM, dtype=torch.uint8, device=device).transpose(0, 1),
                    torch.zeros(3, 6, device=device).t())
            torch.library.opcheck(Q_OUT, tuple(case) + bufs + (False,))


@pytest.mark.parametrize("impl", IMPLS)
def test_q_float8_buffer_mutations(device, impl):
    """The float8-buffer call cannot go through opcheck on CPU: the _out form writes exactly q_fp8 and
    weights_out (as the uint8-buffer call does), every input bit for bit unchanged."""
    from torch_dsv4_ops.ops.indexer_q import q_example

    args = q_example(5, 4, max_pos=32, seed=8, device=device)
    before = [a.clone() for a in args[:4]]
    f8 = (poison_(torch.empty(5, 4, DIM, dtype=torch.float8_e4m3fn, device=device)), torch.zeros(5, 4, device=device))
    u8 = (torch.zeros(5, 4, DIM, dtype=torch.uint8, device=device), torch.zeros(5, 4, device=device))
    with implementation(impl, device):
        Q_OUT(*args, *f8)
        Q_OUT(*args, *u8)
    assert all(torch.equal(a, b) for a, b in zip(args[:4], before))
    assert_bitwise_equal(f8[0].view(torch.uint8), u8[0], "float8 vs uint8 buffer")
    assert_bitwise_equal(f8[1], u8[1], "weights")


@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck_seq(device, impl):
    g = torch.Generator().manual_seed(9)
    x2 = torch.randn(9, 5, generator=g).to(device)
    x3 = torch.randn(9, 2, 3, generator=g).to(device)
    lens = torch.tensor([3, -1, 4, 1], dtype=torch.int32, device=device)
    with implementation(impl, device):
        for x in (x2, x3, x2.t().contiguous().t(), torch.cat([x2, x2[:, :2]], 1)[:, :5]):
            torch.library.opcheck(PACK, (x, lens, -math.inf, 3))
            out = torch.zeros((4, 3) + tuple(x.shape[1:]), device=device)
            torch.library.opcheck(PACK_OUT, (x, lens, 2.5, 3, out))
            packed = torch.randn((4, 3) + tuple(x.shape[1:]), generator=g).to(device)
            torch.library.opcheck(UNPACK, (packed, lens, 10))
            torch.library.opcheck(UNPACK_OUT, (packed, lens.long(), 6, torch.zeros((6,) + tuple(x.shape[1:]),
                                                                                    device=device)))
        xi = torch.randint(-9, 9, (7, 4), generator=g).to(device)
        torch.library.opcheck(PACK, (xi, lens, -1, 2))
        xu = xi.view(7, 2, 2).transpose(0, 1).contiguous().transpose(0, 1)
        torch.library.opcheck(UNPACK, (xu, lens[:1].repeat(7), 9))


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_q_no_recompile(device, impl):
    from torch_dsv4_ops.ops.indexer_q import q_example

    def step(pos, q, cs, w):
        q_fp8, wo = fused_indexer_q_rope_quant(pos, q, cs, w, layout.INDEXER_DIM ** -0.5, 0.125)
        return q_fp8.view(torch.uint8), wo

    def step_out(pos, q, cs, w, qb, wb):
        fused_indexer_q_rope_quant(pos, q, cs, w, 0.25, 0.125, output_buffers=(qb, wb))
        return qb, wb

    inputs = [q_example(t, 4, max_pos=64, seed=t, device=device)[:4] for t in (3, 5, 9)]
    jit = [kernels.indexer_q_rope_quant_kernel]
    with implementation(impl, device):
        check_compile(step, inputs, kernels=jit, new_kernels=1)
        check_compile(step_out, [a + (torch.zeros(a[1].shape, dtype=torch.uint8, device=device),
                                      torch.zeros(a[3].shape, device=device)) for a in inputs], kernels=jit)


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_seq_no_recompile(device, impl):
    def step(x, lens, max_len: int, total: int):
        packed = pack_seq_triton(x, lens, max_len=max_len)
        return packed, unpack_seq_triton(packed, lens, total=total)

    inputs = []
    for b, t in ((2, 7), (3, 11), (5, 13)):
        g = torch.Generator().manual_seed(b)
        lens = torch.randint(-1, 5, (b,), generator=g).int()
        inputs.append((torch.randn(t, 6, 10, generator=g).to(device), lens.to(device), 4, t))   # no duck sizes
    with implementation(impl, device):
        check_compile(step, inputs, kernels=[kernels.pack_seq_kernel, kernels.unpack_seq_kernel], new_kernels=1)


# --- GPU only --------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("cs_dtype", [torch.float32, torch.bfloat16], ids=["cs-fp32", "cs-bf16"])
def test_q_benchmark_sized_exact(cs_dtype):
    """T = 65536, H = 64 (the benchmark's shape), positions up to 1M with 1 in 97 invalid, under sync-debug
    "error", against the reference in chunks of 4096 tokens; plus the platform e4m3 dtype of the result."""
    from torch_dsv4_ops.reference import indexer_q as reference
    from torch_dsv4_ops.reference.k_cache import fp8_format

    g = torch.Generator().manual_seed(31)
    t, h, max_pos = 65536, 64, 1 << 20
    q = random_q(t, h, g)
    cs = rope_table(max_pos, cs_dtype)
    pos = torch.randint(0, max_pos, (t,), generator=g)
    pos[::97] = -1
    pos[5::211] = max_pos
    w = torch.randn(t, h, generator=g)
    dev = [a.cuda() for a in (pos, q, cs, w)]                          # host-to-device copies synchronise: before
    with sync_debug_error():
        q_fp8, wo = fused_indexer_q_rope_quant(*dev, layout.INDEXER_DIM ** -0.5, h ** -0.5)
    fmt = ops.q_format(torch.uint8, q_fp8.device)
    assert q_fp8.dtype == fmt.dtype
    got_q, got_w = q_fp8.view(torch.uint8).cpu(), wo.cpu()
    for lo in range(0, t, 4096):
        sl = slice(lo, lo + 4096)
        codes, ew = reference.fused_indexer_q_rope_quant(pos[sl], q[sl], cs, w[sl], layout.INDEXER_DIM ** -0.5,
                                                         h ** -0.5, fp8_format(fmt is layout.E4M3FNUZ))
        assert_bitwise_equal(got_q[sl], codes, f"q_fp8 tokens {lo}..")
        assert_bitwise_equal(got_w[sl], ew, f"weights tokens {lo}..")
    assert nonzero_share(got_q) > 0.5
    # a slice against the independent oracle as well (its cos/sin rows copied into a small table)
    ok = (pos[:6] >= 0) & (pos[:6] < max_pos)
    small = cs[pos[:6].clamp(0, max_pos - 1)]
    ec, ew = expected_q(torch.where(ok, torch.arange(6), -1), q[:6, :3], small, w[:6, :3], layout.INDEXER_DIM ** -0.5,
                        h ** -0.5, fmt is layout.E4M3FNUZ)
    assert not ok.all() and torch.equal(got_q[:6, :3], ec) and torch.equal(got_w[:6, :3], ew)


@pytest.mark.gpu
def test_q_cuda_graph_new_positions():
    """Capture the _out form; replay with new positions (some invalid), queries and weights in the same buffers
    equals eager (sync-debug "error" throughout), and the replay equals the oracle on a slice."""
    t, h, max_pos = 300, 64, 5000
    cs = rope_table(max_pos).cuda()

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        pos = torch.randint(-5, max_pos + 5, (t,), generator=g)
        return [pos.cuda(), random_q(t, h, g).cuda(), cs, torch.randn(t, h, generator=g).cuda(),
                torch.zeros(t, h, DIM, dtype=torch.uint8).cuda(), torch.zeros(t, h).cuda()]

    def step(pos, q, cs_, w, qb, wb):
        fused_indexer_q_rope_quant(pos, q, cs_, w, 0.088388347648, 0.125, output_buffers=(qb, wb))

    static = inputs(0)
    new = inputs(2)
    snap = [a.cpu().clone() for a in new]
    check_cuda_graph(step, static, [inputs(1), new])
    fnuz = ops.q_format(torch.uint8, static[0].device) is layout.E4M3FNUZ
    ec, ew = expected_q(snap[0][:8], snap[1][:8, :4], snap[2], snap[3][:8, :4], 0.088388347648, 0.125, fnuz)
    assert torch.equal(static[4].cpu()[:8, :4], ec) and torch.equal(static[5].cpu()[:8, :4], ew)


@pytest.mark.gpu
def test_seq_gpu_graph_and_sync():
    """Decode-sized pack/unpack (1024 requests of up to 2 rows of 8192 fp8 bytes; topk rows of 512 int32): first
    calls under sync-debug "error", CUDA-graph replay with new lengths equals eager, results equal the oracle on
    the replayed values."""
    b, next_n = 1024, 2
    g = torch.Generator().manual_seed(41)

    def inputs(seed):
        g.manual_seed(seed)
        lens = torch.randint(0, next_n + 1, (b,), generator=g).int()
        x = torch.randint(0, 256, (b * next_n, 64, DIM), generator=g, dtype=torch.uint8)
        topk = torch.randint(-1, 1 << 20, (b, next_n, 512), generator=g, dtype=torch.int32)
        return [x.cuda(), lens.cuda(), torch.empty(b, next_n, 64, DIM, dtype=torch.uint8).cuda(), topk.cuda(),
                torch.empty(b * next_n, 512, dtype=torch.int32).cuda()]

    def step(x, lens, packed, topk, flat):
        pack_seq_triton(x, lens, 0, max_len=next_n, out=packed)
        unpack_seq_triton(topk, lens, total=b * next_n, out=flat)

    static, first = inputs(0), inputs(3)
    with sync_debug_error():
        step(*first)                                                    # the first calls plan: no sync either
    new = inputs(2)
    snap = [a.cpu().clone() for a in new]
    check_cuda_graph(step, static, [inputs(1), new])
    x, lens, _, topk, _ = snap
    lens_l = lens.tolist()
    exp_p = torch.tensor(oracle_pack(x.view(b * next_n, -1)[:, :16].tolist(), lens_l, next_n, 0, 16),
                         dtype=torch.uint8)
    assert torch.equal(static[2].cpu().view(b, next_n, -1)[:, :, :16], exp_p)
    exp_u = torch.tensor(oracle_unpack(topk.tolist(), lens_l, b * next_n, 512), dtype=torch.int32)
    assert torch.equal(static[4].cpu(), exp_u)
