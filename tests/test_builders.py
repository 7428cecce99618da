"""Metadata builders (SPEC §3.6) and `build_prefill_chunk_metadata` (SPEC §3.4).

The worked examples of SPEC §3.4 / §3.6 are literal tests. Both builders are compared with an
independent from-scratch reference build (plain Python over lists, written from the SPEC text; it
calls only the host planners) on random batches. Also: buffers keep their addresses, the batch is
never modified, bad batches raise ValueError naming the field without touching any buffer, and (GPU)
CUDA-graph replay for a new batch and builds under sync-debug "error".
"""
import contextlib
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import torch_dsv4_ops as d
from torch_dsv4_ops import platform
from torch_dsv4_ops.metadata import split_decodes_and_prefills, split_indexer_prefill_chunks
from torch_dsv4_ops.metadata.builders import IndexerMetadataBuilder, SWAMetadataBuilder
from torch_dsv4_ops.metadata.chunks import build_prefill_chunk_metadata
from torch_dsv4_ops.metadata.types import BatchDescription
from torch_dsv4_ops.testing import as_list, i32, oracle_lookup, sync_debug_error

I32MAX = 2**31 - 1
CASES = 50


L = as_list


def reference_ops(device):
    """CPU tensors run the pure-torch reference unless a test asks for the interpreter."""
    return d.cpu_implementation("reference") if device.type == "cpu" else contextlib.nullcontext()


def triton_ops(device):
    if device.type != "cpu":
        return contextlib.nullcontext()
    if not platform.INTERPRET:
        pytest.skip("CPU tensors run the Triton kernel only under the interpreter")
    return d.cpu_implementation("triton")


# --- batches as plain lists ---------------------------------------------------------------------
def spec(qsl, seq, bt, slot=None, seq_ub=None, T_pad=None, max_query_len=None, causal=True):
    R = len(qsl) - 1
    q = [qsl[r + 1] - qsl[r] for r in range(R)]
    T = qsl[-1]
    if slot is None:
        slot = list(range(100, 100 + T)) + [-1] * ((T_pad or T) - T)
    return SimpleNamespace(qsl=list(qsl), seq=list(seq), bt=[list(r) for r in bt], slot=list(slot),
                           seq_ub=list(seq if seq_ub is None else seq_ub), T=T,
                           max_query_len=max(q, default=0) if max_query_len is None else max_query_len,
                           max_seq_len=max(seq, default=0), causal=causal)


def to_batch(s, device, table_dtype=torch.int32, slot_dtype=torch.int64):
    width = max((len(r) for r in s.bt), default=1)
    return BatchDescription(
        query_start_loc=i32(s.qsl, device), query_start_loc_cpu=i32(s.qsl), seq_lens=i32(s.seq, device),
        seq_lens_cpu_upper_bound=i32(s.seq_ub),
        block_table=torch.tensor(s.bt, dtype=table_dtype, device=device).view(len(s.bt), width),
        slot_mapping=torch.tensor(s.slot, dtype=slot_dtype, device=device), num_actual_tokens=s.T,
        max_query_len=s.max_query_len, max_seq_len=s.max_seq_len, causal=s.causal)


def swa_builder(device, **kw):
    args = dict(max_num_batched_tokens=192, max_num_seqs=16, window_size=8, max_model_len=512, block_size=16)
    args.update(kw)
    return SWAMetadataBuilder(device=device, **args)


def indexer_builder(device, **kw):
    args = dict(max_num_batched_tokens=192, max_num_seqs=16, block_table_width=16, max_model_len=512)
    args.update(kw)
    return IndexerMetadataBuilder(device=device, **args)


# --- the independent reference build (plain Python over lists, from the SPEC text) ---------------
o_lookup = oracle_lookup


def o_split(s, thr, require_uniform=False):
    view = SimpleNamespace(query_start_loc_cpu=i32(s.qsl), max_query_len=s.max_query_len, num_actual_tokens=s.T)
    return split_decodes_and_prefills(view, thr, require_uniform=require_uniform)


def ref_swa(s, window, bs, thr, width_nc=None, max_model_len=512, max_tokens=192):
    R = len(s.qsl) - 1
    q = [s.qsl[r + 1] - s.qsl[r] for r in range(R)]
    nd, np_, ndt, npt = o_split(s, thr)
    t2r = []
    for t in range(len(s.slot)):
        owners = [r for r in range(R) if s.qsl[r] <= t < s.qsl[r + 1]]
        t2r.append(owners[0] if t < s.T else 0)
    valid = [x >= 0 for x in s.slot]

    def row(t, W, noncausal):
        r = t2r[t]
        if not valid[t] or not 0 <= r < R:
            return [-1] * W, 0
        prefix = s.seq[r] - q[r]
        pos = prefix + t - s.qsl[r]
        if pos < 0:
            return [-1] * W, 0
        if noncausal:
            start = max(prefix - window, 0)
            n = min(s.seq[r] - start, W)
        else:
            start = max(pos - window + 1, 0)
            n = pos + 1 - start
        return [o_lookup(s.bt, r, start + c, bs) if c < n else -1 for c in range(W)], n

    W = window if s.causal else width_nc
    dec = [row(t, W, not s.causal) for t in range(ndt)]
    pre = [row(t, window, False) for t in range(ndt, ndt + npt)]
    exp = dict(split=(nd, np_, ndt, npt), t2r=t2r, valid=valid, dec_idx=[x for x, _ in dec],
               dec_lens=[n for _, n in dec], width=W, pre_idx=[x for x, _ in pre], pre_lens=[n for _, n in pre],
               max_decode_query_len=min(s.max_query_len, thr))
    if np_:
        exp.update(gather=[q[r] + min(max(s.seq[r] - q[r], 0), window - 1) for r in range(nd, nd + np_)],
                   pq=q[nd:], pseq_cpu=s.seq_ub[nd:], window=window, mml=max_model_len, mnbt=max_tokens)
    return exp


