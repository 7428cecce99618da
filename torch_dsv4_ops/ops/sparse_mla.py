"""Sparse MLA attention (SPEC §2.1, §3.8): `dsv4::flash_mla_with_kvcache` (decode over fp8_ds_mla caches,
split across programs when there are few rows) and `dsv4::flash_mla_sparse_fwd` (prefill over a gathered
bf16 workspace), each with an `_out` form.

The Python entry points mirror FlashMLA's interface as vLLM calls it (names, argument order, defaults);
`out=`, `lse=`, `max_logits=`, `use_fnuz=`, `extra_use_fnuz=` and `workspace=` are trailing keywords.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from .. import layout, platform
from ..kernels import sparse_mla as kernels, sparse_mla_gluon
from ..library import register_op
from ..reference import sparse_mla as reference
from ._checks import check_bool, check_float, check_int32_extent, check_tensor
from ._plans import MISSING, ByAlignment, PlanCache, signature

CACHE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)
INDEX_DTYPES = (torch.int32,)


# --- validation (SPEC R3: dtypes, shapes, devices, ints; never contents) ----------------------------------
@dataclasses.dataclass(frozen=True)
class CacheInfo:
    num_blocks: int
    bs: int
    page_stride: int      # bytes


def check_ds_mla_cache(name: str, cache, device) -> CacheInfo:
    """An fp8_ds_mla cache of any accepted form: [nb, bs, 584], [nb, bs, 1, 584] or [nb, page_bytes]."""
    check_tensor(name, cache, ndim=(2, 3, 4), dtypes=CACHE_DTYPES, device=device)
    nb = cache.shape[0]
    if cache.dim() == 2:
        bs = layout.ds_mla_block_size_of_pages(cache.shape[1])
        if bs < 1:
            raise ValueError(f"{name} [num_blocks, page_bytes] has pages of {cache.shape[1]} bytes, less than one "
                             f"token ({layout.TOKEN_BYTES} bytes)")
        if cache.shape[1] > 1 and cache.stride(1) != 1:
            raise ValueError(f"{name} [num_blocks, page_bytes] must have stride(1) = 1, got {cache.stride()}")
    else:
        bs = cache.shape[1]
        if cache.dim() == 4 and cache.shape[2] != 1:
            raise ValueError(f"{name} [num_blocks, block_size, 1, {layout.TOKEN_BYTES}] must have shape[2] = 1, "
                             f"got shape {tuple(cache.shape)}")
        if cache.shape[-1] != layout.TOKEN_BYTES or bs < 1:
            raise ValueError(f"{name} must be [num_blocks, block_size >= 1, {layout.TOKEN_BYTES}] (or "
                             f"[num_blocks, block_size, 1, {layout.TOKEN_BYTES}] or [num_blocks, page_bytes]), got "
                             f"shape {tuple(cache.shape)}")
        if cache.stride(-1) != 1 or (bs > 1 and cache.stride(1) != layout.TOKEN_BYTES):
            raise ValueError(f"{name} must have stride(1) = {layout.TOKEN_BYTES} and a last stride of 1, got "
                             f"strides {cache.stride()}")
    page = layout.ds_mla_block_bytes(bs)
    stride = cache.stride(0) if nb > 1 else layout.round_up(page, layout.DS_MLA_CACHE_ALIGN)
    if stride < page:
        raise ValueError(f"{name}.stride(0) = {stride} bytes is smaller than a page of block_size {bs}: "
                         f"{bs}*{layout.TOKEN_BYTES} = {page}")
    if stride % layout.DS_MLA_CACHE_ALIGN:
        raise ValueError(f"{name}: the page stride ({stride} bytes) must be a multiple of {layout.DS_MLA_CACHE_ALIGN} "
                         f"bytes")
    return CacheInfo(nb, bs, stride)


def check_pointers(k_cache, extra_k_cache, workspace=None) -> None:
    """Data-pointer alignment of real tensors (the kernel and the reference check it; fakes have no data):
    caches at multiples of 8 bytes, the workspace at 16."""
    for name, t in (("k_cache", k_cache), ("extra_k_cache", extra_k_cache)):
        if t is not None and t.data_ptr() % layout.DS_MLA_CACHE_ALIGN:
            raise ValueError(f"{name}: the data pointer must be a multiple of {layout.DS_MLA_CACHE_ALIGN} bytes")
    if workspace is not None and workspace.data_ptr() % 16:
        raise ValueError("workspace must have a 16-byte aligned data pointer")


def _check_lengths(name: str, t, rows: int, device) -> None:
    if t is not None:
        check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES, device=device)
        if t.shape[0] != rows:
            raise ValueError(f"{name} must have shape ({rows},), got {tuple(t.shape)}")


def _check_sink(attn_sink, hq: int, device) -> None:
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, ndim=1, dtypes=(torch.float32,), device=device)
        if attn_sink.shape[0] != hq:
            raise ValueError(f"attn_sink must have shape ({hq},) (one logit per q head), got {tuple(attn_sink.shape)}")


@dataclasses.dataclass(frozen=True)
class Decode:
    """What validation derives from a decode call."""

    batch: int
    s_q: int
    hq: int
    main: CacheInfo
    extra: CacheInfo | None

    @property
    def rows(self) -> int:
        return self.batch * self.s_q


def check_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                 softmax_scale, use_fnuz, extra_use_fnuz) -> Decode:
    """Validate flash_mla_with_kvcache's op arguments."""
    check_tensor("q", q, ndim=4, dtypes=(torch.bfloat16,))
    device = q.device
    batch, s_q, hq, dim = q.shape
    if dim != layout.HEAD_DIM or q.stride(3) != 1:
        raise ValueError(f"q must be [B, s_q, Hq, {layout.HEAD_DIM}] with a contiguous last dim, got shape "
                         f"{tuple(q.shape)} and strides {q.stride()}")
    main = check_ds_mla_cache("k_cache", k_cache, device)
    check_tensor("indices", indices, ndim=3, dtypes=INDEX_DTYPES, device=device)
    if tuple(indices.shape[:2]) != (batch, s_q):
        raise ValueError(f"indices must be [B={batch}, s_q={s_q}, topk], got shape {tuple(indices.shape)}")
    check_int32_extent("indices", indices, 2)
    _check_lengths("topk_length", topk_length, batch, device)
    if (extra_k_cache is None) != (extra_indices is None):
        raise ValueError("extra_k_cache and extra_indices_in_kvcache must be given together")
    extra = None
    if extra_k_cache is not None:
        extra = check_ds_mla_cache("extra_k_cache", extra_k_cache, device)
        check_tensor("extra_indices_in_kvcache", extra_indices, ndim=3, dtypes=INDEX_DTYPES, device=device)
        if tuple(extra_indices.shape[:2]) != (batch, s_q):
            raise ValueError(f"extra_indices_in_kvcache must be [B={batch}, s_q={s_q}, K], got shape "
                             f"{tuple(extra_indices.shape)}")
        check_int32_extent("extra_indices_in_kvcache", extra_indices, 2)
        _check_lengths("extra_topk_length", extra_topk_length, batch, device)
    elif extra_topk_length is not None:
        raise ValueError("extra_topk_length is given without extra_k_cache")
    _check_sink(attn_sink, hq, device)
    check_float("softmax_scale", softmax_scale)
    check_bool("use_fnuz", use_fnuz)
    check_bool("extra_use_fnuz", extra_use_fnuz)
    return Decode(batch, s_q, hq, main, extra)


