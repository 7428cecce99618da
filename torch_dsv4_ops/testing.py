"""The test harness shared by every op family: comparisons, output poisoning, opcheck over
several memory layouts, the torch.compile checker and the CUDA-graph checker.

Used by tests/ and by the self-check (`python -m torch_dsv4_ops`); importing it costs nothing.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Sequence

import torch


# atol = rtol for toleranced comparisons (SPEC §5, attention)
TOLERANCES = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-3}

SENTINEL_BYTE = 0xA5   # poison: -3.0e-16-ish in fp16/bf16, a NaN-free e4m3/e5m2 code, 165 as uint8


# --- comparisons --------------------------------------------------------------------------------
def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t` (any dtype, any strides), for bit-exact comparison."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(-1).view(torch.uint8)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Every bit equal (NaN payloads and -0 included); reports the first mismatching elements."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: shape/dtype {tuple(actual.shape)} {actual.dtype} "
                             f"!= {tuple(expected.shape)} {expected.dtype}")
    a, e = actual.detach().cpu(), expected.detach().cpu()
    ab, eb = as_bytes(a).view(a.shape + (a.element_size(),)), as_bytes(e).view(e.shape + (e.element_size(),))
    bad = (ab != eb).any(-1)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        samples = [(i, a[tuple(i)].item(), e[tuple(i)].item()) for i in idx]
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements differ; first "
                             f"(index, actual, expected): {samples}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float | None = None,
                 rtol: float | None = None, what: str = "") -> None:
    """|a - e| <= atol + rtol*|e| elementwise, in float64; NaN positions must match."""
    tol = TOLERANCES.get(actual.dtype, 2e-3)
    atol = tol if atol is None else atol
    rtol = tol if rtol is None else rtol
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}")
    if not torch.equal(a.isnan(), e.isnan()):
        raise AssertionError(f"{what}: NaN positions differ")
    err = (a - e).abs().nan_to_num(0.0)
    bad = err > atol + rtol * e.abs().nan_to_num(0.0)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad.sum())} elements out of tolerance (atol {atol}, rtol {rtol}); "
                             f"max err {err.max().item():.3g}; at {i}: {a[i].item()} vs {e[i].item()}")


# --- poisoning ----------------------------------------------------------------------------------
def poison_(t: torch.Tensor, byte: int = SENTINEL_BYTE) -> torch.Tensor:
    """Fill every byte of `t`'s elements with `byte` (in place); returns t."""
    pattern = torch.full((t.element_size(),), byte, dtype=torch.uint8).view(t.dtype)
    return t.copy_(pattern.expand(t.shape))


