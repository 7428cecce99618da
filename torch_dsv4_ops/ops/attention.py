"""Paged attention over head-major flash caches (SPEC §2.3, §3.7): `dsv4::context_attention_fwd`
(prefix prefill) and `dsv4::chunked_prefill_paged_decode` (prefill requests through the prefill
kernel, single-token requests through a split-K decode kernel).

The Python entry points mirror vLLM's functions of the same names (argument names, order and
defaults); `causal` is this package's trailing argument.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import torch
import triton

from .. import layout, platform
from ..kernels import attention as kernels
from ..library import register_op
from ..reference import attention as reference
from ._checks import INT32_MAX, check_int, check_scale, check_shape, check_tensor, known
from ._plans import MISSING, PlanCache, signature

Q_DTYPES = layout.FLOAT_CACHE_DTYPES
TABLE_DTYPES = (torch.int32, torch.int64)
MAX_GRID_Y = kernels.MAX_GRID_YZ      # requests are the prefill grid's third axis


@dataclasses.dataclass(frozen=True)
class Names:
    """The argument names of one op (the two ops name the same things differently)."""

    q: str
    k: str
    v: str
    o: str
    k_cache: str
    v_cache: str
    table: str
    qsl: str
    seq_lens: str
    max_len: str
    out_scale: str


CONTEXT = Names("q", "k", "v", "o", "k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len", "max_input_len",
                "fp8_out_scale")
CHUNKED = Names("query", "key", "value", "output", "key_cache", "value_cache", "block_table", "query_start_loc",
                "seq_lens", "max_query_len", "output_scale")


@dataclasses.dataclass(frozen=True)
class Checked:
    """What validation derives from a call's metadata."""

    geo: kernels.Geometry
    kv_fmt: layout.Fp8Format | None
    feats: kernels.Features
    tokens: int
    requests: int


