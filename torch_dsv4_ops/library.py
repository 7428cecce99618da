"""The `dsv4` op namespace and the one helper that registers an op card.

An op card is: a schema (mutated arguments annotated), a fake (meta) implementation, a GPU
implementation (the Triton launcher, for CUDA and ROCm alike) and a CPU implementation (the
pure-torch reference, or the Triton kernel under Triton's interpreter when tests ask for it).

Ops are defined with the low-level `torch.library.Library` API (define/impl + register_fake), not
the `@torch.library.custom_op` decorator: a no-op costs 2.8 us per call through `Library` and 14.4 us
through `@custom_op` (H200 host). `register_op` does in its place what `custom_op` would: the schema
marks every mutated argument `(a!)`, the fake is registered, and after each call the version
counter of every mutated argument is bumped (`torch.autograd.graph.increment_version`), so
autograd and anything that caches on `tensor._version` see the write.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import os
from typing import Callable

import torch
from torch.autograd.graph import increment_version

from . import platform

NAMESPACE = "dsv4"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


@dataclasses.dataclass
class OpCard:
    """Everything registered for one `dsv4::` op."""

    name: str
    schema: str                       # "name(args) -> returns", exactly as defined
    reference: Callable               # CPU implementation / test oracle (same arguments as the op)
    kernel: Callable                  # Triton launcher (same arguments as the op)
    fake: Callable
    examples: Callable | None = None  # () -> {label: args on CPU}, for the self-check
    op: torch._ops.OpOverload = None  # torch.ops.dsv4.<name>.default
    mutated: tuple[int, ...] = ()     # positions of the arguments the schema marks (a!)
    approximate: bool = False         # float results agree with the reference within tolerance, not bitwise
    scratch: tuple[int, ...] = ()     # positions of mutated arguments whose contents are unspecified (workspaces)


OPS: dict[str, OpCard] = {}
"""Every registered op card, by name (the csrc_stubs test and the self-check read this)."""


class _CpuImpl:
    """Which implementation the CPU dispatch key runs: the reference or the Triton kernel."""

    triton = platform.INTERPRET


_CPU = _CpuImpl()


@contextlib.contextmanager
def cpu_implementation(which: str):
    """Run CPU tensors through "reference" (the default) or "triton" (needs TRITON_INTERPRET=1)."""
    if which not in ("reference", "triton"):
        raise ValueError(f"cpu_implementation: expected 'reference' or 'triton', got {which!r}")
    if which == "triton" and not platform.INTERPRET:
        raise RuntimeError("cpu_implementation('triton') needs TRITON_INTERPRET=1 before triton is imported")
    previous = _CPU.triton
    _CPU.triton = which == "triton"
    try:
        yield
    finally:
        _CPU.triton = previous


def mutated_positions(schema: str) -> tuple[int, ...]:
    """Positions of the arguments `schema` ("name(args) -> returns") marks as written, `Tensor(a!)`."""
    parsed = torch._C.parse_schema(f"{NAMESPACE}::{schema}")
    return tuple(i for i, a in enumerate(parsed.arguments) if a.alias_info is not None and a.alias_info.is_write)


# torch.autograd.graph.increment_version without its isinstance check (hot path); the public one elsewhere
_increment = getattr(torch._C, "_increment_version", increment_version)


def _bump_versions(tensors) -> None:
    try:
        _increment(tensors)
    except RuntimeError:   # an inference tensor outside inference mode has no version counter
        increment_version(tuple(t for t in tensors if not t.is_inference()))


def _with_version_bump(impl: Callable, schema: str) -> Callable:
    """`impl`, followed by a version bump of every mutated argument (what `@custom_op` does)."""
    parsed = torch._C.parse_schema(f"{NAMESPACE}::{schema}")
    mutated = mutated_positions(schema)
    if not mutated:
        return impl
    if any(parsed.arguments[i].kwarg_only or not isinstance(parsed.arguments[i].type, torch.TensorType)
           for i in mutated):
        raise NotImplementedError(f"{schema}: mutated arguments must be positional, non-optional Tensors")
    take = operator.itemgetter(*mutated)
    single = len(mutated) == 1

    def run(*args, **kwargs):
        out = impl(*args, **kwargs)
        _bump_versions((take(args),) if single else take(args))
        return out

    run.__wrapped__ = impl
    return run


class _EagerFastPath:
    """Whether public wrappers may call the CUDA implementation without the dispatcher (see
    `_public_caller`). On by default; TORCH_DSV4_EAGER_FAST_PATH=0 turns it off."""

    enabled = os.environ.get("TORCH_DSV4_EAGER_FAST_PATH", "1") != "0"


EAGER_FAST_PATH = _EagerFastPath()

_maybe_functorch_level = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", None)
if _maybe_functorch_level is None:   # cannot tell whether a functorch transform is active: no fast path
    EAGER_FAST_PATH.enabled = False


def _public_caller(op: torch._ops.OpOverload, kernel: Callable, schema: str) -> Callable:
    """What the Python wrappers call: `op` through the dispatcher, except in plain eager execution on
    CUDA tensors, where the dispatcher would reach the registered CUDA implementation (`kernel`,
    then the version bump) with the same arguments, and the call does exactly that itself (~4 us
    less host time per call). Plain means: not compiling or tracing, no dispatch or function mode,
    no functorch transform, no profiler, and every tensor argument an exact torch.Tensor with the
    first mutated one on CUDA. `torch.ops.dsv4.<name>` always goes through the dispatcher.

    The function is generated from the schema (its parameters by name, the type checks unrolled):
    this is the hot path of every eager call."""
    parsed = torch._C.parse_schema(f"{NAMESPACE}::{schema}")
    arguments = parsed.arguments
    mutated = mutated_positions(schema)
    if not mutated or any(a.kwarg_only for a in arguments):
        return op
    names = [f"a{i}" for i in range(len(arguments))]
    params = ", ".join(n if not a.has_default_value() else f"{n}={a.default_value!r}"
                       for n, a in zip(names, arguments))
    plain = " and ".join(f"type({n}) is Tensor" for n, a in zip(names, arguments)
                         if isinstance(a.type, torch.TensorType))
    written = "(" + "".join(f"{names[i]}, " for i in mutated) + ")"
    source = f"""