def check_decode_out(checked: Decode, q, out, lse, workspace, needed_bytes: int | None) -> None:
    """The output buffers of the _out form; `needed_bytes` of workspace, None: not checked (the reference and the
    fake, which do not plan)."""
    check_tensor("out", out, ndim=4, dtypes=(torch.bfloat16,), device=q.device)
    if tuple(out.shape) != tuple(q.shape) or out.stride(3) != 1:
        raise ValueError(f"out must be [B, s_q, Hq, {layout.HEAD_DIM}] = {tuple(q.shape)} with a contiguous last "
                         f"dim, got shape {tuple(out.shape)} and strides {out.stride()}")
    check_tensor("lse", lse, ndim=3, dtypes=(torch.float32,), device=q.device)
    if tuple(lse.shape) != (checked.batch, checked.hq, checked.s_q):
        raise ValueError(f"lse must be [B, Hq, s_q] = {(checked.batch, checked.hq, checked.s_q)}, got "
                         f"{tuple(lse.shape)}")
    check_tensor("workspace", workspace, device=q.device)
    if not workspace.is_contiguous():
        raise ValueError("workspace must be contiguous")
    if needed_bytes is None:
        return
    have = workspace.numel() * workspace.element_size()
    if have < needed_bytes or have % 4:
        raise ValueError(f"workspace holds {have} bytes; it needs a multiple of 4 bytes, at least {needed_bytes} "
                         f"(2 x sparse_mla_workspace_size(B={checked.batch}, s_q={checked.s_q}, Hq={checked.hq}))")


@dataclasses.dataclass(frozen=True)
class Prefill:
    tokens: int
    hq: int
    rows: int


