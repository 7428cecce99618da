"""Per-row top-k of the indexer logits: `top_k_per_row_decode` and `top_k_per_row_prefill`.

Bytes one call must move: the fp32 logits of every row whose candidate range is longer than topk (read once;
rows with L <= topk read nothing), topk int32 indices written per row, and the lengths (a few bytes per row).
Logits are indexer-like (a relu-weighted sum: many values near 0, a long positive tail, a tie every 97 columns).

Targets (H100): decode 128 rows x 16384 logits, top-k 512: <= 15 us per call; prefill 4096 rows x 8192 logits,
top-k 512, causal-like (ks = 0, ke growing) and full ranges: <= 2x the time to read the whole logits tensor at
the read bandwidth measured in the same run (`extras`: torch.sum over a 2 GiB buffer).
"""
from __future__ import annotations

import dataclasses

import torch

from torch_dsv4_ops.ops.topk import top_k_per_row_decode, top_k_per_row_prefill
from torch_dsv4_ops.reference import topk as reference

from . import harness

FAMILY = "topk"

TOPK = 512
DECODE = (128, 16384)
PREFILL = (4096, 8192)
CPU_DECODE = (4, 2048)
CPU_PREFILL = (8, 1024)
DECODE_TARGET_US = 15.0
PREFILL_TARGET_X = 2.0


@dataclasses.dataclass(frozen=True)
class Spec:
    op: str               # "decode" or "prefill"
    rows: int
    cols: int
    ranges: str           # decode: "full" or "random"; prefill: "causal" or "full"

    @property
    def name(self) -> str:
        return f"{self.op} {self.rows}x{self.cols} k={TOPK} {self.ranges}"

    def params(self) -> dict:
        return dict(op=self.op, rows=self.rows, N=self.cols, topk=TOPK, ranges=self.ranges, dtype="float32")

    def lengths(self, device) -> tuple:
        """(decode seq_lens [rows] int32,) or (ks, ke) int32 [rows], the per-row candidate counts [rows]."""
        r = torch.arange(self.rows, device=device)
        if self.op == "decode":
            if self.ranges == "full":
                seq = torch.full((self.rows,), self.cols, device=device)
            else:
                seq = torch.randint(self.cols // 4, self.cols + 1, (self.rows,), device=device)
            return (seq.int(),), seq
        ks = torch.zeros(self.rows, dtype=torch.int64, device=device)
        ke = (r + 1) * self.cols // self.rows if self.ranges == "causal" else torch.full_like(ks, self.cols)
        return (ks.int(), ke.int()), ke - ks

    def bytes_per_call(self, counts: torch.Tensor) -> int:
        read = int(torch.where(counts > TOPK, counts, 0).sum()) * 4
        return read + self.rows * (TOPK * 4 + 8)


def logits_like(rows: int, cols: int, device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, device=device).relu_()
    x += torch.randn(rows, cols, generator=g, device=device).relu_()
    x *= torch.rand(rows, 1, generator=g, device=device) * 5
    x[:, ::97] = x[:, 5:6]
    return x


def build(s: Spec, device) -> harness.Workload:
    lengths, counts = s.lengths(device)
    nbytes = s.bytes_per_call(counts)
    nsets = harness.rotation_sets(s.rows * s.cols * 4, device)
    logits = [logits_like(s.rows, s.cols, device, i) for i in range(nsets)]
    out = torch.full((s.rows, TOPK), -7, dtype=torch.int32, device=device)

    def run(i: int) -> None:
        if s.op == "decode":
            top_k_per_row_decode(logits[i], 1, lengths[0], out, s.rows, s.cols, 1, TOPK)
        else:
            top_k_per_row_prefill(logits[i], lengths[0], lengths[1], out, s.rows, s.cols, 1, TOPK)

    def check() -> str:
        out.fill_(-7)
        run(0)
        expected = torch.full((s.rows, TOPK), -7, dtype=torch.int32)
        cpu = [t.cpu() for t in lengths]
        if s.op == "decode":
            reference.top_k_per_row_decode(logits[0].cpu(), 1, cpu[0], expected, s.rows, s.cols, 1, TOPK)
        else:
            reference.top_k_per_row_prefill(logits[0].cpu(), cpu[0], cpu[1], expected, s.rows, s.cols, 1, TOPK)
        bad = int((out.cpu() != expected).sum())
        return "ok" if bad == 0 else f"MISMATCH: {bad} indices differ from the reference"

    return harness.Workload(run, nsets, nbytes, check)


def _case(s: Spec) -> harness.Case:
    return harness.sized_case(s.name, lambda device: build(s, device), s.params(), s.rows * s.cols * 4)


def cases(quick: bool, device: torch.device) -> list[harness.Case]:
    (dr, dc), (pr, pc) = (DECODE, PREFILL) if device.type == "cuda" else (CPU_DECODE, CPU_PREFILL)
    specs = [Spec("decode", dr, dc, "full"), Spec("decode", dr, dc, "random"), Spec("prefill", pr, pc, "causal"),
             Spec("prefill", pr, pc, "full")]
    return [_case(s) for s in specs]


def extras(device: torch.device, quick: bool) -> dict:
    """The read ceiling of this run (GPU only), against which the prefill target is judged."""
    ceilings = harness.read_matmul_ceilings(device)
    return {"read_ceiling": ceilings.get("read_ceiling")}


def targets(doc: dict) -> dict:
    """Decode 128 x 16384 (full rows) in at most 15 us; each prefill 4096 x 8192 case within 2x the time to read
    the whole logits tensor (4096 * 8192 * 4 bytes) at the measured read bandwidth."""
    by_name = {c["name"]: c for c in doc["cases"]}
    out = {}
    us = by_name.get(Spec("decode", *DECODE, "full").name, {}).get("us")
    out["decode_128x16384_us"] = {"target": f"<= {DECODE_TARGET_US:g} us", "value": us,
                                  "pass": None if us is None else us <= DECODE_TARGET_US}
    read = (doc.get("read_ceiling") or {}).get("gbps")
    floor_us = PREFILL[0] * PREFILL[1] * 4 / read / 1e3 if read else None
    for ranges in ("causal", "full"):
        us = by_name.get(Spec("prefill", *PREFILL, ranges).name, {}).get("us")
        x = harness.sig(us / floor_us) if us and floor_us else None
        out[f"prefill_4096x8192_{ranges}_x_of_read"] = {
            "target": f"<= {PREFILL_TARGET_X:g} (time / time to read the logits, {floor_us and harness.sig(floor_us)} "
                      "us)", "value": x, "pass": None if x is None else x <= PREFILL_TARGET_X}
    return out
