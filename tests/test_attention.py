"""Paged attention: context_attention_fwd and chunked_prefill_paged_decode (SPEC §2.3, §3.7, §4 b f g j, §5;
the fixed API contract of issue 8).

Expected values come from an independent float64 softmax oracle written in this file from the spec: K/V are
read back from the head-major cache tensors by this file's own indexing (SPEC §2.3) and dequantised as
`(float(fp8) * scale).to(q.dtype)`, block tables (ids or byte pointers) are decoded here, and the visibility of
every (query position, key position) pair, the ALiBi bias and the sink logit are built here, never with the
package's reference. Every case runs through the reference (CPU) and the Triton kernel (the interpreter on CPU,
compiled on a GPU) on an output poisoned with a sentinel, and every row the call must not write keeps the
sentinel's bytes. q and k are N(0, 1) with sm_scale = 2/sqrt(D) (logit std ~2) and one planted dominant key per
prefill request, so the softmax is far from uniform.

CPU budget: the interpreter runs grid programs one by one, so kernel cases stay at a few requests, 2-8 heads and
contexts of a few blocks; the widest sweeps (Hq 64, D 256 with bs 544, the 10-request ragged batch) run on the
reference only on CPU and on the kernel on a GPU (`REF_ONLY_ON_CPU`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl

import torch_dsv4_ops as d
from torch_dsv4_ops import layout, platform
from torch_dsv4_ops.kernels import attention as attention_kernels
from torch_dsv4_ops.testing import (TOLERANCES, assert_bitwise_equal, check_compile, check_cuda_graph,
                                    implementation, nonzero_share, poison_, run_opcheck, sync_debug_error,
                                    triton_cache_entries)

INT64_MIN = -2**63
INT32_MAX = 2**31 - 1
IMPLS = ["reference", "kernel"]
FP8_OUT_RTOL = 0.0625          # SPEC §5: fp8 output, o.float()*scale within relative 0.0625 plus the q dtype's atol
NAN_CODES = {layout.E4M3FN.name: (0x7F, 0xFF), layout.E4M3FNUZ.name: (0x80,),
             layout.E5M2.name: (0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF)}


def context_attention_fwd(*args):
    return d.context_attention_fwd(*args)


def chunked_prefill_paged_decode(*args):
    return d.chunked_prefill_paged_decode(*args)


def ctx_op():
    return torch.ops.dsv4.context_attention_fwd.default


def chunked_op():
    return torch.ops.dsv4.chunked_prefill_paged_decode.default


def e4m3_for(device) -> layout.Fp8Format:
    return platform.platform_e4m3(platform.target_for(torch.device(device)))


def cdiv(a, b):
    return -(-a // b)


# ================================================================================================
# Cases: one batch (requests, caches, options) built on one device
# ================================================================================================
@dataclasses.dataclass
class Spec:
    q_lens: tuple = (1, 5, 0, 1, 3, 0)
    seq_lens: tuple = (20, 37, 7, 1, 3, 0)     # including the query tokens; >= qlen unless hostile
    hq: int = 4
    hkv: int = 2
    dim: int = 32
    bs: int = 16
    dtype: torch.dtype = torch.bfloat16         # q (and dense k/v, and output unless fp8)
    kv: str = "auto"                            # kv_cache_dtype
    cache_dtype: torch.dtype | None = None      # None: q's dtype ("auto"-like) or uint8 (fp8)
    dense: bool = True                          # k/v given (False: k = v = None, KV from the cache)
    sw: int | None = None
    sinks: tuple | None = None                  # cycled over the q heads
    alibi: bool = False
    causal: bool = True
    table_dtype: torch.dtype = torch.int32
    ptr: bool = False                           # is_block_table_ptr (int64 byte addresses)
    bad: tuple = ()                             # ((r, col, id or pointer kind), ...) hostile table entries
    width: int | None = None                    # table width (None: enough for every seq_len, + extra_cols)
    extra_cols: int = 1
    spare_blocks: int = 3                       # pages no valid entry within seq_len references
    num_blocks: int | None = None               # fixed page count (>= the pages needed; the rest spare)
    out_dtype: torch.dtype | None = None        # fp8 output dtype
    out_scale: float = 0.02
    fill: str = "nan"                           # unused cache bytes: "nan" (NaN codes) or "random" (finite)
    padded: bool = False                        # cache pages padded (stride(0) > page), K and V differently
    sm_scale: float | str | None = "sharp"      # "sharp": 2/sqrt(D); None: the op's default D**-0.5
    max_input_len: int | None = None            # None: max qlen (at least 1)
    max_seq_len: str = "int"                    # "int": max(seq_lens); "none": None
    qsl: tuple | None = None                    # explicit (hostile) query_start_loc; with tokens
    tokens: int | None = None
    pad_rows: int = 2                           # padding rows after the last request (never written)
    peaked: bool = True
    k_scale: float | None = None                # None: 0.043 for fp8 caches, 1 otherwise
    v_scale: float | None = None                # None: 0.027 for fp8 caches, 1 otherwise
    value_scale: float = 1.0                    # magnitude of the V values
    seed: int = 0

    def replace(self, **kw) -> "Spec":
        return dataclasses.replace(self, **kw)


class Case:
    """The tensors of one Spec on `device`; caches written through d.reshape_and_cache_flash."""

    def __init__(self, spec: Spec, device):
        self.spec = s = spec
        self.device = device = torch.device(device)
        g = torch.Generator().manual_seed(s.seed)
        gd = torch.Generator(device).manual_seed(s.seed + 1)   # big tensors are drawn on the device
        if s.qsl is None:
            qsl = [0]
            for n in s.q_lens:
                qsl.append(qsl[-1] + n)
            tokens = qsl[-1] + s.pad_rows
        else:
            qsl, tokens = list(s.qsl), s.tokens
        self.qsl, self.T, self.seqs = qsl, tokens, list(s.seq_lens)
        self.R = R = len(self.seqs)
        assert len(qsl) == R + 1
        self.qlens = [qsl[r + 1] - qsl[r] for r in range(R)]
        fp8 = s.kv.startswith("fp8")
        self.cache_dtype = s.cache_dtype or (torch.uint8 if fp8 else s.dtype)
        self.fmt = layout.resolve_kv_cache_format(s.kv, self.cache_dtype, e4m3_for(device))
        self.x = math.gcd(layout.head_major_x(self.cache_dtype), s.dim)
        self.o_dtype = s.out_dtype or s.dtype
        self.max_input_len = s.max_input_len if s.max_input_len is not None else max([1] + self.qlens)
        self.sm_scale = 2.0 / math.sqrt(s.dim) if s.sm_scale == "sharp" else s.sm_scale
        k_scale = s.k_scale if s.k_scale is not None else (0.043 if fp8 else 1.0)
        v_scale = s.v_scale if s.v_scale is not None else (0.027 if fp8 else 1.0)
        self.k_scale = torch.tensor([k_scale], dtype=torch.float32, device=device)
        self.v_scale = torch.tensor([v_scale], dtype=torch.float32, device=device)
        self.out_scale = (torch.tensor([s.out_scale], dtype=torch.float32, device=device)
                          if s.out_dtype is not None else None)

        # --- physical pages: every request's columns get distinct pages; spare pages stay unused
        bs = s.bs
        cols = [cdiv(max(n, 0), bs) for n in self.seqs]
        self.W = W = s.width if s.width is not None else max(cols + [1]) + s.extra_cols
        needed = sum(min(c, W) for c in cols)
        self.nb = nb = needed + s.spare_blocks if s.num_blocks is None else s.num_blocks
        assert nb >= needed, (nb, needed)
        perm = torch.randperm(nb, generator=g).tolist()
        spare = perm[needed:]
        entries = []
        for r in range(R):
            row = []
            for c in range(W):
                if c < cols[r]:
                    row.append(perm.pop(0))
                else:          # past seq_len: a spare (NaN) page, or a negative id
                    row.append(spare[(r + c) % len(spare)] if spare and (r + c) % 3 else -1)
            entries.append(row)
        for r, c, v in s.bad:   # "unaligned": a pointer 3 bytes into the page the entry held
            entries[r][c] = f"unaligned:{entries[r][c]}" if v == "unaligned" else v
        self.entries = entries

        # --- caches (optionally with padded pages), filled with NaN codes or finite garbage
        hkv, dim, x = s.hkv, s.dim, self.x
        k_page, v_page = hkv * dim * bs, hkv * dim * bs
        k_pad, v_pad = (40, 24) if s.padded else (0, 0)
        kbase = self._filled(nb * (k_page + k_pad), gd)
        vbase = self._filled(nb * (v_page + v_pad), gd)
        self.k_cache = kbase.view(nb, k_page + k_pad)[:, :k_page].unflatten(1, (hkv, dim // x, bs, x))
        self.v_cache = vbase.view(nb, v_page + v_pad)[:, :v_page].unflatten(1, (hkv, dim, bs))
        self.table = self._materialise_table()

        # --- write every cache position < seq_len of a valid page (the oracle reads them back)
        positions = [(r, p) for r in range(R) for p in range(max(self.seqs[r], 0))]
        slots = []
        for r, p in positions:
            blk = self.block_id(r, p // bs)
            slots.append(blk * bs + p % bs if blk >= 0 else -1)
        src_dtype = torch.float32 if fp8 else self.cache_dtype
        n = len(positions)
        key_src = torch.randn(n, hkv, dim, generator=gd, device=device).to(src_dtype)
        value_src = (torch.randn(n, hkv, dim, generator=gd, device=device) * s.value_scale).to(src_dtype)
        if n:
            write_ctx = d.cpu_implementation("reference") if device.type == "cpu" else contextlib.nullcontext()
            with write_ctx:
                d.reshape_and_cache_flash(key_src, value_src, self.k_cache, self.v_cache,
                                          torch.tensor(slots, dtype=torch.int64, device=device), s.kv,
                                          self.k_scale, self.v_scale)
        self.written_slots = [sl for sl in slots if sl >= 0]
        del key_src, value_src

        # --- q, dense k/v (independent of the cache values: reading the wrong source is caught)
        T = self.T
        self.q = torch.randn(T, s.hq, dim, generator=g).to(s.dtype)
        self.k = torch.randn(T, hkv, dim, generator=g).to(s.dtype) if s.dense else None
        self.v = (torch.randn(T, hkv, dim, generator=g) * s.value_scale).to(s.dtype) if s.dense else None
        if s.peaked and s.dense:   # the last row of each prefill request: q = its own key (a dominant key)
            group = s.hq // hkv
            for r in range(R):
                t = qsl[r] + self.qlens[r] - 1
                if self.qlens[r] >= 2 and 0 <= t < T:
                    self.q[t] = self.k[t].repeat_interleave(group, 0)
        self.q = self.q.to(device)
        self.k = self.k.to(device) if self.k is not None else None
        self.v = self.v.to(device) if self.v is not None else None
        self.alibi = None
        if s.alibi:
            self.alibi = torch.tensor([2.0 ** (-8.0 * (h + 1) / s.hq) for h in range(s.hq)], device=device)
        self.sinks = None
        if s.sinks is not None:
            self.sinks = torch.tensor([s.sinks[h % len(s.sinks)] for h in range(s.hq)], dtype=torch.float32,
                                      device=device)
        self.qsl_t = torch.tensor(qsl, dtype=torch.int32, device=device)
        self.seq_t = torch.tensor(self.seqs, dtype=torch.int32, device=device)
        self.max_seq_len = max([0] + self.seqs) if s.max_seq_len == "int" else None

    # --- construction helpers
    def _filled(self, numel, g):
        s, dev = self.spec, self.device
        if self.fmt is None:
            if s.fill == "nan":
                return torch.full((numel,), float("nan"), dtype=self.cache_dtype, device=dev)
            return (torch.randn(numel, generator=g, device=dev) * 30).to(self.cache_dtype)
        if s.fill == "nan":
            codes = torch.tensor(NAN_CODES[self.fmt.name], dtype=torch.uint8, device=dev)
            raw = codes[torch.randint(0, len(codes), (numel,), generator=g, device=dev)]
        else:
            raw = (torch.randn(numel, generator=g, device=dev) * 30).to(self.fmt.dtype).view(torch.uint8)
        return raw.view(self.cache_dtype) if self.cache_dtype != torch.uint8 else raw

    def page_bytes(self):
        return self.k_cache.stride(0) * self.k_cache.element_size()

    def _pointer(self, entry):
        """The byte address a pointer table holds for `entry` (an id, possibly out of range, or a kind)."""
        base, page = self.k_cache.data_ptr(), self.page_bytes()
        if isinstance(entry, int):
            return base + entry * page
        kind, _, arg = entry.partition(":")
        return {"zero": 0, "neg": -page * 3 - 8, "min": INT64_MIN, "below": base - page,
                "past": base + self.nb * page, "unaligned": base + int(arg or 0) * page + 3}[kind]

    def _materialise_table(self):
        if self.spec.ptr:
            rows = [[self._pointer(e) for e in row] for row in self.entries]
            return torch.tensor(rows, dtype=torch.int64, device=self.device)
        return torch.tensor(self.entries, dtype=self.spec.table_dtype, device=self.device)

    # --- the oracle's own table decoding (SPEC §0 lookup, §3.7 pointer tables)
    def block_id(self, r, col):
        """The valid page id that table[r, col] designates, or -1 (masked)."""
        if col >= self.W or col < 0:
            return -1
        raw = self.entries[r][col]
        if self.spec.ptr:
            ptr = self._pointer(raw)
            if ptr <= 0:
                return -1
            blk = (ptr - self.k_cache.data_ptr()) // self.page_bytes()
        else:
            blk = raw
        return blk if 0 <= blk < self.nb else -1

    # --- arguments
    def output(self):
        return poison_(torch.empty(self.T, self.spec.hq, self.spec.dim, dtype=self.o_dtype, device=self.device))

    def args(self, op, out, skip_decode=False, **override):
        s = self.spec
        kw = dict(q=self.q, k=self.k, v=self.v, kv=s.kv, k_cache=self.k_cache, v_cache=self.v_cache,
                  table=self.table, qsl=self.qsl_t, seq=self.seq_t, max_seq_len=self.max_seq_len,
                  max_input_len=self.max_input_len, k_scale=self.k_scale, v_scale=self.v_scale,
                  alibi=self.alibi, sw=s.sw, sm_scale=self.sm_scale, out_scale=self.out_scale, sinks=self.sinks,
                  ptr=s.ptr, causal=s.causal)
        kw.update(override)
        head = (kw["q"], kw["k"], kw["v"], out, kw["kv"], kw["k_cache"], kw["v_cache"], kw["table"], kw["qsl"],
                kw["seq"], kw["max_seq_len"], kw["max_input_len"], kw["k_scale"], kw["v_scale"], kw["alibi"],
                kw["sw"], kw["sm_scale"])
        if op == "ctx":
            return head + (skip_decode, kw["out_scale"], kw["sinks"], kw["ptr"], kw["causal"])
        return head + (kw["out_scale"], kw["sinks"], kw["ptr"], kw["causal"])


# ================================================================================================
# The oracle (float64, from SPEC §3.7 and the API contract)
# ================================================================================================
def dequant_cache(case: Case, which: str, ids: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[n, Hkv, D] float64 values of cache positions (page ids[i], offset offs[i]), read with this file's own
    head-major indexing: K (blk, off, h, d) at k[blk, h, d // x, off, d % x], V at v[blk, h, d, off]."""
    s = case.spec
    if which == "k":
        raw = case.k_cache[ids, :, :, offs, :].reshape(len(ids), s.hkv, s.dim)
        scale = case.k_scale
    else:
        raw = case.v_cache[ids, :, :, offs]
        scale = case.v_scale
    if case.fmt is not None:   # (float(fp8) * scale).to(q.dtype), the product in fp32
        vals = (raw.contiguous().view(torch.uint8).view(case.fmt.dtype).float() * scale.float()).to(s.dtype)
    else:
        vals = raw.to(s.dtype)
    return vals.double()


