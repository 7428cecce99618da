"""Metadata step (SPEC §3.4, §3.6): both builders at the issue's step shapes.

A case is one step's two builds (`SWAMetadataBuilder` and `IndexerMetadataBuilder`, ratio 4,
window 128, MTP with one speculative token). Its device part is timed by CUDA-graph replay: N steps
captured back to back, alternating between batches of the same padded size, GPU µs per step.
`extras` reports the host µs of the two `build` calls (eager, device work enqueued) and the GPU
activities (kernels, memsets, copies) one step makes, counted with torch.profiler. The `bytes`
of a case are the metadata it writes (the GB/s column is not a target here).
"""
from __future__ import annotations

import dataclasses
import random
import statistics

import torch

import torch_dsv4_ops as d
from torch_dsv4_ops import layout, testing

from . import harness

FAMILY = "metadata"

WINDOW, RATIO, SWA_BS, STORAGE_BS, NUM_SPEC = layout.SLIDING_WINDOW, 4, layout.SWA_BLOCK_SIZE, 64, 1
MAX_MODEL_LEN = 65536
MAX_TOKENS, MAX_SEQS = 16384, 512
DECODE_TARGET_US, MIXED_TARGET_US, HOST_TARGET_US = 25.0, 40.0, 200.0


@dataclasses.dataclass(frozen=True)
class Step:
    decodes: int
    prefills: int = 0
    prefill_len: int = 2048

    @property
    def name(self) -> str:
        tail = f" + {self.prefills} prefills of {self.prefill_len}" if self.prefills else ""
        return f"step {self.decodes} decodes (MTP {1 + NUM_SPEC}){tail}"

    def params(self) -> dict:
        return dict(decodes=self.decodes, prefills=self.prefills, prefill_len=self.prefill_len, T=self.tokens,
                    window=WINDOW, ratio=RATIO, num_speculative_tokens=NUM_SPEC, max_model_len=MAX_MODEL_LEN)

    @property
    def tokens(self) -> int:
        return self.decodes * (1 + NUM_SPEC) + self.prefills * self.prefill_len


DECODE_STEP, MIXED_STEP = Step(256), Step(64, 4)


def make_builders(device: torch.device):
    swa = d.SWAMetadataBuilder(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS, window_size=WINDOW,
                               max_model_len=MAX_MODEL_LEN, block_size=SWA_BS, compress_ratios=(RATIO,),
                               num_speculative_tokens=NUM_SPEC, device=device)
    indexer = d.IndexerMetadataBuilder(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS,
                                       block_table_width=layout.cdiv(MAX_MODEL_LEN, STORAGE_BS * RATIO),
                                       max_model_len=MAX_MODEL_LEN, compress_ratio=RATIO,
                                       storage_block_size=STORAGE_BS, num_speculative_tokens=NUM_SPEC, device=device)
    return swa, indexer


def make_batches(step: Step, device: torch.device, seed: int):
    """(SWA-group batch, indexer-group batch): the same requests, each group with its own table and
    slot mapping. Decode contexts up to 64k; prefills have up to 4k of prefix."""
    rnd = random.Random(seed)
    q = [1 + NUM_SPEC] * step.decodes + [step.prefill_len] * step.prefills
    seq = [rnd.randint(1 + NUM_SPEC, MAX_MODEL_LEN) for _ in range(step.decodes)] + \
          [step.prefill_len + rnd.randint(0, 4096) for _ in range(step.prefills)]
    return testing.metadata_step_batches(device, q, seq, MAX_MODEL_LEN, torch.Generator().manual_seed(seed))


def run_step(builders, batches):
    swa, indexer = builders
    return swa.build(batches[0]), indexer.build(batches[1])


def _written_bytes(step: Step) -> int:
    """Metadata one step writes: SWA decode/prefill indices and lengths, token_to_req and validity,
    the compressed slot mapping, decode seq lens and the prefill chunk rows."""
    T = step.tokens
    return T * (WINDOW * 4 + 4 + 4 + 1) + T * 8 + step.decodes * (1 + NUM_SPEC) * 4 * 3 + \
        step.prefills * step.prefill_len * 8


