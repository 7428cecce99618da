"""What the access patterns of the paged ops cost by themselves (GPU only): `python -m benchmarks.probe_patterns`.

Plain Triton kernels that move bytes the way the ops do and nothing else, timed like the benchmarks
(CUDA-graph replay of back-to-back calls), against the read and copy ceilings of the same run:

* chunk reads: 2 GiB read as chunks of C bytes (a head-major cache's K or V of one block and head is
  one 4 KiB chunk at bs 16, D 128, bf16) in a random order, and in address order;
* chunk scatter: 64 MiB read in order and written as chunks of C bytes (the fp8_ds_mla insert writes
  576 B per token) to random chunk slots of a region 8 times larger, and to consecutive slots.

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
def _chunk_scatter_kernel(src_ptr, slot_ptr, dst_ptr, CHUNK: tl.constexpr):
    """Copy chunk p of src (CHUNK int32 words, in order) to chunk slot[p] of dst."""
    p = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, CHUNK)
    s = tl.load(slot_ptr + p).to(tl.int64)
    tl.store(dst_ptr + s * CHUNK + w, tl.load(src_ptr + p * CHUNK + w))


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


def chunk_scatter(chunk_bytes: int, random: bool, device) -> dict:
    words = chunk_bytes // 4
    n = SCATTER_BYTES // chunk_bytes
    nsets = harness.rotation_sets(2 * SCATTER_BYTES, device)
    srcs = [torch.randint(0, 1 << 20, (n * words,), dtype=torch.int32, device=device) for _ in range(nsets)]
    dst = torch.empty(8 * n * words, dtype=torch.int32, device=device)
    slots = [(torch.randperm(8 * n, device=device)[:n] if random else torch.arange(i * n, (i + 1) * n, device=device))
             .to(torch.int32) for i in range(nsets)]
    warps = max(1, min(8, chunk_bytes // 512))

    def run(i: int) -> None:
        _chunk_scatter_kernel[(n,)](srcs[i], slots[i], dst, words, num_warps=warps)

    us = _time(run, nsets, 2 * SCATTER_BYTES)
    return {"pattern": f"copy {chunk_bytes} B chunks to {'random' if random else 'consecutive'} slots",
            "us": harness.sig(us), "gbps": harness.sig(2 * SCATTER_BYTES / us / 1e3)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    device = torch.device("cuda")
    copy = harness.copy_ceiling(device)
    read = harness.read_matmul_ceilings(device)["read_ceiling"]
    rows = []
    for chunk in (512, 1024, 2048, 4096, 8192):
        for random in (False, True):
            r = chunk_reads(chunk, random, device)
            r["pct_of_read"] = harness.sig(100 * r["gbps"] / read["gbps"])
            rows.append(r)
            harness.free_memory(device)
    for chunk in (128, 256, 512, 1024, 2048):
        for random in (False, True):
            r = chunk_scatter(chunk, random, device)
            r["pct_of_copy"] = harness.sig(100 * r["gbps"] / copy["gbps"])
            rows.append(r)
            harness.free_memory(device)
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
