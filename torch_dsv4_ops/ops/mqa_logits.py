"""Indexer logits (SPEC §3.9): `dsv4::fp8_fp4_mqa_logits` (prefill), `dsv4::fp8_fp4_paged_mqa_logits` (decode
over the paged indexer cache) and `dsv4::get_paged_mqa_logits_metadata`, each with an `_out` form.

The Python entry points mirror DeepGEMM's interface as vLLM wraps it (names, argument order, defaults): q and kv
are tuples `(q_fp8, None)` / `(k_fp8, k_scale)`; `out=` and `use_fnuz=` are this package's trailing keywords.
fp8 operands arrive as float8_e4m3fn / float8_e4m3fnuz tensors (their dtype wins) or as uint8 views, which are
read as OCP e4m3 unless `use_fnuz=True` (the indexer cache's rule, SPEC "Points settled").
"""
from __future__ import annotations

import dataclasses

import torch

from .. import layout, platform
from ..kernels import mqa_logits as kernels, mqa_logits_gluon
from ..kernels.attention import device_multiprocessors
from ..library import register_op
from ..reference import mqa_logits as reference
from ._checks import check_bool, check_tensor
from ._plans import MISSING, ByAlignment, PlanCache, signature
from .indexer import SCALE_ALIGN, check_cache_pointer, check_indexer_cache

FP8_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e4m3fnuz)
TABLE_DTYPES = (torch.int32, torch.int64)


# --- validation (SPEC R3: dtypes, shapes, devices, ints; never contents) ------------------------------------------
def fp8_operand_format(name: str, t: torch.Tensor, use_fnuz: bool) -> layout.Fp8Format:
    """The e4m3 flavour of an fp8 operand: a float8 tensor's own, else OCP (FNUZ with use_fnuz)."""
    if t.dtype == torch.uint8:
        return layout.E4M3FNUZ if use_fnuz else layout.E4M3FN
    return layout.FP8_BY_DTYPE[t.dtype]


def _check_last_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


@dataclasses.dataclass(frozen=True)
class Prefill:
    m: int
    n: int
    heads: int
    dim: int
    q_fmt: layout.Fp8Format
    k_fmt: layout.Fp8Format


def check_prefill(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, use_fnuz) -> Prefill:
    """Validate fp8_fp4_mqa_logits' op arguments."""
    check_tensor("q", q, ndim=3, dtypes=FP8_DTYPES)
    device = q.device
    m, heads, dim = q.shape
    if heads < 1:
        raise ValueError(f"q must have H >= 1 heads, got shape {tuple(q.shape)}")
    if dim not in kernels.PREFILL_DIMS:
        raise NotImplementedError(f"q: head dim {dim} is not supported (D must be one of {kernels.PREFILL_DIMS})")
    _check_last_contiguous("q", q)
    check_tensor("k", k, ndim=2, dtypes=FP8_DTYPES, device=device)
    if k.shape[1] != dim:
        raise ValueError(f"k must be [N, {dim}] (q's head dim), got shape {tuple(k.shape)}")
    _check_last_contiguous("k", k)
    n = k.shape[0]
    check_tensor("k_scale", k_scale, ndim=(1, 2), dtypes=(torch.float32,), device=device)
    if k_scale.shape[0] != n or (k_scale.dim() == 2 and k_scale.shape[1] != 1):
        raise ValueError(f"k_scale must be [N] or [N, 1] with N = {n}, got shape {tuple(k_scale.shape)}")
    check_tensor("weights", weights, ndim=2, dtypes=(torch.float32,), device=device)
    if tuple(weights.shape) != (m, heads):
        raise ValueError(f"weights must have shape {(m, heads)} ([M, H]), got {tuple(weights.shape)}")
    for name, t in (("cu_seqlen_ks", cu_seqlen_ks), ("cu_seqlen_ke", cu_seqlen_ke)):
        check_tensor(name, t, ndim=1, dtypes=(torch.int32,), device=device)
        if t.shape[0] != m:
            raise ValueError(f"{name} must have shape ({m},) (one entry per query), got {tuple(t.shape)}")
    check_bool("clean_logits", clean_logits)
    check_bool("use_fnuz", use_fnuz)
    return Prefill(m, n, heads, dim, fp8_operand_format("q", q, use_fnuz), fp8_operand_format("k", k, use_fnuz))


