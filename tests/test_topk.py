"""top_k_per_row_prefill and top_k_per_row_decode (SPEC §3.9, "Points settled", §4 b, h, i, §5).

Every expected index comes from the plain-Python oracle below (candidates sorted by value in float64, NaN
lowest, then by index; the first topk re-sorted ascending); the package's reference is checked against it like
the kernel. Outputs are poisoned: columns past topk and rows past num_rows must keep their sentinel.
"""
import math
import re

import pytest
import torch

from torch_dsv4_ops import layout
from torch_dsv4_ops.kernels import topk as kernels
from torch_dsv4_ops.ops import topk as ops
from torch_dsv4_ops.ops.topk import top_k_per_row_decode, top_k_per_row_prefill
from torch_dsv4_ops.ops._plans import ByAlignment
from torch_dsv4_ops.reference import topk as reference
from torch_dsv4_ops.testing import (assert_bitwise_equal, check_compile, check_cuda_graph, implementation, run_opcheck,
                                    patched_constants, sync_debug_error)

PREFILL = torch.ops.dsv4.top_k_per_row_prefill.default
DECODE = torch.ops.dsv4.top_k_per_row_decode.default
IMPLS = ["reference", "kernel"]
SENTINEL = -7
NAN, INF = float("nan"), float("inf")
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


# --- independent oracle -------------------------------------------------------------------------------------------
def oracle_row(vals: list, lo: int, hi: int, topk: int) -> list:
    """topk_indices[r, :topk] for candidates vals[lo:hi] (Python floats)."""
    n = hi - lo
    if n <= topk:
        return list(range(n)) + [-1] * (topk - n)

    def rank(i):
        v = vals[lo + i]
        return (1, 0.0, i) if math.isnan(v) else (0, -v, i)      # -0.0 == 0.0: the index decides

    return sorted(sorted(range(n), key=rank)[:topk])


def prefill_range(ks: int, ke: int, n_cols: int) -> tuple:
    lo = min(max(ks, 0), n_cols)
    return lo, min(max(ke, lo), n_cols)


def decode_range(seq: list, next_n: int, r: int, n_cols: int) -> tuple:
    b, j = divmod(r, next_n)
    if b >= len(seq):
        return 0, 0
    length = seq[b][j] if isinstance(seq[b], list) else seq[b] - next_n + j + 1
    return 0, min(max(length, 0), n_cols)


def strided_rows(storage: torch.Tensor, offset: int, rows: int, n_cols: int, s0: int, s1: int) -> list:
    """Row r = [storage[offset + r*s0 + c*s1] for c < n_cols] as float64 Python lists."""
    flat = storage.reshape(-1).double().tolist()
    return [[flat[offset + r * s0 + c * s1] for c in range(n_cols)] for r in range(rows)]


def expected_out(poisoned: torch.Tensor, rows: list, ranges: list, topk: int) -> torch.Tensor:
    out = poisoned.clone()
    for r, (lo, hi) in enumerate(ranges):
        out[r, :topk] = torch.tensor(oracle_row(rows[r], lo, hi, topk), dtype=torch.int32)
    return out


def test_oracle_literal():
    """The oracle itself on a literal row: [3, NaN, -inf, 5, 5, -0.0, 0.0, 5, 1]."""
    row = [3.0, NAN, -INF, 5.0, 5.0, -0.0, 0.0, 5.0, 1.0]
    assert oracle_row(row, 0, 9, 3) == [3, 4, 7]
    assert oracle_row(row, 0, 9, 5) == [0, 3, 4, 7, 8]
    assert oracle_row(row, 0, 9, 6) == [0, 3, 4, 5, 7, 8]          # -0.0 ties 0.0: the lower index
    assert oracle_row(row, 0, 9, 8) == [0, 2, 3, 4, 5, 6, 7, 8]    # -inf in, NaN out
    assert oracle_row(row, 2, 9, 3) == [1, 2, 5]                   # request-local
    assert oracle_row(row, 2, 5, 3) == [0, 1, 2] and oracle_row(row, 2, 4, 3) == [0, 1, -1]
    assert prefill_range(-4, 99, 9) == (0, 9) and prefill_range(7, 3, 9) == (7, 7)
    assert prefill_range(12, 20, 9) == (9, 9)
    assert decode_range([5, [1, 2]], 2, 0, 9) == (0, 4) and decode_range([[3, 4]], 2, 1, 9) == (0, 4)
    assert decode_range([5], 2, 2, 9) == (0, 0)


