"""The main job's self-check: every registered op's Triton kernel on the best device present
(compiled on a GPU, under Triton's interpreter on the CPU), against the pure-torch reference on
the CPU, byte for byte, timed; then one metadata step (both builders on a mixed batch), one indexer
decode step and one whole C4A attention decode step the same way. `python -m torch_dsv4_ops` prints
the table."""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from . import layout, library, platform, testing
from .testing import as_bytes


@dataclasses.dataclass
class Row:
    op: str
    case: str
    device: str
    implementation: str  # what ran, "vs" what it was compared with
    error: str          # "exact" (bit-identical to the reference), "within <tol>" (approximate ops), or what differs
    time_us: float
    ok: bool


def best_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def implementation_name(device: torch.device) -> str:
    """The implementation the op runs on `device` (what the self-check checks)."""
    if device.type == "cuda":
        t = platform.target_for(device)
        return f"triton ({t.backend} {t.arch})"
    return "triton interpreter" if platform.INTERPRET else "torch reference"


def _to(args, device):
    return [a.clone().to(device) if isinstance(a, torch.Tensor) else a for a in args]


def _time_us(fn, device, repeats: int = 20) -> float:
    """Median of `repeats` CUDA-event timings after a warm-up call; one wall-clock call on the CPU
    (the interpreter is slow, and nothing there needs warming up)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def _compare(got: torch.Tensor, want: torch.Tensor, approximate: bool = False) -> str:
    diff = int((as_bytes(got.cpu()) != as_bytes(want)).sum())
    if diff == 0:
        return "exact"
    if approximate and got.dtype in testing.TOLERANCES:
        tol = testing.TOLERANCES[got.dtype]
        a, w = got.cpu().double(), want.double()
        same = (a == w) | (a.isnan() & w.isnan())          # equal infinities and NaN positions count as agreeing
        err = torch.where(same, 0.0, (a - w).abs())
        if bool((err <= tol + tol * w.abs().nan_to_num(0.0)).all()):
            return f"within {tol:g} (max |err| {err.max().item():.3g})"
    if got.dtype.is_floating_point:
        return f"{diff} bytes differ, max |err| {(got.cpu().double() - want.double()).abs().max().item():.3g}"
    return f"{diff} bytes differ"


def run(device: torch.device | None = None) -> list[Row]:
    """Check every op card's examples on `device` against the CPU reference: on a GPU the compiled
    kernels, on the CPU the kernels under Triton's interpreter (when TRITON_INTERPRET=1; otherwise
    the reference is all there is to run, and the rows say so)."""
    device = device or best_device()
    rows = []
    impl = f"{implementation_name(device)} vs torch reference (cpu)"
    cpu_kernels = device.type == "cpu" and platform.INTERPRET
    for name, card in sorted(library.OPS.items()):
        if card.examples is None:
            rows.append(Row(name, "-", str(device), impl, "no example", float("nan"), False))
            continue
        for label, args in card.examples().items():
            dev_args = _to(args, device)
            ref_args = _to(args, "cpu")
            with library.cpu_implementation("reference"):
                ref_out = card.op(*ref_args)
            with library.cpu_implementation("triton") if cpu_kernels else contextlib.nullcontext():
                dev_out = card.op(*dev_args)
                errors = [_compare(dev_args[i], ref_args[i], card.approximate) for i in card.mutated
                          if i not in card.scratch]
                errors += [_compare(g, w, card.approximate) for g, w in zip(_tensors(dev_out), _tensors(ref_out))]
                ok = all(e == "exact" or e.startswith("within") for e in errors)
                error = "exact" if all(e == "exact" for e in errors) else "; ".join(e for e in errors if e != "exact")
                t = _time_us(lambda: card.op(*dev_args), device)
            rows.append(Row(name, label, str(device), impl, error, t, ok))
    rows.append(metadata_step(device))
    rows.append(indexer_decode_step(device))
    rows.append(attention_decode_step(device))
    return rows


def _tensors(x) -> list:
    """The tensors of an op's return value, or of a metadata dataclass (recursively), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    if dataclasses.is_dataclass(x):
        return [t for f in dataclasses.fields(x) for t in _tensors(getattr(x, f.name))]
    return []


