"""Sparse MLA on sm_90 in Gluon (Triton 3.6): `flash_mla_sparse_fwd` (prefill over a bf16 workspace) and
`flash_mla_with_kvcache` (decode over fp8_ds_mla caches).

The Triton kernel (`sparse_mla.sparse_mla_kernel`) keeps an acc tile [64 heads, 512] fp32 in one 8-warp program and
spills: 31 % of the bf16 matmul rate on an H100 (benchmarks/NOTES.md, "Sparse MLA"). Here the layouts are explicit.
A program (one query row, 64 heads = the M of both products) holds Q [64, 512] in shared memory; its two
warpgroups split the N of both products: scores S = Q K^T [64, 64] (32 keys each), then O += P V [64, 512] (256
output columns each: 128 accumulator registers a thread), P moving through shared memory to the A operand.
Online softmax in base 2 as the Triton kernel's; the sink enters the denominator at the end only (the decode
divides P and acc's rescale by it in an unsplit item's last step, so that the O product leaves the output
normalised: one pass over acc less, C4A B = 256 -0.9 %). A row's max crosses the warpgroups through a 512-byte
buffer (one barrier; Triton's cross-warp reduction takes three) and its sum stays as each warpgroup's part until the
end (NOTES.md "Barriers nothing asks for": C4A B = 256 -4 %, the prefill -3 %).

* Prefill (`sparse_mla_prefill_gluon_kernel`): each step's 64 selected rows are copied with `cp.async` straight
  into one of two row buffers (zero-filled where a position is not selected). Persistent: at most one program an
  SM, each over the tokens p, p + P, ... as one stream of steps, Q and the row buffers rotating as the decode's
  (below). Step t's O product runs under step t + 1's wait for its rows and is waited before step t + 1's scores;
  the copy of step t + 2 then goes into the buffer it read, under step t + 1's scores, softmax and O. P is the
  O product's A operand from an 8 KB shared buffer (one barrier; the conversion to a register operand takes four).
  H100: 1041-1047 us on the benchmark's case against 1098-1100 before these two changes (NOTES.md "Barriers nothing
  asks for"; the Triton kernel 31-33 % of the bf16 matmul rate).
* Decode (`sparse_mla_decode_gluon_kernel`): two row buffers. While step i's O product runs on one, step i + 1's codes,
  copied a step earlier (`cp.async`) into a staging buffer, are dequantised exactly (codes x 2^(byte - 127), the scale
  bytes loaded as one 8-byte word a row) into the other, whose RoPE columns are copied straight from the cache (under
  the scores product, which reads shared memory at its limit, the dequantisation gained nothing over running after it;
  under the compute-bound O product it gains). Work items (row, split), each over its split's share of the row's steps,
  split as the Triton kernel would be into the same partials for the same combine. Persistent: at most one program an
  SM, each over the items p, p + P, ... as one stream of steps, staged two steps ahead across items. Q and the two row
  buffers are three buffers that rotate: an item's last step copies the next item's Q into the buffer the previous
  step's rows left free as it starts, and takes the old Q's buffer for the next step's rows once its scores product is
  done (the copy waited a step later before, C4A B = 256 -6 %, SWA-only B = 256 -10 %). An item's output leaves through
  the row buffer the last O product read (16-byte stores, whole lines a warp: the accumulator's own layout stored 8
  half-sectors an instruction and took 6.6 us of a 2-step item). The staged codes are dequantised a staging buffer
  at a time (three stores: between one-block stores Triton's barrier analysis put six barriers), the first step's
  index entries are read beside the lengths, and the first Q arrives in two halves. Planned for calls of more than 4
  rows whose lists hold at least 2 steps; up to 4 rows keep the Triton kernel's small-batch plan (NOTES.md "Sparse
  MLA decode in Gluon", "Gluon launches", "The decode's dequantisation under the scores", "A persistent sparse
  decode", "The dequantisation under the O product", "The next item's Q a step earlier", "Barriers nothing asks
  for").

`prefill_planned` / `decode_planned` say when these paths run: sm_90, Triton 3.6 (Gluon's API moves between
versions), a multiple of 64 heads (a program takes a block of 64 heads), q strides (and kv's row stride)
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
PREFILL_SHARED_MEMORY = 205824       # bytes a program takes on sm_90 (Q, two row buffers, P, row maxima, scratch)
DECODE_SHARED_MEMORY = 229888        # (Q, two row buffers, the staged codes of a step, row maxima, scratch)


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
        # [2, 64]: both warpgroups' values of a head in one thread, the heads spread as SliceLayout(1, _S_MMA)'s
        _MX_LOAD = gl.constexpr(gl.DistributedLinearLayout(
            reg_bases=[[1, 0], [0, 8]], lane_bases=[[0, 0], [0, 0], [0, 1], [0, 2], [0, 4]],
            warp_bases=[[0, 16], [0, 32], [0, 0]], block_bases=[], shape=[2, 64]))
        _MX_SH = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
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
    def _warpgroup_parts(x, op: gl.constexpr):
        """op (gl.max / gl.sum) of x [64, 64] (_S_MMA) over each warpgroup's 32 columns: [64, 2], within warps."""
        return op(gl.reshape(x, [64, 2, 32]), axis=2)

    @gluon.jit
    def _row_max(s, mx):
        """Row max of s [64, 64] (_S_MMA), in SliceLayout(1, _S_MMA): the warpgroups' maxima exchanged through
        mx [2, 64] fp32 (one barrier; a cross-warp reduction takes three)."""
        mx.store(gl.permute(_warpgroup_parts(s, gl.max), (1, 0)))
        return gl.convert_layout(gl.max(mx.load(_MX_LOAD), axis=0), gl.SliceLayout(1, _S_MMA))

    @gluon.jit
    def _row_total(l_2):
        """The running sums of the rows (SliceLayout(1, _S_MMA)) out of their warpgroup parts l_2 [64, 2]."""
        return gl.convert_layout(gl.sum(l_2, axis=1), gl.SliceLayout(1, _S_MMA))

    @gluon.jit
    def _empty_state():
        """The running state of a row before its first step: max -inf, sums (warpgroup parts) 0, acc 0."""
        m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, _S_MMA))
        l_2 = _warpgroup_parts(gl.zeros([64, 64], gl.float32, _S_MMA), gl.sum)
        return m_i, l_2, gl.zeros([64, 512], gl.float32, _O_MMA)

    @gluon.jit
    def _softmax_step(s, ok, scale, m_i, l_2, acc, mx, last, z, SINKS: gl.constexpr):
        """One step of the online softmax (base 2) on the scores s [64, 64] (invalid where not ok): the running max
        (`_row_max` through mx), the running sums as each warpgroup's part l_2 [64, 2] (summed at the end only),
        acc rescaled, and P (bf16) for the step's O product. Where `last` (a row's last step, its output to leave
        the O product normalised; False as a constant: never), P and acc's rescale are divided by the denominator
        (`_normaliser`, the sink logits z), and lse is the rows' (else a placeholder)."""
        s = gl.where(ok[None, :], s * scale, float("-inf"))
        m_new = gl.maximum(m_i, _row_max(s, mx))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        parts = _warpgroup_parts(p, gl.sum)
        l_2 = l_2 * gl.convert_layout(alpha, gl.SliceLayout(1, parts.type.layout))[:, None] + parts
        lse = alpha
        if last:
            inv, lse = _normaliser(m_new, _row_total(l_2), z, SINKS)
            alpha = alpha * inv
            p = p * inv[:, None]
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, _O_MMA))[:, None]
        return m_new, l_2, acc, p.to(gl.bfloat16), lse

    @gluon.jit
    def _online_step(s, ok, scale, m_i, l_2, acc, kv, mx, last, z, SINKS: gl.constexpr):
        """`_softmax_step`, then the step's O product over the rows in kv issued asynchronously, P converted to
        its register A operand (through the layout scratch). Where `last`, the product leaves the normalised
        output (one rescale of acc at an item's end, not two); returns lse too."""
        m_i, l_2, acc, p, lse = _softmax_step(s, ok, scale, m_i, l_2, acc, mx, last, z, SINKS)
        return m_i, l_2, warpgroup_mma(gl.convert_layout(p, _P_OP), kv, acc, is_async=True), lse

    @gluon.jit
    def _online_step_smem(s, ok, scale, m_i, l_2, acc, kv, mx, p_smem):
        """`_online_step` with P stored to p_smem [64, 64] as the O product's A operand: one barrier where the
        conversion to the register operand takes four."""
        m_i, l_2, acc, p, _ = _softmax_step(s, ok, scale, m_i, l_2, acc, mx, False, 0.0, False)
        p_smem.store(p)
        fence_async_shared()
        gl.thread_barrier()
        return m_i, l_2, warpgroup_mma(p_smem, kv, acc, is_async=True)

    @gluon.jit
    def _sink_logits(sink_ptr, heads, SINKS: gl.constexpr):
        """The sinks of heads (base 2; zeros without sinks), loaded once a program."""
        z = heads.to(gl.float32) * 0.0
        if SINKS:
            z = gl.load(sink_ptr + heads) * 1.4426950408889634
        return z

    @gluon.jit
    def _normaliser(m_i, l_i, z, SINKS: gl.constexpr):
        """(1 / denominator, lse) of rows' finished running max and sum, the sink logits z (`_sink_logits`) added
        to the denominator; (0, +inf) for a row that selected nothing."""
        denom = l_i
        if SINKS:
            denom = l_i + gl.exp2(z - gl.where(m_i == float("-inf"), 0.0, m_i))
        empty = l_i == 0
        inv = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, denom))
        lse = gl.where(empty, float("inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        return inv, lse

    @gluon.jit
    def _finish(acc, m_i, l_i, z, SINKS: gl.constexpr):
        """(out [64, 512] bf16, lse) of finished running state (`_normaliser`)."""
        inv, lse = _normaliser(m_i, l_i, z, SINKS)
        out = (acc * gl.convert_layout(inv, gl.SliceLayout(1, _O_MMA))[:, None]).to(gl.bfloat16)
        return out, lse

    @gluon.jit
    def _entries(idx_row, i_s2, it, n_sel, rows):
        """Index entries (int32; -1 past the list's n_sel) of step `it`'s 64 positions."""
        pos = it * 64 + rows
        return gl.load(idx_row + pos * i_s2, mask=pos < n_sel, other=-1)

    @gluon.jit
    def _valid(raw, num_rows):
        """Slots (int64, 0 where not selected) of index entries raw, and which are selected rows."""
        ok = (raw >= 0) & (raw < num_rows)
        return gl.where(ok, raw, 0).to(gl.int64), ok

    @gluon.jit
    def _slots(idx_row, i_s2, it, n_sel, num_rows, rows):
        """Slots (int64, 0 where not selected) of step `it`'s positions and which are selected rows."""
        return _valid(_entries(idx_row, i_s2, it, n_sel, rows), num_rows)

    @gluon.jit
    def _gather(kv_ptr, slot, ok, kv_s0, buf, dims_g):
        """cp.async of the rows `slot` into `buf` [STEP, 512] (zeros where not ok); one commit group."""
        async_copy.async_copy_global_to_shared(buf, kv_ptr + (slot * kv_s0)[:, None] + dims_g[None, :],
                                               mask=ok[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _token(t, n_tok, width, len_ptr, len_s, idx_ptr, i_s0, HAS_LEN: gl.constexpr):
        """Token t's selected count (0 past n_tok), its steps (at least one: an empty token takes one masked step,
        so that its outputs are written) and its index row."""
        live = t < n_tok
        n_sel = width * live.to(gl.int32)
        if HAS_LEN:
            n_sel = gl.minimum(gl.maximum(gl.load(len_ptr + t * len_s, mask=live, other=0), 0), width)
        return n_sel, gl.maximum(gl.cdiv(n_sel, 64), 1), idx_ptr + t * i_s0

    @gluon.jit
    def _next_step(t, it, n, e, r, P, tok_args):
        """The step after step `it` of token t (its `_token` fields n, e, r): the token's next, or the first of
        token t + P."""
        it += 1
        if it >= e:
            t = t + P
            it = 0
            n, e, r = _token(t, *tok_args)
        return t, it, n, e, r

    @gluon.jit
    def _copy_q(q_row, head_stride, buf, heads_g, dims_g):
        """cp.async of one token's query [64 heads, 512] (q_row: its first head) into buf; one commit group."""
        async_copy.async_copy_global_to_shared(buf, q_row + (heads_g * head_stride)[:, None] + dims_g[None, :])
        async_copy.commit_group()

    @gluon.jit(do_not_specialize=("width", "num_rows", "n_tok"))
    def sparse_mla_prefill_gluon_kernel(q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, o_ptr, lse_ptr, max_ptr,
                                        sm_scale, width, num_rows, n_tok, kv_s8, q_s08, q_s18, i_s0, i_s2, len_s,
                                        o_s0, o_s1, lse_s0, lse_s1, max_s0, max_s1,
                                        HAS_LEN: gl.constexpr, SINKS: gl.constexpr):
        """Program (p, hb), persistent: heads [64 hb, 64 hb + 64) of the query tokens p, p + P, ... (P programs on
        axis 0) over their selected rows, as one stream of 64-row steps (module docstring). q [Tq, Hq, 512], kv
        rows 8 * kv_s8 elements apart, q strides (8 * q_s08, 8 * q_s18, 1) (multiples of 8 elements the compiler
        can see: 16-byte copies), indices [Tq, 1, C] with strides (i_s0, -, i_s2), out [Tq, Hq, 512]."""
        gl.static_assert(gl.num_warps() == 8)
        D: gl.constexpr = 512
        H: gl.constexpr = 64
        BN: gl.constexpr = 64
        G_L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        kv_s0 = kv_s8 * 8
        q_s0 = q_s08 * 8
        q_s1 = q_s18 * 8
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        h0 = gl.program_id(1).to(gl.int64) * H          # the program's first head
        q_ptr = q_ptr + h0 * q_s1
        o_ptr = o_ptr + h0 * o_s1
        lse_ptr = lse_ptr + h0 * lse_s1
        max_ptr = max_ptr + h0 * max_s1
        rows_g = gl.arange(0, BN, layout=gl.SliceLayout(1, G_L))
        dims_g = gl.arange(0, D, layout=gl.SliceLayout(0, G_L))
        keys = gl.arange(0, BN, layout=gl.SliceLayout(0, _S_MMA))
        heads = gl.arange(0, H, layout=gl.SliceLayout(1, _S_MMA))
        z = _sink_logits(sink_ptr + h0, heads, SINKS)
        tok_args = (n_tok, width, len_ptr, len_s, idx_ptr, i_s0, HAS_LEN)

        # Q and two row buffers, their roles rotating at a token's last step (as the decode's)
        bufs = gl.allocate_shared_memory(gl.bfloat16, [3, BN, D], _SH)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [H, BN], gl.NVMMASharedLayout.get_default_for([H, BN],
                                                                                                    gl.bfloat16))
        mx = gl.allocate_shared_memory(gl.float32, [2, H], _MX_SH)
        t0 = pid.to(gl.int64)
        _copy_q(q_ptr + t0 * q_s0, q_s1, bufs.index(2), rows_g, dims_g)
        n0, e0, r0 = _token(t0, *tok_args)
        slot_g, ok_g = _slots(r0, i_s2, 0, n0, num_rows, rows_g)
        _gather(kv_ptr, slot_g, ok_g, kv_s0, bufs.index(0), dims_g)
        ok_s = _slots(r0, i_s2, 0, n0, num_rows, keys)[1]
        total = pid * 0                      # the program's steps
        for tt in range(pid, n_tok, P):
            total += _token(tt.to(gl.int64), *tok_args)[1]
        # the next step's cursor (token t1, step it1)
        t1, it1, n1, e1, r1 = _next_step(t0, 0, n0, e0, r0, P, tok_args)

        scale = sm_scale * 1.4426950408889634
        m_i, l_2, acc = _empty_state()
        s_zero = gl.zeros([H, BN], gl.float32, _S_MMA)
        h_o = gl.arange(0, H, layout=gl.SliceLayout(1, _O_MMA))
        d_o = gl.arange(0, D, layout=gl.SliceLayout(0, _O_MMA))
        ia = pid * 0                         # this step's rows
        ib = ia + 1                          # the next step's
        iq = ia + 2                          # this step's Q
        # a step's O product runs under the next step's wait for its rows, and is waited before that step's scores;
        # then the step after is gathered into the buffer it read, under the scores, softmax and O (a token's last
        # step: the next token's Q there, its first rows into the old Q's buffer once the scores are done)
        acc = warpgroup_mma_init(acc)
        for g in range(0, total):
            slot_g, ok_g = _slots(r1, i_s2, it1, n1, num_rows, rows_g)
            ok_next = _slots(r1, i_s2, it1, n1, num_rows, keys)[1]
            last0 = it1 == 0                 # this step is its token's last
            async_copy.wait_group(0)
            acc = warpgroup_mma_wait(0, deps=[acc])
            fence_async_shared()
            gl.thread_barrier()              # this step's rows landed; the previous O product done with buffer ib
            kv = bufs.index(ia)
            i_n = ib
            if last0:                        # the next token's Q into ib, its rows into the old Q's buffer
                i_n = iq
                if t1 < n_tok:
                    _copy_q(q_ptr + t1 * q_s0, q_s1, bufs.index(ib), rows_g, dims_g)
            else:
                _gather(kv_ptr, slot_g, ok_g, kv_s0, bufs.index(ib), dims_g)
            s_tok = warpgroup_mma(bufs.index(iq), kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s_tok])
            if last0:
                gl.thread_barrier()          # both warpgroups done with Q: its buffer takes the next rows
                _gather(kv_ptr, slot_g, ok_g, kv_s0, bufs.index(i_n), dims_g)
            m_i, l_2, acc = _online_step_smem(s, ok_s, scale, m_i, l_2, acc, kv, mx, p_smem)
            if last0:
                acc = warpgroup_mma_wait(0, deps=[acc])
                out, lse = _finish(acc, m_i, _row_total(l_2), z, SINKS)
                gl.store(lse_ptr + t0 * lse_s0 + heads * lse_s1, lse)
                gl.store(max_ptr + t0 * max_s0 + heads * max_s1, m_i * 0.6931471805599453)
                gl.store(o_ptr + t0 * o_s0 + (h_o * o_s1)[:, None] + d_o[None, :], out)
                m_i, l_2, acc = _empty_state()
                acc = warpgroup_mma_init(acc)
                iq = ib
            ib = ia
            ia = i_n
            ok_s = ok_next
            t0 = t1
            t1, it1, n1, e1, r1 = _next_step(t1, it1, n1, e1, r1, P, tok_args)
        acc = warpgroup_mma_wait(0, deps=[acc])
        async_copy.wait_group(0)             # no copy outlives the program


    @gluon.jit
    def _cache_rows(raw, num_rows, page_stride, BS: gl.constexpr):
        """The rows of index entries raw in an fp8_ds_mla cache of block size BS: each row's data and scale-byte
        offsets (bytes), and which are selected rows."""
        slot, ok = _valid(raw, num_rows)
        blk = slot // BS
        off = slot - blk * BS
        return blk * page_stride + off * _DATA_BYTES, blk * page_stride + BS * _DATA_BYTES + off * _SCALE_BYTES, ok

    @gluon.jit
    def _raw_slots(idx_row, x_row, i_s2, x_s2, tile, tiles_main, n_main, n_x, rows, EXTRA: gl.constexpr):
        """Index entries (int32; -1 past the list) of step `tile` of the list [main[:n_main] | extra[:n_x]]."""
        if EXTRA:
            if tile < tiles_main:
                raw = _entries(idx_row, i_s2, tile, n_main, rows)
            else:
                raw = _entries(x_row, x_s2, tile - tiles_main, n_x, rows)
        else:
            raw = _entries(idx_row, i_s2, tile, n_main, rows)
        return raw

    @gluon.jit
    def _addresses(raw, tile, t_hi, tiles_main, num_rows, x_num_rows, page_stride, x_page_stride, cache_ptr,
                   x_cache_ptr, BS: gl.constexpr, X_BS: gl.constexpr, EXTRA: gl.constexpr):
        """Step `tile`'s rows from their index entries: the cache, each row's data and scale-byte offsets, ok."""
        src = cache_ptr
        if EXTRA:
            if tile < tiles_main:
                row, sc, ok = _cache_rows(raw, num_rows, page_stride, BS)
            else:
                row, sc, ok = _cache_rows(raw, x_num_rows, x_page_stride, X_BS)
                src = x_cache_ptr
        else:
            row, sc, ok = _cache_rows(raw, num_rows, page_stride, BS)
        return src, row, sc, ok & (tile < t_hi)

    @gluon.jit
    def _stage_blocks(src, row, ok, dst, B0: gl.constexpr, NB: gl.constexpr, L3: gl.constexpr):
        """cp.async of code blocks [B0, B0 + NB) of 64 rows (zeros where not ok) into dst [64, NB, 64]."""
        r3 = gl.convert_layout(row, gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        ok3 = gl.convert_layout(ok, gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        qb = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        col = gl.arange(0, _QB, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        async_copy.async_copy_global_to_shared(
            dst, src + r3[:, None, None] + ((B0 + qb) * _QB)[None, :, None] + col[None, None, :],
            mask=ok3[:, None, None])

    @gluon.jit
    def _stage_codes(src, row, ok, st4, st2, st1, P2: gl.constexpr, P1: gl.constexpr):
        """cp.async of the NoPE codes of 64 rows (zeros where not ok) into st4 [64, 4, 64] (blocks 0-3), st2
        [64, 2, 64] (blocks 4-5), st1 [64, 1, 64] (block 6); one commit group."""
        gl.static_assert((_NUM_QB == 7) & (_QB == 64) & (_NOPE == 448))     # the buffers: 4 + 2 + 1 blocks
        _stage_blocks(src, row, ok, st4, 0, 4, P2)
        _stage_blocks(src, row, ok, st2, 4, 2, P2)
        _stage_blocks(src, row, ok, st1, 6, 1, P1)
        async_copy.commit_group()

    @gluon.jit
    def _stage_rope(src, row, ok, buf, RP: gl.constexpr):
        """cp.async of 64 rows' RoPE (bf16, zeros where not ok) into buf[:, 448:512]; one commit group."""
        d = gl.arange(0, 64, layout=gl.SliceLayout(0, RP))
        rr = gl.convert_layout(row, gl.SliceLayout(1, RP))
        okr = gl.convert_layout(ok, gl.SliceLayout(1, RP))
        async_copy.async_copy_global_to_shared(
            buf.slice(_NOPE, 64, dim=1), (src + rr + _NOPE).to(gl.pointer_type(gl.bfloat16))[:, None] + d[None, :],
            mask=okr[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _scale_words(src, sc, ok):
        """Each row's 8 scale bytes as one int64 (block b in bits 8b .. 8b + 7; 0 where not ok): 8-byte aligned, as
        the op checks the cache's data pointer and page stride are (layout.DS_MLA_CACHE_ALIGN)."""
        gl.static_assert(_SCALE_BYTES == 8)
        return gl.load((src + sc).to(gl.pointer_type(gl.int64)), mask=ok, other=0)

    @gluon.jit
    def _block_scales(words, B0: gl.constexpr, NB: gl.constexpr, L3: gl.constexpr):
        """Scale bytes [64, NB] of blocks [B0, B0 + NB) out of the rows' scale words, in SliceLayout(2, L3)."""
        w = gl.convert_layout(words, gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        qb = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        return ((w[:, None] >> ((B0 + qb) * 8).to(gl.int64)[None, :]) & 0xff).to(gl.int32)

    @gluon.jit
    def _store_nope(codes, e, buf, B0: gl.constexpr, NB: gl.constexpr):
        """buf[:, 64 B0 : 64 (B0 + NB)] = codes x 2^(e - 127) (exact in bf16)."""
        e = e.to(gl.int32)
        scale = gl.where(e == 0, 1 << 22, e << 23).to(gl.float32, bitcast=True)
        val = codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, :, None]
        buf.slice(64 * B0, 64 * NB, dim=1).store(gl.reshape(val.to(gl.bfloat16), [codes.shape[0], 64 * NB]))

    @gluon.jit
    def _dequant_staged(st4, st2, st1, words, buf, P1: gl.constexpr):
        """The staged codes of 64 rows dequantised with their scale words into buf[:, 0:448]: each staging buffer
        in one load and one store (a layout of 8 codes a thread in each block, free of bank conflicts)."""
        L4: gl.constexpr = gl.BlockedLayout([1, 4, 8], [4, 1, 8], [8, 1, 1], [2, 1, 0])
        L2: gl.constexpr = gl.BlockedLayout([1, 2, 8], [4, 1, 8], [8, 1, 1], [2, 1, 0])
        _store_nope(st4.load(L4), _block_scales(words, 0, 4, L4), buf, 0, 4)
        _store_nope(st2.load(L2), _block_scales(words, 4, 2, L2), buf, 4, 2)
        _store_nope(st1.load(P1), _block_scales(words, 6, 1, P1), buf, 6, 1)

    @gluon.jit
    def _item(k, n_items, splits, s_q, width, x_width, len_ptr, x_len_ptr, len_s, x_len_s, idx_ptr, x_idx_ptr,
              i_s0, i_s1, x_s0, x_s1, HAS_LEN: gl.constexpr, HAS_X_LEN: gl.constexpr, EXTRA: gl.constexpr):
        """Work item k = (query row k // splits, split k % splits) of B x s_q rows: its steps [t_lo, t_hi) of the
        row's list [main indices[:len] | extra indices[:len_x]], t_end = max(t_hi, t_lo + 1) (an empty item takes
        one masked step, so that its outputs are written), the main list's steps and both lengths, and the row's
        index rows. Past n_items: an empty item, nothing loaded."""
        live = k < n_items
        split = k - (k // splits) * splits
        b, j = _query_row(k, splits, s_q)
        n_main = width * live.to(gl.int32)
        if HAS_LEN:
            n_main = gl.minimum(gl.maximum(gl.load(len_ptr + b * len_s, mask=live, other=0), 0), width)
        tiles_main = gl.cdiv(n_main, 64)
        tiles = tiles_main
        n_x = width * 0
        if EXTRA:
            n_x = x_width * live.to(gl.int32)
            if HAS_X_LEN:
                n_x = gl.minimum(gl.maximum(gl.load(x_len_ptr + b * x_len_s, mask=live, other=0), 0), x_width)
            tiles += gl.cdiv(n_x, 64)
        per = gl.cdiv(tiles, splits)
        t_lo = split * per
        t_hi = gl.minimum(t_lo + per, tiles)
        return (t_lo, t_hi, gl.maximum(t_hi, t_lo + 1), tiles_main, n_main, n_x, idx_ptr + b * i_s0 + j * i_s1,
                x_idx_ptr + b * x_s0 + j * x_s1)

    @gluon.jit
    def _advance(k, tile, hi, end, tm, nm, nx, ir, xr, P, item_args):
        """A cursor (item k, step tile, and `_item`'s fields of k but t_lo) one step on: the next step of item k, or
        the first of item k + P (item_args: `_item`'s arguments after k)."""
        tile += 1
        if tile >= end:
            k += P
            tile, hi, end, tm, nm, nx, ir, xr = _item(k, *item_args)
        return k, tile, hi, end, tm, nm, nx, ir, xr

    @gluon.jit
    def _stage_step(raw, cur, caches, P, st4, st2, st1, rows, i_s2, x_s2, item_args, BS: gl.constexpr,
                    X_BS: gl.constexpr, EXTRA: gl.constexpr, P2: gl.constexpr, P1: gl.constexpr):
        """Stage the step of cursor cur (`_advance`'s fields; raw: its index entries): its codes copied (one commit
        group) and scale words loaded; then the cursor one step on and its entries. Returns (src, row, ok, words,
        next cursor, its entries)."""
        k, tile, hi, end, tm, nm, nx, ir, xr = cur
        num_rows, x_num_rows, page_stride, x_page_stride, cache_ptr, x_cache_ptr = caches
        src, row, sc, ok = _addresses(raw, tile, hi, tm, num_rows, x_num_rows, page_stride, x_page_stride,
                                      cache_ptr, x_cache_ptr, BS, X_BS, EXTRA)
        _stage_codes(src, row, ok, st4, st2, st1, P2, P1)
        words = _scale_words(src, sc, ok)
        cur = _advance(k, tile, hi, end, tm, nm, nx, ir, xr, P, item_args)
        _, tile, _, _, tm, nm, nx, ir, xr = cur
        return src, row, ok, words, cur, _raw_slots(ir, xr, i_s2, x_s2, tile, tm, nm, nx, rows, EXTRA)

    @gluon.jit
    def _query_row(k, splits, s_q):
        """(b, j) (int64) of work item k's query row t = k // splits of B x s_q."""
        t = k // splits
        return (t // s_q).to(gl.int64), (t % s_q).to(gl.int64)

    @gluon.jit
    def _q_row(q_ptr, k, splits, s_q, q_s08, q_s18):
        """The first element of work item k's query row (q strides in units of 8 elements)."""
        b, j = _query_row(k, splits, s_q)
        return q_ptr + b * (q_s08 * 8) + j * (q_s18 * 8)

    @gluon.jit
    def _load_q(q_ptr, q_smem, k, splits, s_q, q_s08, q_s18, q_s28, heads_g, dims_g):
        """cp.async of item k's query row [64 heads, 512] into q_smem; one commit group."""
        _copy_q(_q_row(q_ptr, k, splits, s_q, q_s08, q_s18), q_s28 * 8, q_smem, heads_g, dims_g)

    @gluon.jit(do_not_specialize=("s_q", "width", "x_width", "num_rows", "x_num_rows", "ml_base", "n_items",
                                  "splits"))
    def sparse_mla_decode_gluon_kernel(q_ptr, cache_ptr, idx_ptr, len_ptr, x_cache_ptr, x_idx_ptr, x_len_ptr,
                                       sink_ptr, o_ptr, lse_ptr, part_ptr, s_q, sm_scale, width, x_width, num_rows,
                                       x_num_rows, page_stride, x_page_stride, ml_base, n_items, splits, q_s08,
                                       q_s18, q_s28, i_s0, i_s1, i_s2, x_s0, x_s1, x_s2, len_s, x_len_s, o_s0, o_s1,
                                       o_s2, lse_s0, lse_s1, lse_s2, BS: gl.constexpr, X_BS: gl.constexpr,
                                       EXTRA: gl.constexpr, HAS_LEN: gl.constexpr, HAS_X_LEN: gl.constexpr,
                                       SINKS: gl.constexpr, SPLIT: gl.constexpr):
        """Program (p, hb), persistent: heads [64 hb, 64 hb + 64) of the work items p, p + P, ... (P programs on
        axis 0; item = (query row t = (b, j) of B x s_q, split), `_item`), their steps one stream: step i + 1
        dequantised under step i's O product, the stream staged two steps ahead across items, the next item's
        Q copied as an item's last step starts, into the row buffer the step before left free (module docstring).
        Unsplit: out and lse; SPLIT: the Triton kernel's partials (unnormalised acc, running max and sum, which
        `sparse_mla.combine_kernel` merges). q strides in units of 8 elements (8 * q_s08, ...)."""
        gl.static_assert(gl.num_warps() == 8)
        D: gl.constexpr = 512
        H: gl.constexpr = 64
        BN: gl.constexpr = 64
        G_L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        # the staging layouts place row r in the same threads: converting between their row slices moves nothing
        P2: gl.constexpr = gl.BlockedLayout([1, 1, 16], [4, 2, 4], [8, 1, 1], [2, 1, 0])
        P1: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 1, 8], [8, 1, 1], [2, 1, 0])
        RP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        RL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, P2))
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        item_args = (n_items, splits, s_q, width, x_width, len_ptr, x_len_ptr, len_s, x_len_s, idx_ptr, x_idx_ptr,
                     i_s0, i_s1, x_s0, x_s1, HAS_LEN, HAS_X_LEN, EXTRA)
        h0 = gl.program_id(1).to(gl.int64) * H          # the program's first head
        hq = gl.num_programs(1) * H
        q_ptr = q_ptr + h0 * (q_s28 * 8)
        o_ptr = o_ptr + h0 * o_s2
        lse_ptr = lse_ptr + h0 * lse_s1
        heads = gl.arange(0, H, layout=gl.SliceLayout(1, _S_MMA))
        z = _sink_logits(sink_ptr + h0, heads, SINKS)
        heads_g = gl.arange(0, H, layout=gl.SliceLayout(1, G_L))
        dims_g = gl.arange(0, D, layout=gl.SliceLayout(0, G_L))
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        # Q and two row buffers, their roles rotating at an item's last step (module docstring)
        bufs = gl.allocate_shared_memory(gl.bfloat16, [3, BN, D], _SH)
        st4 = gl.allocate_shared_memory(gl.uint8, [BN, 4, 64], PLAIN)
        st2 = gl.allocate_shared_memory(gl.uint8, [BN, 2, 64], PLAIN)
        st1 = gl.allocate_shared_memory(gl.uint8, [BN, 1, 64], PLAIN)
        mx = gl.allocate_shared_memory(gl.float32, [2, H], _MX_SH)
        k0 = pid
        q_row0 = _q_row(q_ptr, k0, splits, s_q, q_s08, q_s18)
        # the first item's Q in two halves of heads: the second is copied after the first rows and lands under their
        # dequantisation (SWA-only B = 256 -2 %, C4A B = 64 -1 %: NOTES.md "Barriers nothing asks for")
        HALF: gl.constexpr = H // 2
        heads_h = gl.arange(0, HALF, layout=gl.SliceLayout(1, G_L))
        _copy_q(q_row0, q_s28 * 8, bufs.index(2).slice(0, HALF, dim=0), heads_h, dims_g)
        rows = gl.arange(0, BN, layout=RL)
        # the lists' first entries read beside the lengths (not after them: one latency less before the first
        # codes), cut by the lengths once they land
        b0, j0 = _query_row(k0, splits, s_q)
        live0 = k0 < n_items
        head_m = _entries(idx_ptr + b0 * i_s0 + j0 * i_s1, i_s2, 0, width * live0.to(gl.int32), rows)
        head_x = head_m
        if EXTRA:
            head_x = _entries(x_idx_ptr + b0 * x_s0 + j0 * x_s1, x_s2, 0, x_width * live0.to(gl.int32), rows)
        total = pid * 0                      # the program's steps
        for kk in range(pid, n_items, P):
            lo, _, end, _, _, _, _, _ = _item(kk, *item_args)
            total += end - lo

        # three cursors (item, step): c0 computed, c1 staged, c2 its index entries loaded
        lo, hi, end, tm, nm, nx, ir, xr = _item(k0, *item_args)
        if lo == 0:                          # step 0 of the list: its main part's, or the extra's where that is empty
            raw = gl.where(rows < nm, head_m, -1)
            if EXTRA:
                if tm == 0:
                    raw = gl.where(rows < nx, head_x, -1)
        else:
            raw = _raw_slots(ir, xr, i_s2, x_s2, lo, tm, nm, nx, rows, EXTRA)
        src, row, sc, ok_a = _addresses(raw, lo, hi, tm, num_rows, x_num_rows, page_stride, x_page_stride,
                                        cache_ptr, x_cache_ptr, BS, X_BS, EXTRA)
        _stage_codes(src, row, ok_a, st4, st2, st1, P2, P1)
        _stage_rope(src, row, ok_a, bufs.index(0), RP)
        _copy_q(q_row0 + HALF * (q_s28 * 8), q_s28 * 8, bufs.index(2).slice(HALF, HALF, dim=0), heads_h, dims_g)
        words = _scale_words(src, sc, ok_a)
        tile = lo
        k1, tile, hi, end, tm, nm, nx, ir, xr = _advance(k0, tile, hi, end, tm, nm, nx, ir, xr, P, item_args)
        raw = _raw_slots(ir, xr, i_s2, x_s2, tile, tm, nm, nx, rows, EXTRA)
        async_copy.wait_group(1)             # all but Q's second half: it lands under the first dequantisation
        gl.thread_barrier()
        _dequant_staged(st4, st2, st1, words, bufs.index(0), P1)
        gl.thread_barrier()                  # the staging buffers read
        # c1's codes staged and scale words loaded; its RoPE waits for row buffer 1's first reader
        caches = (num_rows, x_num_rows, page_stride, x_page_stride, cache_ptr, x_cache_ptr)
        src_b, row_b, ok_b, words, cur, raw = _stage_step(raw, (k1, tile, hi, end, tm, nm, nx, ir, xr), caches, P,
                                                          st4, st2, st1, rows, i_s2, x_s2, item_args, BS, X_BS,
                                                          EXTRA, P2, P1)
        k2 = cur[0]
        last0 = k1 != k0                     # c0 / c1 is its item's last step
        last1 = k2 != k1

        scale = sm_scale * 1.4426950408889634
        m_i, l_2, acc = _empty_state()
        s_zero = gl.zeros([H, BN], gl.float32, _S_MMA)
        h_o = gl.arange(0, H, layout=gl.SliceLayout(1, _O_MMA))
        d_o = gl.arange(0, D, layout=gl.SliceLayout(0, _O_MMA))
        async_copy.wait_group(1)             # Q's second half (c1's codes may fly)
        fence_async_shared()
        gl.thread_barrier()                  # row buffer 0 written
        ia = pid * 0                         # c0's rows
        ib = ia + 1                          # c1's rows
        iq = ia + 2                          # c0's Q
        for g in range(0, total):
            kv = bufs.index(ia)
            s_tok = warpgroup_mma(bufs.index(iq), kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if last0:                        # buffer ib, read by the previous step, takes the next item's Q
                if k0 + P < n_items:
                    _load_q(q_ptr, bufs.index(ib), k0 + P, splits, s_q, q_s08, q_s18, q_s28, heads_g, dims_g)
                else:
                    async_copy.commit_group()    # an empty group: the waits below count groups
            else:
                _stage_rope(src_b, row_b, ok_b, bufs.index(ib), RP)
            acc, sc_t = warpgroup_mma_wait(0, deps=[acc, s_tok])
            async_copy.wait_group(1)         # c1's codes (the RoPE, or the next Q, may still fly)
            i_n = ib
            if last0:
                i_n = iq
                gl.thread_barrier()          # both warpgroups' scores done: the old Q's buffer takes c1's rows
                _stage_rope(src_b, row_b, ok_b, bufs.index(i_n), RP)
            nxt = bufs.index(i_n)
            # an unsplit item's last step leaves its output normalised (C4A B = 256 -0.9 %)
            m_i, l_2, acc, lse = _online_step(sc_t, gl.convert_layout(ok_a, gl.SliceLayout(0, _S_MMA)), scale,
                                              m_i, l_2, acc, kv, mx, last0 and not SPLIT, z, SINKS)
            gl.thread_barrier()              # c1's codes, copied by every thread, visible to all
            _dequant_staged(st4, st2, st1, words, nxt, P1)
            gl.thread_barrier()              # the staging buffers read
            src, row_c, ok_c, words, cur, raw = _stage_step(raw, cur, caches, P, st4, st2, st1, rows, i_s2, x_s2,
                                                            item_args, BS, X_BS, EXTRA, P2, P1)
            k3 = cur[0]
            acc = warpgroup_mma_wait(0, deps=[acc])
            if last0:
                t = (k0 // splits).to(gl.int64)
                if SPLIT:
                    # partials of (t, h, split): acc at ((t*Hq + h)*splits + split)*D, (max, sum) at ml_base + 2*that
                    split = k0 % splits
                    prow = (t * hq + h0 + h_o) * splits + split
                    gl.store(part_ptr + (prow * D)[:, None] + d_o[None, :], acc)
                    prow = (t * hq + h0 + heads) * splits + split
                    gl.store(part_ptr + ml_base + 2 * prow, m_i)
                    gl.store(part_ptr + ml_base + 2 * prow + 1, _row_total(l_2))
                else:
                    b, j = _query_row(k0, splits, s_q)
                    out = acc.to(gl.bfloat16)
                    gl.store(lse_ptr + b * lse_s0 + heads * lse_s1 + j * lse_s2, lse)
                    # through the row buffer the O product just read: 16-byte stores, whole lines a warp
                    gl.thread_barrier()
                    kv.store(out)
                    gl.thread_barrier()
                    gl.store(o_ptr + b * o_s0 + j * o_s1 + (heads_g * o_s2)[:, None] + dims_g[None, :], kv.load(G_L))
                m_i, l_2, acc = _empty_state()
            async_copy.wait_group(1)         # c1's RoPE and the next Q (c2's codes may fly)
            fence_async_shared()
            gl.thread_barrier()              # nxt written, and both warpgroups done with kv
            if last0:
                iq = ib
            ib = ia
            ia = i_n
            ok_a = ok_b
            ok_b = ok_c
            row_b = row_c
            src_b = src
            k0 = k1
            k1 = k2
            k2 = k3
            last0 = last1
            last1 = k3 != k1
        async_copy.wait_group(0)             # no copy outlives the program


if gluon is not None:
    PREFILL_LAUNCHER = FastLauncher(sparse_mla_prefill_gluon_kernel)
    DECODE_LAUNCHER = FastLauncher(sparse_mla_decode_gluon_kernel)


def _dtype(t, absent: torch.dtype) -> torch.dtype:
    """An optional tensor's dtype; `absent`: its placeholder's (the op passes int32 indices for absent lengths,
    the fp32 lse for an absent sink)."""
    return t.dtype if t is not None else absent


def persistent_programs(items: int, hq: int, multiprocessor_count: int) -> int:
    """Programs a head block of a call runs (the grid's axis 0) over its `items` work items (decode: rows x splits;
    prefill: tokens): one per item up to one per SM across the head blocks; past that, each loops over several."""
    return max(1, min(items, multiprocessor_count // (hq // HEADS)))


def bind_prefill(q, kv, indices, sm_scale: float, topk_length, attn_sink, out, max_logits, lse, programs: int):
    """The launch of a prefill call `prefill_planned` accepted, worked out once (grid `programs` x head blocks,
    `persistent_programs`): a callable of the Triton kernel's twelve tensors (q, kv, indices, lengths, kv, indices,
    lengths, sink, out, lse, max_logits, lse), for q and kv at 16-byte aligned addresses (a `FastLauncher` launch:
    Triton's JIT only on the first call)."""
    tokens = q.shape[0]
    ints = (float(sm_scale), indices.shape[2], kv.shape[0], tokens, kv.stride(0) // 8, q.stride(0) // 8,
            q.stride(1) // 8, indices.stride(0), indices.stride(2),
            topk_length.stride(0) if topk_length is not None else 0, out.stride(0), out.stride(1), lse.stride(0),
            lse.stride(1), max_logits.stride(0), max_logits.stride(1))
    meta = dict(HAS_LEN=topk_length is not None, SINKS=attn_sink is not None, num_warps=WARPS)
    dtypes = (q.dtype, kv.dtype, indices.dtype, _dtype(topk_length, indices.dtype), _dtype(attn_sink, lse.dtype),
              out.dtype, lse.dtype, max_logits.dtype)
    fast = PREFILL_LAUNCHER.bind((programs, q.shape[1] // HEADS), dtypes, ints, meta, q.device)

    def launch(q, kv, indices, lens, _kv, _indices, _lens, sink, out, lse, max_logits, _lse):
        fast(q, kv, indices, lens, sink, out, lse, max_logits)

    return launch


MIN_DECODE_STEPS = 2                 # index columns (main + extra) of at least this many 64-row steps


def decode_planned(target: platform.Target, hq: int, q_strides: tuple, fnuz: tuple, rows: int, positions: int,
                   forced: int | None = None, version: str = triton.__version__) -> bool:
    """Whether a decode call runs the Gluon kernel: sm_90, Triton 3.6, a multiple of 64 heads, OCP caches (`fnuz`:
    each cache's flag), q strides multiples of 8 elements, the target's shared memory enough for a program, more than
    SMALL_DECODE_ROWS query rows (B·s_q; fewer take the Triton kernel's small-batch plan of 16-head blocks) and
    `positions` (W + K index columns) of at least MIN_DECODE_STEPS steps (a one-step list was not measured). It
    splits the rows as the Triton kernel would (`sparse_mla.decode_splits`: one wave of items) into the same
    partials and combine (H100, CUDA-graph replay, NOTES.md "The decode's dequantisation under the scores" and "A
    persistent sparse decode": C4A B = 8 / 16 / 32 / 48 / 64 16.2 / 21.4 / 27.5 / 34.0 / 36.8 us against 22.0 /
    32.8 / 42.2 / 52.1 / 58.0 for the Triton kernel). `forced`
    (`ops.sparse_mla.forced_splits`): 1 takes this kernel unsplit whatever the rows, more the Triton kernel."""
    rows_ok = forced == 1 or (forced is None and rows > SMALL_DECODE_ROWS)
    return (gluon is not None and triton_minor(version) in VERIFIED_TRITON and target.backend == "cuda"
            and target.arch == 90 and hq > 0 and hq % HEADS == 0 and layout.HEAD_DIM == 512 and not any(fnuz)
            and rows_ok and positions >= MIN_DECODE_STEPS * 64 and all(s % 8 == 0 for s in q_strides[:3])
            and platform.shared_memory_limit(target) >= DECODE_SHARED_MEMORY)


def bind_decode(q, indices, extra_indices, topk_length, extra_topk_length, attn_sink, out, lse, softmax_scale,
                main, extra, splits: int, ml_base: int, programs: int):
    """The launch of a decode call `decode_planned` accepted (grid `programs` x head blocks, `persistent_programs`):
    a callable of the Triton kernel's twelve tensors (q, cache, indices, lengths, extra cache, extra indices,
    extra lengths, sink, out, lse, lse, partials), for q at a 16-byte aligned address (a `FastLauncher` launch).
    main / extra: the caches' (num_blocks, bs, page stride) (`ops.sparse_mla.CacheInfo`). splits > 1: the
    partials go to the fp32 workspace in the Triton kernel's layout (`sparse_mla.workspace_elements`, its (max,
    sum) pairs from `ml_base`)."""
    batch, s_q = q.shape[0], q.shape[1]
    xi = extra_indices if extra is not None else indices
    ints = (s_q, float(softmax_scale), indices.shape[2], xi.shape[2] if extra is not None else 0,
            main.num_blocks * main.bs, extra.num_blocks * extra.bs if extra is not None else 0, main.page_stride,
            extra.page_stride if extra is not None else main.page_stride, ml_base, batch * s_q * splits, splits,
            q.stride(0) // 8, q.stride(1) // 8, q.stride(2) // 8, *indices.stride(), *xi.stride(),
            topk_length.stride(0) if topk_length is not None else 0,
            extra_topk_length.stride(0) if extra_topk_length is not None else 0, *out.stride()[:3], *lse.stride())
    meta = dict(BS=main.bs, X_BS=extra.bs if extra is not None else main.bs, EXTRA=extra is not None,
                HAS_LEN=topk_length is not None, HAS_X_LEN=extra_topk_length is not None and extra is not None,
                SINKS=attn_sink is not None, SPLIT=splits > 1, num_warps=WARPS)
    # the caches as bytes whatever their dtype, the partials as fp32 (the op's workspace may be bf16)
    dtypes = (q.dtype, torch.uint8, indices.dtype, _dtype(topk_length, indices.dtype), torch.uint8, xi.dtype,
              _dtype(extra_topk_length, indices.dtype), _dtype(attn_sink, lse.dtype),
              out.dtype, lse.dtype, torch.float32)
    fast = DECODE_LAUNCHER.bind((programs, q.shape[2] // HEADS), dtypes, ints, meta, q.device)

    def launch(q, cache, indices, lens, x_cache, x_indices, x_lens, sink, out, lse, _lse, part):
        fast(q, cache, indices, lens, x_cache, x_indices, x_lens, sink, out, lse, part)

    return launch
