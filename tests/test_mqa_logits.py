"""fp8_fp4_mqa_logits, fp8_fp4_paged_mqa_logits and get_paged_mqa_logits_metadata (SPEC §2.2, §3.9, §4 b, h, i).

Expected logits come from the float64 oracle below: fp8 codes decoded through a table built from the e4m3
definitions, page bytes of the indexer cache parsed by hand (`struct` for the fp32 scales) and SPEC §0
`lookup` in plain Python. Logits match within 1e-3 of the row's largest |logit|; -inf positions exactly.
"""
import math
import struct

import pytest
import torch

from oracles import oracle_lookup
from torch_dsv4_ops import layout, platform
from torch_dsv4_ops.kernels import mqa_logits as kernels
from torch_dsv4_ops.ops import mqa_logits as ops
from torch_dsv4_ops.ops.indexer import indexer_k_quant_and_cache
from torch_dsv4_ops.testing import (check_compile, check_cuda_graph, check_direct_launches, gluon_runs_direct,
                                    implementation, nonzero_share, patched_constants, poison_, run_opcheck,
                                    sync_debug_error)

PREFILL = torch.ops.dsv4.fp8_fp4_mqa_logits.default
PREFILL_OUT = torch.ops.dsv4.fp8_fp4_mqa_logits_out.default
PAGED = torch.ops.dsv4.fp8_fp4_paged_mqa_logits.default
PAGED_OUT = torch.ops.dsv4.fp8_fp4_paged_mqa_logits_out.default
META = torch.ops.dsv4.get_paged_mqa_logits_metadata.default
META_OUT = torch.ops.dsv4.get_paged_mqa_logits_metadata_out.default
IMPLS = ["reference", "kernel"]
DIM, TOKEN_BYTES = 128, 132                # SPEC §2.2: 128 fp8 codes + one fp32 scale per cache entry
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
REL_TOL = 1e-3                             # SPEC §3.9: relative to the row's largest |logit|
NINF = float("-inf")
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


# --- independent oracle ---------------------------------------------------------------------------------------------
def e4m3_value(code: int, fnuz: bool) -> float:
    """The value of an e4m3 code from the format definition (OCP e4m3fn: bias 7, 0x7F/0xFF NaN; FNUZ: bias 8,
    0x80 the only NaN)."""
    if (fnuz and code == 0x80) or (not fnuz and code & 0x7F == 0x7F):
        return math.nan
    bias = 8 if fnuz else 7
    e, m = (code >> 3) & 0xF, code & 7
    mag = m / 8 * 2.0 ** (1 - bias) if e == 0 else (1 + m / 8) * 2.0 ** (e - bias)
    return -mag if code & 0x80 else mag


TABLE = {fnuz: torch.tensor([e4m3_value(c, fnuz) for c in range(256)], dtype=torch.float64) for fnuz in (False, True)}


def decode(codes: torch.Tensor, fnuz: bool) -> torch.Tensor:
    return TABLE[fnuz][codes.cpu().view(torch.uint8).long()]


def oracle_prefill(q, k, k_scale, w, ks, ke, q_fnuz=False, k_fnuz=False):
    """(logits [M, N] float64, defined [M, N] bool) of SPEC §3.9's prefill formula."""
    qv, kv = decode(q, q_fnuz), decode(k, k_fnuz)
    m, n = q.shape[0], k.shape[0]
    s = torch.einsum("mhd,nd->mhn", qv, kv).clamp_min(0)
    logits = torch.einsum("mhn,mh->mn", s, w.cpu().double()) * k_scale.cpu().double().reshape(1, n)
    defined = torch.zeros(m, n, dtype=torch.bool)
    for i, (a, b) in enumerate(zip(ks.tolist(), ke.tolist())):
        lo = min(max(a, 0), n)
        hi = min(max(b, lo), n)
        defined[i, lo:hi] = True
    return torch.where(defined, logits, torch.full_like(logits, NINF)), defined


def oracle_paged(q, flat: torch.Tensor, lead: int, nb: int, bs: int, stride: int, w, lens, table, max_len, fnuz):
    """(logits [B*n, max_len] float64, defined mask) for the cache whose pages start at byte `lead` of the flat
    byte buffer; lens [B, n] (already expanded from 1-D); an invalid key scores -inf inside the length."""
    batch, next_n = q.shape[:2]
    qv = decode(q, fnuz)
    flat = flat.cpu()
    tab = table.tolist()
    logits = torch.full((batch * next_n, max_len), NINF, dtype=torch.float64)
    defined = torch.zeros(batch * next_n, max_len, dtype=torch.bool)
    for b in range(batch):
        for j in range(next_n):
            length = min(max(lens[b][j], 0), max_len)
            defined[b * next_n + j, :length] = True
            for c in range(length):
                s = oracle_lookup(tab, b, c, bs, nb)
                if s < 0:
                    continue
                page = lead + (s // bs) * stride
                codes = flat[page + (s % bs) * DIM:page + (s % bs + 1) * DIM]
                raw = bytes(flat[page + bs * DIM + 4 * (s % bs):page + bs * DIM + 4 * (s % bs) + 4].tolist())
                scale = struct.unpack("<f", raw)[0]
                dots = (qv[b, j] @ decode(codes, fnuz)).clamp_min(0)
                logits[b * next_n + j, c] = scale * float((dots * w[b * next_n + j].cpu().double()).sum())
    return logits, defined


def assert_logits(got: torch.Tensor, expected: torch.Tensor, defined: torch.Tensor, clean: bool, what: str):
    """Finite expected values within REL_TOL of the row's largest |expected| (inside `defined`), -inf exactly where
    expected; with `clean`, -inf everywhere outside `defined` too."""
    got = got.detach().cpu().double()
    assert got.shape == expected.shape, what
    check = torch.ones_like(defined) if clean else defined
    finite = expected.isfinite()
    row_max = torch.where(finite & defined, expected.abs(), torch.zeros_like(expected)).amax(1, keepdim=True)
    tol = REL_TOL * row_max + 1e-30
    bad_val = check & finite & ~((got - expected).abs() <= tol)
    bad_inf = check & ~finite & ~(got == NINF)
    if bad_val.any() or bad_inf.any():
        i = tuple((bad_val | bad_inf).nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad_val.sum())} values out of tolerance, {int(bad_inf.sum())} -inf "
                             f"missing; at {i}: got {got[i].item()} expected {expected[i].item()}")


