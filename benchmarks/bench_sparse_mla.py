"""Sparse MLA attention: `flash_mla_with_kvcache` (decode over fp8_ds_mla caches) and
`flash_mla_sparse_fwd` (prefill over a bf16 workspace).

Shapes of issue 9: 64 query heads, head dim 512, caches of block size 64 written by
`quantize_and_insert_k_cache` (engine page stride). C4A decode: each query row selects its 128 SWA
rows from the SWA cache and 512 top-k rows (random, of 8192 compressed entries per request) from an
extra cache; SWA-only: the 128 SWA rows. Prefill: 4096 query tokens, each selecting 640 random rows of
a 16384-row bf16 workspace. Ceilings measured in the same run: read bandwidth (`torch.sum` over 2
GiB) and bf16 matmul throughput (8192^3). Floor of a case = max(bytes / read BW, FLOP / matmul
rate), bytes = selected rows x 584 + Q + O, FLOP = 4 * heads * rows * 512 per query row. Beside
them, a plain-torch path (gather + dequantise + masked softmax attention) at B = 64.
"""
from __future__ import annotations

import dataclasses

import torch

import torch_dsv4_ops
from torch_dsv4_ops import layout
from torch_dsv4_ops.reference import k_cache as k_cache_reference
from torch_dsv4_ops.testing import TOLERANCES

from . import harness

FAMILY = "sparse_mla"

HQ, BS = 64, layout.SWA_BLOCK_SIZE
SWA, TOPK = layout.SLIDING_WINDOW, layout.INDEX_TOPK
COMPRESSED_PER_REQUEST = 8192          # C4A entries of a 32K-token context
PREFILL_TOKENS, PREFILL_ROWS, PREFILL_WORKSPACE = 4096, SWA + TOPK, 16384
DECODE_TARGET_X = 2.0                  # time <= 2x the floor
GRAPH_TARGET_US = 10.0                 # B = 1 C4A inside a CUDA graph
PREFILL_TARGET_PCT = 40.0              # of the matmul throughput
PLAIN_TARGET_X = 5.0                   # the op beats the plain-torch path by this factor at B = 64
WRITE_CHUNK = 1 << 18                  # rows per quantize_and_insert_k_cache call while filling caches


@dataclasses.dataclass(frozen=True)
class Spec:
    kind: str                  # "c4a", "swa", "prefill" or "plain" (plain-torch C4A decode)
    batch: int                 # decode rows (s_q = 1) or prefill tokens
    graph: bool = False
    cpu: bool = False          # small CPU smoke sizes
    hq: int = HQ               # query heads (probes; the benchmark's cases have HQ)

    @property
    def name(self) -> str:
        if self.kind == "prefill":
            return f"prefill Tq={self.batch} rows={self.rows}"
        what = {"c4a": "C4A", "swa": "SWA-only", "plain": "plain-torch C4A"}[self.kind]
        return f"decode {what} B={self.batch}" + (" (graph)" if self.graph else "")

    @property
    def heads(self) -> int:
        return 16 if self.cpu else self.hq

    @property
    def swa(self) -> int:
        return 16 if self.cpu else SWA

    @property
    def topk(self) -> int:
        return 0 if self.kind == "swa" else 32 if self.cpu else TOPK

    @property
    def rows(self) -> int:
        if self.kind == "prefill":
            return 40 if self.cpu else PREFILL_ROWS
        return self.swa + self.topk

    def bytes_per_call(self) -> int:
        row_bytes = 2 * layout.HEAD_DIM if self.kind == "prefill" else layout.TOKEN_BYTES
        return self.batch * (self.rows * row_bytes + 2 * self.heads * layout.HEAD_DIM * 2)

    def flops(self) -> int:
        return 4 * self.heads * self.rows * layout.HEAD_DIM * self.batch

    def params(self) -> dict:
        return dict(T=self.batch, Hq=self.heads, rows=self.rows, swa=self.swa, topk=self.topk, block_size=BS,
                    flops=self.flops(), graph=self.graph)


