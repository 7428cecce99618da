"""Triton kernels and launchers for the indexer K cache (SPEC §2.2, §3.9).

* `indexer_insert_kernel`: grid `insert_grid` (one program per group of TOKENS rows, or, for long inserts, fewer
  programs that walk their groups: LOOP). A group of TOKENS rows [TOKENS, 128] is quantised with one exact UE8M0
  exponent per row (the bit rule of kernels/k_cache.py), storing 128 fp8 codes and the fp32 scale 2**e of each
  row whose slot is inside the cache; every load of a group comes before its first store (LOOP: the next group's
  loads too).
* `indexer_gather_kernel`: grid (B, workers), workers = min(cdiv(Nk, ROWS), MAX_WORKERS) from shapes only.
  Program (b, w) copies entries c = w*ROWS, w*ROWS + workers*ROWS, ... < cu[b+1] - cu[b] of request b into
  rows cu[b] + c of dst_k / dst_scale, bit for bit (zeros for an invalid block), skipping rows outside
  [0, Nk).

Cache addressing is int64 (`block * block_stride`); token counts, strides and table widths are runtime
arguments; the block size and the fp8 flavour are constexprs (SPEC §4 h). PDL (sm_90+): both kernels launch as
programmatic dependents and wait for their predecessor's writes before their first load.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layout, platform
from ..reference.k_cache import fp8_format
from ._launch import FastLauncher, launch_options  # noqa: F401  (ops use kernels.launch_options)
from .early import pdl_open, pdl_wait
from .k_cache import ue8m0_codec, ue8m0_codes, ue8m0_exponents

INSERT_TOKENS = 16           # rows per insert group (4 KB of bf16 in, 2 KB of codes and 64 B of scales out)
INSERT_MAX_WARPS = 4         # ... on at most this many warps
INSERT_PROGRAMS_PER_SM = 16  # a longer insert runs this many programs per SM, each walking its groups (`insert_grid`)
GATHER_ROWS = 16             # rows per gather step
MAX_WORKERS = 256            # gather programs per request, at most


@triton.jit
def _insert_loads(k_ptr, slot_ptr, t0, n_tokens, k_stride, slot_stride, D: tl.constexpr, TOKENS: tl.constexpr):
    """Slots [TOKENS] (int64, -1 past n_tokens) and rows [TOKENS, D] (fp32) of tokens t0 .. t0 + TOKENS."""
    t = t0 + tl.arange(0, TOKENS)
    live = t < n_tokens
    t = tl.where(live, t, 0)
    d = tl.arange(0, D)
    slot = tl.load(slot_ptr + t * slot_stride, mask=live, other=-1).to(tl.int64)
    x = tl.load(k_ptr + t[:, None] * k_stride + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    return slot, x


@triton.jit
def _insert_rows(cache_ptr, slot, x, num_slots, block_stride, BS: tl.constexpr, D: tl.constexpr,
                 SCALE_BYTES: tl.constexpr, FMT: tl.constexpr, SW: tl.constexpr, FP8_MAX: tl.constexpr,
                 E_SHIFT: tl.constexpr, MANT_LIMIT: tl.constexpr, FLOOR_BITS: tl.constexpr, BIAS: tl.constexpr,
                 NAN_CODE: tl.constexpr, SAT: tl.constexpr):
    """Quantise rows x and store their codes and scales at `slot` (those inside the cache)."""
    d = tl.arange(0, D)
    e = ue8m0_exponents(x, E_SHIFT, MANT_LIMIT, FLOOR_BITS)
    codes = ue8m0_codes(x, e, FMT, SW, FP8_MAX, BIAS, NAN_CODE, SAT)
    scale_bits = (e + BIAS) << 23                                        # 2**e, a normal fp32
    valid = (slot >= 0) & (slot < num_slots)                            # every negative slot and past the cache: skip
    slot = tl.where(valid, slot, 0)
    page = cache_ptr + (slot // BS) * block_stride
    off = slot % BS
    tl.store(page[:, None] + (off * D)[:, None] + d[None, :], codes, mask=valid[:, None])
    tl.store((page + BS * D + off * SCALE_BYTES).to(tl.pointer_type(tl.int32)), scale_bits, mask=valid)


@triton.jit
def indexer_insert_kernel(
    k_ptr, cache_ptr, slot_ptr, n_tokens, k_stride, slot_stride, num_slots, block_stride,
    BS: tl.constexpr, D: tl.constexpr, SCALE_BYTES: tl.constexpr, FMT: tl.constexpr, SW: tl.constexpr,
    FP8_MAX: tl.constexpr, E_SHIFT: tl.constexpr, MANT_LIMIT: tl.constexpr, FLOOR_BITS: tl.constexpr,
    BIAS: tl.constexpr, NAN_CODE: tl.constexpr, SAT: tl.constexpr, TOKENS: tl.constexpr, PDL: tl.constexpr,
    LOOP: tl.constexpr = False,
):
    pdl_open(PDL, 0)
    pdl_wait(PDL, 0)
    t0 = tl.program_id(0).to(tl.int64) * TOKENS
    slot, x = _insert_loads(k_ptr, slot_ptr, t0, n_tokens, k_stride, slot_stride, D, TOKENS)
    if LOOP:
        # a grid smaller than the groups: each program walks its groups, the next one's loads issued before this
        # one's stores
        step = tl.num_programs(0).to(tl.int64) * TOKENS
        for g in range(t0, n_tokens, step):
            slot1, x1 = _insert_loads(k_ptr, slot_ptr, g + step, n_tokens, k_stride, slot_stride, D, TOKENS)
            _insert_rows(cache_ptr, slot, x, num_slots, block_stride, BS, D, SCALE_BYTES, FMT, SW, FP8_MAX, E_SHIFT,
                         MANT_LIMIT, FLOOR_BITS, BIAS, NAN_CODE, SAT)
            slot, x = slot1, x1
    else:
        _insert_rows(cache_ptr, slot, x, num_slots, block_stride, BS, D, SCALE_BYTES, FMT, SW, FP8_MAX, E_SHIFT,
                     MANT_LIMIT, FLOOR_BITS, BIAS, NAN_CODE, SAT)


@triton.jit
def indexer_gather_kernel(
    cache_ptr, dk_ptr, ds_ptr, bt_ptr, cu_ptr, rows, dk_s0, ds_row, ds_byte, bt_s0, bt_s1, bt_width, bt_rows,
    num_blocks, block_stride, cu_s,
    BS: tl.constexpr, D: tl.constexpr, SCALE_BYTES: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_open(PDL, 0)
    pdl_wait(PDL, 0)
    b = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1)
    step = tl.num_programs(1) * ROWS
    c0 = tl.load(cu_ptr + b * cu_s).to(tl.int64)
    n = tl.load(cu_ptr + (b + 1) * cu_s).to(tl.int64) - c0
    width = tl.where(b < bt_rows, bt_width, 0)                           # a request without a table row: no source
    # only entries whose row lies in [0, rows): hostile cu values cost no empty iterations
    c_first = tl.maximum(-c0, 0)
    n = tl.minimum(n, rows - c0)
    i = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    sb = tl.arange(0, SCALE_BYTES)
    for c_lo in range(c_first + w * ROWS, n, step):
        c = c_lo + i
        dst = c0 + c
        live = (c < n) & (dst >= 0) & (dst < rows)
        col = c // BS
        col_ok = live & (col < width)
        blk = tl.load(bt_ptr + b * bt_s0 + col * bt_s1, mask=col_ok, other=-1).to(tl.int64)
        ok = col_ok & (blk >= 0) & (blk < num_blocks)
        page = cache_ptr + tl.where(ok, blk, 0) * block_stride
        off = c % BS
        codes = tl.load(page[:, None] + (off * D)[:, None] + d[None, :], mask=ok[:, None], other=0)
        scale = tl.load(page[:, None] + BS * D + (off * SCALE_BYTES)[:, None] + sb[None, :], mask=ok[:, None],
                        other=0)
        dst = tl.where(live, dst, 0)
        tl.store(dk_ptr + dst[:, None] * dk_s0 + d[None, :], codes, mask=live[:, None])
        tl.store(ds_ptr + dst[:, None] * ds_row + sb[None, :] * ds_byte, scale, mask=live[:, None])


INSERT_LAUNCHER = FastLauncher(indexer_insert_kernel)
GATHER_LAUNCHER = FastLauncher(indexer_gather_kernel)


# --- host-side planning ---------------------------------------------------------------------------------
def insert_grid(tokens: int, multiprocessor_count: int, target: platform.Target) -> tuple[int, bool]:
    """(programs, LOOP) of an insert of `tokens` rows: a program per INSERT_TOKENS rows, or, past
    INSERT_PROGRAMS_PER_SM per multiprocessor (1 under the interpreter, whose tests then walk the loop), that many
    programs walking their groups in turn (LOOP). Shapes only."""
    groups = layout.cdiv(tokens, INSERT_TOKENS)
    cap = (1 if target.backend == "interpreter" else INSERT_PROGRAMS_PER_SM) * multiprocessor_count
    return min(groups, cap), groups > cap


def insert_constexprs(block_size: int, use_fnuz: bool, target: platform.Target, loop: bool = False) -> dict:
    return dict(BS=block_size, D=layout.INDEXER_DIM, SCALE_BYTES=layout.INDEXER_SCALE_BYTES,
                **ue8m0_codec(fp8_format(use_fnuz), target), TOKENS=INSERT_TOKENS, PDL=platform.supports_pdl(target),
                LOOP=loop,
                num_warps=min(INSERT_MAX_WARPS, platform.num_warps_for(target, INSERT_TOKENS * layout.INDEXER_DIM)))


def insert_runtime_args(n_tokens: int, k_stride: int, slot_stride: int, num_slots: int, block_stride: int) -> tuple:
    """The int arguments after the 3 tensors (k as bf16, cache as uint8, slot_mapping)."""
    return (n_tokens, k_stride, slot_stride, num_slots, block_stride)


def gather_constexprs(block_size: int, target: platform.Target) -> dict:
    return dict(BS=block_size, D=layout.INDEXER_DIM, SCALE_BYTES=layout.INDEXER_SCALE_BYTES, ROWS=GATHER_ROWS,
                PDL=platform.supports_pdl(target),
                num_warps=platform.num_warps_for(target, GATHER_ROWS * layout.INDEXER_DIM, per_thread=16))


def gather_workers(rows: int) -> int:
    """Programs per request: one step each over `rows` destination rows, at most MAX_WORKERS (shapes only)."""
    return max(1, min(layout.cdiv(rows, GATHER_ROWS), MAX_WORKERS))


def gather_runtime_args(rows: int, dk_s0: int, ds_row: int, ds_byte: int, bt_strides, bt_width: int, bt_rows: int,
                        num_blocks: int, block_stride: int, cu_s: int) -> tuple:
    """The int arguments after the 5 tensors (cache, dst_k, dst_scale as uint8; block_table; cu_seq_lens)."""
    return (rows, dk_s0, ds_row, ds_byte, bt_strides[0], bt_strides[1], bt_width, bt_rows, num_blocks, block_stride,
            cu_s)


# --- compile matrix ---------------------------------------------------------------------------------------
def matrix_launch_insert(target: platform.Target, block_size: int, use_fnuz: bool, slot_dtype=torch.int64,
                         loop: bool = False):
    """What ops/indexer.py passes to indexer_insert_kernel for one call (contiguous k, an engine-padded cache)."""
    from .matrix import Ptr

    meta = launch_options(insert_constexprs(block_size, use_fnuz, target, loop))
    stride = layout.round_up(layout.indexer_block_bytes(block_size), layout.PAGE_ALIGN)
    ints = insert_runtime_args(37, layout.INDEXER_DIM, 1, 16 * block_size, stride)
    name = f"indexer_insert.bs{block_size}.{'fnuz' if use_fnuz else 'ocp'}" \
        + ("" if slot_dtype == torch.int64 else ".slot32") + (".loop" if loop else "")
    return name, (Ptr(torch.bfloat16), Ptr(torch.uint8), Ptr(slot_dtype)), ints, meta


def matrix_launch_gather(target: platform.Target, block_size: int, table_dtype=torch.int32):
    """What ops/indexer.py passes to indexer_gather_kernel (4 requests, 8-column table, Nk 1000)."""
    from .matrix import Ptr

    meta = launch_options(gather_constexprs(block_size, target))
    stride = layout.round_up(layout.indexer_block_bytes(block_size), layout.PAGE_ALIGN)
    ints = gather_runtime_args(1000, layout.INDEXER_DIM, layout.INDEXER_SCALE_BYTES, 1, (8, 1), 8, 4, 64, stride, 1)
    name = f"indexer_gather.bs{block_size}" + ("" if table_dtype == torch.int32 else ".table64")
    tensors = (Ptr(torch.uint8), Ptr(torch.uint8), Ptr(torch.uint8), Ptr(table_dtype), Ptr(torch.int32))
    return name, tensors, ints, meta


def matrix_cases(target: platform.Target) -> list:
    """Every specialisation the indexer cache ops launch on `target`: block sizes 64 and 16, OCP and FNUZ, int64
    and int32 slots, inserts of one group per program and looping ones; gather with int32 and int64 tables."""
    from .matrix import dedupe, kernel_case

    def case(fn, launch):
        name, tensors, ints, meta = launch
        return kernel_case(target, name, fn, tensors, ints, meta)

    cases = []
    for bs in (64, 16):
        for fnuz in (False, True):
            cases.append(case(indexer_insert_kernel, matrix_launch_insert(target, bs, fnuz)))
        cases.append(case(indexer_insert_kernel, matrix_launch_insert(target, bs, False, torch.int32)))
        cases.append(case(indexer_insert_kernel, matrix_launch_insert(target, bs, False, loop=True)))
        for table in (torch.int32, torch.int64):
            cases.append(case(indexer_gather_kernel, matrix_launch_gather(target, bs, table)))
    return dedupe(cases)