def check_prefill(q, kv, indices, sm_scale, attn_sink, topk_length) -> Prefill:
    """Validate flash_mla_sparse_fwd's op arguments."""
    check_tensor("q", q, ndim=3, dtypes=(torch.bfloat16,))
    device = q.device
    tokens, hq, dim = q.shape
    if dim != layout.HEAD_DIM or q.stride(2) != 1:
        raise ValueError(f"q must be [Tq, Hq, {layout.HEAD_DIM}] with a contiguous last dim, got shape "
                         f"{tuple(q.shape)} and strides {q.stride()}")
    check_tensor("kv", kv, ndim=3, dtypes=(torch.bfloat16,), device=device)
    if kv.shape[1] != 1 or kv.shape[2] != layout.HEAD_DIM or kv.stride(2) != 1:
        raise ValueError(f"kv must be [Skv, 1, {layout.HEAD_DIM}] with a contiguous last dim, got shape "
                         f"{tuple(kv.shape)} and strides {kv.stride()}")
    check_tensor("indices", indices, ndim=3, dtypes=INDEX_DTYPES, device=device)
    if indices.shape[0] != tokens or indices.shape[1] != 1 or indices.shape[2] < 1:
        raise ValueError(f"indices must be [Tq={tokens}, 1, C >= 1], got shape {tuple(indices.shape)}")
    check_int32_extent("indices", indices, 2)
    _check_lengths("topk_length", topk_length, tokens, device)
    _check_sink(attn_sink, hq, device)
    check_float("sm_scale", sm_scale)
    return Prefill(tokens, hq, kv.shape[0])


def check_prefill_out(checked: Prefill, q, out, max_logits, lse) -> None:
    check_tensor("out", out, ndim=3, dtypes=(torch.bfloat16,), device=q.device)
    if tuple(out.shape) != tuple(q.shape) or out.stride(2) != 1:
        raise ValueError(f"out must be [Tq, Hq, {layout.HEAD_DIM}] = {tuple(q.shape)} with a contiguous last dim, "
                         f"got shape {tuple(out.shape)} and strides {out.stride()}")
    for name, t in (("max_logits", max_logits), ("lse", lse)):
        check_tensor(name, t, ndim=2, dtypes=(torch.float32,), device=q.device)
        if tuple(t.shape) != (checked.tokens, checked.hq):
            raise ValueError(f"{name} must be [Tq, Hq] = {(checked.tokens, checked.hq)}, got {tuple(t.shape)}")


# --- plans ---------------------------------------------------------------------------------------------------
class _Splits:
    forced: int | None = None
    programs: int | None = None      # the Gluon kernels' programs a head block (forced_programs)


SPLITS = _Splits()


@contextlib.contextmanager
def _overridden(name: str, value: int):
    """Inside, SPLITS.<name> is value."""
    previous = getattr(SPLITS, name)
    setattr(SPLITS, name, value)
    try:
        yield
    finally:
        setattr(SPLITS, name, previous)


def forced_splits(splits: int):
    """Inside, flash_mla_with_kvcache splits every row's selection into exactly `splits` parts (a test hook:
    every split count must give the unsplit result within tolerance)."""
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= kernels.MAX_SPLITS:
        raise ValueError(f"splits must be an int in [1, {kernels.MAX_SPLITS}], got {splits!r}")
    return _overridden("forced", splits)


def forced_programs(programs: int):
    """Inside, the sm_90 Gluon decode and prefill run at most `programs` persistent programs a head block, each
    looping over several work items or tokens (a test hook: on the test sizes every program would otherwise take
    one)."""
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"programs must be an int >= 1, got {programs!r}")
    return _overridden("programs", programs)


def _gluon_programs(items: int, hq: int, device) -> int:
    """The persistent programs a head block of a Gluon decode or prefill call runs (`forced_programs` caps them)."""
    programs = sparse_mla_gluon.persistent_programs(items, hq, kernels.device_multiprocessors(device))
    return programs if SPLITS.programs is None else min(programs, SPLITS.programs)


