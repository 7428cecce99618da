"""Sparse MLA attention: flash_mla_with_kvcache (decode over fp8_ds_mla caches) and flash_mla_sparse_fwd (prefill
over a gathered bf16 workspace), with get_mla_metadata and sparse_mla_workspace_size (SPEC §2.1, §3.8, §4 b h i,
§5 "Sparse MLA and indexer"; docs/ops/sparse_mla.md).

Oracle: written in this file from the spec, never with the package's reference. Rows are dequantised here from the
cache bytes (SPEC §2.1: NoPE dim 64j+i = float(fp8 code) * 2**(scale byte j - 127), read through
`.view(float8_e4m3fn / float8_e4m3fnuz)`; dims 448..511 = the stored bf16 bits), the selected set of every query
row is built here in plain Python from the indices and lengths (length clamped to [0, W], entries outside
[0, rows) skipped, duplicates counted), and the softmax with its sink is evaluated in float64:
out = sum e^(s_i-m) kv_i / (sum e^(s_i-m) + e^(z-m)), lse = m + ln sum e^(s_i-m), m = max s_i; S empty gives
out 0, lse +inf, max_logits -inf. Caches are written by `quantize_and_insert_k_cache` into pages first filled with
NaN bytes (0x7F/0xFF for OCP, 0x80 for FNUZ), so any load of an unselected slot shows as NaN. q is N(0, 1), rows are
N(0, 1) with per-quant-block factors and the default test scale is 2/sqrt(512) (logit std ~2); every query row has
one planted dominant row for head 0, and the sinks include dominant (+8) values. Tolerances (SPEC §5): bf16 out
within atol = rtol = 1.6e-2; lse and max_logits within 1e-3 * max(|ref|, 1), infinities and NaN exactly.

CPU budget: the kernel runs under Triton's interpreter, program by program, so kernel cases stay at a few query
rows, W <= ~40 and mostly 16 heads (one Hq 64 and one Hq 128 case); the wider sweeps (`REF_ONLY_ON_CPU`) run on the
reference only on CPU and on the kernel on a GPU. The file takes well under a minute on 2 CPU cores.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random

import pytest
import torch

import torch_dsv4_ops as d
from torch_dsv4_ops import layout, platform
from torch_dsv4_ops.compile_matrix import TARGETS_BY_NAME
from torch_dsv4_ops.kernels import sparse_mla as kernels
from torch_dsv4_ops.library import cpu_implementation
from torch_dsv4_ops.ops import sparse_mla as ops
from torch_dsv4_ops.ops.sparse_mla import forced_splits
from torch_dsv4_ops.testing import (assert_close, check_compile, check_cuda_graph, check_direct_launches,
                                    gluon_runs_direct, implementation, nonzero_share, poison_, run_opcheck,
                                    sync_debug_error, triton_cache_entries)

IMPLS = ["reference", "kernel"]
D = 512
NOPE = 448
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
INF = float("inf")
SHARP = 2 / math.sqrt(D)              # unit q and rows: logits of std ~2
DEFAULT_SCALE = 0.044194173824159216  # 512 ** -0.5, the ops' default (written out)
PEAK_LOGIT = 8.0                      # the planted row's extra logit for head 0
STAT_RTOL = 1e-3                      # lse / max_logits: 1e-3 * max(|ref|, 1)
BLOCK_FACTORS = (1.0, 0.5, 2.0, 1.0, 0.25, 1.0, 2.0, 1.0)   # NoPE quant blocks 0..6, then RoPE

DECODE = torch.ops.dsv4.flash_mla_with_kvcache.default
DECODE_OUT = torch.ops.dsv4.flash_mla_with_kvcache_out.default
PREFILL = torch.ops.dsv4.flash_mla_sparse_fwd.default
PREFILL_OUT = torch.ops.dsv4.flash_mla_sparse_fwd_out.default


# ================================================================================================
# Caches: NaN-filled pages, rows written through quantize_and_insert_k_cache
# ================================================================================================
def nan_fill_(raw: torch.Tensor, fnuz: bool, g: torch.Generator) -> torch.Tensor:
    """Every byte a NaN code of the cache's fp8 flavour: 0x7F/0xFF at random (OCP), 0x80 (FNUZ)."""
    if fnuz:
        return raw.fill_(0x80)
    pick = torch.rand(raw.shape, generator=g) < 0.5
    return raw.copy_(torch.where(pick, 0x7F, 0xFF).to(torch.uint8))


def helpers_on(device):
    """Context for the ops that build inputs (writer, gather, combine): their CPU reference on CPU (fast; they are
    tested bit-exactly in their own files), their kernels on a GPU."""
    return cpu_implementation("reference") if torch.device(device).type == "cpu" else contextlib.nullcontext()


def random_rows(n: int, g: torch.Generator) -> torch.Tensor:
    """float32 [n, 512]: N(0, 1) scaled per quant block (different scale bytes inside a row)."""
    factors = torch.tensor(BLOCK_FACTORS).repeat_interleave(64)
    return torch.randn(n, D, generator=g) * factors


@dataclasses.dataclass
class Cache:
    tensor: torch.Tensor      # what the op receives (a view of raw, in the chosen form and dtype)
    raw: torch.Tensor         # [nb, page stride] uint8: every byte, page padding included
    bs: int
    fnuz: bool
    written: list
    unwritten: list
    _cpu: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.raw.shape[0] * self.bs

    def raw_cpu(self) -> torch.Tensor:
        """The bytes on the CPU (copied once: a case's caches are never written after it is built)."""
        if self._cpu is None:
            self._cpu = self.raw.cpu()
        return self._cpu


def build_cache(nb: int, bs: int, slots: list, rows: torch.Tensor | None, *, fnuz=False, form="3d", padded=True,
                dtype=torch.uint8, device="cpu", g=None) -> Cache:
    """A fp8_ds_mla cache of nb pages (engine stride round_up(bs*584, 576) when padded, else bs*584), NaN bytes
    everywhere, then `rows` written at `slots` by quantize_and_insert_k_cache. form: "3d" [nb, bs, 584], "4d"
    FlashMLA's [nb, bs, 1, 584], "2d" [nb, page bytes]; dtype: uint8, int8 or float8_e4m3fn (the same bytes)."""
    g = g or torch.Generator().manual_seed(1234)
    stride = layout.ds_mla_block_stride(bs) if padded else bs * layout.TOKEN_BYTES
    raw = nan_fill_(torch.empty(nb, stride, dtype=torch.uint8), fnuz, g).to(device)
    cache3 = raw[:, :bs * layout.TOKEN_BYTES].view(nb, bs, layout.TOKEN_BYTES)
    if slots:
        with helpers_on(device):
            d.quantize_and_insert_k_cache(rows.to(torch.bfloat16).to(device), cache3,
                                          torch.tensor(slots, dtype=torch.int64, device=device), bs, True, fnuz)
    view = {"3d": cache3, "4d": cache3.unsqueeze(2), "2d": raw}[form].view(dtype)
    written = sorted(set(slots))
    unwritten = sorted(set(range(nb * bs)) - set(written))
    return Cache(view, raw, bs, fnuz, written, unwritten)


