"""Sparse index ops (SPEC §3.3, §0 lookup, §4 b, e, h, i, §5).

Every worked example of SPEC §3.3 is a literal test; the reference is checked against an
independent plain-Python oracle (below) on random batches, and the Triton kernel (interpreted on
CPU) bit-exactly against the reference on the same batches.
"""
import contextlib

import pytest
import torch

import torch_dsv4_ops as d
from torch_dsv4_ops import layout
from torch_dsv4_ops.kernels import sparse_index as kernels
from torch_dsv4_ops.testing import (as_list, assert_bitwise_equal, check_compile, check_cuda_graph, check_sync_free,
                                    i32, implementation, oracle_lookup, patched_constants, run_opcheck,
                                    triton_cache_entries)

OPS = torch.ops.dsv4
I32MAX = 2**31 - 1
IMPLS = ["kernel", "reference"]


impl_ctx, L = implementation, as_list


# --- the independent oracle (plain Python over lists, written from SPEC's pseudo-code) -----------
def o_lookup(bt, r, p, bs):
    return oracle_lookup(bt, r, p, bs, int32=False)


def o32(v):
    return v if 0 <= v <= I32MAX else -1


def o_global(topk, t2r, bt, bs, valid):
    g = [[o32(o_lookup(bt, t2r[t], v, bs)) if v >= 0 else -1 for v in row] for t, row in enumerate(topk)]
    lens = [sum(x >= 0 for x in row) if valid[t] else 0 for t, row in enumerate(g)]
    return g, lens