def sparse_mla_workspace_size(B: int, s_q: int, Hq: int, device) -> int:
    """bf16 elements of a workspace that serves every flash_mla_with_kvcache call of B x s_q rows and Hq heads
    on `device` (its split partials are fp32: the buffer may be of any dtype with at least 2x this many bytes)."""
    for name, v in (("B", B), ("s_q", s_q), ("Hq", Hq)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    device = torch.device(device)
    splits = kernels.max_splits(B * s_q, Hq, kernels.device_multiprocessors(device), platform.target_for(device))
    if SPLITS.forced is not None:
        splits = max(splits, SPLITS.forced)
    elements, _ = kernels.workspace_elements(B * s_q, Hq, splits)
    return 2 * elements


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    main: object           # a Launch, or None (no rows)
    combine: object        # a Launch when the call splits, else None
    workspace: int         # fp32 elements the call needs


_DECODE_PLANS = PlanCache()
_PREFILL_PLANS = PlanCache()


def _strides3(t) -> tuple:
    return t.stride(0), t.stride(1), t.stride(2)


def _decode_plan(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                 softmax_scale, use_fnuz, extra_use_fnuz, out, lse, workspace, forced) -> DecodePlan:
    checked = check_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
                           extra_topk_length, softmax_scale, use_fnuz, extra_use_fnuz)
    device = q.device
    target = platform.target_for(device)
    main, extra = checked.main, checked.extra
    width = indices.shape[2]
    x_width = extra_indices.shape[2] if extra is not None else 0
    small = kernels.small_decode(checked.rows)
    block_n = kernels.tiles(target, False, small)["BLOCK_N"]
    sms = kernels.device_multiprocessors(device)
    fnuz = (use_fnuz, extra is not None and extra_use_fnuz)
    gluon = sparse_mla_gluon.decode_planned(target, checked.hq, q.stride(), fnuz, checked.rows, width + x_width,
                                            forced)
    # the Triton kernel's split count, which the Gluon kernel takes too (the same partials and combine)
    splits = forced or kernels.decode_splits(checked.rows, checked.hq, width + x_width, block_n, sms, target)
    elements, ml_base = kernels.workspace_elements(checked.rows, checked.hq, splits)
    if splits == 1:
        elements = 0
    if workspace is not None:   # the helper's size, whatever this call's split count: one rule for every call
        needed = max(2 * sparse_mla_workspace_size(checked.batch, checked.s_q, checked.hq, device), 4 * elements)
        check_decode_out(checked, q, out, lse, workspace, needed)
    check_pointers(k_cache, extra_k_cache, workspace)
    if checked.rows == 0 or checked.hq == 0:
        return DecodePlan(None, None, 0)
    x_src = kernels.Source(extra.bs, extra_use_fnuz) if extra is not None else None
    meta = kernels.launch_options(kernels.constexprs(
        target, kernels.Source(main.bs, use_fnuz), x_src, topk_length is not None, extra_topk_length is not None,
        attn_sink is not None, splits > 1, checked.hq, False, small, width + x_width))
    xi = extra_indices if extra is not None else indices
    ints = (checked.s_q, checked.hq, float(softmax_scale), width, x_width, main.num_blocks * main.bs,
            extra.num_blocks * extra.bs if extra is not None else 0, main.page_stride,
            extra.page_stride if extra is not None else main.page_stride, ml_base,
            q.stride(0), q.stride(1), q.stride(2), *_strides3(indices), *_strides3(xi),
            topk_length.stride(0) if topk_length is not None else 0,
            extra_topk_length.stride(0) if extra_topk_length is not None else 0,
            out.stride(0), out.stride(1), out.stride(2), *_strides3(lse), 0, 0)
    dtypes = (torch.bfloat16, torch.uint8, torch.int32, torch.int32, torch.uint8, torch.int32, torch.int32,
              torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.float32)
    grid = (checked.rows, kernels.head_blocks(checked.hq, target, small), splits)
    launch = kernels.SPARSE_LAUNCHER.bind(grid, dtypes, ints, meta, device)
    if gluon:
        programs = _gluon_programs(checked.rows * splits, checked.hq, device)
        gluon_launch = sparse_mla_gluon.bind_decode(q, indices, extra_indices, topk_length, extra_topk_length,
                                                    attn_sink, out, lse, softmax_scale, main, extra, splits, ml_base,
                                                    programs)
        launch = ByAlignment(gluon_launch, launch, (0,), 16)
    if splits == 1:
        return DecodePlan(launch, None, 0)
    cmeta = kernels.launch_options(kernels.combine_constexprs(target, attn_sink is not None, splits))
    combine = kernels.COMBINE_LAUNCHER.bind(
        (checked.rows, checked.hq),
        (torch.float32, torch.bfloat16, torch.float32, torch.float32),
        (checked.s_q, checked.hq, splits, ml_base, out.stride(0), out.stride(1), out.stride(2), *_strides3(lse)),
        cmeta, device)
    return DecodePlan(launch, combine, elements)


def _decode_run(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                softmax_scale, use_fnuz, extra_use_fnuz, out, lse, workspace) -> None:
    """Plan (on a new signature: validation included) and launch. workspace None: the functional form,
    which allocates the split partials when the call splits."""
    forced = SPLITS.forced
    args = (q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
            softmax_scale, use_fnuz, extra_use_fnuz, out, lse, workspace)
    sig = signature("decode", args) + (
        forced, SPLITS.programs, k_cache.data_ptr() % layout.DS_MLA_CACHE_ALIGN,
        extra_k_cache.data_ptr() % layout.DS_MLA_CACHE_ALIGN if extra_k_cache is not None else None,
        workspace.data_ptr() % 16 if workspace is not None else None)
    plan = _DECODE_PLANS.get(sig, MISSING)
    if plan is MISSING:
        plan = _DECODE_PLANS.remember(sig, _decode_plan(*args, forced))
    if plan.main is None:
        return
    part = lse
    if plan.combine is not None:
        part = workspace if workspace is not None else q.new_empty((plan.workspace,), dtype=torch.float32)
    xc = extra_k_cache if extra_k_cache is not None else k_cache
    xi = extra_indices if extra_indices is not None else indices
    plan.main(q, k_cache, indices, topk_length if topk_length is not None else indices, xc, xi,
              extra_topk_length if extra_topk_length is not None else indices,
              attn_sink if attn_sink is not None else lse, out, lse, lse, part)
    if plan.combine is not None:
        plan.combine(attn_sink if attn_sink is not None else lse, out, lse, part)