# ================================================================================================
# The float64 oracle
# ================================================================================================
def oracle_rows(cache: Cache, slots: list) -> torch.Tensor:
    """float64 [n, 512] rows of `slots`, dequantised from the cache bytes (SPEC §2.1)."""
    if not slots:
        return torch.empty(0, D, dtype=torch.float64)
    raw = cache.raw_cpu()
    flat, stride, bs = raw.reshape(-1), raw.shape[1], cache.bs
    s = torch.tensor(slots, dtype=torch.int64)
    page, off = (s // bs) * stride, s % bs
    data = flat[(page + off * layout.TOKEN_DATA_BYTES)[:, None] + torch.arange(layout.TOKEN_DATA_BYTES)]
    scale = flat[(page + bs * layout.TOKEN_DATA_BYTES + off * 8)[:, None] + torch.arange(7)]
    fp8 = torch.float8_e4m3fnuz if cache.fnuz else torch.float8_e4m3fn
    codes = data[:, :NOPE].contiguous().view(fp8).double().view(-1, 7, 64)
    nope = codes * torch.exp2(scale.double() - 127)[:, :, None]
    rope = data[:, NOPE:].contiguous().view(torch.bfloat16).double()
    return torch.cat([nope.reshape(-1, NOPE), rope], 1)


def oracle_attend(q: torch.Tensor, rows: torch.Tensor, scale: float, sink: torch.Tensor | None):
    """q [H, 512], rows [n, 512], sink [H] or None (all float64) -> (out [H, 512], max_logits [H], lse [H])."""
    h = q.shape[0]
    if rows.shape[0] == 0:
        return (torch.zeros(h, D, dtype=torch.float64), torch.full((h,), -INF, dtype=torch.float64),
                torch.full((h,), INF, dtype=torch.float64))
    s = scale * (q @ rows.T)
    m = s.max(1).values                               # NaN propagates
    p = torch.exp(s - m[:, None])
    total = p.sum(1)
    denom = total if sink is None else total + torch.exp(sink - m)   # z = +inf: out 0; z = NaN: NaN
    return (p @ rows) / denom[:, None], m, m + torch.log(total)


def selected(entries: list, length: int | None, num_rows: int) -> list:
    """SPEC §3.8: entries i < clamp(length, 0, W) with 0 <= value < num_rows, duplicates kept."""
    n = len(entries) if length is None else min(max(length, 0), len(entries))
    return [v for v in entries[:n] if 0 <= v < num_rows]


def check_stat(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """lse / max_logits: within 1e-3 * max(|ref|, 1); +-inf and NaN exactly where the oracle has them."""
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.equal(a.isnan(), e.isnan()), f"{what}: NaN positions differ"
    inf = e.isinf()
    assert torch.equal(a[inf], e[inf]), f"{what}: infinities differ"
    fin = ~(inf | e.isnan())
    err = (a - e).abs()[fin]
    bad = ~(err <= STAT_RTOL * e.abs().clamp(min=1.0)[fin])
    assert not bad.any(), (f"{what}: {int(bad.sum())} values out of tolerance, max err {err.max().item():.3g}; "
                           f"actual {a[fin][bad][:4].tolist()} expected {e[fin][bad][:4].tolist()}")


def check_out(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == torch.bfloat16, f"{what}: dtype {actual.dtype}"
    assert_close(actual, expected, what=what)      # bf16: atol = rtol = 1.6e-2; NaN positions match


# ================================================================================================
# Random decode cases
# ================================================================================================
LEN_CODES = {"full": lambda w: w, "part": lambda w: w // 2 + 1, "one": lambda w: 1, "zero": lambda w: 0,
             "over": lambda w: w + 5, "neg": lambda w: -3, "max": lambda w: INT32_MAX, "min": lambda w: INT32_MIN}


def make_entries(rng: random.Random, n: int, width: int, cache: Cache, peak, t: int) -> list:
    """One index row: within the length, written slots with hostile entries (-1, -7, INT32_MIN, rows, rows+13,
    INT32_MAX) at positions 1 mod 5 and a duplicate of the previous entry at 3 mod 5; past the length, slots that
    hold NaN (never written) or -1. The peak slot goes to a position 0 or 4 mod 5 below n."""
    hostile = [-1, -7, INT32_MIN, cache.num_rows, cache.num_rows + 13, INT32_MAX]
    row = []
    for i in range(width):
        if i >= n:
            row.append(rng.choice(cache.unwritten) if cache.unwritten and rng.random() < 0.85 else -1)
        elif i % 5 == 1:
            row.append(hostile[(i // 5 + t) % len(hostile)])
        elif i % 5 == 3:
            row.append(row[i - 1])
        else:
            row.append(rng.choice(cache.written))
    if peak is not None and n > 0:
        row[rng.choice([i for i in range(n) if i % 5 in (0, 4)])] = peak
    return row


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    batch: int = 3
    s_q: int = 1
    hq: int = 16
    width: int = 24                       # W, main index columns
    lens: tuple | None = ("part", "full", "zero")   # LEN_CODES cycled over the batch; None: topk_length=None
    nb: int = 3                           # main cache pages; the last is never written
    bs: int = 64
    form: str = "3d"
    padded: bool = True
    fnuz: bool = False
    extra_width: int = 0                  # K; 0: no extra cache
    x_lens: tuple | None = ("full", "one", "part")
    x_nb: int = 3
    x_bs: int = 64
    x_form: str = "3d"
    x_padded: bool = True
    x_fnuz: bool | None = None            # None: extra_use_fnuz=None (the main cache's flavour)
    dtype: torch.dtype = torch.uint8
    sinks: tuple | None = (0.0, -INF, PEAK_LOGIT, -2.0)   # cycled over the heads
    scale: float | None = SHARP           # None: the op's default
    written: float = 0.6                  # share of the slots of pages 0..nb-2 holding a row
    seed: int = 0

    def replace(self, **kw) -> "DecodeSpec":
        return dataclasses.replace(self, **kw)


class DecodeCase:
    def __init__(self, spec: DecodeSpec, device):
        self.spec = s = spec
        self.device = device = torch.device(device)
        g = torch.Generator().manual_seed(s.seed)
        rng = random.Random(s.seed)
        tokens = s.batch * s.s_q
        q = torch.randn(s.batch, s.s_q, s.hq, D, generator=g).to(torch.bfloat16)
        self.q = q.to(device)
        self.scale = DEFAULT_SCALE if s.scale is None else s.scale
        qf = q.double().reshape(tokens, s.hq, D)
        self.lens_list = None if s.lens is None else [LEN_CODES[s.lens[b % len(s.lens)]](s.width)
                                                      for b in range(s.batch)]
        self.main, self.idx_list = self._source(g, rng, s.nb, s.bs, s.width, self.lens_list, s.form, s.padded,
                                                s.fnuz, qf)
        self.idx = torch.tensor(self.idx_list, dtype=torch.int32, device=device).view(s.batch, s.s_q, s.width)
        self.lens = None if self.lens_list is None else torch.tensor(self.lens_list, dtype=torch.int32, device=device)
        self.extra = self.x_idx = self.x_lens = self.x_lens_list = self.x_idx_list = None
        if s.extra_width:
            x_fnuz = s.fnuz if s.x_fnuz is None else s.x_fnuz
            self.x_lens_list = None if s.x_lens is None else [LEN_CODES[s.x_lens[b % len(s.x_lens)]](s.extra_width)
                                                              for b in range(s.batch)]
            self.extra, self.x_idx_list = self._source(g, rng, s.x_nb, s.x_bs, s.extra_width, self.x_lens_list,
                                                       s.x_form, s.x_padded, x_fnuz, None)
            self.x_idx = torch.tensor(self.x_idx_list, dtype=torch.int32,
                                      device=device).view(s.batch, s.s_q, s.extra_width)
            self.x_lens = (None if self.x_lens_list is None else
                           torch.tensor(self.x_lens_list, dtype=torch.int32, device=device))
        self.sink_list = None if s.sinks is None else [s.sinks[h % len(s.sinks)] for h in range(s.hq)]
        self.sink = None if s.sinks is None else torch.tensor(self.sink_list, dtype=torch.float32, device=device)
        self._expected = None

    def _source(self, g, rng, nb, bs, width, lens_list, form, padded, fnuz, qf):
        """(cache, index rows) of one source; qf given: plant one dominant row per query row (head 0)."""
        s = self.spec
        tokens = s.batch * s.s_q
        cand = list(range((nb - 1) * bs))
        written = sorted(rng.sample(cand, max(2, int(len(cand) * s.written))))
        rows = random_rows(len(written), g)
        probe = Cache(None, torch.empty(nb, 1), bs, fnuz, written, sorted(set(range(nb * bs)) - set(written)))
        peaks = rng.sample(written, tokens) if qf is not None and len(written) >= tokens else [None] * tokens
        entries = []
        for t in range(tokens):
            b = t // s.s_q
            n = width if lens_list is None else min(max(lens_list[b], 0), width)
            entries.append(make_entries(rng, n, width, probe, peaks[t], t))
            if peaks[t] is not None and n > 0:
                q0 = qf[t, 0].float()
                rows[written.index(peaks[t])] += PEAK_LOGIT / (self.scale * float(q0 @ q0)) * q0
        cache = build_cache(nb, bs, written, rows, fnuz=fnuz, form=form, padded=padded, dtype=s.dtype,
                            device=self.device, g=g)
        return cache, entries

    def selected_sets(self):
        """[(main slots, extra slots)] per query row (b, j) in row-major order."""
        s = self.spec
        out = []
        for t in range(s.batch * s.s_q):
            b = t // s.s_q
            main = selected(self.idx_list[t], None if self.lens_list is None else self.lens_list[b],
                            self.main.num_rows)
            extra = []
            if self.extra is not None:
                extra = selected(self.x_idx_list[t], None if self.x_lens_list is None else self.x_lens_list[b],
                                 self.extra.num_rows)
            out.append((main, extra))
        return out

    def expected(self):
        """(out [B, s_q, Hq, 512], lse [B, Hq, s_q]) float64."""
        if self._expected is None:
            s = self.spec
            out = torch.zeros(s.batch, s.s_q, s.hq, D, dtype=torch.float64)
            lse = torch.zeros(s.batch, s.hq, s.s_q, dtype=torch.float64)
            qd = self.q.cpu().double()
            sink = None if self.sink is None else self.sink.cpu().double()
            for t, (main, extra) in enumerate(self.selected_sets()):
                b, j = divmod(t, s.s_q)
                rows = torch.cat([oracle_rows(self.main, main)] + ([oracle_rows(self.extra, extra)] if extra else []))
                out[b, j], _, lse[b, :, j] = oracle_attend(qd[b, j], rows, self.scale, sink)
            self._expected = out, lse
        return self._expected

    def kwargs(self, **kw) -> dict:
        s = self.spec
        args = dict(q=self.q, k_cache=self.main.tensor, block_table=None, cache_seqlens=None, head_dim_v=512,
                    tile_scheduler_metadata=None, num_splits=None, softmax_scale=s.scale, causal=False,
                    is_fp8_kvcache=True, indices=self.idx, attn_sink=self.sink,
                    extra_k_cache=self.extra.tensor if self.extra is not None else None,
                    extra_indices_in_kvcache=self.x_idx, topk_length=self.lens, extra_topk_length=self.x_lens,
                    use_fnuz=s.fnuz, extra_use_fnuz=s.x_fnuz)
        args.update(kw)
        return args

    def op_args(self):
        """Positional arguments of dsv4::flash_mla_with_kvcache (the functional schema)."""
        s = self.spec
        x_fnuz = s.fnuz if s.x_fnuz is None else s.x_fnuz
        return [self.q, self.main.tensor, self.idx, self.lens, self.sink,
                self.extra.tensor if self.extra is not None else None, self.x_idx, self.x_lens, self.scale, s.fnuz,
                x_fnuz]


def plan_hooks(splits: int | None = None, programs: int | None = None) -> contextlib.ExitStack:
    """The plans' test hooks: the decode's `splits` forced, the Gluon kernels' persistent programs capped at
    `programs`."""
    stack = contextlib.ExitStack()
    if splits:
        stack.enter_context(forced_splits(splits))
    if programs:
        stack.enter_context(ops.forced_programs(programs))
    return stack


def run_decode(case: DecodeCase, impl: str, splits: int | None = None, programs: int | None = None, **kw):
    with implementation(impl, case.device), plan_hooks(splits, programs):
        return d.flash_mla_with_kvcache(**case.kwargs(**kw))


def check_decode(case: DecodeCase, out, lse, what: str) -> None:
    s = case.spec
    exp_out, exp_lse = case.expected()
    assert tuple(out.shape) == (s.batch, s.s_q, s.hq, D) and out.dtype == torch.bfloat16, what
    assert tuple(lse.shape) == (s.batch, s.hq, s.s_q) and lse.dtype == torch.float32, what
    check_out(out, exp_out, f"{what}: out")
    check_stat(lse, exp_lse, f"{what}: lse")
    o = out.detach().cpu().float()
    for t, (main, extra) in enumerate(case.selected_sets()):
        b, j = divmod(t, s.s_q)
        if not main and not extra:            # S empty: exactly 0, whatever the sink
            assert torch.equal(o[b, j], torch.zeros_like(o[b, j])), f"{what}: row {t} has S empty, out != 0"
        elif case.sink_list is not None:      # sink +inf: exactly 0
            for h, z in enumerate(case.sink_list):
                if z == INF:
                    assert torch.equal(o[b, j, h], torch.zeros(D)), f"{what}: row {t} head {h} sink +inf"


def assert_coverage(case: DecodeCase) -> None:
    """The case really holds what it is meant to: non-zero cache bytes, hostile and duplicate entries inside the
    lengths, NaN bytes in unused slots, non-trivial outputs."""
    sets = case.selected_sets()
    assert any(m or x for m, x in sets), "every selected set is empty"
    for cache in [case.main] + ([case.extra] if case.extra is not None else []):
        assert nonzero_share(cache.raw) > 0.5
        assert cache.unwritten, "no NaN slot to avoid"
    s = case.spec
    if max(min(max(n, 0), s.width) for n in (case.lens_list or [s.width])) >= 4:
        hostile = dup = 0
        for t, row in enumerate(case.idx_list):
            n = s.width if case.lens_list is None else min(max(case.lens_list[t // s.s_q], 0), s.width)
            hostile += sum(not 0 <= v < case.main.num_rows for v in row[:n])
            valid = [v for v in row[:n] if 0 <= v < case.main.num_rows]
            dup += len(valid) - len(set(valid))
        assert hostile and dup, (hostile, dup)
    assert case.expected()[0].abs().max() > 0.1


# --- kernel-affordable scenarios (both implementations on CPU) --------------------------------------
SCENARIOS = {
    "swa-h16": DecodeSpec(seed=1),
    "swa-h1-2d-unpadded-lens-none-no-sink": DecodeSpec(hq=1, batch=2, width=20, form="2d", padded=False, lens=None,
                                                     sinks=None, seed=2),
    "swa-h20-4d-int8": DecodeSpec(hq=20, batch=2, width=16, form="4d", dtype=torch.int8,
                                  lens=("one", "over"), seed=3),
    "c4a-h16-sq2": DecodeSpec(batch=2, s_q=2, width=16, extra_width=20, lens=("full", "one"),
                              x_lens=("part", "neg"), seed=4),
    "c4a-h16-lens-none-extra": DecodeSpec(batch=3, width=12, extra_width=16, lens=("zero", "max", "part"),
                                          x_lens=None, seed=5),
    "c128a-2d-h16": DecodeSpec(batch=3, width=12, extra_width=16, x_bs=2, x_nb=12, x_form="2d",
                               lens=("part", "zero", "full"), x_lens=("full", "zero", "min"), seed=6),
    "c128a-4d-fnuz-unpadded-int8": DecodeSpec(batch=2, width=12, extra_width=14, x_bs=2, x_nb=10, x_form="4d",
                                              fnuz=True, padded=False, x_padded=False, dtype=torch.int8,
                                              x_lens=("part", "full"), seed=7),
    "mixed-ocp-main-fnuz-extra-float8": DecodeSpec(batch=2, width=14, extra_width=14, x_fnuz=True,
                                                   dtype=torch.float8_e4m3fn, lens=("full", "part"), seed=8),
    "mixed-fnuz-main-ocp-c128a": DecodeSpec(batch=2, width=14, extra_width=10, fnuz=True, x_fnuz=False, x_bs=2,
                                            x_nb=9, x_form="2d", lens=("part", "full"), seed=9),
    "sinks-inf-and-dominant": DecodeSpec(batch=2, width=16, sinks=(INF, 0.0, -INF, PEAK_LOGIT, 30.0),
                                         lens=("full", "zero"), seed=10),
    "default-scale-float8-unpadded": DecodeSpec(batch=2, width=16, scale=None, padded=False,
                                                dtype=torch.float8_e4m3fn, seed=11),
    "h64-small": DecodeSpec(hq=64, batch=2, width=12, lens=("full", "part"), seed=12),
    "h128-c4a-small": DecodeSpec(hq=128, batch=1, s_q=2, width=10, extra_width=8, lens=("full",),
                                 x_lens=("part",), seed=13),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_decode_matches_oracle(device, impl, name):
    case = DecodeCase(SCENARIOS[name], device)
    assert_coverage(case)
    out, lse = run_decode(case, impl)
    check_decode(case, out, lse, f"{name} [{impl}]")


# --- wide sweeps: the reference on CPU, the kernel on a GPU -----------------------------------------
REF_ONLY_ON_CPU = {
    "h64-c4a-wide-sq2": DecodeSpec(hq=64, batch=4, s_q=2, width=128, extra_width=96, nb=4, x_nb=4,
                                   lens=("full", "part", "one", "over"), x_lens=("part", "full", "zero", "one"),
                                   seed=20),
    "h128-c128a-wide": DecodeSpec(hq=128, batch=3, width=64, extra_width=64, x_bs=2, x_nb=40, x_form="2d",
                                  lens=("full", "part", "neg"), x_lens=("full", "over", "part"), seed=21),
    "h16-mixed-flavours-wide": DecodeSpec(hq=16, batch=6, width=96, extra_width=128, fnuz=True, x_fnuz=False,
                                          lens=("full", "part", "one", "zero", "over", "neg"), seed=22),
    "h80-two-head-blocks": DecodeSpec(hq=80, batch=2, width=40, extra_width=24, lens=("full", "part"), seed=23),
}


@pytest.mark.parametrize("name", list(REF_ONLY_ON_CPU))
def test_decode_wide_shapes(device, name):
    impl = "reference" if device.type == "cpu" else "kernel"
    case = DecodeCase(REF_ONLY_ON_CPU[name], device)
    assert_coverage(case)
    out, lse = run_decode(case, impl)
    check_decode(case, out, lse, f"{name} [{impl}]")


# Calls at 64 and 128 heads: the sm_90 Gluon decode (kernels/sparse_mla_gluon.py) where it is planned (on the CPU
# the reference), forced unsplit and as the op plans it (on an H100 split into several, some splits of the shorter
# rows empty), each also with 3 persistent programs a head block looping over the work items. Hostile lengths,
# NaN-poisoned unused pages, a float8 cache, infinite sinks, a 2-row extra block size.
GLUON_HEADS = {
    "h64-c4a-sq2": DecodeSpec(hq=64, batch=6, s_q=2, width=128, extra_width=160, nb=4, x_nb=5,
                              lens=("full", "part", "one", "zero", "over", "neg"),
                              x_lens=("part", "full", "zero", "one", "full", "over"), seed=140),
    "h64-swa-float8-sinks": DecodeSpec(hq=64, batch=5, width=260, lens=None, nb=6, dtype=torch.float8_e4m3fn,
                                       sinks=(INF, 0.0, -INF, PEAK_LOGIT), seed=141),
    "h128-c4a-sq2-xbs2-sinks": DecodeSpec(hq=128, batch=3, s_q=2, width=128, extra_width=192, nb=4, x_bs=2, x_nb=200,
                                          lens=("full", "one", "neg"), x_lens=("part", "full", "zero"),
                                          sinks=(INF, 0.0, -INF, PEAK_LOGIT), seed=142),
}


@pytest.mark.parametrize("programs", [None, 3], ids=["programs-planned", "programs-3"])
@pytest.mark.parametrize("splits", [1, None], ids=["unsplit", "op-plan"])
@pytest.mark.parametrize("name", list(GLUON_HEADS))
def test_decode_gluon_heads(device, name, splits, programs):
    from torch_dsv4_ops.kernels import sparse_mla_gluon as gk

    impl = "reference" if device.type == "cpu" else "kernel"
    case = DecodeCase(GLUON_HEADS[name], device)
    assert case.spec.width + case.spec.extra_width >= gk.MIN_DECODE_STEPS * 64     # long enough for the Gluon path
    assert case.spec.batch * case.spec.s_q > kernels.SMALL_DECODE_ROWS
    assert_coverage(case)
    out, lse = run_decode(case, impl, splits, programs)
    check_decode(case, out, lse, f"{name} [{impl}, splits {splits}, programs {programs}]")


@pytest.mark.gpu
def test_gluon_decode_launches_directly(monkeypatch):
    """Where the Gluon decode runs, a repeated call of one signature skips Triton's JIT and writes what Triton's
    public path writes (host time: eager calls of small batches were bound by it)."""
    from torch_dsv4_ops.kernels import sparse_mla_gluon as gk

    if not gluon_runs_direct(gk):
        pytest.skip("the Gluon decode runs on sm_90 with a verified Triton only")
    case = DecodeCase(GLUON_HEADS["h64-c4a-sq2"], torch.device("cuda"))
    with forced_splits(1):
        out, lse = check_direct_launches(gk.DECODE_LAUNCHER, lambda: run_decode(case, "kernel"), monkeypatch,
                                         ops._DECODE_PLANS, "Gluon decode")
    check_decode(case, out, lse, "Gluon decode, direct launch")


@pytest.mark.gpu
def test_gluon_shared_memory_counted():
    """The shared memory the Gluon plans count on (`DECODE_SHARED_MEMORY`, `PREFILL_SHARED_MEMORY`, checked against
    the target's limit) covers what every compiled decode and prefill kernel takes: a kernel change that grows it
    must raise the constant, or a smaller GPU would be planned a kernel it cannot launch."""
    from torch_dsv4_ops.kernels import sparse_mla_gluon as gk

    if not gluon_runs_direct(gk):
        pytest.skip("the Gluon kernels run on sm_90 with a verified Triton only")
    dev = torch.device("cuda")
    for name in ("h64-c4a-sq2", "h64-swa-float8-sinks"):
        for splits in (1, None):                            # unsplit, and split as the op plans on an H100
            run_decode(DecodeCase(GLUON_HEADS[name], dev), "kernel", splits)
    case = PrefillCase(PrefillSpec(hq=64, tokens=4, skv=100, width=70, seed=59), dev)
    with implementation("kernel", dev):
        d.flash_mla_sparse_fwd(case.q, case.kv, case.idx, case.spec.scale, attn_sink=case.sink, topk_length=case.lens)
    for launcher, counted in ((gk.DECODE_LAUNCHER, gk.DECODE_SHARED_MEMORY),
                              (gk.PREFILL_LAUNCHER, gk.PREFILL_SHARED_MEMORY)):
        taken = [k.metadata.shared for k in launcher._compiled.values()]
        assert taken and max(taken) <= counted, (launcher.fn.__name__, taken, counted)


def test_gluon_decode_rule():
    """The decode's Gluon kernel is planned on sm_90 with Triton 3.6 only, for multiples of 64 heads, OCP caches, q
    strides that are multiples of 8 elements, more than SMALL_DECODE_ROWS query rows (or one forced split), lists of
    at least 2 steps and a target with the shared memory a program takes; its persistent programs: one a work item
    up to one an SM across the head blocks."""
    from torch_dsv4_ops.kernels import sparse_mla_gluon as gk

    sm90 = next(t for t in platform.MATRIX_TARGETS if t.backend == "cuda" and t.arch == 90)
    sm80 = next(t for t in platform.MATRIX_TARGETS if t.backend == "cuda" and t.arch == 80)
    ok = dict(target=sm90, hq=64, q_strides=(64 * 512, 64 * 512, 512, 1), fnuz=(False, False),
              rows=kernels.SMALL_DECODE_ROWS + 1, positions=256, version="3.6.0")
    assert gk.decode_planned(**ok) == (gk.gluon is not None)
    assert gk.decode_planned(**{**ok, "rows": 1, "forced": 1}) == (gk.gluon is not None)
    assert gk.decode_planned(**{**ok, "hq": 128}) == (gk.gluon is not None)
    for change in (dict(version="3.9.0"), dict(target=sm80), dict(hq=96), dict(hq=0), dict(fnuz=(False, True)),
                   dict(rows=kernels.SMALL_DECODE_ROWS), dict(positions=127), dict(forced=2),
                   dict(q_strides=(64 * 516, 64 * 516, 516, 1))):
        assert not gk.decode_planned(**{**ok, **change}), change
    calls = ((5, 64, 10), (132, 64, 1), (256, 64, 1), (40, 128, 1), (300, 128, 1), (1, 256, 1))   # rows, hq, splits
    assert [gk.persistent_programs(rows * splits, hq, 132) for rows, hq, splits in calls] == [50, 132, 132, 40, 66, 1]


# The plans of GPUs with less shared memory (sm_80: 163 KB; sm_86/89/120: 99 KB), run on this GPU: their tiles
# (32-row steps, 32-head blocks) must give the same results. The compile matrix checks that they fit.
SMALLER_SHARED_MEMORY = ("sm_80", "sm_86")


@pytest.mark.parametrize("gpu", SMALLER_SHARED_MEMORY)
def test_smaller_shared_memory_plans(device, gpu, monkeypatch):
    target = platform.target_for(device)
    if target.backend != "cuda":
        pytest.skip("NVIDIA plans: the interpreter has one tile plan, AMD its own")
    limit = platform.shared_memory_limit(TARGETS_BY_NAME[gpu])
    monkeypatch.setattr(platform, "shared_memory_limit", lambda t: limit)
    assert kernels.tiles(target, False)["BLOCK_N"] == 32 and kernels.tiles(target, True)["BLOCK_N"] == 32
    assert kernels.max_block_h(target) == (32 if gpu == "sm_86" else 64)
    for plans in (ops._DECODE_PLANS, ops._PREFILL_PLANS):
        monkeypatch.setattr(plans, "remember", lambda sig, plan: plan)   # neither reuse nor keep these plans
        plans.clear()
    for name in ("h64-c4a-wide-sq2", "h80-two-head-blocks"):
        case = DecodeCase(REF_ONLY_ON_CPU[name], device)
        out, lse = run_decode(case, "kernel")
        check_decode(case, out, lse, f"{name} [{gpu} plan]")
    case = PrefillCase(PrefillSpec(hq=64, tokens=12, skv=300, width=200, nan_rows=40, seed=120), device)
    with implementation("kernel", device):
        out, max_logits, lse = d.flash_mla_sparse_fwd(case.q, case.kv, case.idx, case.spec.scale,
                                                      attn_sink=case.sink, topk_length=case.lens)
    check_prefill(case, out, max_logits, lse, f"prefill [{gpu} plan]")


# ================================================================================================
# Worked example (docs/ops/sparse_mla.md §4), literal
# ================================================================================================
LN2, LN3, LN5 = 0.6931471805599453, 1.0986122886681098, 1.6094379124341003
# (id, decode indices, topk_length, sink, out[0], out[448], lse, max_logits (prefill))
WORKED = [
    ("S=AB", [70, 5, -1, 128], None, None, 0.66796875, 1.0, LN3, LN2),
    ("sink-0", [70, 5, -1, 128], None, 0.0, 0.5, 0.75, LN3, LN2),
    ("sink-ln2", [70, 5, -1, 128], None, LN2, 0.400390625, 0.6015625, LN3, LN2),
    ("sink+inf", [70, 5, -1, 128], None, INF, 0.0, 0.0, LN3, LN2),
    ("duplicate", [70, 5, 5], None, None, 0.80078125, 0.6015625, LN5, LN2),
    ("len-1", [70, 5, -1, 128], 1, None, 0.0, 3.0, 0.0, 0.0),
    ("len-1-sink-0", [70, 5, -1, 128], 1, 0.0, 0.0, 1.5, 0.0, 0.0),
    ("len-0", [70, 5, -1, 128], 0, None, 0.0, 0.0, INF, -INF),
    ("len-0-sink-3", [70, 5, -1, 128], 0, 3.0, 0.0, 0.0, INF, -INF),
    ("len-0-sink+inf", [70, 5, -1, 128], 0, INF, 0.0, 0.0, INF, -INF),
]
PREFILL_SLOT = {70: 1, 5: 0, -1: -1, 128: 2}   # kv = [B, A]: A is row 1, B row 0, 2 = Skv is out of range


def worked_rows():
    """A: kv[448] = 3; B: kv[0] = 1; every other dim 0."""
    a, b = torch.zeros(D), torch.zeros(D)
    a[448], b[0] = 3.0, 1.0
    return a, b


def worked_q(device):
    q = torch.zeros(1, 1, 1, D, dtype=torch.bfloat16, device=device)
    q[..., 0] = 1
    return q


def expected_row(o0, o448):
    e = torch.zeros(D)
    e[0], e[448] = o0, o448
    return e


def check_worked(out, stat_pairs, o0, o448, what):
    """out bit-for-bit (bf16 values written out); lse / max_logits within the spec's tolerance."""
    got = out.detach().cpu().float().reshape(D)
    assert torch.equal(got, expected_row(o0, o448)), (f"{what}: out[0] {got[0].item()} out[448] "
                                                      f"{got[448].item()} (nonzero at {got.nonzero().view(-1)[:6]})")
    for actual, value, name in stat_pairs:
        check_stat(actual.reshape(1), torch.tensor([value], dtype=torch.float64), f"{what}: {name}")


@pytest.mark.parametrize("fnuz", [False, True], ids=["ocp", "fnuz"])
def test_worked_example_cache_bytes(device, fnuz):
    """The bytes §4 names: A's NoPE blocks scale byte 105 (OCP; FNUZ floor 106), RoPE bytes 40 40; B's block 0
    scale byte 119 (FNUZ 120), code 0x78; the C128A copy of B at bytes 4032 (data) and 4616 (scales)."""
    a, b = worked_rows()
    cache = build_cache(2, 64, [70, 5], torch.stack([a, b]), fnuz=fnuz, padded=False, device=device)
    raw = cache.raw_cpu()
    scale_a = raw[1, 64 * 576 + 6 * 8: 64 * 576 + 6 * 8 + 8].tolist()
    assert scale_a == [106 if fnuz else 105] * 7 + [0]
    assert raw[1, 6 * 576 + 448: 6 * 576 + 450].tolist() == [0x40, 0x40]
    assert raw[0, 5 * 576] == 0x78 and raw[0, 64 * 576 + 5 * 8] == (120 if fnuz else 119)
    c128 = build_cache(3, 2, [5], b[None], fnuz=fnuz, form="2d", padded=True, device=device)
    assert tuple(c128.tensor.shape) == (3, 1728)
    flat = c128.raw_cpu().reshape(-1)
    assert flat[4032] == 0x78 and flat[4616] == (120 if fnuz else 119)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("row", WORKED, ids=[r[0] for r in WORKED])
def test_worked_example_decode(device, impl, fnuz, row):
    _, idx, length, sink, o0, o448, lse_v, _ = row
    a, b = worked_rows()
    cache = build_cache(2, 64, [70, 5], torch.stack([a, b]), fnuz=fnuz, padded=False, device=device)
    assert tuple(cache.tensor.shape) == (2, 64, 584)
    with implementation(impl, device):
        out, lse = d.flash_mla_with_kvcache(
            worked_q(device), cache.tensor, None, None, 512, None, softmax_scale=LN2, is_fp8_kvcache=True,
            indices=torch.tensor([[idx]], dtype=torch.int32, device=device),
            attn_sink=None if sink is None else torch.tensor([sink], device=device),
            topk_length=None if length is None else torch.tensor([length], dtype=torch.int32, device=device),
            use_fnuz=fnuz)
    check_worked(out, [(lse, lse_v, "lse")], o0, o448, f"decode {row[0]} [{impl}]")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("row", [WORKED[0], WORKED[2], WORKED[5]], ids=["S=AB", "sink-ln2", "len-1"])
def test_worked_example_two_caches(device, impl, row):
    """Main indices [70, -1] (A), B in a C128A extra cache [3, 1728] (2-D, bs 2) at slot 5: the same rows.
    topk_length [1] keeps only A (the extra cache's length is None: B stays) unless extra_topk_length is 0."""
    _, _, length, sink, o0, o448, lse_v, _ = row
    a, b = worked_rows()
    main = build_cache(2, 64, [70], a[None], padded=False, device=device)
    extra = build_cache(3, 2, [5], b[None], form="2d", padded=True, device=device)
    x_len = None if length is None else torch.tensor([0], dtype=torch.int32, device=device)
    with implementation(impl, device):
        out, lse = d.flash_mla_with_kvcache(
            worked_q(device), main.tensor, None, None, 512, None, softmax_scale=LN2, is_fp8_kvcache=True,
            indices=torch.tensor([[[70, -1]]], dtype=torch.int32, device=device),
            attn_sink=None if sink is None else torch.tensor([sink], device=device), extra_k_cache=extra.tensor,
            extra_indices_in_kvcache=torch.tensor([[[5]]], dtype=torch.int32, device=device),
            topk_length=None if length is None else torch.tensor([length], dtype=torch.int32, device=device),
            extra_topk_length=x_len)
    check_worked(out, [(lse, lse_v, "lse")], o0, o448, f"two caches {row[0]} [{impl}]")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("row", WORKED, ids=[r[0] for r in WORKED])
def test_worked_example_prefill(device, impl, row):
    """kv = [B, A]; indices [1, 0, 2, -1] (2 = Skv is out of range), the duplicate row [1, 0, 0]."""
    _, idx, length, sink, o0, o448, lse_v, max_v = row
    a, b = worked_rows()
    kv = torch.stack([b, a]).to(torch.bfloat16).view(2, 1, D).to(device)
    with implementation(impl, device):
        out, max_logits, lse = d.flash_mla_sparse_fwd(
            worked_q(device)[0], kv, torch.tensor([[[PREFILL_SLOT[v] for v in idx]]], dtype=torch.int32,
                                                  device=device), LN2,
            attn_sink=None if sink is None else torch.tensor([sink], device=device),
            topk_length=None if length is None else torch.tensor([length], dtype=torch.int32, device=device))
    assert tuple(max_logits.shape) == (1, 1) and tuple(lse.shape) == (1, 1)
    check_worked(out, [(lse, lse_v, "lse"), (max_logits, max_v, "max_logits")], o0, o448,
                 f"prefill {row[0]} [{impl}]")


# ================================================================================================
# Split counts and numbers of query rows
# ================================================================================================
SPLIT_SPEC = DecodeSpec(batch=2, s_q=2, width=40, extra_width=40, lens=("full", "part"), x_lens=("full", "over"),
                        sinks=(-INF, 0.0, PEAK_LOGIT, 3.0), seed=30)


def test_decode_every_split_count(device):
    """forced_splits(n): each row's selection in exactly n parts (8 > the row's 6 tiles under the interpreter:
    empty splits combine); every n gives the oracle result and agrees with n = 1 within tolerance."""
    case = DecodeCase(SPLIT_SPEC, device)
    counts = (1, 2, 3, 5, 8) if device.type == "cpu" else (1, 2, 3, 5, 8, 16, 32)
    one = None
    for n in counts:
        out, lse = run_decode(case, "kernel", splits=n)
        check_decode(case, out, lse, f"splits={n}")
        if one is None:
            one = out.detach().cpu().double()
        else:
            assert_close(out, one, what=f"splits={n} vs 1")
    out, lse = run_decode(case, "kernel")   # the automatic split count
    check_decode(case, out, lse, "automatic splits")


def test_plan_hooks_bounds():
    """forced_splits and forced_programs reject counts out of range or not ints, and restore on exit."""
    for bad in (0, 33, -1, 2.0, True):
        with pytest.raises(ValueError, match="splits"):
            with forced_splits(bad):
                pass
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="programs"):
            with ops.forced_programs(bad):
                pass
    with ops.forced_programs(2):
        assert ops.SPLITS.programs == 2
    assert ops.SPLITS.programs is None


def test_half_tiles_rule():
    """Decode rows of at least HALF_TILE_STEPS steps take the two-half steps on sm_90 (the target measured) and under
    the interpreter (so that the CPU tests run them); rows of fewer steps, prefill and other targets keep one tile."""
    sm90, sm80, gfx = TARGETS_BY_NAME["sm_90"], TARGETS_BY_NAME["sm_80"], TARGETS_BY_NAME["gfx942"]
    steps = kernels.HALF_TILE_STEPS
    assert kernels.half_tiles(sm90, False, steps * 64, 64)
    assert not kernels.half_tiles(sm90, False, steps * 64 - 1, 64)          # SWA-only rows: 128 positions
    assert not kernels.half_tiles(sm90, True, 4096, 64)
    assert not kernels.half_tiles(sm80, False, 4096, 32) and not kernels.half_tiles(gfx, False, 4096, 64)
    assert kernels.half_tiles(platform.INTERPRETER_TARGET, False, steps * 16, 16)
    c4a = dict(main=kernels.Source(64, False), extra=kernels.Source(64, False), has_len=True, has_x_len=True,
               sinks=False, split=True, hq=64, prefill=False)
    assert kernels.constexprs(sm90, **c4a, positions=128 + 512)["HALVES"]
    assert not kernels.constexprs(sm90, **c4a, positions=128)["HALVES"]


ROWS_CPU = [(1, 1), (3, 2), (24, 1)]
ROWS_GPU = ROWS_CPU + [(64, 1), (100, 3), (256, 2)]


@pytest.mark.parametrize("batch,s_q", ROWS_GPU, ids=[f"B{b}xsq{s}" for b, s in ROWS_GPU])
def test_decode_query_rows(device, batch, s_q):
    """B*s_q from 1 to 512 (CPU: up to 24) with the automatic split count (which depends on it)."""
    if device.type == "cpu" and (batch, s_q) not in ROWS_CPU:
        pytest.skip("interpreter budget: the kernel runs these on a GPU")
    spec = DecodeSpec(batch=batch, s_q=s_q, hq=16, width=40, extra_width=30,
                      lens=("full", "part", "one", "zero", "over"), x_lens=("part", "full", "zero"),
                      nb=max(3, batch // 8 + 2), x_nb=max(3, batch // 8 + 2), seed=31 + batch)
    case = DecodeCase(spec, device)
    out, lse = run_decode(case, "kernel")
    check_decode(case, out, lse, f"B {batch} s_q {s_q}")


# ================================================================================================
# NaN: unused pages, NaN inside a selected row, NaN sink
# ================================================================================================
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fnuz", [False, True], ids=["ocp", "fnuz"])
def test_unused_pages_nan_outputs_finite(device, impl, fnuz):
    """Every unwritten byte is a NaN code, index entries past the lengths point at NaN slots: outputs finite."""
    case = DecodeCase(DecodeSpec(batch=3, width=20, extra_width=12, x_bs=2, x_nb=12, fnuz=fnuz,
                                 lens=("full", "part", "one"), x_lens=("part", "full", "one"), seed=40), device)
    nan_codes = torch.tensor([0x80] if fnuz else [0x7F, 0xFF], dtype=torch.uint8)
    for cache in (case.main, case.extra):
        raw = cache.raw_cpu()
        assert torch.isin(raw[-1], nan_codes).all()               # the last page is never written
        assert torch.isin(raw, nan_codes).float().mean() > 0.3
    past = sum(v in case.main.unwritten for t, row in enumerate(case.idx_list)
               for v in row[min(max(case.lens_list[t], 0), 20):])
    assert past > 0, "no entry past a length points at a NaN slot"
    out, lse = run_decode(case, impl)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    check_decode(case, out, lse, f"NaN pages [{impl}]")


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_in_selected_row(device, impl):
    """A NaN NoPE value (stored as a NaN code) or a NaN RoPE value (bf16 bits) in a selected row: that query row's
    out is NaN for every head (also through a split); the same row past a length is harmless."""
    g = torch.Generator().manual_seed(41)
    rows = random_rows(12, g)
    rows[0, 5] = float("nan")            # NoPE block 0
    rows[1, 470] = float("nan")          # RoPE
    slots = list(range(12))
    cache = build_cache(2, 64, slots, rows, device=device)
    raw = cache.raw_cpu()
    assert raw[0, 5] in (0x7F, 0xFF)     # the writer stored a NaN code
    idx = torch.tensor([[[2, 0, 3, 4]], [[5, 6, 1, 7]], [[8, 9, 10, 0]]], dtype=torch.int32, device=device)
    lens = torch.tensor([4, 4, 3], dtype=torch.int32, device=device)   # row 2: slot 0 is past its length
    q = torch.randn(3, 1, 16, D, generator=g).to(torch.bfloat16).to(device)
    sink = torch.tensor([0.0, -INF, 2.0, INF] * 4, device=device)
    for splits in (None, 2):
        ctx = forced_splits(splits) if splits else contextlib.nullcontext()
        with implementation(impl, device), ctx:
            out, lse = d.flash_mla_with_kvcache(q, cache.tensor, None, None, 512, None, softmax_scale=SHARP,
                                                is_fp8_kvcache=True, indices=idx, attn_sink=sink, topk_length=lens)
        o = out.cpu().float()
        assert o[0].isnan().all() and o[1].isnan().all(), f"splits={splits} [{impl}]: NaN not propagated"
        assert torch.isfinite(o[2]).all()
        exp_out, _, exp_lse = oracle_attend(q[2, 0].cpu().double(), oracle_rows(cache, [8, 9, 10]), SHARP,
                                               sink.cpu().double())
        check_out(out[2, 0], exp_out, f"finite row, splits={splits} [{impl}]")
        check_stat(lse[2, :, 0], exp_lse, f"finite row lse, splits={splits} [{impl}]")


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_in_selected_prefill_row(device, impl):
    g = torch.Generator().manual_seed(42)
    kv = random_rows(10, g)
    kv[3, 100] = float("nan")
    kv = kv.to(torch.bfloat16).view(10, 1, D).to(device)
    q = torch.randn(2, 16, D, generator=g).to(torch.bfloat16).to(device)
    idx = torch.tensor([[[0, 3, 5]], [[1, 2, 3]]], dtype=torch.int32, device=device)
    lens = torch.tensor([3, 2], dtype=torch.int32, device=device)
    with implementation(impl, device):
        out, _, _ = d.flash_mla_sparse_fwd(q, kv, idx, SHARP, topk_length=lens)
    o = out.cpu().float()
    assert o[0].isnan().all() and torch.isfinite(o[1]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_sink(device, impl):
    """sink NaN on head 1: that head's out is NaN where S is non-empty, 0 where S is empty; lse (without the sink)
    and the other heads are unaffected."""
    case = DecodeCase(DecodeSpec(batch=3, width=12, lens=("full", "zero", "part"),
                                 sinks=(0.0, float("nan"), PEAK_LOGIT, -INF), seed=43), device)
    out, lse = run_decode(case, impl)
    o = out.cpu().float()
    assert o[0, 0, 1].isnan().all() and o[2, 0, 1].isnan().all()
    assert torch.equal(o[1], torch.zeros_like(o[1]))                 # S empty: 0 whatever the sink
    assert torch.isfinite(lse[0]).all() and torch.isfinite(lse[2]).all() and (lse[1] == INF).all()
    check_decode(case, out, lse, f"NaN sink [{impl}]")


# ================================================================================================
# Prefill vs the oracle
# ================================================================================================
@dataclasses.dataclass(frozen=True)
class PrefillSpec:
    tokens: int = 5
    hq: int = 16
    skv: int = 40
    width: int = 24
    lens: tuple | None = ("part", "full", "zero", "one", "over")
    sinks: tuple | None = (0.0, -INF, PEAK_LOGIT, -2.0)
    scale: float = SHARP
    nan_rows: int = 6          # kv rows of NaN, referenced only past a token's length
    seed: int = 0


class PrefillCase:
    def __init__(self, spec: PrefillSpec, device):
        self.spec = s = spec
        self.device = device = torch.device(device)
        g = torch.Generator().manual_seed(s.seed)
        rng = random.Random(s.seed)
        q = torch.randn(s.tokens, s.hq, D, generator=g).to(torch.bfloat16)
        kv = random_rows(s.skv, g)
        nan_rows = rng.sample(range(s.skv), s.nan_rows)
        good = [i for i in range(s.skv) if i not in nan_rows]
        kv[nan_rows] = float("nan")
        self.lens_list = None if s.lens is None else [LEN_CODES[s.lens[t % len(s.lens)]](s.width)
                                                      for t in range(s.tokens)]
        peaks = rng.sample(good, s.tokens)
        hostile = [-1, -7, INT32_MIN, s.skv, s.skv + 13, INT32_MAX]
        self.idx_list = []
        for t in range(s.tokens):
            n = s.width if self.lens_list is None else min(max(self.lens_list[t], 0), s.width)
            row = []
            for i in range(s.width):
                if i >= n:
                    row.append(rng.choice(nan_rows + [-1]))
                elif i % 5 == 1:
                    row.append(hostile[(i // 5 + t) % 6])
                elif i % 5 == 3:
                    row.append(row[i - 1])
                else:
                    row.append(rng.choice(good))
            if n > 0:
                row[rng.choice([i for i in range(n) if i % 5 in (0, 4)])] = peaks[t]
                q0 = q[t, 0].float()
                kv[peaks[t]] += PEAK_LOGIT / (s.scale * float(q0 @ q0)) * q0
            self.idx_list.append(row)
        self.q = q.to(device)
        self.kv = kv.to(torch.bfloat16).view(s.skv, 1, D).to(device)
        self.idx = torch.tensor(self.idx_list, dtype=torch.int32, device=device).view(s.tokens, 1, s.width)
        self.lens = None if self.lens_list is None else torch.tensor(self.lens_list, dtype=torch.int32,
                                                                     device=device)
        self.sink = None if s.sinks is None else torch.tensor([s.sinks[h % len(s.sinks)] for h in range(s.hq)],
                                                              device=device)

    def expected(self):
        s = self.spec
        out = torch.zeros(s.tokens, s.hq, D, dtype=torch.float64)
        mx = torch.zeros(s.tokens, s.hq, dtype=torch.float64)
        lse = torch.zeros(s.tokens, s.hq, dtype=torch.float64)
        rows = self.kv.cpu().double().view(s.skv, D)
        qd = self.q.cpu().double()
        sink = None if self.sink is None else self.sink.cpu().double()
        for t in range(s.tokens):
            sel = selected(self.idx_list[t], None if self.lens_list is None else self.lens_list[t], s.skv)
            out[t], mx[t], lse[t] = oracle_attend(qd[t], rows[sel], s.scale, sink)
        return out, mx, lse

    def args(self):
        return (self.q, self.kv, self.idx, self.spec.scale, self.sink, self.lens)


def check_prefill(case: PrefillCase, out, max_logits, lse, what):
    e_out, e_max, e_lse = case.expected()
    check_out(out, e_out, f"{what}: out")
    check_stat(max_logits, e_max, f"{what}: max_logits")
    check_stat(lse, e_lse, f"{what}: lse")


PREFILL_SCENARIOS = {
    "h16": PrefillSpec(seed=50),
    "h16-lens-none-no-sink": PrefillSpec(lens=None, sinks=None, tokens=3, seed=51),
    "h16-sink-inf": PrefillSpec(sinks=(INF, 0.0, -INF), tokens=4, lens=("full", "zero", "part", "neg"), seed=52),
    "h64-small": PrefillSpec(hq=64, tokens=2, width=12, lens=("full", "part"), seed=53),
    "h128-small": PrefillSpec(hq=128, tokens=2, width=10, lens=("part", "max"), seed=54),
    "h1": PrefillSpec(hq=1, tokens=3, sinks=(PEAK_LOGIT,), seed=55),
    # the sm_90 Gluon path's head count (kernels/sparse_mla_gluon.py): 64-row steps, empty and infinite-sink rows
    "h64-sink-inf-two-steps": PrefillSpec(hq=64, tokens=4, skv=90, width=70, sinks=(INF, 0.0, -INF),
                                          lens=("full", "zero", "part", "neg"), seed=57),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(PREFILL_SCENARIOS))
def test_prefill_matches_oracle(device, impl, name):
    case = PrefillCase(PREFILL_SCENARIOS[name], device)
    assert case.expected()[0].abs().max() > 0.1
    with implementation(impl, device):
        out, max_logits, lse = d.flash_mla_sparse_fwd(case.q, case.kv, case.idx, case.spec.scale,
                                                      attn_sink=case.sink, topk_length=case.lens)
    assert tuple(max_logits.shape) == (case.spec.tokens, case.spec.hq) and max_logits.dtype == torch.float32
    check_prefill(case, out, max_logits, lse, f"{name} [{impl}]")


@pytest.mark.parametrize("programs", [None, 5])
@pytest.mark.parametrize("hq", [64, 128])
def test_prefill_wide_shapes(device, hq, programs):
    """64 and 128 heads (the sm_90 Gluon prefill on an H100), its persistent programs as planned (one token
    each here) and capped at 5, each then looping over 2-3 tokens of different lengths."""
    impl = "reference" if device.type == "cpu" else "kernel"
    case = PrefillCase(PrefillSpec(hq=hq, tokens=12, skv=300, width=200, nan_rows=40, seed=56 + hq), device)
    with implementation(impl, device), plan_hooks(programs=programs):
        out, max_logits, lse = d.flash_mla_sparse_fwd(case.q, case.kv, case.idx, case.spec.scale,
                                                      attn_sink=case.sink, topk_length=case.lens)
    check_prefill(case, out, max_logits, lse, f"wide hq {hq}, programs {programs} [{impl}]")


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_strided_and_unaligned(device, impl):
    """64 heads with q at an address that is not a multiple of 16 bytes, and kv rows 520 (a multiple of 8) or 516
    elements apart: the sm_90 path copies 16-byte pieces, so the plan takes it only for aligned q and kv and rows a
    multiple of 8 elements apart, the Triton kernel otherwise. Every form equals the oracle."""
    case = PrefillCase(PrefillSpec(hq=64, tokens=3, skv=70, width=40, seed=58), device)
    storage = torch.empty(case.q.numel() + 8, dtype=torch.bfloat16, device=device)
    for q_offset, kv_row in ((0, 520), (1, 520), (0, 516)):
        q = storage[q_offset:q_offset + case.q.numel()].view(case.q.shape)
        q.copy_(case.q)
        kv = torch.zeros(case.spec.skv, 1, kv_row, dtype=torch.bfloat16, device=device)[:, :, :D]
        kv.copy_(case.kv)
        with implementation(impl, device):
            out, max_logits, lse = d.flash_mla_sparse_fwd(q, kv, case.idx, case.spec.scale, attn_sink=case.sink,
                                                          topk_length=case.lens)
        check_prefill(case, out, max_logits, lse, f"q offset {q_offset}, kv row {kv_row} [{impl}]")


def test_gluon_prefill_rule():
    """The prefill's Gluon kernel is planned on sm_90 with Triton 3.6 only, for multiples of 64 heads, q and kv
    strides that are multiples of 8 elements and a target with the shared memory a program takes."""
    from torch_dsv4_ops.kernels import sparse_mla_gluon as gk

    sm90 = next(t for t in platform.MATRIX_TARGETS if t.backend == "cuda" and t.arch == 90)
    sm80 = next(t for t in platform.MATRIX_TARGETS if t.backend == "cuda" and t.arch == 80)
    ok = dict(target=sm90, hq=64, q_strides=(64 * 520, 520, 1), kv_row_stride=520, version="3.6.0")
    assert gk.prefill_planned(**ok) == (gk.gluon is not None)
    assert gk.prefill_planned(**{**ok, "hq": 128}) == (gk.gluon is not None)
    for change in (dict(version="3.9.0"), dict(target=sm80), dict(hq=96), dict(hq=16), dict(kv_row_stride=516),
                   dict(q_strides=(64 * 516, 516, 1)), dict(q_strides=(64 * 512 + 4, 512, 1))):
        assert not gk.prefill_planned(**{**ok, **change}), change
    calls = ((4096, 64), (100, 64), (4096, 128), (1, 256))     # tokens, hq
    assert [gk.persistent_programs(*call, 132) for call in calls] == [132, 100, 66, 1]


# --- the prefill chain: quantize_and_insert -> dequantize_and_gather -> combine_topk_swa_indices -> prefill ---
# docs/ops/sparse_index.md's combine example: window 4, ratio 4, topk 2, global qsl [100, 103, 108]. Request 0:
# seq 10, q 3, SWA gather 6 (gstart 4), 2 compressed entries; request 1: seq 5, q 5, gather 5 (gstart 0), 1
# compressed entry. N = 2, M = 8. The combined rows (written out) and the workspace rows they name:
CHAIN_COMBINED = [[1, 0, 2, 3, 4, 5], [1, 0, 3, 4, 5, 6], [1, 0, 4, 5, 6, 7], [10], [10, 11], [10, 11, 12],
                  [8, 10, 11, 12, 13], [8, 11, 12, 13, 14]]
CHAIN_SWA_TABLE = [[2, 0], [1, 3]]     # SWA pages (bs 64) of each request: positions 0..63 in the first entry
CHAIN_C4A_TABLE = [[1], [0]]           # compressed pages (bs 64 = 256 // 4)


def chain_slot(b: int, k: int):
    """(cache, slot) behind workspace row k of request b: k < N: compressed position k; else SWA position
    gstart + k - N (gstart 4 for request 0, 0 for request 1)."""
    if k < 2:
        return "c4a", CHAIN_C4A_TABLE[b][0] * 64 + k
    return "swa", CHAIN_SWA_TABLE[b][0] * 64 + (4, 0)[b] + k - 2


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_over_gathered_workspace(device, impl):
    g = torch.Generator().manual_seed(60)
    swa_slots = [2 * 64 + p for p in range(10)] + [1 * 64 + p for p in range(5)]
    c4a_slots = [1 * 64 + 0, 1 * 64 + 1, 0 * 64 + 0]
    swa = build_cache(4, 64, swa_slots, random_rows(len(swa_slots), g), device=device, g=g)
    c4a = build_cache(3, 64, c4a_slots, random_rows(len(c4a_slots), g), device=device, g=g)
    i32 = dict(dtype=torch.int32, device=device)
    work = torch.full((2, 8, D), float("nan"), dtype=torch.bfloat16, device=device)   # rows never gathered: NaN
    topk = torch.tensor([[1, 0]] * 3 + [[0, -1]] * 5, **i32)
    with helpers_on(device):
        d.dequantize_and_gather_k_cache(work, c4a.tensor, torch.tensor([2, 1], **i32), None,
                                        torch.tensor(CHAIN_C4A_TABLE, **i32), 64, 0)
        d.dequantize_and_gather_k_cache(work, swa.tensor, torch.tensor([10, 5], **i32),
                                        torch.tensor([6, 5], **i32), torch.tensor(CHAIN_SWA_TABLE, **i32), 64, 2)
        combined, lens = d.combine_topk_swa_indices(topk, torch.tensor([100, 103, 108], **i32),
                                                    torch.tensor([10, 5], **i32), torch.tensor([6, 5], **i32),
                                                    4, 4, 2, 8, 2)
    assert [row[:n] for row, n in zip(combined.cpu().tolist(), lens.cpu().tolist())] == CHAIN_COMBINED
    hq = 16
    q = torch.randn(8, hq, D, generator=g).to(torch.bfloat16).to(device)
    sink = torch.tensor([0.0, -INF, PEAK_LOGIT, -2.0] * 4, device=device)
    kv = work.view(16, 1, D)
    with implementation(impl, device):
        out, max_logits, lse = d.flash_mla_sparse_fwd(q, kv, combined.unsqueeze(1), SHARP, attn_sink=sink,
                                                      topk_length=lens)
    caches = {"swa": swa, "c4a": c4a}
    e_out = torch.zeros(8, hq, D, dtype=torch.float64)
    e_max, e_lse = torch.zeros(8, hq, dtype=torch.float64), torch.zeros(8, hq, dtype=torch.float64)
    for t, rows in enumerate(CHAIN_COMBINED):
        kvs = torch.cat([oracle_rows(caches[c], [s]) for c, s in (chain_slot(r // 8, r % 8) for r in rows)])
        e_out[t], e_max[t], e_lse[t] = oracle_attend(q[t].cpu().double(), kvs, SHARP, sink.cpu().double())
    check_out(out, e_out, f"chain [{impl}]: out")
    check_stat(max_logits, e_max, f"chain [{impl}]: max_logits")
    check_stat(lse, e_lse, f"chain [{impl}]: lse")


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_shapes(device, impl):
    """B = 0 and Hq = 0: outputs of the right (empty) shapes; W = 0 with an extra cache: the extra rows alone;
    prefill Tq = 0, and Skv = 0 (every entry out of range): out 0, lse +inf, max_logits -inf."""
    case = DecodeCase(DecodeSpec(batch=2, width=8, extra_width=10, lens=("full", "part"), seed=62), device)
    with implementation(impl, device):
        out, lse = d.flash_mla_with_kvcache(**case.kwargs(
            q=case.q[:0], indices=case.idx[:0], topk_length=case.lens[:0], extra_indices_in_kvcache=case.x_idx[:0],
            extra_topk_length=case.x_lens[:0]))
        assert tuple(out.shape) == (0, 1, 16, D) and tuple(lse.shape) == (0, 16, 1)
        out, lse = d.flash_mla_with_kvcache(**case.kwargs(q=case.q[:, :, :0], attn_sink=None))
        assert tuple(out.shape) == (2, 1, 0, D) and tuple(lse.shape) == (2, 0, 1)
        out, lse = d.flash_mla_with_kvcache(**case.kwargs(indices=case.idx[:, :, :0]))
    case.idx_list = [[] for _ in case.idx_list]      # the oracle sees W = 0 too
    check_decode(case, out, lse, f"W = 0 [{impl}]")
    pre = PrefillCase(PrefillSpec(tokens=3, width=8, seed=63), device)
    with implementation(impl, device):
        out, mx, lse = d.flash_mla_sparse_fwd(pre.q[:0], pre.kv, pre.idx[:0], SHARP, attn_sink=pre.sink,
                                              topk_length=pre.lens[:0])
        assert tuple(out.shape) == (0, 16, D) and tuple(mx.shape) == (0, 16) and tuple(lse.shape) == (0, 16)
        out, mx, lse = d.flash_mla_sparse_fwd(pre.q, pre.kv[:0], pre.idx, SHARP, attn_sink=pre.sink,
                                              topk_length=pre.lens)
    assert torch.equal(out.cpu().float(), torch.zeros(3, 16, D))
    assert (lse.cpu() == INF).all() and (mx.cpu() == -INF).all()


# ================================================================================================
# Output buffers, workspace, helpers
# ================================================================================================
def out_view(shape, device, pad=2):
    """A poisoned strided view of `shape` inside a larger buffer (padding heads on both sides) and the buffer."""
    big = poison_(torch.empty(shape[:-2] + (shape[-2] + 2 * pad, shape[-1]), dtype=torch.bfloat16, device=device))
    return big[..., pad:pad + shape[-2], :], big


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ws_dtype", [torch.bfloat16, torch.uint8, torch.float32])
def test_decode_into_buffers(device, impl, ws_dtype):
    """out (a strided view), lse (a transposed view of a [B, s_q, Hq] buffer) and workspace given: written in place,
    the returned objects are those buffers, the padding around the out view keeps its sentinel."""
    case = DecodeCase(DecodeSpec(batch=2, s_q=2, width=20, extra_width=16, lens=("full", "part"), seed=70), device)
    b, s_q, hq = 2, 2, 16
    out, big = out_view((b, s_q, hq, D), device)
    lse_buf = poison_(torch.empty(b, s_q, hq, device=device))
    lse = lse_buf.transpose(1, 2)
    with forced_splits(3):
        elements = d.sparse_mla_workspace_size(b, s_q, hq, device)
    ws = poison_(torch.empty(2 * elements // ws_dtype.itemsize, dtype=ws_dtype, device=device))
    before = big.clone()
    got_out, got_lse = run_decode(case, impl, splits=3, out=out, lse=lse, workspace=ws)
    assert got_out is out and got_lse is lse
    check_decode(case, out, lse, f"into buffers [{impl}]")
    check_decode(case, big[:, :, 2:2 + hq], lse_buf.transpose(1, 2), f"buffers themselves [{impl}]")
    pad = torch.ones(big.shape[2], dtype=torch.bool)
    pad[2:2 + hq] = False
    assert torch.equal(big[:, :, pad].view(torch.int16), before[:, :, pad].view(torch.int16)), "padding written"


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_out_only(device, impl):
    """Only out= (lse and workspace allocated by the wrapper); block_table, cache_seqlens, the metadata pair and
    num_splits are ignored: junk values give the same result as None."""
    case = DecodeCase(DecodeSpec(batch=2, width=16, extra_width=10, lens=("part", "full"), seed=71), device)
    out = poison_(torch.empty_like(case.q))
    meta, splits = d.get_mla_metadata(case.lens, 64, 1)
    junk = dict(block_table=torch.full((2, 3), -5, dtype=torch.int32, device=device),
                cache_seqlens=torch.tensor([7, INT32_MAX], dtype=torch.int32, device=device),
                tile_scheduler_metadata=meta, num_splits=splits)
    got_out, lse = run_decode(case, impl, out=out, **junk)
    assert got_out is out
    check_decode(case, out, lse, f"out only [{impl}]")
    plain_out, plain_lse = run_decode(case, impl)
    assert torch.equal(plain_out, out) and torch.equal(plain_lse, lse)


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_into_buffers(device, impl):
    case = PrefillCase(PrefillSpec(tokens=4, width=16, lens=("full", "zero", "part", "one"), seed=72), device)
    t, hq = 4, 16
    out, big = out_view((t, hq, D), device)
    before = big.clone()
    max_buf = poison_(torch.empty(hq, t, device=device))
    lse_buf = poison_(torch.empty(hq, t, device=device))
    max_logits, lse = max_buf.T, lse_buf.T          # transposed views: any strides
    with implementation(impl, device):
        got = d.flash_mla_sparse_fwd(case.q, case.kv, case.idx, case.spec.scale, attn_sink=case.sink,
                                     topk_length=case.lens, out=out, max_logits=max_logits, lse=lse)
    assert got[0] is out and got[1] is max_logits and got[2] is lse
    check_prefill(case, out, max_buf.T, lse_buf.T, f"prefill into buffers [{impl}]")
    pad = torch.ones(big.shape[1], dtype=torch.bool)
    pad[2:2 + hq] = False
    assert torch.equal(big[:, pad].view(torch.int16), before[:, pad].view(torch.int16)), "padding written"


def test_prefill_into_buffers_identity(device):
    """The wrapper returns the very objects it was given."""
    case = PrefillCase(PrefillSpec(tokens=2, width=8, seed=73), device)
    out = torch.empty_like(case.q)
    mx = torch.empty(2, 16, device=device)
    lse = torch.empty(2, 16, device=device)
    got = d.flash_mla_sparse_fwd(case.q, case.kv, case.idx, SHARP, attn_sink=case.sink, topk_length=case.lens,
                                 out=out, max_logits=mx, lse=lse)
    assert got[0] is out and got[1] is mx and got[2] is lse


def test_get_mla_metadata(device):
    seqlens = torch.tensor([5, 9], dtype=torch.int32, device=device)
    for pair in (d.get_mla_metadata(seqlens, 64, 1), d.get_mla_metadata(cache_seqlens=seqlens),
                 d.get_mla_metadata()):
        assert isinstance(pair, tuple) and len(pair) == 2
        for t in pair:
            assert isinstance(t, torch.Tensor) and t.dtype == torch.int32
    assert all(t.device == seqlens.device for t in d.get_mla_metadata(seqlens, 64, 1))
    assert all(t.device.type == "cpu" for t in d.get_mla_metadata(64, 1))


def test_workspace_size(device):
    n = d.sparse_mla_workspace_size(4, 1, 64, device)
    assert type(n) is int and n > 0
    with forced_splits(4):
        forced = d.sparse_mla_workspace_size(4, 1, 64, device)
    assert type(forced) is int and forced >= 4 * 64 * 4 * D   # bf16 elements >= fp32 partials of 4 splits


def test_workspace_too_small(device):
    """Under forced_splits(4) the call splits: a workspace one byte short of 2 * size is refused, naming the
    workspace, and out keeps its bytes; exactly 2 * size bytes (uint8) works."""
    case = DecodeCase(DecodeSpec(batch=2, width=24, lens=("full", "part"), seed=74), device)
    with forced_splits(4):
        size = d.sparse_mla_workspace_size(2, 1, 16, device)
    out = poison_(torch.empty_like(case.q))
    before = out.clone()
    short = torch.empty(2 * size - 1, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="workspace"):
        run_decode(case, "kernel", splits=4, out=out, workspace=short)
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))
    exact = torch.empty(2 * size, dtype=torch.uint8, device=device)
    got, lse = run_decode(case, "kernel", splits=4, out=out, workspace=exact)
    check_decode(case, got, lse, "exact workspace")


# ================================================================================================
# Bad input: errors name the argument, outputs untouched
# ================================================================================================
def _bad_decode_case():
    return DecodeCase(DecodeSpec(batch=2, hq=4, width=8, extra_width=6, nb=2, x_nb=2, lens=("full", "part"),
                                 sinks=(0.0,), seed=80), "cpu")


def _misaligned_cache():
    buf = torch.zeros(2 * 64 * 584 + 8, dtype=torch.uint8)
    return buf[1:1 + 2 * 64 * 584].view(2, 64, 584)


BAD_DECODE = [   # (id, overrides(case) -> dict, exception, match)
    ("head_dim_v", lambda c: dict(head_dim_v=256), ValueError, "head_dim_v"),
    ("dense-decode", lambda c: dict(indices=None), NotImplementedError, "indices|dense"),
    ("not-fp8", lambda c: dict(is_fp8_kvcache=False), ValueError, "is_fp8_kvcache"),
    ("causal", lambda c: dict(causal=True), ValueError, "causal"),
    ("extra-cache-without-indices", lambda c: dict(extra_indices_in_kvcache=None), ValueError, "extra"),
    ("extra-indices-without-cache", lambda c: dict(extra_k_cache=None), ValueError, "extra"),
    ("extra-length-without-cache", lambda c: dict(extra_k_cache=None, extra_indices_in_kvcache=None),
     ValueError, "extra_topk_length"),
    ("q-dtype", lambda c: dict(q=c.q.float()), ValueError, r"\bq\b"),
    ("q-head-dim", lambda c: dict(q=c.q[..., :256]), ValueError, r"\bq\b"),
    ("q-last-stride", lambda c: dict(q=c.q.transpose(2, 3).contiguous().transpose(2, 3)), ValueError, r"\bq\b"),
    ("q-rank", lambda c: dict(q=c.q[:, 0]), ValueError, r"\bq\b"),
    ("indices-dtype", lambda c: dict(indices=c.idx.long()), ValueError, "indices"),
    ("indices-shape", lambda c: dict(indices=c.idx[:1]), ValueError, "indices"),
    ("extra-indices-dtype", lambda c: dict(extra_indices_in_kvcache=c.x_idx.long()), ValueError, "extra_indices"),
    ("topk-length-dtype", lambda c: dict(topk_length=c.lens.long()), ValueError, "topk_length"),
    ("topk-length-shape", lambda c: dict(topk_length=c.lens[:1]), ValueError, "topk_length"),
    ("extra-topk-length-shape", lambda c: dict(extra_topk_length=c.x_lens[:1]), ValueError, "extra_topk_length"),
    ("attn_sink-shape", lambda c: dict(attn_sink=torch.zeros(5)), ValueError, "attn_sink"),
    ("attn_sink-dtype", lambda c: dict(attn_sink=torch.zeros(4, dtype=torch.bfloat16)), ValueError, "attn_sink"),
    ("k_cache-last-dim", lambda c: dict(k_cache=torch.zeros(2, 64, 583, dtype=torch.uint8)), ValueError, "k_cache"),
    ("k_cache-dtype", lambda c: dict(k_cache=torch.zeros(2, 64, 584)), ValueError, "k_cache"),
    ("k_cache-4d-not-1", lambda c: dict(k_cache=torch.zeros(2, 64, 2, 584, dtype=torch.uint8)), ValueError,
     "k_cache"),
    ("k_cache-2d-short-page", lambda c: dict(k_cache=torch.zeros(2, 500, dtype=torch.uint8)), ValueError, "k_cache"),
    ("k_cache-page-stride", lambda c: dict(k_cache=torch.zeros(2 * 37376, dtype=torch.uint8).as_strided(
        (2, 64, 584), (37376 - 8, 584, 1))), ValueError, "k_cache"),
    ("k_cache-misaligned", lambda c: dict(k_cache=_misaligned_cache()), ValueError, "k_cache"),
    ("extra_k_cache-last-dim", lambda c: dict(extra_k_cache=torch.zeros(2, 64, 600, dtype=torch.uint8)),
     ValueError, "extra_k_cache"),
    ("out-shape", lambda c: dict(out=poison_(torch.empty(2, 1, 3, D, dtype=torch.bfloat16))), ValueError, "out"),
    ("out-dtype", lambda c: dict(out=torch.zeros(2, 1, 4, D)), ValueError, "out"),
    ("lse-shape", lambda c: dict(out=poison_(torch.empty_like(c.q)), lse=torch.zeros(2, 1, 4)), ValueError, "lse"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", BAD_DECODE, ids=[b[0] for b in BAD_DECODE])
def test_bad_decode_input(impl, bad):
    _, overrides, exc, match = bad
    case = _bad_decode_case()
    kw = overrides(case)
    out = kw.get("out")
    before = out.clone() if out is not None else None
    with implementation(impl, torch.device("cpu")), pytest.raises(exc, match=match):
        d.flash_mla_with_kvcache(**case.kwargs(**kw))
    if out is not None and out.dtype == torch.bfloat16:
        assert torch.equal(out.view(torch.int16), before.view(torch.int16)), "out written before the error"


def _bad_prefill_case():
    return PrefillCase(PrefillSpec(tokens=3, hq=4, skv=12, width=6, sinks=(0.0,), lens=("full",), nan_rows=2,
                                   seed=81), "cpu")


BAD_PREFILL = [
    ("d_v", lambda c: dict(d_v=256), "d_v"),
    ("kv-two-heads", lambda c: dict(kv=torch.zeros(12, 2, D, dtype=torch.bfloat16)), r"\bkv\b"),
    ("kv-dtype", lambda c: dict(kv=c.kv.float()), r"\bkv\b"),
    ("kv-dim", lambda c: dict(kv=c.kv[..., :256]), r"\bkv\b"),
    ("kv-rank", lambda c: dict(kv=c.kv[:, 0]), r"\bkv\b"),
    ("q-dtype", lambda c: dict(q=c.q.half()), r"\bq\b"),
    ("q-rank", lambda c: dict(q=c.q[None]), r"\bq\b"),
    ("indices-dtype", lambda c: dict(indices=c.idx.long()), "indices"),
    ("indices-two-groups", lambda c: dict(indices=c.idx.expand(3, 2, 6).contiguous()), "indices"),
    ("indices-tokens", lambda c: dict(indices=c.idx[:2]), "indices"),
    ("indices-width-0", lambda c: dict(indices=c.idx[:, :, :0]), "indices"),
    ("topk_length-shape", lambda c: dict(topk_length=c.lens[:2]), "topk_length"),
    ("topk_length-dtype", lambda c: dict(topk_length=c.lens.long()), "topk_length"),
    ("attn_sink-shape", lambda c: dict(attn_sink=torch.zeros(3)), "attn_sink"),
    ("out-shape", lambda c: dict(out=poison_(torch.empty(3, 5, D, dtype=torch.bfloat16))), r"\bout\b"),
    ("max_logits-shape", lambda c: dict(max_logits=torch.zeros(4, 3)), "max_logits"),
    ("lse-dtype", lambda c: dict(lse=torch.zeros(3, 4, dtype=torch.float64)), "lse"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", BAD_PREFILL, ids=[b[0] for b in BAD_PREFILL])
def test_bad_prefill_input(impl, bad):
    _, overrides, match = bad
    case = _bad_prefill_case()
    kw = dict(q=case.q, kv=case.kv, indices=case.idx, sm_scale=SHARP, d_v=512, attn_sink=case.sink,
              topk_length=case.lens)
    kw.update(overrides(case))
    out = kw.get("out")
    before = out.clone() if out is not None else None
    with implementation(impl, torch.device("cpu")), pytest.raises(ValueError, match=match):
        d.flash_mla_sparse_fwd(**kw)
    if out is not None:
        assert torch.equal(out.view(torch.int16), before.view(torch.int16)), "out written before the error"


# ================================================================================================
# opcheck and torch.compile
# ================================================================================================
def _opcheck_decode_args(device, out_form: bool):
    case = DecodeCase(DecodeSpec(batch=2, hq=4, width=10, extra_width=8, x_bs=2, x_nb=8, nb=2,
                                 lens=("full", "part"), x_lens=("part", "over"), sinks=(0.0, PEAK_LOGIT), seed=90),
                      device)
    args = case.op_args()
    if not out_form:
        return args
    lse = torch.zeros(2, 1, 4, device=device).transpose(1, 2)
    with forced_splits(2):
        ws = torch.zeros(d.sparse_mla_workspace_size(2, 1, 4, device), dtype=torch.bfloat16, device=device)
    return args[:9] + [torch.zeros_like(case.q), lse, ws] + args[9:]


def _opcheck_prefill_args(device, out_form: bool):
    case = PrefillCase(PrefillSpec(tokens=3, hq=4, skv=20, width=8, lens=("full", "part", "zero"),
                                   sinks=(0.0, PEAK_LOGIT), nan_rows=3, seed=91), device)
    if not out_form:
        return list(case.args())
    return [case.q, case.kv, case.idx, case.spec.scale, torch.zeros_like(case.q), torch.zeros(3, 4, device=device),
            torch.zeros(4, 3, device=device).T, case.sink, case.lens]


# tensors that may take any strides (permuted) / that keep a contiguous last dim (padded rows)
OPCHECK = {
    "decode": (DECODE, _opcheck_decode_args, False, (2, 6), (0, 2, 6)),
    "decode_out": (DECODE_OUT, _opcheck_decode_args, True, (2, 6, 10), (0, 2, 6, 9, 10)),
    "prefill": (PREFILL, _opcheck_prefill_args, False, (2,), (0, 1, 2)),
    "prefill_out": (PREFILL_OUT, _opcheck_prefill_args, True, (2, 5, 6), (0, 1, 2, 4, 5, 6)),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", list(OPCHECK))
def test_opcheck(device, impl, op):
    """torch.library.opcheck with contiguous, permuted (indices, lse, max_logits) and padded-row (q, kv, indices,
    out, lse) inputs; uint8 caches (float8 tensors cannot go through test_schema on CPU). The decode _out form
    splits (forced_splits(2)), so its workspace is really written."""
    fn, make, out_form, permuted, padded = OPCHECK[op]
    args = make(device, out_form)
    ctx = forced_splits(2) if op.startswith("decode") else contextlib.nullcontext()
    with implementation(impl, device), ctx:
        run_opcheck(fn, args, layouts=("contiguous", "permuted"), permute=lambda i, t: i in permuted)
        run_opcheck(fn, args, layouts=("padded",), permute=lambda i, t: i in padded)


def test_float8_cache_mutations(device):
    """The float8-cache call cannot go through opcheck on CPU: check instead that the _out form writes exactly out,
    lse and workspace, leaving the cache (float8) and every other input bit for bit unchanged."""
    case = DecodeCase(DecodeSpec(batch=2, width=12, extra_width=8, dtype=torch.float8_e4m3fn, seed=92), device)
    cache_bytes = case.main.raw.clone()
    x_bytes = case.extra.raw.clone()
    idx, lens, q = case.idx.clone(), case.lens.clone(), case.q.clone()
    out = poison_(torch.empty_like(case.q))
    lse = poison_(torch.empty(2, 16, 1, device=device))
    with implementation("kernel", device), forced_splits(2):
        ws = poison_(torch.empty(d.sparse_mla_workspace_size(2, 1, 16, device), dtype=torch.bfloat16,
                                 device=device))
        ws_before = ws.clone()
        DECODE_OUT(*(case.op_args()[:9] + [out, lse, ws] + case.op_args()[9:]))
    assert torch.equal(case.main.raw, cache_bytes) and torch.equal(case.extra.raw, x_bytes)
    assert torch.equal(case.idx, idx) and torch.equal(case.lens, lens) and torch.equal(case.q, q)
    assert not torch.equal(ws.view(torch.int16), ws_before.view(torch.int16)), "split partials not written"
    check_decode(case, out, lse, "float8 cache _out")


def _jits():
    return [kernels.sparse_mla_kernel, kernels.combine_kernel]


def test_compile_decode_no_recompile(device):
    """fullgraph=True, dynamic=True over three batch sizes with different W, K and lengths: one graph; on a GPU no
    new Triton compilation once each decode plan (small batches', the rest's) has run; the eager results equal the
    oracle. The sizes (B 3/5/7, W 20/28/17, K 12/9/22, nb 4, x_nb 6, Hq 16) never coincide within a call, so duck
    sizing ties none of them together."""
    cases = [DecodeCase(DecodeSpec(batch=b, width=w, extra_width=k, nb=4, x_nb=6,
                                   lens=("full", "part", "one"), x_lens=("part", "zero", "full"), seed=100 + b),
                        device) for b, w, k in ((3, 20, 12), (5, 28, 9), (7, 17, 22))]

    def step(q, cache, idx, lens, x_cache, x_idx, x_lens, sink):
        # the scale as a literal: a float input is traced as a dynamic float, which a custom op cannot take
        return d.flash_mla_with_kvcache(q, cache, None, None, 512, None, softmax_scale=0.08838834764831845,
                                        is_fp8_kvcache=True, indices=idx, attn_sink=sink, extra_k_cache=x_cache,
                                        extra_indices_in_kvcache=x_idx, topk_length=lens, extra_topk_length=x_lens)

    inputs = [(c.q, c.main.tensor, c.idx, c.lens, c.extra.tensor, c.x_idx, c.x_lens, c.sink) for c in cases]
    jits = _jits() if device.type == "cuda" else []
    if jits:
        for args in inputs[:2]:     # the first specialisation of each kernel; B 3 and B 5 take different plans
            step(*args)             # (kernels.small_decode)
        torch.cuda.synchronize()
    before = sum(triton_cache_entries(j) for j in jits)
    check_compile(step, inputs)      # compiled == eager bit for bit, one frame
    if jits:
        assert sum(triton_cache_entries(j) for j in jits) == before, "new Triton compilations"
    for c, args in zip(cases, inputs):
        out, lse = step(*args)
        check_decode(c, out, lse, f"compile B {c.spec.batch} eager")


def test_compile_prefill_no_recompile(device):
    cases = [PrefillCase(PrefillSpec(tokens=t, width=w, skv=40, lens=("full", "part", "zero"), seed=110 + t),
                         device) for t, w in ((3, 20), (5, 28), (9, 13))]

    def step(q, kv, idx, sink, lens):
        return d.flash_mla_sparse_fwd(q, kv, idx, 0.08838834764831845, attn_sink=sink, topk_length=lens)

    inputs = [(c.q, c.kv, c.idx, c.sink, c.lens) for c in cases]
    jits = _jits()[:1] if device.type == "cuda" else []
    if jits:
        step(*inputs[0])
        torch.cuda.synchronize()
    before = sum(triton_cache_entries(j) for j in jits)
    check_compile(step, inputs)      # compiled == eager bit for bit, one frame
    if jits:
        assert sum(triton_cache_entries(j) for j in jits) == before, "new Triton compilations"
    for c, args in zip(cases, inputs):
        check_prefill(c, *step(*args), f"compile Tq {c.spec.tokens} eager")


@pytest.mark.gpu
def test_compile_prefill_64_heads_no_recompile():
    """64 heads (the sm_90 Gluon kernel where it is planned) over three Tq and widths: one graph, no new
    compilation of any of the kernels."""
    from torch_dsv4_ops.kernels import sparse_mla_gluon as gk

    cases = [PrefillCase(PrefillSpec(hq=64, tokens=t, width=w, skv=90, lens=("full", "part", "zero"), seed=130 + t),
                         "cuda") for t, w in ((3, 70), (5, 28), (9, 130))]

    def step(q, kv, idx, sink, lens):
        return d.flash_mla_sparse_fwd(q, kv, idx, 0.08838834764831845, attn_sink=sink, topk_length=lens)

    inputs = [(c.q, c.kv, c.idx, c.sink, c.lens) for c in cases]
    jits = _jits()[:1] + ([gk.sparse_mla_prefill_gluon_kernel] if gk.gluon is not None else [])
    step(*inputs[0])
    torch.cuda.synchronize()
    before = sum(triton_cache_entries(j) for j in jits)
    check_compile(step, inputs)
    assert sum(triton_cache_entries(j) for j in jits) == before, "new Triton compilations"
    for c, args in zip(cases, inputs):
        check_prefill(c, *step(*args), f"compile Tq {c.spec.tokens} eager")


# ================================================================================================
# GPU only: CUDA graphs, sync-free eager calls, benchmark-sized decode
# ================================================================================================
def _graph_cases(splits: int | None, hq: int = 16, batch: int = 4):
    lens = [("full", "part", "one", "zero"), ("one", "over", "full", "part"), ("zero", "full", "neg", "full")]
    lens = [tuple(row[k % len(row)] for k in range(batch)) for row in lens]
    return [DecodeCase(DecodeSpec(batch=batch, hq=hq, width=128, extra_width=128, nb=4, x_nb=5, lens=lens[i],
                                  x_lens=lens[(i + 1) % 3], seed=120 + i + 10 * (splits or 0) + hq + batch), "cuda")
            for i in range(3)]


@pytest.mark.gpu
@pytest.mark.parametrize("splits,hq,batch,programs", [(None, 16, 4, None), (3, 16, 4, None), (1, 64, 4, None),
                                                      (None, 64, 6, None), (1, 64, 6, 2), (None, 64, 6, 5)],
                         ids=["auto-splits", "forced-3", "unsplit-h64", "auto-h64", "unsplit-h64-persistent-2",
                              "auto-h64-persistent-5"])
def test_cuda_graph_decode_replay(splits, hq, batch, programs):
    """Decode with out/lse/workspace given, captured once; replayed with new q, indices, lengths and cache contents
    copied into the same buffers: equal to eager bit for bit, and eager equals the oracle. At 64 heads the sm_90
    Gluon kernel where it is planned: unsplit, and split (6 rows) with the combine, also with fewer persistent
    programs than work items."""
    cases = _graph_cases(splits, hq, batch)

    def ctx():
        return plan_hooks(splits, programs)

    with ctx():
        size = d.sparse_mla_workspace_size(batch, 1, hq, "cuda")

    def buffers(c):
        lse = poison_(torch.empty(batch, 1, hq, device="cuda")).transpose(1, 2)
        return [c.q, c.main.tensor, c.extra.tensor, c.idx, c.lens, c.x_idx, c.x_lens, c.sink,
                poison_(torch.empty_like(c.q)), lse, poison_(torch.empty(size, dtype=torch.bfloat16, device="cuda"))]

    def step(q, cache, x_cache, idx, lens, x_idx, x_lens, sink, out, lse, ws):
        return d.flash_mla_with_kvcache(q, cache, None, None, 512, None, softmax_scale=SHARP, is_fp8_kvcache=True,
                                        indices=idx, attn_sink=sink, extra_k_cache=x_cache,
                                        extra_indices_in_kvcache=x_idx, topk_length=lens, extra_topk_length=x_lens,
                                        out=out, lse=lse, workspace=ws)

    static = [t.clone() for t in buffers(cases[0])]   # the replays overwrite these, never a case's own tensors
    with ctx():
        check_cuda_graph(step, static, [buffers(c) for c in cases[1:]])
        for c in cases:
            out, lse = run_decode(c, "kernel")
            check_decode(c, out, lse, f"graph case {c.spec.seed} eager")


@pytest.mark.gpu
def test_sync_free_eager_calls():
    """No host-device synchronisation in either op (sync-debug "error"): functional, buffers, forced splits."""
    case = DecodeCase(DecodeSpec(batch=4, width=64, extra_width=64, seed=130), "cuda")
    pre = PrefillCase(PrefillSpec(tokens=8, seed=131), "cuda")
    size = d.sparse_mla_workspace_size(4, 1, 16, "cuda")
    out = torch.empty_like(case.q)
    lse = torch.empty(4, 16, 1, device="cuda")
    ws = torch.empty(size, dtype=torch.bfloat16, device="cuda")
    p_out, p_max, p_lse = torch.empty_like(pre.q), torch.empty(8, 16, device="cuda"), torch.empty(8, 16, device="cuda")
    calls = [lambda: d.flash_mla_with_kvcache(**case.kwargs()),
             lambda: d.flash_mla_with_kvcache(**case.kwargs(out=out, lse=lse, workspace=ws)),
             lambda: d.flash_mla_sparse_fwd(*pre.args()[:4], attn_sink=pre.sink, topk_length=pre.lens),
             lambda: d.flash_mla_sparse_fwd(*pre.args()[:4], attn_sink=pre.sink, topk_length=pre.lens, out=p_out,
                                            max_logits=p_max, lse=p_lse)]
    for fn in calls:      # warm up (compiles, plans) outside the check
        fn()
    with forced_splits(3):
        calls[0]()
    torch.cuda.synchronize()
    with sync_debug_error():
        for fn in calls:
            fn()
        with forced_splits(3):
            calls[0]()
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_benchmark_sized_decode():
    """64 heads, B 64: SWA 128 (main cache, bs 64) + top-k 512 (extra cache, bs 64), engine page strides."""
    spec = DecodeSpec(batch=64, hq=64, width=128, extra_width=512, nb=160, x_nb=96, written=0.7,
                      lens=("full", "full", "part", "one"), x_lens=("full", "part", "full", "zero"), seed=140)
    case = DecodeCase(spec, "cuda")
    out, lse = run_decode(case, "kernel")
    check_decode(case, out, lse, "benchmark-sized decode")


@pytest.mark.gpu
def test_device_mismatch():
    case = DecodeCase(DecodeSpec(batch=2, width=8, seed=150), "cuda")
    with pytest.raises(ValueError, match="indices"):
        d.flash_mla_with_kvcache(**case.kwargs(indices=case.idx.cpu()))
    with pytest.raises(ValueError, match="k_cache"):
        d.flash_mla_with_kvcache(**case.kwargs(k_cache=case.main.tensor.cpu()))