def _filled_cache(num_blocks: int, seed: int, device) -> torch.Tensor:
    """[num_blocks, 64, 584] view of an engine-padded cache, every slot written from N(0, 1) rows."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = torch.zeros(num_blocks, layout.ds_mla_block_stride(BS), dtype=torch.uint8, device=device)
    cache = pages[:, :layout.ds_mla_block_bytes(BS)].view(num_blocks, BS, layout.TOKEN_BYTES)
    total = num_blocks * BS
    for start in range(0, total, WRITE_CHUNK):
        n = min(WRITE_CHUNK, total - start)
        rows = torch.randn(n, layout.HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
        torch_dsv4_ops.quantize_and_insert_k_cache(rows, cache, torch.arange(start, start + n, device=device), BS)
    return cache


def _decode_sets(s: Spec, device, nsets: int):
    """nsets argument tuples of flash_mla_with_kvcache (positional, then out/lse/workspace keywords)."""
    g = torch.Generator(device=device).manual_seed(1)
    b, swa_blocks = s.batch, layout.cdiv(s.swa, BS)
    swa_cache = _filled_cache(nsets * b * swa_blocks, 2, device)
    x_per = 4 * s.topk if s.cpu else COMPRESSED_PER_REQUEST
    x_cache = _filled_cache(b * layout.cdiv(x_per, BS), 3, device) if s.topk else None
    sink = torch.randn(s.heads, generator=g, device=device)
    sets = []
    for i in range(nsets):
        base = (i * b + torch.arange(b, device=device)) * swa_blocks * BS
        swa_idx = (base[:, None] + torch.randperm(swa_blocks * BS, generator=g, device=device)[:s.swa]).int()
        q = torch.randn(b, 1, s.heads, layout.HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
        extra = {}
        if s.topk:
            pick = torch.rand(b, x_per, generator=g, device=device).argsort(1)[:, :s.topk]
            x_idx = (torch.arange(b, device=device)[:, None] * layout.cdiv(x_per, BS) * BS + pick).int()
            extra = dict(extra_k_cache=x_cache, extra_indices_in_kvcache=x_idx[:, None, :])
        sets.append((q, swa_cache, swa_idx[:, None, :], sink, extra))
    return sets


def _call_decode(q, cache, idx, sink, extra, **out):
    return torch_dsv4_ops.flash_mla_with_kvcache(q, cache, None, None, layout.HEAD_DIM, None, softmax_scale=None,
                                                 is_fp8_kvcache=True, indices=idx, attn_sink=sink, **extra, **out)


def decode_runner(kind: str, batch: int, device, nsets: int = 2, hq: int = HQ):
    """(run, out, lse) for probes: run(i) calls the op on input set i % nsets of the benchmark's case (at `hq`
    heads) into the fixed buffers out and lse."""
    s = Spec(kind, batch, hq=hq)
    sets = _decode_sets(s, device, nsets)
    out = torch.empty_like(sets[0][0])
    lse = torch.empty(batch, s.heads, 1, device=device)
    ws = torch.empty(torch_dsv4_ops.sparse_mla_workspace_size(batch, 1, s.heads, device), dtype=torch.bfloat16,
                     device=device)

    def run(i: int) -> None:
        _call_decode(*sets[i % nsets], out=out, lse=lse, workspace=ws)

    return run, out, lse


def dequantized_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Plain torch: bf16 rows [..., 512] of valid int64 `slots` of a [nb, 64, 584] fp8_ds_mla cache (§2.1):
    gather each slot's bytes, then the reference's dequantisation (torch ops, on the cache's device)."""
    pages = k_cache_reference.pages(cache, BS)
    blk, off = slots.reshape(-1, 1) // BS, slots.reshape(-1, 1) % BS
    data = pages[blk, off * layout.TOKEN_DATA_BYTES + torch.arange(layout.TOKEN_DATA_BYTES, device=cache.device)]
    scale = pages[blk, layout.ds_mla_scale_offset(BS, 0) + off * layout.SCALE_BYTES
                  + torch.arange(layout.SCALE_BYTES, device=cache.device)]
    rows = k_cache_reference.dequantize_rows(data, scale, layout.E4M3FN)
    return rows.reshape(*slots.shape, layout.HEAD_DIM)


