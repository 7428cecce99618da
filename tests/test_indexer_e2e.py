"""The whole lightning indexer of a C4A layer, end to end, with our own writers and metadata (SPEC §3.6.2, §3.9, §5):

    compressed K rows -> indexer_k_quant_and_cache (slots from get_compressed_slot_mapping's table)
    index_q, positions -> fused_indexer_q_rope_quant -> (q_fp8, folded weights)
    IndexerMetadataBuilder.build(step) ->
      decode rows:  fp8_fp4_paged_mqa_logits over the paged cache -> top_k_per_row_decode
      prefill rows: cp_gather_indexer_k_quant_cache per chunk -> fp8_fp4_mqa_logits -> top_k_per_row_prefill

Oracle, written here: the key rows are dequantised from the cache bytes (SPEC §2.2: 128 e4m3 codes at
page + off*128 read through `.view(float8_e4m3fn)`, times the fp32 scale at page + bs*128 + 4*off), the queries from
q_fp8's codes, and every logit is evaluated in float64 for the compressed positions a row may see (decode row j of
request b: (seq_b - n + 1 + j) // 4; prefill token at position p: (p + 1) // 4, SPEC §3.4). The chosen indices must
be a top-k of those float64 logits up to exact ties: ascending, distinct, min(L, topk) of them (then -1), and no
unchosen logit above the smallest chosen one by more than the fp32 accumulation error. Block tables are
permutations (no two requests share a page), so every key is written exactly once.

CPU budget: 5 requests, 16 heads, compressed contexts <= 90 (topk 32, so rows fall below, at and above topk); the
Triton kernels run under the interpreter. Model sizes (64 heads, topk 512, contexts of thousands) and the CUDA-graph
replay of the decode path with new lengths and tables run on a GPU.
"""
from __future__ import annotations

import pytest
import torch

import torch_dsv4_ops as d
from torch_dsv4_ops import layout
from torch_dsv4_ops.metadata import BatchDescription, IndexerMetadataBuilder
from torch_dsv4_ops.testing import check_cuda_graph, implementation, nonzero_share

RATIO = 4
TOKENS_PER_BLOCK = layout.COMPRESSED_KERNEL_BLOCK   # uncompressed positions per block-table entry
BS = TOKENS_PER_BLOCK // RATIO                      # compressed entries per indexer page (storage block)
D = layout.INDEXER_DIM
IMPLS = ["reference", "kernel"]