def check_attention(n: Names, q, k, v, o, kv_cache_dtype, k_cache, v_cache, table, qsl, seq_lens, max_seq_len,
                    max_len, k_scale, v_scale, alibi_slopes, sliding_window, sm_scale, out_scale, sinks,
                    is_block_table_ptr, causal, e4m3=layout.E4M3FN) -> Checked:
    """Validate either op's arguments (dtypes, shapes, devices, ints; never contents)."""
    check_tensor(n.q, q, ndim=3, dtypes=Q_DTYPES)
    device = q.device
    tokens, hq, dim = q.shape
    check_tensor(n.k_cache, k_cache, ndim=5, device=device)
    check_tensor(n.v_cache, v_cache, ndim=4, dtypes=(k_cache.dtype,), device=device)
    nb, hkv, _, bs, x = k_cache.shape
    if hkv < 1 or hq % hkv:
        raise ValueError(f"{n.q} has {hq} heads, not a multiple of the {hkv} kv heads of {n.k_cache}")
    if bs < 1:
        raise ValueError(f"{n.k_cache} has block size {bs}; it must be at least 1")
    if x < 1 or dim % x:
        raise ValueError(f"{n.k_cache}.shape[4] (x = {x}) must divide the head size {dim} of {n.q}")
    check_shape(n.k_cache, k_cache, (nb, hkv, dim // x, bs, x), f"[num_blocks, num_kv_heads, head_size/x, "
                f"block_size, x] for head size {dim}")
    check_shape(n.v_cache, v_cache, (nb, hkv, dim, bs), "[num_blocks, num_kv_heads, head_size, block_size]")
    kv_fmt = layout.resolve_kv_cache_format(kv_cache_dtype, k_cache.dtype, e4m3)
    if kv_fmt is None and k_cache.dtype != q.dtype:
        raise ValueError(f"{n.k_cache} of dtype {k_cache.dtype} with kv_cache_dtype={kv_cache_dtype!r} needs "
                         f"{n.q} of the same dtype, got {q.dtype}")
    if (k is None) != (v is None):
        raise ValueError(f"{n.k} and {n.v} must both be tensors or both be None")
    if k is not None:
        for name, t in ((n.k, k), (n.v, v)):
            check_tensor(name, t, ndim=3, dtypes=(q.dtype,), device=device)
            check_shape(name, t, (tokens, hkv, dim), "[num_tokens, num_kv_heads, head_size] (q's tokens, the "
                        "cache's kv heads and head size)")
    check_tensor(n.o, o, ndim=3, device=device)
    o_fp8 = o.dtype in layout.FP8_BY_DTYPE
    if out_scale is not None:
        check_scale(n.out_scale, out_scale, device)
        if not o_fp8:
            raise ValueError(f"{n.out_scale} is given, so {n.o} must be an fp8 tensor, got {o.dtype}")
    elif o.dtype != q.dtype:
        raise ValueError(f"{n.o} must have {n.q}'s dtype {q.dtype} (or be fp8 with {n.out_scale}), got {o.dtype}")
    check_shape(n.o, o, tuple(q.shape), f"(the shape of {n.q})")
    check_tensor(n.seq_lens, seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    requests = seq_lens.shape[0]
    check_tensor(n.qsl, qsl, ndim=1, dtypes=(torch.int32,), device=device)
    check_shape(n.qsl, qsl, (requests + 1,), f"[R + 1] for the R = {requests} requests of {n.seq_lens}")
    check_tensor(n.table, table, ndim=2, dtypes=TABLE_DTYPES, device=device)
    if table.shape[0] < requests:
        raise ValueError(f"{n.table} has {table.shape[0]} rows, fewer than the {requests} requests")
    if table.shape[1] * bs > INT32_MAX:
        raise NotImplementedError(f"{n.table} of {table.shape[1]} columns of {bs} tokens spans more than "
                                  f"INT32_MAX positions")
    if not isinstance(is_block_table_ptr, bool):
        raise ValueError(f"is_block_table_ptr must be a bool, got {is_block_table_ptr!r}")
    if is_block_table_ptr and table.dtype != torch.int64:
        raise ValueError(f"{n.table} holds byte addresses (is_block_table_ptr=True), so it must be int64, "
                         f"got {table.dtype}")
    check_scale("k_scale", k_scale, device)
    check_scale("v_scale", v_scale, device)
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=(torch.float32,), device=device)
            check_shape(name, t, (hq,), f"[num_query_heads = {hq}]")
    check_int(n.max_len, max_len, 0)
    if max_seq_len is not None:
        check_int("max_seq_len", max_seq_len, 0)
        if known(max_seq_len) and table.shape[1] * bs < max_seq_len:
            raise ValueError(f"{n.table} has {table.shape[1]} columns of {bs} tokens, too narrow for "
                             f"max_seq_len = {max_seq_len}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)):
        raise ValueError(f"sliding_window must be None or an int, got {sliding_window!r}")
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float))):
        raise ValueError(f"sm_scale must be None or a float, got {sm_scale!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if alibi_slopes is not None and not causal:
        raise ValueError("alibi_slopes needs causal=True (ALiBi is defined for causal attention only)")
    if alibi_slopes is not None and k is None:
        raise NotImplementedError(f"alibi_slopes with {n.k} = {n.v} = None (K/V read back from the cache) is "
                                  f"not supported")
    v_align = math.gcd(v_cache.stride(0), v_cache.stride(1)) if v_cache.stride(3) == 1 else 0
    geo = kernels.Geometry(hq, hkv, dim, bs, x, k_cache.stride(3) == x and k_cache.stride(4) == 1, v_align)
    feats = kernels.Features(sliding_window=max(sliding_window or 0, 0), causal=causal,
                             alibi=alibi_slopes is not None, sinks=sinks is not None, kv_cache=k is None,
                             table_ptr=is_block_table_ptr)
    return Checked(geo, kv_fmt, feats, tokens, requests)


def _platform_e4m3(device: torch.device) -> layout.Fp8Format:
    return platform.platform_e4m3(platform.target_for(device))


# --- kernels: plans keyed by argument signature (see ops/cache.py) -------------------------------
_CONTEXT_PLANS = PlanCache()
_CHUNKED_PLANS = PlanCache()


class _DecodeSplits:
    forced: int | None = None


DECODE_SPLITS = _DecodeSplits()


@contextlib.contextmanager
def forced_decode_splits(splits: int):
    """Inside, the decode path of chunked_prefill_paged_decode splits every request's keys into exactly
    `splits` parts (a test hook: every split count must give the unsplit result within tolerance)."""
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= kernels.MAX_SPLITS:
        raise ValueError(f"splits must be an int in [1, {kernels.MAX_SPLITS}], got {splits!r}")
    previous = DECODE_SPLITS.forced
    DECODE_SPLITS.forced = splits
    try:
        yield
    finally:
        DECODE_SPLITS.forced = previous


def _common_ints(checked: Checked, k_cache, v_cache, table, seq_lens, sm_scale, table_ptr: bool) -> dict:
    geo = checked.geo
    nb = k_cache.shape[0]
    return dict(
        sm_scale=float(sm_scale) if sm_scale is not None else geo.d ** -0.5, W=table.shape[1], num_blocks=nb,
        cache_base=k_cache.data_ptr() if table_ptr else 0,
        page_bytes=max(k_cache.stride(0) * k_cache.element_size(), 1),
        kc=(k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3)),
        vc=(v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)), t=table.stride(), seq_s=seq_lens.stride(0))