def _check_out(out, rows: int, cols: int, device) -> None:
    check_tensor("out", out, ndim=2, dtypes=(torch.float32,), device=device)
    if tuple(out.shape) != (rows, cols):
        raise ValueError(f"out must have shape {(rows, cols)}, got {tuple(out.shape)}")
    _check_last_contiguous("out", out)


@dataclasses.dataclass(frozen=True)
class Paged:
    batch: int
    next_n: int
    heads: int
    num_blocks: int
    block_size: int
    page_stride: int
    q_fmt: layout.Fp8Format
    k_fmt: layout.Fp8Format

    @property
    def rows(self) -> int:
        return self.batch * self.next_n


def check_paged(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, use_fnuz) -> Paged:
    """Validate fp8_fp4_paged_mqa_logits' op arguments."""
    check_tensor("q", q, ndim=4, dtypes=FP8_DTYPES)
    device = q.device
    batch, next_n, heads, dim = q.shape
    if next_n < 1 or heads < 1:
        raise ValueError(f"q must be [B, next_n >= 1, H >= 1, {layout.INDEXER_DIM}], got shape {tuple(q.shape)}")
    if dim != layout.INDEXER_DIM:
        raise ValueError(f"q must have head dim {layout.INDEXER_DIM} (the indexer cache's), got shape "
                         f"{tuple(q.shape)}")
    _check_last_contiguous("q", q)
    nb, bs, stride = check_indexer_cache("kv_cache", kv_cache, device)
    check_tensor("weights", weights, ndim=2, dtypes=(torch.float32,), device=device)
    if tuple(weights.shape) != (batch * next_n, heads):
        raise ValueError(f"weights must have shape {(batch * next_n, heads)} ([B*next_n, H]), got "
                         f"{tuple(weights.shape)}")
    check_tensor("context_lens", context_lens, ndim=(1, 2), dtypes=(torch.int32,), device=device)
    if context_lens.shape[0] != batch or (context_lens.dim() == 2 and context_lens.shape[1] != next_n):
        raise ValueError(f"context_lens must be [B, next_n] = {(batch, next_n)} or [B] = ({batch},), got shape "
                         f"{tuple(context_lens.shape)}")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=TABLE_DTYPES, device=device)
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, (int, torch.SymInt)) or \
            (isinstance(max_model_len, int) and max_model_len < 0):
        raise ValueError(f"max_model_len must be an int >= 0, got {max_model_len!r}")
    check_bool("clean_logits", clean_logits)
    check_bool("use_fnuz", use_fnuz)
    return Paged(batch, next_n, heads, nb, bs, stride, fp8_operand_format("q", q, use_fnuz),
                 fp8_operand_format("kv_cache", kv_cache, use_fnuz))


def check_metadata(context_lens, block_size, num_sms, out=None) -> None:
    """Validate get_paged_mqa_logits_metadata's op arguments (and its out buffer)."""
    check_tensor("context_lens", context_lens, ndim=(1, 2), dtypes=(torch.int32,))
    for name, value in (("block_size", block_size), ("num_sms", num_sms)):
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or \
                (isinstance(value, int) and value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(torch.int32,), device=context_lens.device)
        if tuple(out.shape) != (num_sms + 1, 2):
            raise ValueError(f"out must have shape {(num_sms + 1, 2)} ([num_sms + 1, 2]), got {tuple(out.shape)}")


# --- prefill --------------------------------------------------------------------------------------------------------
_PREFILL_PLANS = PlanCache()
_PAGED_PLANS = PlanCache()
_FILL_PLANS = PlanCache()


