"""`flash_mla_sparse_fwd` (the sparse MLA prefill over a bf16 workspace) on sm_90 in Gluon (Triton 3.6).

The Triton kernel (`sparse_mla.sparse_mla_kernel`) keeps an acc tile [64 heads, 512] fp32 in one 8-warp program and
spills: 31 % of the bf16 matmul rate on an H100 (benchmarks/NOTES.md, "Sparse MLA"). Here the layouts are explicit:
a program (one query token, 64 heads = the M of both products) holds Q [64, 512] in shared memory and gathers each
step's 64 selected rows [64, 512] bf16 straight into shared memory with `cp.async` (zero-filled where a position is
not selected) into one of two buffers. Its two warpgroups split the N of both products: scores S = Q K^T [64, 64]
(32 keys each), then O += P V [64, 512] (256 output columns each: 128 accumulator registers a thread), P moving
through shared memory to the A-operand layout. Step t's O product runs asynchronously under step t + 1's wait for
its rows and its scores; the gather of step t + 1 is issued as soon as step t - 1's products (which read its
buffer) are done, and runs under step t's softmax and O. Online softmax in base 2 as the Triton kernel's; the sink enters the
denominator at the end only. H100: 44.8-45.1 % of the bf16 matmul rate on the benchmark's case (the Triton
kernel 31-32 %; the same kernel with every product synchronous 39.4 %; NOTES.md "Sparse MLA prefill in Gluon").

`prefill_planned` says when this path runs: sm_90, Triton 3.6 (Gluon's API moves between versions), 64 heads,
q's token and head strides and kv's row stride multiples of 8 elements, and q and kv 16-byte aligned (16-byte
copies; the op's plan takes the Triton kernel for a call at other addresses). Everything else keeps the Triton
kernel.
"""
from __future__ import annotations

import triton

from .. import layout, platform
from ._launch import triton_minor

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
SHARED_MEMORY = 200704               # bytes a program takes on sm_90 (Q, two row buffers, layout scratch)


def prefill_planned(target: platform.Target, hq: int, q_strides: tuple, kv_row_stride: int,
                    version: str = triton.__version__) -> bool:
    """Whether a prefill call runs the Gluon kernel (module docstring): q's token and head strides and kv's row
    stride multiples of 8 elements (16-byte copies), and the target's shared memory enough for a program."""
    return (gluon is not None and triton_minor(version) in VERIFIED_TRITON and target.backend == "cuda"
            and target.arch == 90 and hq == HEADS and layout.HEAD_DIM == 512
            and all(s % 8 == 0 for s in (*q_strides[:2], kv_row_stride))
            and platform.shared_memory_limit(target) >= SHARED_MEMORY)


