"""Indexer Q: `fused_indexer_q_rope_quant`, `pack_seq_triton` and `unpack_seq_triton`.

Bytes one call must move:
* Q RoPE + quant: per (token, head) 256 B of bf16 q read, 128 B of fp8 codes written, the head weight read
  (4 B fp32) and written (4 B fp32); per token its cos/sin row (64 x 4 B, fp32 cache) and its position (8 B).
  Positions are random over a 1M-row cos/sin cache (every token reads its own row).
* pack: per packed row D elements written, and read where a token fills it (lengths and x's padding rows: a few
  bytes); unpack: per output row D elements written, and read where a request's row fills it.
The decode shapes of the indexer: B = 1024 requests of next_n = 2 tokens, q_fp8 rows of 64 x 128 B and fp32
weights rows of 64 heads packed, top-k rows of 512 int32 unpacked (lengths random in [1, 2]).
Judged against the copy ceiling of the same run.
"""
from __future__ import annotations

import dataclasses

import torch

from torch_dsv4_ops import layout
from torch_dsv4_ops.ops import indexer_q as ops
from torch_dsv4_ops.reference import indexer_q as reference
from torch_dsv4_ops.reference.k_cache import fp8_format

from . import harness

FAMILY = "indexer_q"

HEADS = 64
MAX_POS = 1 << 20
CPU_MAX_POS = 4096
Q_T = (256, 4096, 65536)
CPU_Q_T = (16, 64)
HEADLINE_T = 65536
SEQ = (1024, 2)                # decode requests x next_n
CPU_SEQ = (8, 2)
Q_TARGET_PCT = 80.0
CHECK_TOKENS = 2048                  # tokens compared with the reference after timing


