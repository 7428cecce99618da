"""Host planners (SPEC §3.5) and the two host widths of §3.4 / §3.6.2.

Plain Python over host ints: the `*_cpu` arguments are 1-D CPU tensors or lists of ints, read once
with `.tolist()`. Nothing here touches device data, so nothing here can synchronise the stream.
"""
from __future__ import annotations

from typing import Any

import torch

from .. import layout


# --- validation (ValueError naming the argument) -------------------------------------------------
def host_int(name: str, value, minimum: int | None = None) -> int:
    """`value`, a Python int (not a bool) >= `minimum`; ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def _bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _host_list(name: str, values, *, boolean: bool = False) -> list:
    """A 1-D CPU tensor or a list/tuple as a Python list (of ints, or of bools with `boolean`)."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor (host planners never read device data), "
                             f"got one on {values.device}")
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        integer = not (values.is_floating_point() or values.is_complex() or values.dtype == torch.bool)
        if (values.dtype != torch.bool) if boolean else not integer:
            raise ValueError(f"{name} must have {'bool' if boolean else 'an integer'} dtype, got {values.dtype}")
        return values.tolist()
    if isinstance(values, (list, tuple)):
        kinds = (bool, int) if boolean else int
        if any(not isinstance(v, kinds) or (not boolean and isinstance(v, bool)) for v in values):
            raise ValueError(f"{name} must hold only {'bools' if boolean else 'ints'}")
        return [bool(v) for v in values] if boolean else list(values)
    raise ValueError(f"{name} must be a 1-D CPU tensor or a list, got {type(values).__name__}")


def _lengths(name: str, values) -> list[int]:
    out = _host_list(name, values)
    if any(v < 0 for v in out):
        raise ValueError(f"{name} must hold lengths >= 0")
    return out


def _same_length(name_a: str, a: list, name_b: str, b: list) -> None:
    if len(a) != len(b):
        raise ValueError(f"{name_a} has {len(a)} entries but {name_b} has {len(b)}")


# --- planners ------------------------------------------------------------------------------------
def split_decodes_and_prefills(batch: Any, decode_threshold: int = 1, require_uniform: bool = False,
                               treat_short_extends_as_decodes: bool = True) -> tuple[int, int, int, int]:
    """Split an ordered batch (decodes, short extends, long extends, prefills) at its first prefill.

    `batch` needs `query_start_loc_cpu` ([R+1] int32, CPU), `max_query_len` (int), `num_actual_tokens`
    (int) and, when `treat_short_extends_as_decodes` is False, `is_prefilling` ([R] bool, CPU).
    Returns `(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)` as ints; an empty
    batch (R = 0) gives `(0, 0, 0, 0)`.
    """
    thr = host_int("decode_threshold", decode_threshold, 0)
    uniform = _bool("require_uniform", require_uniform)
    short = _bool("treat_short_extends_as_decodes", treat_short_extends_as_decodes)
    qsl = _host_list("query_start_loc_cpu", batch.query_start_loc_cpu)
    if not qsl:
        raise ValueError("query_start_loc_cpu must have R+1 >= 1 entries")
    if any(b < a for a, b in zip(qsl, qsl[1:])):
        raise ValueError("query_start_loc_cpu must be non-decreasing")
    max_query_len = host_int("max_query_len", batch.max_query_len, 0)
    T = host_int("num_actual_tokens", batch.num_actual_tokens, 0)
    R = len(qsl) - 1
    is_prefilling = None
    if not short:
        if getattr(batch, "is_prefilling", None) is None:
            raise ValueError("is_prefilling is required when treat_short_extends_as_decodes is False")
        is_prefilling = _host_list("is_prefilling", batch.is_prefilling, boolean=True)
        if len(is_prefilling) != R:
            raise ValueError(f"is_prefilling has {len(is_prefilling)} entries, expected R = {R}")
    if R == 0:
        return 0, 0, 0, 0

    if max_query_len <= thr and (not uniform or thr <= 1) and short:
        return R, 0, T, 0
    q = [b - a for a, b in zip(qsl, qsl[1:])]
    if q[0] > thr:
        return 0, R, 0, T
    if uniform:
        if short and all(x == q[0] or x == 0 for x in q):
            return R, 0, T, 0
        is_prefill = [x != q[0] for x in q]
    else:
        is_prefill = [x > thr for x in q]
    if not short:
        is_prefill = [a or b for a, b in zip(is_prefill, is_prefilling)]
    if not any(is_prefill):
        return R, 0, T, 0
    nd = is_prefill.index(True)
    return nd, R - nd, qsl[nd], T - qsl[nd]


