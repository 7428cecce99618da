"""Sparse MLA on sm_90 in Gluon (Triton 3.6): `flash_mla_sparse_fwd` (prefill over a bf16 workspace) and unsplit
`flash_mla_with_kvcache` calls (decode over fp8_ds_mla caches).

The Triton kernel (`sparse_mla.sparse_mla_kernel`) keeps an acc tile [64 heads, 512] fp32 in one 8-warp program and
spills: 31 % of the bf16 matmul rate on an H100 (benchmarks/NOTES.md, "Sparse MLA"). Here the layouts are explicit.
A program (one query row, 64 heads = the M of both products) holds Q [64, 512] in shared memory; its two
warpgroups split the N of both products: scores S = Q K^T [64, 64] (32 keys each), then O += P V [64, 512] (256
output columns each: 128 accumulator registers a thread), P moving through shared memory to the A-operand layout.
Online softmax in base 2 as the Triton kernel's; the sink enters the denominator at the end only.

* Prefill (`sparse_mla_prefill_gluon_kernel`): each step's 64 selected rows are copied with `cp.async` straight
  into one of two row buffers (zero-filled where a position is not selected). Step t's O product runs under step
  t + 1's wait for its rows and its scores; the copy of step t + 1 is issued once step t - 1's products (which read
  its buffer) are done, and runs under step t's softmax and O. H100: 44.8-46.0 % of the bf16 matmul rate on the
  benchmark's case (the Triton kernel 31-33 %).
* Decode (`sparse_mla_decode_gluon_kernel`): each step's cache bytes (codes, RoPE, scale bytes) are copied with
  `cp.async` into one of two staging buffers two steps ahead, then dequantised exactly (codes x 2^(byte - 127))
  into the row buffer. Program (row, split) over its split's share of the row's steps, split as the Triton kernel
  would be into the same partials for the same combine: planned for calls of more than 4 rows whose lists hold
  at least 4 steps; up to 4 rows keep the Triton kernel's small-batch plan, shorter lists its lower fixed cost
  (NOTES.md "Sparse MLA decode in Gluon", "Gluon launches").

`prefill_planned` / `decode_planned` say when these paths run: sm_90, Triton 3.6 (Gluon's API moves between
versions), a multiple of 64 heads (one program a row and block of 64 heads), q strides (and kv's row stride)
multiples of 8 elements, q (and kv) 16-byte aligned (16-byte copies; the op's plans take the Triton kernel for a
call at other addresses), OCP caches for the decode. Everything else keeps the Triton kernel.
"""
from __future__ import annotations

import torch
import triton

from .. import layout, platform
from ._launch import FastLauncher, triton_minor
from .sparse_mla import SMALL_DECODE_ROWS

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_init, warpgroup_mma_wait)
except ImportError:                  # a Triton without Gluon
    gluon = None

VERIFIED_TRITON = ("3.6",)
HEADS = 64
WARPS = 8
PREFILL_SHARED_MEMORY = 200704       # bytes a program takes on sm_90 (Q, two row buffers, layout scratch)
DECODE_SHARED_MEMORY = 218112        # (Q, the dequantised rows, two buffers of staged cache bytes, scratch)


def prefill_planned(target: platform.Target, hq: int, q_strides: tuple, kv_row_stride: int,
                    version: str = triton.__version__) -> bool:
    """Whether a prefill call runs the Gluon kernel (module docstring): q's token and head strides and kv's row
    stride multiples of 8 elements (16-byte copies), and the target's shared memory enough for a program."""
    return (gluon is not None and triton_minor(version) in VERIFIED_TRITON and target.backend == "cuda"
            and target.arch == 90 and hq > 0 and hq % HEADS == 0 and layout.HEAD_DIM == 512
            and all(s % 8 == 0 for s in (*q_strides[:2], kv_row_stride))
            and platform.shared_memory_limit(target) >= PREFILL_SHARED_MEMORY)