def _keys_for(case: Case, r: int, cache_upto: int, dense_from: int | None, qlen: int):
    """(positions, K, V) of request r: cache positions [0, cache_upto) of valid pages, then (dense_from not None)
    the dense rows qsl[r] + j at positions dense_from + j for 0 <= j < qlen whose row lies in [0, T)."""
    bs = case.spec.bs
    pos, ids, offs = [], [], []
    for p in range(max(cache_upto, 0)):
        blk = case.block_id(r, p // bs)
        if blk >= 0:
            pos.append(p)
            ids.append(blk)
            offs.append(p % bs)
    dev = case.k_cache.device
    if ids:
        it, ot = torch.tensor(ids, device=dev), torch.tensor(offs, device=dev)
        K, V = dequant_cache(case, "k", it, ot), dequant_cache(case, "v", it, ot)
    else:
        K = V = torch.zeros(0, case.spec.hkv, case.spec.dim, dtype=torch.float64, device=dev)
    if dense_from is not None:
        rows = [case.qsl[r] + j for j in range(qlen) if 0 <= case.qsl[r] + j < case.T]
        pos += [dense_from + (t - case.qsl[r]) for t in rows]
        if rows:
            rt = torch.tensor(rows, device=dev)
            K = torch.cat([K, case.k[rt].double()])
            V = torch.cat([V, case.v[rt].double()])
    return torch.tensor(pos, dtype=torch.int64, device=dev), K, V


def attend(case: Case, q_rows: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor, K, V) -> torch.Tensor:
    """float64 [M, Hq, D]: softmax over the visible keys and the sink logit, explicit per-(qp, kp) visibility."""
    s = case.spec
    M, n = q_rows.shape[0], kpos.shape[0]
    out = torch.zeros(M, s.hq, s.dim, dtype=torch.float64, device=q_rows.device)
    if M == 0 or n == 0:
        return out
    group = s.hq // s.hkv
    kvh = torch.arange(s.hq, device=q_rows.device) // group
    Kh, Vh = K[:, kvh], V[:, kvh]                                        # [n, Hq, D]
    sm_scale = case.sm_scale if case.sm_scale is not None else s.dim ** -0.5
    scores = torch.einsum("mhd,nhd->mhn", q_rows.double(), Kh) * sm_scale
    rel = (kpos[None, :] - qpos[:, None]).double()                      # kp - qp, [M, n]
    if case.alibi is not None:
        scores = scores + case.alibi.double()[None, :, None] * rel[:, None, :]
    visible = torch.ones(M, n, dtype=torch.bool, device=q_rows.device)
    if s.causal:
        visible &= kpos[None, :] <= qpos[:, None]
    if s.sw is not None and s.sw > 0:
        visible &= (qpos[:, None] - kpos[None, :]) < s.sw
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    sink = (case.sinks.double() if case.sinks is not None
            else torch.full((s.hq,), float("-inf"), dtype=torch.float64, device=q_rows.device))
    logits = torch.cat([scores, sink[None, :, None].expand(M, s.hq, 1)], -1)
    mx = logits.amax(-1, keepdim=True)
    any_visible = visible.any(-1)                                        # [M]
    mx = torch.where(any_visible[:, None, None], mx, torch.zeros_like(mx))
    p = torch.exp(logits - mx)
    p = p / p.sum(-1, keepdim=True)
    o = torch.einsum("mhn,nhd->mhd", p[..., :n], Vh)
    return torch.where(any_visible[:, None, None], o, out)


def oracle(case: Case, op: str, skip_decode: bool = False) -> dict:
    """{row: float64 [Hq, D]} for every output row the call must write (all other rows stay untouched)."""
    s = case.spec
    expected = {}
    for r in range(case.R):
        qlen, seq, start = case.qlens[r], case.seqs[r], case.qsl[r]
        if qlen <= 0:
            continue
        decode = op == "chunked" and qlen == 1
        if not decode:
            if op == "ctx" and skip_decode and qlen < 2:
                continue
            if op == "chunked" and case.max_input_len <= 1:    # no prefill step at all
                continue
        if decode:   # all seq_len keys from the cache, qp = seq_len - 1, row qsl[r]
            rows = [(start, seq - 1)] if 0 <= start < case.T else []
            kpos, K, V = _keys_for(case, r, seq, None, 0)
        else:
            ctx = seq - qlen
            rows = [(start + m, ctx + m) for m in range(min(qlen, case.max_input_len)) if 0 <= start + m < case.T]
            if s.dense:
                kpos, K, V = _keys_for(case, r, ctx, ctx, qlen)
            else:
                kpos, K, V = _keys_for(case, r, seq, None, 0)
        if not rows:
            continue
        dev = case.q.device
        rt = torch.tensor([t for t, _ in rows], device=dev)
        qp = torch.tensor([p for _, p in rows], dtype=torch.int64, device=dev)
        o = attend(case, case.q[rt], qp, kpos, K, V)
        for i, (t, _) in enumerate(rows):
            expected[t] = o[i]
    return expected


# ================================================================================================
# Running and checking
# ================================================================================================
def run(case: Case, op: str, impl: str, skip_decode: bool = False, splits: int | None = None, **override):
    """Run `op` ("ctx" or "chunked") through the public function with `impl` on a poisoned output."""
    out = case.output()
    args = case.args(op, out, skip_decode, **override)
    fn = context_attention_fwd if op == "ctx" else chunked_prefill_paged_decode
    split_ctx = contextlib.nullcontext()
    if splits is not None:
        from torch_dsv4_ops.ops import attention as attention_ops
        split_ctx = attention_ops.forced_decode_splits(splits)
    with implementation(impl, case.device), split_ctx:
        fn(*args)
    return out


def fp8_expected(case: Case, acc: torch.Tensor) -> torch.Tensor:
    """SPEC: o = fp8(clamp(acc * (1/scale), +-max)); in output units (times the scale)."""
    fmax = layout.FP8_BY_DTYPE[case.o_dtype].max
    scale = case.out_scale.double().cpu()
    return (acc / scale).clamp(-fmax, fmax) * scale


def check_rows(case: Case, out: torch.Tensor, expected: dict, what: str, *, nontrivial: bool = True):
    """Rows in `expected` within tolerance of the oracle; every other row keeps the sentinel's bytes."""
    out = out.detach().cpu()
    sentinel = poison_(torch.empty_like(out))
    untouched = [t for t in range(case.T) if t not in expected]
    if untouched:
        ut = torch.tensor(untouched)
        assert_bitwise_equal(out[ut], sentinel[ut], f"{what}: rows {untouched} must stay untouched")
    if not expected:
        return
    rows = sorted(expected)
    got = out[torch.tensor(rows)]
    want = torch.stack([expected[t].cpu() for t in rows])
    tol = TOLERANCES[case.spec.dtype]
    if case.o_dtype in layout.FP8_BY_DTYPE:
        got64 = got.double() * case.out_scale.double().cpu()
        want = fp8_expected(case, want)
        assert_fp8_out_close(got64, want, case, tol, what)
    else:
        assert_close64(got.double(), want, tol, tol, what)
    if nontrivial:
        assert want.abs().max() > 10 * tol, f"{what}: expected outputs too small to test anything"


def assert_close64(a, e, atol, rtol, what):
    if not torch.isfinite(a).all():
        bad = (~torch.isfinite(a)).nonzero()[0].tolist()
        raise AssertionError(f"{what}: non-finite output at {bad}: {a[tuple(bad)].item()}")
    err = (a - e).abs()
    bad = err > atol + rtol * e.abs()
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements out of tolerance (atol {atol}, "
                             f"rtol {rtol}); max err {err.max().item():.3g}; at {i}: {a[i].item()} vs {e[i].item()}")


def assert_fp8_out_close(got, want, case, atol, what):
    """SPEC §5: |o*scale - e| <= 0.0625|e| + atol. An e5m2 output (2 mantissa bits) rounds by up to 2^-3
    relative, so an element also passes if it is the round-to-nearest of some value within the q dtype's
    tolerance of the oracle (a correct fp32 accumulation, correctly rounded)."""
    if not torch.isfinite(got).all():
        raise AssertionError(f"{what}: non-finite fp8 output")
    ok = (got - want).abs() <= FP8_OUT_RTOL * want.abs() + atol
    if not ok.all():
        fdt, fmax = case.o_dtype, layout.FP8_BY_DTYPE[case.o_dtype].max
        scale = case.out_scale.double().cpu()
        slack = atol + atol * want.abs()
        lo = ((want - slack) / scale).clamp(-fmax, fmax).float().to(fdt).double() * scale
        hi = ((want + slack) / scale).clamp(-fmax, fmax).float().to(fdt).double() * scale
        ok |= (got >= lo) & (got <= hi)
    if not ok.all():
        i = tuple((~ok).nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int((~ok).sum())} fp8 outputs out of tolerance; at {i}: "
                             f"{got[i].item()} vs {want[i].item()}")