def _prefill_plan(q, k, k_scale, weights, ks, ke, clean_logits, out, use_fnuz):
    checked = check_prefill(q, k, k_scale, weights, ks, ke, clean_logits, use_fnuz)
    _check_out(out, checked.m, checked.n, q.device)
    if checked.m == 0 or checked.n == 0:
        return None
    target = platform.target_for(q.device)
    meta = kernels.launch_options(kernels.prefill_constexprs(target, checked.dim, checked.heads, checked.q_fmt,
                                                             checked.k_fmt, clean_logits))
    ints = kernels.prefill_runtime_args(checked.m, checked.n, checked.heads, q.stride(), k.stride(0),
                                        k_scale.stride(0), weights.stride(), ks.stride(0), ke.stride(0),
                                        out.stride(0))
    grid = (layout.cdiv(checked.m, kernels.prefill_queries(checked.heads, target)),)
    dtypes = (torch.uint8, torch.uint8, torch.float32, torch.float32, torch.int32, torch.int32, torch.float32)
    launch = kernels.PREFILL_LAUNCHER.bind(grid, dtypes, ints, meta, q.device)
    if mqa_logits_gluon.prefill_planned(target, checked.heads, checked.dim, k.stride(0), checked.q_fmt,
                                        checked.k_fmt):
        return ByAlignment(mqa_logits_gluon.bind_prefill(q, k, k_scale, weights, ks, ke, out, clean_logits), launch,
                           (1,), 4)
    return launch


def _prefill_run(q, k, k_scale, weights, ks, ke, clean_logits, out, use_fnuz) -> None:
    args = (q, k, k_scale, weights, ks, ke, clean_logits, out, use_fnuz)
    sig = signature("prefill", args)
    launch = _PREFILL_PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _PREFILL_PLANS.remember(sig, _prefill_plan(*args))
    if launch is not None:
        launch(q, k, k_scale, weights, ks, ke, out)


def _prefill_new(q, checked: Prefill):
    return q.new_empty((checked.m, checked.n), dtype=torch.float32)


def _prefill_kernel(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, use_fnuz=False):
    checked = check_prefill(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, use_fnuz)
    out = _prefill_new(q, checked)
    _prefill_run(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, out, use_fnuz)
    return out


def _prefill_reference(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, use_fnuz=False):
    c = check_prefill(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, use_fnuz)
    return reference.fp8_fp4_mqa_logits(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, c.q_fmt, c.k_fmt)


def _prefill_fake(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, use_fnuz=False):
    return _prefill_new(q, check_prefill(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, use_fnuz))


def _prefill_out_kernel(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, out, use_fnuz=False):
    _prefill_run(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, out, use_fnuz)


def _prefill_out_reference(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, out, use_fnuz=False):
    c = check_prefill(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, use_fnuz)
    _check_out(out, c.m, c.n, q.device)
    reference.fp8_fp4_mqa_logits(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, c.q_fmt, c.k_fmt, out)


def _prefill_out_fake(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, out, use_fnuz=False):
    c = check_prefill(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, use_fnuz)
    _check_out(out, c.m, c.n, q.device)


