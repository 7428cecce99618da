"""Indexer logits: `fp8_fp4_mqa_logits` (prefill) and `fp8_fp4_paged_mqa_logits` (decode).

* Prefill: M = 4096 queries x N = 8192 keys, 64 heads, D 128, fp8 e4m3 q/k; full ranges ([0, N) for every
  query) and causal ranges (ke = N - M + m + 1, a 4096-token prefix). Judged by useful FLOP/s (2·H·D per
  (query, key) pair inside the query's range) against the fp8 matmul rate measured in the same run
  (torch._scaled_mm of 8192² e4m3; the bf16 torch.matmul rate where there is no fp8 matmul).
* Paged decode: B = 64 requests, next_n = 2, 64 heads, 16384 compressed entries each, bs 64 engine-padded
  pages at random physical blocks. Judged by bytes that must move (cache pages read, q and weights read,
  logits written) against the read bandwidth measured in the same run.
The logits go into a preallocated out= buffer (the call allocates nothing); inputs rotate over sets that
together exceed L2.
"""
from __future__ import annotations

import dataclasses

import torch

from torch_dsv4_ops import layout
from torch_dsv4_ops.ops import mqa_logits as ops
from torch_dsv4_ops.ops.indexer import indexer_k_quant_and_cache
from torch_dsv4_ops.reference import mqa_logits as reference

from . import harness

FAMILY = "mqa_logits"

HEADS, DIM = 64, 128
PREFILL_MN = (4096, 8192)
CPU_PREFILL_MN = (24, 96)
PAGED = dict(B=64, next_n=2, L=16384)
CPU_PAGED = dict(B=2, next_n=2, L=200)
BS = 64
PAGE = layout.round_up(layout.indexer_block_bytes(BS), layout.PAGE_ALIGN)
PREFILL_TARGET_PCT = 40.0      # % of the fp8 matmul rate
PAGED_TARGET_PCT = 70.0        # % of the read bandwidth
FP8_MATMUL_N = 8192
CHECK_ROWS = 8
REL_TOL = 1e-3