if gluon is not None:
    try:
        # 8 warps: the two warpgroups split the N of the scores [64 heads, 64 rows] and of O [64 heads, 512]
        _S_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, 32, 16]))
        _O_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, 256, 16]))
        _P_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_O_MMA.value, k_width=2))
        _SH = gl.constexpr(gl.NVMMASharedLayout.get_default_for([64, 512], gl.bfloat16))
        # the fp8_ds_mla token (layout.py): 7 blocks of 64 fp8 codes, 64 RoPE bf16, then one scale byte a block
        _DATA_BYTES = gl.constexpr(layout.TOKEN_DATA_BYTES)
        _NOPE = gl.constexpr(layout.NOPE_DIM)
        _QB = gl.constexpr(layout.QUANT_BLOCK)
        _NUM_QB = gl.constexpr(layout.NUM_QUANT_BLOCKS)
        _SCALE_BYTES = gl.constexpr(layout.SCALE_BYTES)
    except (TypeError, AttributeError, ValueError):     # a Gluon whose layout API differs: the Triton kernels only
        gluon = None

if gluon is not None:
    @gluon.jit
    def _online_step(s, ok, scale, m_i, l_i, acc, kv):
        """One step of the online softmax (base 2) on the scores s [64, 64] of the rows in kv (invalid where not
        ok): the running max and sum, acc rescaled and the step's O product issued asynchronously."""
        s = gl.where(ok[None, :], s * scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, _O_MMA))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), _P_OP), kv, acc, is_async=True)
        return m_new, l_i, acc

    @gluon.jit
    def _finish(acc, m_i, l_i, sink_ptr, SINKS: gl.constexpr):
        """(out [64, 512] bf16, lse, max_logits) of finished running state, the sink added to the denominator."""
        heads = gl.arange(0, 64, layout=gl.SliceLayout(1, _S_MMA))
        denom = l_i
        if SINKS:
            z = gl.load(sink_ptr + heads) * 1.4426950408889634
            denom = l_i + gl.exp2(z - gl.where(m_i == float("-inf"), 0.0, m_i))
        empty = l_i == 0
        inv = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, denom))
        lse = gl.where(empty, float("inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        out = (acc * gl.convert_layout(inv, gl.SliceLayout(1, _O_MMA))[:, None]).to(gl.bfloat16)
        return out, lse, m_i * 0.6931471805599453

    @gluon.jit
    def _slots(idx_row, i_s2, it, n_sel, num_rows, rows, STEP: gl.constexpr):
        """Slots (int64, 0 where not selected) of step `it`'s positions and which are selected rows."""
        pos = it * STEP + rows
        slot = gl.load(idx_row + pos * i_s2, mask=pos < n_sel, other=-1)
        ok = (slot >= 0) & (slot < num_rows)
        return gl.where(ok, slot, 0).to(gl.int64), ok

    @gluon.jit
    def _gather(kv_ptr, slot, ok, kv_s0, buf, dims_g):
        """cp.async of the rows `slot` into `buf` [STEP, 512] (zeros where not ok); one commit group."""
        async_copy.async_copy_global_to_shared(buf, kv_ptr + (slot * kv_s0)[:, None] + dims_g[None, :],
                                               mask=ok[:, None])
        async_copy.commit_group()

    @gluon.jit(do_not_specialize=("width", "num_rows"))
    def sparse_mla_prefill_gluon_kernel(q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, o_ptr, lse_ptr, max_ptr,
                                        sm_scale, width, num_rows, kv_s8, q_s08, q_s18, i_s0, i_s2, len_s,
                                        o_s0, o_s1, lse_s0, lse_s1, max_s0, max_s1,
                                        HAS_LEN: gl.constexpr, SINKS: gl.constexpr):
        """Program (t, hb): query token t, heads [64 hb, 64 hb + 64), over its selected rows (module docstring).
        q [Tq, Hq, 512], kv rows 8 * kv_s8 elements apart, q strides (8 * q_s08, 8 * q_s18, 1) (multiples of 8
        elements the compiler can see: 16-byte copies), indices [Tq, 1, C] with strides (i_s0, -, i_s2), out
        [Tq, Hq, 512]."""
        gl.static_assert(gl.num_warps() == 8)
        D: gl.constexpr = 512
        H: gl.constexpr = 64
        BN: gl.constexpr = 64
        G_L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        kv_s0 = kv_s8 * 8
        q_s0 = q_s08 * 8
        q_s1 = q_s18 * 8
        t = gl.program_id(0).to(gl.int64)
        h0 = gl.program_id(1).to(gl.int64) * H          # the program's first head
        q_ptr = q_ptr + h0 * q_s1
        o_ptr = o_ptr + h0 * o_s1
        lse_ptr = lse_ptr + h0 * lse_s1
        max_ptr = max_ptr + h0 * max_s1
        sink_ptr = sink_ptr + h0
        n_sel = width
        if HAS_LEN:
            n_sel = gl.minimum(gl.maximum(gl.load(len_ptr + t * len_s), 0), width)
        steps = gl.cdiv(n_sel, BN)
        idx_row = idx_ptr + t * i_s0
        rows_g = gl.arange(0, BN, layout=gl.SliceLayout(1, G_L))
        dims_g = gl.arange(0, D, layout=gl.SliceLayout(0, G_L))

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [H, D], _SH)
        kv_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, D], _SH)
        async_copy.async_copy_global_to_shared(q_smem, q_ptr + t * q_s0 + (rows_g * q_s1)[:, None] + dims_g[None, :])
        async_copy.commit_group()
        slot_g, ok_g = _slots(idx_row, i_s2, 0, n_sel, num_rows, rows_g, BN)
        _gather(kv_ptr, slot_g, ok_g, kv_s0, kv_smem.index(0), dims_g)

        scale = sm_scale * 1.4426950408889634
        keys = gl.arange(0, BN, layout=gl.SliceLayout(0, _S_MMA))
        m_i = gl.full([H], float("-inf"), gl.float32, gl.SliceLayout(1, _S_MMA))
        l_i = gl.zeros([H], gl.float32, gl.SliceLayout(1, _S_MMA))
        acc = gl.zeros([H, D], gl.float32, _O_MMA)
        s_zero = gl.zeros([H, BN], gl.float32, _S_MMA)
        _, ok_s = _slots(idx_row, i_s2, 0, n_sel, num_rows, keys, BN)
        # O of step it runs asynchronously under step it + 1's gather wait and scores; the next gather is issued
        # once both products that read its buffer are done
        acc = warpgroup_mma_init(acc)
        for it in range(0, steps):
            slot_g, ok_g = _slots(idx_row, i_s2, it + 1, n_sel, num_rows, rows_g, BN)
            _, ok_next = _slots(idx_row, i_s2, it + 1, n_sel, num_rows, keys, BN)
            async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()
            kv = kv_smem.index(it % 2)
            s_tok = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc, s = warpgroup_mma_wait(0, deps=[acc, s_tok])
            gl.thread_barrier()              # both warpgroups are done with the buffer the next gather fills
            if it + 1 < steps:
                _gather(kv_ptr, slot_g, ok_g, kv_s0, kv_smem.index((it + 1) % 2), dims_g)
            m_i, l_i, acc = _online_step(s, ok_s, scale, m_i, l_i, acc, kv)
            ok_s = ok_next
        acc = warpgroup_mma_wait(0, deps=[acc])
        async_copy.wait_group(0)                 # no copy outlives the program (a token with nothing selected)

        out, lse, mx = _finish(acc, m_i, l_i, sink_ptr, SINKS)
        heads = gl.arange(0, H, layout=gl.SliceLayout(1, _S_MMA))
        gl.store(lse_ptr + t * lse_s0 + heads * lse_s1, lse)
        gl.store(max_ptr + t * max_s0 + heads * max_s1, mx)
        h_o = gl.arange(0, H, layout=gl.SliceLayout(1, _O_MMA))
        d_o = gl.arange(0, D, layout=gl.SliceLayout(0, _O_MMA))
        gl.store(o_ptr + t * o_s0 + (h_o * o_s1)[:, None] + d_o[None, :], out)


    @gluon.jit
    def _stage_rows(src, slot, ok, page_stride, st_codes, st_rope, st_scale, BS: gl.constexpr):
        """cp.async of 64 rows (global slots; zeros where not ok) of an fp8_ds_mla cache of block size BS into the
        staging buffers: codes [64, 8, 64] (blocks 0..6), RoPE [64, 64] bf16, scale bytes [64, 8]; one group."""
        C3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [8, 1, 1], [2, 1, 0])
        RP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        SC: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [8, 1], [1, 0])
        blk = slot // BS
        off = slot - blk * BS
        row = blk * page_stride + off * _DATA_BYTES
        scale_at = blk * page_stride + BS * _DATA_BYTES + off * _SCALE_BYTES
        r3 = gl.convert_layout(row, gl.SliceLayout(1, gl.SliceLayout(2, C3)))
        ok3 = gl.convert_layout(ok, gl.SliceLayout(1, gl.SliceLayout(2, C3)))
        qb = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, C3)))
        col = gl.arange(0, _QB, layout=gl.SliceLayout(0, gl.SliceLayout(1, C3)))
        async_copy.async_copy_global_to_shared(
            st_codes, src + r3[:, None, None] + (qb * _QB)[None, :, None] + col[None, None, :],
            mask=ok3[:, None, None] & (qb < _NUM_QB)[None, :, None])
        rr = gl.convert_layout(row, gl.SliceLayout(1, RP))
        okr = gl.convert_layout(ok, gl.SliceLayout(1, RP))
        d = gl.arange(0, 64, layout=gl.SliceLayout(0, RP))
        async_copy.async_copy_global_to_shared(
            st_rope, (src + rr + _NOPE).to(gl.pointer_type(gl.bfloat16))[:, None] + d[None, :], mask=okr[:, None])
        rs = gl.convert_layout(scale_at, gl.SliceLayout(1, SC))
        oks = gl.convert_layout(ok, gl.SliceLayout(1, SC))
        e = gl.arange(0, _SCALE_BYTES, layout=gl.SliceLayout(0, SC))
        async_copy.async_copy_global_to_shared(st_scale, src + rs[:, None] + e[None, :], mask=oks[:, None])

    @gluon.jit
    def _nope_store(st_codes, st_scale, buf, B0: gl.constexpr, NB: gl.constexpr, L3: gl.constexpr):
        """Dequantise staged NoPE blocks [B0, B0 + NB) (codes x 2^(byte - 127), exact in bf16) into
        buf[:, 64 B0 : 64 (B0 + NB)]."""
        codes = st_codes.slice(B0, NB, dim=1).load(L3)
        e = st_scale.slice(B0, NB, dim=1).load(gl.SliceLayout(2, L3)).to(gl.int32)
        scale = gl.where(e == 0, 1 << 22, e << 23).to(gl.float32, bitcast=True)
        val = codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, :, None]
        buf.slice(64 * B0, 64 * NB, dim=1).store(gl.reshape(val.to(gl.bfloat16), [64, 64 * NB]))

    @gluon.jit
    def _dequant_rows(st_codes, st_rope, st_scale, buf):
        """The staged rows dequantised into buf [64, 512] bf16: 7 NoPE blocks with their UE8M0 scales, then the 64
        RoPE bf16."""
        L2: gl.constexpr = gl.BlockedLayout([1, 1, 16], [4, 2, 4], [8, 1, 1], [2, 1, 0])
        L1: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 1, 4], [8, 1, 1], [2, 1, 0])
        RP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        gl.static_assert((_NUM_QB == 7) & (_QB == 64) & (_NOPE == 448))     # the groups below: 2 + 2 + 2 + 1 blocks
        _nope_store(st_codes, st_scale, buf, 0, 2, L2)
        _nope_store(st_codes, st_scale, buf, 2, 2, L2)
        _nope_store(st_codes, st_scale, buf, 4, 2, L2)
        _nope_store(st_codes, st_scale, buf, 6, 1, L1)
        buf.slice(_NOPE, 64, dim=1).store(st_rope.load(RP))

    @gluon.jit
    def _stage_step(cache_ptr, x_cache_ptr, page_stride, x_page_stride, slot, ok, is_main, st_codes, st_rope,
                    st_scale, BS: gl.constexpr, X_BS: gl.constexpr, EXTRA: gl.constexpr):
        """`_stage_rows` from the step's cache (main or extra), then commit the group (empty for no rows)."""
        if EXTRA:
            if is_main:
                _stage_rows(cache_ptr, slot, ok, page_stride, st_codes, st_rope, st_scale, BS)
            else:
                _stage_rows(x_cache_ptr, slot, ok, x_page_stride, st_codes, st_rope, st_scale, X_BS)
        else:
            _stage_rows(cache_ptr, slot, ok, page_stride, st_codes, st_rope, st_scale, BS)
        async_copy.commit_group()

    @gluon.jit
    def _step_slots(idx_row, x_row, i_s2, x_s2, tile, tiles_main, n_main, n_x, num_rows, x_num_rows, rows,
                    EXTRA: gl.constexpr):
        """Step `tile` of the list [main[:n_main] | extra[:n_x]]: its 64 slots (int64, 0 where not selected), which
        are selected rows, and whether the step is in the main list."""
        is_main = tile < tiles_main
        if EXTRA:
            if is_main:
                slot, ok = _slots(idx_row, i_s2, tile, n_main, num_rows, rows, 64)
            else:
                slot, ok = _slots(x_row, x_s2, tile - tiles_main, n_x, x_num_rows, rows, 64)
        else:
            slot, ok = _slots(idx_row, i_s2, tile, n_main, num_rows, rows, 64)
        return slot, ok, is_main

    @gluon.jit(do_not_specialize=("s_q", "width", "x_width", "num_rows", "x_num_rows", "ml_base"))
    def sparse_mla_decode_gluon_kernel(q_ptr, cache_ptr, idx_ptr, len_ptr, x_cache_ptr, x_idx_ptr, x_len_ptr,
                                       sink_ptr, o_ptr, lse_ptr, part_ptr, s_q, sm_scale, width, x_width, num_rows,
                                       x_num_rows, page_stride, x_page_stride, ml_base, q_s08, q_s18, q_s28, i_s0,
                                       i_s1, i_s2, x_s0, x_s1, x_s2, len_s, x_len_s, o_s0, o_s1, o_s2, lse_s0,
                                       lse_s1, lse_s2, BS: gl.constexpr, X_BS: gl.constexpr, EXTRA: gl.constexpr,
                                       HAS_LEN: gl.constexpr, HAS_X_LEN: gl.constexpr, SINKS: gl.constexpr,
                                       SPLIT: gl.constexpr):
        """Program (t, hb, split): query row t = (b, j) of B x s_q, heads [64 hb, 64 hb + 64), its split's share of
        the steps of the row's list [main indices[:len] | extra indices[:len_x]]: each step's cache bytes are copied
        into a staging buffer two steps ahead (`cp.async`), dequantised from it into the row buffer, then the prefill
        kernel's products. Unsplit: out and lse; SPLIT: the Triton kernel's partials (unnormalised acc, running max
        and sum, which `sparse_mla.combine_kernel` merges). q strides in units of 8 elements (8 * q_s08, ...)."""
        gl.static_assert(gl.num_warps() == 8)
        D: gl.constexpr = 512
        H: gl.constexpr = 64
        BN: gl.constexpr = 64
        G_L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        R1: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])
        t = gl.program_id(0).to(gl.int64)
        b = t // s_q
        j = t % s_q
        h0 = gl.program_id(1).to(gl.int64) * H          # the program's first head
        hq = gl.num_programs(1) * H
        q_ptr = q_ptr + h0 * (q_s28 * 8)
        o_ptr = o_ptr + h0 * o_s2
        lse_ptr = lse_ptr + h0 * lse_s1
        sink_ptr = sink_ptr + h0
        n_main = width
        if HAS_LEN:
            n_main = gl.minimum(gl.maximum(gl.load(len_ptr + b * len_s), 0), width)
        tiles_main = gl.cdiv(n_main, BN)
        tiles = tiles_main
        n_x = 0
        if EXTRA:
            n_x = x_width
            if HAS_X_LEN:
                n_x = gl.minimum(gl.maximum(gl.load(x_len_ptr + b * x_len_s), 0), x_width)
            tiles += gl.cdiv(n_x, BN)
        split = gl.program_id(2)
        splits = gl.num_programs(2)
        per = gl.cdiv(tiles, splits)
        t_lo = split * per
        t_hi = gl.minimum(t_lo + per, tiles)
        idx_row = idx_ptr + b * i_s0 + j * i_s1
        x_row = x_idx_ptr + b * x_s0 + j * x_s1

        heads_g = gl.arange(0, H, layout=gl.SliceLayout(1, G_L))
        dims_g = gl.arange(0, D, layout=gl.SliceLayout(0, G_L))
        PLAIN3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])     # a buffer index, then the dims
        PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [H, D], _SH)
        kvb = gl.allocate_shared_memory(gl.bfloat16, [BN, D], _SH)
        st_codes = gl.allocate_shared_memory(gl.uint8, [2, BN, 8, 64], PLAIN3)
        st_rope = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 64], PLAIN2)
        st_scale = gl.allocate_shared_memory(gl.uint8, [2, BN, 8], PLAIN2)
        async_copy.async_copy_global_to_shared(
            q_smem, q_ptr + b * (q_s08 * 8) + j * (q_s18 * 8) + (heads_g * (q_s28 * 8))[:, None] + dims_g[None, :])
        async_copy.commit_group()

        scale = sm_scale * 1.4426950408889634
        rows = gl.arange(0, BN, layout=R1)
        # rows staged two steps ahead: step t's copies are issued once step t - 2's staged bytes are dequantised
        slot, ok_a, is_main = _step_slots(idx_row, x_row, i_s2, x_s2, t_lo, tiles_main, n_main, n_x, num_rows,
                                          x_num_rows, rows, EXTRA)
        ok_a = ok_a & (t_lo < t_hi)
        _stage_step(cache_ptr, x_cache_ptr, page_stride, x_page_stride, slot, ok_a, is_main, st_codes.index(0),
                    st_rope.index(0), st_scale.index(0), BS, X_BS, EXTRA)
        slot, ok_b, is_main = _step_slots(idx_row, x_row, i_s2, x_s2, t_lo + 1, tiles_main, n_main, n_x, num_rows,
                                          x_num_rows, rows, EXTRA)
        ok_b = ok_b & (t_lo + 1 < t_hi)
        _stage_step(cache_ptr, x_cache_ptr, page_stride, x_page_stride, slot, ok_b, is_main, st_codes.index(1),
                    st_rope.index(1), st_scale.index(1), BS, X_BS, EXTRA)
        m_i = gl.full([H], float("-inf"), gl.float32, gl.SliceLayout(1, _S_MMA))
        l_i = gl.zeros([H], gl.float32, gl.SliceLayout(1, _S_MMA))
        acc = warpgroup_mma_init(gl.zeros([H, D], gl.float32, _O_MMA))
        s_zero = gl.zeros([H, BN], gl.float32, _S_MMA)
        for tile in range(t_lo, t_hi):
            sb = (tile - t_lo) % 2
            slot, ok_c, is_main = _step_slots(idx_row, x_row, i_s2, x_s2, tile + 2, tiles_main, n_main, n_x,
                                              num_rows, x_num_rows, rows, EXTRA)
            ok_c = ok_c & (tile + 2 < t_hi)
            async_copy.wait_group(1)         # step tile's group (and Q's) landed; step tile + 1's may still fly
            acc = warpgroup_mma_wait(0, deps=[acc])
            gl.thread_barrier()              # every thread's copies visible; both warpgroups done with kvb
            _dequant_rows(st_codes.index(sb), st_rope.index(sb), st_scale.index(sb), kvb)
            fence_async_shared()
            gl.thread_barrier()              # kvb written; the staging buffer free again
            _stage_step(cache_ptr, x_cache_ptr, page_stride, x_page_stride, slot, ok_c, is_main,
                        st_codes.index(sb), st_rope.index(sb), st_scale.index(sb), BS, X_BS, EXTRA)
            s = warpgroup_mma(q_smem, kvb.permute((1, 0)), s_zero, use_acc=False)
            m_i, l_i, acc = _online_step(s, gl.convert_layout(ok_a, gl.SliceLayout(0, _S_MMA)), scale, m_i, l_i,
                                         acc, kvb)
            ok_a = ok_b
            ok_b = ok_c
        acc = warpgroup_mma_wait(0, deps=[acc])
        async_copy.wait_group(0)

        heads = gl.arange(0, H, layout=gl.SliceLayout(1, _S_MMA))
        h_o = gl.arange(0, H, layout=gl.SliceLayout(1, _O_MMA))
        d_o = gl.arange(0, D, layout=gl.SliceLayout(0, _O_MMA))
        if SPLIT:
            # partials of (t, h, split): acc at ((t*Hq + h)*splits + split)*D, (max, sum) at ml_base + 2*that row
            prow = (t * hq + h0 + h_o) * splits + split
            gl.store(part_ptr + (prow * D)[:, None] + d_o[None, :], acc)
            prow = (t * hq + h0 + heads) * splits + split
            gl.store(part_ptr + ml_base + 2 * prow, m_i)
            gl.store(part_ptr + ml_base + 2 * prow + 1, l_i)
        else:
            out, lse, _ = _finish(acc, m_i, l_i, sink_ptr, SINKS)
            gl.store(lse_ptr + b * lse_s0 + heads * lse_s1 + j * lse_s2, lse)
            gl.store(o_ptr + b * o_s0 + j * o_s1 + (h_o * o_s2)[:, None] + d_o[None, :], out)