def _check(builders, batches) -> str:
    """The device builds of `batches` against fresh builders running the CPU reference."""
    cpu_batches = tuple(dataclasses.replace(b, **{f.name: getattr(b, f.name).cpu() for f in dataclasses.fields(b)
                                                   if isinstance(getattr(b, f.name), torch.Tensor)})
                        for b in batches)
    got = run_step(builders, batches)
    with d.cpu_implementation("reference"):
        exp = run_step(make_builders(torch.device("cpu")), cpu_batches)
    bad = []
    for gmd, emd in zip(got, exp):
        for f in dataclasses.fields(gmd):
            a, e = getattr(gmd, f.name), getattr(emd, f.name)
            if isinstance(a, torch.Tensor) and not torch.equal(a.cpu(), e):
                bad.append(f"{type(gmd).__name__}.{f.name}")
    return "ok" if not bad else "MISMATCH: " + ", ".join(bad)


def build(step: Step, device: torch.device) -> harness.Workload:
    builders = make_builders(device)
    sets = [make_batches(step, device, seed) for seed in range(2)]

    def run(i: int) -> None:
        run_step(builders, sets[i])

    return harness.Workload(run, len(sets), _written_bytes(step), lambda: _check(builders, sets[1]))


def _case(step: Step) -> harness.Case:
    return harness.Case(name=step.name, build=lambda device: build(step, device), params=step.params(),
                        method="graph")


def cases(quick: bool, device: torch.device) -> list[harness.Case]:
    if device.type == "cpu":
        return [_case(Step(8)), _case(Step(4, 1, 64))]
    return [_case(DECODE_STEP), _case(MIXED_STEP)]


def gpu_activities(fn) -> dict:
    """GPU kernels, memsets and copies `fn()` issues, by torch.profiler (CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kinds = {"memset": [n for n in names if "memset" in n.lower()],
             "memcpy": [n for n in names if "memcpy" in n.lower()]}
    kernels = [n for n in names if n not in kinds["memset"] and n not in kinds["memcpy"]]
    return {"kernels": len(kernels), "memsets": len(kinds["memset"]), "memcpys": len(kinds["memcpy"]),
            "kernel_names": sorted(set(kernels))}


def extras(device: torch.device, quick: bool) -> dict:
    """Host µs of one step's two builds, and the GPU activities one step issues."""
    out = {}
    for step in (DECODE_STEP, MIXED_STEP) if device.type == "cuda" else (Step(8),):
        builders = make_builders(device)
        batches = make_batches(step, device, 0)
        calls, rounds = (300, 7) if device.type == "cuda" and not quick else (20, 3)
        swa, indexer = builders
        per_round = harness.host_us_rounds({"step": lambda: run_step(builders, batches),
                                            "swa": lambda: swa.build(batches[0]),
                                            "indexer": lambda: indexer.build(batches[1])},
                                           device, calls, rounds, warmup=20)
        rec = {"host_us_per_step": harness.sig(statistics.median(per_round["step"])),
               "host_us_per_round": [harness.sig(x) for x in per_round["step"]],
               "host_us_swa_build": harness.sig(statistics.median(per_round["swa"])),
               "host_us_indexer_build": harness.sig(statistics.median(per_round["indexer"])),
               "method": f"rounds of {calls} eager calls + one synchronize, the step (SWA + indexer build) and "
                         "each build alone in turn within each round; medians over rounds"}
        if device.type == "cuda":
            try:
                rec["gpu_activities_per_step"] = gpu_activities(lambda: run_step(builders, batches))
            except Exception as e:
                rec["gpu_activities_per_step"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        out[step.name] = rec
    return {"host": out}


def targets(doc: dict) -> dict:
    by_name = {c["name"]: c for c in doc["cases"]}
    out = {}
    for step, limit in ((DECODE_STEP, DECODE_TARGET_US), (MIXED_STEP, MIXED_TARGET_US)):
        value = by_name.get(step.name, {}).get("us")
        out[f"gpu_us_{step.name}"] = {"target": f"<= {limit:g} us of GPU time per step (graph replay)",
                                      "value": value, "pass": None if value is None else value <= limit}
    host = doc.get("host", {}).get(DECODE_STEP.name, {}).get("host_us_per_step")
    out["host_us_decode_step"] = {"target": f"<= {HOST_TARGET_US:g} us host time of build (decode step)",
                                  "value": host, "pass": None if host is None else host <= HOST_TARGET_US}
    return out