def o_combine(topk_idx, qsl, seq, gl, window, ratio, topk, M, N, width, out_rows=None, out_lens=None):
    Tq = len(topk_idx)
    rows = [[-1] * width for _ in range(Tq)] if out_rows is None else [list(r) for r in out_rows]
    lens = [0] * Tq if out_lens is None else list(out_lens)
    base = qsl[0]
    for b in range(len(qsl) - 1):
        qs, qe = qsl[b] - base, qsl[b + 1] - base
        start_pos, gstart = seq[b] - (qe - qs), seq[b] - gl[b]
        for t in range(max(qs, 0), min(qe, Tq)):
            pos = start_pos + (t - qs)
            row = [-1] * width
            if pos < 0:
                rows[t], lens[t] = row, 0
                continue
            tk, sw = min((pos + 1) // ratio, topk), min(pos + 1, window)
            for j in range(tk):
                v = topk_idx[t][j]
                row[j] = o32(M * b + v) if 0 <= v < N else -1
            for i in range(sw):
                w = (pos - sw + 1 + i) - gstart
                row[tk + i] = o32(M * b + N + w) if w >= 0 and N + w < M else -1
            rows[t], lens[t] = row, tk + sw
    return rows, lens


def o_remap(v, bs, span):
    return (v // bs) * span + v % bs if v >= 0 else -1


def o_flashinfer(dswa, dcomp, dlens, ptopk, qsl, seq, t2r, sbt, sbs, cbt, cbs, window, ratio, topk, local, dvalid,
                 sspan, cspan):
    cbt = sbt if cbt is None else cbt
    sspan, cspan = sspan or sbs, cspan or cbs
    Td, Kd = len(dswa), (len(dcomp[0]) if dcomp else 0) if dcomp is not None else 0
    Wswa = len(dswa[0]) if dswa else WSWA_HINT[0]
    P = -(-max(topk, Kd) // 4) * 4
    rows, lens = [], []
    for t in range(Td):
        row = [o32(o_remap(v, sbs, sspan)) for v in dswa[t]]
        comp = [-1] * P
        for j in range(Kd):
            v = dcomp[t][j]
            comp[j] = o32(o_remap(o_lookup(cbt, t2r[t], v, cbs), cbs, cspan)) if local else o32(o_remap(v, cbs, cspan))
        if Kd == 0:
            n = 0
        elif local:
            n = sum(x >= 0 for x in comp[:Kd]) if (dvalid is None or dvalid[t]) else 0
        else:
            n = dlens[t] if dlens is not None else Kd
        rows.append(row + comp)
        lens.append(Wswa + n)
    R = min(len(qsl) - 1, len(seq))
    for tp, loc_row in enumerate(ptopk):
        t = Td + tp
        r = t2r[t]
        pos = seq[r] - (qsl[r + 1] - qsl[r]) + (t - qsl[r]) if 0 <= r < R else -1
        sw = max(0, min(pos + 1, window))
        s0 = pos - sw + 1
        tk = min(max(pos + 1, 0) // ratio, topk)
        row = [o32(o_remap(o_lookup(sbt, r, s0 + c, sbs), sbs, sspan)) if c < sw else -1 for c in range(Wswa)]
        comp = [-1] * P
        for j in range(min(tk, len(loc_row))):
            if loc_row[j] >= 0:
                comp[j] = o32(o_remap(o_lookup(cbt, r, loc_row[j], cbs), cbs, cspan))
        rows.append(row + comp)
        lens.append(Wswa + tk)
    return rows, lens


WSWA_HINT = [0]


def o_c128a(positions, ratio, Td, t2r, bt, bs, slots, gdec, dlens, pref, mct):
    gdec, dlens, pref = [list(r) for r in gdec], list(dlens), [list(r) for r in pref]
    for t, pos in enumerate(positions):
        if t < Td:
            W = min(mct, len(gdec[t]))
            n = min(max((pos + 1) // ratio, 0), W)
            for j in range(W):
                gdec[t][j] = o32(o_lookup(bt, t2r[t], j, bs)) if j < n else -1
            dlens[t] = n if slots[t] >= 0 else 0
        else:
            W = min(mct, len(pref[t - Td]))
            n = min(max((pos + 1) // ratio, 0), W)
            for j in range(W):
                pref[t - Td][j] = j if j < n else -1
    return gdec, dlens, pref


def o_fill(topk_idx, positions, topk, ratio):
    out = [list(r) for r in topk_idx]
    for t, pos in enumerate(positions):
        n = max((pos + 1) // ratio, 0)
        for j in range(topk):
            out[t][j] = j if j < n else -1
    return out


# === literal worked examples (SPEC §3.3) ==========================================================
@pytest.mark.parametrize("impl", IMPLS)
def test_example_compute_global(device, impl):
    with impl_ctx(impl, device):
        args = (i32([[0, 3, -1], [1, 2, -1]], device), i32([0, 1], device), i32([[5, 7], [11, 13]], device), 2,
                torch.tensor([True, False], device=device))
        g, lens = d.compute_global_topk_indices_and_lens(*args)
        assert L(g) == [[10, 15, -1], [23, 26, -1]] and L(lens) == [2, 0]
        bufs = (torch.full((2, 3), 99, dtype=torch.int32, device=device), torch.full((2,), 99, dtype=torch.int32,
                                                                                     device=device))
        g2, lens2 = d.compute_global_topk_indices_and_lens(*args, output_buffers=bufs)
        assert g2 is bufs[0] and lens2 is bufs[1]
        assert L(bufs[0]) == [[10, 15, -1], [23, 26, -1]] and L(bufs[1]) == [2, 0]


def _combine_example(device):
    topk = i32([[1, 0]] * 3 + [[0, -1]] * 5, device)
    return (topk, i32([100, 103, 108], device), i32([10, 5], device), i32([6, 5], device), 4, 4, 2, 8, 2)


COMBINE_EXPECTED = {0: [1, 0, 2, 3, 4, 5], 1: [1, 0, 3, 4, 5, 6], 2: [1, 0, 4, 5, 6, 7], 3: [10],
                    6: [8, 10, 11, 12, 13], 7: [8, 11, 12, 13, 14]}


@pytest.mark.parametrize("impl", IMPLS)
def test_example_combine(device, impl):
    with impl_ctx(impl, device):
        combined, lens = d.combine_topk_swa_indices(*_combine_example(device))
    assert combined.shape == (8, 128) and lens.shape == (8,)
    for t, row in COMBINE_EXPECTED.items():
        assert L(lens[t]) == len(row)
        assert L(combined[t, :len(row)]) == row
        assert L(combined[t, len(row):]) == [-1] * (128 - len(row))        # §4 e
    # the rows the table leaves out: t = 4 (pos 1) and t = 5 (pos 2) of request 1
    assert L(combined[4, :3]) == [10, 11, -1] and L(lens[4]) == 2
    assert L(combined[5, :4]) == [10, 11, 12, -1] and L(lens[5]) == 3


@pytest.mark.parametrize("impl", IMPLS)
def test_example_combine_out_tails_and_uncovered(device, impl):
    """out buffers with C' = 9 >= topk + window = 6 and 2 spare rows: tails -1 over the whole row,
    rows past Tq untouched."""
    with impl_ctx(impl, device):
        out = (torch.full((10, 9), 77, dtype=torch.int32, device=device),
               torch.full((10,), 77, dtype=torch.int32, device=device))
        c, lens = d.combine_topk_swa_indices(*_combine_example(device), out=out)
    assert c.shape == (8, 9) and c.data_ptr() == out[0].data_ptr()
    assert L(out[0][0]) == [1, 0, 2, 3, 4, 5, -1, -1, -1]
    assert L(out[0][3]) == [10, -1, -1, -1, -1, -1, -1, -1, -1]
    assert L(out[0][8:]) == [[77] * 9] * 2 and L(out[1][8:]) == [77, 77]
    assert L(lens) == [6, 6, 6, 1, 2, 3, 5, 5]


@pytest.mark.parametrize("impl", IMPLS)
def test_example_combine_uncovered_rows(device, impl):
    """Rows no request covers: fresh outputs hold -1 / 0, out rows stay untouched."""
    topk = i32([[0]] * 4, device)
    args = (topk, i32([50, 52], device), i32([2], device), i32([2], device), 4, 1, 1, 10, 3)
    with impl_ctx(impl, device):
        c, lens = d.combine_topk_swa_indices(*args)
        out = (torch.full((4, 5), 77, dtype=torch.int32, device=device),
               torch.full((4,), 77, dtype=torch.int32, device=device))
        d.combine_topk_swa_indices(*args, out=out)
    # pos 0: tk = 1 -> [0], sw 1 -> w = 0 - 0 -> 3; pos 1: tk 1 ([0]), sw 2 -> [3, 4]
    assert L(c[0, :3]) == [0, 3, -1] and L(c[1, :4]) == [0, 3, 4, -1]
    assert L(lens) == [2, 3, 0, 0] and L(c[2:]) == [[-1] * 128] * 2
    assert L(out[0][2:]) == [[77] * 5] * 2 and L(out[1]) == [2, 3, 77, 77]
    assert L(out[0][1]) == [0, 3, 4, -1, -1]


@pytest.mark.parametrize("impl", IMPLS)
def test_example_flashinfer_prefill_swa_only(device, impl):
    with impl_ctx(impl, device):
        sparse, lens = d.build_flashinfer_mixed_sparse_indices(
            torch.empty(0, 8, dtype=torch.int32, device=device), None, None,
            torch.empty(1, 0, dtype=torch.int32, device=device), i32([0, 1], device), i32([4], device),
            i32([0], device), i32([[0]], device), 64, None, 64, 4, 1, 0)
    assert L(sparse) == [[0, 1, 2, 3, -1, -1, -1, -1]] and L(lens) == [8]


@pytest.mark.parametrize("impl", IMPLS)
def test_example_flashinfer_local_decode(device, impl):
    with impl_ctx(impl, device):
        sparse, lens = d.build_flashinfer_mixed_sparse_indices(
            i32([[36, 37, 38, 39]], device), i32([[0, 1, -1]], device), None,
            torch.empty(0, 3, dtype=torch.int32, device=device), i32([0, 1], device), i32([40], device),
            i32([0], device), i32([[0]], device), 64, i32([[5]], device), 64, 4, 4, 3,
            decode_compressed_indices_are_local=True, decode_is_valid_token=torch.tensor([True], device=device))
    assert L(sparse) == [[36, 37, 38, 39, 320, 321, -1, -1]] and L(lens) == [6]


@pytest.mark.parametrize("impl", IMPLS)
def test_example_flashinfer_remap(device, impl):
    """bs 64, span 128: remap(70) = 134 (a global decode SWA slot)."""
    with impl_ctx(impl, device):
        sparse, lens = d.build_flashinfer_mixed_sparse_indices(
            i32([[70, -1, 5, -7]], device), None, None, torch.empty(0, 0, dtype=torch.int32, device=device),
            i32([0, 1], device), i32([9], device), i32([0], device), i32([[0]], device), 64, None, 64, 4, 4, 0,
            swa_block_span=128)
    assert L(sparse) == [[134, -1, 5, -1]] and L(lens) == [4]


@pytest.mark.parametrize("impl", IMPLS)
def test_example_c128a(device, impl):
    """ratio 128, bs 2, Kc 128, bt = [[7, 9]]: decodes at pos 300 and 511, prefill at pos 255."""
    with impl_ctx(impl, device):
        g = torch.full((2, 128), 55, dtype=torch.int32, device=device)
        dl = torch.full((2,), 55, dtype=torch.int32, device=device)
        pf = torch.full((1, 128), 55, dtype=torch.int32, device=device)
        gd, lens, pr = d.build_c128a_topk_metadata(
            torch.tensor([300, 511, 255], device=device), 128, 2, i32([0, 0], device), i32([[7, 9]], device), 2,
            torch.tensor([4, 5, 6], device=device), g, dl, pf)
    assert L(gd[0]) == [14, 15] + [-1] * 126 and L(gd[1]) == [14, 15, 18, 19] + [-1] * 124
    assert L(lens) == [2, 4] and L(pr) == [[0, 1] + [-1] * 126]
    assert gd.data_ptr() == g.data_ptr() and pr.data_ptr() == pf.data_ptr()


@pytest.mark.parametrize("impl", IMPLS)
def test_example_fill_short(device, impl):
    with impl_ctx(impl, device):
        t = torch.full((2, 10), 9, dtype=torch.int32, device=device)
        d.fill_short_context_topk_indices(t[:, 1:], torch.tensor([9], device=device), 8, 4)
    assert L(t[0]) == [9, 0, 1, -1, -1, -1, -1, -1, -1, 9] and L(t[1]) == [9] * 10


# === random batches: reference vs oracle, kernel vs reference ====================================
BATCHES = ["decode", "prefill", "mixed", "padding", "qlen0", "empty"]


def make_batch(kind, seed, window=8, ratio=4, int64_table=False):
    """A batch of requests: query lengths, context lengths (incl. the query), decodes first."""
    g = torch.Generator().manual_seed(seed)
    if kind == "decode":
        qlens = [1] * 5
    elif kind == "prefill":
        qlens = [7, 3, 11]
    elif kind == "empty":
        qlens = []
    elif kind == "qlen0":
        qlens = [1, 0, 6, 0, 5]
    else:
        qlens = [1, 1, 9, 4]
    prefix = [int(x) for x in torch.randint(0, 40, (len(qlens),), generator=g)]
    seq = [q + p for q, p in zip(qlens, prefix)]
    qsl = [sum(qlens[:i]) for i in range(len(qlens) + 1)]
    t2r = [r for r, q in enumerate(qlens) for _ in range(q)]
    T = len(t2r)
    bs = 4
    width = 12
    bt = torch.randint(0, 400, (max(len(qlens), 1), width), generator=g)
    bt[torch.rand(bt.shape, generator=g) < 0.15] = -1
    bt = bt.to(torch.int64 if int64_table else torch.int32)
    valid = [bool(x) for x in (torch.rand(T, generator=g) > 0.2)]
    slots = [int(x) for x in torch.randint(0, 100, (T,), generator=g)]
    if kind == "padding" and T:
        t2r[-1] = len(qlens) + 3        # a padded token: out-of-range request
        valid[-1] = False
        slots[-1] = -1
    return dict(g=g, qlens=qlens, seq=seq, qsl=qsl, t2r=t2r, T=T, bs=bs, bt=bt, valid=valid, slots=slots,
                window=window, ratio=ratio)


def run_both(device, fn):
    """fn() under the kernel (device) and the reference (CPU); returns (kernel, reference) results."""
    if device.type == "cpu":
        with d.cpu_implementation("triton"):
            k = fn(device)
    else:
        k = fn(device)
    with d.cpu_implementation("reference"):
        r = fn(torch.device("cpu"))
    return k, r


def assert_same(k, r, what):
    for a, b in zip(k, r):
        assert_bitwise_equal(a.cpu(), b, what)


@pytest.mark.parametrize("kind", BATCHES)
@pytest.mark.parametrize("int64_table", [False, True])
@pytest.mark.parametrize("bs", [4, 3])      # int32 slot math (power of two), the int64 formula (3)
def test_random_global(device, kind, int64_table, bs):
    b = make_batch(kind, 1, int64_table=int64_table)
    b["bs"] = bs
    global_matches_oracle(device, b, 6)


def global_matches_oracle(device, b, K):
    """compute_global_topk_indices_and_lens over random top-k rows of K entries of batch b: the kernel equal to the
    reference and both to the oracle."""
    T = b["T"]
    topk = torch.randint(-2, 12 * 4 + 6, (T, K), generator=b["g"], dtype=torch.int32)
    t2r, valid = torch.tensor(b["t2r"] + [0, 0], dtype=torch.int32), torch.tensor(b["valid"] + [True, True])

    def fn(dev):
        return d.compute_global_topk_indices_and_lens(topk.to(dev), t2r.to(dev), b["bt"].to(dev), b["bs"],
                                                      valid.to(dev))

    k, r = run_both(device, fn)
    assert_same(k, r, "global")
    g, lens = o_global(topk.tolist(), b["t2r"], b["bt"].tolist(), b["bs"], b["valid"])
    assert L(r[0]) == g and L(r[1]) == lens


def combine_case(b, topk=3, chunk=None):
    """Workspace geometry of SPEC's combine example: N compressed rows, then the gathered tail."""
    window, ratio = b["window"], b["ratio"]
    gl = [q + min(s - q, window - 1) for q, s in zip(b["qlens"], b["seq"])]
    N = max([s // ratio for s in b["seq"]], default=0)
    M = N + max(gl, default=0)
    Tq = b["T"]
    topk_idx = torch.randint(-1, N + 2, (Tq, topk + 1), generator=b["g"], dtype=torch.int32)
    qsl = torch.tensor([q + 1000 for q in b["qsl"]], dtype=torch.int32)
    return topk_idx, qsl, torch.tensor(b["seq"], dtype=torch.int32), torch.tensor(gl, dtype=torch.int32), \
        window, ratio, topk, M, N


def combine_matches_oracle(device, args, what):
    """combine_topk_swa_indices(*args) into fresh outputs under the kernel and the reference: equal to each
    other and to the oracle. Returns the reference's (combined, lens)."""
    def fn(dev):
        return d.combine_topk_swa_indices(*[x.to(dev) if isinstance(x, torch.Tensor) else x for x in args])

    k, r = run_both(device, fn)
    assert_same(k, r, what)
    a = [x.tolist() if isinstance(x, torch.Tensor) else x for x in args]
    rows, lens = o_combine(*a, width=layout.combine_width(args[6], args[4]))
    assert L(r[0]) == rows and L(r[1]) == lens
    return r


@pytest.fixture(params=["programs per row", "rows per program"])
def row_programs(request):
    """Kernels that loop over rows: one row per program, or every program looping (one per SM)."""
    from torch_dsv4_ops.ops import sparse_index as ops

    looping = {"ROW_PROGRAMS_PER_SM": 1} if request.param == "rows per program" else {}
    with patched_constants(kernels, [ops._PLANS], **looping):
        yield request.param


@pytest.mark.parametrize("kind", BATCHES)
@pytest.mark.parametrize("topk, out_width", [(3, 13), (150, 300)])
def test_random_combine(device, kind, topk, out_width, row_programs):
    b = make_batch(kind, 2)
    args = combine_case(b, topk=topk)
    Tq, C = args[0].shape[0], layout.combine_width(args[6], args[4])

    def fn(dev):
        a = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in args]
        fresh = d.combine_topk_swa_indices(*a)
        out = (torch.full((Tq + 2, out_width), 5, dtype=torch.int32, device=dev),
               torch.full((Tq + 2,), 5, dtype=torch.int32, device=dev))
        d.combine_topk_swa_indices(*a, out=out)
        return fresh + out

    k, r = run_both(device, fn)
    assert_same(k, r, "combine")
    a = [x.tolist() if isinstance(x, torch.Tensor) else x for x in args]
    rows, lens = o_combine(*a, width=C)
    assert L(r[0]) == rows and L(r[1]) == lens
    rows, lens = o_combine(*a, width=out_width, out_rows=[[5] * out_width] * Tq, out_lens=[5] * Tq)
    assert L(r[2][:Tq]) == rows and L(r[3][:Tq]) == lens and L(r[2][Tq:]) == [[5] * out_width] * 2


@pytest.mark.parametrize("out_width", [None, 500])
def test_combine_long_rows(device, out_width, row_programs):
    """Rows with a long top-k part (tk = 259 and 300 of a 300-column top-k, width 384 or 500): a tile
    that is not a power of two wide, then SWA and -1 columns past it."""
    g = torch.Generator().manual_seed(9)
    N = 420
    topk_idx = torch.randint(-1, N + 3, (6, 300), generator=g, dtype=torch.int32)
    args = (topk_idx, i32([7, 9, 13]), i32([260, 400]), i32([9, 11]), 8, 1, 300, N + 20, N)

    def fn(dev):
        a = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in args]
        if out_width is None:
            return d.combine_topk_swa_indices(*a)
        out = (torch.full((7, out_width), 5, dtype=torch.int32, device=dev),
               torch.full((7,), 5, dtype=torch.int32, device=dev))
        d.combine_topk_swa_indices(*a, out=out)
        return out

    k, r = run_both(device, fn)
    assert_same(k, r, "combine, long rows")
    a = [x.tolist() if isinstance(x, torch.Tensor) else x for x in args]
    width = out_width or layout.combine_width(300, 8)
    rows, lens = o_combine(*a, width=width, out_rows=[[5] * width] * 6, out_lens=[5] * 6)
    assert L(r[0][:6]) == rows and L(r[1][:6]) == lens and max(lens) == 308


def test_combine_overlapping_requests(device):
    """A query_start_loc that is not non-decreasing: rows 3 and 4 lie in requests 0 and 2, and the
    reference's later request wins (the kernel's one-round search takes the last covering request)."""
    g = torch.Generator().manual_seed(5)
    qsl = i32([10, 15, 13, 18])
    seq, gl = i32([30, 9, 40]), i32([8, 4, 9])
    topk_idx = torch.randint(-1, 12, (8, 4), generator=g, dtype=torch.int32)
    args = (topk_idx, qsl, seq, gl, 8, 4, 4, 60, 12)
    r = combine_matches_oracle(device, args, "combine, overlapping requests")
    assert L(r[0])[3][0] == (2 * 60 + L(topk_idx)[3][0] if 0 <= L(topk_idx)[3][0] < 12 else -1)   # request 2


def test_combine_decode_rows_later_request_covers(device):
    """Decode rows t of request t (the kernel's search-free path, kernels._request_decode) where
    query_start_loc decreases later on: request 3 also covers rows 0..3 and wins; with a non-decreasing
    query_start_loc request t wins; an empty last request leaves its row uncovered; row 1 of request 0 lies
    before the (empty) request 1."""
    g = torch.Generator().manual_seed(6)
    seq, gl = i32([9, 12, 7, 20, 5]), i32([3, 8, 2, 9, 4])
    topk_idx = torch.randint(-1, 10, (5, 4), generator=g, dtype=torch.int32)
    r = combine_matches_oracle(device, (topk_idx, i32([0, 1, 2, 3, 4, 5]), seq, gl, 8, 4, 4, 60, 10),
                               "combine, decode rows")
    assert L(r[1]) == [min(s // 4, 4) + min(s, 8) for s in L(seq)]
    qsl = i32([0, 1, 2, 0, 4, 5])                  # request 2 is empty, request 3 covers rows 0..3
    r = combine_matches_oracle(device, (topk_idx, qsl, seq, gl, 8, 4, 4, 60, 10), "combine, decode rows, overlap")
    pos3 = 20 - 4 + 0                               # row 0 as request 3's first token
    assert L(r[1])[0] == min((pos3 + 1) // 4, 4) + min(pos3 + 1, 8)
    r = combine_matches_oracle(device, (topk_idx, i32([0, 1, 2, 3, 4, 4]), seq, gl, 8, 4, 4, 60, 10),
                               "combine, decode rows, last request empty")
    assert L(r[1])[4] == 0 and set(L(r[0])[4]) == {-1}      # row 4: no request covers it
    r = combine_matches_oracle(device, (topk_idx, i32([0, 2, 2, 3, 4, 5]), seq, gl, 8, 4, 4, 60, 10),
                               "combine, decode rows, request 1 empty")
    assert L(r[1])[1] == min(9 // 4, 4) + min(9, 8)           # row 1 is request 0's second token (pos 8)


@pytest.mark.parametrize("M, N", [(2**26, 100), (2**29 + 90, 100), (2**31 + 10, 10), (2**31 + 50, 2**31 + 20),
                                  (50, 60), (300, 0), (-40, 5), (40, -5), (2**31 - 2, 2**29 - 5)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_combine_decode_rows_extreme_values(device, M, N, dtype):
    """Decode rows t of request t (the kernel's search-free path) at extreme values: M*t + N crossing 2**29 and
    INT32_MAX between rows, M - N and N past INT32_MAX, M < N, negative M or N. Rows without a position, short
    ones (top-k and SWA in one tile, tk one short of the tile), long ones (whole top-k tiles), gather_lens past
    seq_lens, negative and near the int32 limits; int64 lengths past them."""
    g = torch.Generator().manual_seed(13)
    small, big = 2**29, 2**32 if dtype == torch.int64 else 0
    seq = [12, 1, 7, 62, 4000, -3, 90, 2**29 - 1, 2**29, 0, 65, 70, 2**31 - 1, 80, big + 12, 30, -big + 12, 50]
    gl = [10, 1, 9, 20, 300, 5, -4, 16, 3, 0, small - 1, -2**31 + 3, 40, 2**31 - 3, 7, big + 3, 9, -big + 3]
    R, topk = len(seq), 16
    topk_idx = torch.randint(-1, min(max(N, 1), 2**20) + 2, (R, topk), generator=g, dtype=torch.int32)
    qsl = torch.arange(R + 1, dtype=dtype) + 500
    args = (topk_idx, qsl, torch.tensor(seq, dtype=dtype), torch.tensor(gl, dtype=dtype), 8, 4, topk, M, N)
    r = combine_matches_oracle(device, args, "combine, decode rows at extreme values")
    assert L(r[1])[3] == 15 + 8 and L(r[1])[4] == topk + 8 and L(r[1])[9] == 0


@pytest.fixture(params=[None, 4], ids=["search-256", "search-4"])
def search(request):
    """The request search as committed, or 4 entries a step (SEARCH = MIN_SEARCH = 4)."""
    from torch_dsv4_ops.ops import sparse_index as ops

    small = {"SEARCH": request.param, "MIN_SEARCH": request.param} if request.param else {}
    with patched_constants(kernels, [ops._PLANS], **small):
        yield request.param


def test_combine_many_requests_two_level_search(device, search):
    """Rc >= kernels.SEARCH takes the kernel's two-level search of query_start_loc (pivots, then one
    segment): rows of a batch of mostly empty requests land on the right request. SEARCH 4: segments of 11
    entries, so the search inside a segment takes several steps (with SEARCH 256, only past 65536 requests)."""
    g = torch.Generator().manual_seed(11)
    Rc = kernels.SEARCH + 37
    qlens = torch.zeros(Rc, dtype=torch.int64)
    qlens[torch.randperm(Rc, generator=g)[:24]] = torch.randint(1, 4, (24,), generator=g)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), qlens.cumsum(0)]).int() + 7
    seq = (qlens + torch.randint(0, 40, (Rc,), generator=g)).int()
    gl = torch.minimum(seq, qlens.int() + 3)
    Tq, N = int(qlens.sum()), 12
    topk_idx = torch.randint(-1, N + 2, (Tq, 4), generator=g, dtype=torch.int32)
    args = (topk_idx, qsl, seq, gl, 8, 4, 4, N + 50, N)
    combine_matches_oracle(device, args, "combine, two-level search")


def flashinfer_case(b, local=True, topk=5, span=None, with_lens=False, wswa=10):
    g = b["g"]
    Td = sum(1 for q in b["qlens"] if q == 1) if b["qlens"] else 0
    Td = min(Td, b["T"])
    Tp = b["T"] - Td
    dswa = torch.randint(-3, 3000, (Td, wswa), generator=g, dtype=torch.int32)
    dcomp = torch.randint(-2, 40, (Td, 6), generator=g, dtype=torch.int32)
    dlens = torch.randint(0, 7, (Td,), generator=g, dtype=torch.int32) if with_lens else None
    ptopk = torch.randint(-2, 50, (Tp, 4), generator=g, dtype=torch.int32)
    cbt = torch.randint(-1, 300, b["bt"].shape, generator=g).to(b["bt"].dtype)
    dvalid = torch.tensor(b["valid"][:Td], dtype=torch.bool)
    if Td:
        dvalid[0] = False                       # a padded decode token: its length counts no compressed entry
    return (dswa, dcomp, dlens, ptopk, torch.tensor(b["qsl"], dtype=torch.int32), torch.tensor(b["seq"],
            dtype=torch.int32), torch.tensor(b["t2r"], dtype=torch.int32), b["bt"], b["bs"], cbt, 2, b["window"],
            b["ratio"], topk, local, dvalid if local else None, span, span and 2 * span)


@pytest.mark.parametrize("kind", ["decode", "mixed", "padding", "qlen0", "prefill", "empty"])
@pytest.mark.parametrize("variant", ["local", "global", "global_lens_span", "shared_table", "odd_sizes",
                                     "narrow_span"])
def test_random_flashinfer(device, kind, variant):
    """Block sizes and spans: powers of two with span >= block size take int32 slot math; odd_sizes (SWA
    block 3, spans 5 and 10) and narrow_span (SWA span 2 < block 4) the int64 formula."""
    b = make_batch(kind, 3, int64_table=variant == "global")
    span = {"global_lens_span": 8, "odd_sizes": 5, "narrow_span": 2}.get(variant)
    if variant == "odd_sizes":
        b["bs"] = 3
    args = flashinfer_case(b, local=variant in ("local", "shared_table", "odd_sizes", "narrow_span"), span=span,
                           with_lens=variant == "global_lens_span")
    if variant == "shared_table":
        args = args[:9] + (None, b["bs"]) + args[11:]
    flashinfer_matches_oracle(device, args)


def flashinfer_matches_oracle(device, args):
    """build_flashinfer_mixed_sparse_indices(*args) into fresh outputs and into out buffers with a spare row,
    under the kernel and the reference: equal to each other and to the oracle, the spare row untouched."""
    WSWA_HINT[0] = args[0].shape[1]
    rows = args[0].shape[0] + args[3].shape[0]

    def fn(dev):
        a = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in args)
        fresh = d.build_flashinfer_mixed_sparse_indices(*a)
        out = (torch.full((rows + 1, fresh[0].shape[1]), 5, dtype=torch.int32, device=dev),
               torch.full((rows + 1,), 5, dtype=torch.int32, device=dev))
        d.build_flashinfer_mixed_sparse_indices(*a, out=out)
        return fresh + out

    k, r = run_both(device, fn)
    assert_same(k, r, "flashinfer")
    a = [x.tolist() if isinstance(x, torch.Tensor) else x for x in args]
    sparse, lens = o_flashinfer(*a)
    assert L(r[0]) == sparse and L(r[1]) == lens
    assert L(r[2][:rows]) == sparse and L(r[3][:rows]) == lens and L(r[3][rows:]) == [5]


@pytest.mark.parametrize("R", [kernels.SEARCH - 1, kernels.SEARCH + 5])
def test_flashinfer_many_requests(device, R):
    """R + 1 query_start_loc entries in one vector (R = SEARCH - 1, one round of loads), or past it (the
    per-row loads after token_to_req_indices): prefill tokens of requests beyond index SEARCH."""
    g = torch.Generator().manual_seed(R)
    qlens = torch.zeros(R, dtype=torch.int64)
    busy = torch.cat([torch.randperm(R, generator=g)[:5], torch.tensor([R - 1])])
    qlens[busy] = torch.randint(1, 4, (6,), generator=g)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), qlens.cumsum(0)]).int()
    seq = (qlens + torch.randint(0, 30, (R,), generator=g)).int()
    t2r = torch.repeat_interleave(torch.arange(R), qlens).int()
    Tp = int(qlens.sum())
    bt = torch.randint(-1, 500, (R, 12), generator=g, dtype=torch.int32)
    ptopk = torch.randint(-2, 40, (Tp, 4), generator=g, dtype=torch.int32)
    args = (torch.zeros((0, 8), dtype=torch.int32), None, None, ptopk, qsl, seq, t2r, bt, 4, None, 4, 8, 4, 4,
            True, None, None, None)

    def fn(dev):
        return d.build_flashinfer_mixed_sparse_indices(*[x.to(dev) if isinstance(x, torch.Tensor) else x for x in args])

    k, r = run_both(device, fn)
    assert_same(k, r, "flashinfer, many requests")
    WSWA_HINT[0] = 8
    sparse, lens = o_flashinfer(*[x.tolist() if isinstance(x, torch.Tensor) else x for x in args])
    assert L(r[0]) == sparse and L(r[1]) == lens
    assert max(x for row in sparse for x in row) >= 0       # some slots are valid


@pytest.mark.parametrize("kind", BATCHES)
@pytest.mark.parametrize("mct", [8192, 5])
@pytest.mark.parametrize("bs", [4, 3, 32])      # table runs per tile row (4), per-position lookups (3, 32 > tile)
def test_random_c128a(device, kind, mct, bs):
    c128a_matches_oracle(device, kind, mct, bs, (9, 11))


def c128a_matches_oracle(device, kind, mct, bs, widths):
    """build_c128a_topk_metadata over a random batch into 3-filled buffers of `widths` (decode, prefill) columns:
    the kernel equal to the reference and both to the oracle."""
    b = make_batch(kind, 4, ratio=2)
    b["bs"] = bs
    T = b["T"]
    Td = sum(1 for q in b["qlens"] if q == 1)
    g = b["g"]
    positions = torch.tensor([s - 1 for s, q in zip(b["seq"], b["qlens"]) if q == 1]
                             + [int(x) for x in torch.randint(-3, 40, (T - Td,), generator=g)], dtype=torch.int64)
    t2r = torch.tensor(b["t2r"][:Td] + [0], dtype=torch.int32)
    slots = torch.tensor(b["slots"], dtype=torch.int64)
    if Td:
        slots[0] = -5

    def fn(dev):
        bufs = (torch.full((Td + 1, widths[0]), 3, dtype=torch.int32, device=dev),
                torch.full((Td + 1,), 3, dtype=torch.int32, device=dev),
                torch.full((T - Td + 1, widths[1]), 3, dtype=torch.int32, device=dev))
        d.build_c128a_topk_metadata(positions.to(dev), 2, Td, t2r.to(dev), b["bt"].to(dev), b["bs"], slots.to(dev),
                                    *bufs, mct)
        return bufs

    k, r = run_both(device, fn)
    assert_same(k, r, "c128a")
    expected = o_c128a(positions.tolist(), 2, Td, t2r.tolist(), b["bt"].tolist(), b["bs"], slots.tolist(),
                       [[3] * widths[0]] * (Td + 1), [3] * (Td + 1), [[3] * widths[1]] * (T - Td + 1), mct)
    assert [L(x) for x in r] == list(expected)


@pytest.mark.parametrize("T", [0, 1, 6])
def test_random_fill_short(device, T):
    fill_matches_oracle(device, T, 9)


def fill_matches_oracle(device, T, topk):
    """fill_short_context_topk_indices over T random positions into columns 2 .. topk + 2 of a random buffer of
    topk + 3 columns: the kernel equal to the reference and both to the oracle, the other columns untouched."""
    g = torch.Generator().manual_seed(T)
    positions = torch.randint(-5, 40, (T,), generator=g)
    base = torch.randint(-9, 9, (T + 2, topk + 3), generator=g, dtype=torch.int32)

    def fn(dev):
        t = base.clone().to(dev)
        d.fill_short_context_topk_indices(t[:, 2:], positions.to(dev), topk, 4)
        return (t,)

    k, r = run_both(device, fn)
    assert_same(k, r, "fill")
    expected = [row[:2] + o for row, o in zip(base.tolist(), o_fill([r[2:] for r in base.tolist()], positions.tolist(),
                                                                    topk, 4))]
    assert L(r[0]) == expected


@pytest.fixture
def narrow_tiles():
    """Column tiles capped at MIN_BLOCK columns, so that rows wider than that walk every kernel's column loops."""
    from torch_dsv4_ops.ops import sparse_index as ops

    with patched_constants(kernels, [ops._PLANS], MAX_BLOCK=kernels.MIN_BLOCK):
        yield


@pytest.mark.parametrize("builder", ["global", "combine", "flashinfer", "c128a", "fill"])
def test_narrow_tiles_walk_every_column_loop(device, narrow_tiles, builder):
    """Each builder with rows of 2-3 tiles (40-48 columns over 16-column tiles): the loops past a row's first tile,
    which only rows wider than MAX_BLOCK (1024) columns take otherwise."""
    b = make_batch("mixed", 11)
    if builder == "global":
        global_matches_oracle(device, b, 40)
    elif builder == "combine":        # ratio 1: top-k parts of up to 40 columns
        combine_matches_oracle(device, combine_case(make_batch("mixed", 11, ratio=1), topk=40), "combine, narrow tiles")
    elif builder == "flashinfer":
        flashinfer_matches_oracle(device, flashinfer_case(b, topk=40, wswa=40))
    elif builder == "c128a":
        c128a_matches_oracle(device, "mixed", 8192, 4, (40, 44))
    else:
        fill_matches_oracle(device, 6, 30)


# === hostile indices (§4 b) =======================================================================
def test_hostile_global(device):
    topk = i32([[-2**31, -2, 0, 5, 23, 24, 2**31 - 1, 3]] * 4)
    t2r = i32([0, 1, -1, 7])
    bt = torch.tensor([[2**40, -3, 4], [-2**62, 2**31, 1]], dtype=torch.int64)   # past INT32_MAX slots -> -1
    valid = torch.tensor([True, True, True, True])

    def fn(dev):
        return d.compute_global_topk_indices_and_lens(topk.to(dev), t2r.to(dev), bt.to(dev), 8, valid.to(dev))

    k, r = run_both(device, fn)
    assert_same(k, r, "global hostile")
    assert L(r[0]) == [[-1, -1, -1, -1, 39, -1, -1, -1], [-1, -1, -1, -1, 15, -1, -1, -1], [-1] * 8, [-1] * 8]
    assert L(r[1]) == [1, 1, 0, 0]


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_slot_limit_global_and_flashinfer_span(device, table_dtype):
    """Block ids at the int32 limit: with bs 8, block 2**28 - 1 still fits (slots up to 2**31 - 1) and block
    2**28 does not (-1); with a span of 16 the limit is block 2**27 (FlashInfer's remap)."""
    bt = torch.tensor([[2**28 - 1, 2**28, 2**27 - 1, 2**27, -1, 2**31 - 1]], dtype=table_dtype)
    topk = torch.arange(0, 48, dtype=torch.int32).view(1, 48)
    t2r = i32([0])
    valid = torch.tensor([True])

    def fn(dev):
        g = d.compute_global_topk_indices_and_lens(topk.to(dev), t2r.to(dev), bt.to(dev), 8, valid.to(dev))
        f = d.build_flashinfer_mixed_sparse_indices(
            torch.zeros((0, 1), dtype=torch.int32, device=dev), None, None, topk.to(dev), i32([0, 1], dev),
            i32([4000], dev), t2r.to(dev), bt.to(dev),
            8, None, 8, 1, 1, 48, True, None, 16, 16)
        return g + f

    k, r = run_both(device, fn)
    assert_same(k, r, "slot limits")
    off = list(range(8))
    assert L(r[0][0]) == ([2**31 - 8 + o for o in off] + [-1] * 8 + [2**30 - 8 + o for o in off]
                          + [2**30 + o for o in off] + [-1] * 16)
    assert L(r[1]) == [24]
    assert L(r[2][0]) == [-1] * 17 + [2**31 - 16 + o for o in off] + [-1] * 24 and L(r[3]) == [49]


def test_hostile_combine(device):
    """Local indices past N and negative, gather_lens > seq_lens, huge M (int32 overflow -> -1)."""
    topk = i32([[5, -2**31, 2**31 - 1, 1]] * 6)
    args = (topk, i32([7, 10, 13]), i32([3, 40]), i32([30, 3]), 4, 1, 3, 6, 2)

    def fn(dev):
        a = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in args]
        return (d.combine_topk_swa_indices(*a) + d.combine_topk_swa_indices(*a[:7], 2**30, 2)
                + d.combine_topk_swa_indices(*a[:7], 2**31 - 2, 2))

    k, r = run_both(device, fn)
    assert_same(k, r, "combine hostile")
    a = [x.tolist() if isinstance(x, torch.Tensor) else x for x in args]
    for i, M in enumerate((6, 2**30, 2**31 - 2)):
        assert L(r[2 * i]) == o_combine(*a[:7], M, 2, width=128)[0]
    # t = 0 (request 0, pos 0, gather range starts at 3 - 30 = -27): l = 5 >= N, then w = 27 (N + w < M?)
    assert L(r[0][0][:3]) == [-1, -1, -1] and L(r[2][0][:3]) == [-1, 29, -1]
    # t = 3 (request 1, pos 37): l = 5, -2**31, 2**31-1 all outside [0, N); window rows w = -3..0
    assert L(r[2][3][:8]) == [-1] * 6 + [2**30 + 2, -1] and L(r[3][3]) == 7
    assert L(r[4][3][:8]) == [-1] * 8      # M*b + N + w = 2**31 is past INT32_MAX: -1


def test_hostile_flashinfer(device):
    args = (i32([[-2**31, 2**31 - 1, 7, -1]]), i32([[-5, 99, 0]]), None, i32([[-2**31, 2**31 - 1, 0, 100]] * 2),
            i32([0, 1, 3]), i32([9, 300]), i32([0, 1, 9]), torch.tensor([[-1, 2**35], [3, 4]]), 4, None, 4, 4, 1, 4,
            True, None, 2**20, None)

    def fn(dev):
        a = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in args)
        return d.build_flashinfer_mixed_sparse_indices(*a)

    k, r = run_both(device, fn)
    assert_same(k, r, "flashinfer hostile")
    WSWA_HINT[0] = 4
    assert L(r[0]) == o_flashinfer(*[x.tolist() if isinstance(x, torch.Tensor) else x for x in args])[0]
    assert L(r[0][2]) == [-1] * 8 and L(r[1][2]) == 4    # request id 9 is out of range


@pytest.mark.parametrize("guess", [True, False])
def test_c128a_token_request_guess(device, guess):
    """Decode token t of a request other than t (the kernel's first tile of table row t, read before
    token_to_req arrives, must be dropped), of request t with a row shorter than the tile, and of an
    out-of-range request; with the guess (small launches) and without it (kernels.GUESS_ROWS = 0)."""
    from torch_dsv4_ops.ops import sparse_index as ops

    g = torch.Generator().manual_seed(17)
    bt = torch.randint(0, 300, (8, 6), generator=g, dtype=torch.int32)
    bt[1, 2] = -1
    t2r = i32([0, 4, 2, 7, 1, 9, 6])                # rows 0, 2 and 6 are request t's; 9 is past the table
    positions = torch.tensor([40, 3, 17, 47, -1, 30, 11, 25], dtype=torch.int64)
    Td, mct = 7, 8192
    slots = torch.tensor([1, 2, -1, 4, 5, 6, 7, 8], dtype=torch.int64)

    def fn(dev):
        bufs = (torch.full((Td, 13), 3, dtype=torch.int32, device=dev),
                torch.full((Td,), 3, dtype=torch.int32, device=dev), torch.full((1, 5), 3, dtype=torch.int32, device=dev))
        d.build_c128a_topk_metadata(positions.to(dev), 2, Td, t2r.to(dev), bt.to(dev), 4, slots.to(dev), *bufs, mct)
        return bufs

    with patched_constants(kernels, [ops._PLANS], **({} if guess else {"GUESS_ROWS": 0})):
        k, r = run_both(device, fn)
    assert_same(k, r, "c128a, token/request guess")
    expected = o_c128a(positions.tolist(), 2, Td, t2r.tolist(), bt.tolist(), 4, slots.tolist(), [[3] * 13] * Td,
                       [3] * Td, [[3] * 5], mct)
    assert [L(x) for x in r] == list(expected)
    assert L(r[0])[1][:3] == [o32(o_lookup(bt.tolist(), 4, j, 4)) for j in (0, 1)] + [-1]   # request 4's row


def test_hostile_c128a_width_limits(device):
    """W = min(max_compressed_tokens, buffer width): nothing past the buffers' rows or columns."""
    positions = torch.tensor([2**40, -7, 2**40, 3])
    bt = i32([[1, -1, 2**30]])

    def fn(dev):
        base_g = torch.full((2, 8), 4, dtype=torch.int32, device=dev)
        base_p = torch.full((2, 8), 4, dtype=torch.int32, device=dev)
        bufs = (base_g[:, :5], torch.full((2,), 4, dtype=torch.int32, device=dev), base_p[:, :6])
        d.build_c128a_topk_metadata(positions.to(dev), 1, 2, i32([0, 5], dev), bt.to(dev), 2,
                                    torch.tensor([0, 0], device=dev), *bufs, 6)
        return base_g, bufs[1], base_p

    k, r = run_both(device, fn)
    assert_same(k, r, "c128a hostile")
    assert L(r[0]) == [[2, 3, -1, -1, -1, 4, 4, 4], [-1, -1, -1, -1, -1, 4, 4, 4]]
    assert L(r[1]) == [5, 0]
    assert L(r[2]) == [[0, 1, 2, 3, 4, 5, 4, 4], [0, 1, 2, 3, -1, -1, 4, 4]]


# === R5 empty work ================================================================================
def test_empty_batches_launch_nothing(device, monkeypatch):
    from torch_dsv4_ops.kernels import _launch
    calls = []
    monkeypatch.setattr(_launch.Launch, "__call__", lambda self, *t: calls.append(self))
    e = torch.empty(0, 4, dtype=torch.int32, device=device)
    g, lens = d.compute_global_topk_indices_and_lens(e, i32([], device), i32([[1]], device), 4,
                                                     torch.empty(0, dtype=torch.bool, device=device))
    assert g.shape == (0, 4) and lens.shape == (0,)
    c, cl = d.combine_topk_swa_indices(i32([[1, 2]] * 3, device), i32([5], device), i32([], device), i32([], device),
                                       4, 4, 2, 8, 2)
    assert L(c) == [[-1] * 128] * 3 and L(cl) == [0] * 3
    s, sl = d.build_flashinfer_mixed_sparse_indices(e, None, None, e, i32([0], device), i32([], device),
                                                    i32([], device), i32([[0]], device), 64, None, 64, 4, 4, 3)
    assert s.shape == (0, 8) and sl.shape == (0,)
    gd, dl, pf = d.build_c128a_topk_metadata(torch.empty(0, dtype=torch.int64, device=device), 128, 0,
                                             i32([], device), i32([[1]], device), 2, i32([], device), e, i32([], device),
                                             e)
    assert gd.shape == (0, 4) and pf.shape == (0, 4)
    d.fill_short_context_topk_indices(e, torch.empty(0, dtype=torch.int64, device=device), 4, 4)
    assert calls == []


# === validation (R3) ================================================================================
def _good_global():
    return [i32([[0, 1]]), i32([0]), i32([[1]]), 4, torch.tensor([True])]


def _good_combine():
    return list(_combine_example("cpu"))


def _good_fi():
    return [i32([[1, 2, 3, 4]]), None, None, torch.empty(0, 2, dtype=torch.int32), i32([0, 1]), i32([5]), i32([0]),
            i32([[0]]), 64, None, 64, 4, 4, 2]


def _good_c128a():
    return [torch.tensor([3, 4]), 128, 1, i32([0]), i32([[1]]), 2, torch.tensor([0, 0]),
            torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, 8, dtype=torch.int32)]


BAD = [
    ("global", 0, torch.zeros(1, 2, dtype=torch.int64), "topk_indices"),
    ("global", 1, torch.zeros(1, 1, dtype=torch.int32), "token_to_req_indices"),
    ("global", 1, i32([]), "token_to_req_indices"),
    ("global", 2, torch.zeros(2, dtype=torch.int32), "block_table"),
    ("global", 2, torch.zeros(1, 1, dtype=torch.float32), "block_table"),
    ("global", 3, 0, "block_size"),
    ("global", 4, torch.tensor([1]), "is_valid_token"),
    ("combine", 0, torch.zeros(8, 1, dtype=torch.int32), "topk"),
    ("combine", 1, torch.zeros(3, dtype=torch.float32), "query_start_loc"),
    ("combine", 2, i32([10]), "seq_lens"),
    ("combine", 3, torch.zeros(2, 1, dtype=torch.int32), "gather_lens"),
    ("combine", 4, 0, "window_size"),
    ("combine", 5, 0, "compress_ratio"),
    ("combine", 6, 3, "topk"),
    ("combine", 6, -1, "topk"),
    ("fi", 0, i32([[1, 2, 3]]), "decode_swa_indices"),
    ("fi", 1, i32([[1], [2]]), "decode_compressed_indices"),
    ("fi", 2, torch.zeros(1, dtype=torch.float32), "decode_compressed_topk_lens"),
    ("fi", 3, torch.zeros(3, dtype=torch.int32), "prefill_topk_indices"),
    ("fi", 6, i32([]), "token_to_req_indices"),
    ("fi", 7, torch.zeros(1, dtype=torch.int32), "swa_block_table"),
    ("fi", 8, 0, "swa_block_size"),
    ("fi", 9, torch.zeros(1, 1, dtype=torch.float32), "compressed_block_table"),
    ("fi", 10, -64, "compressed_block_size"),
    ("fi", 11, 0, "window_size"),
    ("fi", 12, 0, "compress_ratio"),
    ("c128a", 0, torch.zeros(2, 1), "positions"),
    ("c128a", 1, 0, "compress_ratio"),
    ("c128a", 2, 3, "num_decode_tokens"),
    ("c128a", 4, torch.zeros(1, dtype=torch.int32), "block_table"),
    ("c128a", 5, 0, "block_size"),
    ("c128a", 6, torch.zeros(0, dtype=torch.int64), "slot_mapping"),
    ("c128a", 7, torch.zeros(1, 8, dtype=torch.int64), "global_decode_buffer"),
    ("c128a", 8, torch.zeros(0, dtype=torch.int32), "decode_lens_buffer"),
    ("c128a", 9, torch.zeros(0, 8, dtype=torch.int32), "prefill_buffer"),
]
FUNCS = {"global": (_good_global, d.compute_global_topk_indices_and_lens),
         "combine": (_good_combine, d.combine_topk_swa_indices),
         "fi": (_good_fi, d.build_flashinfer_mixed_sparse_indices),
         "c128a": (_good_c128a, d.build_c128a_topk_metadata)}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op,pos,value,name", BAD, ids=[f"{b[0]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input(impl, op, pos, value, name):
    good, fn = FUNCS[op]
    args = good()
    fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])   # the good arguments pass
    args[pos] = value
    with impl_ctx(impl, torch.device("cpu")), pytest.raises(ValueError, match=name):
        fn(*args)


def test_bad_input_buffers():
    args = _good_global()
    with pytest.raises(ValueError, match=r"output_buffers\[0\]"):
        d.compute_global_topk_indices_and_lens(*args, output_buffers=(torch.zeros(2, 2, dtype=torch.int32),
                                                                      torch.zeros(1, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"output_buffers\[1\]"):
        d.compute_global_topk_indices_and_lens(*args, output_buffers=(torch.zeros(1, 2, dtype=torch.int32),
                                                                      torch.zeros(2, dtype=torch.int32)))
    c = _good_combine()     # topk 2 + window 4 = 6 columns needed
    with pytest.raises(ValueError, match=r"out\[0\].*topk \+ window_size"):
        d.combine_topk_swa_indices(*c, out=(torch.zeros(8, 5, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"out\[1\]"):
        d.combine_topk_swa_indices(*c, out=(torch.zeros(8, 6, dtype=torch.int32), torch.zeros(7, dtype=torch.int32)))
    f = _good_fi()          # Wswa 4 + P 4
    with pytest.raises(ValueError, match=r"out\[0\].*Wswa \+ P"):
        d.build_flashinfer_mixed_sparse_indices(*f, out=(torch.zeros(1, 9, dtype=torch.int32),
                                                         torch.zeros(1, dtype=torch.int32)))
    with pytest.raises(ValueError, match="decode_swa_indices"):        # Wswa < window_size
        d.build_flashinfer_mixed_sparse_indices(*f[:11], 5, *f[12:])
    with pytest.raises(ValueError, match="swa_block_span"):
        d.build_flashinfer_mixed_sparse_indices(*f, swa_block_span=0)
    with pytest.raises(ValueError, match="topk"):
        d.fill_short_context_topk_indices(torch.zeros(2, 4, dtype=torch.int32), torch.tensor([1, 2]), 5, 4)
    with pytest.raises(ValueError, match="compress_ratio"):
        d.fill_short_context_topk_indices(torch.zeros(2, 4, dtype=torch.int32), torch.tensor([1, 2]), 4, 0)
    with pytest.raises(ValueError, match="topk_indices"):
        d.fill_short_context_topk_indices(torch.zeros(1, 4, dtype=torch.int32), torch.tensor([1, 2]), 4, 4)
    with pytest.raises(ValueError, match="positions"):
        d.fill_short_context_topk_indices(torch.zeros(2, 4, dtype=torch.int32), torch.tensor([1.0, 2.0]), 4, 4)


# === opcheck (every op, functional and _out forms) ==================================================
def opcheck_cases(device):
    b = make_batch("mixed", 5)
    gl_args = (torch.randint(-1, 40, (b["T"], 5), dtype=torch.int32), torch.tensor(b["t2r"], dtype=torch.int32),
               b["bt"], b["bs"], torch.tensor(b["valid"]))
    T = b["T"]
    comb = combine_case(b)
    fi = flashinfer_case(b)
    rows = fi[0].shape[0] + fi[3].shape[0]
    P = layout.flashinfer_compressed_width(fi[13], fi[1].shape[1])
    Td = 2
    c128 = (torch.arange(T, dtype=torch.int64) * 3, 2, Td, torch.tensor(b["t2r"][:Td], dtype=torch.int32), b["bt"],
            b["bs"], torch.tensor(b["slots"]), torch.zeros(Td, 9, dtype=torch.int32), torch.zeros(Td, dtype=torch.int32),
            torch.zeros(T - Td, 7, dtype=torch.int32), 6)
    cases = {
        "compute_global_topk_indices_and_lens": gl_args,
        "compute_global_topk_indices_and_lens_out": gl_args + (torch.zeros(T, 5, dtype=torch.int32),
                                                               torch.zeros(T, dtype=torch.int32)),
        "combine_topk_swa_indices": comb,
        "combine_topk_swa_indices_out": comb + (torch.zeros(T + 1, 12, dtype=torch.int32),
                                                torch.zeros(T + 1, dtype=torch.int32)),
        "build_flashinfer_mixed_sparse_indices": fi,
        "build_flashinfer_mixed_sparse_indices_out": fi + (torch.zeros(rows, fi[0].shape[1] + P, dtype=torch.int32),
                                                           torch.zeros(rows, dtype=torch.int32)),
        "build_c128a_topk_metadata": c128,
        "fill_short_context_topk_indices": (torch.zeros(T, 6, dtype=torch.int32), torch.arange(T) * 2, 5, 2),
    }
    return {k: tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in v) for k, v in cases.items()}


MUTATED_OR_TABLE = {"compute_global_topk_indices_and_lens_out": (5, 6), "combine_topk_swa_indices_out": (9, 10),
                    "build_flashinfer_mixed_sparse_indices_out": (18, 19), "build_c128a_topk_metadata": (7, 8, 9),
                    "fill_short_context_topk_indices": (0,)}


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("name", list(opcheck_cases("cpu")))
def test_opcheck(device, impl, name):
    if impl == "reference" and device.type != "cpu":
        pytest.skip("the reference is the CPU implementation")
    ctx = d.cpu_implementation(impl) if device.type == "cpu" else contextlib.nullcontext()
    args = opcheck_cases(device)[name]
    keep = MUTATED_OR_TABLE.get(name, ())
    with ctx:
        run_opcheck(getattr(OPS, name).default, args, layouts=("contiguous", "permuted"),
                    permute=lambda i, t: t.dim() >= 2 and i not in keep)


# === torch.compile: three sizes, one graph ==========================================================
def test_compile_no_recompile(device):
    """fullgraph + dynamic over T in {7, 13, 17} (T, T - 2 never 0/1 nor equal to another dim: duck sizing): one graph
    for all five ops, both forms where they exist."""
    def step(topk, t2r, bt, valid, qsl, seq, gl, positions, gbuf, lbuf, pbuf, fill, g_out, l_out):
        g, lens = d.compute_global_topk_indices_and_lens(topk, t2r, bt, 4, valid)
        d.compute_global_topk_indices_and_lens(topk, t2r, bt, 4, valid, output_buffers=(g_out, l_out))
        c, cl = d.combine_topk_swa_indices(topk, qsl, seq, gl, 4, 2, 5, 50, 20)
        s, sl = d.build_flashinfer_mixed_sparse_indices(topk[:0], None, None, topk, qsl, seq, t2r, bt, 4, None, 4,
                                                        4, 2, 5)
        gd, dl, pf = d.build_c128a_topk_metadata(positions, 2, 2, t2r, bt, 4, positions, gbuf, lbuf, pbuf)
        d.fill_short_context_topk_indices(fill, positions, 5, 2)
        return g, lens, g_out, l_out, c, cl, s, sl, gd, dl, pf, fill

    inputs = []
    for n in (7, 13, 17):
        g = torch.Generator().manual_seed(n)
        args = (torch.randint(-1, 30, (n, 6), generator=g, dtype=torch.int32),
                torch.randint(0, 2, (n,), generator=g, dtype=torch.int32),
                torch.randint(-1, 99, (2, 9), generator=g, dtype=torch.int32), torch.rand(n, generator=g) > 0.3,
                i32([0, 1, n]), i32([5, n + 9]), i32([4, n + 3]), torch.randint(0, 20, (n,), generator=g),
                torch.zeros(2, 10, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                torch.zeros(n - 2, 10, dtype=torch.int32), torch.zeros(n, 6, dtype=torch.int32),
                torch.zeros(n, 6, dtype=torch.int32), torch.zeros(n, dtype=torch.int32))
        inputs.append(tuple(a.to(device) for a in args))
    counted = device.type == "cuda"
    ks = (kernels.global_topk_kernel, kernels.combine_kernel, kernels.flashinfer_kernel, kernels.c128a_kernel,
          kernels.fill_short_kernel)
    before = [triton_cache_entries(k) for k in ks] if counted else None
    check_compile(step, inputs)
    if counted:   # one Triton specialisation per kernel for all token counts
        assert all(triton_cache_entries(k) - b <= 1 for k, b in zip(ks, before))


# === GPU only =======================================================================================
@pytest.mark.gpu
def test_cuda_graph_replay_new_metadata():
    """Decode metadata ops captured once, replayed with new values in the same buffers."""
    dev = torch.device("cuda")

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(-1, 300, (16, 512), generator=g, dtype=torch.int32).to(dev),
                torch.randint(0, 4, (16,), generator=g, dtype=torch.int32).to(dev),
                torch.randint(-1, 1000, (4, 8), generator=g, dtype=torch.int32).to(dev),
                (torch.rand(16, generator=g) > 0.2).to(dev),
                torch.randint(0, 60000, (16,), generator=g).to(dev),
                torch.zeros(16, 512, dtype=torch.int32, device=dev), torch.zeros(16, dtype=torch.int32, device=dev),
                torch.zeros(16, 512, dtype=torch.int32, device=dev), torch.zeros(16, dtype=torch.int32, device=dev),
                torch.zeros(1, 512, dtype=torch.int32, device=dev), torch.zeros(16, 512, dtype=torch.int32,
                                                                                 device=dev))

    def step(topk, t2r, bt, valid, positions, g_out, l_out, gbuf, lbuf, pbuf, fill):
        d.compute_global_topk_indices_and_lens(topk, t2r, bt, 64, valid, output_buffers=(g_out, l_out))
        d.build_c128a_topk_metadata(positions, 128, 16, t2r, bt, 2, positions, gbuf, lbuf, pbuf, 512)
        d.fill_short_context_topk_indices(fill, positions, 512, 4)
        return None

    check_cuda_graph(step, inputs(0), [inputs(1), inputs(2)])


@pytest.mark.gpu
def test_cuda_graph_combine_and_flashinfer():
    dev = torch.device("cuda")
    b = make_batch("mixed", 7, window=128)

    def inputs(seed):
        b2 = make_batch("mixed", seed, window=128)
        comb = combine_case(b2, topk=64)
        fi = flashinfer_case(b2, topk=64, wswa=128)
        return tuple(x.to(dev) for x in comb[:4]) + tuple(x.to(dev) for x in (fi[0], fi[1], fi[3], fi[6], fi[7], fi[9],
                                                                             fi[15]))

    static = inputs(7)
    T = static[0].shape[0]
    rows = static[4].shape[0] + static[6].shape[0]
    bufs = (torch.zeros(T, 256, dtype=torch.int32, device=dev), torch.zeros(T, dtype=torch.int32, device=dev),
            torch.zeros(rows, 128 + 64, dtype=torch.int32, device=dev), torch.zeros(rows, dtype=torch.int32,
                                                                                     device=dev))
    M, N = 400, 100

    def step(topk, qsl, seq, gl, dswa, dcomp, ptopk, t2r, sbt, cbt, dvalid, c_out, c_lens, f_out, f_lens):
        d.combine_topk_swa_indices(topk, qsl, seq, gl, 128, 4, 64, M, N, out=(c_out, c_lens))
        d.build_flashinfer_mixed_sparse_indices(dswa, dcomp, None, ptopk, qsl - qsl[:1], seq, t2r, sbt, 4, cbt, 2,
                                                128, 4, 64, True, dvalid, out=(f_out, f_lens))

    check_cuda_graph(step, static + bufs, [inputs(8) + tuple(torch.zeros_like(x) for x in bufs),
                                           inputs(9) + tuple(torch.zeros_like(x) for x in bufs)])
    del b


@pytest.mark.gpu
def test_sync_free():
    check_sync_free(opcheck_cases(torch.device("cuda")))


@pytest.mark.gpu
def test_benchmark_sized_exactness():
    """T = 4096 mixed prefill, window 128, top-k 512, ratio 4; T = 16384 global top-k with K = 512."""
    from benchmarks import bench_sparse_index as bench
    for spec in bench.headline_specs():
        w = bench.build(spec, torch.device("cuda"))
        assert w.check() == "ok", spec
