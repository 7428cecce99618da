"""Per-row top-k of the indexer logits (SPEC §3.9): `dsv4::top_k_per_row_prefill` and `dsv4::top_k_per_row_decode`.

Both are mutating ops (they write `topk_indices[r, :topk]` for r < num_rows and return nothing). The Python entry
points mirror vLLM's `torch.ops._C.top_k_per_row_prefill/decode` (argument names and order). Exact and
deterministic: the `topk` largest logits of each row in ascending index order, ties at the threshold to the
lowest indices, NaN below -inf (docs/ops/topk.md).
"""
from __future__ import annotations

import torch

from .. import platform
from ..kernels import topk as kernels
from ..library import register_op
from ..reference import topk as reference
from ._checks import INT32_MAX, check_int, check_rows, check_tensor, known
from ._plans import MISSING, ByAlignment, PlanCache, signature

LOGITS_DTYPES = (torch.float32,)   # what the logits ops produce; each dtype would be its own kernel
LENGTH_DTYPES = (torch.int32,)


# --- validation (R3: dtypes, shapes, devices, ints; never contents) ---------------------------------------------
def _inside_view(logits, num_rows, stride0, stride1) -> bool:
    """The addresses the strides form are among logits' own elements (no storage look-up needed)."""
    n_cols = logits.shape[1]
    return (num_rows <= logits.shape[0] and (num_rows <= 1 or stride0 == logits.stride(0))
            and (n_cols <= 1 or stride1 == logits.stride(1)))


def storage_elements(t: torch.Tensor) -> int:
    """Elements of t's dtype that fit in its storage."""
    return t.untyped_storage().nbytes() // t.element_size()


def check_logits(logits, num_rows, stride0, stride1) -> None:
    """logits [rows, N] fp32; num_rows >= 0; stride0, stride1 >= 0; every element address r*stride0 +
    c*stride1 (r < num_rows, c < N) from logits' storage offset lies inside its storage."""
    check_tensor("logits", logits, ndim=2, dtypes=LOGITS_DTYPES)
    check_int("num_rows", num_rows, 0)
    check_int("stride0", stride0, 0)
    check_int("stride1", stride1, 0)
    n_cols = logits.shape[1]
    if not known(num_rows, stride0, stride1, n_cols, *logits.shape, *logits.stride()) or num_rows == 0 \
            or n_cols == 0:
        return
    if (n_cols - 1) * stride1 > INT32_MAX:
        raise NotImplementedError(f"logits: one row spans (N - 1) * stride1 = {(n_cols - 1) * stride1} elements, "
                                  "over int32 offsets")
    if _inside_view(logits, num_rows, stride0, stride1):
        return
    last = logits.storage_offset() + (num_rows - 1) * stride0 + (n_cols - 1) * stride1
    size = storage_elements(logits)
    if not known(size, last) or last < size:
        return
    raise ValueError(f"logits: num_rows = {num_rows} rows of N = {n_cols} columns with stride0 = {stride0}, "
                     f"stride1 = {stride1} reach element {last} from the storage start, past the storage's "
                     f"{size} elements")


def check_out(topk_indices, num_rows, topk, device) -> None:
    check_tensor("topk_indices", topk_indices, ndim=2, dtypes=(torch.int32,), device=device)
    check_int("topk", topk, 1)
    check_rows("topk_indices", topk_indices, num_rows)
    if known(topk_indices.shape[1]) and isinstance(topk, int) and topk_indices.shape[1] < topk:
        raise ValueError(f"topk_indices has {topk_indices.shape[1]} columns, fewer than topk = {topk}")


def check_prefill(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, stride0, stride1, topk) -> None:
    check_logits(logits, num_rows, stride0, stride1)
    device = logits.device
    for name, t in (("cu_seqlen_ks", cu_seqlen_ks), ("cu_seqlen_ke", cu_seqlen_ke)):
        check_tensor(name, t, ndim=1, dtypes=LENGTH_DTYPES, device=device)
        check_rows(name, t, num_rows)
    check_out(topk_indices, num_rows, topk, device)


def check_decode(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1, topk) -> None:
    check_logits(logits, num_rows, stride0, stride1)
    device = logits.device
    check_int("next_n", next_n, 1)
    check_tensor("seq_lens", seq_lens, ndim=(1, 2), dtypes=LENGTH_DTYPES, device=device)
    if seq_lens.dim() == 2 and known(seq_lens.shape[1]) and isinstance(next_n, int) and seq_lens.shape[1] != next_n:
        raise ValueError(f"seq_lens of 2 dims must be [B, next_n = {next_n}], got shape {tuple(seq_lens.shape)}")
    check_out(topk_indices, num_rows, topk, device)


