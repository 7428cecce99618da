"""Sparse index ops (SPEC §3.3): `dsv4::compute_global_topk_indices_and_lens[_out]`,
`combine_topk_swa_indices[_out]`, `build_flashinfer_mixed_sparse_indices[_out]`,
`build_c128a_topk_metadata` and `fill_short_context_topk_indices`.

The Python entry points mirror vLLM's functions of the same names (names, argument names, order,
defaults); output buffers are `output_buffers=` / `out=` as SPEC §3.3 lists them.
"""
from __future__ import annotations

import torch

from .. import layout, platform
from ..kernels import sparse_index as kernels
from ..library import register_op
from ..reference import sparse_index as reference
from ._checks import check_int, check_rows, check_tensor
from ._plans import MISSING, PlanCache, bind_rows, signature

INT_DTYPES = (torch.int32, torch.int64)
I32 = (torch.int32,)
BOOL = (torch.bool,)


# --- validation (R3: dtypes, shapes, devices, ints; never contents) ------------------------------
def _table(name: str, bt, device) -> None:
    check_tensor(name, bt, ndim=2, dtypes=INT_DTYPES, device=device)


def check_global(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, global_out=None,
                 lens_out=None) -> tuple[int, int]:
    """Validate compute_global_topk_indices_and_lens; return (T, K)."""
    check_tensor("topk_indices", topk_indices, ndim=2, dtypes=I32)
    device = topk_indices.device
    T, K = topk_indices.shape
    check_tensor("token_to_req_indices", token_to_req_indices, ndim=1, dtypes=INT_DTYPES, device=device)
    check_rows("token_to_req_indices", token_to_req_indices, T)
    _table("block_table", block_table, device)
    check_int("block_size", block_size, 1)
    check_tensor("is_valid_token", is_valid_token, ndim=1, dtypes=BOOL, device=device)
    check_rows("is_valid_token", is_valid_token, T)
    if global_out is not None:
        check_tensor("output_buffers[0]", global_out, ndim=2, dtypes=I32, device=device)
        check_tensor("output_buffers[1]", lens_out, ndim=1, dtypes=I32, device=device)
        if tuple(global_out.shape) != (T, K):
            raise ValueError(f"output_buffers[0] must have shape {(T, K)}, got {tuple(global_out.shape)}")
        if tuple(lens_out.shape) != (T,):
            raise ValueError(f"output_buffers[1] must have shape {(T,)}, got {tuple(lens_out.shape)}")
    return T, K


def check_combine(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N,
                  combined_out=None, lens_out=None) -> tuple[int, int, int]:
    """Validate combine_topk_swa_indices; return (Tq, Rc, row width)."""
    check_tensor("topk_indices", topk_indices, ndim=2, dtypes=I32)
    device = topk_indices.device
    Tq = topk_indices.shape[0]
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INT_DTYPES, device=device)
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must hold at least one entry (Rc+1)")
    Rc = query_start_loc.shape[0] - 1
    for name, t in (("seq_lens", seq_lens), ("gather_lens", gather_lens)):
        check_tensor(name, t, ndim=1, dtypes=INT_DTYPES, device=device)
        check_rows(name, t, Rc)
    check_int("window_size", window_size, 1)
    check_int("compress_ratio", compress_ratio, 1)
    check_int("topk", topk, 0)
    if topk > topk_indices.shape[1]:
        raise ValueError(f"topk ({topk}) exceeds topk_indices.shape[1] ({topk_indices.shape[1]})")
    for name, v in (("M", M), ("N", N)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{name} must be an int, got {type(v).__name__}")
    width = layout.combine_width(topk, window_size)
    if combined_out is not None:
        check_tensor("out[0]", combined_out, ndim=2, dtypes=I32, device=device)
        check_tensor("out[1]", lens_out, ndim=1, dtypes=I32, device=device)
        if combined_out.shape[1] < topk + window_size:
            raise ValueError(f"out[0] has {combined_out.shape[1]} columns; combine needs at least "
                             f"topk + window_size = {topk + window_size}")
        check_rows("out[0]", combined_out, Tq)
        check_rows("out[1]", lens_out, Tq)
        width = combined_out.shape[1]
    return Tq, Rc, width


def check_flashinfer(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                     prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices, swa_block_table,
                     swa_block_size, compressed_block_table, compressed_block_size, window_size, compress_ratio, topk,
                     decode_compressed_indices_are_local, decode_is_valid_token, swa_block_span,
                     compressed_block_span, sparse_out=None, lens_out=None) -> tuple[int, int, int, int, int, int]:
    """Validate build_flashinfer_mixed_sparse_indices; return (Td, Tp, Wswa, Kd, Kp, P)."""
    check_tensor("decode_swa_indices", decode_swa_indices, ndim=2, dtypes=I32)
    device = decode_swa_indices.device
    Td, Wswa = decode_swa_indices.shape
    Kd = 0
    if decode_compressed_indices is not None:
        check_tensor("decode_compressed_indices", decode_compressed_indices, ndim=2, dtypes=I32, device=device)
        if decode_compressed_indices.shape[0] != Td:
            raise ValueError(f"decode_compressed_indices has {decode_compressed_indices.shape[0]} rows, "
                             f"decode_swa_indices {Td}")
        Kd = decode_compressed_indices.shape[1]
    if decode_compressed_topk_lens is not None:
        check_tensor("decode_compressed_topk_lens", decode_compressed_topk_lens, ndim=1, dtypes=INT_DTYPES,
                     device=device)
        check_rows("decode_compressed_topk_lens", decode_compressed_topk_lens, Td)
    check_tensor("prefill_topk_indices", prefill_topk_indices, ndim=2, dtypes=I32, device=device)
    Tp, Kp = prefill_topk_indices.shape
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INT_DTYPES, device=device)
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must hold at least one entry (R+1)")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INT_DTYPES, device=device)
    check_tensor("token_to_req_indices", token_to_req_indices, ndim=1, dtypes=INT_DTYPES, device=device)
    check_rows("token_to_req_indices", token_to_req_indices, Td + Tp)
    _table("swa_block_table", swa_block_table, device)
    if compressed_block_table is not None:
        _table("compressed_block_table", compressed_block_table, device)
    check_int("swa_block_size", swa_block_size, 1)
    check_int("compressed_block_size", compressed_block_size, 1)
    check_int("window_size", window_size, 1)
    check_int("compress_ratio", compress_ratio, 1)
    check_int("topk", topk, 0)
    if swa_block_span is not None:
        check_int("swa_block_span", swa_block_span, 1)
    if compressed_block_span is not None:
        check_int("compressed_block_span", compressed_block_span, 1)
    if Wswa < window_size:
        raise ValueError(f"decode_swa_indices has {Wswa} columns (Wswa), fewer than window_size {window_size}")
    if decode_is_valid_token is not None:
        check_tensor("decode_is_valid_token", decode_is_valid_token, ndim=1, dtypes=BOOL, device=device)
        check_rows("decode_is_valid_token", decode_is_valid_token, Td)
    P = layout.flashinfer_compressed_width(topk, Kd)
    if sparse_out is not None:
        check_tensor("out[0]", sparse_out, ndim=2, dtypes=I32, device=device)
        check_tensor("out[1]", lens_out, ndim=1, dtypes=I32, device=device)
        if sparse_out.shape[1] != Wswa + P:
            raise ValueError(f"out[0] must have exactly Wswa + P = {Wswa + P} columns, got {sparse_out.shape[1]}")
        check_rows("out[0]", sparse_out, Td + Tp)
        check_rows("out[1]", lens_out, Td + Tp)
    return Td, Tp, Wswa, Kd, Kp, P


