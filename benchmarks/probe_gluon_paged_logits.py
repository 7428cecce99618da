"""A Gluon form of the paged indexer logits, measured beside the op (H100, Triton 3.6 only):
`python -m benchmarks.probe_gluon_paged_logits [--tiles-per-split N ...]`.

A probe for issue 10's open target (paged logits >= 70 % of the read bandwidth), not a kernel of the package: it
covers the benchmark's case only (B = 64 requests, next_n = 2, 64 heads, D = 128, 64-key pages, e4m3fn codes,
every table entry valid) and checks itself against `fp8_fp4_paged_mqa_logits` on the same inputs. What it tries
(benchmarks/NOTES.md, "Paged indexer logits in Gluon"):

* the K codes of a page go straight into the wgmma A-operand registers, with no trip through shared memory: the
  128 dims are taken in the order pi(k) = 32 m + 4 c + 2 h + e for k = 16 c + 8 h + 2 m + e (each lane's 32 bytes
  of a key then lie together: two 16-byte loads), decoded by `cvt.rn.f16x2.e4m3x2`, and Q's shared-memory operand
  is stored in the same order;
* one product per query (N = 64: 32 accumulator and 16 weight registers a thread), the second query's product
  issued asynchronously before the first query's head sums, the loads one tile ahead (the first tile's before
  the queries'), 128 registers: 4 programs per SM;
* 32 tiles per split: 8 splits x 64 requests, about one wave of 4 programs per SM;
* the codes loaded with `evict_first` (each is read once).
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton

from torch_dsv4_ops import layout
from torch_dsv4_ops.kernels._launch import triton_minor
from torch_dsv4_ops.ops import mqa_logits as ops
from torch_dsv4_ops.ops.indexer import indexer_k_quant_and_cache

from . import bench_mqa_logits as bench, harness

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)
except ImportError:        # a Triton without Gluon: main() says so
    gluon = None

VERIFIED_TRITON = ("3.6",)        # Gluon's API moves between versions; written against this one

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
    def _pi(k):
        """Dim k = 16 c + 8 h + 2 m + e of the products -> byte 32 m + 4 c + 2 h + e of a key."""
        return 32 * ((k >> 1) & 3) + 4 * (k >> 4) + 2 * ((k >> 3) & 1) + (k & 1)

    @gluon.jit
    def _tile_loads(cache32_ptr, bt_ptr, b, bt_s0, t, t1, page_words, rows_w, words, keys):
        """Tile t's codes as int32 words [64, 32] in the A-operand distribution, and its scales [64] in the
        products' row layout; zeros past t1. cache32_ptr: the cache as int32 words (page_words per page)."""
        blk = gl.load(bt_ptr + b * bt_s0 + t, mask=t < t1, other=-1).to(gl.int64)
        page = cache32_ptr + gl.maximum(blk, 0) * page_words
        ok = blk >= 0
        wd = gl.load(page + rows_w[:, None] * 32 + words[None, :], mask=ok, other=0,
                     eviction_policy="evict_first")                      # read once: 71 % of read against 68 %
        sc = gl.load((page + 64 * 32 + keys).to(gl.pointer_type(gl.float32)), mask=ok, other=0.0)
        return wd, sc

    @gluon.jit
    def _operand(wd, A_WORDS: gl.constexpr, A_L: gl.constexpr):
        """The words' codes as the [64 keys, 128 dims] fp16 A operand (dims in product order)."""
        x0, x1, x2, x3 = _decode4(wd)
        a = gl.reshape(gl.join(gl.join(x0, x2), gl.join(x1, x3)), [64, 128])             # bytes in key order
        a = gl.reshape(gl.permute(gl.reshape(a, [64, 4, 8, 2, 2]), (0, 2, 3, 1, 4)), [64, 128])   # pi^-1
        return gl.convert_layout(gl.convert_layout(a, A_WORDS), A_L)

    @gluon.jit
    def _query_logits(acc, w, sc, t, length, out_ptr, row, o_s0, max_len):
        """One query's logits of a tile from its [64 keys, 64 heads] product (sc: the keys' scales, in the layout
        of the head sum)."""
        lg = gl.sum(gl.maximum(acc, 0.0) * w[None, :], axis=1)
        LG: gl.constexpr = lg.type.layout
        kg = t * 64 + gl.arange(0, 64, layout=LG)
        val = gl.where(kg < length, lg * sc, float("-inf"))
        gl.store(out_ptr + row.to(gl.int64) * o_s0 + kg, val, mask=kg < max_len)

    @gluon.jit
    def paged_logits_probe_kernel(q_ptr, cache32_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr, max_len, page_words, bt_s0,
                                  o_s0, tiles_per_split):
        b = gl.program_id(0)
        split = gl.program_id(1)
        MMA_WIDE: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 128, 16])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        A_WORDS: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_WIDE, k_width=2)
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        # thread (warp v, lane l): keys 16 v + l // 4 and + 8, words 8 (l % 4) .. + 8: the A operand's keys and
        # its dims' bytes under pi
        W_L: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
                                                       lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                                       warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32])
        Q_L: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
        B_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float16)

        len0 = gl.minimum(gl.maximum(gl.load(ctx_ptr + b * 2), 0), max_len)
        len1 = gl.minimum(gl.maximum(gl.load(ctx_ptr + b * 2 + 1), 0), max_len)
        t0 = split * tiles_per_split
        t1 = gl.minimum(t0 + tiles_per_split, gl.cdiv(gl.maximum(len0, len1), 64))
        rows_w = gl.arange(0, 64, layout=gl.SliceLayout(1, W_L))
        words = gl.arange(0, 32, layout=gl.SliceLayout(0, W_L))
        keys = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
        # the first tile's loads go out before the queries'
        wd0, sc0 = _tile_loads(cache32_ptr, bt_ptr, b, bt_s0, t0, t1, page_words, rows_w, words, keys)

        rows = gl.arange(0, 128, layout=gl.SliceLayout(1, Q_L))                       # query x head
        dims = gl.arange(0, 128, layout=gl.SliceLayout(0, Q_L))
        q_codes = gl.load(q_ptr + b.to(gl.int64) * 16384 + rows[:, None] * 128 + dims[None, :])
        q_codes = gl.reshape(gl.permute(gl.reshape(q_codes, [128, 4, 8, 2, 2]), (0, 2, 3, 1, 4)), [128, 128])
        q_smem = gl.allocate_shared_memory(gl.float16, [128, 128], B_SH,
                                           q_codes.to(gl.float8e4nv, bitcast=True).to(gl.float16))
        fence_async_shared()
        b_op = q_smem.permute((1, 0))
        b0 = b_op.slice(0, 64, dim=1)
        b1 = b_op.slice(64, 64, dim=1)
        heads = gl.arange(0, 64, layout=gl.SliceLayout(0, MMA))
        w0 = gl.load(w_ptr + b.to(gl.int64) * 128 + heads)
        w1 = gl.load(w_ptr + b.to(gl.int64) * 128 + 64 + heads)
        for t in range(t0, t1):
            wd1, sc1 = _tile_loads(cache32_ptr, bt_ptr, b, bt_s0, t + 1, t1, page_words, rows_w, words, keys)
            a = _operand(wd0, A_WORDS, A_L)
            acc = warpgroup_mma(a, b0, gl.zeros([64, 64], gl.float32, MMA), use_acc=False)
            tok = warpgroup_mma(a, b1, gl.zeros([64, 64], gl.float32, MMA), use_acc=False, is_async=True)
            _query_logits(acc, w0, sc0, t, len0, out_ptr, b * 2, o_s0, max_len)        # under query 1's product
            acc = warpgroup_mma_wait(0, deps=[tok])
            _query_logits(acc, w1, sc0, t, len1, out_ptr, b * 2 + 1, o_s0, max_len)
            wd0 = wd1
            sc0 = sc1