# --- kernels: plans keyed by argument signature ------------------------------------------------------------------
_PLANS = PlanCache()


def _sig(name: str, args, logits, num_rows, stride0, stride1) -> tuple:
    sig = signature(name, args)
    if logits.dim() == 2 and not _inside_view(logits, num_rows, stride0, stride1):
        # the storage check depends on the storage too
        sig += (logits.storage_offset(), logits.untyped_storage().nbytes())
    return sig


def _bind(mode, logits, a, b, topk_indices, num_rows, stride0, stride1, topk, a_strides, b_s0, next_n, n_seq):
    if num_rows == 0:
        return None
    target = platform.target_for(logits.device)
    n_cols = logits.shape[1]
    ints = kernels.runtime_args(n_cols, stride0, stride1, a_strides, b_s0, topk_indices.stride(), next_n, n_seq)

    def bind(aligned):
        meta = kernels.launch_options(kernels.constexprs(mode, n_cols, topk, target, aligned=aligned))
        launch = kernels.LAUNCHER.bind((num_rows,), (logits.dtype, a.dtype, b.dtype, torch.int32), ints, meta,
                                       logits.device)
        return launch, meta.get("COMPACT", False)

    vectors = stride1 == 1 and stride0 % 16 == 0 and n_cols % 16 == 0 and topk_indices.stride(1) == 1
    launch, compact = bind(vectors)
    # COMPACT's register order needs the aligned launch's vector loads (Triton compiles the two apart)
    return ByAlignment(launch, bind(False)[0], (0,), 16) if compact else launch


def _prefill_plan(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, stride0, stride1, topk):
    check_prefill(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, stride0, stride1, topk)
    return _bind(kernels.MODE_PREFILL, logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, stride0,
                 stride1, topk, (cu_seqlen_ks.stride(0), 0), cu_seqlen_ke.stride(0), 1, 0)


def _prefill_kernel(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, stride0, stride1, topk):
    args = (logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, stride0, stride1, topk)
    sig = _sig("prefill", args, logits, num_rows, stride0, stride1)
    launch = _PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _PLANS.remember(sig, _prefill_plan(*args))
    if launch is not None:
        launch(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices)


def _prefill_reference(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, stride0, stride1, topk):
    check_prefill(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, stride0, stride1, topk)
    reference.top_k_per_row_prefill(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, stride0, stride1,
                                    topk)


def _prefill_fake(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, stride0, stride1, topk):
    check_prefill(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, stride0, stride1, topk)


def _decode_plan(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1, topk):
    check_decode(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1, topk)
    two_d = seq_lens.dim() == 2
    mode = kernels.MODE_DECODE_2D if two_d else kernels.MODE_DECODE_1D
    a_strides = tuple(seq_lens.stride()) if two_d else (seq_lens.stride(0), 0)
    return _bind(mode, logits, seq_lens, seq_lens, topk_indices, num_rows, stride0, stride1, topk, a_strides, 0,
                 next_n, seq_lens.shape[0])


def _decode_kernel(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1, topk):
    args = (logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1, topk)
    sig = _sig("decode", args, logits, num_rows, stride0, stride1)
    launch = _PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _PLANS.remember(sig, _decode_plan(*args))
    if launch is not None:
        launch(logits, seq_lens, seq_lens, topk_indices)


def _decode_reference(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1, topk):
    check_decode(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1, topk)
    reference.top_k_per_row_decode(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1, topk)


def _decode_fake(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1, topk):
    check_decode(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1, topk)