def _decode_new(q, checked: Decode):
    out = q.new_empty(q.shape)
    lse = q.new_empty((checked.batch, checked.hq, checked.s_q), dtype=torch.float32)
    return out, lse


def _decode_kernel(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                   softmax_scale, use_fnuz=False, extra_use_fnuz=False):
    checked = check_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
                           extra_topk_length, softmax_scale, use_fnuz, extra_use_fnuz)
    out, lse = _decode_new(q, checked)
    _decode_run(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                softmax_scale, use_fnuz, extra_use_fnuz, out, lse, None)
    return out, lse


def _decode_reference(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                      softmax_scale, use_fnuz=False, extra_use_fnuz=False):
    check_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                 softmax_scale, use_fnuz, extra_use_fnuz)
    check_pointers(k_cache, extra_k_cache)
    return reference.flash_mla_with_kvcache(q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                                            extra_indices, extra_topk_length, softmax_scale, use_fnuz,
                                            extra_use_fnuz)


def _decode_fake(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                 softmax_scale, use_fnuz=False, extra_use_fnuz=False):
    checked = check_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
                           extra_topk_length, softmax_scale, use_fnuz, extra_use_fnuz)
    return _decode_new(q, checked)


def _decode_out_check(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                      softmax_scale, out, lse, workspace, use_fnuz, extra_use_fnuz):
    """Validation without a split plan (the reference and the fake): the workspace's size is not checked."""
    checked = check_decode(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
                           extra_topk_length, softmax_scale, use_fnuz, extra_use_fnuz)
    check_decode_out(checked, q, out, lse, workspace, None)


def _decode_out_kernel(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                       softmax_scale, out, lse, workspace, use_fnuz=False, extra_use_fnuz=False):
    _decode_run(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                softmax_scale, use_fnuz, extra_use_fnuz, out, lse, workspace)


def _decode_out_reference(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
                          extra_topk_length, softmax_scale, out, lse, workspace, use_fnuz=False,
                          extra_use_fnuz=False):
    _decode_out_check(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                      softmax_scale, out, lse, workspace, use_fnuz, extra_use_fnuz)
    check_pointers(k_cache, extra_k_cache, workspace)
    o, l_ = reference.flash_mla_with_kvcache(q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                                             extra_indices, extra_topk_length, softmax_scale, use_fnuz,
                                             extra_use_fnuz)
    out.copy_(o)
    lse.copy_(l_)


def _decode_out_fake(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                     softmax_scale, out, lse, workspace, use_fnuz=False, extra_use_fnuz=False):
    _decode_out_check(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                      softmax_scale, out, lse, workspace, use_fnuz, extra_use_fnuz)


def _prefill_plan(q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse):
    checked = check_prefill(q, kv, indices, sm_scale, attn_sink, topk_length)
    check_prefill_out(checked, q, out, max_logits, lse)
    if checked.tokens == 0 or checked.hq == 0:
        return None
    target = platform.target_for(q.device)
    meta = kernels.launch_options(kernels.constexprs(target, kernels.Source(), None, topk_length is not None, False,
                                                     attn_sink is not None, False, checked.hq, True))
    width = indices.shape[2]
    ints = (1, checked.hq, float(sm_scale), width, 0, checked.rows, 0, kv.stride(0), kv.stride(0), 0,
            q.stride(0), 0, q.stride(1), *_strides3(indices), *_strides3(indices),
            topk_length.stride(0) if topk_length is not None else 0, 0,
            out.stride(0), 0, out.stride(1), lse.stride(0), lse.stride(1), 0, max_logits.stride(0),
            max_logits.stride(1))
    dtypes = (torch.bfloat16,) * 2 + (torch.int32,) * 2 + (torch.bfloat16,) + (torch.int32,) * 2 \
        + (torch.float32, torch.bfloat16) + (torch.float32,) * 3
    grid = (checked.tokens, kernels.head_blocks(checked.hq, target), 1)
    launch = kernels.SPARSE_LAUNCHER.bind(grid, dtypes, ints, meta, q.device)
    if sparse_mla_gluon.prefill_planned(target, checked.hq, q.stride(), kv.stride(0)):
        programs = _gluon_programs(checked.tokens, checked.hq, q.device)
        gluon_launch = sparse_mla_gluon.bind_prefill(q, kv, indices, sm_scale, topk_length, attn_sink, out,
                                                     max_logits, lse, programs)
        return ByAlignment(gluon_launch, launch, (0, 1), 16)
    return launch


