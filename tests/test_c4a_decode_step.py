"""One C4A decode step end to end, every index produced by our own ops (SPEC §3.3, §3.4, §3.8, §3.9):

    indexer (test_indexer_e2e's Step and run_indexer): top-k compressed positions of each MTP decode token
    compute_global_topk_indices_and_lens(top-k, token -> request, C4A block table, 64)   -> extra slots, lengths
    compute_swa_indices_and_lens(window, ..., SWA block table, 64)                        -> main slots, lengths
    flash_mla_with_kvcache(q, SWA cache, indices = main slots, extra_k_cache = C4A cache,
                           extra_indices_in_kvcache = extra slots)                      -> out, lse

Both fp8_ds_mla caches are NaN-filled pages written by quantize_and_insert_k_cache: the SWA cache holds every
position's 512-d row, the C4A cache every compressed position's (page c // 64 of the request's compressed block
table, as the indexer's own cache). Oracle, written here: the rows the step must select, found by hand (the window
positions pos - window + 1 .. pos, and the indexer's chosen positions, through the block tables), dequantised from
the cache bytes, attended in float64 (SPEC §3.8 tolerances). The indexer's choice itself is checked against its own
float64 oracle by test_indexer_e2e; here it is the input that travels.
"""
from __future__ import annotations

import pytest
import torch

import torch_dsv4_ops as d
from test_indexer_e2e import RATIO, Step, run_indexer
from test_sparse_mla import D, SHARP, build_cache, check_out, check_stat, helpers_on, oracle_attend, oracle_rows, \
    random_rows
from torch_dsv4_ops import layout
from torch_dsv4_ops.testing import implementation

IMPLS = ["reference", "kernel"]
PAGE = layout.SWA_BLOCK_SIZE          # 64 rows per page in both fp8_ds_mla caches