# --- paged decode ----------------------------------------------------------------------------------------------------
def _paged_plan(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, out, use_fnuz):
    checked = check_paged(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, use_fnuz)
    _check_out(out, checked.rows, max_model_len, q.device)
    check_cache_pointer("kv_cache", kv_cache)
    if checked.rows == 0 or max_model_len == 0:
        return None
    target = platform.target_for(q.device)
    if checked.page_stride % 4 == 0 and mqa_logits_gluon.planned(target, checked.heads, checked.next_n,
                                                                 checked.block_size, q, weights, checked.q_fmt,
                                                                 checked.k_fmt):
        return mqa_logits_gluon.bind(q, context_lens, block_tables, out, checked.num_blocks, checked.page_stride,
                                     max_model_len, clean_logits, device_multiprocessors(q.device))
    lens_2d = context_lens.dim() == 2
    meta = kernels.launch_options(kernels.paged_constexprs(target, checked.next_n, checked.heads, checked.block_size,
                                                           checked.q_fmt, checked.k_fmt, lens_2d, clean_logits))
    splits, per = kernels.paged_splits(checked.batch, max_model_len, target,
                                       device_multiprocessors(q.device))
    c_strides = context_lens.stride() if lens_2d else (context_lens.stride(0), 0)
    ints = kernels.paged_runtime_args(max_model_len, checked.heads, checked.num_blocks, checked.page_stride,
                                      block_tables.shape[1], block_tables.shape[0], per, q.stride(), weights.stride(),
                                      c_strides, block_tables.stride(), out.stride(0))
    dtypes = (torch.uint8, torch.uint8, torch.float32, torch.int32, block_tables.dtype, torch.float32)
    return kernels.PAGED_LAUNCHER.bind((checked.batch, splits), dtypes, ints, meta, q.device)


def _paged_run(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, out, use_fnuz):
    args = (q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, out, use_fnuz)
    sig = signature("paged", args) + (kv_cache.data_ptr() % SCALE_ALIGN,)
    launch = _PAGED_PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _PAGED_PLANS.remember(sig, _paged_plan(*args))
    if launch is not None:
        launch(q, kv_cache, weights, context_lens, block_tables, out)


def _paged_new(q, checked: Paged, max_model_len):
    return q.new_empty((checked.rows, max_model_len), dtype=torch.float32)


def _paged_kernel(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, use_fnuz=False):
    checked = check_paged(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, use_fnuz)
    out = _paged_new(q, checked, max_model_len)
    _paged_run(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, out, use_fnuz)
    return out


def _paged_reference(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, use_fnuz=False):
    c = check_paged(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, use_fnuz)
    check_cache_pointer("kv_cache", kv_cache)
    return reference.fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, max_model_len,
                                              c.q_fmt, c.k_fmt)


def _paged_fake(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, use_fnuz=False):
    checked = check_paged(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, use_fnuz)
    return _paged_new(q, checked, max_model_len)


def _paged_out_kernel(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, out,
                      use_fnuz=False):
    _paged_run(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, out, use_fnuz)


def _paged_out_reference(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, out,
                         use_fnuz=False):
    c = check_paged(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, use_fnuz)
    _check_out(out, c.rows, max_model_len, q.device)
    check_cache_pointer("kv_cache", kv_cache)
    reference.fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, max_model_len, c.q_fmt,
                                       c.k_fmt, out)


def _paged_out_fake(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, out,
                    use_fnuz=False):
    c = check_paged(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, use_fnuz)
    _check_out(out, c.rows, max_model_len, q.device)


# --- schedule metadata (a zero tensor: the paged kernel plans from shapes) --------------------------------------------
def _fill_plan(out):
    rows = out.shape[0]
    target = platform.target_for(out.device)
    meta = kernels.launch_options(kernels.fill_constexprs(target))
    return kernels.FILL_LAUNCHER.bind((layout.cdiv(rows * 2, kernels.FILL_BLOCK),), (torch.int32,),
                                      (rows, out.stride(0), out.stride(1)), meta, out.device)


def _fill_run(out) -> None:
    sig = signature("fill", (out,))
    launch = _FILL_PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _FILL_PLANS.remember(sig, _fill_plan(out))
    launch(out)


def _metadata_kernel(context_lens, block_size, num_sms):
    check_metadata(context_lens, block_size, num_sms)
    out = context_lens.new_empty((num_sms + 1, 2))
    _fill_run(out)
    return out


def _metadata_reference(context_lens, block_size, num_sms):
    check_metadata(context_lens, block_size, num_sms)
    return torch.zeros(num_sms + 1, 2, dtype=torch.int32, device=context_lens.device)


def _metadata_fake(context_lens, block_size, num_sms):
    check_metadata(context_lens, block_size, num_sms)
    return context_lens.new_empty((num_sms + 1, 2))