def _prefill_run(q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse) -> None:
    args = (q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse)
    sig = signature("prefill", args) + (SPLITS.programs,)
    launch = _PREFILL_PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _PREFILL_PLANS.remember(sig, _prefill_plan(*args))
    if launch is not None:
        lens = topk_length if topk_length is not None else indices
        launch(q, kv, indices, lens, kv, indices, lens, attn_sink if attn_sink is not None else lse, out, lse,
               max_logits, lse)


def _prefill_new(q, checked: Prefill):
    out = q.new_empty(q.shape)
    max_logits = q.new_empty((checked.tokens, checked.hq), dtype=torch.float32)
    lse = q.new_empty((checked.tokens, checked.hq), dtype=torch.float32)
    return out, max_logits, lse


def _prefill_kernel(q, kv, indices, sm_scale, attn_sink=None, topk_length=None):
    checked = check_prefill(q, kv, indices, sm_scale, attn_sink, topk_length)
    out, max_logits, lse = _prefill_new(q, checked)
    _prefill_run(q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse)
    return out, max_logits, lse


def _prefill_reference(q, kv, indices, sm_scale, attn_sink=None, topk_length=None):
    check_prefill(q, kv, indices, sm_scale, attn_sink, topk_length)
    return reference.flash_mla_sparse_fwd(q, kv, indices, sm_scale, attn_sink, topk_length)


def _prefill_fake(q, kv, indices, sm_scale, attn_sink=None, topk_length=None):
    return _prefill_new(q, check_prefill(q, kv, indices, sm_scale, attn_sink, topk_length))


def _prefill_out_kernel(q, kv, indices, sm_scale, out, max_logits, lse, attn_sink=None, topk_length=None):
    _prefill_run(q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse)


def _prefill_out_reference(q, kv, indices, sm_scale, out, max_logits, lse, attn_sink=None, topk_length=None):
    check_prefill_out(check_prefill(q, kv, indices, sm_scale, attn_sink, topk_length), q, out, max_logits, lse)
    o, m, l_ = reference.flash_mla_sparse_fwd(q, kv, indices, sm_scale, attn_sink, topk_length)
    out.copy_(o)
    max_logits.copy_(m)
    lse.copy_(l_)


def _prefill_out_fake(q, kv, indices, sm_scale, out, max_logits, lse, attn_sink=None, topk_length=None):
    check_prefill_out(check_prefill(q, kv, indices, sm_scale, attn_sink, topk_length), q, out, max_logits, lse)


# --- self-check examples ---------------------------------------------------------------------------------------
def example_caches(num_blocks: int, block_size: int, *, seed: int = 0, fnuz: bool = False, device="cpu"):
    """A padded fp8_ds_mla cache [num_blocks, bs, 584] view (engine page stride) whose every slot holds a
    random bf16 row written by quantize_and_insert_k_cache (scaled so some blocks are large, some small).
    On the CPU the writer's reference runs (bit-identical to the kernel, and not the interpreter's minutes)."""
    from ..library import cpu_implementation
    from .k_cache import quantize_and_insert_k_cache

    g = torch.Generator(device=device).manual_seed(seed)
    stride = layout.ds_mla_block_stride(block_size)
    pages_ = torch.zeros(num_blocks, stride, dtype=torch.uint8, device=device)
    cache = pages_[:, :layout.ds_mla_block_bytes(block_size)].view(num_blocks, block_size, layout.TOKEN_BYTES)
    n = num_blocks * block_size
    rows = torch.randn(n, layout.HEAD_DIM, generator=g, device=device)
    rows *= torch.exp2(torch.randint(-3, 4, (n, 1), generator=g, device=device).float())
    with cpu_implementation("reference"):
        quantize_and_insert_k_cache(rows.to(torch.bfloat16), cache, torch.arange(n, device=device), block_size,
                                    True, fnuz)
    return cache