def call({params}):
    if (not is_compiling() and flag.enabled and {names[mutated[0]]}.is_cuda and not dispatch_modes()
            and not function_modes() and not profiling() and not tracing() and functorch_level() is None
            and {plain}):
        out = kernel({", ".join(names)})
        try:
            increment({written})
        except RuntimeError:
            bump_versions({written})
        return out
    return op({", ".join(names)})
"""
    scope = dict(is_compiling=torch.compiler.is_compiling, flag=EAGER_FAST_PATH, Tensor=torch.Tensor,
                 dispatch_modes=torch._C._len_torch_dispatch_stack,
                 function_modes=torch._C._is_torch_function_mode_enabled,
                 profiling=torch._C._autograd._profiler_enabled, tracing=torch._C._is_tracing,
                 functorch_level=_maybe_functorch_level, kernel=kernel, op=op, increment=_increment,
                 bump_versions=_bump_versions)
    exec(compile(source, f"<dsv4 public caller of {parsed.name}>", "exec"), scope)
    return scope["call"]


def register_op(schema: str, *, reference: Callable, kernel: Callable, fake: Callable,
                examples: Callable | None = None, approximate: bool = False, scratch: tuple[str, ...] = ()) -> Callable:
    """Define `dsv4::<schema>`, register its three implementations and return what the public
    Python wrapper calls (`torch.ops.dsv4.<name>.default`, with the eager fast path of
    `_public_caller`).

    `reference` and `kernel` each validate their arguments (the shared validator of the family)
    and return what the schema says; `fake` validates and allocates with `new_empty` only.
    `examples()` returns {label: argument tuple on CPU} of realistic inputs for the self-check.
    `approximate`: the kernel's float results match the reference within the per-dtype tolerance
    (attention: a different summation order), not bit for bit. `scratch`: names of mutated arguments
    the op may leave in any state (workspaces); the self-check does not compare them.
    """
    name = schema.split("(", 1)[0]
    if name in OPS:
        raise RuntimeError(f"dsv4::{name} is already registered")
    # the dispatcher leaves out trailing arguments that equal their default: every implementation
    # must declare the schema's defaults
    parsed = torch._C.parse_schema(f"{NAMESPACE}::{schema}")
    for impl in (reference, kernel, fake):
        params = list(inspect.signature(impl).parameters.values())
        for i, a in enumerate(parsed.arguments):
            if a.has_default_value() and (i >= len(params) or params[i].default is inspect.Parameter.empty):
                raise TypeError(f"dsv4::{name}: {impl.__name__} must give argument {a.name!r} its default")
    names = [a.name for a in parsed.arguments]
    unknown = [n for n in scratch if n not in names or names.index(n) not in mutated_positions(schema)]
    if unknown:
        raise ValueError(f"dsv4::{name}: scratch arguments {unknown} are not mutated arguments of the schema")
    _LIB.define(schema)

    def cpu_impl(*args, **kwargs):
        if _CPU.triton:
            return kernel(*args, **kwargs)
        # the reference writes with torch indexing, which torch refuses on inference tensors outside
        # inference mode; the kernel writes through pointers: run it where both accept the same tensors
        with torch.inference_mode():
            return reference(*args, **kwargs)

    _LIB.impl(name, _with_version_bump(kernel, schema), "CUDA")   # ROCm builds dispatch HIP tensors through CUDA too
    _LIB.impl(name, _with_version_bump(cpu_impl, schema), "CPU")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    op = getattr(getattr(torch.ops, NAMESPACE), name).default
    OPS[name] = OpCard(name, schema, reference, kernel, fake, examples, op, mutated_positions(schema), approximate,
                       tuple(names.index(n) for n in scratch))
    return _public_caller(op, kernel, schema)