def check_c128a(positions, compress_ratio, num_decode_tokens, token_to_req_indices, block_table, block_size,
                slot_mapping, global_decode_buffer, decode_lens_buffer, prefill_buffer,
                max_compressed_tokens) -> tuple[int, int, int, int]:
    """Validate build_c128a_topk_metadata; return (T, Td, W decode, W prefill)."""
    check_tensor("positions", positions, ndim=1, dtypes=INT_DTYPES)
    device = positions.device
    T = positions.shape[0]
    check_int("compress_ratio", compress_ratio, 1)
    check_int("num_decode_tokens", num_decode_tokens, 0)
    Td = num_decode_tokens
    if Td > T:
        raise ValueError(f"num_decode_tokens ({Td}) exceeds the {T} positions")
    check_tensor("token_to_req_indices", token_to_req_indices, ndim=1, dtypes=INT_DTYPES, device=device)
    check_rows("token_to_req_indices", token_to_req_indices, Td)
    _table("block_table", block_table, device)
    check_int("block_size", block_size, 1)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INT_DTYPES, device=device)
    check_rows("slot_mapping", slot_mapping, Td)
    check_tensor("global_decode_buffer", global_decode_buffer, ndim=2, dtypes=I32, device=device)
    check_rows("global_decode_buffer", global_decode_buffer, Td)
    check_tensor("decode_lens_buffer", decode_lens_buffer, ndim=1, dtypes=I32, device=device)
    check_rows("decode_lens_buffer", decode_lens_buffer, Td)
    check_tensor("prefill_buffer", prefill_buffer, ndim=2, dtypes=I32, device=device)
    check_rows("prefill_buffer", prefill_buffer, T - Td)
    check_int("max_compressed_tokens", max_compressed_tokens, 0)
    return (T, Td, min(max_compressed_tokens, global_decode_buffer.shape[1]),
            min(max_compressed_tokens, prefill_buffer.shape[1]))


def check_fill(topk_indices, positions, topk, compress_ratio) -> int:
    """Validate fill_short_context_topk_indices; return T."""
    check_tensor("topk_indices", topk_indices, ndim=2, dtypes=I32)
    check_tensor("positions", positions, ndim=1, dtypes=INT_DTYPES, device=topk_indices.device)
    check_int("topk", topk, 0)
    check_int("compress_ratio", compress_ratio, 1)
    if topk > topk_indices.shape[1]:
        raise ValueError(f"topk ({topk}) exceeds topk_indices.shape[1] ({topk_indices.shape[1]})")
    T = positions.shape[0]
    check_rows("topk_indices", topk_indices, T)
    return T


# --- plans ---------------------------------------------------------------------------------------
_PLANS = PlanCache()