def ref_chunk(s, start, end, qs0, qs1, ratio, comp_dev, comp_cpu):
    """SPEC §3.4 build_prefill_chunk_metadata without DCP, from lists."""
    total = sum(comp_cpu[start:end])
    if total == 0:
        return None
    n = end - start
    cu = [0]
    for b in range(start, end):
        cu.append(cu[-1] + comp_dev[b])
    base = s.qsl[start]
    ks, ke = [None] * (qs1 - qs0), [None] * (qs1 - qs0)
    for b in range(n):
        r = start + b
        qlen = s.qsl[r + 1] - s.qsl[r]
        for o in range(qlen):
            a = s.qsl[r] - base + o
            if qs0 <= a < qs1:
                ks[a - qs0] = cu[b]
                ke[a - qs0] = cu[b] + (s.seq[r] - qlen + 1 + o) // ratio
    t2s = [next(b for b in range(n) if cu[b] <= k < cu[b + 1]) if k < cu[n] else -1 for k in range(total)]
    return dict(block_table=s.bt[start:end], ks=ks, ke=ke, cu=cu, t2s=t2s, total=total, token_start=base + qs0,
                token_end=base + qs1, num_reqs=n, skip=qs0 > 0)


def ref_indexer(s, ratio, sbs, next_n, native_fn, varlen, mpbs, max_logits, table_width=16, schedule=False):
    R = len(s.qsl) - 1
    q = [s.qsl[r + 1] - s.qsl[r] for r in range(R)]
    flat = not native_fn(next_n)
    nd, np_, ndt, npt = o_split(s, next_n, require_uniform=not (flat or varlen))
    exp = dict(split=(nd, np_, ndt, npt))
    if ratio > 1:
        slots = [-1] * s.T
        for b in range(R):
            for i in range(q[b]):
                pos = s.seq[b] - q[b] + i
                if pos >= 0 and (pos + 1) % ratio == 0:
                    slots[s.qsl[b] + i] = o_lookup(s.bt, b, pos // ratio, sbs, int32=False)
        exp["slots"] = slots
    r_eff = max(ratio, 1)
    comp_dev = [x // ratio for x in s.seq] if ratio > 1 else list(s.seq)
    comp_cpu = [x // ratio for x in s.seq_ub] if ratio > 1 else list(s.seq_ub)
    if np_:
        chunks = []
        for rs, qs in split_indexer_prefill_chunks(comp_cpu[nd:], q[nd:], mpbs, max_logits, request_offset=nd):
            c = ref_chunk(s, rs.start, rs.stop, qs.start, qs.stop, r_eff, comp_dev, comp_cpu)
            if c is not None:
                chunks.append(c)
        exp["chunks"] = chunks
    if nd:
        dl = q[:nd]
        Lmax, Lmin = max(dl), min(dl)
        native = not (flat or varlen) and Lmax <= next_n and (Lmax <= 1 or native_fn(Lmax))
        pad = lambda row: row + [-1] * (table_width - len(row))  # noqa: E731
        if native:
            exp.update(bt=s.bt[:nd], decode_lens=dl, requires_padding=Lmin != Lmax)
            if next_n > 1:
                seqs = [[max(s.seq[b] - Lmax + 1 + j, 0) // r_eff for j in range(Lmax)] for b in range(nd)]
            elif ratio > 1:
                seqs = [[s.seq[b] // ratio] for b in range(nd)][:ndt]     # SPEC: expanded_seq_lens[:ndt]
            else:
                seqs = [[s.seq[b]] for b in range(nd)]
        else:
            rows = [(b, j) for b in range(nd) for j in range(dl[b])]
            assert len(rows) == ndt
            exp.update(bt=[pad(s.bt[b]) for b, _ in rows], decode_lens=[1] * ndt, requires_padding=False,
                       indices=[b for b, _ in rows] if varlen else None)
            seqs = [[max(s.seq[b] - dl[b] + j + 1, 0) // r_eff] for b, j in rows]
        exp["seq"] = seqs
        if schedule:
            flat_seq = [x for r in seqs for x in r]
            exp["schedule"] = [sum(flat_seq) * sbs + len(flat_seq)]
    return exp


def schedule_fn(seq_lens_2d, storage_block_size):
    return (seq_lens_2d.sum() * storage_block_size + seq_lens_2d.numel()).reshape(1).to(torch.int32)


# --- comparisons --------------------------------------------------------------------------------
def check_swa(md, s, exp, builder):
    nd, np_, ndt, npt = exp["split"]
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens) == exp["split"]
    assert L(md.token_to_req_indices) == exp["t2r"]
    assert L(md.is_valid_token) == exp["valid"]
    assert md.decode_swa_width == exp["width"]
    assert tuple(md.decode_swa_indices.shape) == (ndt, 1, exp["width"])
    assert L(md.decode_swa_indices.view(ndt, exp["width"])) == exp["dec_idx"]
    assert L(md.decode_swa_lens) == exp["dec_lens"]
    if ndt:
        assert not builder.decode_swa_lens[ndt:].any()
    if npt:
        assert L(md.prefill_swa_indices.view(npt, -1)) == exp["pre_idx"]
        assert L(md.prefill_swa_lens) == exp["pre_lens"]
    else:
        assert md.prefill_swa_indices is None and md.prefill_swa_lens is None
    assert md.max_decode_query_len == exp["max_decode_query_len"]
    assert L(md.block_table) == s.bt and L(md.slot_mapping) == s.slot and L(md.seq_lens) == s.seq
    assert L(md.query_start_loc) == s.qsl and md.query_start_loc_cpu.tolist() == s.qsl
    if np_:
        assert L(md.prefill_gather_lens) == exp["gather"]
        assert L(md.prefill_seq_lens) == s.seq[nd:]
        assert md.prefill_seq_lens_cpu.tolist() == exp["pseq_cpu"]
        assert md.prefill_query_lens_cpu.dtype == torch.int32 and md.prefill_query_lens_cpu.tolist() == exp["pq"]
        assert (md.prefill_window_size, md.prefill_max_model_len, md.prefill_max_num_batched_tokens) == \
            (exp["window"], exp["mml"], exp["mnbt"])
    else:
        assert md.prefill_gather_lens is None and md.prefill_seq_lens is None and md.prefill_query_lens_cpu is None
        assert md.get_prefill_chunk_plan(4) == []
    assert md.flashinfer_sparse_index_cache == {} and md.scheduler_state == {}


def check_indexer(md, s, exp, builder):
    nd, np_, ndt, npt = exp["split"]
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens) == exp["split"]
    assert L(md.seq_lens) == s.seq and md.max_seq_len == s.max_seq_len
    if "slots" in exp:
        assert md.slot_mapping.dtype == torch.int64 and L(md.slot_mapping) == exp["slots"]
        assert (builder.compressed_slot_mapping[s.T:] == -1).all()
    else:
        assert L(md.slot_mapping) == s.slot
    if np_:
        got = md.prefill.chunks
        assert len(got) == len(exp["chunks"])
        for c, e in zip(got, exp["chunks"]):
            assert L(c.block_table) == e["block_table"]
            assert L(c.cu_seqlen_ks) == e["ks"] and L(c.cu_seqlen_ke) == e["ke"]
            assert L(c.cu_seq_lens) == e["cu"] and L(c.token_to_seq) == e["t2s"]
            assert (c.total_seq_lens, c.token_start, c.token_end, c.num_reqs, c.skip_kv_gather) == \
                (e["total"], e["token_start"], e["token_end"], e["num_reqs"], e["skip"])
            assert L(c.local_cu_seq_lens) == e["cu"]
            assert c.local_total_seq_lens == c.max_local_total_seq_lens == e["total"]
    else:
        assert md.prefill is None
    if nd:
        dm = md.decode
        assert dm.seq_lens.dim() == 2 and L(dm.seq_lens) == exp["seq"]
        assert L(dm.block_table) == exp["bt"]
        assert L(dm.decode_lens) == exp["decode_lens"]
        assert dm.requires_padding == exp["requires_padding"]
        assert dm.global_seq_lens is None
        if exp.get("indices") is None:
            assert dm.indices is None
        else:
            assert L(dm.indices) == exp["indices"]
        if "schedule" in exp:
            assert L(dm.schedule_metadata) == exp["schedule"]
        else:
            assert dm.schedule_metadata is None
        if dm.block_table.data_ptr() == builder.expanded_block_table.data_ptr():    # flatten path
            assert not builder.decode_seq_lens[ndt:].any()
    else:
        assert md.decode is None


# --- literal SPEC examples ----------------------------------------------------------------------
def test_spec_prefill_chunk_example(device):
    """SPEC §3.4: ratio 4, uncompressed [10,9], q [4,3], compressed [2,2]; then query_slice 2:6."""
    qsl, un, comp = i32([0, 4, 7]), i32([10, 9]), i32([2, 2])
    bt = i32([[1, 2], [3, 4]])
    args = (qsl.to(device), qsl, un.to(device), comp.to(device), comp, bt.to(device), 4)
    with reference_ops(device):
        c = build_prefill_chunk_metadata(0, 2, *args)
        assert L(c.cu_seq_lens) == [0, 2, 4] and L(c.token_to_seq) == [0, 0, 1, 1]
        assert L(c.cu_seqlen_ks) == [0, 0, 0, 0, 2, 2, 2] and L(c.cu_seqlen_ke) == [1, 2, 2, 2, 3, 4, 4]
        assert (c.total_seq_lens, c.token_start, c.token_end, c.num_reqs, c.skip_kv_gather) == (4, 0, 7, 2, False)
        assert L(c.block_table) == [[1, 2], [3, 4]]
        assert L(c.local_cu_seq_lens) == [0, 2, 4] and (c.local_total_seq_lens, c.max_local_total_seq_lens) == (4, 4)
        c = build_prefill_chunk_metadata(0, 2, *args, query_slice=slice(2, 6))
        assert L(c.cu_seqlen_ks) == [0, 0, 2, 2] and L(c.cu_seqlen_ke) == [2, 2, 3, 4]
        assert c.skip_kv_gather is True and (c.token_start, c.token_end) == (2, 6)
        assert L(c.cu_seq_lens) == [0, 2, 4] and L(c.token_to_seq) == [0, 0, 1, 1]


def test_prefill_chunk_out_buffers_dcp_and_none(device):
    """out= buffers longer than needed get views of their leading entries; DCP world 2 rank 1
    (hand-computed local(x)); a zero host total gives None; bad arguments raise ValueError."""
    qsl, un, comp = i32([0, 2, 6, 9]), i32([50, 13, 9]), i32([12, 3, 2])
    bt = i32([[7], [8], [9]], device)
    bufs = tuple(torch.full((n,), 99, dtype=torch.int32, device=device) for n in (8, 16, 16, 16, 8))
    with reference_ops(device):
        c = build_prefill_chunk_metadata(1, 3, qsl.to(device), qsl, un.to(device), comp.to(device), comp, bt, 4,
                                         dcp_rank=1, dcp_world_size=2, out=bufs)
        assert all(t.data_ptr() == b.data_ptr() for t, b in zip(
            (c.cu_seq_lens, c.cu_seqlen_ks, c.cu_seqlen_ke, c.token_to_seq, c.local_cu_seq_lens), bufs))
        assert L(c.cu_seq_lens) == [0, 3, 5] and L(c.token_to_seq) == [0, 0, 0, 1, 1]
        assert L(c.local_cu_seq_lens) == [0, 1, 2]
        assert L(c.cu_seqlen_ks) == [0, 0, 0, 0, 1, 1, 1] and L(c.cu_seqlen_ke) == [1, 1, 1, 1, 1, 2, 2]
        assert (c.total_seq_lens, c.local_total_seq_lens, c.max_local_total_seq_lens) == (5, 2, 3)
        assert (c.token_start, c.token_end, c.num_reqs) == (2, 9, 2) and L(c.block_table) == [[8], [9]]
        assert L(bufs[1][7:]) == [99] * 9           # nothing written past the chunk
        zero = i32([0, 0, 0])
        assert build_prefill_chunk_metadata(1, 3, qsl.to(device), qsl, un.to(device), zero.to(device), zero, bt,
                                            4) is None
        with pytest.raises(ValueError, match="query_slice"):
            build_prefill_chunk_metadata(1, 3, qsl.to(device), qsl, un.to(device), comp.to(device), comp, bt, 4,
                                         query_slice=slice(3, 8))
        with pytest.raises(ValueError, match="token_to_seq"):
            build_prefill_chunk_metadata(1, 3, qsl.to(device), qsl, un.to(device), comp.to(device), comp, bt, 4,
                                         out=bufs[:3] + (bufs[3][:2],))


def test_spec_flatten_example(device):
    """SPEC §3.6.2: seq [10,7,12,0], dl [3,1,4,0]: contexts [8,9,10,7,9,10,11,12], compressed (ratio 4)
    [2,2,2,1,2,2,2,3]; with supports_varlen the row owners are [0,0,0,1,2,2,2,2]."""
    bt = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    s = spec([0, 3, 4, 8, 8], [10, 7, 12, 0], bt)
    rows = [bt[0]] * 3 + [bt[1]] + [bt[2]] * 4
    for ratio, expected in ((4, [2, 2, 2, 1, 2, 2, 2, 3]), (1, [8, 9, 10, 7, 9, 10, 11, 12])):
        for varlen in (False, True):
            b = indexer_builder(device, compress_ratio=ratio, num_speculative_tokens=3, supports_varlen=varlen,
                                block_table_width=3)
            with reference_ops(device):
                md = b.build(to_batch(s, device))
            dm = md.decode
            assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (4, 8, 0)
            assert L(dm.seq_lens) == [[x] for x in expected]
            assert L(dm.block_table) == rows and L(dm.decode_lens) == [1] * 8 and dm.requires_padding is False
            assert (L(dm.indices) if varlen else dm.indices) == ([0, 0, 0, 1, 2, 2, 2, 2] if varlen else None)


def test_spec_uniform_and_native_decode(device):
    """prepare_uniform_decode example (L 2, seq [10,0] -> [9,10,0,0]) through the flatten path, and the
    native (B, L) view with a qlen-0 request (requires_padding)."""
    s = spec([0, 2, 4], [10, 0], [[3], [4]])
    b = indexer_builder(device, compress_ratio=1, num_speculative_tokens=1, supports_native_decode=lambda n: n == 1)
    with reference_ops(device):
        dm = b.build(to_batch(s, device)).decode
    assert L(dm.seq_lens) == [[9], [10], [0], [0]]
    assert L(dm.block_table) == [[3] + [-1] * 15] * 2 + [[4] + [-1] * 15] * 2
    assert L(dm.decode_lens) == [1, 1, 1, 1]
    s = spec([0, 2, 4, 4], [10, 7, 0], [[3], [4], [5]])
    for ratio, expected in ((1, [[9, 10], [6, 7], [0, 0]]), (4, [[2, 2], [1, 1], [0, 0]])):
        b = indexer_builder(device, compress_ratio=ratio, num_speculative_tokens=1)
        with reference_ops(device):
            md = b.build(to_batch(s, device))
        dm = md.decode
        assert (md.num_decodes, md.num_decode_tokens) == (3, 4)
        assert L(dm.seq_lens) == expected and L(dm.decode_lens) == [2, 2, 0] and dm.requires_padding is True
        assert L(dm.block_table) == [[3], [4], [5]]


def test_spec_swa_examples(device):
    """SPEC §3.4: causal window 4, bs 4, seq 10, q 3, bt [5,9,2]; DSpark window 8, W 64, seq 20, q 4,
    bs 64, bt [[3]] (slots 200..211, length 12), then update_draft_decode_metadata."""
    b = swa_builder(device, window_size=4, block_size=4, num_speculative_tokens=2)
    with reference_ops(device):
        md = b.build(to_batch(spec([0, 3], [10], [[5, 9, 2]]), device))
    assert L(md.decode_swa_indices) == [[[36, 37, 38, 39]], [[37, 38, 39, 8]], [[38, 39, 8, 9]]]
    assert L(md.decode_swa_lens) == [4, 4, 4] and md.decode_swa_width == 4

    b = swa_builder(device, window_size=8, block_size=64, num_speculative_tokens=3, use_dspark=True)
    batch = to_batch(spec([0, 4], [20], [[3]], causal=False), device)
    with reference_ops(device):
        md = b.build(batch)
        assert md.decode_swa_width == 64 and tuple(md.decode_swa_indices.shape) == (4, 1, 64)
        assert L(md.decode_swa_indices.view(4, 64)) == [list(range(200, 212)) + [-1] * 52] * 4
        assert L(md.decode_swa_lens) == [12] * 4
        md.flashinfer_sparse_index_cache["c4a"] = 1
        md.scheduler_state["swaonly"] = 2
        md.seq_lens = i32([24], device)                  # next draft step: prefix 20, start 12
        b.update_draft_decode_metadata(md)
        assert L(md.decode_swa_indices.view(4, 64)) == [list(range(204, 216)) + [-1] * 52] * 4
        assert md.flashinfer_sparse_index_cache == {} and md.scheduler_state == {}
        md = b.build(to_batch(spec([0, 3], [10], [[5, 9, 2]]), device))   # causal again, same builder
        md.seq_lens = i32([11], device)
        b.update_draft_decode_metadata(md)
        assert L(md.decode_swa_indices.view(3, 8)[0]) == list(range(321, 329))   # pos 8: 1..8 of block 5


def test_spec_gather_lens_slots_and_chunk_plan(device):
    """SPEC §3.4 gather lens (window 128: prefix 1000 q 50 -> 177, prefix 10 q 5 -> 15), compressed slot
    mapping (seq 9, q 3, bt [[2]] -> [-1,129,-1]) with its prefill chunk, and §3.5's chunk plan
    example through DeepseekSparseSWAMetadata.get_prefill_chunk_plan."""
    b = swa_builder(device, window_size=128)
    with reference_ops(device):
        md = b.build(to_batch(spec([0, 50, 55], [1050, 15], [[1], [2]]), device))
    assert L(md.prefill_gather_lens) == [177, 15] and (md.num_decodes, md.num_prefills) == (0, 2)

    b = indexer_builder(device, compress_ratio=4, storage_block_size=64)
    with reference_ops(device):
        md = b.build(to_batch(spec([0, 3], [9], [[2]]), device))
    assert L(md.slot_mapping) == [-1, 129, -1]
    (c,) = md.prefill.chunks
    assert L(c.cu_seq_lens) == [0, 2] and L(c.cu_seqlen_ks) == [0, 0, 0] and L(c.cu_seqlen_ke) == [1, 2, 2]
    assert L(c.token_to_seq) == [0, 0]

    seq = [80, 96, 112, 128, 144]
    s = spec([0, 4, 8, 12, 16, 20], seq, [[0]] * 5)
    b = swa_builder(device, window_size=64, max_model_len=1024, max_num_batched_tokens=128)
    with reference_ops(device):
        md = b.build(to_batch(s, device))
    assert md.get_prefill_chunk_plan(4) == [(0, 5, 36, 103)]
    assert md.get_prefill_chunk_plan(4, prefill_chunk_size=4) == [(0, 5, 36, 103)]


# --- random batches against the reference build -------------------------------------------------
KINDS = ["decode", "prefill", "mixed", "mtp_uniform", "mtp_ragged", "empty"]


def rand_spec(rng, kind, dec_q, pre_q_min, causal=True):
    reqs = []                                      # (q, prefix)
    if kind in ("decode", "mixed", "mtp_uniform", "mtp_ragged"):
        nd = rng.randint(1, 6)
        k = rng.randint(1, dec_q)
        qs = [k] * nd if kind in ("decode", "mtp_uniform") else [rng.randint(1, dec_q) for _ in range(nd)]
        if kind == "decode":
            qs = [1] * nd
        reqs += [(x, rng.choice([0, 1, rng.randint(0, 300)])) for x in qs]
        if rng.random() < 0.3:
            reqs += [(0, rng.choice([0, rng.randint(1, 50)]))]       # qlen-0 request among the decodes
    if kind in ("prefill", "mixed"):
        reqs += [(rng.randint(pre_q_min, 40), rng.choice([0, rng.randint(0, 300)])) for _ in range(rng.randint(1, 3))]
    if kind != "empty" and rng.random() < 0.3:
        reqs += [(0, 0)] * rng.randint(1, 2)                         # padding requests
    qsl = [0]
    for x, _ in reqs:
        qsl.append(qsl[-1] + x)
    seq = [x + p for x, p in reqs]
    T = qsl[-1]
    prefill_from = next((r for r, (x, _) in enumerate(reqs) if x >= pre_q_min), len(reqs))
    seq_ub = [v + (rng.randint(0, 3) if r < prefill_from else 0) for r, v in enumerate(seq)]
    width = rng.randint(4, 16)
    bt = [[-1 if rng.random() < 0.1 else rng.randrange(2000) for _ in range(width)]
          for _ in range(len(reqs) + rng.choice([0, 0, 2]))]
    if not bt:
        bt = [[0] * width]
    T_pad = T + rng.choice([0, 0, 3])
    slot = [rng.choice([-1, -7]) if rng.random() < 0.1 else rng.randrange(10**6) for _ in range(T)]
    slot += [rng.choice([-1, -3]) for _ in range(T_pad - T)]
    return spec(qsl, seq, bt, slot=slot, seq_ub=seq_ub, max_query_len=max([x for x, _ in reqs], default=0),
                causal=causal)


NATIVE = {"default": lambda n: n in (1, 2), "all": lambda n: True, "one": lambda n: n == 1}


def _configs(rng):
    ns = rng.choice([0, 1, 3])
    swa = dict(window_size=rng.choice([4, 8]), num_speculative_tokens=ns, parallel_drafting=rng.random() < 0.3,
               use_dspark=rng.random() < 0.5, compress_ratios=(0, 4, 128))
    idx = dict(compress_ratio=rng.choice([1, 4, 128]), num_speculative_tokens=ns,
               native=rng.choice(list(NATIVE)), supports_varlen=rng.random() < 0.4,
               max_prefill_buffer_size=rng.choice([None, 50]), max_logits_bytes=rng.choice([512 * 2**20, 1200, 8000]),
               schedule=rng.random() < 0.3)
    return swa, idx


def _make(device, swa, idx, cache):
    key = (tuple(sorted(swa.items())), tuple(sorted(idx.items())))
    if key not in cache:
        sb = swa_builder(device, **swa)
        ratio = idx["compress_ratio"]
        ib = indexer_builder(device, compress_ratio=ratio, storage_block_size={1: 64, 4: 64, 128: 2}[ratio],
                             num_speculative_tokens=idx["num_speculative_tokens"],
                             supports_native_decode=NATIVE[idx["native"]], supports_varlen=idx["supports_varlen"],
                             max_prefill_buffer_size=idx["max_prefill_buffer_size"],
                             max_logits_bytes=idx["max_logits_bytes"],
                             decode_schedule_fn=schedule_fn if idx["schedule"] else None)
        cache[key] = (sb, ib)
    return cache[key]


def run_case(rng, device, cache, kind=None):
    swa, idx = _configs(rng)
    sb, ib = _make(device, swa, idx, cache)
    kind = kind or rng.choice(KINDS)
    ns = swa["num_speculative_tokens"]
    causal = not (swa["use_dspark"] and kind in ("decode", "mtp_uniform", "mtp_ragged") and rng.random() < 0.5)
    s = rand_spec(rng, kind, dec_q=1 + ns, pre_q_min=sb.decode_threshold + 1, causal=causal)
    batch = to_batch(s, device, table_dtype=rng.choice([torch.int32] * 4 + [torch.int64]),
                     slot_dtype=rng.choice([torch.int64] * 4 + [torch.int32]))
    before = {k: v.clone() for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}

    md = sb.build(batch)
    check_swa(md, s, ref_swa(s, sb.window_size, sb.block_size, sb.decode_threshold, sb.noncausal_index_width),
              sb)
    ratio = idx["compress_ratio"]
    md = ib.build(batch)
    check_indexer(md, s, ref_indexer(s, ratio, ib.storage_block_size, ib.next_n, NATIVE[idx["native"]],
                                     idx["supports_varlen"], ib.max_prefill_buffer_size, idx["max_logits_bytes"],
                                     schedule=idx["schedule"]), ib)
    for k, v in before.items():       # the batch (block table included) is never modified
        assert torch.equal(getattr(batch, k), v), k
    return kind


def test_random_batches_match_reference_build(device):
    rng = random.Random(1234)
    cache = {}
    kinds = set()
    with reference_ops(device):
        for i in range(CASES):
            kinds.add(run_case(rng, device, cache, kind=KINDS[i] if i < len(KINDS) else None))
    assert kinds == set(KINDS)


def test_random_batches_triton_kernels(device):
    """A few small builds through the Triton kernels (the interpreter on CPU)."""
    rng = random.Random(99)
    cache = {}
    with triton_ops(device):
        for kind in ("mixed", "mtp_ragged", "decode", "prefill"):
            run_case(rng, device, cache, kind=kind)


def test_fast_split_equals_planner():
    """The builders answer the all-decode splits themselves; everything equals the planner."""
    from torch_dsv4_ops.metadata.builders import _split
    rng = random.Random(3)
    for _ in range(400):
        q = [rng.choice([0, 0, 1, 2, 3, 4, 9]) for _ in range(rng.randint(1, 7))]
        qsl = [0]
        for x in q:
            qsl.append(qsl[-1] + x)
        s = spec(qsl, [x + 5 for x in q], [[0]] * len(q), max_query_len=max(q) + rng.choice([0, 0, 1]))
        batch = SimpleNamespace(query_start_loc_cpu=i32(qsl), max_query_len=s.max_query_len, num_actual_tokens=s.T)
        for thr in (1, 2, 4):
            for uniform in (False, True):
                got = _split(batch, len(q), np.array(q, dtype=np.int64), thr, uniform)
                assert got == o_split(s, thr, uniform), (q, thr, uniform)


def _tensors(builder):
    return {k: v for k, v in vars(builder).items() if isinstance(v, torch.Tensor)}


def test_buffers_keep_their_addresses(device):
    rng = random.Random(5)
    sb = swa_builder(device, num_speculative_tokens=1, use_dspark=True)
    ib = indexer_builder(device, num_speculative_tokens=1, decode_schedule_fn=schedule_fn)
    ptrs = {(id(b), k): v.data_ptr() for b in (sb, ib) for k, v in _tensors(b).items()}
    with reference_ops(device):
        for i in range(8):
            s = rand_spec(rng, KINDS[i % 5], dec_q=2, pre_q_min=4, causal=i % 3 != 0)
            md = sb.build(to_batch(s, device))
            assert md.token_to_req_indices.data_ptr() == sb.token_to_req_indices.data_ptr()
            if md.num_decode_tokens:                     # (an empty view has data_ptr 0)
                assert md.decode_swa_indices.data_ptr() == (sb.decode_swa_indices if s.causal else
                                                            sb.decode_swa_indices_noncausal).data_ptr()
            imd = ib.build(to_batch(s, device))
            if imd.decode is not None and imd.decode.seq_lens.numel():
                assert imd.decode.schedule_metadata.data_ptr() == ib.schedule.data_ptr()
            if imd.slot_mapping.numel():
                assert imd.slot_mapping.data_ptr() == ib.compressed_slot_mapping.data_ptr()
            for c in imd.prefill.chunks if imd.prefill else ():
                assert ib.chunk_cu_seqlen_ks.data_ptr() <= c.cu_seqlen_ks.data_ptr() < \
                    ib.chunk_cu_seqlen_ks.data_ptr() + 4 * ib.chunk_cu_seqlen_ks.numel()
    assert ptrs == {(id(b), k): v.data_ptr() for b in (sb, ib) for k, v in _tensors(b).items()}


def _bad_batches(device):
    good = spec([0, 1, 2, 12], [30, 5, 40], [[1, 2, 3]] * 3, T_pad=14)
    big = spec(list(range(18)), [5] * 17, [[1]] * 17)
    yield "query_start_loc_cpu", big                                   # R = 17 > max_num_seqs
    yield "slot_mapping", spec([0, 100, 200], [100, 200], [[1]] * 2)    # T_pad 200 > Tmax
    s = spec(good.qsl, good.seq, good.bt, T_pad=14)
    s.seq = s.seq[:2]
    yield "seq_lens", s
    s = spec(good.qsl, good.seq, good.bt, T_pad=14)
    s.seq_ub = s.seq_ub + [1]
    yield "seq_lens_cpu_upper_bound", s
    s = spec(good.qsl, good.seq, good.bt[:2], T_pad=14)
    yield "block_table", s
    s = spec(good.qsl, good.seq, good.bt, T_pad=14)
    s.T = 13
    yield "num_actual_tokens", s
    s = spec(good.qsl, good.seq, good.bt, T_pad=14)
    s.slot = s.slot[:10]
    yield "num_actual_tokens", s
    s = spec(good.qsl, good.seq, good.bt, T_pad=14)
    s.max_query_len = 3
    yield "max_query_len", s
    yield "query_start_loc_cpu", spec([0, 3, 2, 12], good.seq, good.bt)
    yield "causal", spec([0, 1, 2], [5, 6], [[1]] * 2, causal=False)   # no use_dspark


def test_bad_batches_raise_and_builder_stays_usable(device):
    good = spec([0, 1, 2, 12], [30, 5, 40], [[1, 2, 3]] * 3, T_pad=14)
    sb = swa_builder(device, max_num_batched_tokens=64, max_num_seqs=16)
    ib = indexer_builder(device, max_num_batched_tokens=64, max_num_seqs=16, block_table_width=4)
    with reference_ops(device):
        for b in (sb, ib):
            b.build(to_batch(good, device))
        for field, bad in _bad_batches(device):
            for b in (sb, ib):
                if field == "causal" and b is ib:
                    continue
                snapshot = {k: v.clone() for k, v in _tensors(b).items()}
                with pytest.raises(ValueError, match=field):
                    b.build(to_batch(bad, device))
                for k, v in _tensors(b).items():      # validated before anything was written
                    assert torch.equal(v, snapshot[k]), (field, k)
        batch = to_batch(good, device)
        batch.query_start_loc = batch.query_start_loc[:3]
        with pytest.raises(ValueError, match="query_start_loc"):
            sb.build(batch)
        batch = to_batch(spec([0, 1], [5], [[1] * 5]), device)
        with pytest.raises(ValueError, match="block_table"):       # wider than block_table_width
            ib.build(batch)
        batch = to_batch(good, device)
        batch.seq_lens = batch.seq_lens.long()
        with pytest.raises(ValueError, match="seq_lens"):
            ib.build(batch)
        other = spec([0, 2, 3, 20], [30, 5, 40], [[4, 5, 6]] * 3, T_pad=20)
        md = sb.build(to_batch(other, device))
        check_swa(md, other, ref_swa(other, sb.window_size, sb.block_size, sb.decode_threshold,
                                     max_tokens=64), sb)
        md = ib.build(to_batch(other, device))
        check_indexer(md, other, ref_indexer(other, 4, 64, 1, NATIVE["default"], False, ib.max_prefill_buffer_size,
                                             512 * 2**20, table_width=4), ib)


def test_constructor_validation():
    with pytest.raises(ValueError, match="compress_ratios"):
        SWAMetadataBuilder(max_num_batched_tokens=8, max_num_seqs=2, window_size=4, max_model_len=64,
                           compress_ratios=(1, 8), device="cpu")
    with pytest.raises(ValueError, match="compress_ratio"):
        IndexerMetadataBuilder(max_num_batched_tokens=8, max_num_seqs=2, block_table_width=4, max_model_len=64,
                               compress_ratio=2, device="cpu")
    with pytest.raises(ValueError, match="max_num_seqs"):
        SWAMetadataBuilder(max_num_batched_tokens=8, max_num_seqs=0, window_size=4, max_model_len=64, device="cpu")
    b = SWAMetadataBuilder(max_num_batched_tokens=8, max_num_seqs=2, window_size=128, max_model_len=64,
                           num_speculative_tokens=5, parallel_drafting=True, use_dspark=True, device="cpu")
    assert b.decode_threshold == 11 and tuple(b.decode_swa_indices_noncausal.shape) == (8, 1, 192)
    ib = IndexerMetadataBuilder(max_num_batched_tokens=8, max_num_seqs=2, block_table_width=4, max_model_len=64,
                                num_speculative_tokens=3, device="cpu")
    assert (ib.next_n, ib.use_flattening, ib.max_prefill_buffer_size) == (4, True, 64 * 40)


# --- GPU: CUDA graphs and sync debug --------------------------------------------------------------
def _graph_pair(kind):
    """Two batches with the same host values (split, query lengths, prefill lengths) and different
    device data (decode seq_lens, block tables, slots)."""
    rng = random.Random(kind)
    bt = lambda R: [[rng.randrange(5000) for _ in range(16)] for _ in range(R)]  # noqa: E731
    if kind == "decode":
        qsl, seq = [0, 2, 4, 6, 8], ([300, 17, 90, 4], [120, 400, 33, 250])
    elif kind == "ragged":
        qsl, seq = [0, 2, 3, 5, 5], ([300, 17, 90, 0], [120, 400, 33, 0])
    else:
        qsl, seq = [0, 2, 4, 34, 50], ([300, 17, 90, 70], [120, 400, 90, 70])
    a, b = (spec(qsl, s, bt(4), T_pad=qsl[-1] + 2, seq_ub=[500, 500] + s[2:] if kind == "mixed" else [500] * 4)
            for s in seq)
    b.slot[1] = -1
    b.max_seq_len = a.max_seq_len            # a host value: equal for the replayed step
    return a, b


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "ragged", "mixed"])
@pytest.mark.parametrize("native", ["default", "one"])
def test_cuda_graph_replay_matches_eager(kind, native):
    dev = torch.device("cuda")
    a, b = _graph_pair(kind)
    builders = [(swa_builder(dev, num_speculative_tokens=1, use_dspark=True),
                 indexer_builder(dev, num_speculative_tokens=1, supports_native_decode=NATIVE[native],
                                 decode_schedule_fn=schedule_fn)) for _ in range(2)]
    (sb, ib), (sb2, ib2) = builders
    batch = to_batch(a, dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sb.build(batch), ib.build(batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), sync_debug_error():
        smd, imd = sb.build(batch), ib.build(batch)
    new = to_batch(b, dev)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        getattr(batch, name).copy_(getattr(new, name))
    graph.replay()
    torch.cuda.synchronize()
    ratio = ib.compress_ratio
    exp_s = ref_swa(b, sb.window_size, sb.block_size, sb.decode_threshold, sb.noncausal_index_width)
    exp_i = ref_indexer(b, ratio, ib.storage_block_size, ib.next_n, NATIVE[native], False,
                        ib.max_prefill_buffer_size, ib.max_logits_bytes, schedule=True)
    check_swa(smd, b, exp_s, sb)
    check_indexer(imd, b, exp_i, ib)
    with sync_debug_error():                         # eager build of the new batch agrees
        emd, eimd = sb2.build(new), ib2.build(new)
    check_swa(emd, b, exp_s, sb2)
    check_indexer(eimd, b, exp_i, ib2)


@pytest.mark.gpu
def test_build_under_sync_debug_error():
    dev = torch.device("cuda")
    rng = random.Random(7)
    cache = {}
    for i in range(12):
        swa, idx = _configs(rng)
        sb, ib = _make(dev, swa, idx, cache)
        s = rand_spec(rng, KINDS[i % len(KINDS)], dec_q=1 + swa["num_speculative_tokens"],
                      pre_q_min=sb.decode_threshold + 1)
        batch = to_batch(s, dev)
        torch.cuda.synchronize()
        with sync_debug_error():
            smd, imd = sb.build(batch), ib.build(batch)
        check_swa(smd, s, ref_swa(s, sb.window_size, sb.block_size, sb.decode_threshold, sb.noncausal_index_width),
                  sb)
        check_indexer(imd, s, ref_indexer(s, idx["compress_ratio"], ib.storage_block_size, ib.next_n,
                                          NATIVE[idx["native"]], idx["supports_varlen"], ib.max_prefill_buffer_size,
                                          idx["max_logits_bytes"], schedule=idx["schedule"]), ib)
