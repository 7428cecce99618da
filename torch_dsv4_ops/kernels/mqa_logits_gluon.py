"""`fp8_fp4_paged_mqa_logits` on sm_90 in Gluon (Triton 3.6): the K codes straight into the wgmma A operand.

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

`planned` says when this path runs: sm_90, Triton 3.6 (Gluon's API moves between versions), 64 heads, next_n 1 or 2,
64-key pages, e4m3fn codes, contiguous q and weights. Everything else keeps the Triton kernel. The results equal the
Triton kernel's to fp32 rounding (the same exact fp16 products, accumulated in fp32 in another order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layout, platform
from ._launch import triton_minor

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


def planned(target: platform.Target, heads: int, next_n: int, block_size: int, q: torch.Tensor,
            weights: torch.Tensor, q_fmt: layout.Fp8Format, k_fmt: layout.Fp8Format,
            version: str = triton.__version__) -> bool:
    """Whether a paged call runs the Gluon kernel (module docstring)."""
    return (gluon is not None and triton_minor(version) in VERIFIED_TRITON and target.backend == "cuda"
            and target.arch == 90 and heads == HEADS and next_n in (1, 2) and block_size == BLOCK
            and layout.INDEXER_DIM == 128 and q_fmt == layout.E4M3FN and k_fmt == layout.E4M3FN
            and q.is_contiguous() and weights.is_contiguous())


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

    @gluon.jit
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


class _Words:
    """The cache's address as an int32 pointer argument (its pages hold int32 words; a non-contiguous uint8 view
    cannot be viewed as int32)."""

    __slots__ = ("address",)
    dtype = torch.int32

    def __init__(self, t: torch.Tensor):
        self.address = t.data_ptr()

    def data_ptr(self) -> int:
        return self.address


def bind(q, context_lens, block_tables, out, num_blocks: int, page_stride: int, max_len: int, clean: bool,
         multiprocessor_count: int):
    """The launch of a call `planned` accepted, with its grid, ints and constexprs worked out once (they follow from
    the call's signature): a callable of (q, kv_cache, weights, context_lens, block_tables, out). page_stride:
    bytes, a multiple of 4; the cache 4-byte aligned. Launched through Triton's own path."""
    batch, next_n = q.shape[0], q.shape[1]
    n_splits, per = splits(batch, max_len, multiprocessor_count)
    lens_2d = context_lens.dim() == 2
    c_s0, c_s1 = context_lens.stride() if lens_2d else (context_lens.stride(0), 0)
    ints = (max_len, num_blocks, page_stride // 4, block_tables.shape[1], c_s0, c_s1, block_tables.stride(0),
            block_tables.stride(1), out.stride(0), per)
    kernel = paged_mqa_logits_gluon_kernel[(batch, n_splits)]
    meta = dict(NEXT_N=next_n, LENS_2D=lens_2d, CLEAN=clean, num_warps=4, maxnreg=MAXNREG)

    def launch(q, kv_cache, weights, context_lens, block_tables, out):
        kernel(q.view(torch.uint8), _Words(kv_cache), weights, context_lens, block_tables, out, *ints, **meta)

    return launch
