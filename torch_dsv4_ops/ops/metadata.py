"""Metadata ops (SPEC §3.4): `dsv4::get_compressed_slot_mapping[_out]`, `compute_swa_indices_and_lens`,
`compute_dspark_noncausal_swa_indices_and_lens`, `compute_prefill_gather_lens[_out]`,
`prepare_uniform_decode`, `prepare_varlen_decode`, `fill_prefill_chunk_metadata` (the device part
of `metadata.build_prefill_chunk_metadata`), and the builders' fused steps `prepare_token_metadata`,
`prepare_swa_decode` and `prepare_native_decode`.

The Python entry points mirror vLLM's functions of the same names (names, argument names, order,
defaults); output buffers are a trailing `out=` where vLLM allocates.
"""
from __future__ import annotations

import torch

from .. import platform
from ..kernels import metadata as kernels
from ..library import register_op
from ..reference import metadata as reference
from ._checks import check_int, check_rows, check_tensor, known
from ._plans import MISSING, PlanCache, bind_rows, signature

INT_DTYPES = (torch.int32, torch.int64)
I32 = (torch.int32,)
I64 = (torch.int64,)
BOOL = (torch.bool,)


# --- validation (R3: dtypes, shapes, devices, ints; never contents) ------------------------------
def _vector(name: str, t, device, dtypes=INT_DTYPES) -> None:
    check_tensor(name, t, ndim=1, dtypes=dtypes, device=device)


def _qsl(query_start_loc, device=None) -> int:
    """Validate query_start_loc; return its request count (len - 1)."""
    _vector("query_start_loc", query_start_loc, device)
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must hold at least one entry (R+1)")
    return query_start_loc.shape[0] - 1


def check_slot_mapping(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio,
                       out=None) -> tuple[int, int]:
    """Validate get_compressed_slot_mapping; return (Rq = len(qsl) - 1, R = requests with a table row)."""
    Rq = _qsl(query_start_loc)
    device = query_start_loc.device
    _vector("seq_lens", seq_lens, device)
    check_tensor("block_table", block_table, ndim=2, dtypes=INT_DTYPES, device=device)
    check_int("num_tokens", num_tokens, 0)
    check_int("block_size", block_size, 1)
    check_int("compress_ratio", compress_ratio, 1)
    if out is not None:
        _vector("out", out, device, I64)
    return Rq, min(block_table.shape[0], seq_lens.shape[0], Rq)


def check_swa(swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
              block_table, block_size, token_offset) -> tuple[int, int]:
    """Validate compute_swa_indices_and_lens (and the DSpark variant); return (rows, W)."""
    check_tensor("swa_indices", swa_indices, ndim=(2, 3), dtypes=I32)
    device = swa_indices.device
    if swa_indices.dim() == 3 and swa_indices.shape[1] != 1:
        raise ValueError(f"swa_indices must be [rows, W] or [rows, 1, W], got {tuple(swa_indices.shape)}")
    rows, W = swa_indices.shape[0], swa_indices.shape[-1]
    _vector("swa_lens", swa_lens, device, I32)
    check_rows("swa_lens", swa_lens, rows)
    check_int("window_size", window_size, 1)
    if known(W, window_size) and W < window_size:
        raise ValueError(f"swa_indices has {W} columns (W), fewer than window_size {window_size}")
    _qsl(query_start_loc, device)
    _vector("seq_lens", seq_lens, device)
    _vector("token_to_req_indices", token_to_req_indices, device)
    _vector("is_valid_token", is_valid_token, device, BOOL)
    check_int("token_offset", token_offset, 0)
    check_rows("token_to_req_indices", token_to_req_indices, token_offset + rows)
    check_rows("is_valid_token", is_valid_token, token_offset + rows)
    check_tensor("block_table", block_table, ndim=2, dtypes=INT_DTYPES, device=device)
    check_int("block_size", block_size, 1)
    return rows, W


def check_gather_lens(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out=None) -> None:
    """Validate compute_prefill_gather_lens."""
    _vector("seq_lens", seq_lens, None)
    device = seq_lens.device
    Rq = _qsl(query_start_loc, device)
    check_int("num_decodes", num_decodes, 0)
    check_int("num_prefills", num_prefills, 0)
    check_int("window_size", window_size, 1)
    if known(num_decodes, num_prefills):
        n = num_decodes + num_prefills
        if known(Rq) and Rq < n:
            raise ValueError(f"query_start_loc holds {Rq} requests, fewer than num_decodes + num_prefills = {n}")
        check_rows("seq_lens", seq_lens, n)
    if out is not None:
        _vector("out", out, device, I32)
        check_rows("out", out, num_prefills)


def _decode_outputs(device, decode_seq_lens, expanded_block_table, decode_lens, num_decode_tokens) -> None:
    check_int("num_decode_tokens", num_decode_tokens, 0)
    for name, t in (("decode_seq_lens", decode_seq_lens), ("decode_lens", decode_lens)):
        _vector(name, t, device, I32)
        check_rows(name, t, num_decode_tokens)
    check_tensor("expanded_block_table", expanded_block_table, ndim=2, dtypes=INT_DTYPES, device=device)
    check_rows("expanded_block_table", expanded_block_table, num_decode_tokens)


