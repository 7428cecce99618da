"""What the access patterns of the paged ops cost by themselves (GPU only):
`python -m benchmarks.probe_patterns [--only reads pairs scatter decode] [--out DIR]`.

Plain Triton kernels that move bytes the way the ops do and nothing else, timed like the benchmarks
(CUDA-graph replay of back-to-back calls), against the read and copy ceilings of the same run:

* chunk reads: 2 GiB read as chunks of C bytes (a head-major cache's K or V of one block and head is
  one 4 KiB chunk at bs 16, D 128, bf16) in a random order, and in address order;
* chunk scatter: 64 MiB read in order and written as chunks of C bytes (the fp8_ds_mla insert writes
  576 B per token) to random chunk slots of a region 8 times larger, and to consecutive slots; a program
  moves 2 KiB (several chunks when they are smaller); with side words, 4 B more per chunk to the slot's word
  of a separate array (the indexer cache's 128 B rows and 4 B scales);
* chunk pairs: random 4 KiB chunks from two streams a fixed distance apart, with the same chunk ids in both
  (a decode reads block b's K and V) or unrelated ones;
* the decode itself with its K and V caches placed at several distances.

The ratio random/ordered is the price of the pattern alone: a kernel of that pattern cannot expect more
than its row here. A diagnostic, not a benchmark: prints a table and writes JSON with --out.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from . import harness

READ_BYTES = 2 * harness.GiB
SCATTER_BYTES = 64 * harness.MiB
CHUNKS_PER_PROGRAM = 8


@triton.jit
def _chunk_read_kernel(src_ptr, order_ptr, out_ptr, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    """Sum PER_PROGRAM chunks of CHUNK int32 words (chunk ids from `order`); one int per program."""
    p = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, CHUNK)
    acc = tl.zeros((CHUNK,), tl.int32)
    for i in range(PER_PROGRAM):
        c = tl.load(order_ptr + p * PER_PROGRAM + i).to(tl.int64)
        acc += tl.load(src_ptr + c * CHUNK + w)
    tl.store(out_ptr + p, tl.sum(acc, 0))


@triton.jit
def _chunk_pair_kernel(src_ptr, order_a_ptr, order_b_ptr, b_offset, out_ptr, CHUNK: tl.constexpr,
                       PER_PROGRAM: tl.constexpr):
    """_chunk_read_kernel over two streams at once: chunk order_a[i] of src and chunk order_b[i] of src +
    b_offset (int32 words), as a decode step reads a block's K and V."""
    p = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, CHUNK)
    acc = tl.zeros((CHUNK,), tl.int32)
    for i in range(PER_PROGRAM):
        ca = tl.load(order_a_ptr + p * PER_PROGRAM + i).to(tl.int64)
        cb = tl.load(order_b_ptr + p * PER_PROGRAM + i).to(tl.int64)
        acc += tl.load(src_ptr + ca * CHUNK + w) + tl.load(src_ptr + b_offset + cb * CHUNK + w)
    tl.store(out_ptr + p, tl.sum(acc, 0))


@triton.jit
def _chunk_scatter_kernel(src_ptr, slot_ptr, dst_ptr, side_ptr, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr,
                          SIDE: tl.constexpr):
    """Copy chunks c = p * PER_PROGRAM + i of src (CHUNK int32 words each, in order) to chunk slot[c] of dst,
    every load before the first store; with SIDE, also one int32 per chunk to word slot[c] of side (a scale
    beside each row, as the indexer cache keeps them: 4 B of a 32 B sector)."""
    c = tl.program_id(0).to(tl.int64) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    w = tl.arange(0, CHUNK)
    s = tl.load(slot_ptr + c).to(tl.int64)
    x = tl.load(src_ptr + c[:, None] * CHUNK + w[None, :])
    tl.store(dst_ptr + s[:, None] * CHUNK + w[None, :], x)
    if SIDE:
        tl.store(side_ptr + s, tl.sum(x, 1))


def _time(run, nsets: int, nbytes: int) -> float:
    w = harness.Workload(run, nsets, nbytes)
    return harness.time_graph(w, harness.GRAPH_CALLS_LARGE)