def decode_example(batch: int, hq: int, topk: int, *, extra_topk: int = 0, s_q: int = 1, seed: int = 0,
                   device="cpu", nb: int = 8, x_nb: int = 8, x_bs: int = 64, sinks: bool = True):
    """Arguments of dsv4::flash_mla_with_kvcache: (q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
    extra_indices, extra_topk_length, softmax_scale, use_fnuz, extra_use_fnuz); random valid slots with some
    -1 entries, per-request lengths, q of unit scale."""
    g = torch.Generator(device=device).manual_seed(seed)
    cache = example_caches(nb, 64, seed=seed, device=device)
    q = torch.randn(batch, s_q, hq, layout.HEAD_DIM, generator=g, device=device).to(torch.bfloat16)

    def pick(rows, width):
        idx = torch.randint(0, rows, (batch, s_q, width), generator=g, device=device, dtype=torch.int32)
        idx[..., ::7] = -1
        lens = torch.randint(0, width + 1, (batch,), generator=g, device=device, dtype=torch.int32)
        return idx, lens

    idx, lens = pick(nb * 64, topk)
    sink = torch.randn(hq, generator=g, device=device) if sinks else None
    if not extra_topk:
        return (q, cache, idx, lens, sink, None, None, None, layout.MLA_SOFTMAX_SCALE, False, False)
    x_cache = example_caches(x_nb, x_bs, seed=seed + 1, device=device)
    x_idx, x_lens = pick(x_nb * x_bs, extra_topk)
    return (q, cache, idx, lens, sink, x_cache, x_idx, x_lens, layout.MLA_SOFTMAX_SCALE, False, False)