# --- compute_global_topk_indices_and_lens --------------------------------------------------------
def _global_launch(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, g, lens):
    sig = signature("global", (topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, g, lens))
    launch = _PLANS.get(sig, MISSING)
    if launch is MISSING:
        T, K = check_global(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, g, lens)
        launch = None
        if T > 0:
            tensors = (topk_indices, token_to_req_indices, block_table, is_valid_token, g, lens)
            target = platform.target_for(g.device)
            launch = bind_rows(kernels.GLOBAL_LAUNCHER, T, tensors,
                           kernels.global_runtime_args(*tensors), kernels.global_constexprs(block_size, K, T, target),
                           g.device)
        _PLANS.remember(sig, launch)
    if launch is not None:
        launch(topk_indices, token_to_req_indices, block_table, is_valid_token, g, lens)


def _global_new(topk_indices):
    T, K = topk_indices.shape
    return topk_indices.new_empty((T, K), dtype=torch.int32), topk_indices.new_empty((T,), dtype=torch.int32)


def _global_kernel(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token):
    check_global(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token)
    g, lens = _global_new(topk_indices)
    _global_launch(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, g, lens)
    return g, lens


def _global_reference(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token):
    check_global(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token)
    g, lens = _global_new(topk_indices)
    reference.compute_global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table, block_size,
                                                   is_valid_token, g, lens)
    return g, lens


def _global_fake(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token):
    check_global(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token)
    return _global_new(topk_indices)


def _global_out_kernel(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, global_out,
                       lens_out):
    _global_launch(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, global_out, lens_out)


def _global_out_reference(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, global_out,
                          lens_out):
    check_global(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, global_out, lens_out)
    reference.compute_global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table, block_size,
                                                   is_valid_token, global_out, lens_out)


def _global_out_fake(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, global_out,
                     lens_out):
    check_global(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, global_out, lens_out)


def _global_inputs(T=64, K=512, R=4, bs=64, width=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    topk = torch.randint(-1, bs * width + 16, (T, K), generator=g, dtype=torch.int32)
    t2r = torch.randint(0, R, (T,), generator=g, dtype=torch.int32)
    bt = torch.randint(-1, 1000, (R, width), generator=g, dtype=torch.int32)
    valid = torch.rand(T, generator=g) > 0.1
    return topk, t2r, bt, bs, valid


def _global_examples():
    return {"C4A decode T=64 K=512 bs=64": _global_inputs()}


def _global_out_examples():
    args = _global_inputs()
    return {"C4A decode T=64 K=512 bs=64, buffers": args + _global_new(args[0])}


# --- combine_topk_swa_indices --------------------------------------------------------------------
def _combine_launch(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N,
                    out, lens, fresh: bool):
    sig = signature("combine", (topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk,
                           M, N, out, lens, fresh))
    launch = _PLANS.get(sig, MISSING)
    if launch is MISSING:
        Tq, Rc, width = check_combine(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                                      compress_ratio, topk, M, N, out, lens)
        launch = None
        if Tq > 0 and Rc > 0:
            tensors = (topk_indices, query_start_loc, seq_lens, gather_lens, out, lens)
            target = platform.target_for(out.device)
            launch = bind_rows(kernels.COMBINE_LAUNCHER, kernels.row_programs(Tq, out.device), tensors,
                           kernels.combine_runtime_args(Tq, Rc, M, N, topk_indices, query_start_loc, seq_lens,
                                                        gather_lens, out, lens),
                           kernels.combine_constexprs(window_size, compress_ratio, topk, fresh, Rc, Tq,
                                                      target), out.device)
        _PLANS.remember(sig, launch)
    if launch is not None:
        launch(topk_indices, query_start_loc, seq_lens, gather_lens, out, lens)


def _combine_new(topk_indices, window_size, topk, Rc):
    Tq = topk_indices.shape[0]
    out = topk_indices.new_empty((Tq, layout.combine_width(topk, window_size)), dtype=torch.int32)
    lens = topk_indices.new_empty((Tq,), dtype=torch.int32)
    return out, lens


def _combine_kernel(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N):
    Tq, Rc, _ = check_combine(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio,
                              topk, M, N)
    out, lens = _combine_new(topk_indices, window_size, topk, Rc)
    if Rc == 0:       # R5: nothing to launch; every row is uncovered
        out.fill_(-1)
        lens.zero_()
        return out, lens
    _combine_launch(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N,
                    out, lens, True)
    return out, lens


def _combine_reference(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M,
                       N):
    _, Rc, _ = check_combine(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk,
                             M, N)
    out, lens = _combine_new(topk_indices, window_size, topk, Rc)
    reference.combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                                       compress_ratio, topk, M, N, out, lens, True)
    return out, lens


def _combine_fake(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N):
    _, Rc, _ = check_combine(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk,
                             M, N)
    return _combine_new(topk_indices, window_size, topk, Rc)


def _combine_out_kernel(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N,
                        out_indices, out_lens):
    _combine_launch(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N,
                    out_indices, out_lens, False)


def _combine_out_reference(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M,
                           N, out_indices, out_lens):
    check_combine(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N,
                  out_indices, out_lens)
    reference.combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                                       compress_ratio, topk, M, N, out_indices, out_lens, False)


def _combine_out_fake(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N,
                      out_indices, out_lens):
    check_combine(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N,
                  out_indices, out_lens)


