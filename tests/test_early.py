"""Reads before `gdc_wait` (`kernels/early.py`) never reach a result (GPU, PDL targets), and happen only there.

Each op that reads its inputs early runs right after a kernel that rewrote them, inside a captured graph, and must
see the new values: the early reads are stale whenever the predecessor is still writing, and only their L2 traffic
may differ. The predecessors are our own programmatic-dependent top-k and `reshape_and_cache_flash` (they launch
their dependents at their start and write at their end) or torch kernels.
"""
from __future__ import annotations

import pytest
import torch

import torch_dsv4_ops as d
from torch_dsv4_ops import layout, platform
from torch_dsv4_ops.kernels import attention, early, k_cache, sparse_index
from torch_dsv4_ops.testing import assert_bitwise_equal

WINDOW, RATIO, TOPK = layout.SLIDING_WINDOW, 4, layout.INDEX_TOPK
DECODE_GEO = attention.Geometry(32, 8, 128, 16, 16, True)    # the paged decode's fp8-cache benchmark shape


def test_early_flags_only_where_pdl():
    """Reads before the wait (inline PTX) only on NVIDIA targets with PDL; elsewhere every kernel keeps EARLY = 0."""
    for target in (*platform.MATRIX_TARGETS, platform.INTERPRETER_TARGET):
        pdl = platform.supports_pdl(target)
        assert early.use_early(target) == pdl
        assert bool(k_cache.gather_early(128, target)) == pdl
        assert k_cache.gather_early(8192, target) == 0            # whole-sequence gathers: bandwidth-bound
        assert bool(sparse_index.combine_constexprs(WINDOW, RATIO, TOPK, True, 64, 64, target)["EARLY"]) == pdl
        for rows in (256, 4096):
            assert bool(sparse_index.flashinfer_early(rows, target)) == pdl
        assert bool(attention.decode_tiles(DECODE_GEO, torch.bfloat16, True, target).get("early", 0)) == pdl
        assert not attention.decode_tiles(DECODE_GEO, torch.bfloat16, False, target).get("early", 0)   # float caches
    assert early.flags(touch=True, late=True) == early.TOUCH.value | early.LATE.value


@pytest.fixture
def cuda_early():
    if not torch.cuda.is_available() or not early.use_early(platform.target_for(torch.device("cuda"))):
        pytest.skip("needs a GPU with programmatic dependent launch")


def _replay_and_check(step, expected, outputs, what, rounds=3):
    """Capture step() once and replay it: after each replay, outputs equal expected() (computed after the replay,
    outside the graph)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(rounds):
        graph.replay()
        torch.cuda.synchronize()
        for k, (got, exp) in enumerate(zip(outputs, expected())):
            assert_bitwise_equal(got.cpu(), exp, f"{what}: replay {i}, output {k}")


def _topk_rows(rows, n_cols, seed):
    """Logits for `rows` decode rows, their lengths, and an index buffer the top-k writes."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, n_cols, generator=g).cuda()
    seq = torch.full((rows,), n_cols, dtype=torch.int32, device="cuda")
    return logits, seq, torch.zeros(rows, TOPK, dtype=torch.int32, device="cuda")


def _cpu_topk(logits, seq, rows, n_cols):
    idx = torch.empty(rows, TOPK, dtype=torch.int32)
    with d.cpu_implementation("reference"):
        d.top_k_per_row_decode(logits.cpu(), 1, seq.cpu(), idx, rows, None, None, TOPK)
    return idx


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 256])
def test_combine_sees_indices_written_just_before(cuda_early, rows):
    """combine touches its first top-k tile and request vectors early (EARLY has TOUCH)."""
    assert sparse_index.combine_constexprs(WINDOW, RATIO, TOPK, True, rows, rows, platform.target_for(
        torch.device("cuda")))["EARLY"] & early.TOUCH.value
    n_cols = 4096
    logits, seq_k, idx = _topk_rows(rows, n_cols, rows)
    qsl = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    seq = 4096 + 37 * torch.arange(rows, dtype=torch.int32, device="cuda")
    gl = 1 + torch.clamp(seq - 1, max=WINDOW - 1)
    N = int(seq.max()) // RATIO
    M = N + int(gl.max())
    out = (torch.empty(rows, layout.combine_width(TOPK, WINDOW), dtype=torch.int32, device="cuda"),
           torch.empty(rows, dtype=torch.int32, device="cuda"))

    def step():
        logits.neg_()
        d.top_k_per_row_decode(logits, 1, seq_k, idx, rows, None, None, TOPK)
        d.combine_topk_swa_indices(idx, qsl, seq, gl, WINDOW, RATIO, TOPK, M, N, out=out)

    def expected():
        with d.cpu_implementation("reference"):
            return d.combine_topk_swa_indices(_cpu_topk(logits, seq_k, rows, n_cols), qsl.cpu(), seq.cpu(), gl.cpu(),
                                              WINDOW, RATIO, TOPK, M, N)

    _replay_and_check(step, expected, out, "combine after the top-k")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [256, 4096])