def random_bytes_(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill `t` with random bytes (a sentinel that is different everywhere; NaN codes possible)."""
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=generator)
    t.copy_(raw.view(t.dtype).view(t.shape))
    return t


def changed_mask(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Bool mask (shape of the tensor) of elements whose bytes changed."""
    b, a = as_bytes(before.cpu()), as_bytes(after.cpu())
    return (b.view(before.shape + (before.element_size(),)) != a.view(after.shape + (after.element_size(),))).any(-1)


# --- inputs -------------------------------------------------------------------------------------
def permuted_copy(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, reversed stride order (a non-contiguous layout of the same data)."""
    if t.dim() < 2:
        return t
    order = list(range(t.dim()))[::-1]
    return t.permute(order).contiguous().permute(order)


def padded_copy(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """Same shape and values, each row of the last dim padded: stride(-2) > size(-1)."""
    if t.dim() < 2:
        return t
    big = t.new_zeros(t.shape[:-1] + (t.shape[-1] + pad,))
    view = big[..., : t.shape[-1]]
    view.copy_(t)
    return view


# --- opcheck ------------------------------------------------------------------------------------
def run_opcheck(op, args: Sequence, *, layouts: Iterable[str] = ("contiguous", "permuted", "padded"),
                permute: Callable[[int, torch.Tensor], bool] | None = None, **opcheck_kwargs) -> None:
    """torch.library.opcheck (all four utilities) on `args`, and on non-contiguous copies of them.

    `permute(i, t)` selects which tensor arguments get the non-contiguous layouts (default: all
    with dim >= 2). Raises on the first failure, naming the layout.
    """
    makers = {"contiguous": lambda t: t, "permuted": permuted_copy, "padded": padded_copy}
    choose = permute or (lambda i, t: t.dim() >= 2)
    for name in layouts:
        case = [makers[name](a) if isinstance(a, torch.Tensor) and choose(i, a) else
                (a.clone() if isinstance(a, torch.Tensor) else a) for i, a in enumerate(args)]
        try:
            torch.library.opcheck(op, tuple(case), **opcheck_kwargs)
        except Exception as exc:   # re-raise naming the layout
            raise AssertionError(f"opcheck({op}) failed with {name} inputs: {exc}") from exc


# --- torch.compile ------------------------------------------------------------------------------
def check_compile(fn: Callable, inputs: Sequence[Sequence], *, backend: str = "inductor",
                  compare: Callable | None = None, kernels: Sequence = (), new_kernels: int = 0) -> int:
    """Compile `fn` with fullgraph=True, dynamic=True; call it on each input tuple (different token
    counts); assert one graph compiled in all (no recompiles, no graph breaks: fullgraph raises)
    and the results equal eager's. Inputs are cloned per run. With `kernels` (@triton.jit functions) and
    a GPU, also assert that each gained at most `new_kernels` compiled specialisations over the calls.
    Returns the frame count.
    """
    from torch._dynamo.testing import CompileCounterWithBackend

    counted = list(kernels) if torch.cuda.is_available() else []
    before = [triton_cache_entries(k) for k in counted]

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counter)
    compare = compare or (lambda a, e: assert_bitwise_equal(a, e, "compiled vs eager"))
    for args in inputs:
        eager = fn(*_clone_all(args))
        got = compiled(*_clone_all(args))
        for a, e in zip(_as_tuple(got), _as_tuple(eager)):
            compare(a, e)
    if counter.frame_count != 1:
        raise AssertionError(f"expected one compiled graph across {len(inputs)} input sizes, "
                             f"got {counter.frame_count} (recompiles)")
    grown = {k.__name__: triton_cache_entries(k) - b for k, b in zip(counted, before)}
    if any(n > new_kernels for n in grown.values()):
        raise AssertionError(f"new Triton compilations (at most {new_kernels} per kernel): {grown}")
    return counter.frame_count


def _clone_all(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


# --- CUDA graphs --------------------------------------------------------------------------------
def check_cuda_graph(fn: Callable, static_args: Sequence, new_values: Sequence[Sequence],
                     compare: Callable | None = None) -> None:
    """Capture `fn(*static_args)` in a CUDA graph; for each entry of `new_values` (same shapes),
    copy the values into the static buffers, replay, and compare every tensor argument (mutated
    outputs included) and the return value with an eager run on clones of the same values.
    Eager runs and capture run under torch.cuda.set_sync_debug_mode("error").
    """
    compare = compare or (lambda a, e: assert_bitwise_equal(a, e, "graph replay vs eager"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), sync_debug_error():
        fn(*static_args)                      # warm up (compiles the kernel) outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), sync_debug_error():
        out = fn(*static_args)
    for values in new_values:
        for buf, v in zip(static_args, values):
            if isinstance(buf, torch.Tensor):
                buf.copy_(v)
        eager_args = _clone_all(values)
        with sync_debug_error():
            expected = fn(*eager_args)
        graph.replay()
        torch.cuda.synchronize()
        for buf, e in zip(static_args, eager_args):
            if isinstance(buf, torch.Tensor):
                compare(buf, e)
        if out is not None:
            for a, e in zip(_as_tuple(out), _as_tuple(expected)):
                compare(a, e)


@contextlib.contextmanager
def sync_debug_error():
    """Any host-device synchronisation inside raises (CUDA only; a no-op elsewhere)."""
    if not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def check_sync_free(cases: dict[str, Sequence]) -> None:
    """Call `torch.ops.dsv4.<name>.default(*args)` for every {name: args} under
    torch.cuda.set_sync_debug_mode("error"): any host-device synchronisation raises."""
    with sync_debug_error():
        for name, args in cases.items():
            getattr(torch.ops.dsv4, name).default(*args)
    torch.cuda.synchronize()


def triton_cache_entries(kernel) -> int:
    """How many compiled specialisations a @triton.jit kernel holds (all devices).

    Raises RuntimeError where they cannot be counted (no `device_caches`: under the interpreter,
    which compiles nothing, or a Triton whose JIT keeps them elsewhere), so that a "no new
    compilation" check can never pass without counting.
    """
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        raise RuntimeError(f"triton_cache_entries: {getattr(kernel, '__name__', type(kernel).__name__)} has no "
                           "device_caches (interpreted, or this Triton keeps compiled kernels elsewhere); "
                           "cannot count its compiled specialisations")
    return sum(len(entry[0]) for entry in caches.values())


def gluon_runs_direct(module) -> bool:
    """Whether a `kernels/*_gluon.py` module's Gluon path runs on this machine's CUDA device with direct launches:
    Gluon present, sm_90, a Triton version the module verified, the direct launch policy on."""
    import triton

    from . import platform
    from .kernels import _launch

    target = platform.target_for(torch.device("cuda"))
    return (module.gluon is not None and (target.backend, target.arch) == ("cuda", 90)
            and _launch.direct_launch_policy()[0]
            and _launch.triton_minor(triton.__version__) in module.VERIFIED_TRITON)


def check_direct_launches(launcher, call: Callable[[], Sequence[torch.Tensor]], monkeypatch, plans: dict,
                          what: str) -> Sequence[torch.Tensor]:
    """A FastLauncher's launches (kernels/_launch.py) of one signature: after two calls of `call` (the first
    compiles), a third does not enter Triton's JIT, and writes the bytes Triton's public path writes (run with a
    fresh plan cache `plans`, which must then enter the JIT: the call does use this launcher). Returns the third
    call's outputs. `monkeypatch`: pytest's fixture."""
    call()
    call()
    torch.cuda.synchronize()
    entered = []
    jit_run = launcher.fn.run
    monkeypatch.setattr(launcher.fn, "run", lambda *a, **k: (entered.append(1), jit_run(*a, **k))[1])
    direct = [t.clone() for t in call()]
    torch.cuda.synchronize()
    assert entered == [], f"{what}: a repeated launch went through Triton's JIT"
    monkeypatch.setattr(launcher, "_policy", (False, None))
    plans.clear()
    public = call()
    torch.cuda.synchronize()
    assert entered, f"{what}: the public path did not enter this launcher's kernel"
    for i, (a, b) in enumerate(zip(direct, public)):
        assert_bitwise_equal(a, b, f"{what}: output {i}, direct vs public launch")
    return direct


@contextlib.contextmanager
def patched_constants(module, plans: Iterable[dict] = (), **constants):
    """Within: `module`'s constants set to `constants` (restored on exit) and every plan cache in `plans` empty on
    entry and on exit, so that no plan built under the patch outlives it (plans key on argument signatures, not on
    the constants). Tests use it to take a kernel's loops past their first iteration at small shapes."""
    plans = list(plans)
    old = {name: getattr(module, name) for name in constants}
    for cache in plans:
        cache.clear()
    try:
        for name, value in constants.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)
        for cache in plans:
            cache.clear()