def check_uniform(seq_lens, decode_seq_lens, block_table, expanded_block_table, decode_lens, max_decode_len,
                  num_decode_tokens) -> None:
    """Validate prepare_uniform_decode."""
    _vector("seq_lens", seq_lens, None)
    device = seq_lens.device
    check_tensor("block_table", block_table, ndim=2, dtypes=INT_DTYPES, device=device)
    _decode_outputs(device, decode_seq_lens, expanded_block_table, decode_lens, num_decode_tokens)
    check_int("max_decode_len", max_decode_len, 1)
    if known(max_decode_len, num_decode_tokens):
        requests = -(-num_decode_tokens // max_decode_len)
        check_rows("seq_lens", seq_lens, requests)
        check_rows("block_table", block_table, requests)


def check_varlen(query_start_loc, seq_lens, block_table, decode_seq_lens, expanded_block_table, decode_lens,
                 decode_indices, num_decodes, num_decode_tokens) -> None:
    """Validate prepare_varlen_decode."""
    Rq = _qsl(query_start_loc)
    device = query_start_loc.device
    _vector("seq_lens", seq_lens, device)
    check_tensor("block_table", block_table, ndim=2, dtypes=INT_DTYPES, device=device)
    _decode_outputs(device, decode_seq_lens, expanded_block_table, decode_lens, num_decode_tokens)
    _vector("decode_indices", decode_indices, device, I32)
    check_rows("decode_indices", decode_indices, num_decode_tokens)
    check_int("num_decodes", num_decodes, 0)
    if known(num_decodes, Rq) and Rq < num_decodes:
        raise ValueError(f"query_start_loc holds {Rq} requests, fewer than num_decodes = {num_decodes}")
    check_rows("seq_lens", seq_lens, num_decodes)
    check_rows("block_table", block_table, num_decodes)


def check_chunk(query_start_loc, uncompressed_seq_lens, compressed_seq_lens, start_idx, end_idx, query_start,
                query_end, compress_ratio, dcp_rank, dcp_world_size, cp_kv_cache_interleave_size, cu_seq_lens,
                cu_seqlen_ks, cu_seqlen_ke, token_to_seq) -> None:
    """Validate fill_prefill_chunk_metadata."""
    Rq = _qsl(query_start_loc)
    device = query_start_loc.device
    _vector("uncompressed_seq_lens", uncompressed_seq_lens, device)
    _vector("compressed_seq_lens", compressed_seq_lens, device)
    for name, v in (("start_idx", start_idx), ("end_idx", end_idx), ("query_start", query_start),
                    ("query_end", query_end)):
        check_int(name, v, 0)
    check_int("compress_ratio", compress_ratio, 1)
    check_int("dcp_world_size", dcp_world_size, 1)
    check_int("dcp_rank", dcp_rank, 0)
    check_int("cp_kv_cache_interleave_size", cp_kv_cache_interleave_size, 1)
    if dcp_rank >= dcp_world_size:
        raise ValueError(f"dcp_rank ({dcp_rank}) must be below dcp_world_size ({dcp_world_size})")
    if known(start_idx, end_idx) and end_idx < start_idx:
        raise ValueError(f"end_idx ({end_idx}) is below start_idx ({start_idx})")
    if known(query_start, query_end) and query_end < query_start:
        raise ValueError(f"query_end ({query_end}) is below query_start ({query_start})")
    if known(end_idx, Rq) and Rq < end_idx:
        raise ValueError(f"query_start_loc holds {Rq} requests, fewer than end_idx = {end_idx}")
    check_rows("uncompressed_seq_lens", uncompressed_seq_lens, end_idx)
    check_rows("compressed_seq_lens", compressed_seq_lens, end_idx)
    for name, t in (("cu_seq_lens", cu_seq_lens), ("cu_seqlen_ks", cu_seqlen_ks), ("cu_seqlen_ke", cu_seqlen_ke),
                    ("token_to_seq", token_to_seq)):
        _vector(name, t, device, I32)
    check_rows("cu_seq_lens", cu_seq_lens, end_idx - start_idx + 1)
    check_rows("cu_seqlen_ks", cu_seqlen_ks, query_end - query_start)
    check_rows("cu_seqlen_ke", cu_seqlen_ke, query_end - query_start)


def check_token_metadata(query_start_loc, slot_mapping, token_to_req_indices, is_valid_token) -> tuple[int, int]:
    """Validate prepare_token_metadata; return (Rq = len(qsl) - 1, T = len(slot_mapping))."""
    Rq = _qsl(query_start_loc)
    device = query_start_loc.device
    _vector("slot_mapping", slot_mapping, device)
    _vector("token_to_req_indices", token_to_req_indices, device, I32)
    _vector("is_valid_token", is_valid_token, device, BOOL)
    T = slot_mapping.shape[0]
    check_rows("token_to_req_indices", token_to_req_indices, T)
    check_rows("is_valid_token", is_valid_token, T)
    return Rq, T


def check_native(query_start_loc, seq_lens, decode_lens, decode_seq_lens, num_decodes, max_decode_len,
                 compress_ratio) -> None:
    """Validate prepare_native_decode."""
    Rq = _qsl(query_start_loc)
    device = query_start_loc.device
    _vector("seq_lens", seq_lens, device)
    _vector("decode_lens", decode_lens, device, I32)
    _vector("decode_seq_lens", decode_seq_lens, device, I32)
    check_int("num_decodes", num_decodes, 0)
    check_int("max_decode_len", max_decode_len, 1)
    check_int("compress_ratio", compress_ratio, 1)
    if known(num_decodes, Rq) and Rq < num_decodes:
        raise ValueError(f"query_start_loc holds {Rq} requests, fewer than num_decodes = {num_decodes}")
    check_rows("seq_lens", seq_lens, num_decodes)
    check_rows("decode_lens", decode_lens, num_decodes)
    check_rows("decode_seq_lens", decode_seq_lens, num_decodes * max_decode_len)


def check_swa_decode(swa_indices, swa_lens, token_to_req_indices, is_valid_token, window_size, query_start_loc,
                     seq_lens, slot_mapping, block_table, block_size, num_decode_tokens) -> tuple[int, int, int]:
    """Validate prepare_swa_decode; return (Rq = len(qsl) - 1, T = len(slot_mapping), W)."""
    check_tensor("swa_indices", swa_indices, ndim=(2, 3), dtypes=I32)
    device = swa_indices.device
    if swa_indices.dim() == 3 and swa_indices.shape[1] != 1:
        raise ValueError(f"swa_indices must be [rows, W] or [rows, 1, W], got {tuple(swa_indices.shape)}")
    W = swa_indices.shape[-1]
    check_int("window_size", window_size, 1)
    if known(W, window_size) and W < window_size:
        raise ValueError(f"swa_indices has {W} columns (W), fewer than window_size {window_size}")
    _vector("swa_lens", swa_lens, device, I32)
    Rq, T = check_token_metadata(query_start_loc, slot_mapping, token_to_req_indices, is_valid_token)
    _vector("seq_lens", seq_lens, device)
    check_tensor("block_table", block_table, ndim=2, dtypes=INT_DTYPES, device=device)
    check_int("block_size", block_size, 1)
    check_int("num_decode_tokens", num_decode_tokens, 0)
    if known(num_decode_tokens, T) and num_decode_tokens > T:
        raise ValueError(f"num_decode_tokens ({num_decode_tokens}) exceeds the {T} tokens of slot_mapping")
    check_rows("swa_indices", swa_indices, num_decode_tokens)
    check_rows("swa_lens", swa_lens, num_decode_tokens)
    return Rq, T, W


# --- plans ---------------------------------------------------------------------------------------
_PLANS = PlanCache()


def _plan(name: str, args, make, tensors) -> None:
    """Run the launch cached for this call signature with `tensors` (the kernel's tensor arguments in
    order); on a miss `make()` validates and binds it (None: nothing to launch)."""
    sig = signature(name, args)
    launch = _PLANS.get(sig, MISSING)
    if launch is MISSING:
        launch = _PLANS.remember(sig, make())
    if launch is not None:
        launch(*tensors)


# --- get_compressed_slot_mapping -----------------------------------------------------------------
def _slot_launch(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out):
    def make():
        Rq, R = check_slot_mapping(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio,
                                   out)
        grid = kernels.slot_grid(Rq, out.shape[0]) if out.shape[0] > 0 else 0
        if grid == 0:
            return None
        tensors = (query_start_loc, seq_lens, block_table, out)
        return bind_rows(kernels.SLOT_LAUNCHER, grid, tensors,
                     kernels.slot_runtime_args(Rq, R, min(num_tokens, out.shape[0]), *tensors),
                     kernels.slot_constexprs(block_size, compress_ratio, platform.target_for(out.device)), out.device)

    _plan("slot", (num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out), make,
          (query_start_loc, seq_lens, block_table, out))


def _slot_new(num_tokens, query_start_loc):
    return query_start_loc.new_empty((num_tokens,), dtype=torch.int64)


def _slot_kernel(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio):
    check_slot_mapping(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio)
    out = _slot_new(num_tokens, query_start_loc)
    _slot_launch(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out)
    return out


def _slot_reference(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio):
    check_slot_mapping(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio)
    out = _slot_new(num_tokens, query_start_loc)
    reference.get_compressed_slot_mapping(num_tokens, query_start_loc, seq_lens, block_table, block_size,
                                          compress_ratio, out)
    return out


def _slot_fake(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio):
    check_slot_mapping(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio)
    return _slot_new(num_tokens, query_start_loc)


def _slot_out_kernel(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out):
    _slot_launch(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out)


def _slot_out_reference(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out):
    check_slot_mapping(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out)
    reference.get_compressed_slot_mapping(num_tokens, query_start_loc, seq_lens, block_table, block_size,
                                          compress_ratio, out)


def _slot_out_fake(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out):
    check_slot_mapping(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out)


def _slot_inputs(seed=0):
    """Four decodes (MTP, 2 tokens) and a 40-token prefill, ratio 4, storage bs 64."""
    g = torch.Generator().manual_seed(seed)
    qlens, seq = [2, 2, 2, 2, 40], [900, 5, 70000, 1, 280]
    qsl = torch.tensor([0] + [sum(qlens[:i + 1]) for i in range(5)], dtype=torch.int32)
    bt = torch.randint(-1, 5000, (5, 300), generator=g, dtype=torch.int32)
    return (sum(qlens), qsl, torch.tensor(seq, dtype=torch.int32), bt, 64, 4)


def _slot_examples():
    return {"4 MTP decodes + 40-token prefill, ratio 4": _slot_inputs()}


def _slot_out_examples():
    args = _slot_inputs()
    return {"into a padded buffer": args + (torch.full((args[0] + 5,), 7, dtype=torch.int64),)}


# --- compute_swa_indices_and_lens / compute_dspark_noncausal_swa_indices_and_lens ----------------
def _swa_launch(noncausal, swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices,
                is_valid_token, block_table, block_size, token_offset):
    args = (swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
            block_table, block_size, token_offset)

    def make():
        rows, W = check_swa(*args)
        if rows == 0:
            return None
        tensors = (token_to_req_indices, is_valid_token, query_start_loc, seq_lens, block_table, swa_indices,
                   swa_lens)
        R = min(query_start_loc.shape[0] - 1, seq_lens.shape[0])
        ints = kernels.swa_runtime_args(token_offset, R, W, token_to_req_indices, is_valid_token, query_start_loc,
                                        seq_lens, block_table, (swa_indices.stride(0), swa_indices.stride(-1)),
                                        swa_lens)
        meta = kernels.swa_constexprs(window_size, block_size, noncausal,
                                      W, platform.target_for(swa_indices.device))
        return bind_rows(kernels.SWA_LAUNCHER, rows, tensors, ints, meta, swa_indices.device)

    _plan("swa_nc" if noncausal else "swa", args, make,
          (token_to_req_indices, is_valid_token, query_start_loc, seq_lens, block_table, swa_indices, swa_lens))


def _swa_kernel(swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
                block_table, block_size, token_offset=0):
    _swa_launch(False, swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices,
                is_valid_token, block_table, block_size, token_offset)


def _swa_nc_kernel(swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices,
                   is_valid_token, block_table, block_size, token_offset=0):
    _swa_launch(True, swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices,
                is_valid_token, block_table, block_size, token_offset)


def _swa_reference(swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices,
                   is_valid_token, block_table, block_size, token_offset=0):
    args = (swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
            block_table, block_size, token_offset)
    check_swa(*args)
    reference.compute_swa_indices_and_lens(*args)


def _swa_nc_reference(swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices,
                      is_valid_token, block_table, block_size, token_offset=0):
    args = (swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
            block_table, block_size, token_offset)
    check_swa(*args)
    reference.compute_swa_indices_and_lens(*args, noncausal=True)


def _swa_fake(swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
              block_table, block_size, token_offset=0):
    check_swa(swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
              block_table, block_size, token_offset)


def _swa_inputs(seed=0, width=128, window=128):
    """A mixed step: 6 MTP decodes (2 tokens) then two prefills, SWA bs 64; one padding token."""
    g = torch.Generator().manual_seed(seed)
    qlens = [2] * 6 + [30, 50]
    seq = [2, 130, 300, 64, 1000, 5, 30, 170]
    T = sum(qlens)
    qsl = torch.tensor([0] + [sum(qlens[:i + 1]) for i in range(len(qlens))], dtype=torch.int32)
    t2r = torch.repeat_interleave(torch.arange(len(qlens), dtype=torch.int32), torch.tensor(qlens))
    valid = torch.ones(T, dtype=torch.bool)
    valid[5] = False
    bt = torch.randint(-1, 3000, (len(qlens), 20), generator=g, dtype=torch.int32)
    return (torch.full((T, 1, width), 7, dtype=torch.int32), torch.full((T,), 7, dtype=torch.int32), window, qsl,
            torch.tensor(seq, dtype=torch.int32), t2r, valid, bt, 64, 0)


def _swa_examples():
    return {"6 MTP decodes + 2 prefills, window 128, bs 64": _swa_inputs()}


def _swa_nc_examples():
    return {"DSpark, window 128, W 192": _swa_inputs(width=192)}


# --- compute_prefill_gather_lens -----------------------------------------------------------------
def _gather_lens_launch(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out):
    def make():
        check_gather_lens(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out)
        if num_prefills == 0:
            return None
        tensors = (seq_lens, query_start_loc, out)
        return bind_rows(kernels.GATHER_LENS_LAUNCHER, -(-num_prefills // kernels.ROW_BLOCK), tensors,
                     kernels.gather_lens_runtime_args(num_decodes, num_prefills, window_size, *tensors),
                     kernels.gather_lens_constexprs(platform.target_for(out.device)), out.device)

    _plan("gather_lens", (seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out), make,
          (seq_lens, query_start_loc, out))


def _gather_lens_new(seq_lens, num_prefills):
    return seq_lens.new_empty((num_prefills,), dtype=torch.int32)


def _gather_lens_kernel(seq_lens, query_start_loc, num_decodes, num_prefills, window_size):
    check_gather_lens(seq_lens, query_start_loc, num_decodes, num_prefills, window_size)
    out = _gather_lens_new(seq_lens, num_prefills)
    _gather_lens_launch(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out)
    return out


def _gather_lens_reference(seq_lens, query_start_loc, num_decodes, num_prefills, window_size):
    check_gather_lens(seq_lens, query_start_loc, num_decodes, num_prefills, window_size)
    out = _gather_lens_new(seq_lens, num_prefills)
    reference.compute_prefill_gather_lens(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out)
    return out


def _gather_lens_fake(seq_lens, query_start_loc, num_decodes, num_prefills, window_size):
    check_gather_lens(seq_lens, query_start_loc, num_decodes, num_prefills, window_size)
    return _gather_lens_new(seq_lens, num_prefills)


def _gather_lens_out_kernel(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out):
    _gather_lens_launch(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out)


def _gather_lens_out_reference(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out):
    check_gather_lens(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out)
    reference.compute_prefill_gather_lens(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out)


def _gather_lens_out_fake(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out):
    check_gather_lens(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out)


def _gather_lens_inputs():
    qlens, seq = [1, 1, 50, 5, 300], [900, 4, 1050, 15, 300]
    qsl = torch.tensor([0] + [sum(qlens[:i + 1]) for i in range(5)], dtype=torch.int32)
    return (torch.tensor(seq, dtype=torch.int32), qsl, 2, 3, 128)


def _gather_lens_examples():
    return {"2 decodes + 3 prefills, window 128": _gather_lens_inputs()}


def _gather_lens_out_examples():
    return {"into a padded buffer": _gather_lens_inputs() + (torch.full((8,), 7, dtype=torch.int32),)}


# --- prepare_uniform_decode / prepare_varlen_decode ----------------------------------------------
def _uniform_kernel(seq_lens, decode_seq_lens, block_table, expanded_block_table, decode_lens, max_decode_len,
                    num_decode_tokens):
    args = (seq_lens, decode_seq_lens, block_table, expanded_block_table, decode_lens, max_decode_len,
            num_decode_tokens)

    def make():
        check_uniform(*args)
        if num_decode_tokens == 0:
            return None
        tensors = (seq_lens, decode_seq_lens, block_table, expanded_block_table, decode_lens)
        return bind_rows(kernels.UNIFORM_LAUNCHER, num_decode_tokens, tensors,
                     kernels.uniform_runtime_args(max_decode_len, *tensors),
                     kernels.decode_constexprs(expanded_block_table.shape[1],
                                               platform.target_for(seq_lens.device), False), seq_lens.device)

    _plan("uniform", args, make, args[:5])


def _uniform_reference(seq_lens, decode_seq_lens, block_table, expanded_block_table, decode_lens, max_decode_len,
                       num_decode_tokens):
    args = (seq_lens, decode_seq_lens, block_table, expanded_block_table, decode_lens, max_decode_len,
            num_decode_tokens)
    check_uniform(*args)
    reference.prepare_uniform_decode(*args)


def _uniform_fake(seq_lens, decode_seq_lens, block_table, expanded_block_table, decode_lens, max_decode_len,
                  num_decode_tokens):
    check_uniform(seq_lens, decode_seq_lens, block_table, expanded_block_table, decode_lens, max_decode_len,
                  num_decode_tokens)


def _decode_buffers(rows, width, fill=7):
    return (torch.full((rows,), fill, dtype=torch.int32), torch.full((rows, width), fill, dtype=torch.int32),
            torch.full((rows,), fill, dtype=torch.int32))


def _uniform_examples():
    g = torch.Generator().manual_seed(0)
    seq = torch.tensor([10, 0, 70000, 3], dtype=torch.int32)
    bt = torch.randint(-1, 9000, (4, 300), generator=g, dtype=torch.int32)
    dsl, ebt, dl = _decode_buffers(10, 320)
    return {"4 MTP requests (L 2), 300-column table into 320": (seq, dsl, bt, ebt, dl, 2, 8)}


def _varlen_kernel(query_start_loc, seq_lens, block_table, decode_seq_lens, expanded_block_table, decode_lens,
                   decode_indices, num_decodes, num_decode_tokens):
    args = (query_start_loc, seq_lens, block_table, decode_seq_lens, expanded_block_table, decode_lens,
            decode_indices, num_decodes, num_decode_tokens)

    def make():
        check_varlen(*args)
        if num_decode_tokens == 0:
            return None
        tensors = args[:7]
        return bind_rows(kernels.VARLEN_LAUNCHER, num_decode_tokens, tensors,
                     kernels.varlen_runtime_args(num_decodes, *tensors),
                     kernels.decode_constexprs(expanded_block_table.shape[1],
                                               platform.target_for(seq_lens.device), True), seq_lens.device)

    _plan("varlen", args, make, args[:7])


def _varlen_reference(query_start_loc, seq_lens, block_table, decode_seq_lens, expanded_block_table, decode_lens,
                      decode_indices, num_decodes, num_decode_tokens):
    args = (query_start_loc, seq_lens, block_table, decode_seq_lens, expanded_block_table, decode_lens,
            decode_indices, num_decodes, num_decode_tokens)
    check_varlen(*args)
    reference.prepare_varlen_decode(*args)


def _varlen_fake(query_start_loc, seq_lens, block_table, decode_seq_lens, expanded_block_table, decode_lens,
                 decode_indices, num_decodes, num_decode_tokens):
    check_varlen(query_start_loc, seq_lens, block_table, decode_seq_lens, expanded_block_table, decode_lens,
                 decode_indices, num_decodes, num_decode_tokens)


def _varlen_examples():
    g = torch.Generator().manual_seed(0)
    qsl = torch.tensor([0, 3, 4, 8, 8], dtype=torch.int32)
    seq = torch.tensor([10, 7, 12, 0], dtype=torch.int32)
    bt = torch.randint(-1, 9000, (4, 64), generator=g, dtype=torch.int32)
    dsl, ebt, dl = _decode_buffers(12, 64)
    return {"SPEC §3.6.2 ragged example, 2 padding rows": (qsl, seq, bt, dsl, ebt, dl,
                                                             torch.full((12,), 7, dtype=torch.int32), 4, 10)}


# --- fill_prefill_chunk_metadata ----------------------------------------------------------------
def _chunk_kernel(query_start_loc, uncompressed_seq_lens, compressed_seq_lens, start_idx, end_idx, query_start,
                  query_end, compress_ratio, dcp_rank, dcp_world_size, cp_kv_cache_interleave_size, cu_seq_lens,
                  cu_seqlen_ks, cu_seqlen_ke, token_to_seq):
    args = (query_start_loc, uncompressed_seq_lens, compressed_seq_lens, start_idx, end_idx, query_start, query_end,
            compress_ratio, dcp_rank, dcp_world_size, cp_kv_cache_interleave_size, cu_seq_lens, cu_seqlen_ks,
            cu_seqlen_ke, token_to_seq)

    def make():
        check_chunk(*args)
        n = end_idx - start_idx
        if n == 0:
            return None
        tensors = (query_start_loc, uncompressed_seq_lens, compressed_seq_lens, cu_seq_lens, cu_seqlen_ks,
                   cu_seqlen_ke, token_to_seq)
        ints = kernels.chunk_runtime_args(start_idx, n, query_start, query_end - query_start, dcp_rank,
                                          dcp_world_size, cp_kv_cache_interleave_size, *tensors)
        meta = kernels.chunk_constexprs(compress_ratio, dcp_world_size > 1, platform.target_for(cu_seq_lens.device))
        return bind_rows(kernels.CHUNK_LAUNCHER, n, tensors, ints, meta, cu_seq_lens.device)

    _plan("chunk", args, make, args[:3] + args[11:])


def _chunk_reference(query_start_loc, uncompressed_seq_lens, compressed_seq_lens, start_idx, end_idx, query_start,
                     query_end, compress_ratio, dcp_rank, dcp_world_size, cp_kv_cache_interleave_size, cu_seq_lens,
                     cu_seqlen_ks, cu_seqlen_ke, token_to_seq):
    args = (query_start_loc, uncompressed_seq_lens, compressed_seq_lens, start_idx, end_idx, query_start, query_end,
            compress_ratio, dcp_rank, dcp_world_size, cp_kv_cache_interleave_size, cu_seq_lens, cu_seqlen_ks,
            cu_seqlen_ke, token_to_seq)
    check_chunk(*args)
    if end_idx > start_idx:
        reference.build_prefill_chunk_metadata(*args)


def _chunk_fake(query_start_loc, uncompressed_seq_lens, compressed_seq_lens, start_idx, end_idx, query_start,
                query_end, compress_ratio, dcp_rank, dcp_world_size, cp_kv_cache_interleave_size, cu_seq_lens,
                cu_seqlen_ks, cu_seqlen_ke, token_to_seq):
    check_chunk(query_start_loc, uncompressed_seq_lens, compressed_seq_lens, start_idx, end_idx, query_start,
                query_end, compress_ratio, dcp_rank, dcp_world_size, cp_kv_cache_interleave_size, cu_seq_lens,
                cu_seqlen_ks, cu_seqlen_ke, token_to_seq)


def _chunk_examples():
    qsl = torch.tensor([0, 1, 2, 6, 9], dtype=torch.int32)
    useq = torch.tensor([50, 60, 10, 9], dtype=torch.int32)
    comp = useq // 4
    full = lambda n: torch.full((n,), 7, dtype=torch.int32)  # noqa: E731
    return {"SPEC §3.4 example after two decodes": (qsl, useq, comp, 2, 4, 0, 7, 4, 0, 1, 1, full(3), full(7),
                                                     full(7), full(4)),
            "query slice 2:6 under DCP 2": (qsl, useq, comp, 2, 4, 2, 6, 4, 1, 2, 1, full(3), full(4), full(4),
                                            full(4))}


# --- prepare_token_metadata / prepare_native_decode ----------------------------------------------
def _token_kernel(query_start_loc, slot_mapping, token_to_req_indices, is_valid_token):
    args = (query_start_loc, slot_mapping, token_to_req_indices, is_valid_token)

    def make():
        Rq, T = check_token_metadata(*args)
        if T == 0:
            return None
        return bind_rows(kernels.TOKEN_LAUNCHER, kernels.token_grid(Rq, T), args,
                     kernels.token_runtime_args(Rq, T, *args),
                     kernels.token_constexprs(platform.target_for(slot_mapping.device)), slot_mapping.device)

    _plan("token", args, make, args)


def _token_reference(query_start_loc, slot_mapping, token_to_req_indices, is_valid_token):
    check_token_metadata(query_start_loc, slot_mapping, token_to_req_indices, is_valid_token)
    reference.prepare_token_metadata(query_start_loc, slot_mapping, token_to_req_indices, is_valid_token)


def _token_fake(query_start_loc, slot_mapping, token_to_req_indices, is_valid_token):
    check_token_metadata(query_start_loc, slot_mapping, token_to_req_indices, is_valid_token)


def _token_examples():
    g = torch.Generator().manual_seed(0)
    qsl = torch.tensor([0, 2, 4, 4, 44], dtype=torch.int32)
    slots = torch.randint(-1, 9000, (48,), generator=g)
    return {"3 MTP decodes (one empty) + a 40-token prefill, 4 padding rows": (
        qsl, slots, torch.full((50,), 7, dtype=torch.int32), torch.zeros(50, dtype=torch.bool))}


def _native_kernel(query_start_loc, seq_lens, decode_lens, decode_seq_lens, num_decodes, max_decode_len,
                   compress_ratio):
    args = (query_start_loc, seq_lens, decode_lens, decode_seq_lens, num_decodes, max_decode_len, compress_ratio)

    def make():
        check_native(*args)
        rows = num_decodes * max_decode_len
        if rows == 0:
            return None
        tensors = args[:4]
        return bind_rows(kernels.NATIVE_LAUNCHER, -(-rows // kernels.ROW_BLOCK), tensors,
                     kernels.native_runtime_args(num_decodes, max_decode_len, *tensors),
                     kernels.native_constexprs(compress_ratio, platform.target_for(seq_lens.device)),
                     seq_lens.device)

    _plan("native", args, make, args[:4])


def _native_reference(query_start_loc, seq_lens, decode_lens, decode_seq_lens, num_decodes, max_decode_len,
                      compress_ratio):
    args = (query_start_loc, seq_lens, decode_lens, decode_seq_lens, num_decodes, max_decode_len, compress_ratio)
    check_native(*args)
    reference.prepare_native_decode(*args)


def _native_fake(query_start_loc, seq_lens, decode_lens, decode_seq_lens, num_decodes, max_decode_len,
                 compress_ratio):
    check_native(query_start_loc, seq_lens, decode_lens, decode_seq_lens, num_decodes, max_decode_len,
                 compress_ratio)


def _native_examples():
    qsl = torch.tensor([0, 2, 4, 5, 5, 7], dtype=torch.int32)
    seq = torch.tensor([70000, 2, 9, 0, 300], dtype=torch.int32)
    return {"5 MTP requests (L 2; one short, one empty), ratio 4": (
        qsl, seq, torch.full((6,), 7, dtype=torch.int32), torch.full((12,), 7, dtype=torch.int32), 5, 2, 4)}


# --- prepare_swa_decode --------------------------------------------------------------------------
def _swa_decode_launch(noncausal, swa_indices, swa_lens, token_to_req_indices, is_valid_token, window_size,
                       query_start_loc, seq_lens, slot_mapping, block_table, block_size, num_decode_tokens):
    args = (swa_indices, swa_lens, token_to_req_indices, is_valid_token, window_size, query_start_loc, seq_lens,
            slot_mapping, block_table, block_size, num_decode_tokens, noncausal)
    tensors = (query_start_loc, seq_lens, slot_mapping, block_table, token_to_req_indices, is_valid_token,
               swa_indices, swa_lens)

    def make():
        Rq, T, W = check_swa_decode(*args[:11])
        grid = kernels.swa_decode_grid(T, num_decode_tokens, swa_lens.shape[0])
        if grid == 0:
            return None
        R = min(Rq, seq_lens.shape[0])
        ints = kernels.swa_decode_runtime_args(Rq, R, T, num_decode_tokens, W, query_start_loc, seq_lens,
                                               slot_mapping, block_table, token_to_req_indices, is_valid_token,
                                               (swa_indices.stride(0), swa_indices.stride(-1)), swa_lens)
        meta = kernels.swa_decode_constexprs(window_size, block_size, noncausal, W,
                                             platform.target_for(swa_indices.device))
        return bind_rows(kernels.SWA_DECODE_LAUNCHER, grid, tensors, ints, meta, swa_indices.device)

    _plan("swa_decode", args, make, tensors)


def _swa_decode_kernel(swa_indices, swa_lens, token_to_req_indices, is_valid_token, window_size, query_start_loc,
                       seq_lens, slot_mapping, block_table, block_size, num_decode_tokens, noncausal=False):
    _swa_decode_launch(noncausal, swa_indices, swa_lens, token_to_req_indices, is_valid_token, window_size,
                       query_start_loc, seq_lens, slot_mapping, block_table, block_size, num_decode_tokens)


def _swa_decode_reference(swa_indices, swa_lens, token_to_req_indices, is_valid_token, window_size,
                          query_start_loc, seq_lens, slot_mapping, block_table, block_size, num_decode_tokens,
                          noncausal=False):
    args = (swa_indices, swa_lens, token_to_req_indices, is_valid_token, window_size, query_start_loc, seq_lens,
            slot_mapping, block_table, block_size, num_decode_tokens)
    check_swa_decode(*args)
    reference.prepare_swa_decode(*args, noncausal)


def _swa_decode_fake(swa_indices, swa_lens, token_to_req_indices, is_valid_token, window_size, query_start_loc,
                     seq_lens, slot_mapping, block_table, block_size, num_decode_tokens, noncausal=False):
    check_swa_decode(swa_indices, swa_lens, token_to_req_indices, is_valid_token, window_size, query_start_loc,
                     seq_lens, slot_mapping, block_table, block_size, num_decode_tokens)


def _swa_decode_examples():
    g = torch.Generator().manual_seed(0)
    qlens, seq = [2] * 6 + [0, 2], [2, 130, 300, 64, 1000, 5, 9, 170]
    T = sum(qlens)
    qsl = torch.tensor([0] + [sum(qlens[:i + 1]) for i in range(len(qlens))], dtype=torch.int32)
    slots = torch.randint(-1, 9000, (T + 3,), generator=g)
    bt = torch.randint(-1, 3000, (len(qlens), 20), generator=g, dtype=torch.int32)
    full = lambda *shape: torch.full(shape, 7, dtype=torch.int32)  # noqa: E731
    return {"8 MTP decodes (one empty), 3 padding tokens, window 128": (
        full(T + 5, 1, 128), full(T + 9), full(T + 3), torch.zeros(T + 3, dtype=torch.bool), 128, qsl,
        torch.tensor(seq, dtype=torch.int32), slots, bt, 64, T)}


# --- registration ------------------------------------------------------------------------------
_SLOT_ARGS = "SymInt num_tokens, Tensor query_start_loc, Tensor seq_lens, Tensor block_table, int block_size, " \
             "int compress_ratio"
_slot_op = register_op(f"get_compressed_slot_mapping({_SLOT_ARGS}) -> Tensor", reference=_slot_reference,
                       kernel=_slot_kernel, fake=_slot_fake, examples=_slot_examples)
_slot_out_op = register_op(f"get_compressed_slot_mapping_out({_SLOT_ARGS}, Tensor(a!) out) -> ()",
                           reference=_slot_out_reference, kernel=_slot_out_kernel, fake=_slot_out_fake,
                           examples=_slot_out_examples)

_SWA_ARGS = "(Tensor(a!) swa_indices, Tensor(b!) swa_lens, int window_size, Tensor query_start_loc, " \
            "Tensor seq_lens, Tensor token_to_req_indices, Tensor is_valid_token, Tensor block_table, " \
            "int block_size, SymInt token_offset=0) -> ()"
_swa_op = register_op(f"compute_swa_indices_and_lens{_SWA_ARGS}", reference=_swa_reference, kernel=_swa_kernel,
                      fake=_swa_fake, examples=_swa_examples)
_swa_nc_op = register_op(f"compute_dspark_noncausal_swa_indices_and_lens{_SWA_ARGS}", reference=_swa_nc_reference,
                         kernel=_swa_nc_kernel, fake=_swa_fake, examples=_swa_nc_examples)

_GL_ARGS = "Tensor seq_lens, Tensor query_start_loc, SymInt num_decodes, SymInt num_prefills, int window_size"
_gather_lens_op = register_op(f"compute_prefill_gather_lens({_GL_ARGS}) -> Tensor", reference=_gather_lens_reference,
                              kernel=_gather_lens_kernel, fake=_gather_lens_fake, examples=_gather_lens_examples)
_gather_lens_out_op = register_op(f"compute_prefill_gather_lens_out({_GL_ARGS}, Tensor(a!) out) -> ()",
                                  reference=_gather_lens_out_reference, kernel=_gather_lens_out_kernel,
                                  fake=_gather_lens_out_fake, examples=_gather_lens_out_examples)

_uniform_op = register_op(
    "prepare_uniform_decode(Tensor seq_lens, Tensor(a!) decode_seq_lens, Tensor block_table, "
    "Tensor(b!) expanded_block_table, Tensor(c!) decode_lens, SymInt max_decode_len, SymInt num_decode_tokens) -> ()",
    reference=_uniform_reference, kernel=_uniform_kernel, fake=_uniform_fake, examples=_uniform_examples)

_varlen_op = register_op(
    "prepare_varlen_decode(Tensor query_start_loc, Tensor seq_lens, Tensor block_table, Tensor(a!) decode_seq_lens, "
    "Tensor(b!) expanded_block_table, Tensor(c!) decode_lens, Tensor(d!) decode_indices, SymInt num_decodes, "
    "SymInt num_decode_tokens) -> ()",
    reference=_varlen_reference, kernel=_varlen_kernel, fake=_varlen_fake, examples=_varlen_examples)

_chunk_op = register_op(
    "fill_prefill_chunk_metadata(Tensor query_start_loc, Tensor uncompressed_seq_lens, Tensor compressed_seq_lens, "
    "SymInt start_idx, SymInt end_idx, SymInt query_start, SymInt query_end, int compress_ratio, int dcp_rank, "
    "int dcp_world_size, int cp_kv_cache_interleave_size, Tensor(a!) cu_seq_lens, Tensor(b!) cu_seqlen_ks, "
    "Tensor(c!) cu_seqlen_ke, Tensor(d!) token_to_seq) -> ()",
    reference=_chunk_reference, kernel=_chunk_kernel, fake=_chunk_fake, examples=_chunk_examples)


_token_op = register_op(
    "prepare_token_metadata(Tensor query_start_loc, Tensor slot_mapping, Tensor(a!) token_to_req_indices, "
    "Tensor(b!) is_valid_token) -> ()",
    reference=_token_reference, kernel=_token_kernel, fake=_token_fake, examples=_token_examples)

_native_op = register_op(
    "prepare_native_decode(Tensor query_start_loc, Tensor seq_lens, Tensor(a!) decode_lens, "
    "Tensor(b!) decode_seq_lens, SymInt num_decodes, SymInt max_decode_len, int compress_ratio) -> ()",
    reference=_native_reference, kernel=_native_kernel, fake=_native_fake, examples=_native_examples)


_swa_decode_op = register_op(
    "prepare_swa_decode(Tensor(a!) swa_indices, Tensor(b!) swa_lens, Tensor(c!) token_to_req_indices, "
    "Tensor(d!) is_valid_token, int window_size, Tensor query_start_loc, Tensor seq_lens, Tensor slot_mapping, "
    "Tensor block_table, int block_size, SymInt num_decode_tokens, bool noncausal=False) -> ()",
    reference=_swa_decode_reference, kernel=_swa_decode_kernel, fake=_swa_decode_fake,
    examples=_swa_decode_examples)


# --- public functions (vLLM's names, argument names, order and defaults) --------------------------
def get_compressed_slot_mapping(num_tokens: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                block_table: torch.Tensor, block_size: int, compress_ratio: int,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    """Compressed-cache slot of every uncompressed token (-1 for most): row qsl[b] + i of request b
    (position pos) holds lookup(block_table, b, pos // compress_ratio, block_size) when
    (pos + 1) % compress_ratio == 0, else -1 (SPEC §3.4).

    query_start_loc: [R+1] int32/int64, non-decreasing. seq_lens: [>= R]. block_table: [R', W]
    int32/int64 (this group's own table; negative entries give -1). block_size: the storage block
    size, 256 // compress_ratio. Returns [num_tokens] int64. With `out` ([any] int64), all of out is
    set to -1 first and out[:num_tokens] is returned.
    """
    if out is None:
        return _slot_op(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio)
    _slot_out_op(num_tokens, query_start_loc, seq_lens, block_table, block_size, compress_ratio, out)
    return out[:num_tokens]


def compute_swa_indices_and_lens(swa_indices: torch.Tensor, swa_lens: torch.Tensor, window_size: int,
                                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                 token_to_req_indices: torch.Tensor, is_valid_token: torch.Tensor,
                                 block_table: torch.Tensor, block_size: int, token_offset: int = 0) -> None:
    """Causal sliding-window slots of each token (SPEC §3.4), oldest first from column 0.

    swa_indices: [rows, W] or [rows, 1, W] int32, W >= window_size; swa_lens: [>= rows] int32.
    Row i is token t = token_offset + i of request r = token_to_req_indices[t] ([>= t+1] int) at
    position pos: columns c < n = min(pos+1, window_size) hold lookup(block_table, r,
    max(pos - window_size + 1, 0) + c, block_size), later columns -1; swa_lens[i] = n. Invalid
    tokens (is_valid_token [bool] False, r outside [0, R), pos < 0) get an all -1 row and length 0.
    """
    _swa_op(swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
            block_table, block_size, token_offset)


def compute_dspark_noncausal_swa_indices_and_lens(swa_indices: torch.Tensor, swa_lens: torch.Tensor,
                                                  window_size: int, query_start_loc: torch.Tensor,
                                                  seq_lens: torch.Tensor, token_to_req_indices: torch.Tensor,
                                                  is_valid_token: torch.Tensor, block_table: torch.Tensor,
                                                  block_size: int, token_offset: int = 0) -> None:
    """DSpark (non-causal draft block) SWA slots (SPEC §3.4): every token of request r gets the same
    row, the trailing window of context plus every query token: start = max(prefix - window_size,
    0), n = min(seq - start, W), columns c < n hold lookup(block_table, r, start + c, block_size),
    later columns -1, swa_lens = n. Same arguments and invalid-token rule as
    `compute_swa_indices_and_lens`; W is normally `get_dspark_swa_index_width(window, num_spec)`.
    """
    _swa_nc_op(swa_indices, swa_lens, window_size, query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
               block_table, block_size, token_offset)


def compute_prefill_gather_lens(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_decodes: int,
                                num_prefills: int, window_size: int, out: torch.Tensor | None = None
                                ) -> torch.Tensor:
    """Trailing tokens to gather per prefill (SPEC §3.4): out[i] = query_len[r] + clamp(prefix_len[r],
    0, window_size - 1), r = num_decodes + i. seq_lens: [>= nd+np], query_start_loc: [>= nd+np+1]
    (int32/int64). Returns [num_prefills] int32, or out[:num_prefills] of `out` ([>= np] int32)."""
    if out is None:
        return _gather_lens_op(seq_lens, query_start_loc, num_decodes, num_prefills, window_size)
    _gather_lens_out_op(seq_lens, query_start_loc, num_decodes, num_prefills, window_size, out)
    return out[:num_prefills]


def prepare_uniform_decode(seq_lens: torch.Tensor, decode_seq_lens: torch.Tensor, block_table: torch.Tensor,
                           expanded_block_table: torch.Tensor, decode_lens: torch.Tensor, max_decode_len: int,
                           num_decode_tokens: int) -> None:
    """Flatten uniform multi-token decodes into one row per token (indexer, SPEC §3.4).

    Row idx < num_decode_tokens of request r = idx // L, j = idx % L (L = max_decode_len):
    decode_seq_lens[idx] = max(seq_lens[r] - L + j + 1, 0), expanded_block_table[idx, :w] =
    block_table[r, :w] (w the smaller width; later columns -1), decode_lens[idx] = 1.
    seq_lens [>= R], block_table [>= R, *] int32/int64 with R = ceil(num_decode_tokens / L);
    decode_seq_lens, decode_lens [>= num_decode_tokens] int32; expanded_block_table
    [>= num_decode_tokens, W'] int32/int64.
    """
    _uniform_op(seq_lens, decode_seq_lens, block_table, expanded_block_table, decode_lens, max_decode_len,
                num_decode_tokens)


def prepare_varlen_decode(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                          decode_seq_lens: torch.Tensor, expanded_block_table: torch.Tensor,
                          decode_lens: torch.Tensor, decode_indices: torch.Tensor, num_decodes: int,
                          num_decode_tokens: int) -> None:
    """Flatten ragged decodes into one row per token (indexer flatten path, SPEC §3.6.2 step 3).

    Row qsl[b] - qsl[0] + j of decode request b < num_decodes (j < dl_b = query_len[b]):
    decode_seq_lens = max(seq_b - dl_b + j + 1, 0), expanded_block_table row = block_table[b]
    (as in `prepare_uniform_decode`), decode_indices = b. Rows from E = qsl[nd] - qsl[0] up to
    num_decode_tokens are padding: decode_seq_lens 0, table row [0, -1, ...], decode_indices
    nd + (row - E). decode_lens = 1 on every row. decode_seq_lens, decode_lens, decode_indices:
    [>= num_decode_tokens] int32. (A package addition: vLLM does this with torch ops.)
    """
    _varlen_op(query_start_loc, seq_lens, block_table, decode_seq_lens, expanded_block_table, decode_lens,
               decode_indices, num_decodes, num_decode_tokens)


def fill_prefill_chunk_metadata(query_start_loc, uncompressed_seq_lens, compressed_seq_lens, start_idx: int,
                                end_idx: int, query_start: int, query_end: int, compress_ratio: int,
                                dcp_rank: int, dcp_world_size: int, cp_kv_cache_interleave_size: int, cu_seq_lens,
                                cu_seqlen_ks, cu_seqlen_ke, token_to_seq) -> None:
    """The device part of `build_prefill_chunk_metadata` (SPEC §3.4 steps 2 and 4), one program per
    request of [start_idx, end_idx): cu_seq_lens[:n+1] = [0, cumsum(compressed)], ks/ke for the
    chunk-relative query rows [query_start, query_end), token_to_seq (all of it; -1 past
    cu_seq_lens[n]). Negative compressed lengths count as 0. All outputs int32."""
    _chunk_op(query_start_loc, uncompressed_seq_lens, compressed_seq_lens, start_idx, end_idx, query_start, query_end,
              compress_ratio, dcp_rank, dcp_world_size, cp_kv_cache_interleave_size, cu_seq_lens, cu_seqlen_ks,
              cu_seqlen_ke, token_to_seq)


def prepare_token_metadata(query_start_loc: torch.Tensor, slot_mapping: torch.Tensor,
                           token_to_req_indices: torch.Tensor, is_valid_token: torch.Tensor) -> None:
    """Per-token request ids and validity of one step (SPEC §3.6.1 steps 2 and 3, one launch; a package
    addition). For rows t < T = len(slot_mapping): token_to_req_indices[t] = the request b with
    qsl[b] <= t < qsl[b+1], 0 where there is none (padding rows); is_valid_token[t] =
    slot_mapping[t] >= 0. query_start_loc [R+1] int32/int64, non-decreasing; slot_mapping [T]
    int64/int32; token_to_req_indices [>= T] int32; is_valid_token [>= T] bool."""
    _token_op(query_start_loc, slot_mapping, token_to_req_indices, is_valid_token)


def prepare_native_decode(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, decode_lens: torch.Tensor,
                          decode_seq_lens: torch.Tensor, num_decodes: int, max_decode_len: int,
                          compress_ratio: int = 1) -> None:
    """The indexer's native decode lengths (SPEC §3.6.2 step 3, native path, one launch; a package
    addition): for decode request b < num_decodes and j < L = max_decode_len, decode_lens[b] =
    query_len[b] and decode_seq_lens[b*L + j] = max(seq_lens[b] - L + 1 + j, 0) // compress_ratio
    (the (nd, L) row-major view the logits kernel reads). decode_lens [>= nd], decode_seq_lens
    [>= nd*L] int32; query_start_loc [>= nd+1], seq_lens [>= nd] int32/int64."""
    _native_op(query_start_loc, seq_lens, decode_lens, decode_seq_lens, num_decodes, max_decode_len, compress_ratio)


def prepare_swa_decode(swa_indices: torch.Tensor, swa_lens: torch.Tensor, token_to_req_indices: torch.Tensor,
                       is_valid_token: torch.Tensor, window_size: int, query_start_loc: torch.Tensor,
                       seq_lens: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                       block_size: int, num_decode_tokens: int, noncausal: bool = False) -> None:
    """The SWA builder's decode work (SPEC §3.6.1 steps 2-4) in one launch; a package addition.

    Equal to `prepare_token_metadata(query_start_loc, slot_mapping, token_to_req_indices,
    is_valid_token)`, then `compute_swa_indices_and_lens` (or the DSpark variant when `noncausal`)
    into rows [0, num_decode_tokens) of swa_indices / swa_lens with token_offset 0, then
    swa_lens[num_decode_tokens:] = 0. swa_indices [>= ndt, W] or [>= ndt, 1, W] int32 (rows past ndt
    untouched); swa_lens [>= ndt] int32; the rest as in those two ops."""
    _swa_decode_op(swa_indices, swa_lens, token_to_req_indices, is_valid_token, window_size, query_start_loc,
                   seq_lens, slot_mapping, block_table, block_size, num_decode_tokens, noncausal)