def chunk_reads(chunk_bytes: int, random: bool, device) -> dict:
    words = chunk_bytes // 4
    n_chunks = READ_BYTES // chunk_bytes
    src = torch.randint(0, 1 << 20, (n_chunks * words,), dtype=torch.int32, device=device)
    order = torch.randperm(n_chunks, device=device) if random else torch.arange(n_chunks, device=device)
    order = order.to(torch.int32)
    out = torch.empty(n_chunks // CHUNKS_PER_PROGRAM, dtype=torch.int32, device=device)
    grid = (n_chunks // CHUNKS_PER_PROGRAM,)
    warps = max(1, min(8, chunk_bytes // 512))

    def run(i: int) -> None:
        _chunk_read_kernel[grid](src, order, out, words, CHUNKS_PER_PROGRAM, num_warps=warps)

    us = _time(run, 1, READ_BYTES)
    return {"pattern": f"read {chunk_bytes} B chunks, {'random' if random else 'address'} order",
            "us": harness.sig(us), "gbps": harness.sig(READ_BYTES / us / 1e3)}


def chunk_pairs(offset_bytes: int, same_chunk: bool, device, chunk_bytes: int = 4096) -> dict:
    """1 GiB in random 4 KiB chunks from each of two streams `offset_bytes` apart: chunk c of both (same_chunk,
    the K and V of one block when the two caches are allocated that far apart) or unrelated chunks."""
    words = chunk_bytes // 4
    n_chunks = READ_BYTES // 2 // chunk_bytes
    src = torch.randint(0, 1 << 20, ((offset_bytes + READ_BYTES // 2) // 4,), dtype=torch.int32, device=device)
    order_a = torch.randperm(n_chunks, device=device).to(torch.int32)
    order_b = order_a if same_chunk else torch.randperm(n_chunks, device=device).to(torch.int32)
    out = torch.empty(n_chunks // CHUNKS_PER_PROGRAM, dtype=torch.int32, device=device)
    grid = (n_chunks // CHUNKS_PER_PROGRAM,)

    def run(i: int) -> None:
        _chunk_pair_kernel[grid](src, order_a, order_b, offset_bytes // 4, out, words, CHUNKS_PER_PROGRAM,
                                 num_warps=8)

    us = _time(run, 1, READ_BYTES)
    return {"pattern": f"read 2 x {chunk_bytes} B chunks {offset_bytes} B apart, "
                       f"{'same' if same_chunk else 'unrelated'} chunk ids",
            "us": harness.sig(us), "gbps": harness.sig(READ_BYTES / us / 1e3)}


def chunk_scatter(chunk_bytes: int, random: bool, device, side: bool = False) -> dict:
    """SCATTER_BYTES copied as chunks to random or consecutive slots; with `side`, 4 B more per chunk to the
    slot's word of a side array (counted in the bytes moved)."""
    words = chunk_bytes // 4
    n = SCATTER_BYTES // chunk_bytes
    nsets = harness.rotation_sets(2 * SCATTER_BYTES, device)
    srcs = [torch.randint(0, 1 << 20, (n * words,), dtype=torch.int32, device=device) for _ in range(nsets)]
    dst = torch.empty(8 * n * words, dtype=torch.int32, device=device)
    side_words = torch.empty(8 * n if side else 1, dtype=torch.int32, device=device)
    slots = [(torch.randperm(8 * n, device=device)[:n] if random else torch.arange(i * n, (i + 1) * n, device=device))
             .to(torch.int32) for i in range(nsets)]
    per_program = max(1, 2048 // chunk_bytes)          # 2 KiB per program, as the insert's 4-token tile
    warps = max(1, min(8, per_program * chunk_bytes // 512))

    def run(i: int) -> None:
        _chunk_scatter_kernel[(n // per_program,)](srcs[i], slots[i], dst, side_words, words, per_program, side,
                                                   num_warps=warps)

    nbytes = 2 * SCATTER_BYTES + (4 * n if side else 0)
    us = _time(run, nsets, nbytes)
    return {"pattern": f"copy {chunk_bytes} B chunks{' + 4 B side words' if side else ''} to "
                       f"{'random' if random else 'consecutive'} slots",
            "us": harness.sig(us), "gbps": harness.sig(nbytes / us / 1e3)}


def decode_cache_placement(device, pads=(0, 4096, 69632, 2 * harness.MiB)) -> list[dict]:
    """chunked_prefill_paged_decode on 64 decodes of 4096 tokens (bf16, the attention benchmark's shape) with
    its K and V caches as two allocations (the benchmark's), and as views of one buffer, V starting `pad`
    bytes after K's end: whether the distance between a block's K and V changes the decode's bandwidth."""
    import torch_dsv4_ops
    from torch_dsv4_ops.ops.attention import example_batch

    from .bench_attention import BS, D, HKV, HQ, Spec

    spec = Spec(64, 4096)
    args = list(example_batch(spec.query_lens(), spec.seq_lens(), hq=HQ, hkv=HKV, dim=D, bs=BS, seed=1,
                              device=device))
    kc, vc = args[5], args[6]
    rows = []
    for pad in (None,) + tuple(pads):
        if pad is not None:
            buf = torch.empty(kc.numel() * 2 + vc.numel() * 2 + pad, dtype=torch.uint8, device=device)
            k_view = buf[:kc.numel() * 2].view(kc.dtype).view(kc.shape)
            v_view = buf[kc.numel() * 2 + pad:].view(vc.dtype).view(vc.shape)
            k_view.copy_(kc)
            v_view.copy_(vc)
            args[5], args[6] = k_view, v_view
        us = harness.time_do_bench(lambda: torch_dsv4_ops.chunked_prefill_paged_decode(*args))
        nbytes = spec.bytes_per_call()
        where = "allocated apart" if pad is None else f"{pad} B after K"
        rows.append({"pattern": f"decode 64 x 4096 bf16, V {where}", "us": harness.sig(us),
                     "gbps": harness.sig(nbytes / us / 1e3)})
        if pad is not None:
            del buf, k_view, v_view
        args[5], args[6] = kc, vc
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--only", choices=("reads", "pairs", "scatter", "decode"), nargs="+",
                   help="these pattern groups only (default: all)")
    args = p.parse_args()
    groups = set(args.only or ("reads", "pairs", "scatter", "decode"))
    device = torch.device("cuda")
    copy = harness.copy_ceiling(device)
    read = harness.read_matmul_ceilings(device)["read_ceiling"]
    rows = []

    def add(row: dict, ceiling: dict, key: str) -> None:
        row[key] = harness.sig(100 * row["gbps"] / ceiling["gbps"])
        rows.append(row)
        harness.free_memory(device)

    for chunk in (512, 1024, 2048, 4096, 8192) if "reads" in groups else ():
        for random in (False, True):
            add(chunk_reads(chunk, random, device), read, "pct_of_read")
    for offset_mib, same in ((1024, False), (1024, True), (1026, True), (1024 + 1 / 256, True),
                             (1024 + 17 / 256, True)) if "pairs" in groups else ():
        add(chunk_pairs(int(offset_mib * harness.MiB), same, device), read, "pct_of_read")
    for chunk, side in ((128, False), (128, True), (256, False), (512, False), (512, True), (1024, False),
                        (2048, False)) if "scatter" in groups else ():
        for random in (False, True):
            add(chunk_scatter(chunk, random, device, side), copy, "pct_of_copy")
    for r in decode_cache_placement(device) if "decode" in groups else ():
        add(r, read, "pct_of_read")
    print(f"read ceiling {read['gbps']} GB/s, copy ceiling {copy['gbps']} GB/s ({torch.cuda.get_device_name()})")
    for r in rows:
        pct = f"{r['pct_of_read']} % of read" if "pct_of_read" in r else f"{r['pct_of_copy']} % of copy"
        print(f"{r['pattern']:48s} {r['us']:>9} us {r['gbps']:>8} GB/s {pct}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_patterns.json"), "w") as f:
            json.dump({**harness.environment(device), "read_ceiling": read, "copy_ceiling": copy, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