def _combine_inputs(seed=0, window=128, ratio=4, topk=512):
    """One prefill chunk of three requests (one qlen-0), a few prefix tokens each."""
    g = torch.Generator().manual_seed(seed)
    qlens, prefix = [20, 0, 44], [100, 7, 0]
    seq = [q + p for q, p in zip(qlens, prefix)]
    gl = [q + min(p, window - 1) for q, p in zip(qlens, prefix)]
    N = max(s // ratio for s in seq)
    M = N + max(gl)
    qsl = torch.tensor([1000] + [1000 + sum(qlens[:i + 1]) for i in range(3)], dtype=torch.int32)
    Tq = sum(qlens)
    topk_idx = torch.randint(-1, N, (Tq, topk), generator=g, dtype=torch.int32)
    return (topk_idx, qsl, torch.tensor(seq, dtype=torch.int32), torch.tensor(gl, dtype=torch.int32), window, ratio,
            topk, M, N)


def _combine_examples():
    return {"prefill chunk, window 128, ratio 4, topk 512": _combine_inputs()}


def _combine_out_examples():
    args = _combine_inputs()
    Tq = args[0].shape[0]
    return {"prefill chunk into larger buffers": args + (torch.full((Tq + 3, 640), 7, dtype=torch.int32),
                                                         torch.full((Tq + 3,), 7, dtype=torch.int32))}


# --- build_flashinfer_mixed_sparse_indices -------------------------------------------------------
def _flashinfer_launch(args, out, lens):
    (dswa, dcomp, dlens, ptopk, qsl, seq, t2r, sbt, sbs, cbt, cbs, window, ratio, topk, local, dvalid, sspan,
     cspan) = args
    sig = signature("flashinfer", args + (out, lens))
    launch = _PLANS.get(sig, MISSING)
    if launch is MISSING:
        Td, Tp, Wswa, Kd, Kp, P = check_flashinfer(*args, out, lens)
        launch = None
        if Td + Tp > 0:
            cbt_ = sbt if cbt is None else cbt
            R = min(qsl.shape[0] - 1, seq.shape[0])
            target = platform.target_for(out.device)
            tensors = (dswa, dcomp if dcomp is not None else dswa, dlens if dlens is not None else lens, ptopk, qsl,
                       seq, t2r, sbt, cbt_, dvalid if dvalid is not None else lens, out, lens)
            ints = kernels.flashinfer_runtime_args(
                Td, Wswa, Kd, Kp, P, R, dswa, dcomp.stride() if dcomp is not None else (0, 0),
                dlens.stride(0) if dlens is not None else 0, ptopk, qsl, seq, t2r, sbt, cbt_,
                dvalid.stride(0) if dvalid is not None else 0, out, lens)
            meta = kernels.flashinfer_constexprs(sbs, sbs if sspan is None else sspan, cbs,
                                                 cbs if cspan is None else cspan, window, ratio, topk, bool(local),
                                                 dlens is not None, dvalid is not None, Wswa, P, R, Td + Tp,
                                                 target)
            launch = bind_rows(kernels.FLASHINFER_LAUNCHER, Td + Tp, tensors, ints, meta, out.device)
            launch = (launch, dcomp is None, dlens is None, cbt is None, dvalid is None)
        _PLANS.remember(sig, launch)
    if launch is not None:
        run, no_dcomp, no_dlens, no_cbt, no_dvalid = launch
        run(dswa, dswa if no_dcomp else dcomp, lens if no_dlens else dlens, ptopk, qsl, seq, t2r, sbt,
            sbt if no_cbt else cbt, lens if no_dvalid else dvalid, out, lens)


def _flashinfer_new(decode_swa_indices, decode_compressed_indices, prefill_topk_indices, topk):
    Td, Wswa = decode_swa_indices.shape
    Kd = 0 if decode_compressed_indices is None else decode_compressed_indices.shape[1]
    rows = Td + prefill_topk_indices.shape[0]
    P = layout.flashinfer_compressed_width(topk, Kd)
    return (decode_swa_indices.new_empty((rows, Wswa + P), dtype=torch.int32),
            decode_swa_indices.new_empty((rows,), dtype=torch.int32))


def _flashinfer_kernel(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                       prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices, swa_block_table,
                       swa_block_size, compressed_block_table, compressed_block_size, window_size, compress_ratio,
                       topk, decode_compressed_indices_are_local=False, decode_is_valid_token=None,
                       swa_block_span=None, compressed_block_span=None):
    args = (decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens, prefill_topk_indices,
            query_start_loc, seq_lens, token_to_req_indices, swa_block_table, swa_block_size, compressed_block_table,
            compressed_block_size, window_size, compress_ratio, topk, decode_compressed_indices_are_local,
            decode_is_valid_token, swa_block_span, compressed_block_span)
    check_flashinfer(*args)
    out, lens = _flashinfer_new(decode_swa_indices, decode_compressed_indices, prefill_topk_indices, topk)
    _flashinfer_launch(args, out, lens)
    return out, lens


def _flashinfer_reference(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                          prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices, swa_block_table,
                          swa_block_size, compressed_block_table, compressed_block_size, window_size, compress_ratio,
                          topk, decode_compressed_indices_are_local=False, decode_is_valid_token=None,
                          swa_block_span=None, compressed_block_span=None):
    args = (decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens, prefill_topk_indices,
            query_start_loc, seq_lens, token_to_req_indices, swa_block_table, swa_block_size, compressed_block_table,
            compressed_block_size, window_size, compress_ratio, topk, decode_compressed_indices_are_local,
            decode_is_valid_token, swa_block_span, compressed_block_span)
    check_flashinfer(*args)
    out, lens = _flashinfer_new(decode_swa_indices, decode_compressed_indices, prefill_topk_indices, topk)
    reference.build_flashinfer_mixed_sparse_indices(*args, out, lens)
    return out, lens


def _flashinfer_fake(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                     prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices, swa_block_table,
                     swa_block_size, compressed_block_table, compressed_block_size, window_size, compress_ratio, topk,
                     decode_compressed_indices_are_local=False, decode_is_valid_token=None, swa_block_span=None,
                     compressed_block_span=None):
    check_flashinfer(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens, prefill_topk_indices,
                     query_start_loc, seq_lens, token_to_req_indices, swa_block_table, swa_block_size,
                     compressed_block_table, compressed_block_size, window_size, compress_ratio, topk,
                     decode_compressed_indices_are_local, decode_is_valid_token, swa_block_span,
                     compressed_block_span)
    return _flashinfer_new(decode_swa_indices, decode_compressed_indices, prefill_topk_indices, topk)


def _flashinfer_out_kernel(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                           prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices, swa_block_table,
                           swa_block_size, compressed_block_table, compressed_block_size, window_size, compress_ratio,
                           topk, decode_compressed_indices_are_local, decode_is_valid_token, swa_block_span,
                           compressed_block_span, out_indices, out_lens):
    _flashinfer_launch((decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                        prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices, swa_block_table,
                        swa_block_size, compressed_block_table, compressed_block_size, window_size, compress_ratio,
                        topk, decode_compressed_indices_are_local, decode_is_valid_token, swa_block_span,
                        compressed_block_span), out_indices, out_lens)


def _flashinfer_out_reference(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                              prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices, swa_block_table,
                              swa_block_size, compressed_block_table, compressed_block_size, window_size,
                              compress_ratio, topk, decode_compressed_indices_are_local, decode_is_valid_token,
                              swa_block_span, compressed_block_span, out_indices, out_lens):
    args = (decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens, prefill_topk_indices,
            query_start_loc, seq_lens, token_to_req_indices, swa_block_table, swa_block_size, compressed_block_table,
            compressed_block_size, window_size, compress_ratio, topk, decode_compressed_indices_are_local,
            decode_is_valid_token, swa_block_span, compressed_block_span)
    check_flashinfer(*args, out_indices, out_lens)
    reference.build_flashinfer_mixed_sparse_indices(*args, out_indices, out_lens)


def _flashinfer_out_fake(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                         prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices, swa_block_table,
                         swa_block_size, compressed_block_table, compressed_block_size, window_size, compress_ratio,
                         topk, decode_compressed_indices_are_local, decode_is_valid_token, swa_block_span,
                         compressed_block_span, out_indices, out_lens):
    check_flashinfer(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens, prefill_topk_indices,
                     query_start_loc, seq_lens, token_to_req_indices, swa_block_table, swa_block_size,
                     compressed_block_table, compressed_block_size, window_size, compress_ratio, topk,
                     decode_compressed_indices_are_local, decode_is_valid_token, swa_block_span,
                     compressed_block_span, out_indices, out_lens)


def _flashinfer_inputs(seed=0, local=True, window=128, ratio=4, topk=512):
    """Mixed batch: 3 decode requests then 2 prefill requests (one qlen 0), SWA bs 64, C4A bs 64."""
    g = torch.Generator().manual_seed(seed)
    qlens, seq = [1, 1, 1, 0, 40], [300, 129, 70, 50, 200]
    R, Td = len(qlens), 3
    qsl = torch.tensor([sum(qlens[:i]) for i in range(R + 1)], dtype=torch.int32)
    t2r = torch.repeat_interleave(torch.arange(R, dtype=torch.int32), torch.tensor(qlens))
    sbt = torch.randint(-1, 500, (R, 8), generator=g, dtype=torch.int32)
    cbt = torch.randint(-1, 500, (R, 2), generator=g, dtype=torch.int32)
    dswa = torch.randint(-1, 32000, (Td, window), generator=g, dtype=torch.int32)
    dcomp = torch.randint(-1, 80, (Td, topk), generator=g, dtype=torch.int32)
    ptopk = torch.randint(-1, 50, (40, topk), generator=g, dtype=torch.int32)
    return (dswa, dcomp, None, ptopk, qsl, torch.tensor(seq, dtype=torch.int32), t2r, sbt, 64, cbt, 64, window, ratio,
            topk, local, torch.tensor([True, False, True]), None, None)


def _flashinfer_examples():
    return {"mixed C4A batch, local decode indices": _flashinfer_inputs()}


def _flashinfer_out_examples():
    args = _flashinfer_inputs(local=False)
    args = args[:-2] + (None, 128)
    out, lens = _flashinfer_new(args[0], args[1], args[3], args[13])
    return {"mixed C4A batch, global decode indices, packed span, buffers": args + (out, lens)}


# --- build_c128a_topk_metadata -------------------------------------------------------------------
def _c128a_kernel(positions, compress_ratio, num_decode_tokens, token_to_req_indices, block_table, block_size,
                  slot_mapping, global_decode_buffer, decode_lens_buffer, prefill_buffer,
                  max_compressed_tokens=layout.C128A_MAX_COMPRESSED_TOKENS):
    args = (positions, compress_ratio, num_decode_tokens, token_to_req_indices, block_table, block_size, slot_mapping,
            global_decode_buffer, decode_lens_buffer, prefill_buffer, max_compressed_tokens)
    sig = signature("c128a", args)
    launch = _PLANS.get(sig, MISSING)
    if launch is MISSING:
        T, Td, Wd, Wp = check_c128a(*args)
        launch = None
        if T > 0:
            tensors = (positions, token_to_req_indices, block_table, slot_mapping, global_decode_buffer,
                       decode_lens_buffer, prefill_buffer)
            target = platform.target_for(positions.device)
            launch = bind_rows(kernels.C128A_LAUNCHER, T, tensors, kernels.c128a_runtime_args(Td, Wd, Wp, *tensors),
                           kernels.c128a_constexprs(compress_ratio, block_size, max(Wd, Wp), T, target),
                           positions.device)
        _PLANS.remember(sig, launch)
    if launch is not None:
        launch(positions, token_to_req_indices, block_table, slot_mapping, global_decode_buffer, decode_lens_buffer,
               prefill_buffer)


def _c128a_reference(positions, compress_ratio, num_decode_tokens, token_to_req_indices, block_table, block_size,
                     slot_mapping, global_decode_buffer, decode_lens_buffer, prefill_buffer,
                     max_compressed_tokens=layout.C128A_MAX_COMPRESSED_TOKENS):
    args = (positions, compress_ratio, num_decode_tokens, token_to_req_indices, block_table, block_size, slot_mapping,
            global_decode_buffer, decode_lens_buffer, prefill_buffer, max_compressed_tokens)
    check_c128a(*args)
    reference.build_c128a_topk_metadata(*args)


def _c128a_fake(positions, compress_ratio, num_decode_tokens, token_to_req_indices, block_table, block_size,
                slot_mapping, global_decode_buffer, decode_lens_buffer, prefill_buffer,
                max_compressed_tokens=layout.C128A_MAX_COMPRESSED_TOKENS):
    check_c128a(positions, compress_ratio, num_decode_tokens, token_to_req_indices, block_table, block_size,
                slot_mapping, global_decode_buffer, decode_lens_buffer, prefill_buffer, max_compressed_tokens)


def _c128a_examples():
    g = torch.Generator().manual_seed(0)
    Td, Tp, Kc = 8, 24, 1024   # Kc for max_model_len 131072
    positions = torch.cat([torch.randint(0, 60000, (Td,), generator=g), torch.arange(10000, 10000 + Tp)])
    t2r = torch.arange(Td, dtype=torch.int32)
    bt = torch.randint(-1, 4000, (Td, 512), generator=g, dtype=torch.int32)
    slots = torch.randint(-1, 1000, (Td + Tp,), generator=g)
    return {"8 decodes + 24 prefill tokens, Kc 1024": (
        positions, 128, Td, t2r, bt, 2, slots, torch.full((Td + 2, Kc), 7, dtype=torch.int32),
        torch.full((Td + 2,), 7, dtype=torch.int32), torch.full((Tp + 2, Kc), 7, dtype=torch.int32), 8192)}


# --- fill_short_context_topk_indices -------------------------------------------------------------
def _fill_kernel(topk_indices, positions, topk, compress_ratio):
    sig = signature("fill", (topk_indices, positions, topk, compress_ratio))
    launch = _PLANS.get(sig, MISSING)
    if launch is MISSING:
        T = check_fill(topk_indices, positions, topk, compress_ratio)
        launch = None
        if T > 0 and topk > 0:
            target = platform.target_for(positions.device)
            launch = bind_rows(kernels.FILL_LAUNCHER, T, (topk_indices, positions),
                           kernels.fill_runtime_args(topk_indices, positions),
                           kernels.fill_constexprs(topk, compress_ratio, T, target), positions.device)
        _PLANS.remember(sig, launch)
    if launch is not None:
        launch(topk_indices, positions)


def _fill_reference(topk_indices, positions, topk, compress_ratio):
    check_fill(topk_indices, positions, topk, compress_ratio)
    reference.fill_short_context_topk_indices(topk_indices, positions, topk, compress_ratio)


def _fill_fake(topk_indices, positions, topk, compress_ratio):
    check_fill(topk_indices, positions, topk, compress_ratio)


def _fill_examples():
    g = torch.Generator().manual_seed(0)
    return {"64 tokens, topk 512, ratio 4": (torch.full((64, 512), 7, dtype=torch.int32),
                                             torch.randint(0, 3000, (64,), generator=g), 512, 4)}


# --- registration ------------------------------------------------------------------------------
_GLOBAL_ARGS = "Tensor topk_indices, Tensor token_to_req_indices, Tensor block_table, int block_size, " \
               "Tensor is_valid_token"
_global_op = register_op(f"compute_global_topk_indices_and_lens({_GLOBAL_ARGS}) -> (Tensor, Tensor)",
                         reference=_global_reference, kernel=_global_kernel, fake=_global_fake,
                         examples=_global_examples)
_global_out_op = register_op(
    f"compute_global_topk_indices_and_lens_out({_GLOBAL_ARGS}, Tensor(a!) global_out, Tensor(b!) lens_out) -> ()",
    reference=_global_out_reference, kernel=_global_out_kernel, fake=_global_out_fake, examples=_global_out_examples)

_COMBINE_ARGS = "Tensor topk_indices, Tensor query_start_loc, Tensor seq_lens, Tensor gather_lens, int window_size, " \
                "int compress_ratio, int topk, SymInt M, SymInt N"
_combine_op = register_op(f"combine_topk_swa_indices({_COMBINE_ARGS}) -> (Tensor, Tensor)",
                          reference=_combine_reference, kernel=_combine_kernel, fake=_combine_fake,
                          examples=_combine_examples)
_combine_out_op = register_op(
    f"combine_topk_swa_indices_out({_COMBINE_ARGS}, Tensor(a!) out_indices, Tensor(b!) out_lens) -> ()",
    reference=_combine_out_reference, kernel=_combine_out_kernel, fake=_combine_out_fake,
    examples=_combine_out_examples)

_FI_ARGS = ("Tensor decode_swa_indices, Tensor? decode_compressed_indices, Tensor? decode_compressed_topk_lens, "
            "Tensor prefill_topk_indices, Tensor query_start_loc, Tensor seq_lens, Tensor token_to_req_indices, "
            "Tensor swa_block_table, int swa_block_size, Tensor? compressed_block_table, int compressed_block_size, "
            "int window_size, int compress_ratio, int topk")
_flashinfer_op = register_op(
    f"build_flashinfer_mixed_sparse_indices({_FI_ARGS}, bool decode_compressed_indices_are_local=False, "
    "Tensor? decode_is_valid_token=None, int? swa_block_span=None, int? compressed_block_span=None) "
    "-> (Tensor, Tensor)",
    reference=_flashinfer_reference, kernel=_flashinfer_kernel, fake=_flashinfer_fake,
    examples=_flashinfer_examples)
_flashinfer_out_op = register_op(
    f"build_flashinfer_mixed_sparse_indices_out({_FI_ARGS}, bool decode_compressed_indices_are_local, "
    "Tensor? decode_is_valid_token, int? swa_block_span, int? compressed_block_span, Tensor(a!) out_indices, "
    "Tensor(b!) out_lens) -> ()",
    reference=_flashinfer_out_reference, kernel=_flashinfer_out_kernel, fake=_flashinfer_out_fake,
    examples=_flashinfer_out_examples)

_c128a_op = register_op(
    "build_c128a_topk_metadata(Tensor positions, int compress_ratio, SymInt num_decode_tokens, "
    "Tensor token_to_req_indices, Tensor block_table, int block_size, Tensor slot_mapping, "
    "Tensor(a!) global_decode_buffer, Tensor(b!) decode_lens_buffer, Tensor(c!) prefill_buffer, "
    f"int max_compressed_tokens={layout.C128A_MAX_COMPRESSED_TOKENS}) -> ()",
    reference=_c128a_reference, kernel=_c128a_kernel, fake=_c128a_fake, examples=_c128a_examples)

_fill_op = register_op(
    "fill_short_context_topk_indices(Tensor(a!) topk_indices, Tensor positions, int topk, int compress_ratio) -> ()",
    reference=_fill_reference, kernel=_fill_kernel, fake=_fill_fake, examples=_fill_examples)


# --- public functions (vLLM's names, argument names, order and defaults) --------------------------
def compute_global_topk_indices_and_lens(topk_indices: torch.Tensor, token_to_req_indices: torch.Tensor,
                                         block_table: torch.Tensor, block_size: int, is_valid_token: torch.Tensor,
                                         output_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
                                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Translate request-local compressed top-k indices into global cache slots (C4A decode).

    topk_indices: [T, K] int32 (-1 = none; any strides). token_to_req_indices: [>= T] int32/int64.
    block_table: [R, W] int32/int64 (negative entries invalid). is_valid_token: [>= T] bool.
    Returns (global [T, K] int32, lens [T] int32): global[t, j] = lookup(block_table, t2r[t],
    topk[t, j], block_size) (SPEC §0; -1 for negative indices, bad entries, columns past W,
    out-of-range requests); lens[t] = count(global[t] >= 0) if is_valid_token[t] else 0. With
    `output_buffers` = (exactly [T, K], exactly [T]) int32, writes them and returns them.
    """
    if output_buffers is None:
        return _global_op(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token)
    g, lens = output_buffers
    _global_out_op(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, g, lens)
    return g, lens


def combine_topk_swa_indices(topk_indices: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                             gather_lens: torch.Tensor, window_size: int, compress_ratio: int, topk: int, M: int,
                             N: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Index rows into the gathered bf16 prefill workspace: top-k entries then the SWA window.

    topk_indices: [Tq, >= topk] int32 chunk-local rows of request-local compressed indices.
    query_start_loc: [Rc+1] slice of the global qsl (rebased by its first element; non-decreasing).
    seq_lens, gather_lens: [>= Rc]. M: per-request workspace row stride; N: first SWA row.
    Row t of request b at position pos: tk = min((pos+1)//compress_ratio, topk) entries
    M*b + l (l in [0, N), else -1), then sw = min(pos+1, window_size) entries M*b + N + w (w the
    window position's offset into the gathered range, -1 outside it); every later column -1
    (SPEC §4 e); lens = tk + sw; pos < 0 gives an all -1 row and lens 0.
    Returns (combined [Tq, round_up(topk + window_size, 128)] int32, lens [Tq] int32); rows no
    request covers hold -1 / 0. With `out` = (idx [>= Tq, >= topk + window_size], lens [>= Tq])
    int32, writes the covered rows (whole row width) and returns (out[0][:Tq], out[1][:Tq]).
    """
    if out is None:
        return _combine_op(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk,
                           M, N)
    idx, lens = out
    _combine_out_op(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N,
                    idx, lens)
    Tq = topk_indices.shape[0]
    return idx[:Tq], lens[:Tq]


def build_flashinfer_mixed_sparse_indices(decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens,
                                          prefill_topk_indices, query_start_loc, seq_lens, token_to_req_indices,
                                          swa_block_table, swa_block_size: int, compressed_block_table,
                                          compressed_block_size: int, window_size: int, compress_ratio: int,
                                          topk: int, decode_compressed_indices_are_local: bool = False,
                                          decode_is_valid_token=None, swa_block_span: int | None = None,
                                          compressed_block_span: int | None = None, *,
                                          out: tuple[torch.Tensor, torch.Tensor] | None = None
                                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer sparse index rows for a mixed batch (decodes first), as global physical slots.

    decode_swa_indices: [Td, Wswa] int32 global SWA slots (-1 padded), Wswa >= window_size.
    decode_compressed_indices: [Td, Kd] int32 or None; local (looked up in the compressed table
    through t2r) when decode_compressed_indices_are_local, else global slots.
    decode_compressed_topk_lens: [>= Td] or None (global case; None means Kd).
    prefill_topk_indices: [Tp, Kp] int32 local indices. query_start_loc [R+1], seq_lens [>= R],
    token_to_req_indices [>= Td+Tp]; block tables int32/int64 (compressed None = the SWA table).
    Every slot v >= 0 is remapped to (v // bs) * span + v % bs (spans default to the block sizes).
    Returns (sparse [Td+Tp, Wswa+P] int32 with P = round_up(max(topk, Kd), 4), lens [Td+Tp] int32):
    decode lens Wswa + (count of valid compressed entries, the given lens, or Kd); prefill lens
    Wswa + min((pos+1)//ratio, topk). With `out` (exactly Wswa+P columns, >= Td+Tp rows), writes
    rows [0, Td+Tp) and returns views of them.
    """
    args = (decode_swa_indices, decode_compressed_indices, decode_compressed_topk_lens, prefill_topk_indices,
            query_start_loc, seq_lens, token_to_req_indices, swa_block_table, swa_block_size, compressed_block_table,
            compressed_block_size, window_size, compress_ratio, topk, decode_compressed_indices_are_local,
            decode_is_valid_token, swa_block_span, compressed_block_span)
    if out is None:
        return _flashinfer_op(*args)
    idx, lens = out
    _flashinfer_out_op(*args, idx, lens)
    rows = decode_swa_indices.shape[0] + prefill_topk_indices.shape[0]
    return idx[:rows], lens[:rows]


def build_c128a_topk_metadata(positions, compress_ratio: int, num_decode_tokens: int, token_to_req_indices,
                              block_table, block_size: int, slot_mapping, global_decode_buffer, decode_lens_buffer,
                              prefill_buffer, max_compressed_tokens: int = layout.C128A_MAX_COMPRESSED_TOKENS
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """C128A attends to every compressed entry: build its top-k style metadata.

    positions: [T] int64 (int32 accepted), the first Td = num_decode_tokens being decodes.
    block_table: the decode requests' rows (storage bs 2), int32/int64. slot_mapping: [>= Td],
    >= 0 marks valid tokens. Buffers (int32): global_decode_buffer [>= Td, Kc], decode_lens_buffer
    [>= Td], prefill_buffer [>= T-Td, Kc]. With W = min(max_compressed_tokens, buffer width) and
    n = clamp((pos+1)//compress_ratio, 0, W): decode rows get lookup(bt, t2r[t], j, bs) for j < n,
    -1 up to W, lens n (0 for slot < 0); prefill rows get j for j < n, -1 up to W. Columns >= W are
    never written. Returns (global_decode[:Td], decode_lens[:Td], prefill[:T-Td]).
    """
    _c128a_op(positions, compress_ratio, num_decode_tokens, token_to_req_indices, block_table, block_size,
              slot_mapping, global_decode_buffer, decode_lens_buffer, prefill_buffer, max_compressed_tokens)
    T = positions.shape[0]
    return (global_decode_buffer[:num_decode_tokens], decode_lens_buffer[:num_decode_tokens],
            prefill_buffer[:T - num_decode_tokens])


def fill_short_context_topk_indices(topk_indices: torch.Tensor, positions: torch.Tensor, topk: int,
                                    compress_ratio: int) -> None:
    """Short contexts skip the indexer: topk_indices[t, j] = j if j < max((pos_t+1)//ratio, 0)
    else -1, for t < T = len(positions), j < topk (the row stride is topk_indices' own; columns
    >= topk and rows >= T untouched). topk_indices: [>= T, >= topk] int32; positions int64/int32."""
    _fill_op(topk_indices, positions, topk, compress_ratio)
