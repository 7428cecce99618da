"""fp8_ds_mla K cache: `quantize_and_insert_k_cache` and `dequantize_and_gather_k_cache`.

Bytes one call must move:
* insert: per token 1024 B of bf16 K read and 584 B of cache written (slot_mapping: 8 B more);
* gather: per gathered token 584 B of cache read and 1024 B of bf16 written (table, lengths: a
  few bytes per request).
Insert slots are a random permutation of the cache's slots (block size 64, padded pages), plus one
probe with consecutive slots (the cost of random writes; not a target); gather tables hold random
physical blocks.
"""
from __future__ import annotations

import dataclasses

import torch

import torch_dsv4_ops
from torch_dsv4_ops import layout
from torch_dsv4_ops.reference import k_cache as reference

from . import harness

FAMILY = "k_cache"

INSERT_T = (64, 1024, 16384, 65536)
QUICK_INSERT_T = (64, 65536)
CPU_INSERT_T = (16, 128)
HEADLINE_T = 65536
GATHER_WHOLE = (16, 8192)          # 16 requests x 8192 tokens, whole sequences
GATHER_WINDOW = (16, 128)          # 16 requests x 128-token SWA window (decode step), in a CUDA graph
CPU_GATHER = ((2, 64), (4, 128))
BW_TARGET_PCT = 80.0
WINDOW_TARGET_US = 3.0
BS = layout.SWA_BLOCK_SIZE


@dataclasses.dataclass(frozen=True)
class Spec:
    op: str                   # "insert" or "gather"
    T: int = 0                # insert tokens
    R: int = 0                # gather requests
    L: int = 0                # gather tokens per request
    use_fnuz: bool = False
    window: bool = False      # gather: the last L tokens of longer sequences, written at an offset
    sequential: bool = False  # insert: consecutive slots (a probe of the random-write cost; not a target)

    @property
    def series(self) -> str:
        fmt = "fnuz" if self.use_fnuz else "ocp"
        return f"insert {fmt}" if self.op == "insert" else f"gather {fmt}" + (" window" if self.window else "")

    @property
    def name(self) -> str:
        if self.op == "insert":
            return f"{self.series} T={self.T}" + (" sequential slots" if self.sequential else "")
        return f"{self.series} R={self.R} L={self.L}"

    def params(self) -> dict:
        p = dict(op=self.op, block_size=BS, use_fnuz=self.use_fnuz, block_stride=layout.ds_mla_block_stride(BS))
        if self.op == "insert":
            p.update(T=self.T, slots="consecutive" if self.sequential else "random unique")
        else:
            p.update(T=self.R * self.L, R=self.R, L=self.L, window=self.window, table="random physical blocks")
        return p

    def tokens(self) -> int:
        return self.T if self.op == "insert" else self.R * self.L

    def bytes_per_call(self) -> int:
        k_bytes = 2 * layout.HEAD_DIM
        if self.op == "insert":
            return self.T * (k_bytes + layout.TOKEN_BYTES + 8)
        return self.R * self.L * (layout.TOKEN_BYTES + k_bytes) + self.R * 8


def _cache(num_blocks: int, device) -> torch.Tensor:
    return torch.zeros(num_blocks, layout.ds_mla_block_stride(BS), dtype=torch.uint8, device=device)


def build_insert(s: Spec, device) -> harness.Workload:
    set_bytes = s.T * (2 * layout.HEAD_DIM + 8)
    nsets = harness.rotation_sets(set_bytes, device)
    num_blocks = layout.cdiv(2 * s.T * nsets, BS)
    ks = [(torch.randn(s.T, layout.HEAD_DIM, device=device) * 3).to(torch.bfloat16) for _ in range(nsets)]
    if s.sequential:
        slots = [torch.arange(i * s.T, (i + 1) * s.T, device=device) for i in range(nsets)]
    else:
        slots = [torch.randperm(num_blocks * BS, device=device)[:s.T].contiguous() for _ in range(nsets)]
    cache = _cache(num_blocks, device)

    def run(i: int) -> None:
        torch_dsv4_ops.quantize_and_insert_k_cache(ks[i], cache, slots[i], BS, True, s.use_fnuz)

    def check() -> str:
        cache.fill_(0xA5)
        expected = cache.cpu()
        run(0)
        reference.quantize_and_insert_k_cache(ks[0].cpu(), expected, slots[0].cpu(), BS, True, s.use_fnuz)
        bad = int((cache.cpu() != expected).sum())
        return "ok" if bad == 0 else f"MISMATCH: {bad} cache bytes differ from the reference"

    return harness.Workload(run, nsets, s.bytes_per_call(), check)