def plain_decode(q, cache, idx, sink, extra) -> torch.Tensor:
    """The plain-torch path: gather + dequantise the selected rows, masked softmax attention with the sink."""
    slots = [idx[:, 0].long()]
    caches = [cache]
    if extra:
        slots.append(extra["extra_indices_in_kvcache"][:, 0].long())
        caches.append(extra["extra_k_cache"])
    rows = torch.cat([dequantized_rows(c, s.clamp(min=0)) for c, s in zip(caches, slots)], 1)   # [B, n, 512]
    valid = torch.cat([s >= 0 for s in slots], 1)
    scores = torch.einsum("bhd,bnd->bhn", q[:, 0].float(), rows.float()) * layout.MLA_SOFTMAX_SCALE
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    scores = torch.cat([scores, sink[None, :, None].expand(q.shape[0], -1, 1)], -1)
    p = torch.softmax(scores, -1)[..., :-1]
    return torch.einsum("bhn,bnd->bhd", p, rows.float()).to(torch.bfloat16)[:, None]


def _build_decode(s: Spec, device) -> harness.Workload:
    nsets = harness.rotation_sets(s.bytes_per_call(), device)
    sets = _decode_sets(s, device, nsets)
    q0 = sets[0][0]
    # one set of output buffers (fixed addresses, no allocation per call)
    outs = dict(out=torch.empty_like(q0), lse=torch.empty(s.batch, s.heads, 1, device=device),
                workspace=torch.empty(torch_dsv4_ops.sparse_mla_workspace_size(s.batch, 1, s.heads, device),
                                      dtype=torch.bfloat16, device=device))
    if s.kind == "plain":
        def run(i: int) -> None:
            plain_decode(*sets[i])
        return harness.Workload(run, nsets, s.bytes_per_call(), None)

    def run(i: int) -> None:
        _call_decode(*sets[i], **outs)

    def check() -> str:
        out, _ = _call_decode(*sets[0])
        ref = plain_decode(*sets[0])
        worst = float((out.float() - ref.float()).abs().max())
        tol = TOLERANCES[torch.bfloat16]
        return "ok" if worst <= tol else f"MISMATCH: max error {worst:.3g} (tolerance {tol})"

    return harness.Workload(run, nsets, s.bytes_per_call(), check)