# --- inputs -----------------------------------------------------------------------------------------------------------
def fp8_codes(shape, g, fnuz=False, spread=5) -> torch.Tensor:
    """uint8 codes of N(0,1) * 2**U[-spread, spread] values (realistic spread; never NaN)."""
    fmt = layout.E4M3FNUZ if fnuz else layout.E4M3FN
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-spread, spread + 1, shape, generator=g).float())
    return x.clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8)


def as_operand(codes: torch.Tensor, dtype, device, pad: int = 0) -> torch.Tensor:
    """codes on `device` as `dtype` (uint8 or a float8 view), rows padded by `pad` bytes (last dim contiguous)."""
    if pad:
        big = torch.zeros(codes.shape[:-1] + (codes.shape[-1] + pad,), dtype=torch.uint8)
        big[..., :codes.shape[-1]] = codes
        t = big.to(device)[..., :codes.shape[-1]]
    else:
        t = codes.to(device)
    return t if dtype == torch.uint8 else t.view(dtype)


class PrefillCase:
    def __init__(self, m, n, heads, dim, ranges, *, seed, clean=True, q_fnuz=False, k_fnuz=False,
                 q_dtype=torch.uint8, k_dtype=torch.uint8, scale_2d=False, pad=0):
        g = torch.Generator().manual_seed(seed)
        self.q8 = fp8_codes((m, heads, dim), g, q_fnuz)
        self.k8 = fp8_codes((n, dim), g, k_fnuz)
        self.scale = torch.exp2(torch.randint(-8, 2, (n,), generator=g).float())
        self.w = torch.randn(m, heads, generator=g) / 4
        if ranges == "causal":
            i = torch.arange(m)
            ks = torch.where(i < m // 2, 0, n // 2)
            ke = n - m + i + 1
        elif ranges == "full":
            ks, ke = torch.zeros(m, dtype=torch.int64), torch.full((m,), n)
        else:   # hostile: empty, partial, negative, past N, ke < ks
            base = torch.tensor([[0, n], [3, 3], [5, 2], [-7, 4], [n - 3, n + 9], [n + 2, n + 5],
                                 [INT32_MIN, INT32_MAX], [1, n - 1], [n // 2, n // 2 + 1], [-1, 0]])
            ks, ke = base[torch.arange(m) % len(base)].T
        self.ks, self.ke = ks.int(), ke.int()
        self.clean, self.q_fnuz, self.k_fnuz, self.use_fnuz = clean, q_fnuz, k_fnuz, q_fnuz or k_fnuz
        self.q_dtype, self.k_dtype, self.scale_2d, self.pad = q_dtype, k_dtype, scale_2d, pad
        if self.use_fnuz:   # uint8 operands follow use_fnuz: a mixed pair needs one typed operand
            assert q_fnuz == k_fnuz or q_dtype != torch.uint8 or k_dtype != torch.uint8

    def args(self, device):
        scale = self.scale[:, None] if self.scale_2d else self.scale
        return (as_operand(self.q8, self.q_dtype, device, self.pad),
                as_operand(self.k8, self.k_dtype, device, self.pad), scale.to(device), self.w.to(device),
                self.ks.to(device), self.ke.to(device), self.clean)

    def use_fnuz_arg(self):
        uint8_fnuz = [f for f, dt in ((self.q_fnuz, self.q_dtype), (self.k_fnuz, self.k_dtype)) if dt == torch.uint8]
        return bool(uint8_fnuz and uint8_fnuz[0])

    def expected(self):
        return oracle_prefill(self.q8, self.k8, self.scale, self.w, self.ks, self.ke, self.q_fnuz, self.k_fnuz)


F8, F8Z = torch.float8_e4m3fn, torch.float8_e4m3fnuz
PREFILL_CASES = {
    "h64-d128-causal": dict(m=9, n=70, heads=64, dim=128, ranges="causal", seed=1),
    "h64-d64-hostile-dirty": dict(m=10, n=37, heads=64, dim=64, ranges="hostile", seed=2, clean=False),
    "h1-d32-hostile": dict(m=20, n=50, heads=1, dim=32, ranges="hostile", seed=3),
    "h4-d128-full-float8-scale2d": dict(m=11, n=45, heads=4, dim=128, ranges="full", seed=4, q_dtype=F8, k_dtype=F8,
                                        scale_2d=True),
    "h5-d64-causal-dirty-padded": dict(m=13, n=33, heads=5, dim=64, ranges="causal", seed=5, clean=False, pad=16),
    "h4-d32-fnuz-uint8": dict(m=8, n=40, heads=4, dim=32, ranges="hostile", seed=6, q_fnuz=True, k_fnuz=True),
    "h3-d64-mixed-fnuz-q": dict(m=7, n=30, heads=3, dim=64, ranges="causal", seed=7, q_fnuz=True, q_dtype=F8Z),
    "h96-d32-chunked-heads": dict(m=5, n=20, heads=96, dim=32, ranges="hostile", seed=8),
    # the sm_90 Gluon path's shapes (64 heads, D 128, e4m3fn; kernels/mqa_logits_gluon.py): M not a multiple of its
    # 4 queries, N not of its 64 keys, padded rows (strided q heads, k rows 144 bytes apart), hostile ranges
    "h64-d128-hostile-dirty-padded-sm90": dict(m=11, n=150, heads=64, dim=128, ranges="hostile", seed=9,
                                               clean=False, pad=16),
    "h64-d128-full-float8-scale2d-sm90": dict(m=6, n=129, heads=64, dim=128, ranges="full", seed=10, q_dtype=F8,
                                              k_dtype=F8, scale_2d=True),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_logits(device, impl, name):
    case = PrefillCase(**PREFILL_CASES[name])
    expected, defined = case.expected()
    assert expected[defined].isfinite().float().mean() > 0.9 and defined.any()
    assert (expected[defined] > 0).any() and (expected[defined] < 0).any()
    with implementation(impl, device):
        got = ops.fp8_fp4_mqa_logits((case.args(device)[0], None), case.args(device)[1:3], *case.args(device)[3:],
                                     use_fnuz=case.use_fnuz_arg())
    assert got.dtype == torch.float32 and got.shape == (case.q8.shape[0], case.k8.shape[0])
    assert_logits(got, expected, defined, case.clean, name)


@pytest.mark.parametrize("clean", [True, False], ids=["clean", "dirty"])
@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_out_poisoned(device, impl, clean):
    """out= with a padded row stride, poisoned: the [M, N] view is written (all of it when clean, the defined
    ranges otherwise) and the row padding keeps its sentinel."""
    case = PrefillCase(12, 41, 8, 64, "hostile", seed=11, clean=clean)
    expected, defined = case.expected()
    big = poison_(torch.empty(12, 48, device=device))
    before = big.clone()
    out = big[:, :41]
    with implementation(impl, device):
        args = case.args(device)
        ret = ops.fp8_fp4_mqa_logits((args[0], None), (args[1], args[2]), *args[3:], out=out)
    assert ret is out
    assert torch.equal(big[:, 41:], before[:, 41:]), "row padding untouched"
    assert_logits(out, expected, defined, clean, "prefill out")


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_float8_bitwise_and_inputs_untouched(device, impl):
    """float8 operands cannot go through opcheck on CPU: the float8 call equals the uint8 call bit for bit, and
    leaves every input unchanged."""
    case = PrefillCase(6, 35, 16, 128, "causal", seed=12)
    args = case.args(device)
    f8 = (args[0].view(F8), args[1].view(F8)) + args[2:]
    snapshot = [a.clone() if isinstance(a, torch.Tensor) else a for a in f8]
    with implementation(impl, device):
        a = PREFILL(*args)
        b = PREFILL(*f8)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert all(torch.equal(x.view(torch.uint8) if x.dtype == F8 else x, y.view(torch.uint8) if y.dtype == F8 else y)
               for x, y in zip(f8, snapshot) if isinstance(x, torch.Tensor))


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_unaligned_k(device, impl):
    """k at an address that is not a multiple of 4 bytes (the sm_90 path reads k as int32 words: such a call takes
    the Triton kernel), then the same call at an aligned address: both equal the oracle."""
    case = PrefillCase(7, 90, 64, 128, "causal", seed=13)
    expected, defined = case.expected()
    args = list(case.args(device))
    storage = torch.zeros(case.k8.numel() + 4, dtype=torch.uint8, device=device)
    for offset in (1, 4):
        k = storage[offset:offset + case.k8.numel()].view(case.k8.shape)
        k.copy_(args[1])
        with implementation(impl, device):
            got = ops.fp8_fp4_mqa_logits((args[0], None), (k, args[2]), *args[3:])
        assert_logits(got, expected, defined, True, f"k at offset {offset}")


# --- paged decode -----------------------------------------------------------------------------------------------------
def page_stride(bs: int, kind: str) -> int:
    return {"padded": layout.round_up(bs * TOKEN_BYTES, 576), "unpadded": bs * TOKEN_BYTES}[kind]


class PagedCase:
    """A cache of NaN-poisoned pages (0x7F/0xFF bytes: NaN codes and NaN scales) in which the pages the table
    references validly are fully written by indexer_k_quant_and_cache (the reference), a hostile table (-1,
    INT32_MIN, >= nb, INT32_MAX, and a width shorter than the longest context), random fp8 q."""

    def __init__(self, batch, next_n, heads, *, bs=16, nb=9, kind="padded", lens_2d=True, table_dtype=torch.int32,
                 fnuz=False, max_len=80, clean=True, ndim=4, seed=0, q_dtype=torch.uint8, write_all=False):
        g = torch.Generator().manual_seed(seed)
        self.batch, self.next_n, self.bs, self.nb, self.fnuz = batch, next_n, bs, nb, fnuz
        self.max_len, self.clean, self.ndim, self.q_dtype = max_len, clean, ndim, q_dtype
        self.stride = page_stride(bs, kind)
        self.lead = self.stride                                     # a guard page before the cache
        pattern = torch.tensor([0x7F, 0xFF], dtype=torch.uint8).repeat(self.lead // 2 + nb * self.stride // 2 + 32)
        self.flat = pattern[:self.lead + nb * self.stride + 64].clone()
        width = max(1, layout.cdiv(max_len, bs) - 1)               # the last columns below max_len: past the width
        table = torch.randint(0, nb - 2, (batch, width), generator=g, dtype=torch.int64)   # blocks nb-2, nb-1 unused
        hostile = [-1, INT32_MIN, nb, INT32_MAX, nb + 5, -3]
        for b in range(batch):
            cols = torch.randperm(width, generator=g)[:max(1, min(2, width - 1))].tolist()
            for i, c in enumerate(cols):
                table[b, c] = hostile[(2 * b + i) % len(hostile)]
        self.table = table.to(table_dtype)
        used = range(nb) if write_all else sorted({v for v in table.flatten().tolist() if 0 <= v < nb})
        slots = torch.tensor([blk * bs + o for blk in used for o in range(bs)], dtype=torch.int64)
        k = torch.randn(slots.shape[0], DIM, generator=g) * torch.exp2(torch.randint(-4, 5, (slots.shape[0], 1),
                                                                                      generator=g).float())
        with implementation("reference", torch.device("cpu")):
            indexer_k_quant_and_cache(k.to(torch.bfloat16), self.cache(self.flat), slots, 128, "ue8m0",
                                      use_fnuz=fnuz)
        self.q8 = fp8_codes((batch, next_n, heads, DIM), g, fnuz)
        self.w = torch.randn(batch * next_n, heads, generator=g) / 4
        ctx = torch.randint(-2, max_len + bs + 10, (batch,), generator=g)
        ctx[0] = max_len + 2 * bs                                   # past the table's width and max_len
        if batch > 1:
            ctx[1] = 0
        if lens_2d:
            self.lens = (ctx[:, None] - torch.randint(0, 4, (batch, next_n), generator=g)).int()
            self.lens_rows = self.lens.tolist()
        else:
            self.lens = ctx.int()
            self.lens_rows = [[c - next_n + j + 1 for j in range(next_n)] for c in ctx.tolist()]

    def cache(self, flat):
        pages = flat[self.lead:self.lead + self.nb * self.stride].view(self.nb, self.stride)[:, :self.bs * TOKEN_BYTES]
        shape = (self.nb, self.bs, 1, TOKEN_BYTES) if self.ndim == 4 else (self.nb, self.bs, TOKEN_BYTES)
        return pages.view(shape)

    def args(self, device):
        q = as_operand(self.q8, self.q_dtype, device)
        return (q, self.cache(self.flat.to(device)), self.w.to(device), self.lens.to(device), self.table.to(device),
                self.max_len, self.clean)

    def expected(self):
        return oracle_paged(self.q8, self.flat, self.lead, self.nb, self.bs, self.stride, self.w, self.lens_rows,
                            self.table, self.max_len, self.fnuz)


PAGED_CASES = {
    "n2-h64-bs16-2d-padded": dict(batch=3, next_n=2, heads=64, seed=1),
    "n1-h1-bs64-1d-int64-dirty": dict(batch=2, next_n=1, heads=1, bs=64, nb=5, lens_2d=False,
                                      table_dtype=torch.int64, clean=False, max_len=150, seed=2),
    "n2-h8-bs16-1d-unpadded-3d": dict(batch=3, next_n=2, heads=8, kind="unpadded", lens_2d=False, ndim=3, seed=3),
    "n3-h4-bs5-fnuz-float8": dict(batch=2, next_n=3, heads=4, bs=5, nb=12, fnuz=True, q_dtype=F8Z, max_len=37, seed=4),
    "n2-h48-bs16-dirty": dict(batch=2, next_n=2, heads=48, clean=False, seed=5),
    # two resident query groups (interpreter tiles: 32 rows of 32 heads each); on a GPU one group of 64 rows
    "n2-h32-bs64-groups": dict(batch=2, next_n=2, heads=32, bs=64, nb=6, max_len=200, seed=6),
    # interpreter: 4 groups x 2 head chunks, reloaded per tile; GPU: two resident groups of 2 queries x 64 heads
    "n4-h64-bs64": dict(batch=2, next_n=4, heads=64, bs=64, nb=6, max_len=150, seed=7),
    # the sm_90 Gluon path's shapes (64 heads, next_n 1 or 2, 64-key pages; kernels/mqa_logits_gluon.py)
    "n2-h64-bs64-sm90": dict(batch=3, next_n=2, heads=64, bs=64, nb=7, max_len=200, seed=8),
    "n1-h64-bs64-1d-int64-dirty-sm90": dict(batch=3, next_n=1, heads=64, bs=64, nb=7, lens_2d=False,
                                            table_dtype=torch.int64, clean=False, max_len=170, seed=9),
    "n2-h64-bs64-1d-unpadded-sm90": dict(batch=2, next_n=2, heads=64, bs=64, nb=6, kind="unpadded", lens_2d=False,
                                         max_len=130, seed=10),
}


@pytest.mark.parametrize("name", list(PAGED_CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_paged_logits(device, impl, name):
    case = PagedCase(**PAGED_CASES[name])
    expected, defined = case.expected()
    assert (expected[defined] == NINF).any(), "some invalid table entries inside the lengths"
    assert expected[defined].isfinite().any() and not expected.isnan().any()
    assert nonzero_share(case.flat) > 0.5
    args = case.args(device)
    with implementation(impl, device):
        got = ops.fp8_fp4_paged_mqa_logits((args[0], None), *args[1:5], None, *args[5:], use_fnuz=case.fnuz)
    assert got.shape == (case.batch * case.next_n, case.max_len) and got.dtype == torch.float32
    assert_logits(got, expected, defined, case.clean, name)


@pytest.mark.parametrize("name", ["n3-h4-bs5-fnuz-float8", "n2-h64-bs16-2d-padded"])
def test_paged_logits_one_split_per_request(device, name):
    """PAGED_PROGRAMS_PER_SM = 1: one program per request walks all its key tiles (the loops past a program's
    first tile, which the small cases' one-tile splits do not take), through the page-tile loop (block size 16)
    and the per-key lookup loop (block size 5)."""
    with patched_constants(kernels, [ops._PAGED_PLANS], PAGED_PROGRAMS_PER_SM=1):
        test_paged_logits(device, "kernel", name)


@pytest.mark.parametrize("impl", IMPLS)
def test_paged_out_poisoned_and_inputs_untouched(device, impl):
    """out= (a padded row stride, poisoned) is written and its padding untouched; the cache, q, table and lengths
    are unchanged."""
    case = PagedCase(2, 2, 16, seed=6, clean=True)
    expected, defined = case.expected()
    args = case.args(device)
    snapshot = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    big = poison_(torch.empty(4, case.max_len + 5, device=device))
    out = big[:, :case.max_len]
    with implementation(impl, device):
        PAGED_OUT(*args, out)
    assert torch.equal(big[:, case.max_len:].view(torch.int32), poison_(torch.empty(4, 5, device=device)).view(
        torch.int32))
    assert_logits(out, expected, defined, True, "paged out")
    for a, s in zip(args, snapshot):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, s.view(torch.uint8)
                               if s.element_size() == 1 else s)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_calls(device, impl):
    """M = 0, N = 0, B = 0 and max_model_len = 0 launch nothing and return correctly shaped outputs (R5)."""
    g = torch.Generator().manual_seed(13)
    with implementation(impl, device):
        for m, n in ((0, 9), (4, 0)):
            q = fp8_codes((m, 2, 32), g).to(device)
            k = fp8_codes((n, 32), g).to(device)
            got = ops.fp8_fp4_mqa_logits((q, None), (k, torch.ones(n, device=device)), torch.ones(m, 2, device=device),
                                         torch.zeros(m, dtype=torch.int32, device=device),
                                         torch.full((m,), n, dtype=torch.int32, device=device), True)
            assert got.shape == (m, n)
        cache = torch.zeros(2, 16, 1, TOKEN_BYTES, dtype=torch.uint8, device=device)
        for b, max_len in ((0, 10), (2, 0)):
            q = fp8_codes((b, 2, 4, DIM), g).to(device)
            got = ops.fp8_fp4_paged_mqa_logits((q, None), cache, torch.ones(2 * b, 4, device=device),
                                               torch.ones(b, 2, dtype=torch.int32, device=device),
                                               torch.zeros(b, 1, dtype=torch.int32, device=device), None, max_len, True)
            assert got.shape == (2 * b, max_len)


# --- metadata ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_metadata_zeros(device, impl):
    lens = torch.tensor([[5, 6], [70, 71]], dtype=torch.int32, device=device)
    with implementation(impl, device):
        got = ops.get_paged_mqa_logits_metadata(lens, 64, 132)
        assert got.dtype == torch.int32 and got.shape == (133, 2) and got.device == lens.device
        assert got.eq(0).all()
        buf = torch.full((9, 3), 7, dtype=torch.int32, device=device)
        out = buf[:, :2]
        assert ops.get_paged_mqa_logits_metadata(lens[:, 0], 16, 8, out=out) is out
    assert out.eq(0).all() and buf[:, 2].eq(7).all()
    with pytest.raises(NotImplementedError, match="indices"):
        ops.get_paged_mqa_logits_metadata(lens, 64, 8, indices=lens)


# --- bad input --------------------------------------------------------------------------------------------------------
def _prefill_kwargs(device):
    g = torch.Generator().manual_seed(14)
    return dict(q=fp8_codes((4, 2, 32), g).to(device), k=fp8_codes((6, 32), g).to(device),
                k_scale=torch.ones(6, device=device), weights=torch.ones(4, 2, device=device),
                ks=torch.zeros(4, dtype=torch.int32, device=device), ke=torch.full((4,), 6, dtype=torch.int32,
                                                                                   device=device))


def _call_prefill(a):
    return ops.fp8_fp4_mqa_logits((a["q"], None), (a["k"], a["k_scale"]), a["weights"], a["ks"], a["ke"],
                                  a.get("clean", True), out=a.get("out"), use_fnuz=a.get("use_fnuz", False))


PREFILL_BAD = [
    (lambda a, dev: a.update(q=a["q"].float()), "q", ValueError),
    (lambda a, dev: a.update(q=a["q"][0]), "q", ValueError),
    (lambda a, dev: a.update(q=a["q"].transpose(0, 2).contiguous().transpose(0, 2)), "q", ValueError),
    (lambda a, dev: a.update(q=torch.zeros(4, 2, 48, dtype=torch.uint8, device=dev)), "q", NotImplementedError),
    (lambda a, dev: a.update(q=torch.zeros(4, 0, 32, dtype=torch.uint8, device=dev),
                             weights=torch.ones(4, 0, device=dev)), "q", ValueError),
    (lambda a, dev: a.update(k=torch.zeros(6, 64, dtype=torch.uint8, device=dev)), "k", ValueError),
    (lambda a, dev: a.update(k=a["k"].view(torch.int8)), "k", ValueError),
    (lambda a, dev: a.update(k_scale=torch.ones(5, device=dev)), "k_scale", ValueError),
    (lambda a, dev: a.update(k_scale=torch.ones(6, 2, device=dev)), "k_scale", ValueError),
    (lambda a, dev: a.update(k_scale=torch.ones(6, device=dev).half()), "k_scale", ValueError),
    (lambda a, dev: a.update(weights=torch.ones(4, 3, device=dev)), "weights", ValueError),
    (lambda a, dev: a.update(weights=torch.ones(4, 2, device=dev, dtype=torch.bfloat16)), "weights", ValueError),
    (lambda a, dev: a.update(ks=a["ks"].long()), "cu_seqlen_ks", ValueError),
    (lambda a, dev: a.update(ke=a["ke"][:3]), "cu_seqlen_ke", ValueError),
    (lambda a, dev: a.update(clean=1), "clean_logits", ValueError),
    (lambda a, dev: a.update(out=torch.zeros(4, 5, device=dev)), "out", ValueError),
    (lambda a, dev: a.update(out=torch.zeros(6, 4, device=dev).T), "out", ValueError),
    (lambda a, dev: a.update(out=torch.zeros(4, 6, device=dev).double()), "out", ValueError),
]


@pytest.mark.parametrize("mutate,word,exc", PREFILL_BAD, ids=range(len(PREFILL_BAD)))
@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_bad_input(device, impl, mutate, word, exc):
    a = _prefill_kwargs(device)
    mutate(a, device)
    with implementation(impl, device), pytest.raises(exc, match=rf"\b{word}\b"):
        _call_prefill(a)


def test_fp4_and_indices_not_implemented(device):
    a = _prefill_kwargs(device)
    with pytest.raises(NotImplementedError, match="fp4"):
        ops.fp8_fp4_mqa_logits((a["q"], a["k_scale"]), (a["k"], a["k_scale"]), a["weights"], a["ks"], a["ke"], True)
    case = PagedCase(1, 1, 4, seed=15)
    args = case.args(device)
    with pytest.raises(NotImplementedError, match="fp4"):
        ops.fp8_fp4_paged_mqa_logits((args[0], args[2]), *args[1:5], None, *args[5:])
    with pytest.raises(NotImplementedError, match="indices"):
        ops.fp8_fp4_paged_mqa_logits((args[0], None), *args[1:5], None, *args[5:], indices=args[3])


def _paged_kwargs(device):
    case = PagedCase(2, 2, 4, seed=16)
    q, cache, w, lens, table, max_len, clean = case.args(device)
    return dict(q=q, cache=cache, w=w, lens=lens, table=table, max_len=max_len, clean=clean)


def _call_paged(a):
    return ops.fp8_fp4_paged_mqa_logits((a["q"], None), a["cache"], a["w"], a["lens"], a["table"], None, a["max_len"],
                                        a["clean"], out=a.get("out"))


PAGED_BAD = [
    (lambda a, dev: a.update(q=a["q"][..., :64]), "q"),
    (lambda a, dev: a.update(q=a["q"][0]), "q"),
    (lambda a, dev: a.update(q=a["q"].to(torch.int8)), "q"),
    (lambda a, dev: a.update(cache=a["cache"].view(torch.int8)), "kv_cache"),
    (lambda a, dev: a.update(cache=torch.zeros(3, 16, 2, TOKEN_BYTES, dtype=torch.uint8, device=dev)), "kv_cache"),
    (lambda a, dev: a.update(cache=torch.zeros(3, 16, 1, 128, dtype=torch.uint8, device=dev)), "kv_cache"),
    (lambda a, dev: a.update(w=a["w"][:3]), "weights"),
    (lambda a, dev: a.update(w=a["w"].double()), "weights"),
    (lambda a, dev: a.update(lens=a["lens"].long()), "context_lens"),
    (lambda a, dev: a.update(lens=a["lens"][:, :1]), "context_lens"),
    (lambda a, dev: a.update(lens=a["lens"][:1, 0]), "context_lens"),
    (lambda a, dev: a.update(table=a["table"].to(torch.int16)), "block_tables"),
    (lambda a, dev: a.update(table=a["table"][0]), "block_tables"),
    (lambda a, dev: a.update(max_len=-1), "max_model_len"),
    (lambda a, dev: a.update(max_len=True), "max_model_len"),
    (lambda a, dev: a.update(clean=None), "clean_logits"),
    (lambda a, dev: a.update(out=torch.zeros(4, 7, device=dev)), "out"),
]


@pytest.mark.parametrize("mutate,word", PAGED_BAD, ids=range(len(PAGED_BAD)))
@pytest.mark.parametrize("impl", IMPLS)
def test_paged_bad_input(device, impl, mutate, word):
    a = _paged_kwargs(device)
    mutate(a, device)
    with implementation(impl, device), pytest.raises(ValueError, match=rf"\b{word}\b"):
        _call_paged(a)


@pytest.mark.parametrize("impl", IMPLS)
def test_metadata_bad_input(device, impl):
    lens = torch.ones(3, dtype=torch.int32, device=device)
    with implementation(impl, device):
        for args, word in (((lens.long(), 64, 8), "context_lens"), ((lens, 0, 8), "block_size"),
                           ((lens, 64, 0), "num_sms")):
            with pytest.raises(ValueError, match=word):
                ops.get_paged_mqa_logits_metadata(*args)
        with pytest.raises(ValueError, match="out"):
            ops.get_paged_mqa_logits_metadata(lens, 64, 8, out=torch.zeros(8, 2, dtype=torch.int32, device=device))


# --- composition ------------------------------------------------------------------------------------------------------
def _opcheck_prefill(device, out_form):
    case = PrefillCase(5, 19, 4, 32, "hostile", seed=17)
    args = list(case.args(device))
    if out_form:
        args.append(torch.zeros(5, 19, device=device))
    return args


def _opcheck_paged(device, out_form):
    case = PagedCase(2, 2, 4, seed=18, max_len=40)
    args = list(case.args(device))
    if out_form:
        args.append(torch.zeros(4, 40, device=device))
    return args


# (op, make args, positions given permuted layouts, positions given padded rows)
OPCHECK = {
    "prefill": (PREFILL, _opcheck_prefill, False, (3,), (0, 1, 3)),
    "prefill_out": (PREFILL_OUT, _opcheck_prefill, True, (3,), (0, 1, 3, 7)),
    "paged": (PAGED, _opcheck_paged, False, (2, 3, 4), (0, 2, 3, 4)),
    "paged_out": (PAGED_OUT, _opcheck_paged, True, (2, 3, 4), (0, 2, 3, 4, 7)),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", list(OPCHECK))
def test_opcheck(device, impl, op):
    """torch.library.opcheck on uint8 operands (float8 tensors cannot go through test_schema on CPU: see
    test_prefill_float8_bitwise_and_inputs_untouched), contiguous, permuted and padded-row inputs."""
    fn, make, out_form, permuted, padded = OPCHECK[op]
    args = make(device, out_form)
    with implementation(impl, device):
        run_opcheck(fn, args, layouts=("contiguous", "permuted"), permute=lambda i, t: i in permuted)
        run_opcheck(fn, args, layouts=("padded",), permute=lambda i, t: i in padded)


@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck_metadata(device, impl):
    lens = torch.tensor([[3, 4], [9, 10]], dtype=torch.int32, device=device)
    with implementation(impl, device):
        run_opcheck(META, (lens, 64, 6), layouts=("contiguous",))
        run_opcheck(META_OUT, (lens, 64, 6, torch.full((7, 2), 3, dtype=torch.int32, device=device)),
                    layouts=("contiguous", "permuted"), permute=lambda i, t: i == 3)


def test_compile_prefill_no_recompile(device):
    """fullgraph=True, dynamic=True over three (M, N): one graph; on a GPU no new Triton compilation."""
    cases = [PrefillCase(m, n, 4, 64, "causal", seed=20 + m) for m, n in ((5, 21), (9, 34), (12, 47))]

    def step(q, k, scale, w, ks, ke):
        return ops.fp8_fp4_mqa_logits((q, None), (k, scale), w, ks, ke, True)

    inputs = [c.args(device)[:6] for c in cases]
    step(*inputs[0])                 # the first specialisation
    check_compile(step, inputs, kernels=[kernels.mqa_logits_kernel])
    for c, args in zip(cases, inputs):
        assert_logits(step(*args), *c.expected(), True, "compile eager")


def test_compile_paged_no_recompile(device):
    """fullgraph=True, dynamic=True over three (B, max_model_len, table width): one graph, no new compilation. The
    kernel on a GPU; on the CPU the reference (what dynamo sees does not depend on the implementation, and the
    interpreter's kernel runs in the other tests)."""
    # B, B*next_n, the table width and max_model_len never coincide with each other or a fixed size (duck sizing)
    cases = [PagedCase(b, 2, 4, seed=30 + b, max_len=ml) for b, ml in ((3, 120), (5, 180), (7, 300))]

    def step(q, cache, w, lens, table, max_len):
        return ops.fp8_fp4_paged_mqa_logits((q, None), cache, w, lens, table, None, max_len, True)

    inputs = [c.args(device)[:6] for c in cases]
    with implementation("reference" if device.type == "cpu" else "kernel", device):
        step(*inputs[0])                 # the first specialisation
        check_compile(step, inputs, kernels=[kernels.paged_mqa_logits_kernel])
        for c, args in zip(cases, inputs):
            assert_logits(step(*args), *c.expected(), True, "compile eager")


@pytest.mark.gpu
def test_gluon_paged_launches_directly(monkeypatch):
    """Where the Gluon paged path runs, a repeated call of one signature skips Triton's JIT and writes what Triton's
    public path writes."""
    from torch_dsv4_ops.kernels import mqa_logits_gluon as gk

    if not gluon_runs_direct(gk):
        pytest.skip("the Gluon paged path runs on sm_90 with a verified Triton only")
    case = PagedCase(**PAGED_CASES["n2-h64-bs64-sm90"])
    args = case.args(torch.device("cuda"))
    out = torch.empty(case.batch * case.next_n, case.max_len, device="cuda")

    def call():
        ops.fp8_fp4_paged_mqa_logits((args[0], None), *args[1:5], None, *args[5:], use_fnuz=case.fnuz, out=out)
        return [out]

    check_direct_launches(gk.PAGED_LAUNCHER, call, monkeypatch, ops._PAGED_PLANS, "Gluon paged logits")


def test_gluon_paged_rule():
    """The Gluon path (kernels/mqa_logits_gluon.py) is planned on sm_90 with Triton 3.6 only, for 64 heads, next_n 1
    or 2, 64-key pages, e4m3fn and contiguous q and weights; its grid is about one wave of 4 programs per SM."""
    from torch_dsv4_ops.kernels import mqa_logits_gluon as gk

    sm90 = next(t for t in platform.MATRIX_TARGETS if t.backend == "cuda" and t.arch == 90)
    sm80 = next(t for t in platform.MATRIX_TARGETS if t.backend == "cuda" and t.arch == 80)
    q, w = torch.zeros(2, 2, 64, DIM, dtype=torch.uint8), torch.zeros(4, 64)
    e4, fnuz = layout.E4M3FN, layout.E4M3FNUZ
    ok = dict(target=sm90, heads=64, next_n=2, block_size=64, q=q, weights=w, q_fmt=e4, k_fmt=e4, version="3.6.0")
    assert gk.planned(**ok) == (gk.gluon is not None)
    for change in (dict(version="3.9.0"), dict(target=sm80), dict(heads=32), dict(next_n=4), dict(block_size=16),
                   dict(q_fmt=fnuz), dict(k_fmt=fnuz), dict(q=q.transpose(2, 3)), dict(weights=w.t())):
        assert not gk.planned(**{**ok, **change}), change
    assert gk.splits(64, 16384, 132) == (8, 32) and gk.splits(1, 16384, 132) == (256, 1)
    assert gk.splits(200, 100, 132) == (2, 1)


def test_gluon_prefill_rule():
    """The prefill's Gluon kernel is planned on sm_90 with Triton 3.6 only, for 64 heads, D 128, e4m3fn and k rows a
    multiple of 4 bytes apart."""
    from torch_dsv4_ops.kernels import mqa_logits_gluon as gk

    sm90 = next(t for t in platform.MATRIX_TARGETS if t.backend == "cuda" and t.arch == 90)
    sm80 = next(t for t in platform.MATRIX_TARGETS if t.backend == "cuda" and t.arch == 80)
    e4, fnuz = layout.E4M3FN, layout.E4M3FNUZ
    ok = dict(target=sm90, heads=64, dim=128, k_row_bytes=144, q_fmt=e4, k_fmt=e4, version="3.6.1")
    assert gk.prefill_planned(**ok) == (gk.gluon is not None)
    for change in (dict(version="3.7.1"), dict(target=sm80), dict(heads=32), dict(dim=64), dict(k_row_bytes=130),
                   dict(q_fmt=fnuz), dict(k_fmt=fnuz)):
        assert not gk.prefill_planned(**{**ok, **change}), change


@pytest.mark.gpu
def test_compile_prefill_64_heads_no_recompile():
    """The benchmark's head count and dim (the sm_90 Gluon kernel where it is planned) over three (M, N): one
    graph, and no new compilation of either kernel."""
    from torch_dsv4_ops.kernels import mqa_logits_gluon as gk

    device = torch.device("cuda")
    cases = [PrefillCase(m, n, 64, 128, "causal", seed=20 + m) for m, n in ((5, 70), (9, 131), (16, 192))]

    def step(q, k, scale, w, ks, ke):
        return ops.fp8_fp4_mqa_logits((q, None), (k, scale), w, ks, ke, True)

    inputs = [c.args(device)[:6] for c in cases]
    step(*inputs[0])
    counted = [kernels.mqa_logits_kernel] + ([gk.mqa_logits_gluon_kernel] if gk.gluon is not None else [])
    check_compile(step, inputs, kernels=counted)
    for c, args in zip(cases, inputs):
        assert_logits(step(*args), *c.expected(), True, "compile eager")


def test_head_split_rules():
    """Every product has >= 16 query rows; chunks only when one query's heads exceed the tile; BQ // GQ groups."""
    for heads in (1, 3, 4, 16, 64, 96, 128, 256, 1000):
        for queries in (1, 2, 4, 8):
            gq, hc, chunks = kernels.head_split(heads, queries, 128)
            assert gq * hc >= kernels.MIN_DOT and gq * hc <= max(128, kernels.MIN_DOT)
            assert hc * chunks >= heads and queries % gq == 0
    assert kernels.head_split(64, 2, 128) == (2, 64, 1)
    assert kernels.head_split(256, 1, 128) == (1, 128, 2)
    assert kernels.head_split(1, 1, 128) == (1, 16, 1)


# --- GPU only ---------------------------------------------------------------------------------------------------------
def _sampled_rows_close(got, q8, k8, scale, w, ks, ke, rows, what):
    sub = torch.tensor(rows)
    expected, defined = oracle_prefill(q8[sub], k8, scale, w[sub], ks[sub], ke[sub])
    assert_logits(got.cpu()[sub], expected, defined, True, what)


@pytest.mark.gpu
@pytest.mark.parametrize("ranges", ["full", "causal"])
def test_prefill_benchmark_sized(ranges):
    """M 4096 x N 8192, 64 heads, D 128 (the benchmark's shape), under sync-debug "error"; 48 sampled rows against
    the float64 oracle."""
    g = torch.Generator().manual_seed(40)
    m, n, heads = 4096, 8192, 64
    q8, k8 = fp8_codes((m, heads, DIM), g), fp8_codes((n, DIM), g)
    scale = torch.exp2(torch.randint(-8, 2, (n,), generator=g).float())
    w = torch.randn(m, heads, generator=g) / 4
    i = torch.arange(m)
    ks = torch.zeros(m, dtype=torch.int32) if ranges == "full" else (i // 1024 * 2048).int()
    ke = torch.full((m,), n, dtype=torch.int32) if ranges == "full" else (n - m + i + 1).int()
    dev = [t.cuda() for t in (q8, k8, scale, w, ks, ke)]       # host-to-device copies synchronise: before
    with sync_debug_error():
        got = ops.fp8_fp4_mqa_logits((dev[0].view(F8), None), (dev[1].view(F8), dev[2]), *dev[3:], True)
    torch.cuda.synchronize()
    rows = list(range(0, m, 97)) + [m - 1]
    _sampled_rows_close(got, q8, k8, scale, w, ks, ke, rows, f"prefill {ranges}")


@pytest.mark.gpu
def test_paged_benchmark_sized():
    """B 64, next_n 2, 64 heads, 16384 entries per request over a bs 64 cache written by the insert op; 3 requests
    against the float64 oracle."""
    g = torch.Generator().manual_seed(41)
    batch, next_n, heads, bs, ctx = 64, 2, 64, 64, 16384
    width = ctx // bs
    nb = batch * width + 3
    stride = page_stride(bs, "padded")
    flat = torch.zeros(nb * stride, dtype=torch.uint8)
    pages = flat.view(nb, stride)[:, :bs * TOKEN_BYTES].view(nb, bs, 1, TOKEN_BYTES)
    dev_flat = flat.cuda()
    dev_cache = dev_flat.view(nb, stride)[:, :bs * TOKEN_BYTES].view(nb, bs, 1, TOKEN_BYTES)
    k = (torch.randn(nb * bs, DIM, device="cuda") * 2).to(torch.bfloat16)
    indexer_k_quant_and_cache(k, dev_cache, torch.arange(nb * bs, device="cuda"), 128, "ue8m0")
    table = torch.randperm(nb, generator=g)[:batch * width].view(batch, width).int()
    table[5, 7] = -1
    q8 = fp8_codes((batch, next_n, heads, DIM), g)
    w = torch.randn(batch * next_n, heads, generator=g) / 4
    lens = (ctx - 1 + torch.arange(next_n))[None, :].repeat(batch, 1).int()
    lens[3] = torch.tensor([100, 101])
    args = [q8.cuda(), w.cuda(), lens.cuda(), table.cuda()]
    with sync_debug_error():
        got = ops.fp8_fp4_paged_mqa_logits((args[0], None), dev_cache, args[1], args[2], args[3], None, ctx, True)
    torch.cuda.synchronize()
    flat.copy_(dev_flat.cpu())
    assert nonzero_share(pages) > 0.5
    for b in (0, 3, 5):
        rows = slice(b * next_n, (b + 1) * next_n)
        exp, defined = oracle_paged(q8[b:b + 1], flat, 0, nb, bs, stride, w[rows], lens[b:b + 1].tolist(),
                                    table[b:b + 1], ctx, False)
        assert_logits(got[rows], exp, defined, True, f"paged request {b}")


@pytest.mark.gpu
def test_cuda_graph_paged_replay():
    """The paged _out form and the metadata captured once; replayed with new q, weights, context lengths and block
    tables in the same buffers: equal to eager, and to the oracle."""
    cases = [PagedCase(4, 2, 64, bs=64, nb=6, max_len=200, seed=50 + i, write_all=True) for i in range(3)]
    for c in cases[1:]:
        c.flat = cases[0].flat                                  # one cache (every page written); new tables, lengths
    cache = cases[0].cache(cases[0].flat.cuda())

    def step(q, w, lens, table, out, sched):
        ops.fp8_fp4_paged_mqa_logits((q, None), cache, w, lens, table, sched, 200, True, out=out)
        ops.get_paged_mqa_logits_metadata(lens, 64, 132, out=sched)

    def values(c):
        a = c.args("cuda")
        return [a[0], a[2], a[3], a[4], torch.zeros(8, 200, device="cuda"),
                torch.full((133, 2), 9, dtype=torch.int32, device="cuda")]

    static = values(cases[0])
    check_cuda_graph(step, static, [values(c) for c in cases[1:]])
    expected, defined = cases[2].expected()
    assert_logits(static[4], expected, defined, True, "replayed paged logits")
    assert static[5].eq(0).all()


@pytest.mark.gpu
def test_no_host_sync():
    """First (planning) and later calls of all three ops with fresh shapes under sync-debug "error"."""
    pc = PrefillCase(300, 700, 64, 128, "causal", seed=60)
    pa = PagedCase(5, 2, 64, bs=64, nb=8, max_len=300, seed=61)
    p_args, g_args = pc.args("cuda"), pa.args("cuda")
    with sync_debug_error():
        for _ in range(2):
            a = PREFILL(*p_args)
            b = PAGED(*g_args)
            META(g_args[3], 64, 132)
    torch.cuda.synchronize()
    assert_logits(a, *pc.expected(), True, "prefill under sync-debug")
    assert_logits(b, *pa.expected(), True, "paged under sync-debug")
