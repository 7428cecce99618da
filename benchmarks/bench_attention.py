"""Paged attention: `chunked_prefill_paged_decode` (decode-only batches and a mixed step).

Shapes of issue 8: 32 query heads, 8 kv heads, head size 128, block size 16, head-major caches
(bf16, or fp8 e4m3 with per-tensor scales) written by `reshape_and_cache_flash`, random physical
blocks. Bytes a decode call must move: every context token's K and V of every kv head (the cache
read), plus q read and the output written (small). Decode cases are judged against the read
ceiling (`torch.sum` over a 2 GiB fp32 buffer, measured in the same run); the mixed step against
the larger of its byte floor (bytes / read ceiling) and its FLOP floor (causal QK^T and PV FLOPs /
the bf16 matmul rate measured in the same run).
"""
from __future__ import annotations

import dataclasses

import torch

import torch_dsv4_ops
from torch_dsv4_ops.testing import TOLERANCES

from . import harness

FAMILY = "attention"

HQ, HKV, D, BS = 32, 8, 128, 16
DECODE = ((64, 4096), (256, 1024), (1, 32768))
CPU_DECODE = ((2, 40), (1, 100))
MIXED = dict(prefills=4, new=512, cached=2048, decodes=60, decode_ctx=2048)
CPU_MIXED = dict(prefills=1, new=8, cached=16, decodes=2, decode_ctx=24)
DECODE_TARGET_PCT = {False: 85.0, True: 75.0}          # of the read ceiling, bf16 / fp8 caches
SPLIT_TARGET_PCT = {False: 65.0, True: 75.0}           # 1 request x 32768 (split across the GPU)
MIXED_TARGET_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class Spec:
    decodes: int                   # requests with query length 1
    decode_ctx: int
    fp8: bool = False
    prefills: int = 0              # requests with `new` query tokens on `cached` cached ones
    new: int = 0
    cached: int = 0

    @property
    def name(self) -> str:
        kind = "fp8" if self.fp8 else "bf16"
        if self.prefills:
            return f"mixed {kind} {self.prefills}x{self.new}+{self.cached} & {self.decodes}x{self.decode_ctx}"
        return f"decode {kind} R={self.decodes} ctx={self.decode_ctx}"

    def seq_lens(self) -> list[int]:
        return [self.decode_ctx] * self.decodes + [self.cached + self.new] * self.prefills

    def query_lens(self) -> list[int]:
        return [1] * self.decodes + [self.new] * self.prefills

    def kv_bytes_per_token(self) -> int:
        return 2 * HKV * D * (1 if self.fp8 else 2)

    def bytes_per_call(self) -> int:
        """KV of every context token (the new tokens' dense K/V instead for prefills), q and o."""
        tokens = sum(self.query_lens())
        kv = sum(self.seq_lens()) * self.kv_bytes_per_token()
        if self.prefills:   # dense new K/V are bf16 and read instead of the cache
            kv += self.prefills * self.new * (2 * HKV * D * 2 - self.kv_bytes_per_token())
        return kv + 2 * tokens * HQ * D * 2

    def flops(self) -> int:
        """2 dots of D per (query row, head, visible key), causal."""
        rows = [(1, s) for s in [self.decode_ctx] * self.decodes]
        total = sum(HQ * 4 * D * s for _, s in rows)
        for _ in range(self.prefills):
            visible = sum(self.cached + m + 1 for m in range(self.new))
            total += HQ * 4 * D * visible
        return total

    def params(self) -> dict:
        return dict(T=sum(self.query_lens()), Hq=HQ, Hkv=HKV, D=D, block_size=BS, decodes=self.decodes,
                    decode_ctx=self.decode_ctx, prefills=self.prefills, new=self.new, cached=self.cached,
                    cache="fp8 e4m3" if self.fp8 else "bf16", flops=self.flops(),
                    table="random physical blocks")


def input_sets(s: Spec, device) -> list[tuple]:
    """The call's arguments (caches, tables, queries: `example_batch`), as many sets as together exceed L2 (two at
    least), each drawn with its own seed."""
    from torch_dsv4_ops.ops.attention import example_batch

    return [example_batch(s.query_lens(), s.seq_lens(), hq=HQ, hkv=HKV, dim=D, bs=BS, fp8=s.fp8, seed=1 + i,
                          device=device) for i in range(harness.rotation_sets(s.bytes_per_call(), device))]


def build(s: Spec, device) -> harness.Workload:
    """The call over `input_sets`, rotated."""
    sets = input_sets(s, device)

    def run(i: int) -> None:
        torch_dsv4_ops.chunked_prefill_paged_decode(*sets[i])

    def check() -> str:
        return _check(sets[0], s)

    return harness.Workload(run, len(sets), s.bytes_per_call(), check)


