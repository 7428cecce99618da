"""indexer_k_quant_and_cache and cp_gather_indexer_k_quant_cache (SPEC §2.1, §2.2, §3.9, §4 a, b, d, §5).

Every expected byte comes from the plain-Python oracle below (an e4m3 codec built from the format
definitions, the UE8M0 exponent from `fractions`, `struct` for the fp32 scale bytes, and SPEC §0
`lookup`); the package's reference is compared against it like the kernel, never used as an oracle
(except on the GPU-only benchmark-sized case, which SPEC §5 compares against the reference).
"""
import math
import struct

import pytest
import torch

import torch_dsv4_ops as d
from oracles import FMT, oracle_exponent, oracle_lookup
from torch_dsv4_ops import layout
from torch_dsv4_ops.kernels import indexer as kernels
from torch_dsv4_ops.testing import (assert_bitwise_equal, check_compile, check_cuda_graph, implementation,
                                    nonzero_share, patched_constants, random_bytes_, run_opcheck, sync_debug_error,
                                    triton_cache_entries)

INSERT = torch.ops.dsv4.indexer_k_quant_and_cache.default
GATHER = torch.ops.dsv4.cp_gather_indexer_k_quant_cache.default
DIM, TOKEN_BYTES = 128, 132            # SPEC §2.2: 128 fp8 codes + one fp32 scale per token
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
BF16_MAX = torch.finfo(torch.bfloat16).max
IMPLS = ["reference", "kernel"]
# NaN K rows: Triton's interpreter (numpy) warns when NaN meets the exact power-of-two scale
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def page_stride(bs: int, kind: str) -> int:
    """Engine pages are padded to a multiple of 576 bytes; "plus4" is a multiple of 4 only."""
    return {"padded": layout.round_up(bs * TOKEN_BYTES, 576), "unpadded": bs * TOKEN_BYTES,
            "plus4": bs * TOKEN_BYTES + 4}[kind]


# --- independent oracle (tests/oracles.py: e4m3, the UE8M0 exponent, lookup) ---------------------------
def oracle_row(vals: list, fnuz: bool) -> tuple[list, list, int]:
    """(128 fp8 codes, the 4 little-endian bytes of fp32 2**e, e) of one K row given as Python floats."""
    fmt = FMT[fnuz]
    amax = max((abs(v) for v in vals if not math.isnan(v)), default=0.0)
    e = oracle_exponent(amax, fmt.fp8_max)
    codes = [fmt.encode(v * 2.0 ** -e) for v in vals]          # exact in double
    return codes, list(struct.pack("<f", 2.0 ** e)), e


def oracle_insert(base: torch.Tensor, lead: int, nb: int, bs: int, stride: int, k: torch.Tensor, slots: list,
                  fnuz: bool) -> torch.Tensor:
    """The flat byte buffer `base` (cache pages from byte `lead`) after the insert."""
    out = base.clone()
    rows = k.float().tolist()
    for t, s in enumerate(slots):
        if not 0 <= s < nb * bs:
            continue
        blk, off = divmod(s, bs)
        page = lead + blk * stride
        codes, scale, _ = oracle_row(rows[t], fnuz)
        out[page + off * DIM:page + (off + 1) * DIM] = torch.tensor(codes, dtype=torch.uint8)
        out[page + bs * DIM + 4 * off:page + bs * DIM + 4 * off + 4] = torch.tensor(scale, dtype=torch.uint8)
    return out


def oracle_gather(base, lead, nb, bs, stride, table: list, cu: list, dk: torch.Tensor, ds: torch.Tensor):
    """Apply the gather to uint8 views dk [Nk, 128] and ds [Nk, 4] (in place) from the cache bytes."""
    rows = dk.shape[0]
    for b in range(len(cu) - 1):
        # entries c < cu[b+1] - cu[b]; those whose row cu[b] + c is outside [0, rows) are skipped
        for c in range(max(-cu[b], 0), min(cu[b + 1] - cu[b], rows - cu[b])):
            row = cu[b] + c
            assert 0 <= row < rows
            s = oracle_lookup(table, b, c, bs, nb)
            if s < 0:
                dk[row], ds[row] = 0, 0
                continue
            blk, off = divmod(s, bs)
            page = lead + blk * stride
            dk[row] = base[page + off * DIM:page + (off + 1) * DIM]
            ds[row] = base[page + bs * DIM + 4 * off:page + bs * DIM + 4 * off + 4]


def cache_view(base: torch.Tensor, lead: int, nb: int, bs: int, stride: int, ndim: int = 3) -> torch.Tensor:
    """An indexer cache [nb, bs, 132] (or [nb, bs, 1, 132]) whose pages start at byte `lead` of `base`."""
    pages = base[lead:lead + nb * stride].view(nb, stride)[:, :bs * TOKEN_BYTES]
    return pages.view(nb, bs, TOKEN_BYTES) if ndim == 3 else pages.view(nb, bs, 1, TOKEN_BYTES)


def bf16_bits(bits: int) -> torch.Tensor:
    return torch.tensor(bits - (1 << 16) if bits >= 1 << 15 else bits, dtype=torch.int16).view(torch.bfloat16)


def bf16_neighbours(a: float) -> list:
    b = torch.tensor([a], dtype=torch.bfloat16)
    assert b.item() == a
    i = b.view(torch.int16)
    return [a, (i + 1).view(torch.bfloat16).item(), (i - 1).view(torch.bfloat16).item()]


def special_rows() -> torch.Tensor:
    """K rows for the bit-exact insert: several magnitudes, fp8 RNE midpoints and their bf16 neighbours
    (amax 448: e = 0 OCP, e = 1 FNUZ), amax 450 (e = 1 OCP), amax 224 (e = 0 FNUZ), fp8 subnormals, zero
    and -0 rows, the 1e-4 floor, NaN/inf, an all-NaN row and max bf16."""
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(DIM, generator=g) * m for m in (1e-3, 1.0, 100.0, 1e4)]
    r = torch.zeros(DIM)
    mids = [1.0625, 1.1875, 17.0, 19.0, 232.0, 440.0, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, 0.15625]
    r[:4] = torch.tensor([448.0, -1.0625, -232.0, -0.0])
    for i, v in enumerate(mids):
        r[4 + 3 * i:7 + 3 * i] = torch.tensor(bf16_neighbours(v))
    rows.append(r)
    rows.append(torch.tensor([450.0, 1.0, -3.0, 225.0, 0.5, 2.0**-9, 2.0**-8] + [0.0] * (DIM - 7)))
    rows.append(torch.tensor([224.0, 1.0625, 116.0, -0.53125, 2.0**-10, 2.0**-11] + [-0.0] * (DIM - 6)))
    rows.append(torch.zeros(DIM))
    rows.append(torch.full((DIM,), -0.0))
    rows.append(torch.randn(DIM, generator=g) * 1e-6)            # below the 1e-4 floor: e = -22 (OCP)
    rows.append(torch.randn(DIM, generator=g) * 448.0 * 2.0**-20)
    rows.append(torch.randn(DIM, generator=g).clamp(-3, 3) * 448.0 * 2.0**100 / 3)
    big = torch.randn(DIM, generator=g)
    big[7], big[8], big[9] = BF16_MAX, -BF16_MAX / 3, 1.0
    rows.append(big)
    k = torch.stack(rows + [torch.randn(DIM, generator=g)] * 3).to(torch.bfloat16)
    nan_inf, nan_fin, all_nan = len(rows), len(rows) + 1, len(rows) + 2
    k[nan_inf] = (torch.randn(DIM, generator=g) * 5).to(torch.bfloat16)
    k[nan_inf, 3], k[nan_inf, 4] = float("inf"), -float("inf")
    k[nan_inf, 5], k[nan_inf, 6] = bf16_bits(0x7FC0), bf16_bits(0xFFC0)          # +NaN, -NaN
    k[nan_fin] = (torch.randn(DIM, generator=g) * 0.1).to(torch.bfloat16)
    k[nan_fin, 0], k[nan_fin, 1], k[nan_fin, 2], k[nan_fin, 3] = bf16_bits(0xFFC0), 2.0, bf16_bits(0x7F81), -0.5
    k[all_nan] = bf16_bits(0xFFC1)
    return k