class Step:
    """One step of `decodes` MTP decodes (2 query tokens each) followed by prefills, with a permutation block table,
    every compressed K row of every request written into a NaN-poisoned cache, and the quantised queries."""

    def __init__(self, device, seq_lens, query_lens, heads, *, seed, max_model_len=8192, extra_blocks=3):
        g = torch.Generator().manual_seed(seed)
        self.device, self.heads = device, heads
        self.seq, self.q = list(seq_lens), list(query_lens)
        self.max_model_len = max_model_len
        width = layout.cdiv(max(self.seq), TOKENS_PER_BLOCK) + 1
        nb = len(self.seq) * width + extra_blocks
        self.table = torch.randperm(nb, generator=g)[:len(self.seq) * width].view(len(self.seq), width).int()
        self.cache = self._written_cache(nb, g)
        qsl = torch.tensor([0] + torch.tensor(self.q).cumsum(0).tolist(), dtype=torch.int32)
        self.positions = torch.cat([torch.arange(s - n, s) for s, n in zip(self.seq, self.q)])
        self.tokens = int(qsl[-1])
        req = torch.repeat_interleave(torch.arange(len(self.q)), torch.tensor(self.q))
        slots = self.table[req, self.positions // TOKENS_PER_BLOCK].long() * TOKENS_PER_BLOCK \
            + self.positions % TOKENS_PER_BLOCK
        seq = torch.tensor(self.seq, dtype=torch.int32)
        self.batch = BatchDescription(
            query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device),
            seq_lens_cpu_upper_bound=seq, block_table=self.table.to(device), slot_mapping=slots.to(device),
            num_actual_tokens=self.tokens, max_query_len=max(self.q), max_seq_len=max(self.seq),
            positions=self.positions.to(device))
        # index_q N(0, 1) with per-token magnitudes over 2**[-3, 3]; RoPE tables of random angles
        self.index_q = (torch.randn(self.tokens, heads, D, generator=g)
                        * torch.exp2(torch.randint(-3, 4, (self.tokens, 1, 1), generator=g).float())).to(torch.bfloat16)
        angles = torch.rand(max_model_len, D // 4, generator=g) * 6.3
        self.cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
        self.weights = torch.randn(self.tokens, heads, generator=g)
        self.softmax_scale, self.head_scale = D ** -0.5, heads ** -0.5

    def _written_cache(self, nb, g):
        """A NaN-filled indexer cache (page stride padded to 576) holding K rows for every compressed position."""
        page = layout.indexer_block_bytes(BS)
        stride = layout.round_up(page, layout.PAGE_ALIGN)
        raw = torch.full((nb, stride), 0x7F, dtype=torch.uint8)
        cache = raw[:, :page].view(nb, BS, layout.INDEXER_TOKEN_BYTES).to(self.device)
        self.keys = []
        slots = []
        for r, s in enumerate(self.seq):
            c = torch.arange(s // RATIO)
            slots.append(self.table[r, c // BS].long() * BS + c % BS)
            # rows N(0, 1) with per-row magnitudes over 2**[-6, 6] and a few large outliers
            rows = torch.randn(c.numel(), D, generator=g) * torch.exp2(torch.randint(-6, 7, (c.numel(), 1),
                                                                                     generator=g).float())
            self.keys.append(rows.to(torch.bfloat16))
        d.indexer_k_quant_and_cache(torch.cat(self.keys).to(self.device), cache, torch.cat(slots).to(self.device),
                                    layout.INDEXER_QUANT_BLOCK, layout.INDEXER_SCALE_FMT)
        return cache

    # --- the oracle's view of the data ---------------------------------------------------------------------
    def key_rows(self, r: int) -> torch.Tensor:
        """float64 [seq_r // 4, 128]: request r's dequantised compressed K rows, read from the cache bytes (cached)."""
        if not hasattr(self, "_rows"):
            self._rows, self._pages = {}, self.cache.cpu().flatten(1)
        if r not in self._rows:
            c = torch.arange(self.seq[r] // RATIO)
            pages = self._pages[self.table[r, c // BS].long()]                       # [n, page bytes]
            off = (c % BS)[:, None]
            codes = pages.gather(1, off * D + torch.arange(D)).view(torch.float8_e4m3fn).double()
            scale = pages.gather(1, BS * D + 4 * off + torch.arange(4)).contiguous().view(torch.float32).double()
            self._rows[r] = codes * scale
        return self._rows[r]

    def oracle_logits(self, q_fp8, weights, token: int, request: int, visible: int) -> torch.Tensor:
        """float64 [visible]: sum_h w[h] relu(<q[h], k[n]>) * scale[n] over the first `visible` keys."""
        q = q_fp8[token].cpu()
        q = (q.view(torch.float8_e4m3fn) if q.dtype == torch.uint8 else q).double()     # [H, D]
        w = weights[token].cpu().double()
        keys = self.key_rows(request)[:visible]
        return (torch.relu(keys @ q.T) * w).sum(1)


def check_topk_row(chosen: torch.Tensor, logits: torch.Tensor, topk: int, what: str) -> None:
    """`chosen` [topk] int32 is a top-k of float64 `logits` [L] up to exact ties (see the module docstring)."""
    L = logits.numel()
    chosen = chosen.tolist()
    n = min(L, topk)
    assert chosen[n:] == [-1] * (topk - n), f"{what}: {chosen}"
    sel = chosen[:n]
    assert sel == sorted(set(sel)) and all(0 <= i < L for i in sel), f"{what}: not ascending distinct in [0, {L})"
    if L <= topk:
        assert sel == list(range(L)), what
        return
    mask = torch.zeros(L, dtype=torch.bool)
    mask[sel] = True
    tol = 1e-5 * float(logits.abs().max()) + 1e-30
    worst_in, best_out = float(logits[mask].min()), float(logits[~mask].max())
    assert best_out <= worst_in + tol, f"{what}: unchosen {best_out} > chosen {worst_in}"


def run_indexer(step: Step, topk: int, builder=None):
    """The indexer pipeline of one step; returns (q_fp8, weights, topk indices [T, topk] int32, metadata)."""
    dev = step.device
    q_fp8, weights = d.fused_indexer_q_rope_quant(step.positions.to(dev), step.index_q.to(dev), step.cos_sin.to(dev),
                                                  step.weights.to(dev), step.softmax_scale, step.head_scale)
    if builder is None:
        builder = IndexerMetadataBuilder(max_num_batched_tokens=step.tokens, max_num_seqs=len(step.seq),
                                         block_table_width=step.table.shape[1], max_model_len=step.max_model_len,
                                         compress_ratio=RATIO, storage_block_size=BS, num_speculative_tokens=1,
                                         device=dev)
    meta = builder.build(step.batch)
    out = torch.full((step.tokens, topk + 3), -7, dtype=torch.int32, device=dev)
    if meta.decode is not None:
        dec = meta.decode
        nd, n = dec.seq_lens.shape
        logits = d.fp8_fp4_paged_mqa_logits((q_fp8[:nd * n].view(nd, n, step.heads, D), None),
                                            step.cache.view(step.cache.shape[0], BS, 1, -1), weights[:nd * n],
                                            dec.seq_lens, dec.block_table, dec.schedule_metadata,
                                            step.max_model_len // RATIO, False)
        d.top_k_per_row_decode(logits, n, dec.seq_lens, out, nd * n, logits.stride(0), logits.stride(1), topk)
    if meta.prefill is not None:
        for chunk in meta.prefill.chunks:
            k = torch.empty(chunk.total_seq_lens, D, dtype=torch.uint8, device=dev)
            scale = torch.empty(chunk.total_seq_lens, dtype=torch.float32, device=dev)
            d.cp_gather_indexer_k_quant_cache(step.cache, k, scale, chunk.block_table, chunk.cu_seq_lens)
            ts, te = chunk.token_start, chunk.token_end
            logits = d.fp8_fp4_mqa_logits((q_fp8[ts:te], None), (k.view(torch.float8_e4m3fn), scale),
                                          weights[ts:te], chunk.cu_seqlen_ks, chunk.cu_seqlen_ke, False)
            d.top_k_per_row_prefill(logits, chunk.cu_seqlen_ks, chunk.cu_seqlen_ke, out[ts:te], te - ts,
                                    logits.stride(0), logits.stride(1), topk)
    return q_fp8, weights, out, meta


def check_step(step: Step, topk: int, q_fp8, weights, out) -> None:
    """Every token's row against the float64 oracle; columns past topk keep the sentinel."""
    out = out.cpu()
    assert bool((out[:, topk:] == -7).all()), "columns past topk were written"
    t = 0
    for r, (s, n) in enumerate(zip(step.seq, step.q)):
        for o in range(n):
            visible = (s - n + 1 + o) // RATIO
            logits = step.oracle_logits(q_fp8, weights, t, r, visible)
            check_topk_row(out[t, :topk], logits, topk, f"request {r} token {o} (L {visible})")
            t += 1


# 3 MTP decodes (compressed contexts 12..90) and 2 prefills (37 and 60 tokens)
CPU_SEQ, CPU_Q = [49, 250, 363, 120, 90], [2, 2, 2, 37, 60]


@pytest.mark.parametrize("impl", IMPLS)
def test_indexer_step_end_to_end(device, impl):
    step = Step(device, CPU_SEQ, CPU_Q, heads=16, seed=1, max_model_len=1024)
    assert nonzero_share(step.cache) > 0.5
    topk = 32
    with implementation(impl, device):
        q_fp8, weights, out, meta = run_indexer(step, topk)
    assert meta.num_decodes == 3 and meta.num_prefills == 2
    check_step(step, topk, q_fp8, weights, out)


@pytest.mark.gpu
def test_indexer_step_model_size():
    """64 heads, topk 512, contexts up to 20000 (compressed 5000): decodes and long prefills on the GPU."""
    g = torch.Generator().manual_seed(3)
    seq = [int(v) for v in torch.randint(500, 20000, (6,), generator=g)] + [3000, 9000]
    step = Step(torch.device("cuda"), seq, [2] * 6 + [700, 300], heads=64, seed=4, max_model_len=32768)
    q_fp8, weights, out, _ = run_indexer(step, 512)
    check_step(step, 512, q_fp8, weights, out)


@pytest.mark.gpu
def test_indexer_decode_cuda_graph():
    """The decode path (paged logits + top-k) captured in a CUDA graph and replayed with new context lengths and
    block tables (entries -1 and past the cache included) in the same buffers equals eager; capture and eager runs
    are under sync-debug "error" (check_cuda_graph)."""
    dev = torch.device("cuda")
    B, n, H, topk, width, nb = 16, 2, 64, 512, 40, 700
    max_len = width * BS
    g = torch.Generator().manual_seed(8)
    cache = torch.empty(nb, BS, 1, layout.INDEXER_TOKEN_BYTES, dtype=torch.uint8, device=dev)
    magnitudes = torch.exp2(torch.randint(-6, 7, (nb * BS, 1), generator=g).float())
    rows = (torch.randn(nb * BS, D, generator=g) * magnitudes).to(torch.bfloat16)
    d.indexer_k_quant_and_cache(rows.to(dev), cache, torch.arange(nb * BS, device=dev), layout.INDEXER_QUANT_BLOCK,
                                layout.INDEXER_SCALE_FMT)

    def inputs(seed):
        gg = torch.Generator().manual_seed(seed)
        q = torch.randn(B, n, H, D, generator=gg).to(torch.float8_e4m3fn).to(dev)
        w = torch.randn(B * n, H, generator=gg).to(dev)
        lens = torch.randint(0, max_len, (B, 1), generator=gg).int() + torch.arange(n).int()
        table = torch.randint(-1, nb + 2, (B, width), generator=gg).int()
        return q, w, lens.clamp(max=max_len).to(dev), table.to(dev)

    def decode(q, w, lens, table, out):
        logits = d.fp8_fp4_paged_mqa_logits((q, None), cache, w, lens, table, None, max_len, False)
        d.top_k_per_row_decode(logits, n, lens, out, B * n, logits.stride(0), logits.stride(1), topk)
        return out

    out = torch.full((B * n, topk), -7, dtype=torch.int32, device=dev)
    check_cuda_graph(decode, (*inputs(10), out), [(*inputs(s), out) for s in (11, 12)])