def shard_members(test_ids: Sequence[str], shard: int, shards: int) -> list[bool]:
    """Which of `test_ids` (in collection order) shard `shard` of `shards` runs (DSV4_TEST_SHARD, tests/conftest.py):
    every `shards`-th test, the reference tests counted apart from the rest. They alternate with the kernel tests
    and skip on a GPU, so one count over both gave half the shards every kernel test."""
    seen = {False: 0, True: 0}
    members = []
    for test_id in test_ids:
        group = "reference" in test_id
        members.append(seen[group] % shards == shard)
        seen[group] += 1
    return members


def nonzero_share(t: torch.Tensor) -> float:
    """Fraction of non-zero bytes: guards against fp8 caches that silently hold only zeros."""
    b = as_bytes(t.cpu())
    return float((b != 0).float().mean()) if b.numel() else 0.0


# --- metadata steps --------------------------------------------------------------------------------
def metadata_step_batches(device, query_lens: Sequence[int], seq_lens: Sequence[int], max_context: int,
                          generator: torch.Generator, min_block: int = 0, max_block: int = 200000):
    """(SWA-group batch, indexer-group batch) of one step, decodes first: the same requests, each group
    with its own random block table (SWA: 64 tokens per block; indexer: one block per 256 tokens,
    storage block 64 at ratio 4) wide enough for `max_context`, entries in [min_block, max_block), and
    the slot mapping that table gives (negative where the entry is)."""
    from . import layout
    from .metadata import BatchDescription

    q, seq = list(query_lens), list(seq_lens)
    qsl = torch.tensor([0] + torch.tensor(q).cumsum(0).tolist(), dtype=torch.int32)
    seq_t = torch.tensor(seq, dtype=torch.int32)
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seq, q)])
    req = torch.repeat_interleave(torch.arange(len(q)), torch.tensor(q))
    batches = []
    for tokens_per_block in (layout.SWA_BLOCK_SIZE, layout.COMPRESSED_KERNEL_BLOCK):
        width = layout.cdiv(max_context, tokens_per_block)
        table = torch.randint(min_block, max_block, (len(q), width), generator=generator, dtype=torch.int32)
        slots = table[req, positions // tokens_per_block].long() * tokens_per_block + positions % tokens_per_block
        batches.append(BatchDescription(
            query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq_t.to(device),
            seq_lens_cpu_upper_bound=seq_t, block_table=table.to(device), slot_mapping=slots.to(device),
            num_actual_tokens=int(qsl[-1]), max_query_len=max(q), max_seq_len=max(seq),
            positions=positions.to(device)))
    return tuple(batches)


# --- index-op tests: which implementation runs, plain-Python oracles ----------------------------------
INT32_MAX = 2**31 - 1


def implementation(impl: str, device: torch.device):
    """Context that runs ops through `impl` ("kernel" or "reference") on `device`. The reference is
    the CPU implementation; CPU tensors run the Triton kernel only under the interpreter. Skips the
    calling pytest test where the pair cannot run."""
    import pytest

    from . import platform
    from .library import cpu_implementation

    if impl == "reference":
        if device.type != "cpu":
            pytest.skip("the reference is the CPU implementation")
        return cpu_implementation("reference")
    if device.type == "cpu" and not platform.INTERPRET:
        pytest.skip("CPU tensors run the Triton kernel only under the interpreter")
    return cpu_implementation("triton") if device.type == "cpu" else contextlib.nullcontext()


def i32(rows, device="cpu") -> torch.Tensor:
    """An int32 tensor of nested lists."""
    return torch.tensor(rows, dtype=torch.int32, device=device)


def as_list(t: torch.Tensor) -> list:
    return t.cpu().tolist()


def oracle_lookup(bt: list, r: int, p: int, bs: int, int32: bool = True) -> int:
    """SPEC §0 `lookup` over a block table given as lists (no num_blocks); with `int32`, slots past
    INT32_MAX are -1."""
    if not (0 <= r < len(bt)) or p < 0:
        return -1
    col = p // bs
    if col >= len(bt[r]):
        return -1
    blk = bt[r][col]
    if blk < 0:
        return -1
    s = blk * bs + p % bs
    return s if not int32 or s <= INT32_MAX else -1