def _check(args, s: Spec) -> str:
    """The first and last request against a float64 softmax over the dequantised cache (a prefill's new tokens:
    the dense key/value the op reads for them)."""
    (query, key, value, output, kv_cache_dtype, key_cache, value_cache, table, qsl, seq_lens, _, _, k_scale,
     v_scale) = args
    output.fill_(float("nan"))
    torch_dsv4_ops.chunked_prefill_paged_decode(*args)
    worst = 0.0
    for r in {0, len(s.seq_lens()) - 1}:
        q0, q1, n = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        pos = torch.arange(n, device=query.device)
        blk = table[r, pos // BS].long()
        off = pos % BS
        k = key_cache[blk, :, :, off, :].reshape(n, HKV, D)
        v = value_cache[blk, :, :, off].reshape(n, HKV, D)
        if s.fp8:
            k = (k.view(torch.float8_e4m3fn).double() * k_scale.double()).to(query.dtype)
            v = (v.view(torch.float8_e4m3fn).double() * v_scale.double()).to(query.dtype)
        if q1 - q0 > 1:    # a prefill reads its new tokens' K/V from the dense key/value, not from the cache
            k[n - (q1 - q0):] = key[q0:q1]
            v[n - (q1 - q0):] = value[q0:q1]
        k = k.double().repeat_interleave(HQ // HKV, 1)
        v = v.double().repeat_interleave(HQ // HKV, 1)
        q = query[q0:q1].double()
        scores = torch.einsum("mhd,nhd->hmn", q, k) * D ** -0.5
        qp = n - (q1 - q0) + torch.arange(q1 - q0, device=query.device)
        scores = scores.masked_fill(pos[None, None, :] > qp[None, :, None], float("-inf"))
        ref = torch.einsum("hmn,nhd->mhd", torch.softmax(scores, -1), v)
        worst = max(worst, float((output[q0:q1].double() - ref).abs().max()))
    tol = TOLERANCES[torch.bfloat16]
    return "ok" if worst <= tol else f"MISMATCH: max error {worst:.3g} (tolerance {tol})"


def extras(device, quick: bool) -> dict:
    """Read ceiling and bf16 matmul rate, measured now (the floors of this family's targets)."""
    return harness.read_matmul_ceilings(device)


def _specs(quick: bool, device) -> list[Spec]:
    if device.type != "cuda":
        return [Spec(r, c) for r, c in CPU_DECODE] + [Spec(**CPU_MIXED)]
    out = [Spec(r, c, fp8) for fp8 in (False, True) for r, c in DECODE]
    out += [Spec(**MIXED), Spec(**MIXED, fp8=True)] if not quick else [Spec(**MIXED)]
    return out


def cases(quick: bool, device: torch.device) -> list[harness.Case]:
    """Timed by CUDA-graph replay of back-to-back calls over rotated inputs, and by do_bench beside it: do_bench's
    flush leaves up to an L2 of dirty lines whose write-back the timed call pays (benchmarks/NOTES.md)."""
    return [harness.Case(name=s.name, build=lambda device, s=s: build(s, device), params=s.params(),
                         method="graph", series=None, crosscheck_do_bench=True) for s in _specs(quick, device)]


def targets(doc: dict) -> dict:
    """Decode bandwidth against the read ceiling; the mixed step against its floors."""
    by_name = {c["name"]: c for c in doc["cases"]}
    read = (doc.get("read_ceiling") or {}).get("gbps")
    tflops = (doc.get("matmul_ceiling") or {}).get("tflops")
    out = {}
    for fp8 in (False, True):
        for r, ctx in DECODE:
            s = Spec(r, ctx, fp8)
            c = by_name.get(s.name, {})
            pct = harness.sig(100 * c["gbps"] / read) if c.get("gbps") and read else None
            goal = SPLIT_TARGET_PCT[fp8] if r == 1 else DECODE_TARGET_PCT[fp8]
            db = (c.get("do_bench_crosscheck") or {}).get("gbps")
            db_pct = harness.sig(100 * db / read) if db and read else None
            if c:
                c["pct_of_read"] = pct
            out[f"decode_{'fp8' if fp8 else 'bf16'}_R{r}_ctx{ctx}_pct_of_read"] = {
                "target": f">= {goal:g} (% of the read ceiling; KV bytes read / time)", "value": pct,
                "method": c.get("method"), "do_bench_value": db_pct, "pass": None if pct is None else pct >= goal}
    s = Spec(**MIXED)
    c = by_name.get(s.name, {})
    if harness.add_floors(c, s.bytes_per_call(), s.flops(), read, tflops):
        out["mixed_step_x_of_floor"] = {
            "target": f"<= {MIXED_TARGET_FACTOR:g} x max(byte floor {c['byte_floor_us']:.1f} us, "
                      f"FLOP floor {c['flop_floor_us']:.1f} us)",
            "value": c["x_of_floor"], "pass": c["x_of_floor"] <= MIXED_TARGET_FACTOR}
    else:
        out["mixed_step_x_of_floor"] = {"target": f"<= {MIXED_TARGET_FACTOR:g} x the larger floor", "value": None,
                                        "pass": None}
    return out