def split_indexer_prefill_chunks(seq_lens_cpu, query_lens_cpu, workspace_size: int, max_logits_bytes: int,
                                 request_offset: int = 0) -> list[tuple[slice, slice]]:
    """Chunk prefill requests so each chunk's K fits the gather workspace and its fp32 logits fit the budget.

    `seq_lens_cpu` and `query_lens_cpu` are [n] ints (CPU tensor or list; in DSV4 the seq lens are
    compressed). Returns `(request slice, query slice)` pairs: requests `[s0, s1)` shifted by
    `request_offset`, and a range of the chunk's concatenated query tokens. A request that alone
    exceeds a limit forms its own chunk, its queries split one row (or `elems // k` rows) at a time.
    """
    seq = _lengths("seq_lens_cpu", seq_lens_cpu)
    q = _lengths("query_lens_cpu", query_lens_cpu)
    _same_length("seq_lens_cpu", seq, "query_lens_cpu", q)
    ws = host_int("workspace_size", workspace_size, 0)
    elems = host_int("max_logits_bytes", max_logits_bytes, 0) // 4
    offset = host_int("request_offset", request_offset, 0)

    chunks: list[tuple[slice, slice]] = []
    n, i = len(seq), 0
    while i < n:
        s0, m, k = i, 0, 0
        while i < n and k + seq[i] <= ws and (m + q[i]) * (k + seq[i]) <= elems:
            m += q[i]
            k += seq[i]
            i += 1
        if i == s0:
            m, k = q[i], seq[i]
            i += 1
        step = max(1, elems // k) if k > 0 else max(1, m)
        for off in range(0, m, step):
            chunks.append((slice(s0 + offset, i + offset), slice(off, min(off + step, m))))
    return chunks


def get_prefill_chunk_plan(prefill_seq_lens_cpu, prefill_query_lens_cpu, window_size: int, max_model_len: int,
                           max_num_batched_tokens: int, compress_ratio: int,
                           prefill_chunk_size: int = 4) -> list[tuple[int, int, int, int]]:
    """Group consecutive prefills into chunks whose gathered workspace stays under an area cap.

    `prefill_seq_lens_cpu` and `prefill_query_lens_cpu` are [n] ints (CPU tensor or list). Returns
    `(cs, ce, chunk_N, chunk_M)` per chunk: requests `[cs, ce)`, `chunk_N` their largest compressed
    length and `chunk_M` that plus their largest gather length. `[]` when n = 0.
    **Addition:** a request whose own area exceeds the cap still forms a chunk by itself, so the plan
    always covers every request.
    """
    seq = _lengths("prefill_seq_lens_cpu", prefill_seq_lens_cpu)
    q = _lengths("prefill_query_lens_cpu", prefill_query_lens_cpu)
    _same_length("prefill_seq_lens_cpu", seq, "prefill_query_lens_cpu", q)
    window = host_int("window_size", window_size, 1)
    mml = host_int("max_model_len", max_model_len, 0)
    mnbt = host_int("max_num_batched_tokens", max_num_batched_tokens, 0)
    ratio = host_int("compress_ratio", compress_ratio, 0)     # 0 and 1: no compressed cache (SWA-only layers)
    chunk_size = host_int("prefill_chunk_size", prefill_chunk_size, 1)

    cap = chunk_size * ((0 if ratio <= 1 else layout.cdiv(mml, ratio)) + window + mnbt)
    gath = [qi + min(max(si - qi, 0), window - 1) for si, qi in zip(seq, q)]
    comp = [0 if ratio <= 1 else si // ratio for si in seq]

    plan: list[tuple[int, int, int, int]] = []
    n, cs = len(seq), 0
    while cs < n:
        C, G, ce = comp[cs], gath[cs], cs + 1
        while ce < n and (ce - cs + 1) * (max(C, comp[ce]) + max(G, gath[ce])) <= cap:
            C, G = max(C, comp[ce]), max(G, gath[ce])
            ce += 1
        plan.append((cs, ce, C, C + G))
        cs = ce
    return plan


# --- host widths ---------------------------------------------------------------------------------
def get_dspark_swa_index_width(window_size: int, num_speculative_tokens: int) -> int:
    """Row width W of the DSpark non-causal SWA indices: round_up(max(window, 0) + max(num_spec, 0), 64)."""
    window = host_int("window_size", window_size)
    num_spec = host_int("num_speculative_tokens", num_speculative_tokens)
    return layout.round_up(max(window, 0) + max(num_spec, 0), layout.DSPARK_WIDTH_ALIGN)


def get_max_prefill_buffer_size(max_model_len: int) -> int:
    """Default indexer prefill gather workspace, in compressed tokens: max_model_len * 40."""
    return host_int("max_model_len", max_model_len, 0) * layout.PREFILL_BUFFER_TOKENS_PER_MODEL_LEN
