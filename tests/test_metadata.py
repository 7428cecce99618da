"""Metadata ops (SPEC §3.4, §0 lookup, §4 b, h, i, §5).

Every worked example of SPEC §3.4 is a literal test. On random batches, the reference and the
Triton kernel (interpreted on CPU) are each compared exactly with an independent plain-Python
oracle (below), in poisoned output buffers so that every untouched element is checked too.
"""
import contextlib
import random

import pytest
import torch

import torch_dsv4_ops as d
from torch_dsv4_ops.kernels import metadata as kernels
from torch_dsv4_ops.testing import (as_list, assert_bitwise_equal, check_compile, check_cuda_graph, check_sync_free,
                                    i32, implementation, oracle_lookup, patched_constants, run_opcheck,
                                    triton_cache_entries)

OPS = torch.ops.dsv4
IMPLS = ["kernel", "reference"]
POISON = 0x5A5A5A5A


impl_ctx, L = implementation, as_list


def poisoned(shape, device, dtype=torch.int32):
    return torch.full(shape, POISON, dtype=dtype, device=device)


# --- the independent oracle (plain Python over lists, written from SPEC's text) ------------------
o_lookup = oracle_lookup


def o_slot_mapping(num_tokens, qsl, seq, bt, bs, ratio, out_len):
    out = [-1] * out_len
    R = min(len(bt), len(seq), len(qsl) - 1)
    for b in range(R):
        q = qsl[b + 1] - qsl[b]
        for i in range(q):
            row = qsl[b] + i
            if 0 <= row < min(num_tokens, out_len):
                pos = seq[b] - q + i
                ok = pos >= 0 and (pos + 1) % ratio == 0
                out[row] = o_lookup(bt, b, pos // ratio, bs, int32=False) if ok else -1
    return out


def o_swa(rows, W, window, qsl, seq, t2r, valid, bt, bs, offset, noncausal=False):
    idx, lens = [], []
    R = min(len(qsl) - 1, len(seq))
    for i in range(rows):
        t = offset + i
        r = t2r[t]
        if not valid[t] or not (0 <= r < R):
            idx.append([-1] * W)
            lens.append(0)
            continue
        q = qsl[r + 1] - qsl[r]
        prefix = seq[r] - q
        pos = prefix + t - qsl[r]
        if pos < 0:
            idx.append([-1] * W)
            lens.append(0)
            continue
        if noncausal:
            start = max(prefix - window, 0)
            n = max(min(seq[r] - start, W), 0)
        else:
            start = max(pos - window + 1, 0)
            n = pos + 1 - start
        idx.append([o_lookup(bt, r, start + c, bs) if c < n else -1 for c in range(W)])
        lens.append(n)
    return idx, lens


def o_gather_lens(seq, qsl, nd, np_, window):
    out = []
    for i in range(np_):
        r = nd + i
        q = qsl[r + 1] - qsl[r]
        out.append(q + min(max(seq[r] - q, 0), window - 1))
    return out


def o_table_row(bt, r, width):
    if r is None:
        return [0] + [-1] * (width - 1)
    w = min(len(bt[0]) if bt else 0, width)
    return [bt[r][c] if c < w else -1 for c in range(width)]


def o_uniform(seq, bt, L_, n, width):
    dsl, ebt = [], []
    for idx in range(n):
        r, j = divmod(idx, L_)
        dsl.append(max(seq[r] - L_ + j + 1, 0))
        ebt.append(o_table_row(bt, r, width))
    return dsl, ebt, [1] * n


def o_varlen(qsl, seq, bt, nd, n, width):
    dsl, ebt, di = [], [], []
    rows = []
    for b in range(nd):
        for j in range(qsl[b + 1] - qsl[b]):
            rows.append((b, j))
    E = len(rows)
    for row in range(n):
        if row < E:
            b, j = rows[row]
            dl = qsl[b + 1] - qsl[b]
            dsl.append(max(seq[b] - dl + j + 1, 0))
            ebt.append(o_table_row(bt, b, width))
            di.append(b)
        else:
            dsl.append(0)
            ebt.append(o_table_row(bt, None, width))
            di.append(nd + row - E)
    return dsl, ebt, [1] * n, di


def o_token_metadata(qsl, slots):
    t2r = []
    for t in range(len(slots)):
        owners = [b for b in range(len(qsl) - 1) if qsl[b] <= t < qsl[b + 1]]
        t2r.append(owners[0] if owners else 0)
    return t2r, [s >= 0 for s in slots]


def o_native(qsl, seq, nd, L_, ratio):
    dl = [qsl[b + 1] - qsl[b] for b in range(nd)]
    dsl = [max(seq[b] - L_ + 1 + j, 0) // ratio for b in range(nd) for j in range(L_)]
    return dl, dsl


def o_local(x, rank, world, inter):
    if world <= 1:
        return x
    base = (x // inter // world) * inter
    return base + min(max(x - base * world - rank * inter, 0), inter)


def o_chunk(qsl, useq, comp, start, end, qs0, qs1, ratio, rank=0, world=1, inter=1, tts_len=None):
    n = end - start
    counts = [max(c, 0) for c in comp[start:end]]
    cu = [0]
    for c in counts:
        cu.append(cu[-1] + c)
    row_start = [0]
    for c in counts:
        row_start.append(row_start[-1] + o_local(c, rank, world, inter))
    ks, ke = [None] * (qs1 - qs0), [None] * (qs1 - qs0)
    for b in range(n):
        qlen = qsl[start + b + 1] - qsl[start + b]
        for o in range(qlen):
            a = qsl[start + b] - qsl[start] + o
            if qs0 <= a < qs1:
                ks[a - qs0] = row_start[b]
                ke[a - qs0] = row_start[b] + o_local(max(useq[start + b] - qlen + 1 + o, 0) // ratio, rank, world,
                                                     inter)
    total = cu[n] if tts_len is None else tts_len
    tts = [-1] * total
    for b in range(n):
        for k in range(cu[b], min(cu[b + 1], total)):
            tts[k] = b
    return cu, ks, ke, tts


# --- random batches ----------------------------------------------------------------------------
def make_batch(kind, seed, *, bs=64, width=24, bt_dtype=torch.int32, max_ctx=1500):
    """Decodes first (MTP with 1-3 tokens), then prefills; qlen-0 padding requests and -1 padding
    tokens; a table with negative and -10**6 entries."""
    rnd = random.Random(seed)
    nd = {"decode": rnd.randint(1, 6), "prefill": 0, "mixed": rnd.randint(1, 4), "empty": 0}[kind]
    np_ = {"decode": 0, "prefill": rnd.randint(1, 3), "mixed": rnd.randint(1, 3), "empty": 0}[kind]
    L_ = rnd.randint(1, 3)
    qlens = [rnd.choice([L_, L_, 0, 1]) for _ in range(nd)] + [rnd.choice([0, rnd.randint(1, 40)])
                                                              for _ in range(np_)]
    seq = [q + rnd.randint(0, max_ctx) for q in qlens]
    if seq:
        seq[rnd.randrange(len(seq))] = qlens[0] if qlens else 0     # a request with no prefix
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    T = qsl[-1]
    t2r = [b for b, q in enumerate(qlens) for _ in range(q)]
    valid = [rnd.random() > 0.1 for _ in range(T)]
    R = len(qlens)
    bt = [[rnd.choice([rnd.randint(0, 5000), rnd.randint(0, 5000), -1, -10**6]) for _ in range(width)]
          for _ in range(max(R, 1))]
    return dict(qlens=qlens, seq=seq, qsl=qsl, T=T, t2r=t2r, valid=valid, bt=bt, bs=bs, nd=nd, np=np_,
                bt_dtype=bt_dtype)


def tensors(b, device):
    return (i32(b["qsl"], device), i32(b["seq"], device), torch.tensor(b["bt"], dtype=b["bt_dtype"], device=device))


KINDS = ["decode", "prefill", "mixed", "empty"]


# === worked examples (SPEC §3.4, literal) ==============================================================
@pytest.mark.parametrize("impl", IMPLS)
def test_slot_mapping_worked_examples(device, impl):
    with impl_ctx(impl, device):
        out = d.get_compressed_slot_mapping(40, i32([0, 40], device), i32([280], device), i32([[5, 7]], device),
                                            64, 4)
        expected = [-1] * 40
        for k, v in enumerate([380, 381, 382, 383, 448, 449, 450, 451, 452, 453]):
            expected[3 + 4 * k] = v
        assert L(out) == expected
        assert out.dtype == torch.int64
        assert L(d.get_compressed_slot_mapping(3, i32([0, 3], device), i32([9], device), i32([[2]], device), 64,
                                               4)) == [-1, 129, -1]
        buf = torch.full((6,), 77, dtype=torch.int64, device=device)
        view = d.get_compressed_slot_mapping(3, i32([0, 3], device), i32([9], device), i32([[2]], device), 64, 4,
                                             out=buf)
        assert L(view) == [-1, 129, -1] and L(buf) == [-1, 129, -1, -1, -1, -1]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape3", [False, True])
def test_swa_worked_example(device, impl, shape3):
    idx = poisoned((3, 1, 4) if shape3 else (3, 4), device)
    lens = poisoned((3,), device)
    with impl_ctx(impl, device):
        d.compute_swa_indices_and_lens(idx, lens, 4, i32([0, 3], device), i32([10], device), i32([0, 0, 0], device),
                                       torch.ones(3, dtype=torch.bool, device=device), i32([[5, 9, 2]], device), 4)
    assert L(idx.view(3, 4)) == [[36, 37, 38, 39], [37, 38, 39, 8], [38, 39, 8, 9]]
    assert L(lens) == [4, 4, 4]


@pytest.mark.parametrize("impl", IMPLS)
def test_dspark_worked_example(device, impl):
    idx, lens = poisoned((4, 1, 64), device), poisoned((4,), device)
    with impl_ctx(impl, device):
        d.compute_dspark_noncausal_swa_indices_and_lens(idx, lens, 8, i32([0, 4], device), i32([20], device),
                                                        i32([0] * 4, device),
                                                        torch.ones(4, dtype=torch.bool, device=device),
                                                        i32([[3]], device), 64)
    row = list(range(200, 212)) + [-1] * 52
    assert L(idx.view(4, 64)) == [row] * 4
    assert L(lens) == [12] * 4


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_lens_worked_example(device, impl):
    # one decode first (nd = 1), then prefix 1000 / q 50 and prefix 10 / q 5
    qsl, seq = i32([0, 1, 51, 56], device), i32([77, 1050, 15], device)
    with impl_ctx(impl, device):
        assert L(d.compute_prefill_gather_lens(seq, qsl, 1, 2, 128)) == [177, 15]
        buf = poisoned((4,), device)
        assert L(d.compute_prefill_gather_lens(seq, qsl, 1, 2, 128, out=buf)) == [177, 15]
        assert L(buf)[2:] == [POISON, POISON]


@pytest.mark.parametrize("impl", IMPLS)
def test_uniform_decode_worked_example(device, impl):
    dsl, ebt, dl = poisoned((5,), device), poisoned((5, 3), device), poisoned((5,), device)
    bt = i32([[4, 5], [6, -1]], device)
    with impl_ctx(impl, device):
        d.prepare_uniform_decode(i32([10, 0], device), dsl, bt, ebt, dl, 2, 4)
    assert L(dsl) == [9, 10, 0, 0, POISON]
    assert L(dl) == [1, 1, 1, 1, POISON]
    assert L(ebt) == [[4, 5, -1], [4, 5, -1], [6, -1, -1], [6, -1, -1], [POISON] * 3]
    assert L(bt) == [[4, 5], [6, -1]]


@pytest.mark.parametrize("impl", IMPLS)
def test_varlen_decode_worked_example(device, impl):
    """SPEC §3.6.2: seq [10,7,12,0], dl [3,1,4,0] -> per-token contexts [8,9,10,7,9,10,11,12]; two
    padding rows after them."""
    dsl, ebt, dl, di = (poisoned((11,), device), poisoned((11, 2), device), poisoned((11,), device),
                        poisoned((11,), device))
    bt = i32([[1, 2], [3, 4], [5, 6], [7, 8]], device)
    with impl_ctx(impl, device):
        d.prepare_varlen_decode(i32([0, 3, 4, 8, 8], device), i32([10, 7, 12, 0], device), bt, dsl, ebt, dl, di, 4,
                                10)
    assert L(dsl) == [8, 9, 10, 7, 9, 10, 11, 12, 0, 0, POISON]
    assert L(dl) == [1] * 10 + [POISON]
    assert L(di) == [0, 0, 0, 1, 2, 2, 2, 2, 4, 5, POISON]
    assert L(ebt) == [[1, 2]] * 3 + [[3, 4]] + [[5, 6]] * 4 + [[0, -1]] * 2 + [[POISON] * 2]


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_chunk_worked_example(device, impl):
    """SPEC §3.4: ratio 4, uncompressed [10,9], q [4,3], compressed [2,2] (after two decodes)."""
    qsl, useq = i32([0, 1, 2, 6, 9], device), i32([50, 60, 10, 9], device)
    comp = i32([12, 15, 2, 2], device)
    cu, ks, ke, tts = poisoned((4,), device), poisoned((8,), device), poisoned((8,), device), poisoned((4,), device)
    with impl_ctx(impl, device):
        d.fill_prefill_chunk_metadata(qsl, useq, comp, 2, 4, 0, 7, 4, 0, 1, 1, cu, ks, ke, tts)
        assert L(cu) == [0, 2, 4, POISON]
        assert L(tts) == [0, 0, 1, 1]
        assert L(ks) == [0, 0, 0, 0, 2, 2, 2, POISON]
        assert L(ke) == [1, 2, 2, 2, 3, 4, 4, POISON]
        ks2, ke2 = poisoned((4,), device), poisoned((4,), device)
        d.fill_prefill_chunk_metadata(qsl, useq, comp, 2, 4, 2, 6, 4, 0, 1, 1, cu, ks2, ke2, tts)
        assert L(ks2) == [0, 0, 2, 2]
        assert L(ke2) == [2, 2, 3, 4]


# === random batches: reference == oracle, kernel == reference ============================================
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ratio,bs", [(4, 64), (128, 2)])
def test_slot_mapping_random(device, impl, kind, ratio, bs):
    for seed in range(3):
        b = make_batch(kind, seed, bs=bs, bt_dtype=torch.int64 if seed % 2 else torch.int32, max_ctx=4000)
        qsl, seq, bt = tensors(b, device)
        extra = seed   # T_pad > T: padding rows stay -1
        expected = o_slot_mapping(b["T"], b["qsl"], b["seq"], b["bt"], bs, ratio, b["T"] + extra)
        with impl_ctx(impl, device):
            got = d.get_compressed_slot_mapping(b["T"] + extra, qsl, seq, bt, bs, ratio)
            buf = poisoned((b["T"] + extra + 3,), device, torch.int64)
            view = d.get_compressed_slot_mapping(b["T"], qsl, seq, bt, bs, ratio, out=buf)
        assert L(got) == expected
        assert L(buf) == expected[:b["T"]] + [-1] * (extra + 3)
        assert view.shape[0] == b["T"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("noncausal", [False, True])
def test_swa_random(device, impl, kind, noncausal):
    for seed in range(3):
        b = make_batch(kind, 10 + seed, bs=16, bt_dtype=torch.int64 if seed == 1 else torch.int32, max_ctx=300)
        qsl, seq, bt = tensors(b, device)
        window = 24
        W = 64 if noncausal else window + 4 * seed
        t2r = b["t2r"] + [0, -3, 99]          # padding rows past T: hostile requests
        valid = b["valid"] + [True, True, True]
        for offset in (0, 2):
            rows = max(len(t2r) - offset, 0)
            exp_idx, exp_lens = o_swa(rows, W, window, b["qsl"], b["seq"], t2r, valid, b["bt"], 16, offset, noncausal)
            idx, lens = poisoned((rows, 1, W), device), poisoned((rows + 2,), device)
            fn = d.compute_dspark_noncausal_swa_indices_and_lens if noncausal else d.compute_swa_indices_and_lens
            with impl_ctx(impl, device):
                fn(idx, lens, window, qsl, seq, i32(t2r, device), torch.tensor(valid, device=device), bt, 16, offset)
            assert L(idx.view(rows, W)) == exp_idx
            assert L(lens) == exp_lens + [POISON, POISON]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["prefill", "mixed"])
def test_gather_lens_random(device, impl, kind):
    for seed in range(4):
        b = make_batch(kind, 20 + seed)
        qsl, seq, _ = tensors(b, device)
        for window in (1, 128):
            with impl_ctx(impl, device):
                got = d.compute_prefill_gather_lens(seq, qsl, b["nd"], b["np"], window)
            assert L(got) == o_gather_lens(b["seq"], b["qsl"], b["nd"], b["np"], window)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bt_dtype", [torch.int32, torch.int64])
def test_decode_flatten_random(device, impl, bt_dtype):
    rnd = random.Random(5)
    for seed in range(3):
        nd = rnd.randint(1, 6)
        L_ = rnd.randint(1, 3)
        seq = [rnd.choice([0, rnd.randint(0, 3), rnd.randint(3, 9000)]) for _ in range(nd)]
        width = rnd.randint(3, 9)
        bt = [[rnd.randint(-5, 900) for _ in range(width)] for _ in range(nd)]
        ew = rnd.choice([width - 2, width, width + 3])
        n = nd * L_
        bt_t = torch.tensor(bt, dtype=bt_dtype, device=device)
        dsl, ebt, dl = poisoned((n + 1,), device), poisoned((n + 1, ew), device, bt_dtype), poisoned((n + 1,), device)
        with impl_ctx(impl, device):
            d.prepare_uniform_decode(i32(seq, device), dsl, bt_t, ebt, dl, L_, n)
        e_dsl, e_ebt, e_dl = o_uniform(seq, bt, L_, n, ew)
        assert L(dsl) == e_dsl + [POISON] and L(dl) == e_dl + [POISON] and L(ebt)[:n] == e_ebt
        # ragged: lengths 0..L per request, 0..2 padding rows
        dls = [rnd.randint(0, 3) for _ in range(nd)]
        qsl = [0]
        for x in dls:
            qsl.append(qsl[-1] + x)
        seq = [s + x for s, x in zip(seq, dls)]
        n = qsl[-1] + rnd.randint(0, 2)
        dsl, ebt, dl, di = (poisoned((n + 1,), device), poisoned((n + 1, ew), device, bt_dtype),
                            poisoned((n + 1,), device), poisoned((n + 1,), device))
        with impl_ctx(impl, device):
            d.prepare_varlen_decode(i32(qsl, device), i32(seq, device), bt_t, dsl, ebt, dl, di, nd, n)
        e_dsl, e_ebt, e_dl, e_di = o_varlen(qsl, seq, bt, nd, n, ew)
        assert L(dsl) == e_dsl + [POISON] and L(dl) == e_dl + [POISON] and L(di) == e_di + [POISON]
        assert L(ebt)[:n] == e_ebt


PREFILL_CHUNK_DCP = [(0, 1, 1), (1, 2, 1), (0, 4, 8), (3, 4, 8)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dcp", PREFILL_CHUNK_DCP)
def test_prefill_chunk_random(device, impl, dcp):
    """Random chunks of random batches, then two chunks that are whole batches of 4-7 requests (every request's
    rows and token_to_seq entries)."""
    rnd = random.Random(hash(dcp) % 1000)
    for seed in range(6):
        whole = seed >= 4
        R = rnd.randint(4 if whole else 1, 7)
        qlens = [rnd.choice([0, 1, rnd.randint(1, 30)]) for _ in range(R)]
        useq = [q + rnd.randint(0, 500) for q in qlens]
        ratio = rnd.choice([4, 128])
        comp = [u // ratio for u in useq]
        comp[rnd.randrange(R)] = -3          # a hostile length counts as 0
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        start = 0 if whole else rnd.randint(0, R - 1)
        end = R if whole else rnd.randint(start, R)
        nq = qsl[end] - qsl[start]
        qs0 = 0 if whole else rnd.randint(0, nq)
        qs1 = nq if whole else rnd.randint(qs0, nq)
        slack = rnd.randint(17, 40) if whole else rnd.randint(0, 3)
        total = sum(max(c, 0) for c in comp[start:end]) + slack   # a host upper bound
        cu, ks, ke, tts = o_chunk(qsl, useq, comp, start, end, qs0, qs1, ratio, *dcp, tts_len=total)
        bufs = (poisoned((end - start + 2,), device), poisoned((qs1 - qs0 + 1,), device),
                poisoned((qs1 - qs0 + 1,), device), poisoned((total,), device))
        with impl_ctx(impl, device):
            d.fill_prefill_chunk_metadata(i32(qsl, device), i32(useq, device), i32(comp, device), start, end, qs0,
                                          qs1, ratio, *dcp, *bufs)
        if end > start:
            assert L(bufs[0]) == cu + [POISON]
            assert L(bufs[1]) == ks + [POISON] and L(bufs[2]) == ke + [POISON]
            assert L(bufs[3]) == tts
        else:   # no request: nothing written
            assert all(v == POISON for buf in bufs for v in L(buf))


@pytest.mark.parametrize("impl", IMPLS)
def test_token_metadata_worked_example(device, impl):
    """qsl [0,2,2,5] (request 1 empty), T_pad 7: rows 5 and 6 are padding (request 0, slot -1)."""
    t2r, valid = poisoned((8,), device), torch.zeros(8, dtype=torch.bool, device=device)
    slots = torch.tensor([10, 11, -1, 40, 41, -1, -1], device=device)
    with impl_ctx(impl, device):
        d.prepare_token_metadata(i32([0, 2, 2, 5], device), slots, t2r, valid)
    assert L(t2r) == [0, 0, 2, 2, 2, 0, 0, POISON]
    assert L(valid) == [True, True, False, True, True, False, False, False]


@pytest.mark.parametrize("impl", IMPLS)
def test_native_decode_worked_example(device, impl):
    """L 2, ratio 4: seq [10, 1, 0] -> contexts [9,10], [0,1], [0,0] -> compressed [2,2], [0,0], [0,0];
    query lengths [2, 1, 0]."""
    dl, dsl = poisoned((4,), device), poisoned((7,), device)
    with impl_ctx(impl, device):
        d.prepare_native_decode(i32([0, 2, 3, 3], device), i32([10, 1, 0], device), dl, dsl, 3, 2, 4)
    assert L(dl) == [2, 1, 0, POISON]
    assert L(dsl) == [2, 2, 0, 0, 0, 0, POISON]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_token_and_native_random(device, impl, kind):
    for seed in range(3):
        b = make_batch(kind, 40 + seed, max_ctx=70000)
        qsl, seq, _ = tensors(b, device)
        rnd = random.Random(seed)
        pad = rnd.randint(0, 300)
        slots = [rnd.choice([-1, rnd.randint(0, 10**6)]) for _ in range(b["T"] + pad)]
        t2r, valid = poisoned((len(slots) + 1,), device), torch.zeros(len(slots) + 1, dtype=torch.bool,
                                                                      device=device)
        slot_t = torch.tensor(slots, dtype=torch.int64 if seed % 2 else torch.int32, device=device)
        with impl_ctx(impl, device):
            d.prepare_token_metadata(qsl, slot_t, t2r, valid)
        e_t2r, e_valid = o_token_metadata(b["qsl"], slots)
        assert L(t2r) == e_t2r + [POISON]
        assert L(valid) == e_valid + [False]
        nd, L_ = b["nd"], rnd.randint(1, 4)
        for ratio in (1, 4, 128):
            dl, dsl = poisoned((nd + 1,), device), poisoned((nd * L_ + 1,), device)
            with impl_ctx(impl, device):
                d.prepare_native_decode(qsl, seq, dl, dsl, nd, L_, ratio)
            e_dl, e_dsl = o_native(b["qsl"], b["seq"], nd, L_, ratio)
            assert L(dl) == e_dl + [POISON] and L(dsl) == e_dsl + [POISON]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("noncausal", [False, True])
def test_swa_decode_worked_example(device, impl, noncausal):
    """SPEC §3.4's SWA example as the builder's fused decode step: window 4, bs 4, seq 10, q 3,
    bt [5,9,2]; one padding token (slot -1); lens tail zeroed; rows past ndt untouched."""
    W = 4 if not noncausal else 8
    idx, lens = poisoned((5, 1, W), device), poisoned((6,), device)
    t2r, valid = poisoned((5,), device), torch.zeros(5, dtype=torch.bool, device=device)
    slots = torch.tensor([37, 38, 39, -1], device=device)
    with impl_ctx(impl, device):
        d.prepare_swa_decode(idx, lens, t2r, valid, 4, i32([0, 3], device), i32([10], device), slots,
                             i32([[5, 9, 2]], device), 4, 3, noncausal)
    if noncausal:   # start = max(7 - 4, 0) = 3, n = min(10 - 3, 8) = 7: positions 3..9
        row = [23, 36, 37, 38, 39, 8, 9, -1]
        assert L(idx.view(5, W))[:3] == [row] * 3 and L(lens) == [7, 7, 7, 0, 0, 0]
    else:
        assert L(idx.view(5, W))[:3] == [[36, 37, 38, 39], [37, 38, 39, 8], [38, 39, 8, 9]]
        assert L(lens) == [4, 4, 4, 0, 0, 0]
    assert L(idx.view(5, W))[3:] == [[POISON] * W] * 2
    assert L(t2r) == [0, 0, 0, 0, POISON] and L(valid) == [True, True, True, False, False]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["decode", "mixed", "prefill"])
@pytest.mark.parametrize("noncausal", [False, True])
def test_swa_decode_random(device, impl, kind, noncausal):
    """The fused op equals token metadata + SWA rows of the first ndt tokens + a zeroed lens tail."""
    for seed in range(3):
        b = make_batch(kind, 60 + seed, bs=16, bt_dtype=torch.int64 if seed == 1 else torch.int32, max_ctx=300)
        qsl, seq, bt = tensors(b, device)
        rnd = random.Random(seed)
        slots = [rnd.choice([-1, rnd.randint(0, 10**5)]) for _ in range(b["T"] + rnd.randint(0, 5))]
        ndt = b["qsl"][b["nd"]]
        window, W = 24, (64 if noncausal else 28)
        idx, lens = poisoned((ndt + 2, W), device), poisoned((len(slots) + 7,), device)
        t2r, valid = poisoned((len(slots),), device), torch.zeros(len(slots), dtype=torch.bool, device=device)
        slot_t = torch.tensor(slots, dtype=torch.int64, device=device)
        with impl_ctx(impl, device):
            d.prepare_swa_decode(idx, lens, t2r, valid, window, qsl, seq, slot_t, bt, 16, ndt, noncausal)
        e_t2r, e_valid = o_token_metadata(b["qsl"], slots)
        e_idx, e_lens = o_swa(ndt, W, window, b["qsl"], b["seq"], e_t2r, e_valid, b["bt"], 16, 0, noncausal)
        assert L(t2r) == e_t2r and L(valid) == e_valid
        assert L(idx)[:ndt] == e_idx and L(idx)[ndt:] == [[POISON] * W] * 2
        assert L(lens) == e_lens + [0] * (len(slots) + 7 - ndt)


@pytest.fixture
def small_tiles():
    """SEARCH 1, ROW_BLOCK 16 and column tiles of 4: the random batches (a few requests, tens of rows, 3-64
    columns) then walk every kernel's request-search, row and column loops past their first step, which otherwise
    only batches of more than 256 requests or rows and rows of more than 1024 columns take."""
    from torch_dsv4_ops.kernels import sparse_index
    from torch_dsv4_ops.ops import metadata as ops

    with patched_constants(kernels, [ops._PLANS], SEARCH=1, ROW_BLOCK=16), \
            patched_constants(sparse_index, MIN_BLOCK=4, MAX_BLOCK=4):
        yield


SMALL_TILE_RUNS = {
    "slot_mapping": lambda dev: test_slot_mapping_random(dev, "kernel", "mixed", 4, 64),
    "swa": lambda dev: test_swa_random(dev, "kernel", "mixed", True),
    "gather_lens": lambda dev: test_gather_lens_random(dev, "kernel", "mixed"),
    "decode_flatten": lambda dev: test_decode_flatten_random(dev, "kernel", torch.int32),
    "prefill_chunk": lambda dev: [test_prefill_chunk_random(dev, "kernel", dcp) for dcp in PREFILL_CHUNK_DCP],
    "token_and_native": lambda dev: test_token_and_native_random(dev, "kernel", "mixed"),
    "swa_decode": lambda dev: test_swa_decode_random(dev, "kernel", "mixed", False),
}


@pytest.mark.parametrize("name", list(SMALL_TILE_RUNS))
def test_random_with_small_tiles(device, small_tiles, name):
    """The random tests' kernel runs with small tiles (`small_tiles`): equal to the oracle as with the real ones."""
    SMALL_TILE_RUNS[name](device)


# === hostile indices (§4 b): the documented result, no access outside the tensors ======================
@pytest.mark.parametrize("impl", IMPLS)
def test_hostile_tables_and_requests(device, impl):
    """Table entries < 0, INT32-overflowing slots, columns past the width, requests past the table or
    seq_lens, token ids past R: -1 / 0, and the table untouched."""
    big = 2**30
    bt = i32([[-1, big, 3], [-(2**31), 2, -7]], device)
    before = bt.clone()
    qsl, seq = i32([0, 2, 4, 6], device), i32([9000, 5, 130], device)
    with impl_ctx(impl, device):
        out = d.get_compressed_slot_mapping(6, qsl, seq, bt, 64, 4)
        idx, lens = poisoned((7, 8), device), poisoned((7,), device)
        t2r = i32([0, 0, 1, 1, 2, -5, 2**31 - 1], device)
        d.compute_swa_indices_and_lens(idx, lens, 8, qsl, seq, t2r, torch.ones(7, dtype=torch.bool, device=device),
                                       bt, 64)
    assert L(out) == o_slot_mapping(6, [0, 2, 4, 6], [9000, 5, 130], L(before), 64, 4, 6)
    e_idx, e_lens = o_swa(7, 8, 8, [0, 2, 4, 6], [9000, 5, 130], L(t2r), [True] * 7, L(before), 64, 0)
    assert L(idx) == e_idx and L(lens) == e_lens
    assert e_lens[5:] == [0, 0] and e_idx[2][0] == -1          # request 2 has no table row
    assert torch.equal(bt, before)


# === bad input: ValueError naming the argument, buffers untouched ========================================
def _bad_cases(dev):
    qsl, seq, bt = i32([0, 2], dev), i32([5], dev), i32([[1, 2]], dev)
    ok = torch.ones(2, dtype=torch.bool, device=dev)
    idx, lens = torch.zeros(2, 8, dtype=torch.int32, device=dev), torch.zeros(2, dtype=torch.int32, device=dev)
    return [
        ("out", lambda: d.get_compressed_slot_mapping(2, qsl, seq, bt, 64, 4,
                                                      out=torch.zeros(2, dtype=torch.int32, device=dev))),
        ("block_table", lambda: d.get_compressed_slot_mapping(2, qsl, seq, bt[0], 64, 4)),
        ("compress_ratio", lambda: d.get_compressed_slot_mapping(2, qsl, seq, bt, 64, 0)),
        ("swa_indices", lambda: d.compute_swa_indices_and_lens(idx.long(), lens, 8, qsl, seq, i32([0, 0], dev),
                                                               ok, bt, 64)),
        ("W", lambda: d.compute_swa_indices_and_lens(idx, lens, 16, qsl, seq, i32([0, 0], dev), ok, bt, 64)),
        ("token_to_req_indices", lambda: d.compute_swa_indices_and_lens(idx, lens, 8, qsl, seq, i32([0, 0], dev),
                                                                        ok, bt, 64, 1)),
        ("is_valid_token", lambda: d.compute_swa_indices_and_lens(idx, lens, 8, qsl, seq, i32([0, 0], dev),
                                                                  ok.int(), bt, 64)),
        ("swa_lens", lambda: d.compute_swa_indices_and_lens(idx, lens[:1], 8, qsl, seq, i32([0, 0], dev), ok, bt,
                                                            64)),
        ("query_start_loc", lambda: d.compute_prefill_gather_lens(seq, qsl, 1, 1, 128)),
        ("out", lambda: d.compute_prefill_gather_lens(seq, qsl, 0, 1, 128, out=lens[:0])),
        ("block_table", lambda: d.prepare_uniform_decode(i32([5, 6], dev), lens, bt, idx, lens, 1, 2)),
        ("max_decode_len", lambda: d.prepare_uniform_decode(seq, lens, bt, idx, lens, 0, 2)),
        ("decode_indices", lambda: d.prepare_varlen_decode(qsl, seq, bt, lens, idx, lens, lens[:1], 1, 2)),
        ("num_decodes", lambda: d.prepare_varlen_decode(qsl, seq, bt, lens, idx, lens, lens, 2, 2)),
        ("cu_seq_lens", lambda: d.fill_prefill_chunk_metadata(qsl, seq, seq, 0, 1, 0, 2, 4, 0, 1, 1, lens[:1], lens,
                                                              lens, lens)),
        ("dcp_rank", lambda: d.fill_prefill_chunk_metadata(qsl, seq, seq, 0, 1, 0, 2, 4, 2, 2, 1, lens, lens, lens,
                                                           lens)),
        ("query_end", lambda: d.fill_prefill_chunk_metadata(qsl, seq, seq, 0, 1, 2, 1, 4, 0, 1, 1, lens, lens, lens,
                                                            lens)),
        ("cu_seqlen_ks", lambda: d.fill_prefill_chunk_metadata(qsl, seq, seq, 0, 1, 0, 2, 4, 0, 1, 1, lens,
                                                               lens[:1], lens, lens)),
        ("is_valid_token", lambda: d.prepare_token_metadata(qsl, i32([1, 2, 3], dev), i32([0] * 3, dev), ok)),
        ("token_to_req_indices", lambda: d.prepare_token_metadata(qsl, i32([1, 2], dev), lens.long(), ok)),
        ("decode_seq_lens", lambda: d.prepare_native_decode(qsl, seq, lens, lens[:1], 1, 2, 4)),
        ("compress_ratio", lambda: d.prepare_native_decode(qsl, seq, lens, lens, 1, 2, 0)),
        ("num_decodes", lambda: d.prepare_native_decode(qsl, seq, lens, lens, 2, 1, 4)),
        ("num_decode_tokens", lambda: d.prepare_swa_decode(idx, lens, i32([0, 0], dev), ok, 8, qsl, seq,
                                                           i32([1, 2], dev), bt, 64, 3)),
        ("W", lambda: d.prepare_swa_decode(idx, lens, i32([0, 0], dev), ok, 16, qsl, seq, i32([1, 2], dev), bt,
                                           64, 2)),
        ("swa_lens", lambda: d.prepare_swa_decode(idx, lens.long(), i32([0, 0], dev), ok, 8, qsl, seq,
                                                  i32([1, 2], dev), bt, 64, 2)),
    ]


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_input_raises_naming_the_argument(device, impl):
    for name, call in _bad_cases(device):
        with impl_ctx(impl, device), pytest.raises(ValueError, match=name):
            call()


# === opcheck, compile, graphs =============================================================================
def opcheck_cases(dev):
    b = make_batch("mixed", 3, bs=16)
    qsl, seq, bt = tensors(b, dev)
    T = b["T"]
    t2r, valid = i32(b["t2r"], dev), torch.tensor(b["valid"], device=dev)
    nd = b["nd"]
    z = lambda *s: torch.zeros(*s, dtype=torch.int32, device=dev)  # noqa: E731
    return {
        "get_compressed_slot_mapping": (T, qsl, seq, bt, 16, 4),
        "get_compressed_slot_mapping_out": (T, qsl, seq, bt, 16, 4, torch.zeros(T + 2, dtype=torch.int64,
                                                                                   device=dev)),
        "compute_swa_indices_and_lens": (z(T, 1, 24), z(T), 24, qsl, seq, t2r, valid, bt, 16, 0),
        "compute_dspark_noncausal_swa_indices_and_lens": (z(T, 64), z(T), 24, qsl, seq, t2r, valid, bt, 16, 0),
        "compute_prefill_gather_lens": (seq, qsl, nd, b["np"], 128),
        "compute_prefill_gather_lens_out": (seq, qsl, nd, b["np"], 128, z(b["np"] + 1)),
        "prepare_uniform_decode": (seq, z(2 * nd), bt, z(2 * nd, 30), z(2 * nd), 2, 2 * nd),
        "prepare_varlen_decode": (qsl, seq, bt, z(T + 1), z(T + 1, 30), z(T + 1), z(T + 1), nd, b["qsl"][nd] + 1),
        "fill_prefill_chunk_metadata": (qsl, seq, seq // 4, nd, nd + b["np"], 0, T - b["qsl"][nd], 4, 0, 1, 1,
                                        z(b["np"] + 1), z(T), z(T), z(sum(s // 4 for s in b["seq"][nd:]))),
        "prepare_token_metadata": (qsl, torch.arange(-3, T + 2, device=dev), z(T + 6),
                                   torch.zeros(T + 5, dtype=torch.bool, device=dev)),
        "prepare_native_decode": (qsl, seq, z(nd + 1), z(2 * nd), nd, 2, 4),
        "prepare_swa_decode": (z(T, 1, 24), z(T + 3), z(T + 1), torch.zeros(T + 1, dtype=torch.bool, device=dev), 24,
                               qsl, seq, torch.arange(-3, T - 2, device=dev), bt, 16, b["qsl"][nd]),
    }


@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck(device, impl):
    for name, args in opcheck_cases(device).items():
        with impl_ctx(impl, device):
            run_opcheck(getattr(OPS, name).default, args)


def test_compile_no_recompile(device):
    """fullgraph + dynamic over T in {7, 13, 17}: one graph for all twelve registrations, no new Triton
    compilations."""
    def step(qsl, seq, t2r, valid, bt, idx, lens, slots, dsl, ebt, dl, di, cu, ks, ke, tts):
        T = t2r.shape[0]
        d.prepare_token_metadata(qsl, slots, di, valid.clone())
        d.prepare_native_decode(qsl, seq, dl, dsl, 2, 1, 4)
        d.prepare_swa_decode(idx, lens, di, valid.clone(), 8, qsl, seq, slots, bt, 4, 3)
        s = d.get_compressed_slot_mapping(T, qsl, seq, bt, 4, 4)
        d.get_compressed_slot_mapping(T, qsl, seq, bt, 4, 4, out=slots)
        d.compute_swa_indices_and_lens(idx, lens, 8, qsl, seq, t2r, valid, bt, 4)
        d.compute_dspark_noncausal_swa_indices_and_lens(idx, lens, 8, qsl, seq, t2r, valid, bt, 4)
        g = d.compute_prefill_gather_lens(seq, qsl, 0, 2, 8)
        d.compute_prefill_gather_lens(seq, qsl, 0, 2, 8, out=cu)
        d.prepare_varlen_decode(qsl, seq, bt, dsl, ebt, dl, di, 2, T)
        d.prepare_uniform_decode(seq, dsl, bt, ebt, dl, 1, 2)
        d.fill_prefill_chunk_metadata(qsl, seq, seq, 0, 2, 0, T, 4, 0, 1, 1, cu, ks, ke, tts)
        return s, g

    inputs = []
    for n in (7, 13, 17):
        g = torch.Generator().manual_seed(n)
        z = lambda *s: torch.zeros(*s, dtype=torch.int32)  # noqa: E731
        args = (i32([0, 3, n]), i32([5, n + 9]), torch.tensor([0] * 3 + [1] * (n - 3), dtype=torch.int32),
                torch.rand(n, generator=g) > 0.2, torch.randint(-1, 99, (2, 9), generator=g, dtype=torch.int32),
                z(n, 8), z(n), torch.zeros(n, dtype=torch.int64), z(n), z(n, 9), z(n), z(n), z(3), z(n), z(n),
                z((n + 14) // 4 + 1))
        inputs.append(tuple(a.to(device) for a in args))
    counted = device.type == "cuda"
    ks_ = tuple(launcher.fn for launcher in kernels.LAUNCHERS.values()) if counted else ()
    before = [triton_cache_entries(k) for k in ks_]
    check_compile(step, inputs)
    if counted:   # one specialisation per kernel for all token counts (swa_kernel: causal and DSpark)
        allowed = {kernels.SWA_LAUNCHER.fn: 2}
        grown = {k.__name__: triton_cache_entries(k) - b for k, b in zip(ks_, before)
                 if triton_cache_entries(k) - b > allowed.get(k, 1)}
        assert not grown, f"new Triton compilations across token counts: {grown}"


@pytest.mark.gpu
def test_cuda_graph_replay_new_metadata():
    """Every metadata op captured once (decode-sized step), replayed with new values in the same buffers."""
    dev = torch.device("cuda")

    def inputs(seed):
        b = make_batch("mixed", seed, bs=16, width=40)
        b2 = make_batch("mixed", 7, bs=16, width=40)     # the shapes of seed 7's batch, new values
        rnd = random.Random(seed)
        qsl = torch.tensor(b2["qsl"], dtype=torch.int32)
        perm = qsl.clone()
        perm[1:-1] = torch.tensor(sorted(rnd.randint(0, b2["T"]) for _ in range(len(b2["qsl"]) - 2)))
        seq = torch.tensor([rnd.randint(0, 600) for _ in b2["seq"]], dtype=torch.int32)
        t2r = torch.tensor([rnd.randint(-1, len(b2["seq"])) for _ in range(b2["T"])], dtype=torch.int32)
        valid = torch.tensor([rnd.random() > 0.2 for _ in range(b2["T"])])
        bt = torch.tensor([[rnd.randint(-1, 900) for _ in range(40)] for _ in b2["bt"]], dtype=torch.int32)
        del b
        return tuple(x.to(dev) for x in (perm, seq, t2r, valid, bt))

    static = inputs(7)
    T, R = static[2].shape[0], static[1].shape[0]
    z = lambda *s: torch.zeros(*s, dtype=torch.int32, device=dev)  # noqa: E731
    bufs = (torch.zeros(T + 4, dtype=torch.int64, device=dev), z(T, 1, 24), z(T), z(T, 64), z(T), z(R),
            z(2 * R), z(2 * R, 48), z(2 * R), z(T + 2), z(T + 2, 48), z(T + 2), z(T + 2), z(R + 1), z(T), z(T), z(4000))

    def step(qsl, seq, t2r, valid, bt, slots, idx, lens, nidx, nlens, gl, dsl, ebt, dl, vdsl, vebt, vdl, vdi, cu, ks,
             ke, tts):
        d.get_compressed_slot_mapping(T, qsl, seq, bt, 16, 4, out=slots)
        d.compute_swa_indices_and_lens(idx, lens, 24, qsl, seq, t2r, valid, bt, 16)
        d.compute_dspark_noncausal_swa_indices_and_lens(nidx, nlens, 24, qsl, seq, t2r, valid, bt, 16)
        d.compute_prefill_gather_lens(seq, qsl, 0, R, 128, out=gl)
        d.prepare_uniform_decode(seq, dsl, bt, ebt, dl, 2, 2 * R)
        d.prepare_varlen_decode(qsl, seq, bt, vdsl, vebt, vdl, vdi, R, T + 2)
        d.fill_prefill_chunk_metadata(qsl, seq, seq // 4, 0, R, 0, T, 4, 0, 1, 1, cu, ks, ke, tts)
        d.prepare_token_metadata(qsl, slots[:T], vdi, valid.clone())
        d.prepare_native_decode(qsl, seq, dl, dsl, R, 2, 4)
        d.prepare_swa_decode(idx, lens, vdi, valid.clone(), 24, qsl, seq, slots[:T], bt, 16, T)

    check_cuda_graph(step, static + bufs, [inputs(s) + tuple(torch.zeros_like(x) for x in bufs) for s in (8, 9)])


@pytest.mark.gpu
def test_sync_free():
    check_sync_free(opcheck_cases(torch.device("cuda")))


@pytest.mark.gpu
def test_large_batch_exactness():
    """Benchmark-sized batches (256 MTP decodes, 4 prefills of 2048) on the GPU against the CPU reference."""
    dev = torch.device("cuda")
    rnd = random.Random(0)
    qlens = [2] * 256 + [2048] * 4
    seq = [rnd.randint(2, 65536) for _ in range(256)] + [rnd.randint(2048, 65536) for _ in range(4)]
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    T = qsl[-1]
    bt = torch.randint(-1, 100000, (260, 1024), dtype=torch.int32)
    t2r = torch.repeat_interleave(torch.arange(260, dtype=torch.int32), torch.tensor(qlens))
    valid = torch.rand(T) > 0.05
    cpu = (i32(qsl), i32(seq), t2r, valid, bt)
    gpu = tuple(x.to(dev) for x in cpu)
    outs = {}
    for name, args, ctx in (("cpu", cpu, d.cpu_implementation("reference")), ("gpu", gpu, contextlib.nullcontext())):
        q, s, t, v, b = args
        with ctx:
            slots = d.get_compressed_slot_mapping(T, q, s, b, 64, 4)
            idx = torch.zeros(T, 1, 128, dtype=torch.int32, device=q.device)
            lens = torch.zeros(T, dtype=torch.int32, device=q.device)
            d.compute_swa_indices_and_lens(idx, lens, 128, q, s, t, v, b, 64)
            dsl = torch.zeros(512, dtype=torch.int32, device=q.device)
            ebt = torch.zeros(512, 1024, dtype=torch.int32, device=q.device)
            dl = torch.zeros(512, dtype=torch.int32, device=q.device)
            d.prepare_uniform_decode(s, dsl, b, ebt, dl, 2, 512)
        outs[name] = (slots, idx, lens, dsl, ebt, dl)
    for a, e in zip(outs["gpu"], outs["cpu"]):
        assert_bitwise_equal(a.cpu(), e)