def metadata_step_batches(device, decodes: int = 6, prefill_lens=(37, 300), seed: int = 0):
    """(SWA-group batch, indexer-group batch) of one mixed step: `decodes` MTP decodes (2 query
    tokens), then prefills; contexts up to 5000, some table entries -1."""
    g = torch.Generator().manual_seed(seed)
    q = [2] * decodes + list(prefill_lens)
    seq = [int(torch.randint(2, 5000, (1,), generator=g)) for _ in range(decodes)] + \
          [n + int(torch.randint(0, 300, (1,), generator=g)) for n in prefill_lens]
    return testing.metadata_step_batches(device, q, seq, 5000 + 128, g, min_block=-1, max_block=20000)


def metadata_step_builders(device, batches):
    """An SWAMetadataBuilder and an IndexerMetadataBuilder (window 128, MTP 1, ratio 4) for `batches`."""
    from .metadata import IndexerMetadataBuilder, SWAMetadataBuilder

    tokens = batches[0].slot_mapping.shape[0]
    swa = SWAMetadataBuilder(max_num_batched_tokens=tokens, max_num_seqs=16, window_size=128, max_model_len=8192,
                             num_speculative_tokens=1, device=device)
    indexer = IndexerMetadataBuilder(max_num_batched_tokens=tokens, max_num_seqs=16,
                                     block_table_width=batches[1].block_table.shape[1], max_model_len=8192,
                                     compress_ratio=4, num_speculative_tokens=1, device=device)
    return swa, indexer


def metadata_step(device: torch.device) -> Row:
    """Both builders on one mixed step on `device`, every tensor of both metadata sets against builders
    running the CPU reference."""
    def build(dev, ctx):
        batches = metadata_step_batches(dev)
        swa, indexer = metadata_step_builders(dev, batches)
        with ctx:
            return swa.build(batches[0]), indexer.build(batches[1])

    def kernels():
        return library.cpu_implementation("triton") if device.type == "cpu" and platform.INTERPRET \
            else contextlib.nullcontext()

    want = _tensors(build("cpu", library.cpu_implementation("reference")))
    got = _tensors(build(device, kernels()))
    errors = [_compare(g, w) for g, w in zip(got, want)]
    if len(got) != len(want):
        errors.append(f"{len(got)} tensors against {len(want)}")
    error = "exact" if all(e == "exact" for e in errors) else "; ".join(e for e in errors if e != "exact")
    batches = metadata_step_batches(device)
    swa, indexer = metadata_step_builders(device, batches)
    with kernels():
        t = _time_us(lambda: (swa.build(batches[0]), indexer.build(batches[1])), device)
    return Row("metadata step (SWA + indexer builders)", "6 MTP decodes + prefills of 37 and 300", str(device),
               f"{implementation_name(device)} vs torch reference (cpu)", error, t, error == "exact")


INDEXER_STEP_SEQ = (600, 1100, 2100, 4000)     # 4 MTP decodes: compressed contexts 150 .. 1000 (top-k 512)