def _metadata_out_kernel(context_lens, block_size, num_sms, out):
    check_metadata(context_lens, block_size, num_sms, out)
    _fill_run(out)


def _metadata_out_reference(context_lens, block_size, num_sms, out):
    check_metadata(context_lens, block_size, num_sms, out)
    out.zero_()


def _metadata_out_fake(context_lens, block_size, num_sms, out):
    check_metadata(context_lens, block_size, num_sms, out)


# --- self-check examples ----------------------------------------------------------------------------------------------
def random_fp8(shape, generator, fmt: layout.Fp8Format = layout.E4M3FN, spread: int = 4) -> torch.Tensor:
    """uint8 codes of N(0, 1) values times 2**U[-spread, spread] (clamped to the format's range)."""
    x = torch.randn(shape, generator=generator)
    x = x * torch.exp2(torch.randint(-spread, spread + 1, shape, generator=generator).float())
    return x.clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8)


def prefill_example(m: int, n: int, heads: int, dim: int = 128, *, seed: int = 0, causal: bool = True):
    """(q, k, k_scale, weights, ks, ke, clean_logits) of one prefill call: random fp8 q/k, power-of-two key
    scales, weights ~ N(0, 1)/8; causal ranges of two requests (ks = request start, ke = n - m + i + 1) with
    some empty and past-N rows, or random ranges."""
    g = torch.Generator().manual_seed(seed)
    q = random_fp8((m, heads, dim), g)
    k = random_fp8((n, dim), g)
    k_scale = torch.exp2(torch.randint(-6, -1, (n,), generator=g).float())
    weights = torch.randn(m, heads, generator=g) / 8
    if causal:
        i = torch.arange(m)
        start = torch.where(i < m // 2, 0, n // 3)
        end = n - m + i + 1
    else:
        start = torch.randint(-3, n, (m,), generator=g)
        end = start + torch.randint(-2, n, (m,), generator=g)
    return q, k, k_scale, weights, start.int(), end.int(), True


def paged_example(batch: int, next_n: int, heads: int, *, nb: int = 10, block_size: int = 16, max_model_len: int = 96,
                  seed: int = 0, use_fnuz: bool = False):
    """(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, use_fnuz): a padded-page
    cache written by indexer_k_quant_and_cache, a table with -1 and out-of-range entries, 2-D lengths."""
    from ..reference.indexer import indexer_k_quant_and_cache
    from .indexer import example_cache

    g = torch.Generator().manual_seed(seed)
    cache = example_cache(nb, block_size, seed=seed)
    rows = nb * block_size
    k = torch.randn(rows, layout.INDEXER_DIM, generator=g) * torch.exp2(torch.randint(-3, 4, (rows, 1), generator=g))
    indexer_k_quant_and_cache(k.to(torch.bfloat16), cache, torch.arange(rows), layout.INDEXER_QUANT_BLOCK,
                              layout.INDEXER_SCALE_FMT, use_fnuz)
    fmt = layout.E4M3FNUZ if use_fnuz else layout.E4M3FN
    q = random_fp8((batch, next_n, heads, layout.INDEXER_DIM), g, fmt)
    weights = torch.randn(batch * next_n, heads, generator=g) / 8
    width = layout.cdiv(max_model_len, block_size) + 1
    table = torch.randint(0, nb, (batch, width), generator=g, dtype=torch.int32)
    table[:, 1] = -1
    table[0, 2] = nb
    lens = torch.randint(0, max_model_len + 20, (batch, 1), generator=g) + torch.arange(next_n)
    return q, cache, weights, lens.int(), table, max_model_len, True, use_fnuz


def _prefill_examples():
    return {"causal, 2 requests, 64 heads, D 128": prefill_example(12, 70, 64),
            "random ranges, 4 heads, D 32": prefill_example(9, 40, 4, 32, seed=1, causal=False)}


def _prefill_out_examples():
    args = prefill_example(7, 50, 8, 64, seed=2)
    return {"into a padded out": args + (torch.zeros(7, 56)[:, :50], False)}


def _paged_examples():
    return {"B 3, next_n 2, 64 heads": paged_example(3, 2, 64),
            "B 2, next_n 1, 4 heads, FNUZ": paged_example(2, 1, 4, seed=1, use_fnuz=True)}


def _paged_out_examples():
    q, cache, w, lens, table, max_len, clean, fnuz = paged_example(2, 2, 8, seed=2)
    return {"1-D lengths into out": (q, cache, w, lens[:, 1].contiguous(), table, max_len, clean,
                                     torch.zeros(4, max_len), fnuz)}


def _metadata_examples():
    return {"132 SMs": (torch.tensor([[5, 6], [9, 10]], dtype=torch.int32), 64, 132)}


def _metadata_out_examples():
    return {"8 SMs": (torch.tensor([7], dtype=torch.int32), 64, 8, torch.full((9, 2), 5, dtype=torch.int32))}


_PREFILL_ARGS = ("Tensor q, Tensor k, Tensor k_scale, Tensor weights, Tensor cu_seqlen_ks, Tensor cu_seqlen_ke, "
                 "bool clean_logits")
_PAGED_ARGS = ("Tensor q, Tensor kv_cache, Tensor weights, Tensor context_lens, Tensor block_tables, "
               "SymInt max_model_len, bool clean_logits")
_prefill_op = register_op(
    f"fp8_fp4_mqa_logits({_PREFILL_ARGS}, bool use_fnuz=False) -> Tensor",
    reference=_prefill_reference, kernel=_prefill_kernel, fake=_prefill_fake, examples=_prefill_examples,
    approximate=True)
_prefill_out_op = register_op(
    f"fp8_fp4_mqa_logits_out({_PREFILL_ARGS}, Tensor(a!) out, bool use_fnuz=False) -> ()",
    reference=_prefill_out_reference, kernel=_prefill_out_kernel, fake=_prefill_out_fake,
    examples=_prefill_out_examples, approximate=True)
_paged_op = register_op(
    f"fp8_fp4_paged_mqa_logits({_PAGED_ARGS}, bool use_fnuz=False) -> Tensor",
    reference=_paged_reference, kernel=_paged_kernel, fake=_paged_fake, examples=_paged_examples,
    approximate=True)
_paged_out_op = register_op(
    f"fp8_fp4_paged_mqa_logits_out({_PAGED_ARGS}, Tensor(a!) out, bool use_fnuz=False) -> ()",
    reference=_paged_out_reference, kernel=_paged_out_kernel, fake=_paged_out_fake,
    examples=_paged_out_examples, approximate=True)
_metadata_op = register_op(
    "get_paged_mqa_logits_metadata(Tensor context_lens, SymInt block_size, SymInt num_sms) -> Tensor",
    reference=_metadata_reference, kernel=_metadata_kernel, fake=_metadata_fake, examples=_metadata_examples)
_metadata_out_op = register_op(
    "get_paged_mqa_logits_metadata_out(Tensor context_lens, SymInt block_size, SymInt num_sms, Tensor(a!) out) -> ()",
    reference=_metadata_out_reference, kernel=_metadata_out_kernel, fake=_metadata_out_fake,
    examples=_metadata_out_examples)


# --- public API -------------------------------------------------------------------------------------------------------
def _unpack_q(q):
    if not isinstance(q, (tuple, list)) or len(q) != 2:
        raise ValueError(f"q must be a (q_fp8, None) tuple, got {type(q).__name__}")
    if q[1] is not None:
        raise NotImplementedError("q: fp4 queries (a second element, the fp4 scales) are not supported; pass "
                                  "(q_fp8, None)")
    return q[0]


def fp8_fp4_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, *, out=None, use_fnuz=False):
    """Prefill indexer logits (SPEC §3.9): logits[m, n] = k_scale[n] * sum_h weights[m, h] * relu(<q[m, h], k[n]>)
    for ks'(m) <= n < ke'(m), with ks' = clamp(ks, 0, N) and ke' = clamp(ke, ks', N); the fp8 values exactly,
    fp32 accumulation.

    q: (q_fp8 [M, H, D], None), D in {32, 64, 128}, any H >= 1. kv: (k_fp8 [N, D], k_scale [N] or [N, 1] fp32).
    fp8 tensors are float8_e4m3fn / float8_e4m3fnuz or uint8 (OCP e4m3, FNUZ with use_fnuz), last dim
    contiguous. weights: [M, H] fp32. cu_seqlen_ks / cu_seqlen_ke: [M] int32. Outside [ks', ke') a logit is -inf
    with clean_logits, otherwise unspecified. Returns logits [M, N] fp32, or writes `out` ([M, N] fp32, last dim
    contiguous, any row stride) and returns it. A second element of q (fp4) raises NotImplementedError.
    """
    q_fp8 = _unpack_q(q)
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise ValueError(f"kv must be a (k_fp8, k_scale) tuple, got {type(kv).__name__}")
    k, k_scale = kv
    check_bool("clean_logits", clean_logits)        # the dispatcher would turn 0/1 into a bool
    if out is None:
        return _prefill_op(q_fp8, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, use_fnuz)
    _prefill_out_op(q_fp8, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, out, use_fnuz)
    return out