# --- self-check examples ------------------------------------------------------------------------------------------
def example_logits(rows: int, n_cols: int, *, seed: int = 0) -> torch.Tensor:
    """Random fp32 logits [rows, n_cols] with planted ties (a repeated value), NaN, +-inf and +-0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_cols, generator=g) * 3
    x[:, ::7] = 1.5
    x[::3, 5::11] = float("nan")
    x[1::4, 2::13] = float("-inf")
    x[2::5, 3::17] = float("inf")
    x[:, 4::19] = -0.0
    x[:, 6::23] = 0.0
    return x


def _prefill_examples():
    """12 rows of 300 logits, top-k 16: causal-like ranges (short, equal to and above top-k), an empty one and
    ranges past the row; a transposed logits view."""
    logits = example_logits(12, 300)
    ks = torch.tensor([0, 0, 0, 10, 10, 250, -5, 290, 0, 100, 7, 0], dtype=torch.int32)
    ke = torch.tensor([5, 16, 17, 300, 10, 400, 30, 280, 300, 164, 200, 1000], dtype=torch.int32)
    out = torch.full((12, 20), -7, dtype=torch.int32)
    t = logits.T.contiguous().T
    return {"contiguous": (logits, ks, ke, out, 12, 300, 1, 16),
            "transposed logits, 10 of 12 rows": (t, ks, ke, out.clone(), 10, 1, 12, 16)}


def _decode_examples():
    """next_n 2, 4 requests (one row past seq_lens), 2-D and 1-D lengths, top-k 16 over rows of 260 logits."""
    logits = example_logits(10, 260, seed=1)
    seq2 = torch.tensor([[3, 4], [16, 17], [200, 300], [0, -3]], dtype=torch.int32)
    seq1 = torch.tensor([17, 2, 250, 260], dtype=torch.int32)
    out = torch.full((10, 16), -7, dtype=torch.int32)
    return {"2-D seq_lens": (logits, 2, seq2, out, 10, 260, 1, 16),
            "1-D seq_lens": (logits, 2, seq1, out.clone(), 10, 260, 1, 16)}


_prefill_op = register_op(
    "top_k_per_row_prefill(Tensor logits, Tensor cu_seqlen_ks, Tensor cu_seqlen_ke, Tensor(a!) topk_indices, "
    "SymInt num_rows, SymInt stride0, SymInt stride1, int topk) -> ()",
    reference=_prefill_reference, kernel=_prefill_kernel, fake=_prefill_fake, examples=_prefill_examples)
_decode_op = register_op(
    "top_k_per_row_decode(Tensor logits, int next_n, Tensor seq_lens, Tensor(a!) topk_indices, SymInt num_rows, "
    "SymInt stride0, SymInt stride1, int topk) -> ()",
    reference=_decode_reference, kernel=_decode_kernel, fake=_decode_fake, examples=_decode_examples)


def top_k_per_row_prefill(logits: torch.Tensor, cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor,
                          topk_indices: torch.Tensor, num_rows: int, stride0: int | None, stride1: int | None,
                          topk: int) -> None:
    """Top-k logits of each prefill row, as request-local column indices (SPEC §3.9).

    logits: [M, N] fp32, read as logits[r, c] = storage[offset + r*stride0 + c*stride1]
    (the explicit strides win over logits.stride(); None takes logits.stride(d); every address for r < num_rows,
    c < N must lie in logits' storage). cu_seqlen_ks, cu_seqlen_ke: int32 [>= num_rows]. Row r's candidates are
    the columns n in [ks', ke'), ks' = clamp(ks[r], 0, N), ke' = clamp(ke[r], ks', N), L = ke' - ks'.
    topk_indices: int32 [>= num_rows, >= topk], any strides; row r, columns [0, topk) receive [0..L-1, -1...]
    when L <= topk, else n - ks' of the topk largest logits in ascending order (NaN below -inf, -0.0 == +0.0,
    ties to the lowest n). Other elements are untouched. Mutates topk_indices; returns None.
    """
    _prefill_op(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows,
                logits.stride(0) if stride0 is None else stride0, logits.stride(1) if stride1 is None else stride1,
                topk)


def top_k_per_row_decode(logits: torch.Tensor, next_n: int, seq_lens: torch.Tensor, topk_indices: torch.Tensor,
                         num_rows: int, stride0: int | None, stride1: int | None, topk: int) -> None:
    """Top-k logits of each decode row (SPEC §3.9).

    logits: [B*next_n, N] fp32, addressed through stride0/stride1 as in
    `top_k_per_row_prefill`. seq_lens: int32 [B, next_n] (len = seq_lens[b, j]) or [B] (len = seq_lens[b] -
    next_n + j + 1) for row r = b*next_n + j; a row with b >= B has len 0. Row r's candidates are the columns
    [0, clamp(len, 0, N)). topk_indices: int32 [>= num_rows, >= topk]; row r, columns [0, topk) receive
    [0..L-1, -1...] when L <= topk, else the columns of the topk largest logits in ascending order (NaN below
    -inf, -0.0 == +0.0, ties to the lowest column). Mutates topk_indices; returns None.
    """
    _decode_op(logits, next_n, seq_lens, topk_indices, num_rows,
               logits.stride(0) if stride0 is None else stride0, logits.stride(1) if stride1 is None else stride1,
               topk)