def _workload(device, nsets: int = 4):
    """The benchmark's paged case (bench_mqa_logits.build_paged's inputs), returned as tensors."""
    s = bench.Spec("paged", batch=bench.PAGED["B"], next_n=bench.PAGED["next_n"], length=bench.PAGED["L"])
    width = s.length // bench.BS
    nb = s.batch * width * nsets
    raw = torch.zeros(nb, bench.PAGE, dtype=torch.uint8, device=device)
    cache = raw[:, :layout.indexer_block_bytes(bench.BS)].view(nb, bench.BS, 1, layout.INDEXER_TOKEN_BYTES)
    for lo in range(0, nb * bench.BS, 1 << 16):
        hi = min(nb * bench.BS, lo + (1 << 16))
        k = (torch.randn(hi - lo, bench.DIM, device=device) * 2).to(torch.bfloat16)
        indexer_k_quant_and_cache(k, cache, torch.arange(lo, hi, device=device), layout.INDEXER_QUANT_BLOCK,
                                  layout.INDEXER_SCALE_FMT)
    perm = torch.randperm(nb, device=device)
    tables = [perm[j * s.batch * width:(j + 1) * s.batch * width].view(s.batch, width).int().contiguous()
              for j in range(nsets)]
    qs = [bench._codes((s.batch, s.next_n, bench.HEADS, bench.DIM), device) for _ in range(nsets)]
    ws = [torch.randn(s.batch * s.next_n, bench.HEADS, device=device) / 8 for _ in range(nsets)]
    lens = (s.length - s.next_n + 1 + torch.arange(s.next_n, device=device, dtype=torch.int32)).repeat(s.batch, 1)
    return s, raw, cache, tables, qs, ws, lens.contiguous()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiles-per-split", type=int, nargs="+", default=[32, 64, 16])
    p.add_argument("--maxnreg", type=int, default=128, help="registers per thread (128: 4 programs per SM)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if gluon is None or not torch.cuda.is_available() or torch.version.hip \
            or triton_minor(triton.__version__) not in VERIFIED_TRITON \
            or torch.cuda.get_device_capability() != (9, 0):
        print("probe_gluon_paged_logits: needs an sm_90 GPU and Triton " + " or ".join(VERIFIED_TRITON))
        return 1
    dev = torch.device("cuda")
    torch.manual_seed(0)
    s, raw, cache, tables, qs, ws, lens = _workload(dev)
    width = s.length // bench.BS
    out_op = torch.empty(s.batch * s.next_n, s.length, device=dev)
    out = torch.empty_like(out_op)
    sched = ops.get_paged_mqa_logits_metadata(lens, bench.BS, 132)

    def run_op(j: int) -> None:
        ops.fp8_fp4_paged_mqa_logits((qs[j], None), cache, ws[j], lens, tables[j], sched, s.length, True, out=out_op)

    def run_probe(j: int, per: int) -> None:
        paged_logits_probe_kernel[(s.batch, triton.cdiv(width, per))](
            qs[j].view(torch.uint8), raw.view(torch.int32), ws[j], lens, tables[j], out, s.length, bench.PAGE // 4,
            tables[j].stride(0), out.stride(0), per, num_warps=4, maxnreg=args.maxnreg)

    run_op(0)
    for per in args.tiles_per_split:
        out.fill_(7.0)
        run_probe(0, per)
        finite = out_op.isfinite()
        row_max = out_op.where(finite, 0.0).abs().amax(1, keepdim=True)
        err = ((out - out_op).abs() / row_max).where(finite, 0.0).max().item()
        same_inf = bool((finite == out.isfinite()).all())
        print(f"{per} tiles per split: largest difference from the op {err:.2g} of the row's max |logit|; "
              f"-inf where the op's: {same_inf}")
    read_us = harness._time_read(dev)
    harness.free_memory(dev)
    read_gbps = harness.READ_BYTES / read_us / 1e3
    print(f"read ceiling {read_gbps:.1f} GB/s (torch.sum over {harness.READ_BYTES >> 30} GiB)")
    for r in range(args.rounds):
        cases = [("op", run_op)] + [(f"probe/{per}", lambda j, per=per: run_probe(j, per))
                                    for per in args.tiles_per_split]
        for label, fn in cases:
            it = itertools.count()
            us = harness.time_do_bench(lambda: fn(next(it) % len(qs)))
            gbps = s.bytes_per_call() / us / 1e3
            print(f"r{r} {label:10s} {us:8.2f} us  {gbps:7.1f} GB/s  {100 * gbps / read_gbps:.1f} % of read",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