def _prefill_launch(checked: Checked, numerics: kernels.Numerics, q, k, v, o, k_cache, v_cache, table, seq_lens,
                    max_len: int, sm_scale, min_qlen: int, dtypes: tuple):
    geo, target = checked.geo, platform.target_for(q.device)
    if checked.tokens == 0 or checked.requests == 0 or max_len == 0:
        return None
    if checked.requests > MAX_GRID_Y:
        raise NotImplementedError(f"the prefill path takes at most {MAX_GRID_Y} requests per call, got "
                                  f"{checked.requests}")
    c = _common_ints(checked, k_cache, v_cache, table, seq_lens, sm_scale, checked.feats.table_ptr)
    tiles = kernels.prefill_tiles(geo, q.dtype, target, numerics.kv_fp8 != layout.NOT_FP8)
    last_first = kernels.tiles_last_first(tiles, max_len)
    meta = kernels.launch_options(kernels.prefill_constexprs(geo, checked.feats, numerics, tiles, min_qlen,
                                                             last_first))
    kk, vv = (k, v) if k is not None else (q, q)
    ints = (checked.tokens, max_len, c["sm_scale"], c["W"], c["num_blocks"], c["cache_base"], c["page_bytes"],
            *q.stride(), *kk.stride(), *vv.stride(), *o.stride(), *c["kc"], *c["vc"], *c["t"], c["seq_s"])
    grid = kernels.prefill_grid(checked.requests, geo, tiles, max_len, last_first)
    return kernels.PREFILL_LAUNCHER.bind(grid, dtypes, ints, meta, q.device)


def _dtypes(q, o, k_cache, table, numerics) -> tuple:
    """Triton's view of (q, k, v, o, k_cache, v_cache, table, qsl, seq_lens, 5 fp32 tensors)."""
    cache = kernels.cache_view(k_cache.dtype)
    return (q.dtype, q.dtype, q.dtype, kernels.output_view(o.dtype, numerics), cache, cache, table.dtype,
            torch.int32, torch.int32) + (torch.float32,) * 5


def _context_plan(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, max_seq_len,
                  max_input_len, k_scale, v_scale, alibi_slopes, sliding_window, sm_scale, skip_decode,
                  fp8_out_scale, sinks, is_block_table_ptr, causal):
    checked = check_attention(CONTEXT, q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len,
                              max_seq_len, max_input_len, k_scale, v_scale, alibi_slopes, sliding_window, sm_scale,
                              fp8_out_scale, sinks, is_block_table_ptr, causal, _platform_e4m3(q.device))
    numerics = kernels.make_numerics(q.dtype, checked.kv_fmt, o.dtype, platform.target_for(q.device))
    return _prefill_launch(checked, numerics, q, k, v, o, k_cache, v_cache, b_loc, b_seq_len, max_input_len, sm_scale,
                           2 if skip_decode else 1, _dtypes(q, o, k_cache, b_loc, numerics))