def prefill_example(tokens: int, hq: int, rows: int, width: int, *, seed: int = 0, device="cpu"):
    """Arguments of dsv4::flash_mla_sparse_fwd: (q, kv, indices, sm_scale, attn_sink, topk_length)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(tokens, hq, layout.HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
    kv = torch.randn(rows, 1, layout.HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
    idx = torch.randint(0, rows, (tokens, 1, width), generator=g, device=device, dtype=torch.int32)
    idx[..., ::5] = -1
    lens = torch.randint(0, width + 1, (tokens,), generator=g, device=device, dtype=torch.int32)
    return (q, kv, idx, layout.MLA_SOFTMAX_SCALE, torch.randn(hq, generator=g, device=device), lens)


def _decode_examples():
    return {"C4A: SWA 32 + extra top-k 48, 16 heads, B 3": decode_example(3, 16, 32, extra_topk=48),
            "SWA-only, 64 heads, s_q 2": decode_example(2, 64, 40, s_q=2, seed=1, sinks=False)}


def _decode_out_examples():
    args = decode_example(2, 16, 24, extra_topk=20, seed=2)
    q = args[0]
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    # CPU tensors the self-check moves to the best device: room for the most splits any device plans
    elements, _ = kernels.workspace_elements(q.shape[0] * q.shape[1], q.shape[2], kernels.MAX_SPLITS)
    ws = torch.empty(2 * elements, dtype=torch.bfloat16)
    return {"C4A into out buffers": args[:9] + (out, lse, ws) + args[9:]}


def _prefill_examples():
    return {"24 tokens, 16 heads, 60 rows, top 40": prefill_example(24, 16, 60, 40)}


def _prefill_out_examples():
    q, kv, idx, scale, sink, lens = prefill_example(10, 16, 50, 33, seed=3)
    return {"into out buffers": (q, kv, idx, scale, torch.zeros_like(q), torch.zeros(10, 16), torch.zeros(10, 16),
                                 sink, lens)}


_DECODE_ARGS = ("Tensor q, Tensor k_cache, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
                "Tensor? extra_k_cache, Tensor? extra_indices, Tensor? extra_topk_length, float softmax_scale")
_decode_op = register_op(
    f"flash_mla_with_kvcache({_DECODE_ARGS}, bool use_fnuz=False, bool extra_use_fnuz=False) -> (Tensor, Tensor)",
    reference=_decode_reference, kernel=_decode_kernel, fake=_decode_fake, examples=_decode_examples,
    approximate=True)
_decode_out_op = register_op(
    f"flash_mla_with_kvcache_out({_DECODE_ARGS}, Tensor(a!) out, Tensor(b!) lse, Tensor(c!) workspace, "
    "bool use_fnuz=False, bool extra_use_fnuz=False) -> ()",
    reference=_decode_out_reference, kernel=_decode_out_kernel, fake=_decode_out_fake,
    examples=_decode_out_examples, approximate=True, scratch=("workspace",))
_prefill_op = register_op(
    "flash_mla_sparse_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, Tensor? attn_sink=None, "
    "Tensor? topk_length=None) -> (Tensor, Tensor, Tensor)",
    reference=_prefill_reference, kernel=_prefill_kernel, fake=_prefill_fake, examples=_prefill_examples,
    approximate=True)
_prefill_out_op = register_op(
    "flash_mla_sparse_fwd_out(Tensor q, Tensor kv, Tensor indices, float sm_scale, Tensor(a!) out, "
    "Tensor(b!) max_logits, Tensor(c!) lse, Tensor? attn_sink=None, Tensor? topk_length=None) -> ()",
    reference=_prefill_out_reference, kernel=_prefill_out_kernel, fake=_prefill_out_fake,
    examples=_prefill_out_examples, approximate=True)


# --- public API -------------------------------------------------------------------------------------------------
def get_mla_metadata(*args, **kwargs):
    """FlashMLA's scheduler metadata, kept so callers written for FlashMLA work: returns a placeholder
    (tile_scheduler_metadata, num_splits) pair of empty int32 tensors, on the device of the first tensor
    argument (CPU if none). flash_mla_with_kvcache ignores both: its split plan depends only on shapes."""
    device = next((a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)),
                  torch.device("cpu"))
    return torch.empty(0, dtype=torch.int32, device=device), torch.empty(0, dtype=torch.int32, device=device)


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                           attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None, *, out=None, lse=None, use_fnuz=False, extra_use_fnuz=None,
                           workspace=None):
    """Sparse decode attention over fp8_ds_mla caches (SPEC §3.8): each query row attends to the rows its
    indices select, dequantised from the paged caches inside the kernel.

    q: [B, s_q, Hq, 512] bf16 (last dim contiguous). k_cache: fp8_ds_mla cache, uint8/int8/float8_e4m3fn,
    [nb, bs, 584], [nb, bs, 1, 584] or [nb, page_bytes]. indices: [B, s_q, W] int32 global slots
    (block*bs + offset); topk_length [B] int32 or None (= W). extra_k_cache / extra_indices_in_kvcache
    [B, s_q, K] / extra_topk_length: an optional second cache with its own block size and page stride.
    attn_sink: [Hq] fp32 or None. softmax_scale: default 512**-0.5. use_fnuz / extra_use_fnuz: each cache's
    fp8 flavour (extra None = same as main). block_table, cache_seqlens, tile_scheduler_metadata and
    num_splits are ignored. Entries past a length, negative or past their cache select nothing.
    Returns (out [B, s_q, Hq, 512] bf16, lse [B, Hq, s_q] fp32); with `out` (and `lse`, `workspace`: see
    sparse_mla_workspace_size) given, writes them and allocates nothing.
    """
    if head_dim_v != layout.HEAD_DIM:
        raise ValueError(f"head_dim_v must be {layout.HEAD_DIM}, got {head_dim_v!r}")
    if indices is None:
        raise NotImplementedError("flash_mla_with_kvcache: dense decode (indices=None) is not supported; pass the "
                                  "sparse indices")
    if not is_fp8_kvcache:
        raise ValueError("is_fp8_kvcache must be True with indices (the sparse path reads fp8_ds_mla caches)")
    if causal:
        raise ValueError("causal must be False with indices (the indices define what each row sees)")
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        raise ValueError("extra_k_cache and extra_indices_in_kvcache must be given together")
    scale = layout.MLA_SOFTMAX_SCALE if softmax_scale is None else softmax_scale
    x_fnuz = use_fnuz if extra_use_fnuz is None else extra_use_fnuz
    if out is None and lse is None and workspace is None:
        return _decode_op(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                          extra_topk_length, scale, use_fnuz, x_fnuz)
    if out is None:
        out = q.new_empty(q.shape)
    if lse is None:
        lse = q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32).transpose(1, 2)
    if workspace is None:
        workspace = q.new_empty((sparse_mla_workspace_size(q.shape[0], q.shape[1], q.shape[2], q.device),),
                                dtype=torch.bfloat16)
    _decode_out_op(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                   extra_topk_length, scale, out, lse, workspace, use_fnuz, x_fnuz)
    return out, lse


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, *, out=None,
                         max_logits=None, lse=None):
    """Sparse prefill attention over a gathered bf16 workspace (SPEC §3.8).

    q: [Tq, Hq, 512] bf16; kv: [Skv, 1, 512] bf16 (last dim contiguous); indices: [Tq, 1, C] int32 rows of
    kv; topk_length: [Tq] int32 or None (= C); attn_sink: [Hq] fp32 or None; d_v must be 512. Entries past
    the length, negative or >= Skv select nothing. Returns (out [Tq, Hq, 512] bf16, max_logits [Tq, Hq]
    fp32, lse [Tq, Hq] fp32); buffers given as out / max_logits / lse are written and returned.
    """
    if d_v != layout.HEAD_DIM:
        raise ValueError(f"d_v must be {layout.HEAD_DIM}, got {d_v!r}")
    if out is None and max_logits is None and lse is None:
        return _prefill_op(q, kv, indices, sm_scale, attn_sink, topk_length)
    shape = (q.shape[0], q.shape[1])
    out = q.new_empty(q.shape) if out is None else out
    max_logits = q.new_empty(shape, dtype=torch.float32) if max_logits is None else max_logits
    lse = q.new_empty(shape, dtype=torch.float32) if lse is None else lse
    _prefill_out_op(q, kv, indices, sm_scale, out, max_logits, lse, attn_sink, topk_length)
    return out, max_logits, lse