def _indexer_chain(device, batch, k_rows, index_q, cos_sin, weights, num_blocks, heads):
    """The indexer decode chain of one step on `device` (the current implementation): K rows into a fresh cache,
    queries quantised, decode metadata built, paged logits. Returns (cache, q_fp8, weights_out, logits, decode)."""
    from . import ops
    from .metadata import IndexerMetadataBuilder

    bs = layout.COMPRESSED_KERNEL_BLOCK // 4
    page = layout.indexer_block_bytes(bs)
    raw = torch.zeros(num_blocks, layout.round_up(page, layout.PAGE_ALIGN), dtype=torch.uint8, device=device)
    cache = raw[:, :page].view(num_blocks, bs, layout.INDEXER_TOKEN_BYTES)
    ops.indexer.indexer_k_quant_and_cache(k_rows.to(device), cache, torch.arange(num_blocks * bs, device=device),
                                          layout.INDEXER_QUANT_BLOCK, layout.INDEXER_SCALE_FMT)
    q8, w = ops.indexer_q.fused_indexer_q_rope_quant(batch.positions, index_q.to(device), cos_sin.to(device),
                                                     weights.to(device), layout.INDEXER_DIM ** -0.5, heads ** -0.5)
    builder = IndexerMetadataBuilder(max_num_batched_tokens=batch.slot_mapping.shape[0], max_num_seqs=8,
                                     block_table_width=batch.block_table.shape[1], max_model_len=8192,
                                     compress_ratio=4, num_speculative_tokens=1, device=device)
    dec = builder.build(batch).decode
    nd, n = dec.seq_lens.shape
    logits = ops.mqa_logits.fp8_fp4_paged_mqa_logits(
        (q8.view(nd, n, heads, layout.INDEXER_DIM), None), cache.view(num_blocks, bs, 1, -1), w, dec.seq_lens,
        dec.block_table, dec.schedule_metadata, 8192 // 4, True)
    return cache, q8, w, logits, dec


def _indexer_inputs(g: torch.Generator, heads: int, num_blocks: int) -> tuple:
    """(compressed K rows [num_blocks * 64, 128] bf16, index_q [tokens, heads, 128] bf16, cos_sin [8192, 64] fp32,
    weights [tokens, heads] fp32) of the indexer steps' 2 * len(INDEXER_STEP_SEQ) tokens."""
    k_rows = (torch.randn(num_blocks * 64, layout.INDEXER_DIM, generator=g) * 4).to(torch.bfloat16)
    index_q = torch.randn(2 * len(INDEXER_STEP_SEQ), heads, layout.INDEXER_DIM, generator=g).to(torch.bfloat16)
    angles = torch.rand(8192, layout.INDEXER_ROPE_PAIRS, generator=g) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    weights = torch.randn(2 * len(INDEXER_STEP_SEQ), heads, generator=g)
    return k_rows, index_q, cos_sin, weights


def indexer_decode_step(device: torch.device) -> Row:
    """One indexer decode step (4 MTP decodes, next_n 2) on `device`: K rows written by indexer_k_quant_and_cache,
    queries by fused_indexer_q_rope_quant, IndexerMetadataBuilder's decode metadata, fp8_fp4_paged_mqa_logits and
    top_k_per_row_decode (k 512), against the same chain on the CPU reference: cache, q codes and weights exact,
    logits within 1e-3 of each row's max |logit| (SPEC §3.9), the top-k of the device's logits exact."""
    from . import ops

    heads = layout.INDEXER_HEADS if device.type == "cuda" else 16      # the interpreter is slow
    g = torch.Generator().manual_seed(11)
    num_blocks = 64
    batches = {dev: testing.metadata_step_batches(dev, [2] * len(INDEXER_STEP_SEQ), INDEXER_STEP_SEQ, 8192,
                                                  torch.Generator().manual_seed(12), max_block=num_blocks)[1]
               for dev in {"cpu", str(device)}}
    args = (*_indexer_inputs(g, heads, num_blocks), num_blocks, heads)
    with library.cpu_implementation("reference"):
        want = _indexer_chain("cpu", batches["cpu"], *args)
    def kernels():
        return library.cpu_implementation("triton") if device.type == "cpu" and platform.INTERPRET \
            else contextlib.nullcontext()

    with kernels():
        got = _indexer_chain(device, batches[str(device)], *args)
    errors = [_compare(g_, w_) for g_, w_ in zip(got[:3], want[:3])]
    logits, ref = got[3].cpu().double(), want[3].double()
    finite = ref.isfinite()
    row_max = torch.where(finite, ref.abs(), torch.zeros_like(ref)).amax(1, keepdim=True)
    bad = torch.where(finite, (logits - ref).abs() > 1e-3 * row_max, logits != ref)
    errors.append("exact" if not bad.any() else f"{int(bad.sum())} logits off")
    dec, rows = got[4], got[3].shape[0]

    def topk(logits_, seq_lens, out):
        ops.topk.top_k_per_row_decode(logits_, 2, seq_lens, out, rows, logits_.stride(0), logits_.stride(1),
                                      layout.INDEX_TOPK)
        return out

    with kernels():
        idx = topk(got[3], dec.seq_lens, torch.full((rows, layout.INDEX_TOPK), -7, dtype=torch.int32, device=device))
        t = _time_us(lambda: (_indexer_chain(device, batches[str(device)], *args), topk(
            got[3], dec.seq_lens, idx)), device, repeats=5)
    with library.cpu_implementation("reference"):
        ref_idx = topk(got[3].cpu(), dec.seq_lens.cpu(), torch.full((rows, layout.INDEX_TOPK), -7, dtype=torch.int32))
    errors.append(_compare(idx, ref_idx))
    ok = all(e == "exact" for e in errors)
    error = "exact (logits within 1e-3 of the row max)" if ok else "; ".join(e for e in errors if e != "exact")
    return Row("indexer decode step (insert, Q quant, builder, paged logits, top-k 512)",
               f"4 MTP decodes, contexts {INDEXER_STEP_SEQ[0]}..{INDEXER_STEP_SEQ[-1]}, {heads} heads", str(device),
               f"{implementation_name(device)} vs torch reference (cpu)", error, t, ok)


ATTENTION_WINDOW = 128


def _attention_chain(device, swa_batch, c4a_table, topk, q, sink, swa, c4a, window):
    """The attention half of a C4A decode step on `device`: the window's slots (compute_swa_indices_and_lens),
    the indexer's top-k positions as slots of the compressed cache (compute_global_topk_indices_and_lens), and
    flash_mla_with_kvcache over the SWA cache `swa` and the compressed cache `c4a` (fp8_ds_mla, 64 rows a page).
    Every request has 2 query tokens. Returns (window slots, window lengths, compressed slots, their lengths, out,
    lse)."""
    from . import ops

    rows = topk.shape[0]
    i32 = dict(dtype=torch.int32, device=device)
    t2r = torch.arange(rows, **i32) // 2
    valid = torch.ones(rows, dtype=torch.bool, device=device)
    swa_idx = torch.full((rows, 1, window), -1, **i32)
    swa_lens = torch.zeros(rows, **i32)
    ops.metadata.compute_swa_indices_and_lens(swa_idx, swa_lens, window, swa_batch.query_start_loc,
                                              swa_batch.seq_lens, t2r, valid, swa_batch.block_table,
                                              layout.SWA_BLOCK_SIZE)
    extra, extra_lens = ops.sparse_index.compute_global_topk_indices_and_lens(
        topk.to(device), t2r, c4a_table.to(device), layout.SWA_BLOCK_SIZE, valid)
    out, lse = ops.sparse_mla.flash_mla_with_kvcache(
        q.to(device), swa, None, None, 512, None, is_fp8_kvcache=True, indices=swa_idx, attn_sink=sink.to(device),
        extra_k_cache=c4a, extra_indices_in_kvcache=extra.view(rows, 1, -1), topk_length=swa_lens,
        extra_topk_length=extra_lens)
    return swa_idx, swa_lens, extra, extra_lens, out, lse


def attention_decode_step(device: torch.device) -> Row:
    """One C4A attention decode step (4 MTP decodes, next_n 2) on `device`: the indexer chain of
    `indexer_decode_step` and its top-k 512, then `_attention_chain` (window 128 over the SWA cache, the top-k
    positions over the compressed cache, 64 heads). Against the same attention chain on the CPU reference, fed the
    device's top-k: indices exact, out within bf16 tolerance, lse within 1e-3 * max(|lse|, 1) (SPEC §3.8)."""
    from . import ops

    heads = 64 if device.type == "cuda" else 16              # the interpreter is slow
    index_heads = layout.INDEXER_HEADS if device.type == "cuda" else 16
    window = ATTENTION_WINDOW if device.type == "cuda" else 32
    g = torch.Generator().manual_seed(31)
    num_blocks = 64
    swa_batch, index_batch = testing.metadata_step_batches(device, [2] * len(INDEXER_STEP_SEQ), INDEXER_STEP_SEQ,
                                                           8192, torch.Generator().manual_seed(32),
                                                           max_block=num_blocks)
    index_args = (*_indexer_inputs(g, index_heads, num_blocks), num_blocks, index_heads)
    # both caches written on the CPU (the writer's own rows check it on the device), every slot a row
    swa, c4a = (ops.sparse_mla.example_caches(num_blocks, layout.SWA_BLOCK_SIZE, seed=s) for s in (33, 34))
    q = (torch.randn(2 * len(INDEXER_STEP_SEQ), 1, heads, 512, generator=g) / 512 ** 0.25).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g)
    rows = q.shape[0]

    def step():
        *_, logits, dec = _indexer_chain(device, index_batch, *index_args)
        topk = torch.empty(rows, layout.INDEX_TOPK, dtype=torch.int32, device=device)
        ops.topk.top_k_per_row_decode(logits, 2, dec.seq_lens, topk, rows, logits.stride(0), logits.stride(1),
                                      layout.INDEX_TOPK)
        return topk, _attention_chain(device, swa_batch, index_batch.block_table, topk, q, sink, swa_dev, c4a_dev,
                                      window)

    swa_dev, c4a_dev = swa.to(device), c4a.to(device)
    kernels = library.cpu_implementation("triton") if device.type == "cpu" and platform.INTERPRET \
        else contextlib.nullcontext()
    results = []
    with kernels:      # one call on the CPU (the interpreter is slow), the last of the timed ones on a GPU
        t = _time_us(lambda: results.append(step()), device, repeats=5)
    topk, got = results[-1]
    cpu_batch = testing.metadata_step_batches("cpu", [2] * len(INDEXER_STEP_SEQ), INDEXER_STEP_SEQ, 8192,
                                              torch.Generator().manual_seed(32), max_block=num_blocks)[0]
    with library.cpu_implementation("reference"):
        want = _attention_chain("cpu", cpu_batch, index_batch.block_table.cpu(), topk.cpu(), q, sink, swa, c4a,
                                window)
    errors = [_compare(g_, w_) for g_, w_ in zip(got[:4], want[:4])]
    errors.append(_compare(got[4], want[4], approximate=True))
    lse, ref = got[5].cpu().double(), want[5].double()
    same = (lse == ref) | (lse.isnan() & ref.isnan())          # equal infinities (an empty selection: +inf)
    bad = ~(same | ((lse - ref).abs() <= 1e-3 * ref.abs().clamp(min=1.0)))
    errors.append("exact" if not bad.any() else f"{int(bad.sum())} lse off")
    ok = all(e == "exact" or e.startswith("within") for e in errors)
    error = "indices exact, out and lse within SPEC §3.8" if ok else "; ".join(e for e in errors if e != "exact")
    return Row("C4A attention decode step (indexer, top-k 512, SWA + global indices, sparse MLA)",
               f"4 MTP decodes, window {window}, {heads} heads", str(device),
               f"{implementation_name(device)} vs torch reference (cpu)", error, t, ok)


def format_table(rows: list[Row]) -> str:
    header = ("op", "case", "device", "implementation", "error", "time (us)")
    body = [(r.op, r.case, r.device, r.implementation, r.error, f"{r.time_us:.1f}") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))   # noqa: E731
    return "\n".join([line(header), line("-" * w for w in widths)] + [line(b) for b in body])