# --- literal worked example -------------------------------------------------------------------------------
def test_layout_literals():
    """bs 64: 8448 logical bytes per page, engine pages 8640 = 15 x 576; token 6's scale at 8192 + 24."""
    assert layout.indexer_block_bytes(64) == 8448 and page_stride(64, "padded") == 8640
    assert layout.indexer_scale_offset(64, 6) == 8216
    assert layout.indexer_block_bytes(2) == 264 and page_stride(2, "padded") == 576


@pytest.mark.parametrize("impl", IMPLS)
def test_worked_example(device, impl):
    """bs 64, page stride 8640, 3 pages of 0xA5. OCP:
    row A (slot 70 = page 1, offset 6: codes at 9408, scale at 8640 + 8192 + 24 = 16856): 448, 1.0, -0.5 ->
      e = 0, codes 7E 38 B0, scale 1.0 = 00 00 80 3F;
    row B (slot 0: codes at 0, scale at 8192): 450, 1.0 -> e = 1, codes 450/2 = 225 -> 224 = 76, 0.5 -> 30,
      scale 2.0 = 00 00 00 40;
    row C (slot 191 = page 2, offset 63: codes at 25344, scale at 25724): zeros -> the 1e-4 floor, e = -22,
      scale 2**-22 = 00 00 80 34;
    slot -1 and slot 192 (past the cache) write nothing.
    FNUZ (FP8_MAX 224): row A e = 1, codes 224 -> 7E, 0.5 -> 38, -0.25 -> B0, scale 2.0; row B e = 2,
    450/4 = 112.5 -> 112 = 76, 0.25 -> 30, scale 4.0 = 00 00 80 40; row C e = -21, scale 00 00 00 35;
    a fourth row (slot 100 = page 1, offset 36) of 224, -1.0: OCP e = -1, codes 448 -> 7E, -2 -> C0, scale 0.5 =
    00 00 00 3F; FNUZ e = 0, 224 -> 7E, -1 -> C0, scale 1.0."""
    k = torch.zeros(6, DIM)
    k[0, :3] = torch.tensor([448.0, 1.0, -0.5])
    k[1, :2] = torch.tensor([450.0, 1.0])
    k[3, :2] = torch.tensor([224.0, -1.0])
    k[4:] = 7.0                                                         # slots -1 and 192: skipped
    k = k.to(torch.bfloat16)
    slots = [70, 0, 191, 100, -1, 192]
    flat_page = torch.full((3 * 8640,), 0xA5, dtype=torch.uint8)
    for use_fnuz in (False, True):
        base = flat_page.clone().to(device)
        with implementation(impl, device):
            d.indexer_k_quant_and_cache(k.to(device), cache_view(base, 0, 3, 64, 8640), torch.tensor(
                slots, device=device), 128, "ue8m0", use_fnuz=use_fnuz)
        flat = base.cpu()
        a, b, c, f = (flat[9408:9408 + 128], flat[0:128], flat[25344:25344 + 128], flat[8640 + 36 * 128:][:128])
        sa, sb, sc, sf = (flat[16856:16860], flat[8192:8196], flat[25724:25728], flat[8640 + 8192 + 144:][:4])
        if not use_fnuz:
            assert a[:3].tolist() == [0x7E, 0x38, 0xB0] and sa.tolist() == [0x00, 0x00, 0x80, 0x3F]
            assert b[:2].tolist() == [0x76, 0x30] and sb.tolist() == [0x00, 0x00, 0x00, 0x40]
            assert sc.tolist() == [0x00, 0x00, 0x80, 0x34]
            assert f[:2].tolist() == [0x7E, 0xC0] and sf.tolist() == [0x00, 0x00, 0x00, 0x3F]   # 2**-1
        else:
            assert a[:3].tolist() == [0x7E, 0x38, 0xB0] and sa.tolist() == [0x00, 0x00, 0x00, 0x40]
            assert b[:2].tolist() == [0x76, 0x30] and sb.tolist() == [0x00, 0x00, 0x80, 0x40]
            assert sc.tolist() == [0x00, 0x00, 0x00, 0x35]
            assert f[:2].tolist() == [0x7E, 0xC0] and sf.tolist() == [0x00, 0x00, 0x80, 0x3F]
        assert a[3:].eq(0).all() and b[2:].eq(0).all() and c.eq(0).all() and f[2:].eq(0).all()
        written = torch.zeros(flat.shape, dtype=torch.bool)
        for lo, n in ((9408, 128), (0, 128), (25344, 128), (8640 + 36 * 128, 128),
                      (16856, 4), (8192, 4), (25724, 4), (8640 + 8192 + 144, 4)):
            written[lo:lo + n] = True
        assert flat[~written].eq(0xA5).all(), "other tokens, skipped slots and page padding are untouched"

        # gather: request 0 (table [1], 7 entries) -> rows 0..6 = page 1 offsets 0..6 (row 6 = A, rows 0..5
        # the unwritten sentinel bytes); request 1 (table [0], 1 entry) -> row 7 = B; request 2 (table [5],
        # past the 3 pages) -> row 8 zeros; row 9 is covered by no request.
        dst_k = torch.full((10, DIM), 0x11, dtype=torch.uint8, device=device)
        dst_s = torch.full((10,), -9.0, device=device)
        with implementation(impl, device):
            d.cp_gather_indexer_k_quant_cache(cache_view(base, 0, 3, 64, 8640), dst_k, dst_s,
                                              torch.tensor([[1], [0], [5]], dtype=torch.int32, device=device),
                                              torch.tensor([0, 7, 8, 9], dtype=torch.int32, device=device))
        gk, gs = dst_k.cpu(), dst_s.cpu()
        sentinel = struct.unpack("<f", b"\xa5" * 4)[0]
        assert gs.tolist() == [sentinel] * 6 + ([1.0, 2.0] if not use_fnuz else [2.0, 4.0]) + [0.0, -9.0]
        assert gk[:6].eq(0xA5).all() and torch.equal(gk[6], a) and torch.equal(gk[7], b)
        assert gk[8].eq(0).all() and gk[9].eq(0x11).all()


# --- UE8M0 edge cases: amax = FP8_MAX * 2**j and bf16 neighbours --------------------------------------------
def ue8m0_rows() -> torch.Tensor:
    """One row per amax: 448*2**j (= 224*2**(j+1)) for j in [-31, 119] and their bf16 neighbours, 0, values
    around the fp32 1e-4 floor, the smallest bf16 subnormal, max bf16 and inf; the amax sits at a varying
    column with a random sign, the other entries are random values of smaller magnitude."""
    g = torch.Generator().manual_seed(17)
    amaxes = [v for j in range(-31, 120) for v in bf16_neighbours(448.0 * 2.0**j)]
    amaxes += [0.0, BF16_MAX, 2.0**-133, math.inf] + bf16_neighbours(torch.tensor(1e-4).bfloat16().item())
    n = len(amaxes)
    a = torch.tensor(amaxes)
    finite = torch.where(a.isinf(), torch.full_like(a, 1.0), a)
    rows = (torch.rand(n, DIM, generator=g) * 2 - 1) * finite[:, None]
    rows[torch.arange(n), torch.arange(n) % DIM] = a * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    k = rows.to(torch.bfloat16)
    assert torch.equal(k.float().abs().amax(1), a)
    return k