# --- worked example (docs/ops/topk.md §4) ---------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_worked_example(device, impl):
    """logits row [3, NaN, -inf, 5, 5, -0.0, 0.0, 5, 1] and topk_indices [3, 8] of -7:
    prefill rows (ks, ke) = (0, 9), (2, 9), (-3, 2), (5, 5) with topk 6 give [0 3 4 5 7 8], [1 2 3 4 5 6],
    [0 1 -1 -1 -1 -1], [-1 x 6]; decode next_n 1 with seq_lens [9, 40, 2] and topk 8 gives [0 2 3 4 5 6 7 8]
    for rows 0 and 1 (40 clamps to 9) and [0 1 -1 ...] for row 2. Columns 6, 7 (prefill) stay -7."""
    row = torch.tensor([3.0, NAN, -INF, 5.0, 5.0, -0.0, 0.0, 5.0, 1.0])
    logits = row.expand(3, 9).contiguous().to(device)
    out = torch.full((4, 8), SENTINEL, dtype=torch.int32, device=device)
    big = torch.zeros(4, 9, device=device)
    big[:3] = logits
    big[3] = logits[0]
    ks = torch.tensor([0, 2, -3, 5], dtype=torch.int32, device=device)
    ke = torch.tensor([9, 9, 2, 5], dtype=torch.int32, device=device)
    with implementation(impl, device):
        top_k_per_row_prefill(big, ks, ke, out, 4, 9, 1, 6)
    s = SENTINEL
    assert out.cpu().tolist() == [[0, 3, 4, 5, 7, 8, s, s], [1, 2, 3, 4, 5, 6, s, s], [0, 1, -1, -1, -1, -1, s, s],
                                  [-1, -1, -1, -1, -1, -1, s, s]]
    out = torch.full((3, 8), SENTINEL, dtype=torch.int32, device=device)
    with implementation(impl, device):
        top_k_per_row_decode(logits, 1, torch.tensor([9, 40, 2], dtype=torch.int32, device=device), out, 3, None,
                             None, 8)
    assert out.cpu().tolist() == [[0, 2, 3, 4, 5, 6, 7, 8]] * 2 + [[0, 1] + [-1] * 6]


