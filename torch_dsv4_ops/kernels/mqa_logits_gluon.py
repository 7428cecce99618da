"""The indexer logits on sm_90 in Gluon (Triton 3.6): the K codes straight into the wgmma A operand.
`paged_mqa_logits_gluon_kernel` serves `fp8_fp4_paged_mqa_logits`, `mqa_logits_gluon_kernel` the prefill
`fp8_fp4_mqa_logits`.

The Triton kernel (`mqa_logits.paged_mqa_logits_kernel`) decodes each 64-key tile into registers, moves it through
shared memory to the dot's operand layout and the logits through it again to the store's: 48 % of the read
bandwidth on an H100 (benchmarks/NOTES.md). Gluon's explicit layouts let the codes be loaded in the operand's own
distribution: a thread of the m64 A fragment holds keys 16 v + l // 4 and + 8 (warp v, lane l) and dims
16 c + 8 h + 2 m + e (m = l % 4); taking the 128 dims in the order pi(k) = 32 m + 4 c + 2 h + e, and storing Q's
shared-memory operand in the same order (the dot product does not see the order), puts each lane's 32 bytes of a
key side by side: two 16-byte loads, `cvt.rn.f16x2.e4m3x2`, and a register-only reshape to the operand. One product
per query (N = 64), the second query's issued asynchronously under the first's head sums, loads one tile ahead
(`evict_first`), 128 registers: 4 programs per SM, about one wave of them. H100: 71.4 % of read in the benchmark
(48 % with the Triton kernel; NOTES.md "Paged indexer logits in Gluon").

The prefill kernel takes the same operand loads over contiguous key rows: a program holds 4 queries' Q (65 KB of
shared memory) and walks the 64-key tiles that meet their ranges, one N = 64 product per query, each issued before
the previous query's head sums so that one product is always in flight; 168 registers, 3 programs per SM. H100:
47.4 % (full ranges) and 47.6 % (causal) of the fp8 matmul rate, against 40-41 % with the Triton kernel.

`planned` / `prefill_planned` say when these paths run: sm_90, Triton 3.6 (Gluon's API moves between versions),
64 heads, e4m3fn codes; paged: next_n 1 or 2, 64-key pages, contiguous q and weights; prefill: D 128, k rows a
multiple of 4 bytes apart. Everything else keeps the Triton kernels. The results equal the Triton kernels' to fp32
rounding (the same exact 16-bit products, accumulated in fp32 in another order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layout, platform
from ._launch import FastLauncher, triton_minor

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)
except ImportError:                  # a Triton without Gluon
    gluon = None

VERIFIED_TRITON = ("3.6",)
HEADS = 64
BLOCK = 64                           # keys per tile: one page
_HEADS = tl.constexpr(HEADS)                 # the same, as constexpr globals of the kernels
_BLOCK = tl.constexpr(BLOCK)
PROGRAMS_PER_SM = 4                  # 128 registers a thread, 4 warps
MAXNREG = 128
# Prefill: 4 queries a program (4 products of N = 64 per 64-key tile, 65 KB of shared memory), 4 warps, 168
# registers: 3 programs per SM. Swept on an H100 (benchmarks/NOTES.md "Prefill indexer logits in Gluon").
PREFILL_QUERIES = 4
PREFILL_WARPS = 4
PREFILL_MAXNREG = 168


def planned(target: platform.Target, heads: int, next_n: int, block_size: int, q: torch.Tensor,
            weights: torch.Tensor, q_fmt: layout.Fp8Format, k_fmt: layout.Fp8Format,
            version: str = triton.__version__) -> bool:
    """Whether a paged call runs the Gluon kernel (module docstring)."""
    return (gluon is not None and triton_minor(version) in VERIFIED_TRITON and target.backend == "cuda"
            and target.arch == 90 and heads == HEADS and next_n in (1, 2) and block_size == BLOCK
            and layout.INDEXER_DIM == 128 and q_fmt == layout.E4M3FN and k_fmt == layout.E4M3FN
            and q.is_contiguous() and weights.is_contiguous())


def prefill_planned(target: platform.Target, heads: int, dim: int, k_row_bytes: int, q_fmt: layout.Fp8Format,
                    k_fmt: layout.Fp8Format, version: str = triton.__version__) -> bool:
    """Whether a prefill call runs the Gluon kernel: sm_90, Triton 3.6, 64 heads, D 128, e4m3fn, k rows a multiple
    of 4 bytes apart (read as int32 words; a call whose k address is not 4-byte aligned takes the Triton kernel)."""
    return (gluon is not None and triton_minor(version) in VERIFIED_TRITON and target.backend == "cuda"
            and target.arch == 90 and heads == HEADS and dim == 128 and k_row_bytes % 4 == 0
            and q_fmt == layout.E4M3FN and k_fmt == layout.E4M3FN)


def splits(batch: int, max_len: int, multiprocessor_count: int) -> tuple[int, int]:
    """(splits, tiles per split): about one wave of PROGRAMS_PER_SM programs per SM over the B requests."""
    tiles = layout.cdiv(max_len, BLOCK)
    want = max(1, min(PROGRAMS_PER_SM * multiprocessor_count // max(batch, 1), tiles))
    per = layout.cdiv(tiles, want)
    return layout.cdiv(tiles, per), per


if gluon is not None:
    @gluon.jit
    def _decode4(words):
        """int32 words of 4 e4m3fn codes -> 4 fp16 tensors (bytes 0..3)."""
        return gl.inline_asm_elementwise(
            asm="{ .reg .b16 c0, c1; .reg .b32 lo, hi; mov.b32 {c0, c1}, $4; cvt.rn.f16x2.e4m3x2 lo, c0; "
                "cvt.rn.f16x2.e4m3x2 hi, c1; mov.b32 {$0, $1}, lo; mov.b32 {$2, $3}, hi; }",
            constraints="=h,=h,=h,=h,r", args=[words], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
            is_pure=True, pack=1)

    @gluon.jit
    def _permuted(x):
        """[R, 128] in key-byte order -> product order: column k = 16 c + 8 h + 2 m + e takes byte pi(k)."""
        return gl.reshape(gl.permute(gl.reshape(x, [x.shape[0], 4, 8, 2, 2]), (0, 2, 3, 1, 4)), [x.shape[0], 128])

    @gluon.jit
    def _tile(cache32_ptr, bt_ptr, b, bt_s0, bt_s1, t, t1, width, num_blocks, page_words, rows_w, words, keys):
        """Tile t's block (-1 when invalid: an entry < 0 or >= num_blocks, a column past the table, t >= t1), its
        codes as int32 words [64, 32] in the A-operand distribution and its scales [64]; zeros when invalid."""
        blk = gl.load(bt_ptr + b * bt_s0 + t * bt_s1, mask=(t < t1) & (t < width), other=-1).to(gl.int64)
        blk = gl.where((blk >= 0) & (blk < num_blocks), blk, -1)
        ok = blk >= 0
        page = cache32_ptr + gl.maximum(blk, 0) * page_words
        wd = gl.load(page + rows_w[:, None] * 32 + words[None, :], mask=ok, other=0, eviction_policy="evict_first")
        sc = gl.load((page + _BLOCK * 32 + keys).to(gl.pointer_type(gl.float32)), mask=ok, other=0.0)
        return blk, wd, sc

    @gluon.jit
    def _query_logits(acc, w, sc, ok, t, length, out_ptr, row, o_s0, max_len):
        """One query's logits of a tile from its [64 keys, 64 heads] product: -inf for keys of an invalid page and
        keys at or past the query's length."""
        lg = gl.sum(gl.maximum(acc, 0.0) * w[None, :], axis=1)
        kg = t * _BLOCK + gl.arange(0, _BLOCK, layout=lg.type.layout)
        val = gl.where(ok & (kg < length), lg * sc, float("-inf"))
        gl.store(out_ptr + row.to(gl.int64) * o_s0 + kg, val, mask=kg < max_len)

    @gluon.jit
    def _lens(ctx_ptr, b, c_s0, c_s1, j, max_len, NEXT_N: gl.constexpr, LENS_2D: gl.constexpr):
        """Clamped key count of query j of request b: context_lens[b, j], or ctx_b - next_n + j + 1."""
        if LENS_2D:
            n = gl.load(ctx_ptr + b * c_s0 + j * c_s1)
        else:
            n = gl.load(ctx_ptr + b * c_s0) - NEXT_N + 1 + j
        return gl.minimum(gl.maximum(n, 0), max_len)

    @gluon.jit(do_not_specialize=("max_len", "num_blocks", "width", "o_s0", "tiles_per_split"))
    def paged_mqa_logits_gluon_kernel(q_ptr, cache32_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr, max_len, num_blocks,
                                      page_words, width, c_s0, c_s1, bt_s0, bt_s1, o_s0, tiles_per_split,
                                      NEXT_N: gl.constexpr, LENS_2D: gl.constexpr, CLEAN: gl.constexpr):
        """Program (b, split): the tiles [split * tiles_per_split, ...) of request b, both queries. q: [B, NEXT_N,
        64, 128] codes, weights [B * NEXT_N, 64], both contiguous; out rows b * NEXT_N + j."""
        b = gl.program_id(0)
        split = gl.program_id(1)
        ROWS: gl.constexpr = NEXT_N * _HEADS
        MMA_WIDE: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 128, 16])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        A_WORDS: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_WIDE, k_width=2)
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        W_L: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
                                                       lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                                       warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32])
        Q_L: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
        B_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, 128], gl.float16)
        O_L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])

        len0 = _lens(ctx_ptr, b, c_s0, c_s1, 0, max_len, NEXT_N, LENS_2D)
        if NEXT_N == 2:
            len1 = _lens(ctx_ptr, b, c_s0, c_s1, 1, max_len, NEXT_N, LENS_2D)
        else:
            len1 = len0
        t0 = split * tiles_per_split
        t_end = gl.minimum(t0 + tiles_per_split, gl.cdiv(max_len, _BLOCK))
        t1 = gl.maximum(gl.minimum(t_end, gl.cdiv(gl.maximum(len0, len1), _BLOCK)), t0)
        rows_w = gl.arange(0, 64, layout=gl.SliceLayout(1, W_L))
        words = gl.arange(0, 32, layout=gl.SliceLayout(0, W_L))
        keys = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
        blk0, wd0, sc0 = _tile(cache32_ptr, bt_ptr, b, bt_s0, bt_s1, t0, t1, width, num_blocks, page_words, rows_w,
                               words, keys)

        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, Q_L))                   # query x head
        dims = gl.arange(0, 128, layout=gl.SliceLayout(0, Q_L))
        q_codes = _permuted(gl.load(q_ptr + b.to(gl.int64) * (ROWS * 128) + rows[:, None] * 128 + dims[None, :]))
        q_smem = gl.allocate_shared_memory(gl.float16, [ROWS, 128], B_SH,
                                           q_codes.to(gl.float8e4nv, bitcast=True).to(gl.float16))
        fence_async_shared()
        b_op = q_smem.permute((1, 0))
        heads = gl.arange(0, 64, layout=gl.SliceLayout(0, MMA))
        w0 = gl.load(w_ptr + b.to(gl.int64) * ROWS + heads)
        b0 = b_op.slice(0, 64, dim=1)
        if NEXT_N == 2:
            w1 = gl.load(w_ptr + b.to(gl.int64) * ROWS + 64 + heads)
            b1 = b_op.slice(64, 64, dim=1)
        for t in range(t0, t1):
            blk1, wd1, sc1 = _tile(cache32_ptr, bt_ptr, b, bt_s0, bt_s1, t + 1, t1, width, num_blocks, page_words,
                                   rows_w, words, keys)
            x0, x1, x2, x3 = _decode4(wd0)
            a = _permuted(gl.reshape(gl.join(gl.join(x0, x2), gl.join(x1, x3)), [64, 128]))   # bytes in key order
            a = gl.convert_layout(gl.convert_layout(a, A_WORDS), A_L)
            ok = blk0 >= 0
            acc = warpgroup_mma(a, b0, gl.zeros([64, 64], gl.float32, MMA), use_acc=False)
            if NEXT_N == 2:
                tok = warpgroup_mma(a, b1, gl.zeros([64, 64], gl.float32, MMA), use_acc=False, is_async=True)
                _query_logits(acc, w0, sc0, ok, t, len0, out_ptr, b * 2, o_s0, max_len)
                acc = warpgroup_mma_wait(0, deps=[tok])
                _query_logits(acc, w1, sc0, ok, t, len1, out_ptr, b * 2 + 1, o_s0, max_len)
            else:
                _query_logits(acc, w0, sc0, ok, t, len0, out_ptr, b, o_s0, max_len)
            blk0 = blk1
            wd0 = wd1
            sc0 = sc1
        if CLEAN:
            ninf = gl.full([_BLOCK], float("-inf"), gl.float32, O_L)
            k_o = gl.arange(0, _BLOCK, layout=O_L)
            for t in range(t1, t_end):
                kg = t * _BLOCK + k_o
                for j in gl.static_range(NEXT_N):
                    gl.store(out_ptr + (b * NEXT_N + j).to(gl.int64) * o_s0 + kg, ninf, mask=kg < max_len)


    @gluon.jit
    def _k_tile(k32_ptr, sc_ptr, t, t_hi, n_keys, k_words, sc_s0, rows_w, words, keys, BLOCK: gl.constexpr):
        """Prefill key tile t: codes as int32 words [BLOCK, 32] in the A-operand distribution and scales [BLOCK];
        zeros for keys >= n_keys and for t >= t_hi (nothing loaded)."""
        n_w = t * BLOCK + rows_w
        wd = gl.load(k32_ptr + n_w.to(gl.int64)[:, None] * k_words + words[None, :],
                     mask=((n_w < n_keys) & (t < t_hi))[:, None], other=0)
        n_s = t * BLOCK + keys
        sc = gl.load(sc_ptr + n_s.to(gl.int64) * sc_s0, mask=(n_s < n_keys) & (t < t_hi), other=0.0)
        return wd, sc

    @gluon.jit
    def _pick(v, j):
        """Element j of a [GQ] vector every thread holds whole."""
        return gl.sum(gl.where(gl.arange(0, v.shape[0], layout=v.type.layout) == j, v, 0), axis=0)

    @gluon.jit
    def _range_logits(acc, w, sc, t, ks, ke, n_keys, out_ptr, row, row_ok, o_s0, BLOCK: gl.constexpr):
        """One query's logits of a prefill tile from its [BLOCK keys, 64 heads] product: -inf outside [ks, ke)."""
        lg = gl.sum(gl.maximum(acc, 0.0) * w[None, :], axis=1)
        n = t * BLOCK + gl.arange(0, BLOCK, layout=lg.type.layout)
        val = gl.where((n >= ks) & (n < ke), lg * sc, float("-inf"))
        gl.store(out_ptr + row * o_s0 + n, val, mask=(n < n_keys) & row_ok)

    @gluon.jit
    def _prefill_query_logits(acc, w_smem, sc, t, ks, ke, j, m0, n_queries, n_keys, out_ptr, o_s0,
                              BLOCK: gl.constexpr):
        """`_range_logits` of the program's query j (its weights, range and row)."""
        w = w_smem.slice(j * _HEADS, _HEADS).load(gl.SliceLayout(0, acc.type.layout))
        _range_logits(acc, w, sc, t, _pick(ks, j), _pick(ke, j), n_keys, out_ptr, (m0 + j).to(gl.int64),
                      m0 + j < n_queries, o_s0, BLOCK)

    @gluon.jit(do_not_specialize=("n_queries", "n_keys", "o_s0"))
    def mqa_logits_gluon_kernel(q_ptr, k32_ptr, sc_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, n_queries, n_keys, q_s0,
                                q_s1, k_words, sc_s0, w_s0, w_s1, ks_s0, ke_s0, o_s0,
                                GQ: gl.constexpr, CLEAN: gl.constexpr):
        """Program p: queries [GQ * blk, GQ * blk + GQ), blk counted from the end (the longest causal ranges
        first), over the key tiles meeting their ranges; tiles of 16 * num_warps keys (64 per warpgroup). q: [M,
        64, 128] codes with strides (q_s0, q_s1, 1); k: [N, 128] codes, rows k_words int32 words apart."""
        gl.static_assert(GQ <= 4, "GQ 8 gave wrong logits on an H100 (NOTES.md)")
        NW: gl.constexpr = gl.num_warps()
        BLOCK: gl.constexpr = 16 * NW
        ROWS: gl.constexpr = GQ * _HEADS
        MMA_WIDE: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, 128, 16])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, 64, 16])
        A_WORDS: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_WIDE, k_width=2)
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        if NW == 8:
            W_L: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                warp_bases=[[16, 0], [32, 0], [64, 0]], block_bases=[], shape=[BLOCK, 32])
        else:
            W_L: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK, 32])
        Q_L: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [NW, 1], [1, 0])
        B_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, 128], gl.float16)
        W_SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        R_L: gl.constexpr = gl.BlockedLayout([GQ], [32], [NW], [0])
        O_L: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])

        blk = gl.num_programs(0) - 1 - gl.program_id(0)
        m0 = blk * GQ
        qi = m0 + gl.arange(0, GQ, layout=R_L)
        q_ok = qi < n_queries
        ks = gl.load(ks_ptr + qi.to(gl.int64) * ks_s0, mask=q_ok, other=0)
        ke = gl.load(ke_ptr + qi.to(gl.int64) * ke_s0, mask=q_ok, other=0)
        ks = gl.minimum(gl.maximum(ks, 0), n_keys)
        ke = gl.minimum(gl.maximum(ke, ks), n_keys)
        lo = gl.min(gl.where(q_ok, ks, n_keys), axis=0)
        hi = gl.max(gl.where(q_ok, ke, 0), axis=0)
        t_lo = lo // BLOCK
        t_hi = gl.where(hi > lo, gl.cdiv(hi, BLOCK), t_lo)

        rows_w = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, W_L))
        words = gl.arange(0, 32, layout=gl.SliceLayout(0, W_L))
        keys = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA))
        wd0, sc0 = _k_tile(k32_ptr, sc_ptr, t_lo, t_hi, n_keys, k_words, sc_s0, rows_w, words, keys, BLOCK)

        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, Q_L))                   # query x head
        dims = gl.arange(0, 128, layout=gl.SliceLayout(0, Q_L))
        q_row = m0 + rows // _HEADS
        q_codes = gl.load(q_ptr + q_row.to(gl.int64)[:, None] * q_s0 + (rows % _HEADS)[:, None] * q_s1
                          + dims[None, :], mask=(q_row < n_queries)[:, None], other=0)
        q_smem = gl.allocate_shared_memory(gl.float16, [ROWS, 128], B_SH,
                                           _permuted(q_codes).to(gl.float8e4nv, bitcast=True).to(gl.float16))
        heads = gl.arange(0, _HEADS, layout=gl.SliceLayout(0, MMA))
        wq = gl.arange(0, GQ, layout=gl.SliceLayout(1, MMA))
        w_row = m0 + wq
        w_all = gl.load(w_ptr + w_row.to(gl.int64)[:, None] * w_s0 + heads[None, :] * w_s1,
                        mask=(w_row < n_queries)[:, None], other=0.0)
        w_smem = gl.allocate_shared_memory(gl.float32, [ROWS], W_SH, gl.reshape(w_all, [ROWS]))
        fence_async_shared()
        b_op = q_smem.permute((1, 0))
        zero = gl.zeros([BLOCK, _HEADS], gl.float32, MMA)
        for t in range(t_lo, t_hi):
            wd1, sc1 = _k_tile(k32_ptr, sc_ptr, t + 1, t_hi, n_keys, k_words, sc_s0, rows_w, words, keys, BLOCK)
            x0, x1, x2, x3 = _decode4(wd0)
            a = _permuted(gl.reshape(gl.join(gl.join(x0, x2), gl.join(x1, x3)), [BLOCK, 128]))
            a = gl.convert_layout(gl.convert_layout(a, A_WORDS), A_L)
            acc = warpgroup_mma(a, b_op.slice(0, _HEADS, dim=1), zero, use_acc=False, is_async=True)
            for j in gl.static_range(1, GQ):
                nxt = warpgroup_mma(a, b_op.slice(j * _HEADS, _HEADS, dim=1), zero, use_acc=False, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
                _prefill_query_logits(acc, w_smem, sc0, t, ks, ke, j - 1, m0, n_queries, n_keys, out_ptr, o_s0,
                                      BLOCK)
                acc = nxt
            acc = warpgroup_mma_wait(0, deps=[acc])
            _prefill_query_logits(acc, w_smem, sc0, t, ks, ke, GQ - 1, m0, n_queries, n_keys, out_ptr, o_s0, BLOCK)
            wd0 = wd1
            sc0 = sc1
        if CLEAN:
            ninf = gl.full([BLOCK], float("-inf"), gl.float32, O_L)
            n_o = gl.arange(0, BLOCK, layout=O_L)
            for t in range(0, gl.cdiv(n_keys, BLOCK)):
                if (t < t_lo) | (t >= t_hi):
                    n = t * BLOCK + n_o
                    for j in gl.static_range(GQ):
                        gl.store(out_ptr + (m0 + j).to(gl.int64) * o_s0 + n, ninf,
                                 mask=(n < n_keys) & (m0 + j < n_queries))


if gluon is not None:
    PAGED_LAUNCHER = FastLauncher(paged_mqa_logits_gluon_kernel)
    PREFILL_LAUNCHER = FastLauncher(mqa_logits_gluon_kernel)


def bind(q, context_lens, block_tables, out, num_blocks: int, page_stride: int, max_len: int, clean: bool,
         multiprocessor_count: int):
    """The launch of a call `planned` accepted, with its grid, ints and constexprs worked out once (they follow from
    the call's signature): a callable of (q, kv_cache, weights, context_lens, block_tables, out). page_stride:
    bytes, a multiple of 4; the cache 4-byte aligned. A `FastLauncher` launch: Triton's JIT only on the first call."""
    batch, next_n = q.shape[0], q.shape[1]
    n_splits, per = splits(batch, max_len, multiprocessor_count)
    lens_2d = context_lens.dim() == 2
    c_s0, c_s1 = context_lens.stride() if lens_2d else (context_lens.stride(0), 0)
    ints = (max_len, num_blocks, page_stride // 4, block_tables.shape[1], c_s0, c_s1, block_tables.stride(0),
            block_tables.stride(1), out.stride(0), per)
    meta = dict(NEXT_N=next_n, LENS_2D=lens_2d, CLEAN=clean, num_warps=4, maxnreg=MAXNREG)
    # q's fp8 codes as bytes, the cache's rows as int32 words, the rest as they are (a table of int32 or int64)
    dtypes = (torch.uint8, torch.int32, torch.float32, context_lens.dtype, block_tables.dtype, out.dtype)
    return PAGED_LAUNCHER.bind((batch, n_splits), dtypes, ints, meta, q.device)


def bind_prefill(q, k, k_scale, weights, ks, ke, out, clean: bool):
    """The launch of a prefill call `prefill_planned` accepted, worked out once: a callable of (q, k, k_scale,
    weights, ks, ke, out) for k at a 4-byte aligned address (a `FastLauncher` launch)."""
    m = q.shape[0]
    ints = (m, k.shape[0], q.stride(0), q.stride(1), k.stride(0) // 4, k_scale.stride(0), weights.stride(0),
            weights.stride(1), ks.stride(0), ke.stride(0), out.stride(0))
    meta = dict(GQ=PREFILL_QUERIES, CLEAN=clean, num_warps=PREFILL_WARPS, maxnreg=PREFILL_MAXNREG)
    dtypes = (torch.uint8, torch.int32, k_scale.dtype, weights.dtype, ks.dtype, ke.dtype, out.dtype)
    return PREFILL_LAUNCHER.bind((triton.cdiv(m, PREFILL_QUERIES),), dtypes, ints, meta, q.device)