def _build_prefill(s: Spec, device) -> harness.Workload:
    g = torch.Generator(device=device).manual_seed(4)
    rows = 64 if s.cpu else PREFILL_WORKSPACE
    kv = torch.randn(rows, 1, layout.HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
    q = torch.randn(s.batch, s.heads, layout.HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
    idx = torch.rand(s.batch, rows, generator=g, device=device).argsort(1)[:, None, :s.rows].int().contiguous()
    sink = torch.randn(s.heads, generator=g, device=device)
    out = torch.empty_like(q)
    max_logits = torch.empty(s.batch, s.heads, device=device)
    lse = torch.empty(s.batch, s.heads, device=device)

    def run(i: int) -> None:
        torch_dsv4_ops.flash_mla_sparse_fwd(q, kv, idx, layout.MLA_SOFTMAX_SCALE, attn_sink=sink, out=out,
                                            max_logits=max_logits, lse=lse)

    def check() -> str:
        o, _, _ = torch_dsv4_ops.flash_mla_sparse_fwd(q[:64], kv, idx[:64], layout.MLA_SOFTMAX_SCALE,
                                                      attn_sink=sink)
        sel = kv[idx[:64, 0].long(), 0].float()                                  # [64, rows, 512]
        scores = torch.einsum("thd,tnd->thn", q[:64].float(), sel) * layout.MLA_SOFTMAX_SCALE
        scores = torch.cat([scores, sink[None, :, None].expand(scores.shape[0], -1, 1)], -1)
        ref = torch.einsum("thn,tnd->thd", torch.softmax(scores, -1)[..., :-1], sel)
        worst = float((o.float() - ref).abs().max())
        tol = TOLERANCES[torch.bfloat16]
        return "ok" if worst <= tol else f"MISMATCH: max error {worst:.3g} (tolerance {tol})"

    return harness.Workload(run, 1, s.bytes_per_call(), check)


def build(s: Spec, device) -> harness.Workload:
    return _build_prefill(s, device) if s.kind == "prefill" else _build_decode(s, device)


def extras(device, quick: bool) -> dict:
    """Read ceiling and bf16 matmul rate, measured now (the floors of this family's targets)."""
    return harness.read_matmul_ceilings(device)


def _specs(quick: bool, device) -> list[Spec]:
    if device.type != "cuda":
        return [Spec("c4a", 2, cpu=True), Spec("swa", 2, cpu=True), Spec("prefill", 4, cpu=True)]
    out = [Spec("c4a", 64), Spec("c4a", 256), Spec("swa", 256), Spec("c4a", 1, graph=True),
           Spec("prefill", PREFILL_TOKENS), Spec("plain", 64)]
    return out[:4] + out[5:] if quick else out


def cases(quick: bool, device: torch.device) -> list[harness.Case]:
    return [harness.Case(name=s.name, build=lambda device, s=s: build(s, device), params=s.params(),
                         method="graph" if s.graph else "do_bench", series=None) for s in _specs(quick, device)]


def targets(doc: dict) -> dict:
    """Decode time against its floor, the B = 1 graph time, prefill against the matmul rate, and the
    speed-up over the plain-torch path."""
    by_name = {c["name"]: c for c in doc["cases"]}
    read = (doc.get("read_ceiling") or {}).get("gbps")
    tflops = (doc.get("matmul_ceiling") or {}).get("tflops")
    out = {}
    for s in (Spec("c4a", 64), Spec("c4a", 256), Spec("swa", 256), Spec("plain", 64)):
        c = by_name.get(s.name, {})
        harness.add_floors(c, s.bytes_per_call(), s.flops(), read, tflops)
        if s.kind == "plain":
            continue
        value = c.get("x_of_floor")
        out[f"decode_{s.kind}_B{s.batch}_x_of_floor"] = {
            "target": f"<= {DECODE_TARGET_X:g} x max(bytes / read BW, FLOP / matmul rate)", "value": value,
            "pass": None if value is None else value <= DECODE_TARGET_X}
    c = by_name.get(Spec("c4a", 1, graph=True).name, {})
    out["decode_c4a_B1_graph_us"] = {"target": f"<= {GRAPH_TARGET_US:g} us inside a CUDA graph",
                                     "value": c.get("us"), "pass": None if not c.get("us") else
                                     c["us"] <= GRAPH_TARGET_US}
    s = Spec("prefill", PREFILL_TOKENS)
    c = by_name.get(s.name, {})
    pct = harness.sig(100 * s.flops() / c["us"] / 1e6 / tflops) if c.get("us") and tflops else None
    if c:
        c["pct_of_matmul"] = pct
        c["tflops"] = harness.sig(s.flops() / c["us"] / 1e6) if c.get("us") else None
    out["prefill_pct_of_matmul"] = {"target": f">= {PREFILL_TARGET_PCT:g} (% of the bf16 matmul rate; FLOP / time)",
                                    "value": pct, "pass": None if pct is None else pct >= PREFILL_TARGET_PCT}
    op, plain = by_name.get(Spec("c4a", 64).name, {}), by_name.get(Spec("plain", 64).name, {})
    ratio = harness.sig(plain["us"] / op["us"]) if op.get("us") and plain.get("us") else None
    out["plain_torch_over_op_B64"] = {"target": f">= {PLAIN_TARGET_X:g} (plain-torch time / op time, C4A B = 64)",
                                      "value": ratio, "pass": None if ratio is None else ratio >= PLAIN_TARGET_X}
    return out
