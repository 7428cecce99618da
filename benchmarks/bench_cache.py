"""Flash KV-cache writes: `reshape_and_cache_flash` (NHD, head-major) and `_diffkv`.

Bytes one call must move: key and value read once, slot_mapping read once, the two 4-byte scales
when an fp8 cache divides by them, and the cache bytes of every valid token written once. Slots
are random and unique (a random permutation of 2*T*nsets cache slots), so every token is valid.
"""
from __future__ import annotations

import dataclasses
import statistics

import torch
import triton
import triton.language as tl

import torch_dsv4_ops
from torch_dsv4_ops import layout, platform
from torch_dsv4_ops.reference import cache as reference

from . import harness

FAMILY = "cache"

SWEEP_T = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
QUICK_T = (1, 64, 4096, 65536)
CPU_T = (1, 16, 256)            # CPU smoke run (reference implementation)
CPU_VARIANT_T = 64
HEADLINE_T = 65536              # the bandwidth target size
DECODE_T = (1, 4, 16, 64)       # decode-step sizes, also timed with L2-resident key/value
GRAPH_MAX_T = 16384             # T up to this is timed by CUDA-graph replay (do_bench's floor is ~10 us)
BW_TARGET_PCT = 85.0
GRAPH_TARGET_US, GRAPH_TARGET_MAX_T = 1.5, 64
HOST_TARGET_RATIO = 3.0

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One cache-write configuration (cache dtype follows kv_cache_dtype: input dtype or uint8)."""

    T: int
    dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: str = "auto"
    layout: str = "nhd"          # "nhd", "head_major" or "diffkv"
    H: int = 8
    D: int = 128                 # key head size
    Dv: int = 128                # value head size
    bs: int = 16
    # decode-step model: the same key/value every call (just written by the projection, so
    # L2-resident), slot mappings rotating over a cache far past L2 (cold destinations)
    hot_inputs: bool = False

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.uint8 if self.fp8 else self.dtype

    @property
    def series(self) -> str:
        return f"{_DTYPE_NAMES[self.dtype]}/{self.kv_cache_dtype} {self.layout}" + (" hot-kv" if self.hot_inputs else "")

    @property
    def name(self) -> str:
        return f"{self.series} T={self.T}"

    def params(self) -> dict:
        return dict(T=self.T, H=self.H, D=self.D, Dv=self.Dv, block_size=self.bs, dtype=str(self.dtype),
                    kv_cache_dtype=self.kv_cache_dtype, cache_dtype=str(self.cache_dtype), layout=self.layout,
                    slots="random unique", slot_dtype="int64", hot_inputs=self.hot_inputs)

    def set_bytes(self) -> int:
        """Bytes of one input set (key, value, slot_mapping)."""
        return self.T * self.H * (self.D + self.Dv) * _size(self.dtype) + 8 * self.T

    def bytes_per_call(self) -> int:
        """Bytes the op must move: inputs read once, valid tokens' cache bytes written once."""
        scales = 8 if self.fp8 else 0
        return self.set_bytes() + scales + self.T * self.H * (self.D + self.Dv) * _size(self.cache_dtype)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _make_caches(s: Spec, num_blocks: int, device) -> tuple:
    empty = dict(dtype=s.cache_dtype, device=device)
    if s.layout == "nhd":
        return (torch.empty(num_blocks, s.bs, s.H, s.D, **empty), torch.empty(num_blocks, s.bs, s.H, s.Dv, **empty))
    if s.layout == "head_major":
        x = layout.head_major_x(s.cache_dtype)
        return (torch.empty(num_blocks, s.H, s.D // x, s.bs, x, **empty),
                torch.empty(num_blocks, s.H, s.Dv, s.bs, **empty))
    if s.layout == "diffkv":
        return (torch.empty(num_blocks, s.bs, s.H, s.D + s.Dv, **empty),)
    raise ValueError(f"unknown layout {s.layout!r}")


def _scale(x: torch.Tensor, fp8: bool) -> torch.Tensor:
    if fp8:
        return (x.abs().amax().float() / 64).reshape(1)   # largest |x|/scale is 64
    return torch.ones(1, dtype=torch.float32, device=x.device)


def build(s: Spec, device: torch.device) -> harness.Workload:
    """Input sets, one shared cache, the timed call and a check of set 0 against the reference."""
    nsets = harness.rotation_sets(s.set_bytes(), device)
    num_slots = layout.round_up(2 * s.T * nsets, s.bs)
    n_inputs = 1 if s.hot_inputs else nsets
    keys = [torch.randn(s.T, s.H, s.D, dtype=s.dtype, device=device) for _ in range(n_inputs)]
    values = [torch.randn(s.T, s.H, s.Dv, dtype=s.dtype, device=device) for _ in range(n_inputs)]
    slots = [torch.randperm(num_slots, device=device)[:s.T].contiguous() for _ in range(nsets)]
    caches = _make_caches(s, num_slots // s.bs, device)
    k_scale, v_scale = _scale(keys[0], s.fp8), _scale(values[0], s.fp8)
    if s.layout == "diffkv":
        op, ref = torch_dsv4_ops.reshape_and_cache_flash_diffkv, reference.reshape_and_cache_flash_diffkv
    else:
        op, ref = torch_dsv4_ops.reshape_and_cache_flash, reference.reshape_and_cache_flash

    def run(i: int) -> None:
        op(keys[i % n_inputs], values[i % n_inputs], *caches, slots[i], s.kv_cache_dtype, k_scale, v_scale)

    def check() -> str:
        for c in caches:
            c.view(torch.uint8).fill_(0xA5)            # poison: unwritten or stray bytes show up
        expected = [c.clone() for c in caches]
        run(0)
        e4m3 = platform.platform_e4m3(platform.target_for(device))
        ref(keys[0], values[0], *expected, slots[0], s.kv_cache_dtype, k_scale, v_scale, e4m3=e4m3)
        bad = sum(int((c.view(torch.uint8) != e.view(torch.uint8)).sum()) for c, e in zip(caches, expected))
        return "ok" if bad == 0 else f"MISMATCH: {bad} cache bytes differ from the reference"

    return harness.Workload(run, nsets, s.bytes_per_call(), check)


def _case(s: Spec, series: bool) -> harness.Case:
    return harness.Case(
        name=s.name, build=lambda device: build(s, device), params=s.params(),
        method="graph" if s.T <= GRAPH_MAX_T else "do_bench",
        series=s.series if series else None, crosscheck_graph=s.T == HEADLINE_T)


def cases(quick: bool, device: torch.device) -> list[harness.Case]:
    """The T sweep (bf16 'auto' and 'fp8', NHD) and the layout/dtype variants at one large T.

    Headline cases (T = 65536) run first, so the bandwidth targets are measured even if a later
    case goes wrong.
    """
    if device.type == "cpu":
        sweep_t, variant_t, variants = CPU_T, CPU_VARIANT_T, True
    else:
        sweep_t, variant_t, variants = (QUICK_T if quick else SWEEP_T), HEADLINE_T, not quick
    sweep = [_case(Spec(t, kv_cache_dtype=kv), series=True) for kv in ("auto", "fp8") for t in sweep_t]
    if device.type == "cuda":
        sweep += [_case(Spec(t, kv_cache_dtype=kv, hot_inputs=True), series=True)
                  for kv in ("auto", "fp8") for t in DECODE_T]
    sweep.sort(key=lambda c: c.params["T"] != HEADLINE_T)
    if not variants:
        return sweep
    t = variant_t
    return sweep + [_case(s, series=False) for s in (
        Spec(t, dtype=torch.float16),
        Spec(t, kv_cache_dtype="fp8_e5m2"),
        Spec(t, layout="head_major"),
        Spec(t, kv_cache_dtype="fp8", layout="head_major"),
        Spec(t, layout="diffkv"),
        Spec(t, kv_cache_dtype="fp8", layout="diffkv"),
    )]


def _host_layers(device: torch.device) -> tuple[dict, dict]:
    """Callables for each layer of one T=1 bf16 'auto' NHD write, from the public API down to
    Triton, and {layer: error} for layers that could not be set up."""
    s = Spec(1)
    key = torch.randn(1, s.H, s.D, dtype=s.dtype, device=device)
    value = torch.randn(1, s.H, s.Dv, dtype=s.dtype, device=device)
    kc, vc = _make_caches(s, 64, device)
    slot = torch.tensor([5], dtype=torch.int64, device=device)
    k_scale = v_scale = torch.ones(1, dtype=torch.float32, device=device)
    args = (key, value, kc, vc, slot, "auto", k_scale, v_scale)
    x = torch.randn(16, device=device)
    layers = {
        "x.add_(1)": lambda: x.add_(1),
        "public reshape_and_cache_flash": lambda: torch_dsv4_ops.reshape_and_cache_flash(*args),
        "torch.ops.dsv4.reshape_and_cache_flash.default": lambda: torch.ops.dsv4.reshape_and_cache_flash.default(*args),
    }
    errors = {}
    if device.type == "cuda":
        impl = torch_dsv4_ops.OPS["reshape_and_cache_flash"].kernel
        layers["impl, no dispatcher (OPS[...].kernel)"] = lambda: impl(*args)
        try:
            layers.update(_launch_layers(s, key, value, kc, vc, slot, k_scale, v_scale, device))
        except Exception as e:
            errors["launch layers setup"] = f"{type(e).__name__}: {e}"[:500]
    return layers, errors


def _launch_layers(s: Spec, key, value, kc, vc, slot, k_scale, v_scale, device) -> dict:
    """Launches below the op, with every argument prebuilt (bf16 -> bf16 'auto' is a plain copy, so
    the kernel views are the tensors themselves). Kernel arguments are matched by parameter name."""
    from torch_dsv4_ops.kernels import cache as kernels

    target = platform.target_for(device)
    codec = kernels.make_codec(key.dtype, kc.dtype, None, target)
    kgeo, vgeo = kernels.nhd_geometry(kc), kernels.nhd_geometry(vc)
    num_slots = kc.shape[0] * s.bs
    meta = kernels.constexprs(s.H, s.D, s.Dv, kgeo, vgeo, s.bs, codec, target)
    grid = (slot.shape[0], -(-s.H // meta["BLOCK_H"]))
    kernel = kernels.flash_cache_write_kernel
    named = dict(key_ptr=key, value_ptr=value, kc_ptr=kc, vc_ptr=vc, slot_ptr=slot, k_scale_ptr=k_scale,
                 v_scale_ptr=v_scale, num_slots=num_slots, slot_stride=slot.stride(0), vc_start=0)
    named.update(zip(("k_st", "k_sh", "k_sd"), key.stride()))
    named.update(zip(("v_st", "v_sh", "v_sd"), value.stride()))
    named.update(zip(("kc_blk", "kc_off", "kc_h", "kc_dx", "kc_di"), kgeo.strides))
    named.update(zip(("vc_blk", "vc_off", "vc_h", "vc_dx", "vc_di"), vgeo.strides))
    runtime = tuple(named[n] for n in kernel.arg_names if n not in meta)
    layers = {}
    if hasattr(kernels, "launch"):            # launcher API of the first commit
        layers["kernels.cache.launch (prebuilt views)"] = lambda: kernels.launch(
            key, value, kc, vc, slot, k_scale, v_scale, num_slots, kgeo, vgeo, s.bs, codec, target)
    if hasattr(kernels, "LAUNCHER"):          # FastLauncher: compiled kernel called directly
        constexpr_values = tuple(meta[n] for n in kernel.arg_names if n in meta)
        plan_key = ("benchmark",) + tuple(v for v in runtime if isinstance(v, int))
        layers["kernels.cache.LAUNCHER (prebuilt args)"] = lambda: kernels.LAUNCHER(
            grid, runtime, 7, constexpr_values, meta, plan_key, device)
    layers["triton kernel[grid](...) (prebuilt args)"] = lambda: kernel[grid](*runtime, **meta)
    return layers


@triton.jit
def _noop_kernel(ptr):
    tl.store(ptr, tl.load(ptr) + 1)


def graph_floor_us(device: torch.device, n_calls: int = 100) -> dict:
    """Per-call time, in a CUDA graph, of the smallest kernels: a one-program Triton kernel and
    x.add_(1) on one element. The graph-latency target is read against this floor."""
    x = torch.zeros(1, device=device, dtype=torch.int32)
    out = {}
    for name, fn in (("triton one-program kernel", lambda i: _noop_kernel[(1,)](x)), ("x.add_(1)", lambda i: x.add_(1))):
        out[name] = harness.sig(harness.graph_us_per_call(fn, n_calls))
    return out


def extras(device: torch.device, quick: bool) -> dict:
    """Eager host overhead per call at T=1 (the public op against x.add_(1), and each layer below
    it) and the CUDA-graph launch floor."""
    floor = {}
    if device.type == "cuda":
        try:
            floor = graph_floor_us(device)
        except Exception as e:
            floor = {"error": f"{type(e).__name__}: {e}"[:500]}
    calls, rounds = (1000, 11) if device.type == "cuda" and not quick else (200, 3)
    out = {"T": 1, "calls": calls, "rounds": rounds, "baseline": "x.add_(1)",
           "method": "rounds of `calls` eager calls + one synchronize, every layer in turn within each "
                     "round; us_per_call: median over rounds; ratio: median over rounds of public / baseline",
           "us_per_call": {}, "errors": {}}
    try:
        layers, out["errors"] = _host_layers(device)
    except Exception as e:
        out["errors"]["setup"] = f"{type(e).__name__}: {e}"[:500]
        layers = {}
    working = {}
    for name, fn in layers.items():   # drop layers that cannot run, keep the rest
        try:
            fn()
            working[name] = fn
        except Exception as e:
            out["errors"][name] = f"{type(e).__name__}: {e}"[:500]
    per_round = harness.host_us_rounds(working, device, calls, rounds) if working else {}
    out["us_per_call"] = {name: harness.sig(statistics.median(v)) for name, v in per_round.items()}
    if "x.add_(1)" in per_round and "public reshape_and_cache_flash" in per_round:
        ratios = [p / a for p, a in zip(per_round["public reshape_and_cache_flash"], per_round["x.add_(1)"])]
        out["ratio_public_to_add"] = harness.sig(statistics.median(ratios), 4)
        out["ratio_per_round"] = [harness.sig(r, 4) for r in ratios]
    return {"host_overhead": out, "graph_floor_us_per_call": floor}


def targets(doc: dict) -> dict:
    """The issue's targets: bandwidth at T=65536, graph latency at T <= 64, eager host overhead."""
    by_name = {c["name"]: c for c in doc["cases"]}
    out = {}
    for label, kv in (("bf16", "auto"), ("fp8", "fp8")):
        pct = by_name.get(Spec(HEADLINE_T, kv_cache_dtype=kv).name, {}).get("pct_of_copy")
        out[f"{label}_T{HEADLINE_T}_pct_of_copy"] = {
            "target": f">= {BW_TARGET_PCT:g} (% of copy ceiling; H=8 D=128 bs=16, random slots)",
            "value": pct, "pass": None if pct is None else pct >= BW_TARGET_PCT}
    for label, hot, what in (("cold", False, "key/value/slots/cache all DRAM-cold: a fresh input set per call"),
                             ("decode_step", True, "key/value L2-resident (same buffers, as a decode step reads "
                                                   "what the projection just wrote), fresh slots into a cold cache")):
        small = [c for c in doc["cases"] if c.get("series") and c["method"] == "graph"
                 and c["params"]["T"] <= GRAPH_TARGET_MAX_T and c["params"].get("hot_inputs", False) == hot]
        worst = max((c["us"] for c in small if "us" in c), default=None)
        out[f"graph_us_per_call_T_le_{GRAPH_TARGET_MAX_T}_{label}"] = {
            "target": f"<= {GRAPH_TARGET_US:g} us per call in a CUDA graph (worst of bf16/fp8, "
                      f"T <= {GRAPH_TARGET_MAX_T}; {what})",
            "value": worst,
            "pass": None if not small else (all("us" in c for c in small) and worst is not None
                                            and worst <= GRAPH_TARGET_US)}
    ratio = (doc.get("host_overhead") or {}).get("ratio_public_to_add")
    out["eager_host_overhead_ratio_T1"] = {
        "target": f"<= {HOST_TARGET_RATIO:g} x the host time of x.add_(1)",
        "value": ratio, "pass": None if ratio is None else ratio <= HOST_TARGET_RATIO}
    return out
