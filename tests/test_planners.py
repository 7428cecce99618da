"""Host planners (SPEC §3.5) and the host widths of §3.4 (DSpark) and §3.6.2.

Every worked example of SPEC §3.5 and the DSpark width examples of §3.4 are literal tests; each
planner is checked against an independent plain-Python oracle (below, written from the SPEC text
by brute force) on random batches, and its output against the invariants it promises.
"""
import random
from types import SimpleNamespace

import pytest
import torch

from torch_dsv4_ops.metadata import (get_dspark_swa_index_width, get_max_prefill_buffer_size,
                                     get_prefill_chunk_plan, split_decodes_and_prefills,
                                     split_indexer_prefill_chunks)

CASES = 200


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def batch(qsl, is_prefilling=None, max_query_len=None, num_actual_tokens=None):
    q = [b - a for a, b in zip(qsl, qsl[1:])]
    return SimpleNamespace(
        query_start_loc_cpu=i32(qsl),
        max_query_len=max(q, default=0) if max_query_len is None else max_query_len,
        num_actual_tokens=qsl[-1] if num_actual_tokens is None else num_actual_tokens,
        is_prefilling=None if is_prefilling is None else torch.tensor(is_prefilling, dtype=torch.bool))


def sl(a, b):
    return slice(a, b)


# --- the independent oracles (plain Python over lists, brute force from the SPEC text) ------------
def o_split(qsl, max_query_len, T, is_prefilling, thr, uniform, short):
    """Classify every request, then cut at the first prefill (the split is positional)."""
    R = len(qsl) - 1
    if R == 0:
        return (0, 0, 0, 0)
    all_decodes, all_prefills = (R, 0, T, 0), (0, R, 0, T)
    q = [qsl[r + 1] - qsl[r] for r in range(R)]
    if short and max_query_len <= thr and (thr <= 1 or not uniform):
        return all_decodes
    if q[0] > thr:
        return all_prefills
    if uniform and short and set(q) <= {q[0], 0}:
        return all_decodes
    for r in range(R):
        prefill = (q[r] != q[0]) if uniform else (q[r] > thr)
        if prefill or (not short and is_prefilling[r]):
            return (r, R - r, qsl[r], T - qsl[r])
    return all_decodes