def build_gather(s: Spec, device) -> harness.Workload:
    blocks_per_req = layout.cdiv(s.L, BS) + (1 if s.window else 0)
    seq_len = blocks_per_req * BS if s.window else s.L
    nsets = harness.rotation_sets(s.R * s.L * (layout.TOKEN_BYTES + 2 * layout.HEAD_DIM), device)
    num_blocks = s.R * blocks_per_req * nsets
    cache = _cache(num_blocks, device)
    filler = (torch.randn(num_blocks * BS, layout.HEAD_DIM, device=device) * 3).to(torch.bfloat16)
    torch_dsv4_ops.quantize_and_insert_k_cache(filler, cache, torch.arange(num_blocks * BS, device=device), BS,
                                               True, s.use_fnuz)   # the cache holds what the gather decodes
    del filler
    perm = torch.randperm(num_blocks, device=device)
    tables = [perm[i * s.R * blocks_per_req:(i + 1) * s.R * blocks_per_req].view(s.R, blocks_per_req).int()
              .contiguous() for i in range(nsets)]
    seq = torch.full((s.R,), seq_len, dtype=torch.int32, device=device)
    gl = torch.full((s.R,), s.L, dtype=torch.int32, device=device) if s.window else None
    offset = 3 if s.window else 0
    outs = [torch.empty(s.R, s.L + offset, layout.HEAD_DIM, dtype=torch.bfloat16, device=device)
            for _ in range(nsets)]

    def run(i: int) -> None:
        torch_dsv4_ops.dequantize_and_gather_k_cache(outs[i], cache, seq, gl, tables[i], BS, offset, s.use_fnuz)

    def check() -> str:
        outs[0].fill_(7.0)
        expected = outs[0].cpu()
        run(0)
        reference.dequantize_and_gather_k_cache(expected, cache.cpu(), seq.cpu(), None if gl is None else gl.cpu(),
                                                tables[0].cpu(), BS, offset, s.use_fnuz)
        bad = int((outs[0].cpu().view(torch.int16) != expected.view(torch.int16)).sum())
        return "ok" if bad == 0 else f"MISMATCH: {bad} output elements differ from the reference"

    return harness.Workload(run, nsets, s.bytes_per_call(), check)


def _case(s: Spec, series: bool) -> harness.Case:
    build = build_insert if s.op == "insert" else build_gather
    return harness.sized_case(s.name, lambda device: build(s, device), s.params(), s.bytes_per_call(),
                              series=s.series if series else None)


def cases(quick: bool, device: torch.device) -> list[harness.Case]:
    """Headline cases first (insert T=65536, gather 16 x 8192, gather 16 x 128 window), then the T sweep
    and FNUZ variants."""
    if device.type == "cpu":
        out = [_case(Spec("insert", T=t), series=True) for t in CPU_INSERT_T]
        out += [_case(Spec("insert", T=CPU_INSERT_T[0], use_fnuz=True), series=False)]
        out += [_case(Spec("gather", R=r, L=n, window=w), series=False) for r, n in CPU_GATHER for w in (False, True)]
        return out
    out = [_case(Spec("insert", T=HEADLINE_T), series=True),
           _case(Spec("gather", R=GATHER_WHOLE[0], L=GATHER_WHOLE[1]), series=False),
           _case(Spec("gather", R=GATHER_WINDOW[0], L=GATHER_WINDOW[1], window=True), series=False)]
    sweep = QUICK_INSERT_T if quick else INSERT_T
    out += [_case(Spec("insert", T=t), series=True) for t in sweep if t != HEADLINE_T]
    if not quick:
        out += [_case(Spec("insert", T=HEADLINE_T, sequential=True), series=False),
                _case(Spec("insert", T=HEADLINE_T, use_fnuz=True), series=False),
                _case(Spec("gather", R=GATHER_WHOLE[0], L=GATHER_WHOLE[1], use_fnuz=True), series=False),
                _case(Spec("gather", R=GATHER_WHOLE[0], L=1024, window=True), series=False)]
    return out


def targets(doc: dict) -> dict:
    """The issue's targets: insert and whole-sequence gather bandwidth, windowed-gather graph latency."""
    by_name = {c["name"]: c for c in doc["cases"]}
    out = {}
    for key, spec, what in (
            (f"insert_T{HEADLINE_T}_pct_of_copy", Spec("insert", T=HEADLINE_T),
             "block size 64, random slots; 1024 B read + 584 B written per token"),
            (f"gather_R{GATHER_WHOLE[0]}xL{GATHER_WHOLE[1]}_pct_of_copy",
             Spec("gather", R=GATHER_WHOLE[0], L=GATHER_WHOLE[1]),
             "whole sequences; 584 B read + 1024 B written per token")):
        case = by_name.get(spec.name, {})
        pct = case.get("pct_of_copy")
        out[key] = {"target": f">= {BW_TARGET_PCT:g} (% of copy ceiling; {what})", "value": pct,
                    "method": case.get("method"),
                    "do_bench_value": case.get("do_bench_crosscheck", {}).get("pct_of_copy"),
                    "pass": None if pct is None else pct >= BW_TARGET_PCT}
    win = by_name.get(Spec("gather", R=GATHER_WINDOW[0], L=GATHER_WINDOW[1], window=True).name, {})
    us = win.get("us") if win.get("method") == "graph" else None
    out[f"gather_window_R{GATHER_WINDOW[0]}xL{GATHER_WINDOW[1]}_graph_us"] = {
        "target": f"<= {WINDOW_TARGET_US:g} us per call inside a CUDA graph", "value": us,
        "pass": None if us is None else us <= WINDOW_TARGET_US}
    return out