if gluon is not None:
    PREFILL_LAUNCHER = FastLauncher(sparse_mla_prefill_gluon_kernel)
    DECODE_LAUNCHER = FastLauncher(sparse_mla_decode_gluon_kernel)


def _dtype(t, absent: torch.dtype) -> torch.dtype:
    """An optional tensor's dtype; `absent`: its placeholder's (the op passes int32 indices for absent lengths,
    the fp32 lse for an absent sink)."""
    return t.dtype if t is not None else absent


def bind_prefill(q, kv, indices, sm_scale: float, topk_length, attn_sink, out, max_logits, lse):
    """The launch of a prefill call `prefill_planned` accepted, worked out once: a callable of the Triton kernel's
    twelve tensors (q, kv, indices, lengths, kv, indices, lengths, sink, out, lse, max_logits, lse), for q and kv at
    16-byte aligned addresses (a `FastLauncher` launch: Triton's JIT only on the first call)."""
    tokens = q.shape[0]
    ints = (float(sm_scale), indices.shape[2], kv.shape[0], kv.stride(0) // 8, q.stride(0) // 8,
            q.stride(1) // 8, indices.stride(0), indices.stride(2),
            topk_length.stride(0) if topk_length is not None else 0, out.stride(0), out.stride(1), lse.stride(0),
            lse.stride(1), max_logits.stride(0), max_logits.stride(1))
    meta = dict(HAS_LEN=topk_length is not None, SINKS=attn_sink is not None, num_warps=WARPS)
    dtypes = (q.dtype, kv.dtype, indices.dtype, _dtype(topk_length, indices.dtype), _dtype(attn_sink, lse.dtype),
              out.dtype, lse.dtype, max_logits.dtype)
    fast = PREFILL_LAUNCHER.bind((tokens, q.shape[1] // HEADS), dtypes, ints, meta, q.device)

    def launch(q, kv, indices, lens, _kv, _indices, _lens, sink, out, lse, max_logits, _lse):
        fast(q, kv, indices, lens, sink, out, lse, max_logits)

    return launch


MIN_DECODE_STEPS = 4                 # index columns (main + extra) of at least this many 64-row steps


def decode_planned(target: platform.Target, hq: int, q_strides: tuple, fnuz: tuple, rows: int, positions: int,
                   forced: int | None = None, version: str = triton.__version__) -> bool:
    """Whether a decode call runs the Gluon kernel: sm_90, Triton 3.6, a multiple of 64 heads, OCP caches (`fnuz`:
    each cache's flag), q strides multiples of 8 elements, the target's shared memory enough for a program, more than
    SMALL_DECODE_ROWS query rows (B·s_q; fewer take the Triton kernel's small-batch plan of 16-head blocks) and
    `positions` (W + K index columns) of at least MIN_DECODE_STEPS steps (shorter lists keep the Triton kernel's
    lower fixed cost per row: SWA-only B = 256, 2 steps a row, no faster in Gluon). It splits the rows as the Triton
    kernel would (`sparse_mla.decode_splits`: one wave of programs) into the same partials and combine (H100,
    CUDA-graph replay, NOTES.md "Gluon launches" item 5: C4A B = 8 / 16 / 32 / 48 / 64 16.2 / 23.0 / 29.6 / 37.1 /
    40.9 us against 22.0 / 33.3 / 42.5 / 52.3 / 57.9 for the Triton kernel). `forced`
    (`ops.sparse_mla.forced_splits`): 1 takes this kernel unsplit whatever the rows, more the Triton kernel."""
    rows_ok = forced == 1 or (forced is None and rows > SMALL_DECODE_ROWS)
    return (gluon is not None and triton_minor(version) in VERIFIED_TRITON and target.backend == "cuda"
            and target.arch == 90 and hq > 0 and hq % HEADS == 0 and layout.HEAD_DIM == 512 and not any(fnuz)
            and rows_ok and positions >= MIN_DECODE_STEPS * 64 and all(s % 8 == 0 for s in q_strides[:3])
            and platform.shared_memory_limit(target) >= DECODE_SHARED_MEMORY)


def bind_decode(q, indices, extra_indices, topk_length, extra_topk_length, attn_sink, out, lse, softmax_scale,
                main, extra, splits: int, ml_base: int):
    """The launch of a decode call `decode_planned` accepted (grid B·s_q x splits): a callable of the Triton
    kernel's twelve tensors (q, cache, indices, lengths, extra cache, extra indices, extra lengths, sink, out, lse,
    lse, partials), for q at a 16-byte aligned address (a `FastLauncher` launch). main / extra: the caches'
    (num_blocks, bs, page stride) (`ops.sparse_mla.CacheInfo`). splits > 1: the partials go to the fp32 workspace
    in the Triton kernel's layout (`sparse_mla.workspace_elements`, its (max, sum) pairs from `ml_base`)."""
    batch, s_q = q.shape[0], q.shape[1]
    xi = extra_indices if extra is not None else indices
    ints = (s_q, float(softmax_scale), indices.shape[2], xi.shape[2] if extra is not None else 0,
            main.num_blocks * main.bs, extra.num_blocks * extra.bs if extra is not None else 0, main.page_stride,
            extra.page_stride if extra is not None else main.page_stride, ml_base, q.stride(0) // 8, q.stride(1) // 8,
            q.stride(2) // 8, *indices.stride(), *xi.stride(), topk_length.stride(0) if topk_length is not None else 0,
            extra_topk_length.stride(0) if extra_topk_length is not None else 0, *out.stride()[:3], *lse.stride())
    meta = dict(BS=main.bs, X_BS=extra.bs if extra is not None else main.bs, EXTRA=extra is not None,
                HAS_LEN=topk_length is not None, HAS_X_LEN=extra_topk_length is not None and extra is not None,
                SINKS=attn_sink is not None, SPLIT=splits > 1, num_warps=WARPS)
    # the caches as bytes whatever their dtype, the partials as fp32 (the op's workspace may be bf16)
    dtypes = (q.dtype, torch.uint8, indices.dtype, _dtype(topk_length, indices.dtype), torch.uint8, xi.dtype,
              _dtype(extra_topk_length, indices.dtype), _dtype(attn_sink, lse.dtype),
              out.dtype, lse.dtype, torch.float32)
    fast = DECODE_LAUNCHER.bind((batch * s_q, q.shape[2] // HEADS, splits), dtypes, ints, meta, q.device)

    def launch(q, cache, indices, lens, x_cache, x_indices, x_lens, sink, out, lse, _lse, part):
        fast(q, cache, indices, lens, x_cache, x_indices, x_lens, sink, out, lse, part)

    return launch
