"""Sparse index ops (SPEC §3.3): bandwidth at the issue's sizes, latency at decode sizes.

Bytes one call must move: every input read once (index rows, per-token/per-request metadata; the
block table counted once, as rows of the requests in the batch) and every output written once.
Input sets rotate (harness.rotation_sets) so that together they exceed L2.
"""
from __future__ import annotations

import dataclasses

import torch

import torch_dsv4_ops
from torch_dsv4_ops import layout

from . import harness

FAMILY = "sparse_index"

WINDOW, TOPK, RATIO, SWA_BS, C_BS = layout.SLIDING_WINDOW, layout.INDEX_TOPK, 4, layout.SWA_BLOCK_SIZE, 64
GLOBAL_T, MIXED_T = 16384, 4096
DECODE_T = (1, 16, 64, 256)
CPU_T = (16,)
GLOBAL_TARGET_PCT, MIXED_TARGET_PCT, GRAPH_TARGET_US = 85.0, 80.0, 2.0
OPS = ("global", "combine", "flashinfer", "c128a", "fill")


@dataclasses.dataclass(frozen=True)
class Spec:
    op: str
    T: int
    R: int = 0          # requests (0: T // 512 prefill requests, or T decodes)

    @property
    def name(self) -> str:
        return f"{self.op} T={self.T}"

    def params(self) -> dict:
        return dict(op=self.op, T=self.T, window=WINDOW, topk=TOPK, ratio=RATIO if self.op != "c128a" else 128)


def _reqs(T: int, decode: bool):
    """(query lens, seq lens): T decodes, or mostly prefill (8 decodes, then requests of 512 tokens)."""
    if decode:
        return [1] * T, [4096 + 37 * i for i in range(T)]
    nd = min(8, T)
    q = [1] * nd
    rest = T - nd
    while rest:
        q.append(min(512, rest))
        rest -= q[-1]
    return q, [x + 2000 + 13 * i for i, x in enumerate(q)]


