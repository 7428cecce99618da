"""The `dsv4` op namespace and the one helper that registers an op card.

An op card is: a schema (mutated arguments annotated), a fake (meta) implementation, a GPU
implementation (the Triton launcher, for CUDA and ROCm alike) and a CPU implementation (the
pure-torch reference, or the Triton kernel under Triton's interpreter when tests ask for it).

Ops are defined with the low-level `torch.library.Library` API: `torch.ops.dsv4.<op>.default`
dispatches straight to the Python implementation, which keeps eager host overhead low.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch

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


def register_op(schema: str, *, reference: Callable, kernel: Callable, fake: Callable,
                examples: Callable | None = None) -> torch._ops.OpOverload:
    """Define `dsv4::<schema>`, register its three implementations and return the bound overload.

    `reference` and `kernel` each validate their arguments (the shared validator of the family)
    and return what the schema says; `fake` validates and allocates with `new_empty` only.
    `examples()` returns {label: argument tuple on CPU} of realistic inputs for the self-check.
    """
    name = schema.split("(", 1)[0]
    if name in OPS:
        raise RuntimeError(f"dsv4::{name} is already registered")
    _LIB.define(schema)

    def cpu_impl(*args):
        return (kernel if _CPU.triton else reference)(*args)

    _LIB.impl(name, kernel, "CUDA")   # ROCm builds of torch dispatch HIP tensors through CUDA too
    _LIB.impl(name, cpu_impl, "CPU")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    op = getattr(getattr(torch.ops, NAMESPACE), name).default
    OPS[name] = OpCard(name, schema, reference, kernel, fake, examples, op)
    return op