@pytest.mark.parametrize("use_fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("impl", IMPLS)
def test_ue8m0_edges_exact(device, impl, use_fnuz):
    k = ue8m0_rows()
    n, bs = k.shape[0], 64
    nb = -(-n // bs)
    stride = page_stride(bs, "padded")
    base = random_bytes_(torch.empty(nb * stride, dtype=torch.uint8), torch.Generator().manual_seed(3))
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(4))[:n]
    dev = base.clone().to(device)
    with implementation(impl, device):
        d.indexer_k_quant_and_cache(k.to(device), cache_view(dev, 0, nb, bs, stride), slots.to(device), 128,
                                    "ue8m0", use_fnuz=use_fnuz)
    expected = oracle_insert(base, 0, nb, bs, stride, k, slots.tolist(), use_fnuz)
    assert_bitwise_equal(dev.cpu(), expected, "UE8M0 edge rows vs oracle")
    # the stored exponent field of 2**e spans exactly the UE8M0 byte range of SPEC §2.1
    pages = dev.cpu().view(nb, stride)
    scale_bits = [int.from_bytes(bytes(pages[s // bs, bs * DIM + 4 * (s % bs):][:4].tolist()), "little")
                  for s in slots.tolist()]
    assert all(b & 0x807FFFFF == 0 for b in scale_bits), "scales are positive powers of two"
    exps = [b >> 23 for b in scale_bits]
    assert (min(exps), max(exps)) == ((105, 247) if not use_fnuz else (106, 248))
    # literal anchors (§4 d): amax 448 -> e = 0 (OCP) / 1 (FNUZ); the next bf16 above 448 -> 1 / 2
    j0 = 3 * 31
    assert k[j0].float().abs().max().item() == 448.0 and k[j0 + 1].float().abs().max().item() == 450.0
    assert exps[j0] - 127 == (0 if not use_fnuz else 1) and exps[j0 + 1] - 127 == (1 if not use_fnuz else 2)


def test_oracle_self_check():
    """The oracle itself against literal values (so a broken oracle cannot make the exact tests vacuous)."""
    ocp, fnuz = FMT[False], FMT[True]
    assert [ocp.encode(v) for v in (448.0, 1.0, -0.5, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 1e9, -0.0)] == \
        [0x7E, 0x38, 0xB0, 0x38, 0x3A, 0x00, 0x02, 0x7E, 0x80]
    assert [fnuz.encode(v) for v in (224.0, 1.0, -0.25, -0.0, -2.0**-12, math.nan, -math.inf)] == \
        [0x7E, 0x40, 0xB0, 0x00, 0x00, 0x80, 0xFE]
    assert ocp.decode(0x01) == 2.0**-9 and fnuz.decode(0x01) == 2.0**-10 and fnuz.decode(0x7F) == 240.0
    assert [oracle_exponent(v, 448.0) for v in (448.0, 450.0, 0.0, 1e-4, math.inf, 896.0, 896.5)] == \
        [0, 1, -22, -22, 120, 1, 2]
    assert [oracle_exponent(v, 224.0) for v in (224.0, 448.0, 0.0, math.inf)] == [0, 1, -21, 121]
    codes, scale, e = oracle_row([float(BF16_MAX)] + [1.0] * 127, False)
    assert e == 120 and scale == [0, 0, 0x80, 0x7B] and codes[0] == 0x78 and codes[1] == 0   # 255 -> 256


# --- insert: bit-exact sweep --------------------------------------------------------------------------------
INSERT_GEOMETRIES = {
    # name: (bs, nb, page stride kind, cache ndim, slot dtype)
    "bs64-padded-3d-int64": (64, 3, "padded", 3, torch.int64),
    "bs16-unpadded-4d-int32": (16, 4, "unpadded", 4, torch.int32),
    "bs1-stride136-3d-int64": (1, 40, "plus4", 3, torch.int64),
    "bs5-one-page-4d-int32": (5, 1, "padded", 4, torch.int32),
}


@pytest.mark.parametrize("use_fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("geometry", list(INSERT_GEOMETRIES))
@pytest.mark.parametrize("impl", IMPLS)
def test_insert_exact(device, impl, geometry, use_fnuz):
    """Every byte of a random-byte allocation (a guard page before the cache, page padding, a guard tail):
    written tokens hold the oracle's codes and scale, everything else its sentinel. k has a padded row stride
    and N_k > N (the extra rows are NaN and must not be read); slot_mapping has stride 2 and hostile slots."""
    bs, nb, kind, ndim, slot_dtype = INSERT_GEOMETRIES[geometry]
    seed = 31 * bs + 7 * use_fnuz + ndim
    g = torch.Generator().manual_seed(seed)
    stride = page_stride(bs, kind)
    rows = special_rows()
    rng = (torch.randn(6, DIM, generator=g) * torch.exp2(torch.randint(-20, 20, (6, 1), generator=g).float()))
    k_all = torch.cat([rows, rng.to(torch.bfloat16)])
    hostile = ([-1, -2, INT64_MIN, nb * bs, nb * bs + 7, INT64_MAX] if slot_dtype == torch.int64
               else [-1, INT32_MIN, nb * bs, INT32_MAX])
    n_valid = min(k_all.shape[0], nb * bs)
    slots = torch.randperm(nb * bs, generator=g)[:n_valid].tolist() + hostile
    k_rows = torch.cat([k_all[:n_valid], k_all[-len(hostile):]])
    order = torch.randperm(len(slots), generator=g)
    k_rows, slots = k_rows[order], [slots[i] for i in order.tolist()]
    n = len(slots)
    kbuf = torch.full((n + 2, DIM + 8), float("nan"), dtype=torch.bfloat16)
    kbuf[:n, 3:3 + DIM] = k_rows
    sbuf = torch.tensor([[s, 5] for s in slots], dtype=slot_dtype)
    lead = stride                                                 # a guard page before the cache
    base = random_bytes_(torch.empty(lead + nb * stride + 64, dtype=torch.uint8), g)

    dev = base.clone().to(device)
    kdev = kbuf.to(device)[:, 3:3 + DIM]
    assert kdev.stride() == (DIM + 8, 1) and kdev.shape[0] == n + 2
    with implementation(impl, device):
        d.indexer_k_quant_and_cache(kdev, cache_view(dev, lead, nb, bs, stride, ndim), sbuf.to(device)[:, 0],
                                    128, "ue8m0", use_fnuz=use_fnuz)
    expected = oracle_insert(base, lead, nb, bs, stride, k_rows, slots, use_fnuz)
    got = dev.cpu()
    assert_bitwise_equal(got, expected, f"{geometry}: whole allocation vs oracle")
    assert sum(0 <= s < nb * bs for s in slots) == n_valid and n_valid >= 5
    assert nonzero_share(got[lead:lead + nb * stride]) > 0.3


def test_insert_walks_its_groups(device):
    """An insert longer than its grid (`insert_grid`: INSERT_PROGRAMS_PER_SM programs per SM, one under the
    interpreter) walks its groups of INSERT_TOKENS rows: the whole cache equals the reference's, with a ragged last
    group, slots that are negative or past the cache, and each program walking two or three groups."""
    from torch_dsv4_ops import platform
    from torch_dsv4_ops.kernels.attention import device_multiprocessors

    target = platform.target_for(device)
    programs, _ = kernels.insert_grid(1 << 40, device_multiprocessors(device), target)
    n = 5 * programs * kernels.INSERT_TOKENS // 2 + 5
    assert kernels.insert_grid(n, device_multiprocessors(device), target) == (programs, True)
    bs, nb = 64, layout.cdiv(n, 64) + 3
    stride = page_stride(bs, "padded")
    g = torch.Generator().manual_seed(n)
    k = (torch.randn(n, DIM, generator=g) * torch.exp2(torch.randint(-8, 8, (n, 1), generator=g).float()))
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[::97] = -1
    slots[5::131] = nb * bs
    base = random_bytes_(torch.empty(nb * stride, dtype=torch.uint8), g)
    expected = base.clone()
    with implementation("reference", torch.device("cpu")):
        d.indexer_k_quant_and_cache(k.to(torch.bfloat16), cache_view(expected, 0, nb, bs, stride), slots, 128,
                                    "ue8m0")
    got = base.to(device)
    with implementation("kernel", device):
        d.indexer_k_quant_and_cache(k.to(torch.bfloat16).to(device), cache_view(got, 0, nb, bs, stride),
                                    slots.to(device), 128, "ue8m0")
    assert_bitwise_equal(got.cpu(), expected, f"insert of {n} rows on {programs} programs vs the reference")


@pytest.mark.parametrize("impl", IMPLS)
def test_insert_hostile_and_empty(device, impl):
    """Only hostile slots (every negative value, INT64_MIN/INT32_MIN, past the cache): nothing written; N = 0
    (with N_k = 3): nothing launched, nothing written."""
    nb, bs = 2, 16
    base = torch.full((nb, bs, TOKEN_BYTES), 0x5A, dtype=torch.uint8)
    k = torch.randn(6, DIM).to(torch.bfloat16).to(device)
    cases = (torch.tensor([-1, -2, INT64_MIN, nb * bs, INT64_MAX, -7]),
             torch.tensor([-1, -2, INT32_MIN, nb * bs, INT32_MAX], dtype=torch.int32),
             torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32))
    with implementation(impl, device):
        for slots in cases:
            cache = base.clone().to(device)
            d.indexer_k_quant_and_cache(k[:max(3, slots.shape[0])], cache, slots.to(device), 128, "ue8m0")
            assert torch.equal(cache.cpu(), base), slots


# --- gather -----------------------------------------------------------------------------------------------
class GatherCase:
    """A cache of random sentinel bytes (guard page and page padding included) in which two thirds of the
    slots were written by `indexer_k_quant_and_cache`; random destination bytes; a hostile table."""

    def __init__(self, bs, nb, kind, ndim, fnuz, table, table_dtype, cu, rows, *, seed, dk_dtype=torch.uint8,
                 scale="fp32", dk_pad=0, ds_pad=0, table_transposed=False, cu_stride=1):
        g = torch.Generator().manual_seed(seed)
        self.bs, self.nb, self.fnuz, self.ndim = bs, nb, fnuz, ndim
        self.stride = page_stride(bs, kind)
        self.lead = self.stride
        self.base = random_bytes_(torch.empty(self.lead + nb * self.stride + 32, dtype=torch.uint8), g)
        n_write = 2 * nb * bs // 3
        self.written = torch.randperm(nb * bs, generator=g)[:n_write].tolist()
        self.k = (torch.randn(n_write, DIM, generator=g)
                  * torch.exp2(torch.randint(-12, 12, (n_write, 1), generator=g).float())).to(torch.bfloat16)
        with d.cpu_implementation("reference"):
            d.indexer_k_quant_and_cache(self.k, self.cache(self.base), torch.tensor(self.written), 128, "ue8m0",
                                        use_fnuz=fnuz)
        self.table, self.table_dtype, self.cu, self.rows = table, table_dtype, cu, rows
        self.dk_dtype, self.scale, self.dk_pad, self.ds_pad = dk_dtype, scale, dk_pad, ds_pad
        self.table_transposed, self.cu_stride = table_transposed, cu_stride
        # destination buffers with 3 guard rows before and a guard tail after (rows < 0 and >= Nk are skipped)
        self.dk_lead, self.ds_lead = 3 * (DIM + dk_pad), 3 * (4 + ds_pad if scale == "uint8" else 4)
        self.dk_base = random_bytes_(torch.empty(self.dk_lead + rows * (DIM + dk_pad) + 16, dtype=torch.uint8), g)
        self.ds_base = random_bytes_(torch.empty(self.ds_lead * (rows + 7) // 3, dtype=torch.uint8), g)

    def cache(self, base):
        return cache_view(base, self.lead, self.nb, self.bs, self.stride, self.ndim)

    def dk_bytes(self, base):
        w = DIM + self.dk_pad
        return base[self.dk_lead:self.dk_lead + self.rows * w].view(self.rows, w)[:, :DIM]

    def ds_bytes(self, base):
        w = 4 + self.ds_pad if self.scale == "uint8" else 4
        return base[self.ds_lead:self.ds_lead + self.rows * w].view(self.rows, w)[:, :4]

    def args(self, device):
        base, dk_base, ds_base = self.base.to(device), self.dk_base.to(device), self.ds_base.to(device)
        dk = self.dk_bytes(dk_base)
        dk = dk if self.dk_dtype == torch.uint8 else dk.view(self.dk_dtype)
        ds = self.ds_bytes(ds_base)
        ds = ds.reshape(-1).view(torch.float32) if self.scale == "fp32" else ds
        assert ds.data_ptr() == ds_base.data_ptr() + self.ds_lead
        table = torch.tensor(self.table, dtype=self.table_dtype).reshape(len(self.table), -1)
        if self.table_transposed:
            table = table.T.contiguous().T
        table = table.to(device)
        assert not self.table_transposed or table.stride() == (1, table.shape[0])
        cu = torch.tensor([v for c in self.cu for v in [c] + [-5] * (self.cu_stride - 1)], dtype=torch.int32)
        cu = cu.to(device)[::self.cu_stride]
        return (self.cache(base), dk, ds, table, cu), (dk_base, ds_base)

    def run(self, device, impl):
        args, (dk_base, ds_base) = self.args(device)
        with implementation(impl, device):
            d.cp_gather_indexer_k_quant_cache(*args)
        exp_dk, exp_ds = self.dk_base.clone(), self.ds_base.clone()
        oracle_gather(self.base, self.lead, self.nb, self.bs, self.stride, self.table, self.cu,
                      self.dk_bytes(exp_dk), self.ds_bytes(exp_ds))
        assert_bitwise_equal(dk_base.cpu(), exp_dk, "dst_k allocation vs oracle")
        assert_bitwise_equal(ds_base.cpu(), exp_ds, "dst_scale allocation vs oracle")
        return self.dk_bytes(dk_base.cpu()), self.ds_bytes(ds_base.cpu())

    def check_written_rows(self, dk, ds, at_least=5):
        """Composition: every gathered entry whose slot the writer wrote holds the insert oracle's bytes."""
        where = {s: i for i, s in enumerate(self.written)}
        checked = 0
        for b in range(len(self.cu) - 1):
            for c in range(max(-self.cu[b], 0), min(self.cu[b + 1] - self.cu[b], self.rows - self.cu[b])):
                row, s = self.cu[b] + c, oracle_lookup(self.table, b, c, self.bs, self.nb)
                if s in where:
                    codes, scale, _ = oracle_row(self.k[where[s]].float().tolist(), self.fnuz)
                    assert dk[row].tolist() == codes and ds[row].tolist() == scale, (b, c)
                    checked += 1
        assert checked >= at_least
        return checked


def gather_case(name: str) -> GatherCase:
    if name == "bs16-padded-fp32scale-int32":
        # nb 9; request 0 rows -3..33 (3 entries before row 0 skipped; col 2 = -1); request 1 empty;
        # request 2 cols valid / INT32_MAX / valid; request 3 INT32_MIN / valid / -7; request 4 has no table
        # row (zeros); Nk = 101 < cu[B] = 105: rows past it skipped
        table = [[4, 0, -1], [2, 9, 3], [6, INT32_MAX, 8], [INT32_MIN, 1, -7]]
        return GatherCase(16, 9, "padded", 3, False, table, torch.int32, [-3, 34, 34, 79, 99, 105], 101, seed=1)
    if name == "bs64-unpadded-fp8dst-uint8scale-int64":
        # rows 0..2 and 178..189 covered by no request; request 1: INT64_MIN and 2**40 (past the cache)
        table = [[3, 2**40], [INT64_MIN, -1], [0, 1]]
        return GatherCase(64, 4, "unpadded", 4, True, table, torch.int64, [3, 73, 78, 178], 190, seed=2,
                          dk_dtype=torch.float8_e4m3fn, scale="uint8")
    if name == "bs4-odd-stride-strided-dst-and-table":
        # 2 table rows for 4 requests; entries past the table width (request 0, 13 > 3 cols * 4) are zeros;
        # dst_k / dst_scale with padded row strides, a transposed table and cu with stride 2
        table = [[5, 7, -1], [1, 12, 0]]
        return GatherCase(4, 12, "plus4", 3, False, table, torch.int32, [0, 13, 20, 23, 26], 30, seed=3,
                          scale="uint8", dk_pad=32, ds_pad=4, table_transposed=True, cu_stride=2)
    raise KeyError(name)


GATHER_CASES = ["bs16-padded-fp32scale-int32", "bs64-unpadded-fp8dst-uint8scale-int64",
                "bs4-odd-stride-strided-dst-and-table"]


@pytest.mark.parametrize("name", GATHER_CASES)
@pytest.mark.parametrize("impl", IMPLS)
def test_gather_exact(device, impl, name):
    case = gather_case(name)
    dk, ds = case.run(device, impl)
    case.check_written_rows(dk, ds)
    # the hostile parts of the table really produced zero rows (and the rest is not all zero)
    zero_rows = int((dk == 0).all(1).logical_and((ds == 0).all(1)).sum())
    assert 5 <= zero_rows < dk.shape[0] - 5


@pytest.mark.parametrize("name", GATHER_CASES[:2])
def test_gather_one_program_walks_every_step(device, name):
    """MAX_WORKERS = 1: each request's one program walks all its rows, GATHER_ROWS a step (the loop past its first
    step, which only calls of more than GATHER_ROWS * MAX_WORKERS rows take otherwise); bit-exact with the oracle
    over both whole allocations (`GatherCase.run`)."""
    from torch_dsv4_ops.ops import indexer as ops_indexer

    with patched_constants(kernels, [ops_indexer._GATHER_PLANS], MAX_WORKERS=1):
        case = gather_case(name)
        assert max(b - a for a, b in zip(case.cu, case.cu[1:])) > 2 * kernels.GATHER_ROWS     # requests of 3+ steps
        assert kernels.gather_workers(case.rows) == 1
        dk, ds = case.run(device, "kernel")
        case.check_written_rows(dk, ds)


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_empty_and_degenerate(device, impl):
    """B = 0 and Nk = 0: nothing written; a table of width 0, and one with no rows: zeros."""
    case = GatherCase(8, 3, "padded", 3, False, [[0, 1]], torch.int32, [0, 4, 9], 12, seed=4)
    with implementation(impl, device):
        args, (dk_base, ds_base) = case.args(device)
        cache, dk, ds, _, _ = args
        d.cp_gather_indexer_k_quant_cache(cache, dk, ds, torch.zeros(1, 2, dtype=torch.int32, device=device),
                                          torch.tensor([2], dtype=torch.int32, device=device))
        assert torch.equal(dk_base.cpu(), case.dk_base) and torch.equal(ds_base.cpu(), case.ds_base), "B = 0"
        d.cp_gather_indexer_k_quant_cache(cache, dk[:0], ds[:0], torch.zeros(2, 2, dtype=torch.int32, device=device),
                                          torch.tensor([0, 4, 9], dtype=torch.int32, device=device))
        assert torch.equal(dk_base.cpu(), case.dk_base) and torch.equal(ds_base.cpu(), case.ds_base), "Nk = 0"
        for table in (torch.zeros(2, 0, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int64)):
            args, (dk_base, ds_base) = case.args(device)
            cache, dk, ds, _, cu = args
            d.cp_gather_indexer_k_quant_cache(cache, dk, ds, table.to(device), cu)
            got_k, got_s = case.dk_bytes(dk_base.cpu()), case.ds_bytes(ds_base.cpu())
            assert got_k[:9].eq(0).all() and got_s[:9].eq(0).all()
            assert torch.equal(got_k[9:], case.dk_bytes(case.dk_base)[9:])
            assert torch.equal(got_s[9:], case.ds_bytes(case.ds_base)[9:])


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_hostile_cu(device, impl):
    """cu_seq_lens at the int32 extremes (lengths up to 2**32 - 1, decreasing values): only entries whose rows
    lie in [0, Nk) are written (and visited: the call must return promptly), the rest of dst keeps its bytes."""
    table = [[3, 0, 5, 1, -1], [2, 4, 1, 0, 3], [5, 3, 2, 1, 0], [0, 1]]
    for cu in ([INT32_MIN, -2, 5, INT32_MAX, INT32_MAX], [INT32_MAX, INT32_MIN, 0, 3, -9]):
        case = GatherCase(4, 6, "padded", 3, False, [row + [-1] * (5 - len(row)) for row in table], torch.int32,
                          cu, 20, seed=7)
        dk, ds = case.run(device, impl)
        covered = 20 if cu[0] == INT32_MIN else 3
        case.check_written_rows(dk, ds, at_least=5 if covered == 20 else 1)
        assert torch.equal(dk[covered:], case.dk_bytes(case.dk_base)[covered:])


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_single_row_strided_fp32_scale(device, impl):
    """Nk = 1 with an fp32 dst_scale [1] of stride 2 (torch calls it contiguous): either a ValueError naming
    dst_scale with nothing written, or the row written correctly; never another error (a validator that accepted
    it while both implementations failed to view it as bytes raised RuntimeError)."""
    case = GatherCase(8, 3, "padded", 3, False, [[1]], torch.int32, [0, 1], 1, seed=5)
    args, (dk_base, _) = case.args(device)
    cache, dk, _, table, cu = args
    holder = torch.full((1, 2), -9.0, device=device)
    assert holder[:, 0].is_contiguous() and holder[:, 0].stride() == (2,)
    try:
        with implementation(impl, device):
            d.cp_gather_indexer_k_quant_cache(cache, dk, holder[:, 0], table, cu)
    except ValueError as exc:
        assert "dst_scale" in str(exc)
        assert holder.cpu().eq(-9.0).all() and torch.equal(dk_base.cpu(), case.dk_base)
        return
    exp_dk, exp_ds = torch.zeros(1, DIM, dtype=torch.uint8), torch.zeros(1, 4, dtype=torch.uint8)
    oracle_gather(case.base, case.lead, case.nb, case.bs, case.stride, case.table, case.cu, exp_dk, exp_ds)
    assert holder.cpu()[0, 0].view(torch.uint8).view(1, 4).tolist() == exp_ds.tolist()
    assert holder.cpu()[0, 1].item() == -9.0
    assert torch.equal(case.dk_bytes(dk_base.cpu()), exp_dk)


# --- round trip bound (SPEC §5) -----------------------------------------------------------------------------
@pytest.mark.parametrize("use_fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("n,bs", [(1, 16), (4, 64), (8, 16), (17, 64)])
@pytest.mark.parametrize("impl", IMPLS)
def test_round_trip_bound(device, impl, n, bs, use_fnuz):
    """Insert, gather (one request over a permuted table), dequantise float(fp8) * scale:
    max|err| <= 16 * 2**ceil(log2(max(amax, 1e-4) / 448)) per token, and the scale is exactly 2**e."""
    g = torch.Generator().manual_seed(100 * n + bs + use_fnuz)
    mags = torch.tensor([1e-6, 1e-3, 1.0, 100.0, 3e4])
    rows = torch.randn(n, DIM, generator=g) * mags[torch.arange(n) % 5][:, None]
    signs = torch.randint(0, 2, (n, DIM), generator=g) * 2 - 1
    rows = torch.where((torch.arange(n) % 3 == 1)[:, None], signs * mags[(torch.arange(n) + 2) % 5][:, None], rows)
    k = rows.to(torch.bfloat16)
    nb = -(-n // bs) + 1
    perm = torch.randperm(nb, generator=g)
    cache = torch.zeros(nb, bs, TOKEN_BYTES, dtype=torch.uint8, device=device)
    # token t goes to position t of the request: page perm[t // bs], offset t % bs
    slots = perm[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    dst_k = torch.zeros(n, DIM, dtype=torch.float8_e4m3fnuz if use_fnuz else torch.float8_e4m3fn, device=device)
    dst_s = torch.zeros(n, device=device)
    with implementation(impl, device):
        d.indexer_k_quant_and_cache(k.to(device), cache, slots.to(device), 128, "ue8m0", use_fnuz=use_fnuz)
        d.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_s, perm[None].int().to(device),
                                          torch.tensor([0, n], dtype=torch.int32, device=device))
    codes, scales = dst_k.cpu().view(torch.uint8).tolist(), dst_s.cpu().tolist()
    fmt = FMT[use_fnuz]
    for t in range(n):
        x = k[t].float().tolist()
        amax = max(abs(v) for v in x)
        assert scales[t] == 2.0 ** oracle_exponent(amax, fmt.fp8_max)
        bound = 16 * 2.0 ** oracle_exponent(amax, 448.0)
        err = max(abs(v - fmt.decode(c) * scales[t]) for v, c in zip(x, codes[t]))
        assert err <= bound, (t, err, bound)
        if amax > 1e-3:
            assert max(abs(fmt.decode(c)) for c in codes[t]) >= fmt.fp8_max / 2   # the scale uses the range


# --- bad input ------------------------------------------------------------------------------------------------
def _insert_args(device):
    return dict(k=torch.zeros(4, DIM, dtype=torch.bfloat16, device=device),
                kv_cache=torch.zeros(2, 16, TOKEN_BYTES, dtype=torch.uint8, device=device),
                slot_mapping=torch.arange(4, device=device), quant_block_size=128, scale_fmt="ue8m0",
                use_fnuz=False)


def _strided_cache(device, nb, bs, stride):
    return torch.zeros(nb * (stride + bs * TOKEN_BYTES), dtype=torch.uint8, device=device).as_strided(
        (nb, bs, TOKEN_BYTES), (stride, TOKEN_BYTES, 1))


INSERT_BAD = [
    (lambda a, dev: a.update(k=a["k"].float()), "k"),
    (lambda a, dev: a.update(k=torch.zeros(4, 64, dtype=torch.bfloat16, device=dev)), "k"),
    (lambda a, dev: a.update(k=torch.zeros(4, 1, DIM, dtype=torch.bfloat16, device=dev)), "k"),
    (lambda a, dev: a.update(k=torch.zeros(DIM, 4, dtype=torch.bfloat16, device=dev).T), "k"),
    (lambda a, dev: a.update(k=torch.zeros(3, DIM, dtype=torch.bfloat16, device=dev)), "k"),
    (lambda a, dev: a.update(slot_mapping=a["slot_mapping"].float()), "slot_mapping"),
    (lambda a, dev: a.update(slot_mapping=a["slot_mapping"].to(torch.int16)), "slot_mapping"),
    (lambda a, dev: a.update(slot_mapping=a["slot_mapping"].view(2, 2)), "slot_mapping"),
    (lambda a, dev: a.update(kv_cache=a["kv_cache"].to(torch.int8)), "kv_cache"),
    (lambda a, dev: a.update(kv_cache=a["kv_cache"].view(torch.float8_e4m3fn)), "kv_cache"),
    (lambda a, dev: a.update(kv_cache=torch.zeros(2, 16, DIM, dtype=torch.uint8, device=dev)), "kv_cache"),
    (lambda a, dev: a.update(kv_cache=a["kv_cache"].view(2, -1)), "kv_cache"),
    (lambda a, dev: a.update(kv_cache=torch.zeros(2, 16, 2, TOKEN_BYTES, dtype=torch.uint8, device=dev)),
     "kv_cache"),
    (lambda a, dev: a.update(kv_cache=torch.zeros(2, TOKEN_BYTES, 16, dtype=torch.uint8, device=dev)
                             .transpose(1, 2)), "kv_cache"),
    (lambda a, dev: a.update(kv_cache=_strided_cache(dev, 2, 16, 16 * TOKEN_BYTES + 2)), "kv_cache"),
    (lambda a, dev: a.update(kv_cache=_strided_cache(dev, 2, 16, 16 * TOKEN_BYTES + 578)), "kv_cache"),
    (lambda a, dev: a.update(kv_cache=_strided_cache(dev, 2, 16, 16 * TOKEN_BYTES - 4)), "kv_cache"),
    (lambda a, dev: a.update(quant_block_size=64), "quant_block_size"),
    (lambda a, dev: a.update(quant_block_size=256), "quant_block_size"),
    (lambda a, dev: a.update(scale_fmt="fp32"), "scale_fmt"),
    (lambda a, dev: a.update(scale_fmt="UE8M0"), "scale_fmt"),
]


@pytest.mark.parametrize("mutate,word", INSERT_BAD, ids=range(len(INSERT_BAD)))
@pytest.mark.parametrize("impl", IMPLS)
def test_insert_bad_input(device, impl, mutate, word):
    args = _insert_args(device)
    mutate(args, device)
    before = args["kv_cache"].view(torch.uint8).cpu().clone()
    with implementation(impl, device), pytest.raises(ValueError, match=rf"\b{word}\b"):
        d.indexer_k_quant_and_cache(**args)
    assert torch.equal(args["kv_cache"].view(torch.uint8).cpu(), before), "cache untouched on error"


@pytest.mark.parametrize("impl", IMPLS)
def test_insert_misaligned_cache_pointer(device, impl):
    """Documented behaviour (ops/indexer.py): the fp32 scales are stored as 4-byte words, so a cache whose
    data pointer is not 4-byte aligned is refused with a ValueError naming kv_cache, and left untouched."""
    raw = torch.full((2 * 2112 + 8,), 0x33, dtype=torch.uint8, device=device)
    cache = raw[2:2 + 2 * 2112].view(2, 16, TOKEN_BYTES)
    assert cache.data_ptr() % 4 == 2
    with implementation(impl, device), pytest.raises(ValueError, match="kv_cache"):
        d.indexer_k_quant_and_cache(torch.ones(1, DIM, dtype=torch.bfloat16, device=device), cache,
                                    torch.tensor([3], device=device), 128, "ue8m0")
    assert raw.eq(0x33).all()


def _gather_args(device):
    return dict(kv_cache=torch.zeros(2, 16, TOKEN_BYTES, dtype=torch.uint8, device=device),
                dst_k=torch.full((6, DIM), 3, dtype=torch.uint8, device=device),
                dst_scale=torch.full((6, 4), 3, dtype=torch.uint8, device=device),
                block_table=torch.zeros(2, 2, dtype=torch.int32, device=device),
                cu_seq_lens=torch.tensor([0, 2, 6], dtype=torch.int32, device=device))


def _u8(dev, *shape):
    return torch.full(shape, 3, dtype=torch.uint8, device=dev)


GATHER_BAD = [
    (lambda a, dev: a.update(kv_cache=a["kv_cache"].float()), "kv_cache"),
    (lambda a, dev: a.update(kv_cache=_u8(dev, 2, 16, DIM)), "kv_cache"),
    (lambda a, dev: a.update(kv_cache=_strided_cache(dev, 2, 16, 16 * TOKEN_BYTES + 1)), "kv_cache"),
    (lambda a, dev: a.update(kv_cache=_strided_cache(dev, 2, 16, 16 * TOKEN_BYTES - 132)), "kv_cache"),
    (lambda a, dev: a.update(dst_k=torch.zeros(6, DIM, device=dev)), "dst_k"),
    (lambda a, dev: a.update(dst_k=a["dst_k"].view(torch.int8)), "dst_k"),
    (lambda a, dev: a.update(dst_k=_u8(dev, 6, 64)), "dst_k"),
    (lambda a, dev: a.update(dst_k=_u8(dev, 6, 1, DIM)), "dst_k"),
    (lambda a, dev: a.update(dst_k=_u8(dev, DIM, 6).T), "dst_k"),
    (lambda a, dev: a.update(dst_scale=_u8(dev, 6, 8)), "dst_scale"),
    (lambda a, dev: a.update(dst_scale=_u8(dev, 5, 4)), "dst_scale"),
    (lambda a, dev: a.update(dst_scale=_u8(dev, 24)), "dst_scale"),
    (lambda a, dev: a.update(dst_scale=_u8(dev, 4, 6).T), "dst_scale"),
    (lambda a, dev: a.update(dst_scale=torch.zeros(6, 1, device=dev)), "dst_scale"),
    (lambda a, dev: a.update(dst_scale=torch.zeros(5, device=dev)), "dst_scale"),
    (lambda a, dev: a.update(dst_scale=torch.zeros(12, device=dev)[::2]), "dst_scale"),
    (lambda a, dev: a.update(dst_scale=torch.zeros(6, dtype=torch.int32, device=dev)), "dst_scale"),
    (lambda a, dev: a.update(dst_scale=torch.zeros(6, 4, dtype=torch.int8, device=dev)), "dst_scale"),
    (lambda a, dev: a.update(block_table=a["block_table"].to(torch.int16)), "block_table"),
    (lambda a, dev: a.update(block_table=a["block_table"].float()), "block_table"),
    (lambda a, dev: a.update(block_table=a["block_table"].view(-1)), "block_table"),
    (lambda a, dev: a.update(cu_seq_lens=a["cu_seq_lens"].long()), "cu_seq_lens"),
    (lambda a, dev: a.update(cu_seq_lens=a["cu_seq_lens"][None]), "cu_seq_lens"),
    (lambda a, dev: a.update(cu_seq_lens=a["cu_seq_lens"][:0]), "cu_seq_lens"),
]


@pytest.mark.parametrize("mutate,word", GATHER_BAD, ids=range(len(GATHER_BAD)))
@pytest.mark.parametrize("impl", IMPLS)
def test_gather_bad_input(device, impl, mutate, word):
    args = _gather_args(device)
    mutate(args, device)
    before = [args[n].cpu().clone() for n in ("dst_k", "dst_scale")]
    with implementation(impl, device), pytest.raises(ValueError, match=rf"\b{word}\b"):
        d.cp_gather_indexer_k_quant_cache(**args)
    assert all(torch.equal(args[n].cpu(), b) for n, b in zip(("dst_k", "dst_scale"), before)), "outputs untouched"


@pytest.mark.gpu
def test_bad_input_device_mismatch():
    args = _insert_args("cuda")
    args["k"] = args["k"].cpu()
    with pytest.raises(ValueError, match="k"):
        d.indexer_k_quant_and_cache(**args)
    args = _insert_args("cuda")
    args["slot_mapping"] = args["slot_mapping"].cpu()
    with pytest.raises(ValueError, match="slot_mapping"):
        d.indexer_k_quant_and_cache(**args)
    g = _gather_args("cuda")
    g["block_table"] = g["block_table"].cpu()
    with pytest.raises(ValueError, match="block_table"):
        d.cp_gather_indexer_k_quant_cache(**g)
    g = _gather_args("cuda")
    g["dst_scale"] = g["dst_scale"].cpu()
    with pytest.raises(ValueError, match="dst_scale"):
        d.cp_gather_indexer_k_quant_cache(**g)


# --- composition ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck_insert(device, impl, use_fnuz):
    g = torch.Generator().manual_seed(8)
    k = (torch.randn(5, DIM, generator=g) * 3).to(torch.bfloat16).to(device)
    slots = torch.tensor([5, -1, 0, 11, 2], device=device)
    base = torch.zeros(3 * 576, dtype=torch.uint8, device=device)
    with implementation(impl, device):
        # k gets a padded row stride; the cache layout is the op's contract (a padded-page view here)
        run_opcheck(INSERT, (k, cache_view(base, 0, 3, 4, 576), slots, 128, "ue8m0", use_fnuz),
                    layouts=("contiguous", "padded"), permute=lambda i, t: i == 0)
        run_opcheck(INSERT, (k, torch.zeros(3, 4, 1, TOKEN_BYTES, dtype=torch.uint8, device=device),
                             slots.int(), 128, "ue8m0", use_fnuz), layouts=("contiguous",))


@pytest.mark.parametrize("scale", ["uint8", "fp32"])
@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck_gather(device, impl, scale):
    case = GatherCase(4, 6, "padded", 3, False, [[2, 0, -1], [5, 9, 1]], torch.int32, [0, 7, 7, 15], 14, seed=9,
                      scale=scale)
    args, _ = case.args(device)
    with implementation(impl, device):
        run_opcheck(GATHER, args, layouts=("contiguous", "padded"), permute=lambda i, t: i in (1, 2, 3))
        run_opcheck(GATHER, args, layouts=("permuted",), permute=lambda i, t: i == 3)


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_insert_no_recompile(device, impl):
    bs, nb = 4, 6

    def step(k, cache, slots):
        d.indexer_k_quant_and_cache(k, cache, slots, 128, "ue8m0")
        return cache

    inputs = []
    for n in (3, 5, 9):
        g = torch.Generator().manual_seed(n)
        base = random_bytes_(torch.empty(nb * 576, dtype=torch.uint8), g).to(device)
        inputs.append(((torch.randn(n + 2, DIM, generator=g) * 2).to(torch.bfloat16).to(device),
                       cache_view(base, 0, nb, bs, 576), torch.randperm(nb * bs, generator=g)[:n].to(device)))
    counted = device.type == "cuda"
    before = triton_cache_entries(kernels.indexer_insert_kernel) if counted else None
    with implementation(impl, device):
        check_compile(step, inputs)
    if counted:
        assert triton_cache_entries(kernels.indexer_insert_kernel) - before <= 1


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_gather_no_recompile(device, impl):
    bs, nb = 4, 10
    cache = random_bytes_(torch.empty(nb, bs, TOKEN_BYTES, dtype=torch.uint8), torch.Generator().manual_seed(1))

    def step(cache, dk, ds, table, cu):
        d.cp_gather_indexer_k_quant_cache(cache, dk, ds, table, cu)
        return dk, ds

    inputs = []
    for b, rows in ((2, 7), (3, 11), (5, 13)):
        g = torch.Generator().manual_seed(b)
        lens = torch.randint(0, 9, (b,), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).int()
        inputs.append((cache.to(device), torch.zeros(rows, DIM, dtype=torch.uint8, device=device),
                       torch.zeros(rows, 4, dtype=torch.uint8, device=device),
                       torch.randint(-2, nb + 2, (b, 6), generator=g, dtype=torch.int32).to(device), cu.to(device)))
    counted = device.type == "cuda"
    before = triton_cache_entries(kernels.indexer_gather_kernel) if counted else None
    with implementation(impl, device):
        check_compile(step, inputs)
    if counted:
        assert triton_cache_entries(kernels.indexer_gather_kernel) - before <= 1


# --- GPU only --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("use_fnuz", [False, True], ids=["ocp", "fnuz"])
def test_cuda_graph_insert_and_gather(use_fnuz):
    """Capture insert + gather; replay with new K, slots, tables and cu values in the same buffers equals eager
    (all under sync-debug "error"), and the replayed result equals the oracle."""
    bs, nb, n, rows, b = 64, 24, 300, 700, 4
    stride = page_stride(bs, "padded")

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        k = (torch.randn(n + 5, DIM, generator=g) * (seed + 1)).to(torch.bfloat16)
        slots = torch.randperm(nb * bs, generator=g)[:n]
        slots[::13] = -1
        slots[5] = nb * bs + seed
        base = random_bytes_(torch.empty(nb * stride, dtype=torch.uint8), g).cuda()
        dk = random_bytes_(torch.empty(rows, DIM, dtype=torch.uint8), g)
        ds = random_bytes_(torch.empty(rows, 4, dtype=torch.uint8), g)
        table = torch.randint(-3, nb + 3, (b, 7), generator=g, dtype=torch.int32)
        lens = torch.randint(0, 6 * bs, (b,), generator=g)
        cu = (torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]) + seed).int()
        return [k.cuda(), cache_view(base, 0, nb, bs, stride), slots.cuda(), dk.cuda(), ds.cuda(), table.cuda(),
                cu.cuda()]

    def step(k, cache, slots, dk, ds, table, cu):
        d.indexer_k_quant_and_cache(k, cache, slots, 128, "ue8m0", use_fnuz=use_fnuz)
        d.cp_gather_indexer_k_quant_cache(cache, dk, ds, table, cu)

    static = inputs(0)
    new = inputs(2)
    snapshot = [t.cpu().clone() for t in new]
    check_cuda_graph(step, static, [inputs(1), new])
    k, cache, slots, dk, ds, table, cu = snapshot
    base = torch.zeros(nb * stride, dtype=torch.uint8)
    cache_view(base, 0, nb, bs, stride).copy_(cache)
    expected = oracle_insert(base, 0, nb, bs, stride, k, slots.tolist(), use_fnuz)
    got_cache = torch.zeros(nb * stride, dtype=torch.uint8)
    cache_view(got_cache, 0, nb, bs, stride).copy_(static[1].cpu())
    assert_bitwise_equal(cache_view(got_cache, 0, nb, bs, stride), cache_view(expected, 0, nb, bs, stride),
                         "replayed insert vs oracle")
    oracle_gather(expected, 0, nb, bs, stride, table.tolist(), cu.tolist(), dk, ds)
    assert_bitwise_equal(static[3].cpu(), dk, "replayed gather dst_k vs oracle")
    assert_bitwise_equal(static[4].cpu(), ds, "replayed gather dst_scale vs oracle")


@pytest.mark.gpu
def test_no_host_sync():
    """First calls (planning) and later calls of both ops, with fresh shapes, under sync-debug "error"."""
    bs, nb = 16, 7
    k = torch.randn(37, DIM, device="cuda").to(torch.bfloat16)
    cache = torch.zeros(nb, bs, 1, TOKEN_BYTES, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(nb * bs, device="cuda")[:33].int()
    dk = torch.zeros(51, DIM, dtype=torch.float8_e4m3fn, device="cuda")
    ds = torch.zeros(51, device="cuda")
    table = torch.randint(-1, nb + 1, (3, 5), dtype=torch.int64, device="cuda")
    cu = torch.tensor([0, 20, 20, 49], dtype=torch.int32, device="cuda")
    with sync_debug_error():
        for _ in range(2):
            d.indexer_k_quant_and_cache(k, cache, slots, 128, "ue8m0", use_fnuz=True)
            d.cp_gather_indexer_k_quant_cache(cache, dk, ds, table, cu)
    torch.cuda.synchronize()
    expected = oracle_insert(torch.zeros(nb * bs * TOKEN_BYTES, dtype=torch.uint8), 0, nb, bs, bs * TOKEN_BYTES,
                             k.cpu()[:33], slots.cpu().tolist(), True)
    assert_bitwise_equal(cache.cpu().view(-1), expected, "insert under sync-debug")
    exp_dk, exp_ds = torch.zeros(51, DIM, dtype=torch.uint8), torch.zeros(51, 4, dtype=torch.uint8)
    oracle_gather(expected, 0, nb, bs, bs * TOKEN_BYTES, table.cpu().tolist(), cu.cpu().tolist(), exp_dk, exp_ds)
    assert_bitwise_equal(dk.cpu().view(torch.uint8), exp_dk, "gather codes under sync-debug")
    assert_bitwise_equal(ds.cpu().view(torch.uint8).view(51, 4), exp_ds, "gather scales under sync-debug")


@pytest.mark.gpu
@pytest.mark.parametrize("use_fnuz", [False, True], ids=["ocp", "fnuz"])
def test_benchmark_sized_exact(use_fnuz):
    """T = 65536 insert (bs 64, random slots with skips, engine-padded pages) and 16 x 2048-entry gathers, against
    the reference, under sync-debug "error"."""
    from torch_dsv4_ops.reference import indexer as reference

    g = torch.Generator().manual_seed(21)
    t, bs = 65536, 64
    nb = t // bs + 8
    stride = page_stride(bs, "padded")
    k = (torch.randn(t, DIM, generator=g) * torch.exp2(torch.randint(-10, 10, (t, 1), generator=g).float())
         ).to(torch.bfloat16)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[::97] = -1
    base = random_bytes_(torch.empty(nb * stride, dtype=torch.uint8), g)
    dev, k_dev, slots_dev = base.cuda(), k.cuda(), slots.cuda()   # host-to-device copies synchronise: before
    with sync_debug_error():
        d.indexer_k_quant_and_cache(k_dev, cache_view(dev, 0, nb, bs, stride), slots_dev, 128, "ue8m0",
                                    use_fnuz=use_fnuz)
    reference.indexer_k_quant_and_cache(k, cache_view(base, 0, nb, bs, stride), slots, 128, "ue8m0", use_fnuz)
    assert_bitwise_equal(dev.cpu(), base, "insert T = 65536")
    r, s = 16, 2048
    table = torch.randperm(nb, generator=g)[:r * s // bs].view(r, s // bs).int()
    table[3, 5] = -1
    cu = torch.arange(r + 1, dtype=torch.int32) * s
    dk = torch.zeros(r * s, DIM, dtype=torch.uint8)
    ds = torch.zeros(r * s)
    dk_dev, ds_dev, table_dev, cu_dev = dk.cuda(), ds.cuda(), table.cuda(), cu.cuda()
    with sync_debug_error():
        d.cp_gather_indexer_k_quant_cache(cache_view(dev, 0, nb, bs, stride), dk_dev, ds_dev, table_dev, cu_dev)
    reference.cp_gather_indexer_k_quant_cache(cache_view(base, 0, nb, bs, stride), dk, ds, table, cu)
    assert_bitwise_equal(dk_dev.cpu(), dk, "gather 16 x 2048 codes")
    assert_bitwise_equal(ds_dev.cpu(), ds, "gather 16 x 2048 scales")
    assert nonzero_share(dk) > 0.5