@dataclasses.dataclass(frozen=True)
class Spec:
    op: str                    # "prefill" or "paged"
    ranges: str = "full"       # prefill: "full" or "causal"
    m: int = 0
    n: int = 0
    batch: int = 0
    next_n: int = 0
    length: int = 0

    @property
    def name(self) -> str:
        if self.op == "prefill":
            return f"prefill {self.ranges} M={self.m} N={self.n}"
        return f"paged B={self.batch} n={self.next_n} L={self.length}"

    def params(self) -> dict:
        if self.op == "prefill":
            return dict(op=self.op, ranges=self.ranges, M=self.m, N=self.n, H=HEADS, D=DIM, fp8="e4m3fn")
        return dict(op=self.op, B=self.batch, next_n=self.next_n, L=self.length, H=HEADS, D=DIM, block_size=BS,
                    page_stride=PAGE, table="random physical blocks")

    def pairs(self) -> int:
        """(query, key) pairs scored inside the ranges."""
        if self.op == "paged":
            return self.batch * self.next_n * self.length
        if self.ranges == "full":
            return self.m * self.n
        return sum(self.n - self.m + i + 1 for i in range(self.m))

    def flops(self) -> int:
        return 2 * HEADS * DIM * self.pairs()

    def bytes_per_call(self) -> int:
        if self.op == "prefill":
            return (self.m * HEADS * DIM + self.n * DIM + 4 * self.n + 4 * self.m * HEADS + 8 * self.m
                    + 4 * self.m * self.n)
        rows = self.batch * self.next_n
        cache = self.batch * self.length * layout.INDEXER_TOKEN_BYTES
        return cache + rows * HEADS * (DIM + 4) + 4 * rows * self.length + 4 * self.batch * (self.length // BS + 1)


def _codes(shape, device) -> torch.Tensor:
    x = torch.randn(shape, device=device) * torch.exp2(torch.randint(-4, 5, shape, device=device).float())
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def _close(got: torch.Tensor, want: torch.Tensor) -> int:
    """Elements of `got` outside REL_TOL of each row's largest finite |want| (-inf must match exactly)."""
    got, want = got.cpu().double(), want.cpu().double()
    finite = want.isfinite()
    row = torch.where(finite, want.abs(), torch.zeros_like(want)).amax(1, keepdim=True)
    bad = torch.where(finite, (got - want).abs() > REL_TOL * row + 1e-30, got != want)
    return int(bad.sum())


def build_prefill(s: Spec, device) -> harness.Workload:
    q_bytes = s.m * HEADS * DIM
    nsets = harness.rotation_sets(q_bytes + s.n * DIM, device)
    qs = [_codes((s.m, HEADS, DIM), device) for _ in range(nsets)]
    ks = [_codes((s.n, DIM), device) for _ in range(nsets)]
    scales = [torch.exp2(torch.randint(-8, 0, (s.n,), device=device).float()) for _ in range(nsets)]
    ws = [torch.randn(s.m, HEADS, device=device) / 8 for _ in range(nsets)]
    i = torch.arange(s.m, device=device, dtype=torch.int32)
    if s.ranges == "full":
        start, end = torch.zeros_like(i), torch.full_like(i, s.n)
    else:
        start, end = torch.zeros_like(i), s.n - s.m + i + 1
    out = torch.empty(s.m, s.n, device=device)

    def run(j: int) -> None:
        ops.fp8_fp4_mqa_logits((qs[j], None), (ks[j], scales[j]), ws[j], start, end, True, out=out)

    def check() -> str:
        run(0)
        rows = torch.linspace(0, s.m - 1, CHECK_ROWS).long()
        want = reference.fp8_fp4_mqa_logits(qs[0][rows].cpu(), ks[0].cpu(), scales[0].cpu(), ws[0][rows].cpu(),
                                            start[rows].cpu(), end[rows].cpu(), layout.E4M3FN, layout.E4M3FN)
        bad = _close(out[rows], want)
        return "ok" if bad == 0 else f"MISMATCH: {bad} logits of {CHECK_ROWS} sampled rows off the reference"

    return harness.Workload(run, nsets, s.bytes_per_call(), check)


def paged_inputs(s: Spec, device, nsets: int) -> tuple:
    """(cache, tables, qs, ws, lens) of the paged case: every slot of a 64-key-page cache written through the insert
    op, and nsets sets of tables (a random permutation of the pages), q codes and weights."""
    width = layout.cdiv(s.length, BS)
    nb = s.batch * width * nsets
    raw = torch.zeros(nb, PAGE, dtype=torch.uint8, device=device)
    cache = raw[:, :layout.indexer_block_bytes(BS)].view(nb, BS, 1, layout.INDEXER_TOKEN_BYTES)
    chunk = 1 << 16
    for lo in range(0, nb * BS, chunk):                        # write every slot through the insert op
        hi = min(nb * BS, lo + chunk)
        k = (torch.randn(hi - lo, DIM, device=device) * 2).to(torch.bfloat16)
        indexer_k_quant_and_cache(k, cache, torch.arange(lo, hi, device=device), layout.INDEXER_QUANT_BLOCK,
                                  layout.INDEXER_SCALE_FMT)
    perm = torch.randperm(nb, device=device)
    tables = [perm[j * s.batch * width:(j + 1) * s.batch * width].view(s.batch, width).int().contiguous()
              for j in range(nsets)]
    qs = [_codes((s.batch, s.next_n, HEADS, DIM), device) for _ in range(nsets)]
    ws = [torch.randn(s.batch * s.next_n, HEADS, device=device) / 8 for _ in range(nsets)]
    lens = (s.length - s.next_n + 1 + torch.arange(s.next_n, device=device, dtype=torch.int32)).repeat(s.batch, 1)
    return cache, tables, qs, ws, lens


def build_paged(s: Spec, device) -> harness.Workload:
    nsets = harness.rotation_sets(s.batch * s.length * layout.INDEXER_TOKEN_BYTES, device)
    cache, tables, qs, ws, lens = paged_inputs(s, device, nsets)
    out = torch.empty(s.batch * s.next_n, s.length, device=device)
    sched = ops.get_paged_mqa_logits_metadata(lens, BS, 132)

    def run(j: int) -> None:
        ops.fp8_fp4_paged_mqa_logits((qs[j], None), cache, ws[j], lens, tables[j], sched, s.length, True, out=out)

    def check() -> str:
        run(0)
        bad = 0
        for b in (0, s.batch - 1):
            rows = slice(b * s.next_n, (b + 1) * s.next_n)
            want = reference.fp8_fp4_paged_mqa_logits(qs[0][b:b + 1].cpu(), cache.cpu(), ws[0][rows].cpu(),
                                                      lens[b:b + 1].cpu(), tables[0][b:b + 1].cpu(), s.length,
                                                      layout.E4M3FN, layout.E4M3FN)
            bad += _close(out[rows], want)
        return "ok" if bad == 0 else f"MISMATCH: {bad} logits of 2 sampled requests off the reference"

    return harness.Workload(run, nsets, s.bytes_per_call(), check)


def _specs(device) -> list[Spec]:
    if device.type != "cuda":
        (m, n), p = CPU_PREFILL_MN, CPU_PAGED
    else:
        (m, n), p = PREFILL_MN, PAGED
    return [Spec("prefill", "full", m, n), Spec("prefill", "causal", m, n),
            Spec("paged", batch=p["B"], next_n=p["next_n"], length=p["L"])]


def cases(quick: bool, device: torch.device) -> list[harness.Case]:
    def case(s: Spec) -> harness.Case:
        build = build_prefill if s.op == "prefill" else build_paged
        params = dict(s.params(), flops=s.flops())
        return harness.Case(name=s.name, build=lambda device: build(s, device), params=params, method="do_bench")

    return [case(s) for s in _specs(device)]


# --- ceilings ------------------------------------------------------------------------------------------------------
def fp8_matmul_ceiling(device: torch.device) -> dict | None:
    """torch._scaled_mm of two 8192² e4m3 matrices (platform e4m3) into bf16, measured now; None where the device
    has no fp8 matmul."""
    if device.type != "cuda":
        return None
    fp8 = torch.float8_e4m3fnuz if torch.version.hip and "gfx942" in torch.cuda.get_device_properties(
        device).gcnArchName else torch.float8_e4m3fn
    n = FP8_MATMUL_N
    try:
        a = torch.randn(n, n, device=device).to(fp8)
        b = torch.randn(n, n, device=device).to(fp8).T          # column-major second operand
        one = torch.ones((), device=device)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        us = harness.time_do_bench(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                                   rep_ms=200)
    except (RuntimeError, NotImplementedError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        harness.free_memory(device)
    return {"tflops": harness.sig(2 * n ** 3 / us / 1e6),
            "method": f"torch._scaled_mm {n}^2 x {n}^2 {str(fp8).split('.')[-1]} -> bf16, do_bench median"}


def extras(device, quick: bool) -> dict:
    """Read bandwidth and bf16 matmul rate (harness), and the fp8 matmul rate, measured now."""
    out = harness.read_matmul_ceilings(device)
    fp8 = fp8_matmul_ceiling(device)
    if fp8 is not None:
        out["fp8_matmul_ceiling"] = fp8
    return out


def targets(doc: dict) -> dict:
    """Prefill (full and causal) useful TFLOP/s against the fp8 matmul rate (bf16 where no fp8 matmul ran);
    paged decode GB/s against the read bandwidth."""
    fp8 = (doc.get("fp8_matmul_ceiling") or {}).get("tflops")
    rate = fp8 or (doc.get("matmul_ceiling") or {}).get("tflops")
    read = (doc.get("read_ceiling") or {}).get("gbps")
    out = {}
    for c in doc["cases"]:
        p = c["params"]
        if not c.get("us"):
            value = None
        elif p["op"] == "prefill":
            c["tflops"] = harness.sig(p["flops"] / c["us"] / 1e6)
            value = harness.sig(100 * c["tflops"] / rate) if rate else None
        else:
            value = harness.sig(100 * c["gbps"] / read) if read else None
        if p["op"] == "prefill":
            key, want = f"prefill_{p['ranges']}_pct_of_{'fp8' if fp8 else 'bf16'}_matmul", PREFILL_TARGET_PCT
        else:
            key, want = "paged_pct_of_read_bw", PAGED_TARGET_PCT
        out[key] = {"target": f">= {want:g} %", "value": value, "pass": None if value is None else value >= want}
    return out