def _set(spec: Spec, device, g):
    """One input set and (bytes of inputs, bytes of outputs), and the call."""
    T = spec.T
    decode = T <= 256
    q, seq = _reqs(T, decode)
    R = len(q)
    qsl = torch.tensor([0] + list(torch.tensor(q).cumsum(0)), dtype=torch.int32, device=device)
    t2r = torch.repeat_interleave(torch.arange(R, dtype=torch.int32), torch.tensor(q)).to(device)
    seq_t = torch.tensor(seq, dtype=torch.int32, device=device)
    width = layout.cdiv(max(seq) + 1, C_BS)
    bt = torch.randint(0, 50000, (R, width), generator=g, dtype=torch.int32).to(device)
    i32 = 4
    if spec.op == "global":
        topk = torch.randint(-1, max(seq) // RATIO, (T, TOPK), generator=g, dtype=torch.int32).to(device)
        valid = torch.ones(T, dtype=torch.bool, device=device)
        out = (torch.empty(T, TOPK, dtype=torch.int32, device=device), torch.empty(T, dtype=torch.int32, device=device))
        args = (topk, t2r, bt, C_BS, valid)
        nin = T * TOPK * i32 + T * (i32 + 1) + bt.numel() * i32
        return (lambda: torch_dsv4_ops.compute_global_topk_indices_and_lens(*args, output_buffers=out)), nin, \
            T * (TOPK + 1) * i32, (args, out)
    if spec.op == "combine":
        gl = torch.tensor([x + min(s - x, WINDOW - 1) for x, s in zip(q, seq)], dtype=torch.int32, device=device)
        N = max(seq) // RATIO
        M = N + int(gl.max())
        topk = torch.randint(-1, N, (T, TOPK), generator=g, dtype=torch.int32).to(device)
        C = layout.combine_width(TOPK, WINDOW)
        out = (torch.empty(T, C, dtype=torch.int32, device=device), torch.empty(T, dtype=torch.int32, device=device))
        args = (topk, qsl, seq_t, gl, WINDOW, RATIO, TOPK, M, N)
        nin = T * TOPK * i32 + (3 * R + 1) * i32
        return (lambda: torch_dsv4_ops.combine_topk_swa_indices(*args, out=out)), nin, T * (C + 1) * i32, (args, out)
    if spec.op == "flashinfer":
        Td = sum(1 for x in q if x == 1)
        Tp = T - Td
        dswa = torch.randint(0, 2**30, (Td, WINDOW), generator=g, dtype=torch.int32).to(device)
        dcomp = torch.randint(-1, 1000, (Td, TOPK), generator=g, dtype=torch.int32).to(device)
        ptopk = torch.randint(-1, 1000, (Tp, TOPK), generator=g, dtype=torch.int32).to(device)
        sbt = torch.randint(0, 50000, (R, layout.cdiv(max(seq) + 1, SWA_BS)), generator=g,
                            dtype=torch.int32).to(device)
        valid = torch.ones(Td, dtype=torch.bool, device=device)
        P = layout.flashinfer_compressed_width(TOPK, TOPK)
        out = (torch.empty(T, WINDOW + P, dtype=torch.int32, device=device),
               torch.empty(T, dtype=torch.int32, device=device))
        args = (dswa, dcomp, None, ptopk, qsl, seq_t, t2r, sbt, SWA_BS, bt, C_BS, WINDOW, RATIO, TOPK, True, valid)
        nin = (dswa.numel() + dcomp.numel() + ptopk.numel() + T + 2 * R + 1 + sbt.numel() + bt.numel()) * i32 + Td
        return (lambda: torch_dsv4_ops.build_flashinfer_mixed_sparse_indices(*args, out=out)), nin, \
            T * (WINDOW + P + 1) * i32, (args, out)
    if spec.op == "c128a":
        Kc = 1024
        positions = torch.randint(0, 128 * Kc, (T,), generator=g).to(device)
        bt2 = torch.randint(0, 50000, (T, Kc // 2), generator=g, dtype=torch.int32).to(device)
        t2r_d = torch.arange(T, dtype=torch.int32, device=device)
        bufs = (torch.empty(T, Kc, dtype=torch.int32, device=device), torch.empty(T, dtype=torch.int32, device=device),
                torch.empty(1, Kc, dtype=torch.int32, device=device))
        args = (positions, 128, T, t2r_d, bt2, 2, positions)
        return (lambda: torch_dsv4_ops.build_c128a_topk_metadata(*args, *bufs)), T * 20 + bt2.numel() * i32, \
            T * (Kc + 1) * i32, (args, bufs)
    positions = torch.randint(0, 4 * TOPK, (T,), generator=g).to(device)
    buf = torch.empty(T, TOPK, dtype=torch.int32, device=device)
    return (lambda: torch_dsv4_ops.fill_short_context_topk_indices(buf, positions, TOPK, RATIO)), T * 8, \
        T * TOPK * i32, ((buf, positions, TOPK, RATIO), None)


def build(spec: Spec, device: torch.device) -> harness.Workload:
    g = torch.Generator().manual_seed(spec.T)
    _, nin, nout, _ = _set(spec, "cpu", torch.Generator().manual_seed(0))
    nsets = harness.rotation_sets(nin + nout, device)
    sets = [_set(spec, device, g) for _ in range(nsets)]

    def run(i: int) -> None:
        sets[i][0]()

    def check() -> str:
        """Set 0 on the device against the CPU reference."""
        fn, _, _, (args, out) = sets[0]
        fn()
        cpu = lambda x: x.cpu() if isinstance(x, torch.Tensor) else x   # noqa: E731
        with torch_dsv4_ops.cpu_implementation("reference"):
            if spec.op == "global":
                exp = torch_dsv4_ops.compute_global_topk_indices_and_lens(*map(cpu, args))
            elif spec.op == "combine":
                exp = torch_dsv4_ops.combine_topk_swa_indices(*map(cpu, args))
                exp = (exp[0][:, :out[0].shape[1]], exp[1])
            elif spec.op == "flashinfer":
                exp = torch_dsv4_ops.build_flashinfer_mixed_sparse_indices(*map(cpu, args))
            elif spec.op == "c128a":
                bufs = tuple(b.cpu().clone() for b in out)
                torch_dsv4_ops.build_c128a_topk_metadata(*map(cpu, args), *bufs)
                exp = bufs[:2]
                out = out[:2]
            else:
                buf = args[0].cpu().clone()
                torch_dsv4_ops.fill_short_context_topk_indices(buf, *map(cpu, args[1:]))
                exp, out = (buf,), (args[0],)
        bad = sum(int((a.cpu() != e).sum()) for a, e in zip(out, exp))
        return "ok" if bad == 0 else f"MISMATCH: {bad} elements differ from the reference"

    return harness.Workload(run, nsets, nin + nout, check)


def _case(spec: Spec) -> harness.Case:
    return harness.Case(name=spec.name, build=lambda device: build(spec, device), params=spec.params(),
                        method="graph", series=spec.op)


def headline_specs() -> list[Spec]:
    return [Spec("global", GLOBAL_T), Spec("combine", MIXED_T), Spec("flashinfer", MIXED_T)]


def cases(quick: bool, device: torch.device) -> list[harness.Case]:
    """Headline bandwidth cases first, then every op at decode sizes (CUDA-graph latency)."""
    if device.type == "cpu":
        return [_case(Spec(op, t)) for op in OPS for t in CPU_T]
    decode = DECODE_T[::2] + DECODE_T[-1:] if quick else DECODE_T
    return [_case(s) for s in headline_specs()] + [_case(Spec(op, t)) for op in OPS for t in decode]


def targets(doc: dict) -> dict:
    by_name = {c["name"]: c for c in doc["cases"]}
    out = {}
    for spec, pct in zip(headline_specs(), (GLOBAL_TARGET_PCT, MIXED_TARGET_PCT, MIXED_TARGET_PCT)):
        value = by_name.get(spec.name, {}).get("pct_of_copy")
        out[f"{spec.op}_T{spec.T}_pct_of_copy"] = {
            "target": f">= {pct:g} (% of copy ceiling; window {WINDOW}, top-k {TOPK}, ratio {RATIO})",
            "value": value, "pass": None if value is None else value >= pct}
    small = [c for c in doc["cases"] if c["params"]["T"] <= 256 and c.get("series")]
    worst = max((c["us"] for c in small if "us" in c), default=None)
    out["graph_us_per_call_decode"] = {
        "target": f"<= {GRAPH_TARGET_US:g} us per call in a CUDA graph, every index op, T <= 256",
        "value": worst, "pass": None if not small else (all("us" in c for c in small) and worst is not None
                                                          and worst <= GRAPH_TARGET_US)}
    return out