if gluon is not None:
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

    @gluon.jit(do_not_specialize=("n_tokens", "width", "num_rows"))
    def sparse_mla_prefill_gluon_kernel(q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, o_ptr, lse_ptr, max_ptr,
                                        n_tokens, sm_scale, width, num_rows, kv_s8, q_s08, q_s18, i_s0, i_s2, len_s,
                                        o_s0, o_s1, lse_s0, lse_s1, max_s0, max_s1,
                                        HAS_LEN: gl.constexpr, SINKS: gl.constexpr):
        """Program t: query token t, all 64 heads, over its selected rows (module docstring). q [Tq, 64, 512],
        kv rows 8 * kv_s8 elements apart, q strides (8 * q_s08, 8 * q_s18, 1) (multiples of 8 elements the compiler
        can see: 16-byte copies), indices [Tq, 1, C] with strides (i_s0, -, i_s2), out [Tq, 64, 512]."""
        gl.static_assert(gl.num_warps() == 8)
        D: gl.constexpr = 512
        H: gl.constexpr = 64
        BN: gl.constexpr = 64
        S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, 32, 16])
        O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, 256, 16])
        P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=2)
        SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16)
        G_L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        kv_s0 = kv_s8 * 8
        q_s0 = q_s08 * 8
        q_s1 = q_s18 * 8
        t = gl.program_id(0).to(gl.int64)
        n_sel = width
        if HAS_LEN:
            n_sel = gl.minimum(gl.maximum(gl.load(len_ptr + t * len_s), 0), width)
        steps = gl.cdiv(n_sel, BN)
        idx_row = idx_ptr + t * i_s0
        rows_g = gl.arange(0, BN, layout=gl.SliceLayout(1, G_L))
        dims_g = gl.arange(0, D, layout=gl.SliceLayout(0, G_L))

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [H, D], SH)
        kv_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, D], SH)
        async_copy.async_copy_global_to_shared(q_smem, q_ptr + t * q_s0 + (rows_g * q_s1)[:, None] + dims_g[None, :])
        async_copy.commit_group()
        slot_g, ok_g = _slots(idx_row, i_s2, 0, n_sel, num_rows, rows_g, BN)
        _gather(kv_ptr, slot_g, ok_g, kv_s0, kv_smem.index(0), dims_g)

        scale = sm_scale * 1.4426950408889634
        keys = gl.arange(0, BN, layout=gl.SliceLayout(0, S_MMA))
        m_i = gl.full([H], float("-inf"), gl.float32, gl.SliceLayout(1, S_MMA))
        l_i = gl.zeros([H], gl.float32, gl.SliceLayout(1, S_MMA))
        acc = gl.zeros([H, D], gl.float32, O_MMA)
        s_zero = gl.zeros([H, BN], gl.float32, S_MMA)
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
            s = gl.where(ok_s[None, :], s * scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - m_use[:, None])
            alpha = gl.exp2(m_i - m_use)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))[:, None]
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_OP), kv, acc, is_async=True)
            ok_s = ok_next
        acc = warpgroup_mma_wait(0, deps=[acc])
        async_copy.wait_group(0)                 # no copy outlives the program (a token with nothing selected)

        heads = gl.arange(0, H, layout=gl.SliceLayout(1, S_MMA))
        denom = l_i
        if SINKS:
            z = gl.load(sink_ptr + heads) * 1.4426950408889634
            denom = l_i + gl.exp2(z - gl.where(m_i == float("-inf"), 0.0, m_i))
        empty = l_i == 0
        inv = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, denom))
        lse = gl.where(empty, float("inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        gl.store(lse_ptr + t * lse_s0 + heads * lse_s1, lse)
        gl.store(max_ptr + t * max_s0 + heads * max_s1, m_i * 0.6931471805599453)
        out = (acc * gl.convert_layout(inv, gl.SliceLayout(1, O_MMA))[:, None]).to(gl.bfloat16)
        h_o = gl.arange(0, H, layout=gl.SliceLayout(1, O_MMA))
        d_o = gl.arange(0, D, layout=gl.SliceLayout(0, O_MMA))
        gl.store(o_ptr + t * o_s0 + (h_o * o_s1)[:, None] + d_o[None, :], out)


def bind_prefill(q, kv, indices, sm_scale: float, topk_length, attn_sink, out, max_logits, lse):
    """The launch of a prefill call `prefill_planned` accepted, worked out once: a callable of the Triton kernel's
    twelve tensors (q, kv, indices, lengths, kv, indices, lengths, sink, out, lse, max_logits, lse), for q and kv at
    16-byte aligned addresses. Launched through Triton's own path."""
    tokens = q.shape[0]
    ints = (tokens, float(sm_scale), indices.shape[2], kv.shape[0], kv.stride(0) // 8, q.stride(0) // 8,
            q.stride(1) // 8, indices.stride(0), indices.stride(2), topk_length.stride(0) if topk_length is not None else 0,
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), max_logits.stride(0), max_logits.stride(1))
    kernel = sparse_mla_prefill_gluon_kernel[(tokens,)]
    meta = dict(HAS_LEN=topk_length is not None, SINKS=attn_sink is not None, num_warps=WARPS)

    def launch(q, kv, indices, lens, _kv, _indices, _lens, sink, out, lse, max_logits, _lse):
        kernel(q, kv, indices, lens, sink, out, lse, max_logits, *ints, **meta)

    return launch