def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len,
                             clean_logits, indices=None, *, out=None, use_fnuz=False):
    """Decode indexer logits over the paged indexer cache (SPEC §2.2, §3.9).

    q: (q_fp8 [B, next_n, H, 128], None). kv_cache: the indexer cache, uint8 [nb, bs, 1, 132] or [nb, bs, 132],
    any page stride >= bs*132 (a multiple of 4); its bytes are OCP e4m3 unless use_fnuz. weights: [B*next_n, H]
    fp32. context_lens: [B, next_n] int32 compressed lengths, or [B] (row j then has ctx_b - next_n + j + 1).
    block_tables: [B, W] int32 (int64 accepted). Row b*next_n + j of the logits [B*next_n, max_model_len] fp32
    holds, for k < min(context_lens[b, j], max_model_len), the prefill formula with key k read at page
    block_tables[b, k // bs], offset k % bs; a key whose table entry is invalid (< 0, >= nb, column past W) is
    never loaded and scores -inf. Columns past the context: -inf with clean_logits, otherwise unspecified.
    schedule_metadata is ignored; indices (the variable-length form) raises NotImplementedError. With `out`
    ([B*next_n, max_model_len] fp32, last dim contiguous) given, writes and returns it.
    """
    q_fp8 = _unpack_q(q)
    if indices is not None:
        raise NotImplementedError("fp8_fp4_paged_mqa_logits: indices (the variable-length form) is not supported")
    check_bool("clean_logits", clean_logits)
    if isinstance(max_model_len, bool):                  # the dispatcher would take a bool as an int
        raise ValueError(f"max_model_len must be an int >= 0, got {max_model_len!r}")
    if out is None:
        return _paged_op(q_fp8, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits,
                         use_fnuz)
    _paged_out_op(q_fp8, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, out, use_fnuz)
    return out


def get_paged_mqa_logits_metadata(context_lens, block_size, num_sms, indices=None, *, out=None):
    """DeepGEMM's decode schedule, kept so that an IndexerMetadataBuilder's decode_schedule_fn keeps working: a
    zero int32 [num_sms + 1, 2] tensor on context_lens' device (fp8_fp4_paged_mqa_logits plans from shapes and
    ignores it). context_lens: [B] or [B, next_n] int32; block_size, num_sms: ints >= 1. With `out` given, zeroes
    and returns it. indices raises NotImplementedError."""
    if indices is not None:
        raise NotImplementedError("get_paged_mqa_logits_metadata: indices (the variable-length form) is not "
                                  "supported")
    if out is None:
        return _metadata_op(context_lens, block_size, num_sms)
    _metadata_out_op(context_lens, block_size, num_sms, out)
    return out