@dataclasses.dataclass(frozen=True)
class Spec:
    op: str                  # "q", "pack_q", "pack_weights" or "unpack_topk"
    T: int = 0               # q tokens
    B: int = 0               # pack/unpack requests
    N: int = 0               # rows per request (next_n)

    @property
    def name(self) -> str:
        return f"q rope+quant T={self.T} H={HEADS}" if self.op == "q" else f"{self.op} B={self.B} n={self.N}"

    @property
    def row(self) -> tuple[tuple, torch.dtype]:
        """(trailing shape, dtype) of one packed row."""
        return {"pack_q": ((HEADS, layout.INDEXER_DIM), torch.uint8), "pack_weights": ((HEADS,), torch.float32),
                "unpack_topk": ((layout.INDEX_TOPK,), torch.int32)}[self.op]

    def params(self) -> dict:
        if self.op == "q":
            return dict(op="fused_indexer_q_rope_quant", T=self.T, H=HEADS, cos_sin="fp32", max_pos=MAX_POS,
                        weights="fp32", positions="random int64")
        shape, dtype = self.row
        return dict(op=self.op, T=self.B * self.N, B=self.B, next_n=self.N, row=list(shape), dtype=str(dtype),
                    lengths="random in [1, next_n]")

    def row_bytes(self) -> int:
        shape, dtype = self.row
        n = 1
        for s in shape:
            n *= s
        return n * torch.empty((), dtype=dtype).element_size()

    def bytes_per_call(self) -> int:
        if self.op == "q":
            per_row = 2 * layout.INDEXER_DIM + layout.INDEXER_DIM + 4 + 4
            return self.T * (HEADS * per_row + 4 * reference.ROPE_DIM + 8)
        # every output row written once; about 3/4 of the rows read (lengths in [1, 2])
        rows = self.B * self.N
        return rows * self.row_bytes() + (3 * rows // 4) * self.row_bytes() + 8 * self.B


def _max_pos(device) -> int:
    return MAX_POS if device.type == "cuda" else CPU_MAX_POS


def _cos_sin(device) -> torch.Tensor:
    inv = 10000.0 ** (-torch.arange(reference.ROPE_PAIRS, dtype=torch.float32, device=device) / reference.ROPE_PAIRS)
    ang = torch.arange(_max_pos(device), dtype=torch.float32, device=device)[:, None] * inv
    return torch.cat([ang.cos(), ang.sin()], 1)


def build_q(s: Spec, device) -> harness.Workload:
    set_bytes = s.T * HEADS * (2 * layout.INDEXER_DIM + 4) + s.T * 8
    nsets = harness.rotation_sets(set_bytes, device)
    cs = _cos_sin(device)
    qs = [(torch.randn(s.T, HEADS, layout.INDEXER_DIM, device=device) * 3).to(torch.bfloat16) for _ in range(nsets)]
    ws = [torch.randn(s.T, HEADS, device=device) for _ in range(nsets)]
    pos = [torch.randint(0, _max_pos(device), (s.T,), device=device) for _ in range(nsets)]
    q_fp8 = torch.empty(s.T, HEADS, layout.INDEXER_DIM, dtype=torch.uint8, device=device)
    w_out = torch.empty(s.T, HEADS, dtype=torch.float32, device=device)
    scales = (layout.INDEXER_DIM ** -0.5, HEADS ** -0.5)

    def run(i: int) -> None:
        ops.fused_indexer_q_rope_quant(pos[i], qs[i], cs, ws[i], *scales,
                                                                output_buffers=(q_fp8, w_out))

    def check() -> str:
        q_fp8.fill_(0xA5)
        run(0)
        n = min(s.T, CHECK_TOKENS)
        fmt = ops.q_format(torch.uint8, q_fp8.device)
        codes, w = reference.fused_indexer_q_rope_quant(pos[0][:n].cpu(), qs[0][:n].cpu(), cs.cpu(), ws[0][:n].cpu(),
                                                        *scales, fp8_format(fmt is layout.E4M3FNUZ))
        bad = int((q_fp8[:n].cpu() != codes).sum()) + int((w_out[:n].cpu().view(torch.int32)
                                                           != w.view(torch.int32)).sum())
        return "ok" if bad == 0 else f"MISMATCH: {bad} elements of the first {n} tokens differ from the reference"

    return harness.Workload(run, nsets, s.bytes_per_call(), check)


def build_seq(s: Spec, device) -> harness.Workload:
    shape, dtype = s.row
    rows = s.B * s.N
    nsets = harness.rotation_sets(2 * rows * s.row_bytes(), device)
    lens = [torch.randint(1, s.N + 1, (s.B,), device=device, dtype=torch.int32) for _ in range(nsets)]
    if s.op == "unpack_topk":
        xs = [torch.randint(-1, 1 << 20, (s.B, s.N) + shape, device=device, dtype=dtype) for _ in range(nsets)]
        out = torch.empty((rows,) + shape, dtype=dtype, device=device)
    else:
        xs = [(torch.randint(0, 256, (rows,) + shape, device=device, dtype=torch.uint8) if dtype == torch.uint8
               else torch.randn((rows,) + shape, device=device)) for _ in range(nsets)]
        out = torch.empty((s.B, s.N) + shape, dtype=dtype, device=device)

    def run(i: int) -> None:
        if s.op == "unpack_topk":
            ops.unpack_seq_triton(xs[i], lens[i], total=rows, out=out)
        else:
            ops.pack_seq_triton(xs[i], lens[i], 0, max_len=s.N, out=out)

    def check() -> str:
        out.view(torch.uint8).fill_(0xA5)
        run(0)
        expected = torch.empty(out.shape, dtype=dtype)
        if s.op == "unpack_topk":
            reference.unpack_seq(xs[0].cpu(), lens[0].cpu(), rows, expected)
        else:
            reference.pack_seq(xs[0].cpu(), lens[0].cpu(), 0, s.N, expected)
        bad = int((reference.bits_view(out.cpu()) != reference.bits_view(expected)).sum())
        return "ok" if bad == 0 else f"MISMATCH: {bad} output elements differ from the reference"

    return harness.Workload(run, nsets, s.bytes_per_call(), check)


def _case(s: Spec) -> harness.Case:
    build = build_q if s.op == "q" else build_seq
    return harness.sized_case(s.name, lambda device: build(s, device), s.params(), s.bytes_per_call(),
                              series="q" if s.op == "q" else None)


def cases(quick: bool, device: torch.device) -> list[harness.Case]:
    cuda = device.type == "cuda"
    q_t = (Q_T[0], Q_T[-1]) if cuda and quick else Q_T if cuda else CPU_Q_T
    b, n = SEQ if cuda else CPU_SEQ
    seq = [Spec(op, B=b, N=n) for op in ("pack_q", "pack_weights", "unpack_topk")]
    return [_case(Spec("q", T=t)) for t in q_t] + [_case(s) for s in seq]


def targets(doc: dict) -> dict:
    """Q RoPE + quant at T = 65536, H = 64 against the copy ceiling (the brief's >= 80 %)."""
    copy = (doc.get("copy_ceiling") or {}).get("gbps")
    c = {c["name"]: c for c in doc["cases"]}.get(Spec("q", T=HEADLINE_T).name, {})
    pct = harness.sig(100 * c["gbps"] / copy) if c.get("gbps") and copy else None
    return {"q_T65536_pct_of_copy": {"target": f">= {Q_TARGET_PCT:g} (% of copy bandwidth)", "value": pct,
                                     "pass": None if pct is None else pct >= Q_TARGET_PCT}}