def impl_available(impl, device):
    return not (impl == "reference" and device.type != "cpu")


def run_and_check(case: Case, op: str, impl: str, skip_decode=False, what="", **kw):
    out = run(case, op, impl, skip_decode, **kw)
    check_rows(case, out, oracle(case, op, skip_decode), f"{what or op} [{impl}]")
    return out


# ================================================================================================
# SPEC §3.7 worked example (literal expected values)
# ================================================================================================
def worked_case(device, dtype, seq=3, q_lens=(1,), dense=True, v_dense=None):
    """Hq = Hkv = 1, D = 2, bs 4, K = 0 everywhere, V at positions 0, 1, 2 = [4,0], [0,4], [4,4], page 1 of a
    NaN-filled 2-page cache (page 0 unused)."""
    x = math.gcd(layout.head_major_x(dtype), 2)
    kc = torch.full((2, 1, 2 // x, 4, x), float("nan"), dtype=dtype)
    vc = torch.full((2, 1, 2, 4), float("nan"), dtype=dtype)
    values = [[4.0, 0.0], [0.0, 4.0], [4.0, 4.0]]
    for p in range(min(seq, 3)):
        for dd in range(2):
            kc[1, 0, dd // x, p, dd % x] = 0.0
            vc[1, 0, dd, p] = values[p][dd]
    T = sum(q_lens)
    q = torch.randn(T, 1, 2, generator=torch.Generator().manual_seed(1)).to(dtype)
    k = torch.zeros(T, 1, 2, dtype=dtype) if dense else None
    v = None
    if dense:
        v = torch.tensor(v_dense, dtype=dtype).view(T, 1, 2)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    dev = torch.device(device)
    return dict(q=q.to(dev), k=None if k is None else k.to(dev), v=None if v is None else v.to(dev),
                kc=kc.to(dev), vc=vc.to(dev), table=torch.tensor([[1, -1]], dtype=torch.int32, device=dev),
                qsl=torch.tensor(qsl, dtype=torch.int32, device=dev),
                seq=torch.tensor([seq], dtype=torch.int32, device=dev), T=T)


def run_worked(w, op, impl, device, max_len, alibi=None, sw=None, sinks=None):
    out = poison_(torch.empty(w["T"], 1, 2, dtype=w["q"].dtype, device=device))
    one = torch.ones(1, device=device)
    alibi_t = None if alibi is None else torch.tensor([alibi], dtype=torch.float32, device=device)
    sinks_t = None if sinks is None else torch.tensor([sinks], dtype=torch.float32, device=device)
    head = (w["q"], w["k"], w["v"], out, "auto", w["kc"], w["vc"], w["table"], w["qsl"], w["seq"], 8, max_len,
            one, one, alibi_t, sw, 1.0)
    with implementation(impl, device):
        if op == "ctx":
            context_attention_fwd(*head, False, None, sinks_t, False, True)
        else:
            chunked_prefill_paged_decode(*head, None, sinks_t, False, True)
    return out.cpu().double()


DECODE_ROWS = [   # (label, options, literal output)
    ("seq3", {}, [8 / 3, 8 / 3]),
    ("seq3-sw2", {"sw": 2}, [2.0, 4.0]),
    ("seq3-sink0", {"sinks": 0.0}, [2.0, 2.0]),
    ("seq3-alibi-ln2", {"alibi": math.log(2.0)}, [20 / 7, 24 / 7]),   # weights prop. to [1/4, 1/2, 1]
]
PREFILL_ROWS = [
    ("causal", {}, [[4.0, 0.0], [2.0, 2.0], [8 / 3, 8 / 3]]),
    ("causal-sw2", {"sw": 2}, [[4.0, 0.0], [2.0, 2.0], [2.0, 4.0]]),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("row", DECODE_ROWS, ids=[r[0] for r in DECODE_ROWS])
def test_worked_example_decode_rows(device, impl, dtype, row):
    """Decode rows: chunked_prefill_paged_decode with one request of qlen 1 (all three keys from the cache;
    key/value are given - ALiBi needs them - but hold garbage the decode path must not read); and the same row
    through context_attention_fwd, where the newest key/value come from the dense row [0,0]/[4,4]."""
    _, opts, want = row
    tol = TOLERANCES[dtype]
    want_t = torch.tensor([[want]], dtype=torch.float64)
    w = worked_case(device, dtype, v_dense=[[100.0, -100.0]])
    w["k"] = torch.full_like(w["k"], 50.0)          # garbage: the decode path reads only the cache
    got = run_worked(w, "chunked", impl, device, 1, **opts)
    assert torch.allclose(got, want_t, atol=tol, rtol=tol), f"decode: {got.tolist()} != {want}"
    w = worked_case(device, dtype, v_dense=[[4.0, 4.0]])   # context_attention_fwd: prefix 2 cached + 1 dense
    got = run_worked(w, "ctx", impl, device, 1, **opts)
    assert torch.allclose(got, want_t, atol=tol, rtol=tol), f"prefill path: {got.tolist()} != {want}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dense", [True, False], ids=["dense-kv", "cache-kv"])
@pytest.mark.parametrize("row", PREFILL_ROWS, ids=[r[0] for r in PREFILL_ROWS])
def test_worked_example_prefill_rows(device, impl, dense, row):
    """Prefill q 3, prefix 0: context_attention_fwd, and chunked_prefill_paged_decode with max_query_len 3
    (its prefill step); keys dense (k = 0, v = the three rows) or all from the cache."""
    _, opts, want = row
    want_t = torch.tensor(want, dtype=torch.float64).view(3, 1, 2)
    for op in ("ctx", "chunked"):
        w = worked_case(device, torch.float32, q_lens=(3,), dense=dense,
                        v_dense=[[4.0, 0.0], [0.0, 4.0], [4.0, 4.0]])
        got = run_worked(w, op, impl, device, 3, **opts)
        assert torch.allclose(got, want_t, atol=2e-3, rtol=2e-3), f"{op}: {got.view(3, 2).tolist()} != {want}"


@pytest.mark.parametrize("impl", IMPLS)
def test_worked_example_decode_seq0(device, impl):
    """decode, seq 0 -> [0, 0] (with and without a sink)."""
    for sinks in (None, 2.0):
        w = worked_case(device, torch.float32, seq=0, dense=False)
        got = run_worked(w, "chunked", impl, device, 1, sinks=sinks)
        assert got.view(2).tolist() == [0.0, 0.0]


# ================================================================================================
# Features alone and combined (each case: both ops, both implementations)
# ================================================================================================
BASE = Spec()
FP8 = dict(kv="fp8", cache_dtype=torch.uint8)
TINY = dict(hq=2, hkv=1, q_lens=(1, 3, 0, 1), seq_lens=(9, 21, 4, 1))

FEATURES = {
    # dtypes of q / head sizes
    "bf16": BASE,
    "fp16": BASE.replace(dtype=torch.float16, seed=1),
    "fp32": BASE.replace(dtype=torch.float32, seed=2),
    "D24-fp32": BASE.replace(dtype=torch.float32, dim=24, seed=3),           # x = 4
    "D24-bf16": BASE.replace(dim=24, seed=4),                                 # x = 8
    "D64": BASE.replace(dim=64, seed=5),
    "D128": BASE.replace(dim=128, **TINY, seed=6),
    "D256": BASE.replace(dim=256, **TINY, seed=7),
    # block sizes (contexts not multiples of bs)
    "bs32": BASE.replace(bs=32, q_lens=(1, 4, 0, 2), seq_lens=(70, 41, 3, 33), seed=8),
    "bs544": BASE.replace(bs=544, **TINY | dict(seq_lens=(600, 549, 4, 1)), spare_blocks=1, seed=9),
    "bs1": BASE.replace(bs=1, q_lens=(1, 3, 0), seq_lens=(5, 6, 2), seed=10),
    # head groups
    "MHA": BASE.replace(hq=2, hkv=2, seed=11),
    "MQA": BASE.replace(hq=8, hkv=1, seed=12),
    # masks
    "non-causal": BASE.replace(causal=False, seed=13),
    "non-causal-cache": BASE.replace(causal=False, dense=False, seed=14),
    "sw0": BASE.replace(sw=0, seed=15),
    "sw-negative": BASE.replace(sw=-3, seed=16),
    "sw1": BASE.replace(sw=1, seed=17),                                       # one key left per row
    "sw16": BASE.replace(sw=16, seed=18),
    "sw2048": BASE.replace(sw=2048, seed=19),
    "sw5-non-causal": BASE.replace(sw=5, causal=False, seed=20),
    # sinks (raw logits, per head): none, -2, 0, 3, mixed, dominant (fp32: the outputs shrink ~20x)
    "sinks-neg-inf": BASE.replace(sinks=(float("-inf"),), seed=21),
    "sinks-mixed": BASE.replace(sinks=(float("-inf"), -2.0, 0.0, 3.0), seed=22),
    "sink-dominant": BASE.replace(dtype=torch.float32, sinks=(9.0,), value_scale=30.0, seed=23),
    # ALiBi alone, with SW, with sinks and fp8 output
    "alibi": BASE.replace(alibi=True, seed=24),
    "alibi-sw16": BASE.replace(alibi=True, sw=16, seed=25),
    "alibi-sinks-fp8out": BASE.replace(alibi=True, sw=7, sinks=(-2.0, 3.0), out_dtype=torch.float8_e4m3fn,
                                       seed=26),
    # KV from the cache
    "cache-kv": BASE.replace(dense=False, seed=27),
    # tables
    "int64-table": BASE.replace(table_dtype=torch.int64, bad=((1, 1, INT64_MIN),), seed=28),
    "ptr-table": BASE.replace(ptr=True, bad=((1, 0, "zero"), (1, 2, "neg")), seed=29),
    "ptr-table-padded-pages": BASE.replace(ptr=True, padded=True, dense=False, seed=30),
    # invalid blocks in tiles that lie wholly inside the context (the kernels' whole-tile loops, whose V loads
    # zero-fill by block validity): each bad column sits in a whole tile at every backend's tile width (GPU
    # prefill 64 keys, fp8 decode 32, interpreter 16), float and fp8 caches
    "invalid-blocks-whole-tiles": BASE.replace(q_lens=(1, 4, 1), seq_lens=(80, 90, 70),
                                               bad=((0, 1, -1), (1, 2, -5), (2, 3, 10**6)), seed=53),
    "invalid-blocks-whole-tiles-fp8": BASE.replace(q_lens=(1, 4, 1), seq_lens=(80, 90, 70),
                                                   bad=((0, 1, -1), (1, 2, -5), (2, 3, 10**6)), **FP8, seed=55),
    # whole cached tiles of several blocks (the interpreter's 16-key tiles: four blocks of 4), each block's id
    # from its own table entry, invalid ones inside them (prefill_tiles' tile_ids)
    "bs4-whole-tiles": BASE.replace(bs=4, q_lens=(1, 4, 2), seq_lens=(80, 90, 70),
                                    bad=((1, 5, -1), (1, 10, 10**6), (2, 4, -3)), seed=57),
    "bs4-whole-tiles-ptr": BASE.replace(bs=4, q_lens=(1, 4, 2), seq_lens=(80, 90, 70), ptr=True,
                                        bad=((1, 6, "neg"), (1, 11, "past"), (2, 9, "unaligned")), seed=58),
    # ... and on a GPU's 64-key tiles: eight blocks of 8, two of 32
    "bs8-whole-tiles": BASE.replace(bs=8, q_lens=(1, 4, 2), seq_lens=(150, 170, 140),
                                    bad=((1, 3, -1), (1, 12, 10**6), (2, 9, -3)), seed=59),
    "bs32-whole-tiles": BASE.replace(bs=32, q_lens=(1, 4, 2), seq_lens=(150, 170, 140),
                                     bad=((1, 1, -1), (2, 2, 10**6)), seed=60),
    # prefills of 40 new tokens: several dense-key tiles per q tile (the interpreter's 16-key tiles), whole ones
    # without a mask and the masked ones past them, causal, windowed and not causal
    "long-prefill": BASE.replace(q_lens=(1, 40, 3), seq_lens=(20, 57, 3), seed=63),
    "long-prefill-sw33": BASE.replace(q_lens=(1, 40, 3), seq_lens=(20, 57, 3), sw=33, seed=64),
    "long-prefill-non-causal": BASE.replace(q_lens=(1, 40, 3), seq_lens=(20, 57, 3), causal=False, seed=65),
    # fp8 KV caches (k_scale != v_scale != 1), uint8 and typed
    "fp8-e4m3-uint8": BASE.replace(**FP8, seed=31),
    "fp8-e4m3-typed": BASE.replace(kv="fp8_e4m3", cache_dtype=torch.float8_e4m3fn, seed=32),
    "fp8-e5m2-uint8": BASE.replace(kv="fp8_e5m2", cache_dtype=torch.uint8, dtype=torch.float16, seed=33),
    "fp8-e5m2-typed": BASE.replace(kv="fp8_e5m2", cache_dtype=torch.float8_e5m2, dtype=torch.float32, seed=34),
    "fp8-cache-kv": BASE.replace(**FP8, dense=False, seed=35),
    # fp8 decode's table chunks (the interpreter's: 2 tiles of 16 keys) straddle blocks of 40 keys: a chunk's 32
    # keys span 2 table columns
    "fp8-bs40": BASE.replace(**FP8, bs=40, q_lens=(1, 1, 3), seq_lens=(100, 75, 50), seed=56),
    # fp8 output with a scale (e4m3fn, e5m2; a small scale saturates some outputs)
    "fp8-out-e4m3": BASE.replace(out_dtype=torch.float8_e4m3fn, seed=36),
    "fp8-out-e5m2": BASE.replace(out_dtype=torch.float8_e5m2, dtype=torch.float16, seed=37),
    "fp8-out-saturating": BASE.replace(out_dtype=torch.float8_e4m3fn, out_scale=1e-3, value_scale=2.0, seed=38),
    # caches with padded page strides, finite garbage instead of NaN in unused pages
    "padded-pages": BASE.replace(padded=True, seed=39),
    "random-fill": BASE.replace(fill="random", seed=40),
    # sm_scale default (None -> D**-0.5)
    "sm-scale-default": BASE.replace(sm_scale=None, seed=41),
    # scales <= 0: the scores' order reversed, and every score 0 (a uniform softmax over the visible keys)
    "sm-scale-negative": BASE.replace(sm_scale=-0.7, seed=61),
    "sm-scale-zero-fp8": BASE.replace(sm_scale=0.0, **FP8, seed=62),
    # rows >= max_input_len are not computed
    "max-input-len-2": BASE.replace(max_input_len=2, seed=42),
    # max_query_len 1: chunked_prefill_paged_decode runs no prefill step (prefill rows untouched)
    "max-input-len-1": BASE.replace(max_input_len=1, seed=49),
    # max_seq_len None (a hint only)
    "max-seq-len-none": BASE.replace(max_seq_len="none", seed=43),
    # decodes with seq_len 0 and a ragged batch with several qlen-0 requests
    "seq0-decodes": BASE.replace(q_lens=(1, 0, 1, 4, 1, 0), seq_lens=(0, 0, 1, 4, 17, 5), seed=44),
    # combinations
    "combo-gqa-sw-sinks-e5m2-ptr-fp8out": BASE.replace(
        hq=8, hkv=2, sw=16, sinks=(float("-inf"), -2.0, 0.0, 3.0), kv="fp8_e5m2", cache_dtype=torch.float8_e5m2,
        ptr=True, out_dtype=torch.float8_e4m3fn, padded=True, seed=45),
    "combo-cache-noncausal-sw-int64-e4m3": BASE.replace(
        dense=False, causal=False, sw=6, table_dtype=torch.int64, sinks=(0.0, 3.0), **FP8, dtype=torch.float16,
        seed=46),
    "combo-alibi-sw1-ptr-fp8-D24": BASE.replace(
        alibi=True, sw=1, ptr=True, **FP8, dim=24, sinks=(-2.0,), seed=47),
    "combo-D64-bs32-sinks-fp32-cache": BASE.replace(
        dim=64, bs=32, dense=False, sinks=(3.0, float("-inf")), dtype=torch.float32, q_lens=(2, 1, 0, 6),
        seq_lens=(40, 33, 2, 70), seed=48),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(FEATURES))
def test_features(device, impl, name):
    """Each feature alone and in combination, through both ops: context_attention_fwd (every qlen >= 1 request)
    and chunked_prefill_paged_decode (prefills through its prefill step, qlen-1 requests on the decode path)."""
    case = Case(FEATURES[name], device)
    if case.fmt is not None:   # the writer stored genuinely non-zero, finite fp8 codes at every written slot
        bs = case.spec.bs
        ids = torch.tensor([sl // bs for sl in case.written_slots], device=case.k_cache.device)
        offs = torch.tensor([sl % bs for sl in case.written_slots], device=case.k_cache.device)
        nan = torch.tensor(NAN_CODES[case.fmt.name], dtype=torch.uint8, device=case.k_cache.device)
        for cache in (case.k_cache[ids, :, :, offs, :], case.v_cache[ids, :, :, offs]):
            raw = cache.contiguous().view(torch.uint8)
            assert nonzero_share(raw) > 0.5 and not torch.isin(raw, nan).any()
    if name.startswith("invalid-blocks"):   # the kernels read an invalid block's keys from page 0: here a NaN page,
        assert 0 not in {sl // case.spec.bs for sl in case.written_slots}   # so a V row left unzeroed shows
    for op in ("ctx", "chunked"):
        run_and_check(case, op, impl, what=f"{name} {op}")


@pytest.mark.parametrize("last_first", [True, False], ids=["tiles-last-first", "tiles-in-order"])
def test_prefill_tile_orders(device, last_first, monkeypatch):
    """The prefill grid's two program orders (kernels.tiles_last_first): q tiles on the second axis, last tile
    first, and, when there are more tiles than that axis holds (here a limit of 1), q tiles on the first axis."""
    from torch_dsv4_ops.ops import attention as attention_ops

    if not last_first:
        monkeypatch.setattr(attention_kernels, "MAX_GRID_YZ", 1)
    monkeypatch.setattr(attention_ops, "_CHUNKED_PLANS", type(attention_ops._CHUNKED_PLANS)())
    monkeypatch.setattr(attention_ops, "_CONTEXT_PLANS", type(attention_ops._CONTEXT_PLANS)())
    grids, grid_of = [], attention_kernels.prefill_grid
    monkeypatch.setattr(attention_kernels, "prefill_grid", lambda *a: grids.append(grid_of(*a)) or grids[-1])
    long, mid = (20, 13) if device.type == "cpu" else (300, 200)    # several q tiles of the interpreter's / a GPU's
    case = Case(Spec(q_lens=(1, long, 0, mid), seq_lens=(9, long + 25, 4, mid + 17), sinks=(0.0, 2.0), seed=71),
                device)
    for op in ("ctx", "chunked"):
        run_and_check(case, op, "kernel", what=f"prefill tile order {op}")
    tiles, groups = (grids[0][1], grids[0][0]) if last_first else grids[0][:2]
    assert len(grids) == 2 and grids[0] == grids[1] and tiles > 1 and groups == 2, grids   # 2 kv heads of 2 q heads


def test_skip_decode(device):
    """context_attention_fwd(skip_decode=True) leaves the qlen-1 requests' rows untouched."""
    case = Case(BASE.replace(seed=50), device)
    for impl in IMPLS:
        if impl_available(impl, device):
            run_and_check(case, "ctx", impl, skip_decode=True, what="skip_decode")


# --- GQA/MQA at Hq 64, big head sizes, bs 544 -------------------------------------------------------
# On CPU these run on the reference only (the interpreter would run 64+ programs of big tiles one by one);
# the tiny kernel cases above cover the same code paths; on a GPU they run on the kernel.
REF_ONLY_ON_CPU = {
    "hq64-ratio1": Spec(hq=64, hkv=64, dim=64, q_lens=(1, 3, 0), seq_lens=(19, 10, 2), seed=60),
    "hq64-ratio8": Spec(hq=64, hkv=8, dim=128, q_lens=(1, 3, 0), seq_lens=(19, 10, 2), sinks=(0.0, 3.0, -2.0),
                        sw=16, seed=61),
    "hq64-ratio64": Spec(hq=64, hkv=1, dim=256, q_lens=(1, 4, 0), seq_lens=(40, 36, 2), alibi=True,
                         seed=62),
    "hq64-ratio8-fp8-ptr": Spec(hq=64, hkv=8, dim=64, **FP8, ptr=True, q_lens=(1, 2), seq_lens=(33, 20),
                                seed=63),
    "D256-bs544-cache": Spec(hq=4, hkv=2, dim=256, bs=544, dense=False, q_lens=(1, 5, 1), seq_lens=(560, 1100, 3),
                             sinks=(-2.0,), spare_blocks=1, seed=64),
    "D256-bs544-fp8-sw2048": Spec(hq=4, hkv=1, dim=256, bs=544, kv="fp8_e5m2", cache_dtype=torch.uint8, sw=2048,
                                  q_lens=(1, 7), seq_lens=(2100, 1500), spare_blocks=1, seed=65),
}


@pytest.mark.parametrize("name", list(REF_ONLY_ON_CPU))
def test_wide_shapes(device, name):
    impl = "reference" if device.type == "cpu" else "kernel"
    case = Case(REF_ONLY_ON_CPU[name], device)
    for op in ("ctx", "chunked"):
        run_and_check(case, op, impl, what=f"{name} {op}")


@pytest.mark.parametrize("hkv", [64, 8, 1], ids=["ratio1", "ratio8", "ratio64"])
def test_hq64_kernel_small(device, hkv):
    """Hq 64 with GQA ratios 1, 8, 64 through the kernel at a tiny size (interpreter-affordable)."""
    case = Case(Spec(hq=64, hkv=hkv, dim=16, bs=16, q_lens=(1, 2), seq_lens=(20, 17), sinks=(0.0, -2.0), seed=66),
                device)
    for op in ("ctx", "chunked"):
        run_and_check(case, op, "kernel", what=f"hq64 {op}")


# --- a ragged batch of 10 requests (SPEC §5: query lengths in [1, 1024], some 0 and 1; contexts in [0, 1024]) ---
def ragged_spec(scale_down: bool, seed: int = 70, **kw) -> Spec:
    g = torch.Generator().manual_seed(seed)
    top = 160 if scale_down else 1024
    q_lens = [1, 0, 1, top, 0, 1, int(torch.randint(2, top, (1,), generator=g)), 17, 1,
              int(torch.randint(2, top, (1,), generator=g))]
    ctx = [int(c) for c in torch.randint(0, top + 1, (10,), generator=g)]
    ctx[2] = 0
    ctx[3] = top
    return Spec(q_lens=tuple(q_lens), seq_lens=tuple(c + q for c, q in zip(ctx, q_lens)), hq=4, hkv=2, dim=64, bs=16,
                sw=kw.pop("sw", None), sinks=kw.pop("sinks", (float("-inf"), -2.0, 0.0, 3.0)), seed=seed, **kw)


@pytest.mark.parametrize("variant", ["dense-bf16", "cache-fp8-sw"])
def test_ragged_batch(device, variant):
    """Reference-only on CPU, at 1/6 size (the interpreter would take minutes); full size on a GPU."""
    small = device.type == "cpu"
    extra = {} if variant == "dense-bf16" else dict(dense=False, kv="fp8", cache_dtype=torch.uint8, sw=200,
                                                     dtype=torch.float16)
    case = Case(ragged_spec(small, **extra), device)
    impl = "reference" if small else "kernel"
    for op in ("ctx", "chunked"):
        run_and_check(case, op, impl, what=f"ragged {variant} {op}")


# ================================================================================================
# Decode split plans and table chunks (host ints)
# ================================================================================================
@pytest.mark.parametrize("per_sm", [4, 11])
@pytest.mark.parametrize("min_keys", [attention_kernels.MIN_KEYS_PER_SPLIT, 32])
def test_decode_split_counts(per_sm, min_keys):
    """With at_most, the split count is the largest whose (request x kv head x split) programs fit per_sm per SM
    (one wave), bounded by min_keys keys per part and MAX_SPLITS; without it, the smallest that reaches
    per_sm per SM, under the same bounds."""
    k = attention_kernels
    for requests, hkv, keys, sms in [(64, 8, 4096, 132), (256, 8, 1024, 132), (1, 8, 32768, 132), (1, 1, 300, 132),
                                     (3, 2, 10**6, 78), (1000, 8, 4096, 132), (0, 8, 4096, 132), (2, 4, 0, 16),
                                     (1, 8, 4096, 132), (2, 8, 1000, 132)]:
        programs, slots = max(requests * hkv, 1), per_sm * sms
        cap = min(-(-max(keys, 1) // min_keys), k.MAX_SPLITS)
        fit = k.decode_splits(requests, hkv, keys, sms, per_sm, at_most=True, min_keys=min_keys)
        fill = k.decode_splits(requests, hkv, keys, sms, per_sm, min_keys=min_keys)
        assert 1 <= fit <= fill <= cap
        assert fit == 1 or programs * fit <= slots
        assert fit == cap or programs * (fit + 1) > slots
        assert fill == cap or programs * fill >= slots
        assert fill == 1 or fill == cap or programs * (fill - 1) < slots


def test_combine_block_holds_the_splits():
    """The combine's tile: the smallest of COMBINE_BLOCKS that holds the split count, for every allowed count."""
    k = attention_kernels
    for splits in range(1, k.MAX_SPLITS + 1):
        block = k.combine_block(splits)
        assert block in k.COMBINE_BLOCKS and block >= splits
        assert not [b for b in k.COMBINE_BLOCKS if splits <= b < block]


def _plan_inputs():
    """(target, geometry, q dtype) over every GPU target, the head groups and the dtypes the matrix compiles."""
    for target in platform.MATRIX_TARGETS:
        for hq, hkv, d in ((32, 8, 128), (64, 8, 64), (4, 2, 24)):
            for q_dtype in (torch.bfloat16, torch.float16):
                yield target, attention_kernels.Geometry(hq=hq, hkv=hkv, d=d, bs=16, x=8, k_std=True), q_dtype


def test_table_chunk_loop_on_one_warp():
    """Every GPU target's decode of at most 128 dims from an fp8 cache, or from a float cache with groups of at most
    FLOAT_CHUNK_MAX_ROWS heads, takes the table-chunk loop on one warp per program (its tl.gather stays in warp
    shuffles), over the head groups and dtypes the matrix compiles."""
    k = attention_kernels
    for target, geo, q_dtype in _plan_inputs():
        for kv_fp8 in (True, False):
            tiles = k.decode_tiles(geo, q_dtype, kv_fp8, target)
            assert tiles["loop"] != k.LOOP_TABLE_CHUNKS or tiles["num_warps"] == 1, (target, geo)
            chunks = geo.block_d <= 128 and (kv_fp8 or geo.group <= k.FLOAT_CHUNK_MAX_ROWS)
            assert (tiles["loop"] == k.LOOP_TABLE_CHUNKS) == chunks, (target, geo, kv_fp8)


def test_prefill_tiles_fp8_caches_two_stages():
    """fp8-cache prefills with per-block table loads stay at two stages on every GPU target (at three, triton 3.6
    built a PV dot that read shared memory out of bounds on the H100), and three-stage plans come only on targets
    with at least WIDE_PREFILL_SMEM of shared memory (the compile matrix checks each plan's actual use)."""
    k = attention_kernels
    for target, geo, q_dtype in _plan_inputs():
        fp8 = k.prefill_tiles(geo, q_dtype, target, True)
        assert not (fp8["tile_ids"] and fp8["num_stages"] > 2), (target, geo)
        if k.prefill_tiles(geo, q_dtype, target)["num_stages"] > 2:
            assert platform.shared_memory_limit(target) >= k.WIDE_PREFILL_SMEM, target


def test_table_chunk_holds_its_columns():
    """Every chunk of table_chunk's tiles, starting at any tile boundary, covers at most CHUNK_COLS table columns,
    CHUNK_COLS is a power of two of at most TABLE_CHUNK_COLS, and a chunk has at most TABLE_CHUNK_TILES tiles (2 under
    the interpreter)."""
    k = attention_kernels
    gpu = next(t for t in platform.MATRIX_TARGETS if t.backend == "cuda")
    for target in (gpu, platform.INTERPRETER_TARGET):
        for block_n in (16, 32):
            for bs in list(range(1, 70)) + [127, 128, 129, 544, 4096]:
                chunk, cols = k.table_chunk(bs, block_n, target)
                assert chunk >= 1 and cols & (cols - 1) == 0 and cols <= k.TABLE_CHUNK_COLS
                assert chunk <= (2 if target.backend == "interpreter" else k.TABLE_CHUNK_TILES)
                for start in range(0, 3 * bs * block_n, block_n):
                    end = start + chunk * block_n - 1
                    assert end // bs - start // bs + 1 <= cols, (bs, block_n, start)


# ================================================================================================
# Decode split equivalence
# ================================================================================================
SPLIT_SPEC = Spec(q_lens=(1, 1, 0, 1, 1, 1), seq_lens=(37, 80, 5, 1, 0, 130), hq=4, hkv=2, dim=32, bs=16,
                  sinks=(float("-inf"), 3.0, -2.0, 0.0), seed=80)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", ["plain", "sw20-alibi", "fp8-e5m2-ptr", "long", "long-d128"])
def test_decode_split_equivalence(device, impl, variant):
    """forced_decode_splits(n) for n in {1, 2, 3, 7, 12 (> the 9 key blocks of the longest request), 40} (the
    interpreter runs 1, 3, 12 and 40): within tolerance of n = 1 and of the oracle; the sink is counted once and
    empty splits (sliding window) combine; variant "long" fills all 40 parts with keys, and "long-d128" does so
    with 128-dim heads, whose 40-split combine merges each output row in 4 column parts (`combine_parts`; the
    interpreter's decode tiles, like fp8 caches on a GPU, allow them)."""
    spec = SPLIT_SPEC
    if variant == "sw20-alibi":
        spec = spec.replace(sw=20, alibi=True)
    elif variant == "fp8-e5m2-ptr":
        spec = spec.replace(kv="fp8_e5m2", cache_dtype=torch.uint8, ptr=True, dense=False, padded=True)
    elif variant == "long":   # 600 keys: every one of 40 parts holds keys (on CPU, 16-key tiles)
        spec = spec.replace(q_lens=(1,), seq_lens=(600,))
    elif variant == "long-d128":
        spec = spec.replace(q_lens=(1,), seq_lens=(600,), dim=128)
        assert attention_kernels.combine_parts(attention_kernels.combine_block(40), 128, 4) == 4
    case = Case(spec, device)
    expected = oracle(case, "chunked")
    tol = TOLERANCES[spec.dtype]
    one = None
    for n in (1, 2, 3, 7, 12, 40) if device.type == "cuda" else (1, 3, 12, 40):
        out = run(case, "chunked", impl, splits=n)
        check_rows(case, out, expected, f"splits={n} [{impl}]")
        if one is None:
            one = out.cpu().double()
        else:
            rows = torch.tensor(sorted(expected))
            assert_close64(out.cpu().double()[rows], one[rows], tol, tol, f"splits={n} vs 1 [{impl}]")


# ================================================================================================
# Unused pages full of NaN, finite output
# ================================================================================================
NAN_SPECS = {
    "bf16-dense": BASE.replace(seed=90),
    "fp16-cache-sw": BASE.replace(dtype=torch.float16, dense=False, sw=16, seed=91),
    "e4m3-uint8": BASE.replace(**FP8, seed=92),
    "e5m2-uint8-cache": BASE.replace(kv="fp8_e5m2", cache_dtype=torch.uint8, dense=False, seed=93),
    "e4m3-typed-ptr": BASE.replace(kv="fp8", cache_dtype=torch.float8_e4m3fn, ptr=True, seed=94),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(NAN_SPECS))
def test_unused_pages_nan(device, impl, name):
    """Every page no valid entry within seq_len references, and the tails of partly used pages past seq_len,
    hold NaN codes (0x7F/0xFF e4m3fn, 0x7D..0x7F/0xFD..0xFF e5m2): the output is finite and matches the
    oracle; contexts end mid-page and table columns past seq_len point at spare NaN pages."""
    spec = NAN_SPECS[name].replace(q_lens=(1, 3, 1, 0), seq_lens=(21, 19, 33, 3), spare_blocks=4, extra_cols=2)
    case = Case(spec, device)
    kc = case.k_cache.cpu().contiguous().view(torch.uint8) if case.fmt is not None else case.k_cache.cpu()
    assert (kc.isnan() if case.fmt is None else torch.isin(kc, torch.tensor(NAN_CODES[case.fmt.name],
                                                                          dtype=torch.uint8))).any()
    for op in ("ctx", "chunked"):
        run_and_check(case, op, impl, what=f"NaN pages {name} {op}")


# ================================================================================================
# Hostile values (SPEC §4 b, f): masked keys, untouched rows, no crash
# ================================================================================================
def hostile_spec(table: str) -> Spec:
    """query_start_loc negative at the start, decreasing and flat at the end, the last request past T;
    seq_len < qlen (prefill and decode), seq_len 0 and negative (a decode at -100 and a prefill at -1000: ranges
    below a whole tile, whose tiles would start at negative table columns); hostile table entries within seq_len,
    and a table narrower than the longest context (max_seq_len None)."""
    qsl = (-3, 1, 3, 4, 5, 12, 2, 2)            # r0 -3..0, r1 1..2, r2 3, r3 4, r4 5..11 (T = 10), r5 -10, r6 0
    seq = (10, 5, 0, -100, -1000, 7, 3)
    bs = 4
    if table == "ptr":
        bad = ((0, 0, "zero"), (0, 1, "neg"), (1, 0, "below"), (4, 0, "past"), (5, 1, "min"),
               (1, 1, "unaligned"))
    elif table == "int64":
        bad = ((0, 0, -1), (0, 1, INT64_MIN), (1, 0, 10**6), (4, 0, -7), (5, 1, 2**62))
    else:
        bad = ((0, 0, -1), (0, 1, -(2**31)), (1, 0, INT32_MAX), (4, 0, 5000))
    return Spec(qsl=qsl, tokens=10, seq_lens=seq, q_lens=(), bs=bs, hq=4, hkv=2, dim=16, width=2, bad=bad,
                table_dtype=torch.int32 if table == "int32" else torch.int64, ptr=table == "ptr",
                max_seq_len="none", max_input_len=7, sinks=(float("-inf"), 1.0), seed=100,
                peaked=False)   # no dominant key: a stray key (e.g. a row read before row 0) must show


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("table", ["int32", "int64", "ptr"])
@pytest.mark.parametrize("dense", [True, False], ids=["dense-kv", "cache-kv"])
def test_hostile_values(device, impl, table, dense):
    spec = hostile_spec(table).replace(dense=dense)
    case = Case(spec, device)   # with "ptr": an unaligned pointer inside a valid page addresses that page
    for op in ("ctx", "chunked"):
        out1 = run(case, op, impl)
        out2 = run(case, op, impl)
        assert_bitwise_equal(out1.cpu(), out2.cpu(), f"{op}: deterministic")
        check_rows(case, out1, oracle(case, op), f"hostile {table} {op} [{impl}]", nontrivial=False)


def test_hostile_reference_equals_kernel(device):
    """The documented result is the same on both implementations (within the dtype tolerance)."""
    if device.type != "cpu":
        pytest.skip("the reference is the CPU implementation")
    case = Case(hostile_spec("int64"), device)
    tol = TOLERANCES[case.spec.dtype]
    for op in ("ctx", "chunked"):
        a, b = run(case, op, "reference").double(), run(case, op, "kernel").double()
        assert torch.equal(a.isnan(), b.isnan())
        assert_close64(a.nan_to_num(0), b.nan_to_num(0), tol, tol, f"{op}: reference vs kernel")


# ================================================================================================
# opcheck and torch.compile
# ================================================================================================
def small_case(device, **kw):
    return Case(Spec(q_lens=(1, 3), seq_lens=(9, 7), hq=2, hkv=1, dim=16, bs=8, pad_rows=1, **kw), device)


def _permute_real(i, t):
    # q, k, v, o and the block table get the non-contiguous layouts; k/v may be None (not tensors, left out)
    # and the 1-D metadata/scales have nothing to permute. The caches keep the engine's head-major layout:
    # a reversed-stride copy of a 5-D page tensor is the same logical cache, but its data_ptr/stride(0)
    # change, which is what pointer tables encode; they are exercised with padded pages elsewhere.
    return t.dim() >= 2 and i in (0, 1, 2, 3, 7)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["ctx", "chunked"])
@pytest.mark.parametrize("variant", ["dense-sinks", "cache-fp8"])
def test_opcheck(device, impl, op, variant):
    if not impl_available(impl, device):
        pytest.skip("the reference is the CPU implementation")
    # fp8 *outputs* are left out: opcheck's test_schema compares outputs with torch.allclose, which has no
    # float8 kernel (NotImplementedError "mul_cpu_reduced_float"); the fp8 cache path is covered here
    kw = dict(sinks=(0.0, 3.0), sw=5) if variant == "dense-sinks" else dict(dense=False, **FP8, alibi=False,
                                                                             sinks=(-2.0, 1.0))
    case = small_case(device, **kw)
    args = case.args(op, case.output())
    with implementation(impl, device):
        run_opcheck(ctx_op() if op == "ctx" else chunked_op(), args, permute=_permute_real)


def _compile_inputs(device, op, fp8=False):
    """Three batches of different token and request counts (T 13/9/20, R 6/3/9). Fixed: Hq 4, Hkv 2, D 16, bs 8,
    24 pages, table width 5. The first call's sizes differ from every other dim and are >= 2, so neither duck
    sizing nor 0/1 specialisation ties them to a constant."""
    batches = [((1, 3, 1, 0, 4, 2), (12, 9, 30, 3, 17, 2)), ((2, 1, 4), (5, 31, 8)),
               ((1, 1, 5, 1, 0, 2, 1, 3, 4), (3, 19, 25, 4, 6, 13, 28, 10, 7))]
    inputs, cases = [], []
    for i, (q_lens, seqs) in enumerate(batches):
        spec = Spec(q_lens=q_lens, seq_lens=seqs, hq=4, hkv=2, dim=16, bs=8, width=5, num_blocks=24,
                    max_input_len=5, sinks=(0.0, -2.0), sw=19, seed=110 + i, sm_scale=0.5, pad_rows=2 if i != 1 else 1,
                    **(dict(FP8, dense=False) if fp8 else {}))
        case = Case(spec, device)
        case.max_seq_len = 40
        cases.append(case)
        inputs.append(case.args(op, case.output()))
    return inputs, cases


@pytest.mark.parametrize("op", ["ctx", "chunked"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_compile_no_recompile(device, op, fp8):
    """fullgraph=True, dynamic=True over three token/request counts: one graph, no recompiles; compiled results
    equal eager's (the kernel on GPU; on CPU the reference: what dynamo sees does not depend on the
    implementation, and the interpreter's kernel runs in the other tests) and the oracle."""
    if device.type == "cpu":
        with d.cpu_implementation("reference"):
            _compile_no_recompile(device, op, fp8)
    else:
        _compile_no_recompile(device, op, fp8)


def _compile_no_recompile(device, op, fp8):
    inputs, cases = _compile_inputs(device, op, fp8)
    fn_op = context_attention_fwd if op == "ctx" else chunked_prefill_paged_decode

    def step(*args):
        # sm_scale as a literal: a float from any source (an input, a closure cell, a module attribute) is traced
        # as a dynamic float under dynamic=True; a custom op's `float?` argument cannot take one, so dynamo
        # restarts the analysis once with floats specialised and the backend runs twice for the one frame,
        # which check_compile would count as a recompile
        args = args[:16] + (0.5,) + args[17:]
        fn_op(*args)
        return args[3]

    tol = TOLERANCES[torch.bfloat16]
    jits = [getattr(attention_kernels, n) for n in dir(attention_kernels)
            if hasattr(getattr(attention_kernels, n), "device_caches")] if device.type == "cuda" else []
    before = sum(triton_cache_entries(j) for j in jits)
    check_compile(step, inputs, compare=lambda a, e: assert_close64(a.cpu().double(), e.cpu().double(), tol, tol,
                                                                    "compiled vs eager"))
    if jits:   # one Triton specialisation per kernel for all batch sizes
        assert sum(triton_cache_entries(j) for j in jits) - before <= len(jits)
    for case in cases:   # and the eager result is right
        out = case.output()
        fn_op(*case.args(op, out))
        check_rows(case, out, oracle(case, op), f"compile batch {case.R} requests")


# ================================================================================================
# Bad input
# ================================================================================================
def _bad_base(device="cpu"):
    return Case(Spec(q_lens=(1, 3), seq_lens=(9, 7), hq=4, hkv=2, dim=16, bs=8, pad_rows=1, sinks=(0.0, 1.0)),
                device)


BAD_CASES = [   # (id, mutation of the argument dict, exception, words for ctx, words for chunked)
    ("hq-not-divisible", lambda c, a: a.update(q=torch.randn(c.T, 3, 16).to(c.q), sinks=None), ValueError,
     r"\bq\b|k_cache|k\b", r"query|key_cache|key\b"),
    ("head-size-q", lambda c, a: a.update(q=torch.randn(c.T, 4, 8).to(c.q)), ValueError,
     r"\bq\b|k_cache|v_cache|head", r"query|key_cache|value_cache|head"),
    ("head-size-k", lambda c, a: a.update(k=torch.randn(c.T, 2, 8).to(c.q), v=torch.randn(c.T, 2, 8).to(c.q)),
     ValueError, r"\bk\b|\bv\b", r"key|value"),
    ("table-too-narrow", lambda c, a: a.update(max_seq_len=c.W * c.spec.bs + 1), ValueError, "b_loc",
     "block_table"),
    ("int-q", lambda c, a: a.update(q=c.q.to(torch.int32)), ValueError, r"\bq\b", "query"),
    ("k-dtype", lambda c, a: a.update(k=c.k.float(), v=c.v.float()), ValueError, r"\bk\b|\bv\b", r"key|value"),
    ("k-without-v", lambda c, a: a.update(v=None), ValueError, r"\bk\b|\bv\b", r"key|value"),
    ("uint8-cache-auto", lambda c, a: a.update(k_cache=torch.zeros(c.nb, 2, 1, 8, 16, dtype=torch.uint8),
                                               v_cache=torch.zeros(c.nb, 2, 16, 8, dtype=torch.uint8)),
     ValueError, "kv_cache_dtype", "kv_cache_dtype"),
    ("bad-kv-cache-dtype", lambda c, a: a.update(kv="fp4"), ValueError, "kv_cache_dtype", "kv_cache_dtype"),
    ("fp8-string-bf16-cache", lambda c, a: a.update(kv="fp8"), ValueError, "kv_cache_dtype", "kv_cache_dtype"),
    ("qsl-length", lambda c, a: a.update(qsl=c.qsl_t[:-1]), ValueError, "b_start_loc", "query_start_loc"),
    ("qsl-dtype", lambda c, a: a.update(qsl=c.qsl_t.float()), ValueError, "b_start_loc", "query_start_loc"),
    ("seq-dtype", lambda c, a: a.update(seq=c.seq_t.float()), ValueError, "b_seq_len", "seq_lens"),
    ("table-dtype", lambda c, a: a.update(table=c.table.float()), ValueError, "b_loc", "block_table"),
    ("ptr-table-int32", lambda c, a: a.update(ptr=True), ValueError, "b_loc", "block_table"),
    ("k-scale-shape", lambda c, a: a.update(k_scale=torch.ones(2)), ValueError, "k_scale", "k_scale"),
    ("v-scale-dtype", lambda c, a: a.update(v_scale=torch.ones(1, dtype=torch.float16)), ValueError, "v_scale",
     "v_scale"),
    ("sinks-shape", lambda c, a: a.update(sinks=torch.zeros(3)), ValueError, "sinks", "sinks"),
    ("alibi-shape", lambda c, a: a.update(alibi=torch.ones(3)), ValueError, "alibi_slopes", "alibi_slopes"),
    ("q-rank", lambda c, a: a.update(q=c.q[:, 0]), ValueError, r"\bq\b", "query"),
    ("alibi-non-causal", lambda c, a: a.update(alibi=torch.ones(4), causal=False), ValueError,
     "alibi_slopes|causal", "alibi_slopes|causal"),
    ("alibi-cache-kv", lambda c, a: a.update(alibi=torch.ones(4), k=None, v=None), NotImplementedError,
     "alibi", "alibi"),
]
OUT_CASES = [   # output dtype / scale mismatches
    ("fp8-out-without-scale", torch.float8_e4m3fn, None, r"\bo\b|fp8_out_scale", r"output|output_scale"),
    ("scale-with-float-out", torch.bfloat16, 0.5, r"\bo\b|fp8_out_scale", r"output|output_scale"),
    ("int-out", torch.int32, None, r"\bo\b", "output"),
    ("out-shape", "short", None, r"\bo\b", "output"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["ctx", "chunked"])
@pytest.mark.parametrize("bad", BAD_CASES, ids=[b[0] for b in BAD_CASES])
def test_bad_input(impl, op, bad):
    _, mutate, exc, words_ctx, words_chunked = bad
    case = _bad_base()
    overrides = {}
    mutate(case, overrides)
    q = overrides.get("q")
    # an output matching q's (bad) shape, so that only the argument under test is wrong
    out = poison_(torch.empty_like(q)) if q is not None and q.is_floating_point() else case.output()
    args = case.args(op, out, **overrides)
    before = out.clone()
    fn = context_attention_fwd if op == "ctx" else chunked_prefill_paged_decode
    with implementation(impl, torch.device("cpu")), pytest.raises(exc, match=words_ctx if op == "ctx"
                                                                   else words_chunked):
        fn(*args)
    assert_bitwise_equal(out, before, "output after an error")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["ctx", "chunked"])
@pytest.mark.parametrize("bad", OUT_CASES, ids=[b[0] for b in OUT_CASES])
def test_bad_output(impl, op, bad):
    _, o_dtype, scale, words_ctx, words_chunked = bad
    case = _bad_base()
    if o_dtype == "short":
        out = poison_(torch.empty(case.T - 1, 4, 16, dtype=case.q.dtype))
    else:
        out = poison_(torch.empty(case.T, 4, 16, dtype=o_dtype))
    before = out.clone()
    args = case.args(op, out, out_scale=None if scale is None else torch.tensor([scale]))
    fn = context_attention_fwd if op == "ctx" else chunked_prefill_paged_decode
    with implementation(impl, torch.device("cpu")), pytest.raises(ValueError, match=words_ctx if op == "ctx"
                                                                   else words_chunked):
        fn(*args)
    assert_bitwise_equal(out, before, "output after an error")


# ================================================================================================
# GPU only: CUDA graphs, sync-free eager calls, benchmark-sized decodes, split sweep
# ================================================================================================
def _decode_spec(R, ctx, hq=32, hkv=8, dim=128, bs=16, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    seqs = tuple(int(c) for c in torch.randint(max(ctx // 2, 1), ctx + 1, (R,), generator=g))
    return Spec(q_lens=(1,) * R, seq_lens=seqs, hq=hq, hkv=hkv, dim=dim, bs=bs, pad_rows=0, dense=False,
                spare_blocks=8, extra_cols=0, seed=seed, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_cuda_graph_decode_replay(kv):
    """chunked_prefill_paged_decode's decode path captured once; replayed with new q, seq_lens (longer, shorter,
    0) and block tables (and cache contents) in the same buffers: equal to eager, and eager equals the oracle."""
    extra = dict(FP8) if kv == "fp8" else {}
    cases = []
    for i in range(3):
        spec = _decode_spec(6, 300, hq=8, hkv=2, seed=150 + i, sinks=(0.0, 3.0), num_blocks=160, width=19, **extra)
        if i == 2:
            spec = spec.replace(seq_lens=spec.seq_lens[:3] + (0,) + spec.seq_lens[4:])
        cases.append(Case(spec, "cuda"))
    c0 = cases[0]

    def buffers(c):
        return [c.q, c.k_cache, c.v_cache, c.table, c.qsl_t, c.seq_t, c.output()]

    def step(q, k_cache, v_cache, table, qsl, seq, out):
        chunked_prefill_paged_decode(q, None, None, out, c0.spec.kv, k_cache, v_cache, table, qsl, seq, 304, 1,
                                     c0.k_scale, c0.v_scale, None, None, c0.sm_scale, None, c0.sinks, False, True)

    static = [t.clone() for t in buffers(c0)]
    check_cuda_graph(step, static, [buffers(c) for c in cases[1:]])
    for c in cases:
        out = run(c, "chunked", "kernel")
        check_rows(c, out, oracle(c, "chunked"), f"graph case {c.spec.seed} eager", nontrivial=False)


@pytest.mark.gpu
def test_sync_free_eager_calls():
    """No host-device synchronisation inside either op (sync-debug "error"), prefill and decode paths."""
    case = Case(BASE.replace(sinks=(0.0, 3.0), sw=16, seed=120), "cuda")
    fp8 = Case(BASE.replace(**FP8, dense=False, ptr=True, out_dtype=torch.float8_e4m3fn, seed=121), "cuda")
    calls = []
    for c in (case, fp8):
        calls.append((context_attention_fwd, c.args("ctx", c.output())))
        calls.append((chunked_prefill_paged_decode, c.args("chunked", c.output())))
    for fn, args in calls:   # warm up (compiles) outside the check
        fn(*args)
    torch.cuda.synchronize()
    with sync_debug_error():
        for fn, args in calls:
            fn(*args)
    torch.cuda.synchronize()


def _check_big_decode(case: Case, out: torch.Tensor, what: str):
    """Oracle on the GPU in float64, request by request (K/V of one request at a time)."""
    expected = oracle(case, "chunked")
    check_rows(case, out, expected, what)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e5m2"])
def test_benchmark_sized_decode(kv):
    """32 q heads, 8 kv heads, D 128, bs 16, 64 requests x context up to 4096 (bf16 q)."""
    extra = {"fp8": dict(FP8), "fp8_e5m2": dict(kv="fp8_e5m2", cache_dtype=torch.uint8), "auto": {}}[kv]
    spec = _decode_spec(64, 4096, seed=130, sinks=(float("-inf"), 0.0), fill="random", **extra)
    spec = spec.replace(seq_lens=(4096,) + spec.seq_lens[1:])
    case = Case(spec, "cuda")
    out = run(case, "chunked", "kernel")
    _check_big_decode(case, out, f"64 x 4096 {kv}")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["bf16", "fp8", "fp8-bs544"])
def test_split_sweep_long_context(variant):
    """1 request x 32768 context: every forced split count agrees with the oracle and with one split (fp8 caches:
    one split runs 2048 tiles in 32 table chunks; at bs 544 chunks straddle blocks)."""
    extra = dict(FP8) if variant.startswith("fp8") else {}
    bs = 544 if variant.endswith("bs544") else 16
    spec = _decode_spec(1, 32768, seed=140, sinks=(2.0,), fill="random", bs=bs, **extra).replace(seq_lens=(32768,))
    case = Case(spec, "cuda")
    expected = oracle(case, "chunked")
    one = None
    for n in (1, 2, 3, 4, 7, 8, 16, 32, 64, 128):   # forced_decode_splits accepts 1..MAX_SPLITS (128)
        out = run(case, "chunked", "kernel", splits=n)
        check_rows(case, out, expected, f"splits={n}")
        if one is None:
            one = out.double().cpu()
        else:
            tol = TOLERANCES[spec.dtype]
            assert_close64(out.double().cpu(), one, tol, tol, f"splits={n} vs 1")
    out = run(case, "chunked", "kernel")   # the automatic split count
    check_rows(case, out, expected, "automatic splits")


@pytest.mark.gpu
def test_device_mismatch():
    case = small_case("cuda")
    out = case.output()
    args = case.args("chunked", out, seq=case.seq_t.cpu())
    with pytest.raises(ValueError, match="seq_lens"):
        chunked_prefill_paged_decode(*args)


@triton.jit
def _f16_rows_probe(q_ptr, out_ptr, down_ptr, M: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
    q16, down = attention_kernels._to_f16_rows(tl.load(q_ptr + i))
    tl.store(out_ptr + i, q16)
    tl.store(down_ptr + tl.arange(0, M)[:, None], down)


def test_f16_rows_of_bf16_q(device):
    """The fp8-cache decode's fp16 q (kernels/attention.py `_to_f16_rows`): per row a power of two puts the
    largest |element| in [2^14, 2^15); every element at least 2^-31 of its row's largest comes back exactly
    (fp16 * inverse power == the bf16 value), smaller ones within 2^-39 of the largest; NaN and inf stay."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(16, 32, generator=g, dtype=torch.float64)
    q *= torch.tensor([1.0, 1e-30, 1e30, 3e38, 1e-36, 0.0, 1.0, 1.0, 2.0 ** -100, 2.0 ** 100, 1.0, 1.0, 1.0, 1.0,
                       1e-5, 1e5], dtype=torch.float64)[:, None]
    q[6, 3] = float("nan")
    q[7, :] = 0.0
    q[7, 5] = 1.0
    q[10, 1:] *= 2.0 ** -40          # one large element, the rest far below it
    q[11, 0] = float("inf")
    qb = q.to(torch.bfloat16).to(device)
    out = torch.empty(16, 32, dtype=torch.float16, device=device)
    down = torch.empty(16, 1, dtype=torch.float32, device=device)
    _f16_rows_probe[(1,)](qb, out, down, M=16, N=32)
    qf, back = qb.double().cpu(), out.double().cpu() * down.double().cpu()
    amax = torch.nan_to_num(qf.abs(), nan=0.0, posinf=math.inf).amax(1, keepdim=True)
    finite = torch.isfinite(amax)[:, 0]
    scaled_max = out.double().cpu().abs().nan_to_num(nan=0.0).amax(1)
    # rows 3 and 11 hold inf; below 2^-112 (rows 4, 5) the power is capped at 2^126
    ranged = finite & (amax[:, 0] >= 2.0 ** -112)
    assert ranged.sum() == 12 and ((scaled_max >= 2.0 ** 14) & (scaled_max < 2.0 ** 15))[ranged].all(), scaled_max
    exact = (qf.abs() >= amax * 2.0 ** -31) & qf.isfinite() & ranged[:, None]
    assert torch.equal(back[exact], qf[exact])
    small = (qf.abs() < amax * 2.0 ** -31) & ranged[:, None]
    assert ((back[small] - qf[small]).abs() <= amax.expand_as(qf)[small] * 2.0 ** -39).all()
    assert torch.equal(back[4:6], qf[4:6])          # bf16's smallest values times 2^126: fp16 holds them all
    assert back[6, 3].isnan() and torch.equal(out[5].cpu(), torch.zeros(32, dtype=torch.float16))
    assert back[11, 0] == float("inf")