def o_indexer_chunks(seq, q, ws, max_bytes, offset):
    """Each chunk takes the longest run of requests that fits (both limits grow with the run), or one."""
    E, out, s, n = max_bytes // 4, [], 0, len(seq)
    while s < n:
        fits = [e for e in range(s + 1, n + 1) if sum(seq[s:e]) <= ws and sum(q[s:e]) * sum(seq[s:e]) <= E]
        e = max(fits, default=s + 1)
        K, M = sum(seq[s:e]), sum(q[s:e])
        step = max(1, M) if K == 0 else max(1, E // K)
        pieces = -(-M // step)
        out += [(slice(s + offset, e + offset), slice(j * step, min(M, (j + 1) * step))) for j in range(pieces)]
        s = e
    return out


def o_chunk_plan(seq, q, window, mml, mnbt, ratio, chunk_size):
    """Each chunk is the longest run [cs, ce) whose area (ce-cs) * (max comp + max gath) fits, or one request."""
    comp_len = -(-mml // ratio) if ratio > 1 else 0
    cap = chunk_size * (comp_len + window + mnbt)
    gath = [qq + min(window - 1, max(0, s - qq)) for s, qq in zip(seq, q)]
    comp = [s // ratio if ratio > 1 else 0 for s in seq]
    out, cs = [], 0
    while cs < len(seq):
        fits = [ce for ce in range(cs + 1, len(seq) + 1)
                if (ce - cs) * (max(comp[cs:ce]) + max(gath[cs:ce])) <= cap]
        ce = max(fits, default=cs + 1)
        out.append((cs, ce, max(comp[cs:ce]), max(comp[cs:ce]) + max(gath[cs:ce])))
        cs = ce
    return out


# --- SPEC §3.4: DSpark width; §3.6.2: prefill buffer ------------------------------------------------
@pytest.mark.parametrize("window, num_spec, width", [(128, 5, 192), (512, 5, 576), (1024, 0, 1024), (8, 4, 64),
                                                     (0, 0, 0), (-3, 70, 128), (64, -2, 64)])
def test_dspark_swa_index_width(window, num_spec, width):
    assert get_dspark_swa_index_width(window, num_spec) == width


def test_max_prefill_buffer_size():
    assert get_max_prefill_buffer_size(1024) == 40960
    assert get_max_prefill_buffer_size(0) == 0


# --- split_decodes_and_prefills ------------------------------------------------------------------
def test_split_spec_example():
    b = batch([0, 1, 3, 4, 104])                       # q = 1, 2, 1, 100
    assert split_decodes_and_prefills(b, 2) == (3, 1, 4, 100)
    assert split_decodes_and_prefills(b, 2, require_uniform=True) == (1, 3, 1, 103)


@pytest.mark.parametrize("qsl, thr, uniform, short, is_prefilling, expected", [
    ([0], 1, False, True, None, (0, 0, 0, 0)),                                 # empty batch
    ([0], 2, True, False, [], (0, 0, 0, 0)),
    ([0, 1, 2, 3], 1, False, True, None, (3, 0, 3, 0)),                        # decode-only
    ([0, 5, 6], 1, False, True, None, (0, 2, 0, 6)),                           # first request is a prefill
    ([0, 1, 2, 3], 1, False, False, [False, True, False], (1, 2, 1, 2)),       # is_prefilling marks request 1
    ([0, 1, 2, 3], 1, False, False, [False, False, False], (3, 0, 3, 0)),
    ([0, 2, 4, 4], 2, True, True, None, (3, 0, 4, 0)),                         # uniform with a qlen-0 pad
    ([0, 2, 2, 4], 2, True, True, None, (3, 0, 4, 0)),
    ([0, 2, 3, 5], 2, True, True, None, (1, 2, 2, 3)),                         # 1 != 2: positional split
    ([0, 2, 3, 5], 2, False, True, None, (3, 0, 5, 0)),
    ([0, 0, 1, 2], 1, True, True, None, (3, 0, 2, 0)),                         # thr <= 1: the first exit
    ([0, 0, 1, 2], 2, True, True, None, (1, 2, 0, 2)),                         # q[0] = 0 is the uniform length
    ([0, 1, 1, 9, 10], 1, False, True, None, (2, 2, 1, 9)),                    # qlen-0 pad before a prefill
])
def test_split_literal(qsl, thr, uniform, short, is_prefilling, expected):
    b = batch(qsl, is_prefilling)
    got = split_decodes_and_prefills(b, thr, require_uniform=uniform, treat_short_extends_as_decodes=short)
    assert got == expected
    assert all(type(v) is int for v in got)


def test_split_reads_batch_ints_not_qsl():
    # max_query_len and num_actual_tokens are taken from the batch as given
    assert split_decodes_and_prefills(batch([0, 1, 9], max_query_len=1, num_actual_tokens=12)) == (2, 0, 12, 0)
    assert split_decodes_and_prefills(batch([0, 1, 9], num_actual_tokens=12)) == (1, 1, 1, 11)


def test_split_accepts_lists():
    b = SimpleNamespace(query_start_loc_cpu=[0, 1, 3, 4, 104], max_query_len=100, num_actual_tokens=104,
                        is_prefilling=[False, False, True, False])
    assert split_decodes_and_prefills(b, 2, treat_short_extends_as_decodes=False) == (2, 2, 3, 101)


def _random_qsl(rng, thr):
    R = rng.choice([0, 1, 2, 3, 5, 8, 13])
    kind = rng.choice(["decode", "uniform", "prefill", "mixed", "random"])
    if kind == "decode":
        q = [rng.randint(0, thr) for _ in range(R)]
    elif kind == "uniform":
        L = rng.randint(0, thr + 1)
        q = [rng.choice([L, L, L, 0]) for _ in range(R)]
    elif kind == "prefill":
        q = [rng.randint(thr + 1, thr + 50) for _ in range(R)]
    elif kind == "mixed":
        nd = rng.randint(0, R)
        q = sorted(rng.randint(0, thr) for _ in range(nd)) + [rng.randint(0, 60) for _ in range(R - nd)]
    else:
        q = [rng.randint(0, 2 * thr + 1) for _ in range(R)]
    qsl = [0]
    for x in q:
        qsl.append(qsl[-1] + x)
    return qsl, q


def test_split_random_vs_oracle():
    rng = random.Random(1234)
    for _ in range(CASES):
        thr = rng.choice([0, 1, 1, 2, 3, 4])
        qsl, q = _random_qsl(rng, thr)
        uniform, short = rng.random() < 0.5, rng.random() < 0.5
        isp = [rng.random() < 0.2 or x > thr for x in q] if rng.random() < 0.5 else [rng.random() < 0.3 for x in q]
        b = batch(qsl, isp)
        got = split_decodes_and_prefills(b, thr, uniform, short)
        want = o_split(qsl, b.max_query_len, b.num_actual_tokens, isp, thr, uniform, short)
        assert got == want, (qsl, thr, uniform, short, isp)
        nd, np_, ndt, npt = got
        assert nd + np_ == len(q) and ndt + npt == b.num_actual_tokens


# --- split_indexer_prefill_chunks -----------------------------------------------------------------
@pytest.mark.parametrize("seq, q, ws, nbytes, expected", [
    ([100] * 3, [10] * 3, 1000, 5000, [(sl(0, 1), sl(0, 10)), (sl(1, 2), sl(0, 10)), (sl(2, 3), sl(0, 10))]),
    ([10] * 3, [5] * 3, 100, 10000, [(sl(0, 3), sl(0, 15))]),
    ([50] * 3, [1] * 3, 50, 10**6, [(sl(0, 1), sl(0, 1)), (sl(1, 2), sl(0, 1)), (sl(2, 3), sl(0, 1))]),
    ([10] * 3, [5] * 3, 100, 1000, [(sl(0, 2), sl(0, 10)), (sl(2, 3), sl(0, 5))]),
    ([1000, 50], [100, 5], 2000, 1000, [(sl(0, 1), sl(i, i + 1)) for i in range(100)] + [(sl(1, 2), sl(0, 5))]),
    ([0], [0], 100, 1000, []),
])
def test_indexer_chunks_spec_table(seq, q, ws, nbytes, expected):
    assert split_indexer_prefill_chunks(seq, q, ws, nbytes) == expected
    assert split_indexer_prefill_chunks(i32(seq), i32(q), ws, nbytes) == expected


def test_indexer_chunks_request_offset():
    assert split_indexer_prefill_chunks(i32([10] * 3), i32([5] * 3), 100, 1000, request_offset=7) == [
        (sl(7, 9), sl(0, 10)), (sl(9, 10), sl(0, 5))]
    assert split_indexer_prefill_chunks([], [], 100, 1000) == []


def check_indexer_chunks(chunks, seq, q, ws, nbytes, offset):
    """Every query token of every request exactly once, in order; limits hold except for lone oversized requests."""
    elems, tokens, prev = nbytes // 4, [], None
    for rs, qs in chunks:
        s, e = rs.start - offset, rs.stop - offset
        assert 0 <= s < e <= len(seq)
        assert prev is None or (s, e) == prev or s >= prev[1]
        prev = (s, e)
        chunk_tokens = [(r, j) for r in range(s, e) for j in range(q[r])]
        assert 0 <= qs.start < qs.stop <= len(chunk_tokens)
        tokens += chunk_tokens[qs]
        k = sum(seq[s:e])
        if e - s > 1:
            assert k <= ws and sum(q[s:e]) * k <= elems
        if e - s > 1 or k <= elems:
            assert (qs.stop - qs.start) * k <= elems or k == 0
    assert tokens == [(r, j) for r in range(len(seq)) for j in range(q[r])]


def test_indexer_chunks_random_vs_oracle():
    rng = random.Random(99)
    for _ in range(CASES):
        n = rng.choice([0, 1, 2, 3, 5, 8])
        seq = [rng.choice([0, rng.randint(0, 40), rng.randint(0, 400)]) for _ in range(n)]
        q = [rng.choice([0, 1, rng.randint(0, 30), rng.randint(0, 200)]) for _ in range(n)]
        ws = rng.choice([0, 50, 200, 1000, 10**6])
        nbytes = rng.choice([0, 3, 400, 4000, 40000, 4 * 10**6])
        offset = rng.choice([0, 0, 3])
        seq_arg = i32(seq) if rng.random() < 0.5 else seq
        got = split_indexer_prefill_chunks(seq_arg, i32(q), ws, nbytes, request_offset=offset)
        assert got == o_indexer_chunks(seq, q, ws, nbytes, offset), (seq, q, ws, nbytes, offset)
        check_indexer_chunks(got, seq, q, ws, nbytes, offset)


# --- get_prefill_chunk_plan -----------------------------------------------------------------------
def test_chunk_plan_spec_example():
    # cap = 4 * (1024/4 + 64 + 128) = 1792, gath = 67 each, comp = 20..36
    assert get_prefill_chunk_plan(i32([80, 96, 112, 128, 144]), i32([4] * 5), 64, 1024, 128, 4) == [(0, 5, 36, 103)]


def test_chunk_plan_literal():
    assert get_prefill_chunk_plan(i32([]), i32([]), 64, 1024, 128, 4) == []
    # cap = 1 * (0 + 4 + 8) = 12; gath = [8, 3, 4]; 2 * 8 > 12, then 2 * 4 <= 12
    assert get_prefill_chunk_plan([10, 3, 20], [5, 3, 1], 4, 100, 8, 1, prefill_chunk_size=1) == [
        (0, 1, 0, 8), (1, 3, 0, 4)]
    # a request alone over the cap (53 > 12) still forms its own chunk (Addition)
    assert get_prefill_chunk_plan([100, 2], [50, 1], 4, 100, 8, 1, prefill_chunk_size=1) == [
        (0, 1, 0, 53), (1, 2, 0, 2)]
    # ratio 128: cap = 1 * (cdiv(1000, 128) + 8 + 0) = 16; comp = [2, 1], gath = [3 + 7, 3 + 7]; 2 * 12 > 16
    assert get_prefill_chunk_plan([300, 200], [3, 3], 8, 1000, 0, 128, prefill_chunk_size=1) == [(0, 1, 2, 12),
                                                                                                (1, 2, 1, 11)]
    # the same with chunk size 2: cap = 32 >= 2 * (2 + 10)
    assert get_prefill_chunk_plan([300, 200], [3, 3], 8, 1000, 0, 128, prefill_chunk_size=2) == [(0, 2, 2, 12)]
    # exactly at the cap, which rounds max_model_len / ratio up: cap = 2 * (cdiv(1000, 128) + 2) = 20 = 2 * (2 + 8)
    assert get_prefill_chunk_plan([256, 1], [7, 1], 2, 1000, 0, 128, prefill_chunk_size=2) == [(0, 2, 2, 10)]


def check_chunk_plan(plan, seq, q, window, mml, mnbt, ratio, chunk_size):
    """Chunks partition [0, n); multi-request chunks satisfy the area bound with exact maxima."""
    cap = chunk_size * ((-(-mml // ratio) if ratio > 1 else 0) + window + mnbt)
    bounds = [0] + [ce for _, ce, _, _ in plan]
    assert [cs for cs, _, _, _ in plan] == bounds[:-1] and bounds[-1] == len(seq)
    for cs, ce, N, M in plan:
        assert cs < ce
        assert N == max((s // ratio if ratio > 1 else 0) for s in seq[cs:ce])
        assert M - N == max(qq + min(window - 1, max(0, s - qq)) for s, qq in zip(seq[cs:ce], q[cs:ce]))
        if ce - cs > 1:
            assert (ce - cs) * M <= cap


def test_chunk_plan_random_vs_oracle():
    rng = random.Random(7)
    for _ in range(CASES):
        n = rng.choice([0, 1, 2, 3, 5, 8, 12])
        seq = [rng.randint(0, 2000) for _ in range(n)]
        q = [rng.choice([0, 1, rng.randint(0, s), s]) if s else 0 for s in seq]
        window = rng.choice([1, 4, 64, 128])
        mml, mnbt = rng.choice([64, 256, 1000, 1024, 3000]), rng.choice([0, 8, 64, 256])
        ratio, chunk_size = rng.choice([1, 4, 128]), rng.choice([1, 2, 4, 8])
        got = get_prefill_chunk_plan(i32(seq), i32(q), window, mml, mnbt, ratio, chunk_size)
        assert got == o_chunk_plan(seq, q, window, mml, mnbt, ratio, chunk_size), (seq, q, window, mml, mnbt,
                                                                                   ratio, chunk_size)
        check_chunk_plan(got, seq, q, window, mml, mnbt, ratio, chunk_size)


# --- bad input ------------------------------------------------------------------------------------
def test_split_bad_input():
    ok = batch([0, 1, 2])
    with pytest.raises(ValueError, match="decode_threshold"):
        split_decodes_and_prefills(ok, -1)
    with pytest.raises(ValueError, match="decode_threshold"):
        split_decodes_and_prefills(ok, 1.0)
    with pytest.raises(ValueError, match="require_uniform"):
        split_decodes_and_prefills(ok, 1, require_uniform=1)
    with pytest.raises(ValueError, match="treat_short_extends_as_decodes"):
        split_decodes_and_prefills(ok, 1, treat_short_extends_as_decodes=None)
    with pytest.raises(ValueError, match="is_prefilling"):
        split_decodes_and_prefills(ok, 1, treat_short_extends_as_decodes=False)
    with pytest.raises(ValueError, match="is_prefilling"):
        split_decodes_and_prefills(batch([0, 1, 2], [True]), 1, treat_short_extends_as_decodes=False)
    with pytest.raises(ValueError, match="is_prefilling"):
        split_decodes_and_prefills(SimpleNamespace(**{**vars(ok), "is_prefilling": i32([0, 1])}), 1,
                                   treat_short_extends_as_decodes=False)
    for bad_qsl in (i32([]), i32([[0, 1]]), torch.tensor([0.0, 1.0]), [0, 2, 1], "0,1", torch.zeros(2, device="meta",
                                                                                                    dtype=torch.int32)):
        with pytest.raises(ValueError, match="query_start_loc_cpu"):
            split_decodes_and_prefills(SimpleNamespace(**{**vars(ok), "query_start_loc_cpu": bad_qsl}))
    with pytest.raises(ValueError, match="max_query_len"):
        split_decodes_and_prefills(SimpleNamespace(**{**vars(ok), "max_query_len": -1}))
    with pytest.raises(ValueError, match="num_actual_tokens"):
        split_decodes_and_prefills(SimpleNamespace(**{**vars(ok), "num_actual_tokens": torch.tensor(2)}))


@pytest.mark.parametrize("args, kwargs, name", [
    (([1, 2], [1], 10, 10), {}, "query_lens_cpu"),
    (([1, -2], [1, 1], 10, 10), {}, "seq_lens_cpu"),
    ((i32([[1, 2]]), [1, 1], 10, 10), {}, "seq_lens_cpu"),
    (([1, 2], [1.0, 1.0], 10, 10), {}, "query_lens_cpu"),
    (([1, 2], torch.tensor([True, False]), 10, 10), {}, "query_lens_cpu"),
    (([1, 2], [1, 1], -1, 10), {}, "workspace_size"),
    (([1, 2], [1, 1], 10, 10.0), {}, "max_logits_bytes"),
    (([1, 2], [1, 1], 10, 10), {"request_offset": -1}, "request_offset"),
])
def test_indexer_chunks_bad_input(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        split_indexer_prefill_chunks(*args, **kwargs)


@pytest.mark.parametrize("change, name", [
    ({"prefill_seq_lens_cpu": [1, 2, 3]}, "prefill_query_lens_cpu"),
    ({"prefill_seq_lens_cpu": torch.zeros(2, 1, dtype=torch.int32)}, "prefill_seq_lens_cpu"),
    ({"prefill_query_lens_cpu": [1, -1]}, "prefill_query_lens_cpu"),
    ({"window_size": 0}, "window_size"),
    ({"max_model_len": -1}, "max_model_len"),
    ({"max_num_batched_tokens": 1.5}, "max_num_batched_tokens"),
    ({"compress_ratio": -1}, "compress_ratio"),
    ({"prefill_chunk_size": 0}, "prefill_chunk_size"),
    ({"prefill_chunk_size": True}, "prefill_chunk_size"),
])
def test_chunk_plan_bad_input(change, name):
    kwargs = dict(prefill_seq_lens_cpu=[10, 20], prefill_query_lens_cpu=[1, 2], window_size=8, max_model_len=64,
                  max_num_batched_tokens=16, compress_ratio=4, prefill_chunk_size=4)
    with pytest.raises(ValueError, match=name):
        get_prefill_chunk_plan(**{**kwargs, **change})


def test_widths_bad_input():
    with pytest.raises(ValueError, match="window_size"):
        get_dspark_swa_index_width(128.0, 5)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        get_dspark_swa_index_width(128, None)
    with pytest.raises(ValueError, match="max_model_len"):
        get_max_prefill_buffer_size(-1)
    with pytest.raises(ValueError, match="max_model_len"):
        get_max_prefill_buffer_size("1024")


def test_non_cpu_tensor_is_refused():
    meta = torch.zeros(2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="seq_lens_cpu"):
        split_indexer_prefill_chunks(meta, [1, 1], 10, 10)
    with pytest.raises(ValueError, match="prefill_query_lens_cpu"):
        get_prefill_chunk_plan([1, 1], meta, 8, 64, 16, 4)
    b = batch([0, 1, 2])
    b.is_prefilling = torch.zeros(2, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match="is_prefilling"):
        split_decodes_and_prefills(b, 1, treat_short_extends_as_decodes=False)


def test_chunk_plan_ratio_0_and_1_have_no_compressed_part():
    """SWA-only layers (ratio 0 or 1): cap = 4 * (8 + 16) = 96; gath = [1 + 7, 2 + 7, 3 + 5]; comp = 0."""
    for ratio in (0, 1):
        assert get_prefill_chunk_plan([10, 20, 8], [1, 2, 3], 8, 64, 16, ratio) == [(0, 3, 0, 9)]