def _max_seq_key(max_seq_len, table, v_cache):
    """max_seq_len as plan signatures hold it. It grows every step, so a valid int is rounded up to a
    power of two (the split-count hint uses the same bucket): a new plan only when the bucket changes.
    Anything else (None, a bad value, a table too narrow for it) is kept as given, so that such a call
    plans, and validates, for itself."""
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1 \
            or table.dim() != 2 or v_cache.dim() != 4 or table.shape[1] * v_cache.shape[3] < max_seq_len:
        return max_seq_len
    return triton.next_power_of_2(max_seq_len)


def _optional(t, fallback):
    return t if t is not None else fallback


def _context_kernel(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, max_seq_len,
                    max_input_len, k_scale, v_scale, alibi_slopes=None, sliding_window=None, sm_scale=None,
                    skip_decode=False, fp8_out_scale=None, sinks=None, is_block_table_ptr=False, causal=True):
    args = (q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, max_seq_len, max_input_len,
            k_scale, v_scale, alibi_slopes, sliding_window, sm_scale, skip_decode, fp8_out_scale, sinks,
            is_block_table_ptr, causal)
    sig = signature("context", args[:10] + (_max_seq_key(max_seq_len, b_loc, v_cache),) + args[11:])
    if is_block_table_ptr:
        sig += (k_cache.data_ptr(),)
    launch = _CONTEXT_PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _CONTEXT_PLANS.remember(sig, _context_plan(*args))
    if launch is not None:
        launch(q, _optional(k, q), _optional(v, q), o, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, k_scale,
               v_scale, _optional(fp8_out_scale, k_scale), _optional(alibi_slopes, k_scale), _optional(sinks, k_scale))


def _context_reference(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, max_seq_len,
                       max_input_len, k_scale, v_scale, alibi_slopes=None, sliding_window=None, sm_scale=None,
                       skip_decode=False, fp8_out_scale=None, sinks=None, is_block_table_ptr=False, causal=True):
    check_attention(CONTEXT, q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, max_seq_len,
                    max_input_len, k_scale, v_scale, alibi_slopes, sliding_window, sm_scale, fp8_out_scale, sinks,
                    is_block_table_ptr, causal)
    reference.context_attention_fwd(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len,
                                    max_seq_len, max_input_len, k_scale, v_scale, alibi_slopes, sliding_window,
                                    sm_scale, skip_decode, fp8_out_scale, sinks, is_block_table_ptr, causal)


def _context_fake(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, max_seq_len,
                  max_input_len, k_scale, v_scale, alibi_slopes=None, sliding_window=None, sm_scale=None,
                  skip_decode=False, fp8_out_scale=None, sinks=None, is_block_table_ptr=False, causal=True):
    check_attention(CONTEXT, q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, max_seq_len,
                    max_input_len, k_scale, v_scale, alibi_slopes, sliding_window, sm_scale, fp8_out_scale, sinks,
                    is_block_table_ptr, causal)


@dataclasses.dataclass(frozen=True)
class ChunkedPlan:
    prefill: object          # a Launch, or None
    decode: object           # a Launch, or None (nothing to do)
    combine: object          # a Launch when the decode path splits, else None
    workspace: int           # fp32 elements of the partial rows


