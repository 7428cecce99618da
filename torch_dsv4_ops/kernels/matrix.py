"""Kernel cases for the ahead-of-time compile matrix (`torch_dsv4_ops.compile_matrix`).

A kernel module exposes `matrix_cases(target) -> list[KernelCase]`, built from the same codec,
geometry and tile functions its launcher uses. `specialise` turns the arguments a launcher
passes into what Triton's runtime would compile for them: pointer dtypes, int widths, ints equal
to 1 as constexprs, 16-divisibility and (AMD buffer ops) 32-bit pointer ranges as attributes.

Nothing here compiles or touches a device; it does not import triton's compiler at import time.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import torch

from .. import platform

# Triton's pointer element names for the dtypes launchers pass
TRITON_DTYPE = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
    torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
    torch.float8_e4m3fnuz: "fp8e4b8",
}
INT32_RANGE = range(-2**31, 2**31)
COMPILE_OPTIONS = ("num_stages", "enable_fp_fusion", "maxnreg")   # launch keywords that select a compiled kernel
LAUNCH_ONLY = ("launch_pdl",)                          # launch keywords that do not


@dataclasses.dataclass(frozen=True)
class Ptr:
    """A tensor argument: the dtype of the view the launcher passes, whether its data pointer is
    16-byte aligned, and whether its storage is under 2 GiB (AMD buffer-op specialisation)."""

    dtype: torch.dtype
    aligned: bool = True
    small: bool = True


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One specialisation of one @triton.jit kernel, ready for `triton.compile(ASTSource(...))`."""

    name: str
    fn: Any                                   # the triton.JITFunction
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    attrs: dict = dataclasses.field(default_factory=dict)   # {(arg index,): [[attribute, value], ...]}
    options: dict = dataclasses.field(default_factory=dict)  # other compile options: num_stages, enable_fp_fusion

    def key(self) -> tuple:
        """What makes two cases the same compiled kernel (the name does not)."""
        return (self.fn.__name__, tuple(self.signature.items()), tuple(sorted(self.constexprs.items())),
                self.num_warps, tuple(sorted((k, repr(v)) for k, v in self.attrs.items())),
                tuple(sorted(self.options.items())))


def gpu_target(target: platform.Target):
    """The triton `GPUTarget` of a platform target."""
    from triton.backends.compiler import GPUTarget
    return GPUTarget(target.backend, target.arch, target.warp_size)


@functools.lru_cache(maxsize=None)
def _backend(target: platform.Target):
    from triton.compiler import make_backend
    return make_backend(gpu_target(target))


def _parse_attr(target: platform.Target, desc: str) -> list:
    return _backend(target).parse_attr(desc)


def _buffer_ops(target: platform.Target) -> bool:
    if target.backend != "hip":
        return False
    import triton
    amd = getattr(getattr(triton, "knobs", None), "amd", None)
    return bool(getattr(amd, "use_buffer_ops", True))


def specialise(fn, args: Sequence, meta: dict[str, Any], target: platform.Target):
    """(signature, constexprs, attrs) of `fn[grid](*args, **meta)`, args in the launcher's order.

    Mirrors the runtime's rules: a pointer is `*dtype` with divisibility 16 when aligned (and a
    32-bit pointer range on HIP when its storage is under 2 GiB); an int is i32 when it fits, else
    i64, with divisibility 16 when a multiple of 16, and an int equal to 1 becomes constexpr 1.
    """
    if len(args) > len(fn.params):
        raise TypeError(f"{fn.__name__} takes {len(fn.params)} arguments, got {len(args)} positional")
    bound = dict(meta)
    bound.update((param.name, value) for param, value in zip(fn.params, args))
    signature, constexprs, attrs = {}, {}, {}
    buffer_ops = _buffer_ops(target)
    for index, param in enumerate(fn.params):
        name = param.name
        if name not in bound:
            raise TypeError(f"{fn.__name__}: no value for {name}")
        value = bound[name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
            continue
        specialize = not param.do_not_specialize
        align = specialize and not getattr(param, "do_not_specialize_on_alignment", False)
        desc = ""
        if isinstance(value, Ptr):
            signature[name] = "*" + TRITON_DTYPE[value.dtype]
            desc = ("D" if align and value.aligned else "") + ("S" if buffer_ops and value.small else "")
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1 and specialize:
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if value in INT32_RANGE else "i64" if value < 2**63 else "u64"
            desc = "D" if align and value % 16 == 0 else ""
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: unsupported matrix argument {name}={value!r}")
        parsed = _parse_attr(target, desc) if desc else []
        if parsed:
            attrs[(index,)] = parsed
    unknown = set(bound) - set(signature)
    if unknown:
        raise TypeError(f"{fn.__name__} has no parameters {sorted(unknown)}")
    return signature, constexprs, attrs


def kernel_case(target: platform.Target, name: str, fn, tensors, ints, meta: dict) -> KernelCase:
    """A case from a launcher's tensor arguments (`Ptr`s), int arguments and launch keywords: constexprs,
    num_warps and the other compile options (`COMPILE_OPTIONS`); `LAUNCH_ONLY` keywords are ignored."""
    meta = {k: v for k, v in meta.items() if k not in LAUNCH_ONLY}
    num_warps = meta.pop("num_warps")
    options = {k: meta.pop(k) for k in COMPILE_OPTIONS if k in meta}
    signature, consts, attrs = specialise(fn, tuple(tensors) + tuple(ints), meta, target)
    return KernelCase(name, fn, signature, consts, num_warps, attrs, options)


def dedupe(cases: list[KernelCase]) -> list[KernelCase]:
    """Drop cases that compile to the same kernel as an earlier one; names must stay unique."""
    seen, names, out = set(), set(), []
    for case in cases:
        if case.key() in seen:
            continue
        if case.name in names:
            raise ValueError(f"two different matrix cases are named {case.name!r}")
        seen.add(case.key())
        names.add(case.name)
        out.append(case)
    return out