# --- random data with planted ties, NaN, infinities and signed zeros ------------------------------------------------
def planted_logits(rows: int, n_cols: int, seed: int) -> torch.Tensor:
    """fp32 [rows, n_cols]: random values, a third of them rounded to few levels (ties everywhere, also at the
    threshold), NaN, +-inf, +-0.0; row 1 all equal, row 2 all NaN, row 3 few levels only, row 4 -inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_cols, generator=g) * 3
    coarse = torch.rand(rows, n_cols, generator=g) < 0.35
    x = torch.where(coarse, (x * 2).round() / 2, x)
    special = torch.randint(0, 60, (rows, n_cols), generator=g)
    for code, v in ((0, NAN), (1, INF), (2, -INF), (3, 0.0), (4, -0.0)):
        x[special == code] = v
    x[1 % rows] = 0.75
    if rows > 4:
        x[2] = NAN
        x[3] = torch.randint(-2, 3, (n_cols,), generator=g).float()
        x[4] = torch.where(torch.rand(n_cols, generator=g) < 0.5, torch.tensor(-INF), torch.tensor(NAN))
    return x


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_random(device, impl):
    """16 of 18 rows of 600 logits, top-k 40: causal-like, full, empty, L = topk - 1, topk, topk + 1, ks < 0,
    ke past the row, ke < ks, ks past the row, the int32 extremes; unaligned starts."""
    n_cols, topk = 600, 40
    logits = planted_logits(18, n_cols, seed=1)
    spans = [(0, 600), (0, 600), (0, 600), (0, 600), (0, 600), (3, 44), (17, 57), (100, 139), (-50, 41),
             (560, 900), (300, 200), (700, 800), (INT32_MIN, INT32_MAX), (5, 333), (0, 1), (411, 599), (0, 0), (0, 0)]
    ks = torch.tensor([a for a, _ in spans], dtype=torch.int32)
    ke = torch.tensor([b for _, b in spans], dtype=torch.int32)
    out = torch.full((18, topk + 5), SENTINEL, dtype=torch.int32)
    rows = strided_rows(logits, 0, 16, n_cols, n_cols, 1)
    want = expected_out(out, rows, [prefill_range(a, b, n_cols) for a, b in spans[:16]], topk)
    got = out.clone().to(device)
    with implementation(impl, device):
        top_k_per_row_prefill(logits.to(device), ks.to(device), ke.to(device), got, 16, n_cols, 1, topk)
    assert_bitwise_equal(got.cpu(), want, "prefill vs oracle")


@pytest.mark.parametrize("next_n,seq_dim", [(1, 1), (2, 1), (2, 2)], ids=["n1-1d", "n2-1d", "n2-2d"])
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_random(device, impl, next_n, seq_dim):
    """6 requests of next_n rows (one row past seq_lens' requests), lengths 0, below / at / above topk, past the
    row, negative and the int32 extremes; top-k 40 over rows of 520 logits."""
    n_cols, topk, reqs = 520, 40, 6
    num_rows = reqs * next_n + 1
    logits = planted_logits(num_rows + 1, n_cols, seed=2 + next_n)
    if seq_dim == 1:
        seq = [520, 41, INT32_MAX, 40 + next_n - 1, INT32_MIN, 300]
    else:
        seq = [[520, 519], [41, 40], [900, -5], [39, 0], [INT32_MIN, INT32_MAX], [300, 299]]
    seq_t = torch.tensor(seq, dtype=torch.int32)
    out = torch.full((num_rows + 2, topk + 3), SENTINEL, dtype=torch.int32)
    rows = strided_rows(logits, 0, num_rows, n_cols, n_cols, 1)
    want = expected_out(out, rows, [decode_range(seq, next_n, r, n_cols) for r in range(num_rows)], topk)
    got = out.clone().to(device)
    with implementation(impl, device):
        top_k_per_row_decode(logits.to(device), next_n, seq_t.to(device), got, num_rows, n_cols, 1, topk)
    assert_bitwise_equal(got.cpu(), want, "decode vs oracle")


def check_prefill_rows(device, impl: str, logits: torch.Tensor, spans: list, topk: int, pad: int, label: str):
    """top_k_per_row_prefill over every row of a contiguous `logits` with (ks, ke) = spans[r], into a poisoned
    [rows, topk + pad] output, against the oracle."""
    rows_n, n_cols = logits.shape
    ks = torch.tensor([a for a, _ in spans], dtype=torch.int32)
    ke = torch.tensor([b for _, b in spans], dtype=torch.int32)
    out = torch.full((rows_n, topk + pad), SENTINEL, dtype=torch.int32)
    rows = strided_rows(logits, 0, rows_n, n_cols, n_cols, 1)
    want = expected_out(out, rows, [prefill_range(a, b, n_cols) for a, b in spans], topk)
    got = out.clone().to(device)
    with implementation(impl, device):
        top_k_per_row_prefill(logits.to(device), ks.to(device), ke.to(device), got, rows_n, n_cols, 1, topk)
    assert_bitwise_equal(got.cpu(), want, label)


def search_rows(n_cols: int, topk: int, seed: int) -> torch.Tensor:
    """Rows that steer the in-register threshold search into each of its exits: the threshold among consecutive
    floats (the search runs to the last bit after compacting), a value range from subnormals to 1e38, the top
    values packed at one end with -inf elsewhere, fewer than topk non-NaN values, topk + 1 and 2 * topk + 1
    copies of the maximum (more ties than the topk slots the compaction may fill: the narrowing ends at
    lo == top and the last sweep runs over the whole tile), topk + 1 or 2 * topk distinct values far above the
    rest, and few levels of about topk / 2 copies each (counts between them stall the interpolated search, so it
    snaps to the keys present)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.tensor(1.0)
    chain = [base]
    for _ in range(n_cols - 1):
        chain.append(torch.nextafter(chain[-1], torch.tensor(2.0)))
    adjacent = torch.stack(chain)[torch.randperm(n_cols, generator=g)]
    spread = torch.randn(n_cols, generator=g).sign() * 10.0 ** (torch.rand(n_cols, generator=g) * 76 - 38)
    spread[::37] = 1e-45                                              # subnormals
    packed = torch.full((n_cols,), -INF)
    packed[:2 * topk] = torch.arange(2 * topk, dtype=torch.float32)
    few = torch.full((n_cols,), NAN)
    few[torch.randperm(n_cols, generator=g)[:topk // 2]] = 1.0
    ties = torch.arange(n_cols, dtype=torch.float32)
    ties[torch.randperm(n_cols, generator=g)[:topk + 1]] = 1e9
    near = torch.randn(n_cols, generator=g)
    near[: topk + 1] = near[: topk + 1].abs() + 100.0                 # topk + 1 values far above the rest
    over = torch.randn(n_cols, generator=g)
    over[torch.randperm(n_cols, generator=g)[:2 * topk + 1]] = 7.0    # 2 * topk + 1 tied maxima
    full = torch.randn(n_cols, generator=g)
    full[1:4 * topk + 1:2] = torch.rand(2 * topk, generator=g) + 50.0  # 2 * topk distinct values on top
    levels = torch.randint(0, n_cols // (topk // 2), (n_cols,), generator=g).float()   # ~topk / 2 copies of each
    return torch.stack([adjacent, spread, packed, few, ties, near, over, full, levels])


@pytest.mark.parametrize("impl", IMPLS)
def test_threshold_search_rows(device, impl):
    """The rows of `search_rows` (600 columns, top-k 40) against the oracle, whole and from column 1 on."""
    n_cols, topk = 600, 40
    spans = [(0, n_cols)] * 9 + [(1, n_cols)] * 9
    check_prefill_rows(device, impl, search_rows(n_cols, topk, seed=11).repeat(2, 1), spans, topk, 1, "search rows")


@pytest.mark.parametrize("impl", IMPLS)
def test_whole_and_fitted_tiles(device, impl):
    """Decode windows that fill the 1024-column tile, its half and its quarter exactly (loaded without masks), and
    windows one column short of or past those sizes (masked, or the next tile up); top-k 40."""
    n_cols, topk = 1024, 40
    seq = [1024, 1023, 512, 513, 511, 256, 257, 255]
    logits = planted_logits(len(seq), n_cols, seed=21)
    out = torch.full((len(seq), topk + 2), SENTINEL, dtype=torch.int32)
    rows = strided_rows(logits, 0, len(seq), n_cols, n_cols, 1)
    want = expected_out(out, rows, [decode_range(seq, 1, r, n_cols) for r in range(len(seq))], topk)
    got = out.clone().to(device)
    with implementation(impl, device):
        top_k_per_row_decode(logits.to(device), 1, torch.tensor(seq, dtype=torch.int32, device=device), got,
                             len(seq), n_cols, 1, topk)
    assert_bitwise_equal(got.cpu(), want, "fitted tiles vs oracle")


@pytest.mark.parametrize("impl", IMPLS)
def test_explicit_strides(device, impl):
    """A transposed logits view (stride0 1), a padded one, and strides that differ from logits.stride() (they win):
    a [4, 300] view of a [5, 307]-padded buffer read with stride0 = 307 + 307 (every other buffer row); the output
    is a transposed int32 view."""
    n_cols, topk = 300, 24
    base = planted_logits(10, 307, seed=5)
    spans = [(0, 300), (10, 250), (-1, 30), (7, 31)]
    ks = torch.tensor([a for a, _ in spans], dtype=torch.int32)
    ke = torch.tensor([b for _, b in spans], dtype=torch.int32)
    ranges = [prefill_range(a, b, n_cols) for a, b in spans]
    cases = {
        "transposed": (base[:4, :n_cols].T.contiguous(), None, None),
        "padded rows": (base[:4, :n_cols], None, None),
        "every other row": (base[:4, :n_cols], 2 * 307, 1),
    }
    for name, (src, s0, s1) in cases.items():
        if name == "transposed":
            src = src.T
            assert src.stride() == (1, 4)
        stride0, stride1 = s0 or src.stride(0), s1 or src.stride(1)
        flat = torch.as_strided(src, (src.untyped_storage().nbytes() // 4,), (1,), 0)     # the whole storage
        rows = strided_rows(flat, src.storage_offset(), 4, n_cols, stride0, stride1)
        want = expected_out(torch.full((4, topk + 3), SENTINEL, dtype=torch.int32), rows, ranges, topk)
        got = torch.full((topk + 3, 4), SENTINEL, dtype=torch.int32).to(device).T    # strides (1, 4)
        storage = flat.clone().to(device)
        view = torch.as_strided(storage, src.shape, src.stride(), src.storage_offset())
        with implementation(impl, device):
            top_k_per_row_prefill(view, ks.to(device), ke.to(device), got, 4, s0, s1, topk)
        assert_bitwise_equal(got.cpu().contiguous(), want, name)


# --- long rows: the streaming path, and every digit schedule --------------------------------------------------------
@pytest.mark.parametrize("radix", [5, 8, 10])
@pytest.mark.parametrize("tiles", ["one-tile", "streamed"])
def test_kernel_paths_and_radix(device, radix, tiles):
    """The kernel with each digit width (5: Triton 3.6's schedule, 10: 3.7+, 8) on the in-register and the
    streaming path (128-column tiles), against the oracle: ties across tile boundaries, unaligned windows."""
    streamed = {"TILE_MAX": 128} if tiles == "streamed" else {}
    with patched_constants(kernels, [ops._PLANS], radix_bits=lambda version=None: radix, **streamed):
        n_cols, topk = 530, 48
        logits = planted_logits(8, n_cols, seed=7 + radix)
        logits[5] = torch.randint(0, 2, (n_cols,)).float()            # ~265 equal maxima: ties span tiles
        spans = [(0, 530), (0, 530), (0, 530), (0, 530), (0, 530), (3, 470), (129, 178), (250, 530)]
        check_prefill_rows(device, "kernel", logits, spans, topk, 2, f"radix {radix}, {tiles}")


def test_short_rows_written_in_steps(device):
    """Rows of at most TOPK candidates take the index fill, OUT_BLOCK columns a step: with OUT_BLOCK_MAX 16 a
    48-column top-k is written in 3 steps (as top-k 2048 is in 2 with the committed 1024), -1 past each row's
    length, the pad columns untouched."""
    with patched_constants(kernels, [ops._PLANS], OUT_BLOCK_MAX=16):
        logits = planted_logits(5, 200, seed=21)
        check_prefill_rows(device, "kernel", logits, [(0, 20), (7, 7), (100, 148), (150, 183), (31, 33)], 48, 2,
                           "short rows in 16-column steps")


def test_radix_bits_per_triton_version():
    assert kernels.radix_bits("3.6.0") == 5 and kernels.radix_bits("3.5.1") == 5
    assert kernels.radix_bits("3.7.0") == 5 and kernels.radix_bits("3.9.0+git1234") == 5
    assert kernels.tile_for(1) == kernels.TILE_MIN and kernels.tile_for(8192) == 8192
    assert kernels.tile_for(10**6) == kernels.TILE_MAX <= 16384


def test_register_cap_rule():
    """NVIDIA in-register tiles of at most REG_CAP_WARPS warps are compiled with REG_CAP registers (5 programs per
    SM); 8-warp tiles, streamed rows and other backends are not capped."""
    from torch_dsv4_ops import platform

    cuda = next(t for t in platform.MATRIX_TARGETS if t.backend == "cuda")
    hip = next(t for t in platform.MATRIX_TARGETS if t.backend == "hip")
    prefill = kernels.constexprs(kernels.MODE_PREFILL, 8192, 512, cuda)
    caps = kernels.COMPACT_REG_CAP if prefill["COMPACT"] else kernels.REG_CAP
    assert prefill["num_warps"] <= kernels.REG_CAP_WARPS and prefill["maxnreg"] == caps["cuda"]
    assert kernels.constexprs(kernels.MODE_PREFILL, 8192, 512, cuda, aligned=False)["maxnreg"] == \
        kernels.REG_CAP["cuda"]
    assert "maxnreg" not in kernels.constexprs(kernels.MODE_DECODE_1D, 16384, 512, cuda)      # 8 warps
    assert "maxnreg" not in kernels.constexprs(kernels.MODE_PREFILL, 4 * kernels.TILE_MAX, 512, cuda)   # streamed
    assert "maxnreg" not in kernels.constexprs(kernels.MODE_PREFILL, 8192, 512, hip)


def test_inline_compaction_rule(monkeypatch):
    """COMPACT (kernels/compact.py) only on NVIDIA, on a verified Triton version, for aligned vector rows, and for
    tiles of 1, 2, 4, 8 or 16 rows of 128 per warp (every tile size and its halvings); 128 registers with it."""
    from torch_dsv4_ops import platform
    from torch_dsv4_ops.kernels import compact

    assert compact.compaction_available("3.6.0") and not compact.compaction_available("3.9.0")
    cuda = next(t for t in platform.MATRIX_TARGETS if t.backend == "cuda")
    hip = next(t for t in platform.MATRIX_TARGETS if t.backend == "hip")
    monkeypatch.setattr(kernels, "compaction_available", lambda: True)
    for n_cols in (300, 2048, 8192, 16384, 4 * kernels.TILE_MAX):
        meta = kernels.constexprs(kernels.MODE_PREFILL, n_cols, 16, cuda)
        assert meta["COMPACT"] and kernels.compact_rows(meta["BLOCK"], meta["WARPS"], meta["HALVINGS"]), n_cols
    assert not kernels.constexprs(kernels.MODE_PREFILL, 128, 16, cuda)["COMPACT"]     # its quarter: 32 columns
    prefill = kernels.constexprs(kernels.MODE_PREFILL, 8192, 512, cuda)
    assert prefill["COMPACT"] and prefill["maxnreg"] == kernels.COMPACT_REG_CAP["cuda"] == 128
    assert not kernels.constexprs(kernels.MODE_PREFILL, 8192, 512, cuda, aligned=False)["COMPACT"]
    assert not kernels.constexprs(kernels.MODE_PREFILL, 8192, 512, hip)["COMPACT"]
    assert kernels.compact_rows(8192, 4, 3) and not kernels.compact_rows(8192, 4, 5)   # 256 columns on 4 warps
    assert not kernels.compact_rows(64 * 128, 1, 0)                      # 64 rows per warp
    monkeypatch.setattr(kernels, "compaction_available", lambda: False)
    assert not kernels.constexprs(kernels.MODE_PREFILL, 8192, 512, cuda)["COMPACT"]


def test_plan_by_logits_alignment():
    """A COMPACT plan runs its aligned launch for logits at a 16-byte aligned address and its other launch
    otherwise (Triton compiles the two apart)."""
    calls = []
    plan = ByAlignment(lambda *t: calls.append(("aligned", t)), lambda *t: calls.append(("other", t)), (0,), 16)
    storage = torch.zeros(20)
    plan(storage[:16].view(2, 8), 1, 2, 3)
    plan(storage[1:17].view(2, 8), 1, 2, 3)
    plan(storage[4:20].view(2, 8), 1, 2, 3)
    assert [c[0] for c in calls] == ["aligned", "other", "aligned"] and calls[0][1][1:] == (1, 2, 3)


def test_compaction_asm_operands():
    """The PTX block of every rows-per-warp: one output and 5 inputs per packed value in its constraints; it names
    every output, every value and the first of each other input; a 5-step shuffle scan per 4 rows; a store per
    value."""
    from torch_dsv4_ops.kernels import compact

    for rows in (1, 2, 4, 8, 16):
        asm, constraints = compact.compaction_asm(rows)
        p = 4 * rows
        assert constraints.split(",") == ["=r"] * p + ["l"] * p + ["r"] * 4 * p
        named = {int(k) for k in re.findall(r"\$(\d+)", asm)}
        assert named == set(range(p)) | {p} | set(range(2 * p, 3 * p)) | {3 * p, 4 * p, 5 * p}
        assert asm.count("shfl.sync.up.b32") == 5 * ((rows + 3) // 4)
        assert asm.count("st.global.b16") == p


def test_tile_halvings_rule():
    """A window of at most half or a quarter of the tile runs on a tile of that size, while that tile still holds
    the short vector (2 * next_pow2(topk) keys) and a key per lane."""
    from torch_dsv4_ops import platform

    cuda = next(t for t in platform.MATRIX_TARGETS if t.backend == "cuda")
    assert kernels.constexprs(kernels.MODE_PREFILL, 8192, 512, cuda)["HALVINGS"] == 2
    assert kernels.constexprs(kernels.MODE_DECODE_1D, 16384, 512, cuda)["HALVINGS"] == 2
    assert kernels.constexprs(kernels.MODE_PREFILL, 2048, 512, cuda)["HALVINGS"] == 1
    assert kernels.constexprs(kernels.MODE_PREFILL, 1024, 512, cuda)["HALVINGS"] == 0
    assert kernels.halvings(256, 64, 128) == 1 and kernels.halvings(128, 64, 128) == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_work(device, impl):
    """num_rows = 0: nothing written; N = 0 and seq_lens with no rows: every row [-1 ...]."""
    out = torch.full((3, 5), SENTINEL, dtype=torch.int32, device=device)
    logits = torch.randn(3, 40, device=device)
    z = torch.zeros(3, dtype=torch.int32, device=device)
    with implementation(impl, device):
        top_k_per_row_prefill(logits, z, z + 40, out, 0, 40, 1, 4)
        assert out.cpu().eq(SENTINEL).all()
        top_k_per_row_prefill(logits[:, :0], z, z + 40, out, 3, 0, 1, 4)
        assert out.cpu()[:, :4].eq(-1).all() and out.cpu()[:, 4].eq(SENTINEL).all()
        out.fill_(SENTINEL)
        top_k_per_row_decode(logits, 1, torch.zeros(0, dtype=torch.int32, device=device), out, 3, 40, 1, 5)
        assert out.cpu().eq(-1).all()


# --- bad input --------------------------------------------------------------------------------------------------------
def _prefill_args(device):
    return dict(logits=torch.zeros(4, 64, device=device),
                cu_seqlen_ks=torch.zeros(4, dtype=torch.int32, device=device),
                cu_seqlen_ke=torch.full((4,), 64, dtype=torch.int32, device=device),
                topk_indices=torch.full((4, 8), SENTINEL, dtype=torch.int32, device=device), num_rows=4, stride0=64,
                stride1=1, topk=8)


def _decode_args(device):
    return dict(logits=torch.zeros(4, 64, device=device), next_n=2,
                seq_lens=torch.full((2, 2), 30, dtype=torch.int32, device=device),
                topk_indices=torch.full((4, 8), SENTINEL, dtype=torch.int32, device=device), num_rows=4, stride0=64,
                stride1=1, topk=8)


PREFILL_BAD = [
    (lambda a, dev: a.update(logits=a["logits"].double()), "logits"),
    (lambda a, dev: a.update(logits=a["logits"].to(torch.bfloat16)), "logits"),
    (lambda a, dev: a.update(logits=a["logits"].int()), "logits"),
    (lambda a, dev: a.update(logits=a["logits"].view(-1)), "logits"),
    (lambda a, dev: a.update(stride0=65), "logits"),                       # row 3 ends past the storage
    (lambda a, dev: a.update(stride1=2), "logits"),
    (lambda a, dev: a.update(num_rows=5, cu_seqlen_ks=torch.zeros(5, dtype=torch.int32, device=dev),
                             cu_seqlen_ke=torch.zeros(5, dtype=torch.int32, device=dev),
                             topk_indices=torch.zeros(5, 8, dtype=torch.int32, device=dev)), "logits"),
    (lambda a, dev: a.update(stride0=-64), "stride0"),
    (lambda a, dev: a.update(stride1=-1), "stride1"),
    (lambda a, dev: a.update(num_rows=-1), "num_rows"),
    (lambda a, dev: a.update(cu_seqlen_ks=a["cu_seqlen_ks"].long()), "cu_seqlen_ks"),
    (lambda a, dev: a.update(cu_seqlen_ks=a["cu_seqlen_ks"][:3]), "cu_seqlen_ks"),
    (lambda a, dev: a.update(cu_seqlen_ke=a["cu_seqlen_ke"].view(2, 2)), "cu_seqlen_ke"),
    (lambda a, dev: a.update(cu_seqlen_ke=a["cu_seqlen_ke"].float()), "cu_seqlen_ke"),
    (lambda a, dev: a.update(topk_indices=a["topk_indices"].long()), "topk_indices"),
    (lambda a, dev: a.update(topk_indices=a["topk_indices"][:3]), "topk_indices"),
    (lambda a, dev: a.update(topk_indices=a["topk_indices"][:, :7]), "topk_indices"),
    (lambda a, dev: a.update(topk_indices=a["topk_indices"].view(-1)), "topk_indices"),
    (lambda a, dev: a.update(topk=0), "topk"),
]
DECODE_BAD = [
    (lambda a, dev: a.update(next_n=0), "next_n"),
    (lambda a, dev: a.update(seq_lens=a["seq_lens"].long()), "seq_lens"),
    (lambda a, dev: a.update(seq_lens=a["seq_lens"][:, :1]), "seq_lens"),
    (lambda a, dev: a.update(seq_lens=a["seq_lens"].view(1, 2, 2)), "seq_lens"),
    (lambda a, dev: a.update(topk_indices=a["topk_indices"].int()[:2]), "topk_indices"),
]


@pytest.mark.parametrize("mutate,word", PREFILL_BAD, ids=range(len(PREFILL_BAD)))
@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_bad_input(device, impl, mutate, word):
    args = _prefill_args(device)
    mutate(args, device)
    before = args["topk_indices"].cpu().clone()
    with implementation(impl, device), pytest.raises(ValueError, match=rf"\b{word}\b"):
        top_k_per_row_prefill(**args)
    assert torch.equal(args["topk_indices"].cpu(), before), "topk_indices untouched on error"


@pytest.mark.parametrize("mutate,word", DECODE_BAD, ids=range(len(DECODE_BAD)))
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_bad_input(device, impl, mutate, word):
    args = _decode_args(device)
    mutate(args, device)
    before = args["topk_indices"].cpu().clone()
    with implementation(impl, device), pytest.raises(ValueError, match=rf"\b{word}\b"):
        top_k_per_row_decode(**args)
    assert torch.equal(args["topk_indices"].cpu(), before), "topk_indices untouched on error"


def test_row_span_over_int32_not_implemented():
    """(N - 1) * stride1 past int32 offsets: NotImplementedError naming logits (meta tensors: nothing allocated)."""
    storage = torch.empty(2**33, device="meta")
    logits = storage.as_strided((2, 2**20), (1, 4096))
    out = torch.empty(2, 8, dtype=torch.int32, device="meta")
    z = torch.zeros(2, dtype=torch.int32, device="meta")
    with pytest.raises(NotImplementedError, match="logits"):
        PREFILL(logits, z, z, out, 2, 1, 4096, 8)


@pytest.mark.gpu
def test_bad_input_device_mismatch():
    args = _prefill_args("cuda")
    args["cu_seqlen_ke"] = args["cu_seqlen_ke"].cpu()
    with pytest.raises(ValueError, match="cu_seqlen_ke"):
        top_k_per_row_prefill(**args)
    args = _decode_args("cuda")
    args["topk_indices"] = args["topk_indices"].cpu()
    with pytest.raises(ValueError, match="topk_indices"):
        top_k_per_row_decode(**args)


# --- composition ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck(device, impl):
    """Both ops with contiguous, permuted (topk_indices, 2-D seq_lens) and padded (topk_indices) layouts; logits
    keep the layout the explicit strides describe."""
    logits = planted_logits(6, 200, seed=11).to(device)
    ks = torch.tensor([0, 5, 0, 100, -3, 190], dtype=torch.int32, device=device)
    ke = torch.tensor([200, 190, 9, 150, 50, 400], dtype=torch.int32, device=device)
    out = torch.full((6, 20), SENTINEL, dtype=torch.int32, device=device)
    seq2 = torch.tensor([[200, 150], [20, 0], [60, 61]], dtype=torch.int32, device=device)
    with implementation(impl, device):
        run_opcheck(PREFILL, (logits, ks, ke, out, 6, 200, 1, 16), permute=lambda i, t: i == 3)
        run_opcheck(DECODE, (logits, 2, seq2, out, 6, 200, 1, 16), permute=lambda i, t: i in (2, 3))
        run_opcheck(DECODE, (logits.T.contiguous().T, 3, seq2[:, 0].contiguous(), out, 5, 1, 6, 16),
                    layouts=("contiguous",))


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_no_recompile(device, impl):
    """torch.compile(fullgraph=True, dynamic=True) over 3 row counts of each op: one graph, no new Triton kernel."""
    n_cols, topk = 160, 16

    def prefill(logits, ks, ke, out):
        top_k_per_row_prefill(logits, ks, ke, out, logits.shape[0], logits.stride(0), logits.stride(1), topk)
        return out

    def decode(logits, seq, out):
        top_k_per_row_decode(logits, 2, seq, out, logits.shape[0], logits.stride(0), logits.stride(1), topk)
        return out

    pre, dec = [], []
    for rows in (3, 5, 9):
        g = torch.Generator().manual_seed(rows)
        logits = planted_logits(rows, n_cols, seed=rows).to(device)
        ks = torch.randint(-5, 100, (rows,), generator=g, dtype=torch.int32)
        ke = ks + torch.randint(0, 120, (rows,), generator=g, dtype=torch.int32)
        out = torch.full((rows, topk + 1), SENTINEL, dtype=torch.int32)
        pre.append((logits, ks.to(device), ke.to(device), out.to(device)))
        seq = torch.randint(0, 200, (layout.cdiv(rows, 2),), generator=g, dtype=torch.int32)
        dec.append((logits, seq.to(device), out.to(device)))
    with implementation(impl, device):
        check_compile(prefill, pre, kernels=[kernels.topk_per_row_kernel], new_kernels=1)
        check_compile(decode, dec, kernels=[kernels.topk_per_row_kernel], new_kernels=1)


# --- GPU only ---------------------------------------------------------------------------------------------------------
def _gpu_logits(rows: int, n_cols: int, seed: int) -> torch.Tensor:
    """Indexer-like logits (a relu-weighted sum: many values near 0, a long positive tail) with planted ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.relu(torch.randn(rows, n_cols, 4, generator=g)).sum(-1) * torch.rand(rows, 1, generator=g) * 5
    x[:, ::97] = x[:, 5:6]                                                # ties at many ranks
    x[:, 3::301] = NAN
    return x


@pytest.mark.gpu
def test_benchmark_sized_exact():
    """Decode 128 x 16384 (top-k 512, 2-D seq_lens), prefill 1024 x 8192 (causal-like and full ranges) and 3 rows
    of 70000 (the streaming path) against the reference, under sync-debug "error"; the reference is checked
    against the oracle on 3 rows of each."""
    cases = []
    g = torch.Generator().manual_seed(3)
    logits = _gpu_logits(128, 16384, 1)
    seq = torch.randint(0, 16385, (64, 2), generator=g, dtype=torch.int32)
    seq[0] = 16384
    cases.append(("decode", logits, seq, 512))
    logits = _gpu_logits(1024, 8192, 2)
    ke = torch.arange(1024, dtype=torch.int32) * 8
    ks = torch.where(torch.arange(1024) % 2 == 0, torch.zeros(1024, dtype=torch.int32), ke // 3)
    cases.append(("prefill", logits, (ks, ke), 512))
    logits = _gpu_logits(3, 70000, 3)
    cases.append(("prefill", logits, (torch.tensor([0, 13, 5], dtype=torch.int32),
                                      torch.tensor([70000, 69000, 2000], dtype=torch.int32)), 1024))
    for kind, logits, meta, topk in cases:
        rows, n_cols = logits.shape
        out = torch.full((rows, topk + 4), SENTINEL, dtype=torch.int32)
        expected = out.clone()
        if kind == "decode":
            reference.top_k_per_row_decode(logits, 2, meta, expected, rows, n_cols, 1, topk)
            dev = (logits.cuda(), meta.cuda(), out.cuda())
            with sync_debug_error():
                top_k_per_row_decode(dev[0], 2, dev[1], dev[2], rows, n_cols, 1, topk)
            ranges = [decode_range(meta.tolist(), 2, r, n_cols) for r in range(3)]
        else:
            reference.top_k_per_row_prefill(logits, meta[0], meta[1], expected, rows, n_cols, 1, topk)
            dev = (logits.cuda(), meta[0].cuda(), meta[1].cuda(), out.cuda())
            with sync_debug_error():
                top_k_per_row_prefill(*dev, rows, n_cols, 1, topk)
            ranges = [prefill_range(a, b, n_cols) for a, b in zip(meta[0].tolist()[-3:], meta[1].tolist()[-3:])]
        assert_bitwise_equal(dev[-1].cpu(), expected, f"{kind} {rows} x {n_cols}")
        first = rows - 3 if kind == "prefill" else 0
        for i, (lo, hi) in enumerate(ranges):
            assert expected[first + i, :topk].tolist() == oracle_row(logits[first + i].double().tolist(), lo, hi,
                                                                     topk)


COMPACT_SHAPES = [(384, 16), (512, 40), (1024, 40), (2048, 100), (4096, 512), (8192, 512), (16384, 512),
                  (8192, 2048), (70000, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("n_cols,topk", COMPACT_SHAPES, ids=[f"{n}-k{k}" for n, k in COMPACT_SHAPES])
def test_inline_compaction_shapes(n_cols, topk):
    """Every rows-per-warp (1 to 16) and warp count (1 to 8, and the streamed tiles' 32) of the inline-PTX
    compaction: the search rows and planted rows over whole windows, windows of the tile's half and quarter and
    windows starting past column 0, against the reference; then the same logits at an address 4 bytes past a
    16-byte boundary (the plan's other launch, without COMPACT) give the same indices."""
    from torch_dsv4_ops import platform

    rows = torch.cat([search_rows(n_cols, topk, seed=n_cols) if n_cols <= 16384 else planted_logits(9, n_cols, 3),
                      planted_logits(7, n_cols, seed=n_cols + 1)])
    quarter = min(n_cols, kernels.TILE_MAX) // 4
    spans = [(0, n_cols), (0, n_cols - 1), (5, n_cols), (0, 2 * quarter), (1, 2 * quarter + 1), (0, quarter),
             (16, quarter + 16), (n_cols - topk - 1, n_cols)]
    spans = [spans[r % len(spans)] for r in range(rows.shape[0])]
    ks = torch.tensor([a for a, _ in spans], dtype=torch.int32)
    ke = torch.tensor([b for _, b in spans], dtype=torch.int32)
    expected = torch.full((rows.shape[0], topk + 1), SENTINEL, dtype=torch.int32)
    reference.top_k_per_row_prefill(rows, ks, ke, expected, rows.shape[0], n_cols, 1, topk)
    meta = kernels.constexprs(kernels.MODE_PREFILL, n_cols, topk, platform.target_for(torch.device("cuda")))
    assert meta["COMPACT"] == kernels.compaction_available()
    storage = torch.empty(rows.numel() + 4, device="cuda")
    for offset in (0, 1):                          # 16-byte aligned rows, then 4 bytes past
        logits = storage[offset:offset + rows.numel()].view(rows.shape)
        logits.copy_(rows)
        out = torch.full_like(expected, SENTINEL, device="cuda")
        top_k_per_row_prefill(logits, ks.cuda(), ke.cuda(), out, rows.shape[0], n_cols, 1, topk)
        assert_bitwise_equal(out.cpu(), expected, f"{n_cols} columns, top-k {topk}, offset {offset}")


@pytest.mark.gpu
def test_cuda_graph_new_seq_lens():
    """Capture decode (2-D seq_lens) and prefill; replay with new logits, lengths and ranges in the same buffers
    equals eager, under sync-debug "error"."""
    rows, n_cols, topk = 64, 4096, 512

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        logits = _gpu_logits(rows, n_cols, seed)
        seq = torch.randint(0, n_cols + 50, (rows // 2, 2), generator=g, dtype=torch.int32)
        ks = torch.randint(-10, 2000, (rows,), generator=g, dtype=torch.int32)
        ke = ks + torch.randint(0, 3000, (rows,), generator=g, dtype=torch.int32)
        out = torch.full((rows, topk), SENTINEL, dtype=torch.int32)
        return [t.cuda() for t in (logits, seq, ks, ke, out, out.clone())]

    def step(logits, seq, ks, ke, out_d, out_p):
        top_k_per_row_decode(logits, 2, seq, out_d, rows, n_cols, 1, topk)
        top_k_per_row_prefill(logits, ks, ke, out_p, rows, n_cols, 1, topk)

    check_cuda_graph(step, inputs(0), [inputs(1), inputs(2)])


@pytest.mark.gpu
def test_stream_order_with_pdl():
    """Launched with programmatic dependent launch (sm_90+), the op sees the logits a torch kernel wrote just
    before it, and a torch kernel after it sees its indices, inside a captured graph."""
    rows, n_cols, topk = 32, 2048, 64
    logits = _gpu_logits(rows, n_cols, 4).cuda()
    seq = torch.full((rows,), n_cols, dtype=torch.int32, device="cuda")
    out = torch.zeros(rows, topk, dtype=torch.int32, device="cuda")
    snapshot = torch.empty_like(out)

    def step():
        logits.neg_()
        top_k_per_row_decode(logits, 1, seq, out, rows, n_cols, 1, topk)
        snapshot.copy_(out)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        expected = torch.empty(rows, topk, dtype=torch.int32)
        reference.top_k_per_row_decode(-logits.cpu(), 1, seq.cpu(), expected, rows, n_cols, 1, topk)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(out.cpu(), expected, "indices of the logits written just before")
        assert_bitwise_equal(snapshot.cpu(), expected, "snapshot after the op")