def _chunked_plan(query, key, value, output, kv_cache_dtype, key_cache, value_cache, block_table, query_start_loc,
                  seq_lens, max_seq_len, max_query_len, k_scale, v_scale, alibi_slopes, sliding_window, sm_scale,
                  output_scale, sinks, is_block_table_ptr, causal, forced_splits):
    device = query.device
    target = platform.target_for(device)
    checked = check_attention(CHUNKED, query, key, value, output, kv_cache_dtype, key_cache, value_cache,
                              block_table, query_start_loc, seq_lens, max_seq_len, max_query_len, k_scale, v_scale,
                              alibi_slopes, sliding_window, sm_scale, output_scale, sinks, is_block_table_ptr, causal,
                              _platform_e4m3(device))
    numerics = kernels.make_numerics(query.dtype, checked.kv_fmt, output.dtype, target)
    dtypes = _dtypes(query, output, key_cache, block_table, numerics)
    prefill = None
    if max_query_len > 1:
        prefill = _prefill_launch(checked, numerics, query, key, value, output, key_cache, value_cache, block_table,
                                  seq_lens, max_query_len, sm_scale, 2, dtypes)
    geo, feats = checked.geo, checked.feats
    if checked.tokens == 0 or checked.requests == 0 or max_query_len < 1:   # rows >= max_query_len: none
        return ChunkedPlan(prefill, None, None, 0)
    max_keys = block_table.shape[1] * geo.bs
    if isinstance(max_seq_len, int) and max_seq_len > 0:   # the hint as _max_seq_key buckets it
        max_keys = min(max_keys, triton.next_power_of_2(max_seq_len))
    if feats.sliding_window:
        max_keys = min(max_keys, feats.sliding_window)
    tiles = kernels.decode_tiles(geo, query.dtype, numerics.kv_fp8 != layout.NOT_FP8, target)
    splits = forced_splits or kernels.decode_splits(
        checked.requests, geo.hkv, max_keys, kernels.device_multiprocessors(device), tiles["per_sm"],
        tiles.get("at_most", False), tiles.get("split_keys", kernels.MIN_KEYS_PER_SPLIT))
    c = _common_ints(checked, key_cache, value_cache, block_table, seq_lens, sm_scale, feats.table_ptr)
    meta = kernels.launch_options(kernels.decode_constexprs(geo, feats, numerics, tiles, splits))
    ints = (checked.tokens, c["sm_scale"], c["W"], c["num_blocks"], c["cache_base"], c["page_bytes"],
            *query.stride(), *output.stride(), *c["kc"], *c["vc"], *c["t"], c["seq_s"])
    decode_dtypes = (dtypes[0], dtypes[3]) + dtypes[4:] + (torch.float32,)
    decode = kernels.DECODE_LAUNCHER.bind((checked.requests, geo.hkv, splits), decode_dtypes, ints, meta, device)
    if splits == 1:
        return ChunkedPlan(prefill, decode, None, 0)
    meta = kernels.launch_options(kernels.combine_constexprs(geo, feats, numerics, target, splits,
                                                             tiles.get("combine_parts", 1)))
    combine = kernels.COMBINE_LAUNCHER.bind(
        kernels.combine_grid(checked.requests, geo, meta),
        (dtypes[3], torch.int32, torch.float32, torch.float32, torch.float32),
        (checked.tokens, geo.hq, splits, *output.stride()), meta, device)
    return ChunkedPlan(prefill, decode, combine, kernels.partial_elements(checked.requests, geo, splits))