def test_flashinfer_sees_indices_written_just_before(cuda_early, rows):
    """flashinfer touches its rows' first inputs early at decode sizes and launches late above them."""
    n_cols = 4096
    logits, seq_k, dcomp = _topk_rows(rows, n_cols, rows + 1)
    g = torch.Generator().manual_seed(rows)
    dswa = torch.randint(0, 2**30, (rows, WINDOW), generator=g, dtype=torch.int32).cuda()
    qsl = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    seq = 4096 + 37 * torch.arange(rows, dtype=torch.int32, device="cuda")
    t2r = torch.arange(rows, dtype=torch.int32, device="cuda")
    cbt = torch.randint(0, 50000, (rows, n_cols // 64 + 1), generator=g, dtype=torch.int32).cuda()
    valid = torch.ones(rows, dtype=torch.bool, device="cuda")
    P = layout.flashinfer_compressed_width(TOPK, TOPK)
    out = (torch.empty(rows, WINDOW + P, dtype=torch.int32, device="cuda"),
           torch.empty(rows, dtype=torch.int32, device="cuda"))
    empty = torch.empty(0, TOPK, dtype=torch.int32, device="cuda")

    def args(dcomp_):
        return (dswa, dcomp_, None, empty, qsl, seq, t2r, cbt, 64, cbt, 64, WINDOW, RATIO, TOPK, True, valid)

    def step():
        logits.neg_()
        d.top_k_per_row_decode(logits, 1, seq_k, dcomp, rows, None, None, TOPK)
        dswa.add_(1)
        d.build_flashinfer_mixed_sparse_indices(*args(dcomp), out=out)

    def expected():
        cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args(_cpu_topk(logits, seq_k, rows, n_cols))]
        with d.cpu_implementation("reference"):
            return d.build_flashinfer_mixed_sparse_indices(*cpu)

    _replay_and_check(step, expected, out, "flashinfer after the top-k")


@pytest.mark.gpu
def test_window_gather_sees_lengths_and_table_written_just_before(cuda_early):
    """The window gather reads lengths and table entries early and touches the pages they name (EARLY = TOUCH |
    LATE); torch kernels move the lengths and rotate the table right before it."""
    bs, R, width = 64, 16, 128
    assert k_cache.gather_early(width, platform.target_for(torch.device("cuda"))) & early.TOUCH.value
    g = torch.Generator().manual_seed(0)
    nb = 4 * R
    k = torch.randn(nb * bs, layout.HEAD_DIM, generator=g).to(torch.bfloat16).cuda()
    cache = torch.zeros(nb, layout.ds_mla_block_stride(bs), dtype=torch.uint8, device="cuda")
    d.quantize_and_insert_k_cache(k, cache, torch.arange(nb * bs, device="cuda"), bs)
    table = torch.randperm(nb, generator=g).to(torch.int32).view(R, 4).cuda()
    seq = torch.randint(width, 3 * bs, (R,), generator=g, dtype=torch.int32).cuda()
    gl = torch.full((R,), width, dtype=torch.int32, device="cuda")
    out = torch.zeros(R, width, layout.HEAD_DIM, dtype=torch.bfloat16, device="cuda")

    def step():
        seq.add_(1)
        table.copy_(table.roll(1, 0))
        d.dequantize_and_gather_k_cache(out, cache, seq, gl, table, bs, 0)

    def expected():
        ref = torch.zeros_like(out, device="cpu")
        with d.cpu_implementation("reference"):
            d.dequantize_and_gather_k_cache(ref, cache.cpu(), seq.cpu(), gl.cpu(), table.cpu(), bs, 0)
        return (ref,)

    _replay_and_check(step, expected, (out,), "window gather after new lengths and table")


@pytest.mark.gpu
def test_paged_decode_sees_the_token_written_just_before(cuda_early):
    """The fp8-cache decode touches its first tiles' pages early (EARLY = TOUCH | LATE) while our programmatic-dependent
    `reshape_and_cache_flash` (it launches its dependents at its start) writes each request's newest token into them;
    torch kernels grow the lengths and change the token's K/V right before. The result must use the new token: it
    equals the same call made again after the replay (no race left), and the float64-accumulated reference."""
    from torch_dsv4_ops.ops.attention import example_batch
    from torch_dsv4_ops.testing import assert_close

    assert attention.decode_tiles(DECODE_GEO, torch.bfloat16, True,
                                  platform.target_for(torch.device("cuda")))["early"] & early.TOUCH.value
    lens, bs, rounds = [4000, 300, 37, 1000], 16, 3
    batch = list(example_batch([1] * len(lens), [n + rounds + 2 for n in lens], hq=32, hkv=8, dim=128, bs=bs,
                               fp8=True, seed=7, device="cuda"))
    (query, _, _, output, kv, key_cache, value_cache, table, qsl, seq, _, _, k_scale, v_scale) = batch
    seq.copy_(torch.tensor(lens, dtype=torch.int32))
    batch[10] = max(lens) + rounds + 2                     # max_seq_len: one plan (and split count) for every replay
    g = torch.Generator(device="cuda").manual_seed(8)
    new_k = 4 * torch.randn(len(lens), 8, 128, generator=g, device="cuda").to(torch.bfloat16)
    new_v = torch.randn(len(lens), 8, 128, generator=g, device="cuda").to(torch.bfloat16)
    slots = torch.zeros(len(lens), dtype=torch.int64, device="cuda")

    def step():
        seq.add_(1)
        pos = seq.long() - 1
        slots.copy_(table.gather(1, (pos // bs)[:, None]).squeeze(1).long() * bs + pos % bs)
        new_k.neg_()
        d.reshape_and_cache_flash(new_k, new_v, key_cache, value_cache, slots, kv, k_scale, v_scale)
        d.chunked_prefill_paged_decode(*batch)

    def expected():
        again = torch.empty_like(output)
        d.chunked_prefill_paged_decode(*batch[:3], again, *batch[4:])
        cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in batch]
        cpu[3] = torch.empty_like(cpu[3])
        with d.cpu_implementation("reference"):
            d.chunked_prefill_paged_decode(*cpu)
        assert_close(again.cpu(), cpu[3], what="decode after the newest token's write against the reference")
        return (again.cpu(),)

    _replay_and_check(step, expected, (output,), "fp8 decode after the newest token's write")