class DecodeStep:
    """An indexer Step of MTP decodes plus the two attention caches, their block tables and the MLA queries."""

    def __init__(self, device, seq_lens, heads, index_heads, window, topk, seed):
        g = torch.Generator().manual_seed(seed)
        self.device, self.window, self.topk, self.heads = device, window, topk, heads
        self.index = Step(device, seq_lens, [2] * len(seq_lens), index_heads, seed=seed)
        self.seq = list(seq_lens)
        # the C4A cache: compressed position c of request r at page c4a_table[r, c // 64] (the indexer's table)
        self.c4a_table = self.index.table
        c4a_slots = [int(self.c4a_table[r, c // PAGE]) * PAGE + c % PAGE
                     for r, s in enumerate(self.seq) for c in range(s // RATIO)]
        self.c4a = build_cache(self.c4a_table.numel() + 2, PAGE, c4a_slots, random_rows(len(c4a_slots), g),
                               device=device, g=g)
        # the SWA cache: every position of request r at page swa_table[r, p // 64], a permutation of the pages
        width = layout.cdiv(max(self.seq), PAGE)
        nb = len(self.seq) * width + 2
        self.swa_table = torch.randperm(nb, generator=g)[:len(self.seq) * width].view(len(self.seq), width).int()
        swa_slots = [int(self.swa_table[r, p // PAGE]) * PAGE + p % PAGE
                     for r, s in enumerate(self.seq) for p in range(s)]
        self.swa = build_cache(nb, PAGE, swa_slots, random_rows(len(swa_slots), g), device=device, g=g)
        self.tokens = self.index.tokens
        self.req = torch.repeat_interleave(torch.arange(len(self.seq)), 2)
        self.q = (torch.randn(self.tokens, 1, heads, D, generator=g) / D ** 0.5).to(torch.bfloat16)
        self.sink = torch.randn(heads, generator=g) - 1.0

    def run(self, impl: str):
        """The step's index ops and attention; returns (out, lse, window slots, the indexer's top-k positions,
        their slots in the C4A cache, their counts)."""
        dev, T = self.device, self.tokens
        i32 = dict(dtype=torch.int32, device=dev)
        _, _, chosen, _ = run_indexer(self.index, self.topk)
        t2r = self.req.to(**i32)
        valid = torch.ones(T, dtype=torch.bool, device=dev)
        qsl = self.index.batch.query_start_loc
        swa_idx = torch.full((T, 1, self.window), -7, **i32)
        swa_lens = torch.full((T,), -7, **i32)
        with implementation(impl, dev):
            d.compute_swa_indices_and_lens(swa_idx, swa_lens, self.window, qsl, self.index.batch.seq_lens, t2r, valid,
                                           self.swa_table.to(dev), PAGE)
            extra, extra_lens = d.compute_global_topk_indices_and_lens(chosen[:, :self.topk], t2r,
                                                                       self.c4a_table.to(dev), PAGE, valid)
            out, lse = d.flash_mla_with_kvcache(
                self.q.to(dev), self.swa.tensor, None, None, D, None, softmax_scale=SHARP, is_fp8_kvcache=True,
                indices=swa_idx, attn_sink=self.sink.to(dev), extra_k_cache=self.c4a.tensor,
                extra_indices_in_kvcache=extra.view(T, 1, self.topk), topk_length=swa_lens,
                extra_topk_length=extra_lens)
        return out, lse, swa_idx, chosen[:, :self.topk], extra, extra_lens

    def check(self, impl: str) -> None:
        out, lse, swa_idx, chosen, extra, extra_lens = self.run(impl)
        positions = self.index.positions.tolist()
        chosen, extra = chosen.cpu(), extra.cpu()
        e_out = torch.zeros(self.tokens, 1, self.heads, D, dtype=torch.float64)
        e_lse = torch.zeros(self.tokens, self.heads, 1, dtype=torch.float64)
        for t, p in enumerate(positions):
            r = int(self.req[t])
            window = range(max(p - self.window + 1, 0), p + 1)
            main = [int(self.swa_table[r, q // PAGE]) * PAGE + q % PAGE for q in window]
            assert swa_idx[t, 0, :len(main)].tolist() == main, f"token {t}: window slots"
            picked = [c for c in chosen[t].tolist() if c >= 0]
            slots = [int(self.c4a_table[r, c // PAGE]) * PAGE + c % PAGE for c in picked]
            assert extra[t, :len(slots)].tolist() == slots and int(extra_lens[t]) == len(slots), \
                f"token {t}: compressed slots"
            rows = torch.cat([oracle_rows(self.swa, main), oracle_rows(self.c4a, slots)])
            o, _, s = oracle_attend(self.q[t, 0].double(), rows, SHARP, self.sink.double())
            e_out[t, 0], e_lse[t, :, 0] = o, s
        check_out(out, e_out, f"C4A decode step [{impl}]: out")
        check_stat(lse, e_lse, f"C4A decode step [{impl}]: lse")


@pytest.mark.parametrize("impl", IMPLS)
def test_c4a_decode_step(device, impl):
    """3 MTP decodes (compressed contexts 12..90, so some rows hold fewer than top-k positions), window 16,
    top-k 32, 16 heads; the input ops run their reference on the CPU, their kernels on a GPU."""
    step = DecodeStep(device, [49, 250, 363], heads=16, index_heads=16, window=16, topk=32, seed=21)
    with helpers_on(device):
        step.check(impl)


@pytest.mark.gpu
def test_c4a_decode_step_model_size():
    """DSV4's shapes: 64 heads, window 128, top-k 512 over compressed contexts up to 5000, on the GPU."""
    g = torch.Generator().manual_seed(22)
    seq = [int(v) for v in torch.randint(600, 20000, (6,), generator=g)] + [130, 2100]
    step = DecodeStep(torch.device("cuda"), seq, heads=64, index_heads=64, window=128, topk=512, seed=23)
    step.check("kernel")