def _chunked_kernel(query, key, value, output, kv_cache_dtype, key_cache, value_cache, block_table, query_start_loc,
                    seq_lens, max_seq_len, max_query_len, k_scale, v_scale, alibi_slopes=None, sliding_window=None,
                    sm_scale=None, output_scale=None, sinks=None, is_block_table_ptr=False, causal=True):
    args = (query, key, value, output, kv_cache_dtype, key_cache, value_cache, block_table, query_start_loc, seq_lens,
            max_seq_len, max_query_len, k_scale, v_scale, alibi_slopes, sliding_window, sm_scale, output_scale, sinks,
            is_block_table_ptr, causal)
    forced = DECODE_SPLITS.forced
    sig = signature("chunked", args[:10] + (_max_seq_key(max_seq_len, block_table, value_cache),) + args[11:]) \
        + (forced,)
    if is_block_table_ptr:
        sig += (key_cache.data_ptr(),)
    plan = _CHUNKED_PLANS.get(sig, MISSING)
    if plan is MISSING:
        plan = _CHUNKED_PLANS.remember(sig, _chunked_plan(*args, forced))
    out_scale, alibi, sink = _optional(output_scale, k_scale), _optional(alibi_slopes, k_scale), \
        _optional(sinks, k_scale)
    side = None
    if plan.prefill is not None and plan.decode is not None and CONCURRENT.enabled and output.is_cuda:
        # the prefill (compute-bound) and decode (memory-bound) kernels write disjoint rows: run them
        # side by side, the prefill on a side stream that forks from and joins the current one
        # (also inside CUDA-graph capture)
        current = torch.cuda.current_stream(output.device)
        side = _side_stream(output.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            plan.prefill(query, _optional(key, query), _optional(value, query), output, key_cache, value_cache,
                         block_table, query_start_loc, seq_lens, k_scale, v_scale, out_scale, alibi, sink)
    elif plan.prefill is not None:
        plan.prefill(query, _optional(key, query), _optional(value, query), output, key_cache, value_cache,
                     block_table, query_start_loc, seq_lens, k_scale, v_scale, out_scale, alibi, sink)
    if plan.decode is not None:
        part = output.new_empty((plan.workspace,), dtype=torch.float32) if plan.combine is not None else k_scale
        plan.decode(query, output, key_cache, value_cache, block_table, query_start_loc, seq_lens, k_scale,
                    v_scale, out_scale, alibi, sink, part)
        if plan.combine is not None:
            plan.combine(output, query_start_loc, out_scale, sink, part)
    if side is not None:
        current.wait_stream(side)


class _Concurrent:
    """Whether chunked_prefill_paged_decode runs its prefill and decode kernels concurrently (two
    streams) when it has both. TORCH_DSV4_ATTENTION_STREAMS=0 turns it off."""

    enabled = os.environ.get("TORCH_DSV4_ATTENTION_STREAMS", "1") != "0"


CONCURRENT = _Concurrent()
_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def _chunked_reference(query, key, value, output, kv_cache_dtype, key_cache, value_cache, block_table,
                       query_start_loc, seq_lens, max_seq_len, max_query_len, k_scale, v_scale, alibi_slopes=None,
                       sliding_window=None, sm_scale=None, output_scale=None, sinks=None, is_block_table_ptr=False,
                       causal=True):
    check_attention(CHUNKED, query, key, value, output, kv_cache_dtype, key_cache, value_cache, block_table,
                    query_start_loc, seq_lens, max_seq_len, max_query_len, k_scale, v_scale, alibi_slopes,
                    sliding_window, sm_scale, output_scale, sinks, is_block_table_ptr, causal)
    reference.chunked_prefill_paged_decode(query, key, value, output, kv_cache_dtype, key_cache, value_cache,
                                           block_table, query_start_loc, seq_lens, max_seq_len, max_query_len,
                                           k_scale, v_scale, alibi_slopes, sliding_window, sm_scale, output_scale,
                                           sinks, is_block_table_ptr, causal)


def _chunked_fake(query, key, value, output, kv_cache_dtype, key_cache, value_cache, block_table, query_start_loc,
                  seq_lens, max_seq_len, max_query_len, k_scale, v_scale, alibi_slopes=None, sliding_window=None,
                  sm_scale=None, output_scale=None, sinks=None, is_block_table_ptr=False, causal=True):
    check_attention(CHUNKED, query, key, value, output, kv_cache_dtype, key_cache, value_cache, block_table,
                    query_start_loc, seq_lens, max_seq_len, max_query_len, k_scale, v_scale, alibi_slopes,
                    sliding_window, sm_scale, output_scale, sinks, is_block_table_ptr, causal)


# --- self-check examples ---------------------------------------------------------------------------
def example_batch(query_lens, seq_lens, *, hq=8, hkv=2, dim=64, bs=16, dtype=torch.bfloat16, fp8=False, seed=0,
                  device="cpu"):
    """A ragged batch on `device` with its head-major caches written by reshape_and_cache_flash:
    (query, key, value, output, kv_cache_dtype, key_cache, value_cache, block_table, query_start_loc,
    seq_lens, max_seq_len, max_query_len, k_scale, v_scale). Blocks are a random permutation; the
    new tokens' K/V are in the cache too (the decode path reads them there). Data is drawn on
    `device` (seeded), so large batches build quickly on a GPU; on the CPU the writer's reference runs
    (bit-identical to the kernel, and not the interpreter's time)."""
    from ..library import cpu_implementation
    from .cache import reshape_and_cache_flash

    g = torch.Generator(device=device).manual_seed(seed)
    tokens, total = sum(query_lens), sum(seq_lens)
    blocks_per_req = [layout.cdiv(s, bs) for s in seq_lens]
    width = max(blocks_per_req + [1])
    nb = sum(blocks_per_req) + 2
    perm = torch.randperm(nb, generator=g, device=device)
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32, device=device)
    starts = [0]
    for n in blocks_per_req:
        starts.append(starts[-1] + n)
    cols = torch.arange(width, device=device)
    first = torch.tensor(starts[:-1], device=device)[:, None]
    count = torch.tensor(blocks_per_req, device=device)[:, None]
    table = torch.where(cols < count, perm[(first + cols).clamp(max=nb - 1)], table).int()
    cache_dtype = torch.uint8 if fp8 else dtype
    x = layout.head_major_x(cache_dtype)
    key_cache = torch.zeros(nb, hkv, dim // x, bs, x, dtype=cache_dtype, device=device)
    value_cache = torch.zeros(nb, hkv, dim, bs, dtype=cache_dtype, device=device)
    all_k = torch.randn(total, hkv, dim, generator=g, device=device).to(dtype)
    all_v = torch.randn(total, hkv, dim, generator=g, device=device).to(dtype)
    req = torch.repeat_interleave(torch.arange(len(seq_lens), device=device),
                                  torch.tensor(seq_lens, device=device), output_size=total)
    seq_start = torch.tensor([0] + list(seq_lens), device=device).cumsum(0)
    pos = torch.arange(total, device=device) - seq_start[req]
    slots = table[req, pos // bs].long() * bs + pos % bs
    kv_cache_dtype = "fp8" if fp8 else "auto"
    k_scale = torch.tensor([0.02], device=device)
    v_scale = torch.tensor([0.03], device=device)
    with cpu_implementation("reference"):
        reshape_and_cache_flash(all_k, all_v, key_cache, value_cache, slots, kv_cache_dtype, k_scale, v_scale)
    query = torch.randn(tokens, hq, dim, generator=g, device=device).to(dtype)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    is_new = pos >= (torch.tensor(seq_lens, device=device) - torch.tensor(query_lens, device=device))[req]
    key, value = all_k[is_new], all_v[is_new]
    output = torch.zeros_like(query)
    return (query, key, value, output, kv_cache_dtype, key_cache, value_cache, table,
            torch.tensor(qsl, dtype=torch.int32, device=device), torch.tensor(seq_lens, dtype=torch.int32,
                                                                             device=device),
            max(seq_lens + [0]), max(query_lens + [0]), k_scale, v_scale)


def _chunked_examples():
    """Two decodes and two prefills (one with a prefix), GQA 4:1, bs 16; bf16 and fp8 caches."""
    return {"bf16 GQA mixed": example_batch([1, 5, 1, 12], [40, 21, 17, 12]),
            "fp8 cache, window 16, sinks": example_batch([1, 9], [33, 30], fp8=True, seed=1)
            + (None, 16, None, None, torch.linspace(-1, 1, 8))}


def _context_examples():
    """A prefix-prefill batch (prefixes 0, 19 and 31 tokens), GQA 4:1, bs 16."""
    args = example_batch([4, 7, 3], [4, 26, 34], seed=2)
    return {"bf16 GQA prefix": args}


_CONTEXT_SCHEMA = (
    "context_attention_fwd(Tensor q, Tensor? k, Tensor? v, Tensor(a!) o, str kv_cache_dtype, Tensor k_cache, "
    "Tensor v_cache, Tensor b_loc, Tensor b_start_loc, Tensor b_seq_len, SymInt? max_seq_len, SymInt max_input_len, "
    "Tensor k_scale, Tensor v_scale, Tensor? alibi_slopes=None, int? sliding_window=None, float? sm_scale=None, "
    "bool skip_decode=False, Tensor? fp8_out_scale=None, Tensor? sinks=None, bool is_block_table_ptr=False, "
    "bool causal=True) -> ()")
_CHUNKED_SCHEMA = (
    "chunked_prefill_paged_decode(Tensor query, Tensor? key, Tensor? value, Tensor(a!) output, str kv_cache_dtype, "
    "Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor query_start_loc, Tensor seq_lens, "
    "SymInt? max_seq_len, SymInt max_query_len, Tensor k_scale, Tensor v_scale, Tensor? alibi_slopes=None, "
    "int? sliding_window=None, float? sm_scale=None, Tensor? output_scale=None, Tensor? sinks=None, "
    "bool is_block_table_ptr=False, bool causal=True) -> ()")

_context_op = register_op(_CONTEXT_SCHEMA, reference=_context_reference, kernel=_context_kernel, fake=_context_fake,
                          examples=_context_examples, approximate=True)
_chunked_op = register_op(_CHUNKED_SCHEMA, reference=_chunked_reference, kernel=_chunked_kernel, fake=_chunked_fake,
                          examples=_chunked_examples, approximate=True)


def _scale_tensor(name: str, scale, like: torch.Tensor) -> torch.Tensor:
    """A Python number scale (finite, > 0) as a 1-element fp32 tensor; tensors pass through."""
    if isinstance(scale, torch.Tensor):
        return scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} must be a 1-element float32 tensor or a finite Python float > 0, got {scale!r}")
    return torch.full((1,), float(scale), dtype=torch.float32, device=like.device)


def context_attention_fwd(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, max_seq_len,
                          max_input_len, k_scale, v_scale, alibi_slopes=None, sliding_window=None, sm_scale=None,
                          skip_decode=False, fp8_out_scale=None, sinks=None, is_block_table_ptr=False,
                          causal=True) -> None:
    """Prefix-prefill attention over a paged head-major KV cache plus the step's new K/V (SPEC §3.7).

    q: [T, Hq, D] fp16/bf16/fp32. k, v: [T, Hkv, D] (q's dtype), the new tokens' K/V, or both None to
    read every key from the cache. o: [T, Hq, D], q's dtype, or fp8 with `fp8_out_scale`.
    k_cache [num_blocks, Hkv, D//x, bs, x], v_cache [num_blocks, Hkv, D, bs] (any bs; fp8 per
    `kv_cache_dtype`, dequantised with k_scale / v_scale, 1-element fp32). b_loc: [R, W] int32/int64
    block ids (int64 byte addresses with `is_block_table_ptr`). b_start_loc: [R+1] int32 query starts;
    b_seq_len: [R] int32 context lengths including the new tokens. max_input_len: host int >= every
    query length. Options: alibi_slopes / sinks [Hq] fp32, sliding_window (None or <= 0: none),
    sm_scale (default D**-0.5), skip_decode (only requests of >= 2 query tokens), causal.
    Writes o's rows of the processed requests; returns None.
    """
    _context_op(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, max_seq_len,
                max_input_len, _scale_tensor("k_scale", k_scale, q), _scale_tensor("v_scale", v_scale, q), alibi_slopes,
                sliding_window, sm_scale, skip_decode, fp8_out_scale, sinks, is_block_table_ptr, causal)


def chunked_prefill_paged_decode(query, key, value, output, kv_cache_dtype, key_cache, value_cache, block_table,
                                 query_start_loc, seq_lens, max_seq_len, max_query_len, k_scale, v_scale,
                                 alibi_slopes=None, sliding_window=None, sm_scale=None, output_scale=None, sinks=None,
                                 is_block_table_ptr=False, causal=True) -> None:
    """Attention for a mixed step (SPEC §3.7): requests of >= 2 query tokens through the prefill path
    (when max_query_len > 1), requests of exactly 1 through the split-K decode path, which reads all
    seq_len keys from the cache (reshape_and_cache_flash must have written the new token); requests
    of 0 query tokens write nothing.

    Arguments as `context_attention_fwd` (query/key/value/output, block_table, query_start_loc
    [R+1] int32, seq_lens [R] int32, max_query_len host int, output_scale for an fp8 output).
    Writes output's rows of the processed requests; returns None.
    """
    _chunked_op(query, key, value, output, kv_cache_dtype, key_cache, value_cache, block_table, query_start_loc,
                seq_lens, max_seq_len, max_query_len, _scale_tensor("k_scale", k_scale, query),
                _scale_tensor("v_scale", v_scale, query), alibi_slopes, sliding_window, sm_scale, output_scale, sinks,
                is_block_table_ptr, causal)
