"""Render `csrc_stubs/`: C++ functions and schema definitions of every `dsv4::` op.

    python -m torch_dsv4_ops.stubs           # (re)write csrc_stubs/dsv4_ops.h and dsv4_ops_schema.cpp
    python -m torch_dsv4_ops.stubs --check   # exit 1 with a diff if the checked-in files are stale

Both files are rendered from `torch_dsv4_ops.OPS` (sorted by name), with each schema read by
torch's own parser. Declarations follow ATen's C++ conventions:

    Tensor -> const at::Tensor&        Tensor(a!) -> at::Tensor&       Tensor? -> const std::optional<at::Tensor>&
    int -> int64_t   SymInt -> c10::SymInt   float -> double   bool -> bool   str -> c10::string_view
    int[] -> at::IntArrayRef   SymInt[] -> c10::SymIntArrayRef   Tensor[] -> at::TensorList   T? -> std::optional<T>
    returns: () -> void, Tensor -> at::Tensor, Tensor(a!) -> at::Tensor&, (A, B) -> std::tuple<A, B>
    (a returned Tensor(a!) stays a reference only when every return is one, as the dispatcher requires)

C++ has neither keyword arguments nor defaults that may precede required parameters, so every
parameter is declared in schema order (the dispatcher's calling convention), the schema's `*`
becomes a `/* *, */` marker and each default is kept only as a `/* = value */` comment.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

import torch

from .library import NAMESPACE, OPS

STUB_DIR = Path(__file__).resolve().parent.parent / "csrc_stubs"
HEADER, SOURCE = "dsv4_ops.h", "dsv4_ops_schema.cpp"
_COMMAND = "python -m torch_dsv4_ops.stubs"

_VALUE_TYPES = {  # by-value C++ type of each schema element type, by torch type kind
    "TensorType": "at::Tensor", "IntType": "int64_t", "SymIntType": "c10::SymInt", "FloatType": "double",
    "BoolType": "bool", "StringType": "c10::string_view", "NumberType": "at::Scalar",
    "ScalarTypeType": "at::ScalarType", "LayoutType": "at::Layout", "MemoryFormatType": "at::MemoryFormat",
    "DeviceObjType": "at::Device", "GeneratorType": "at::Generator",
}
_ARRAY_REFS = {"IntType": "at::IntArrayRef", "SymIntType": "c10::SymIntArrayRef", "TensorType": "at::TensorList",
               "FloatType": "at::ArrayRef<double>"}
_BY_CONST_REF = ("at::Tensor", "at::Scalar", "std::optional<at::Tensor>", "c10::List<std::optional<at::Tensor>>")
_INCLUDES = {  # header each rendered C++ type needs, besides <ATen/core/Tensor.h>
    "c10::string_view": "<c10/util/string_view.h>", "std::optional<": "<optional>", "std::tuple<": "<tuple>",
    "std::vector<": "<vector>", "std::array<": "<array>", "std::string": "<string>",
    "at::Generator": "<ATen/core/Generator.h>", "c10::List<": "<ATen/core/List.h>",
}


def _value_type(t, returned: bool = False) -> str:
    """C++ value type of a torch schema type (`arg.real_type`)."""
    kind = t.kind()
    if kind == "OptionalType":
        return f"std::optional<{_value_type(t.getElementType(), returned)}>"
    if kind == "ListType":
        elem = t.getElementType()
        if returned:
            return f"std::vector<{_value_type(elem, True)}>"
        if elem.kind() in _ARRAY_REFS:
            return _ARRAY_REFS[elem.kind()]
        if elem.kind() == "OptionalType" and elem.getElementType().kind() == "TensorType":
            return "c10::List<std::optional<at::Tensor>>"
        raise NotImplementedError(f"csrc stubs: no C++ mapping for list type {t}")
    if returned and kind == "StringType":
        return "std::string"
    if kind not in _VALUE_TYPES:
        raise NotImplementedError(f"csrc stubs: no C++ mapping for schema type {t} ({kind})")
    return _VALUE_TYPES[kind]


def _param_type(arg) -> str:
    """C++ parameter type of a schema argument (mutated plain tensors become `at::Tensor&`)."""
    t = arg.real_type
    if t.kind() == "ListType" and arg.N is not None and t.getElementType().kind() == "BoolType":
        return f"std::array<bool, {arg.N}>"
    cpp = _value_type(t)
    if cpp == "at::Tensor" and arg.alias_info is not None and arg.alias_info.is_write:
        return "at::Tensor&"
    return f"const {cpp}&" if cpp in _BY_CONST_REF else cpp


def _return_type(schema) -> str:
    """C++ return type: void, one type, or a std::tuple of them."""
    types = [_value_type(ret.real_type, returned=True) for ret in schema.returns]
    mutable = [t == "at::Tensor" and ret.alias_info is not None and ret.alias_info.is_write
               for t, ret in zip(types, schema.returns)]
    if types and all(mutable):   # ATen returns mutated tensors by reference only when all of them are
        types = [f"{t}&" for t in types]
    if not types:
        return "void"
    return types[0] if len(types) == 1 else f"std::tuple<{', '.join(types)}>"


def _default(value) -> str:
    """Schema-style spelling of a parsed default value, for a comment."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_default(v) for v in value) + "]"
    return repr(value)


def declaration(schema_str: str) -> str:
    """The C++ function of one op (its schema as a comment above), one parameter per line: an
    inline definition that calls the op through the dispatcher, so a C++ caller needs no more
    than this header and a process where the op is registered (e.g. torch_dsv4_ops imported)."""
    schema = torch._C.parse_schema(schema_str)
    params, types, kwarg_marked = [], [], False
    for arg in schema.arguments:
        marker = "/* *, */ " if arg.kwarg_only and not kwarg_marked else ""
        kwarg_marked |= arg.kwarg_only
        default = f" /* = {_default(arg.default_value)} */" if arg.has_default_value() else ""
        types.append(_param_type(arg))
        params.append(f"    {marker}{types[-1]} {arg.name}{default}")
    returns = _return_type(schema)
    body = "(\n" + ",\n".join(params) + ")" if params else "()"
    signature = f"{returns}({', '.join(types)})"
    call_args = ", ".join(arg.name for arg in schema.arguments)
    return (f"// {NAMESPACE}::{schema_str}\n"
            f"inline {returns} {schema.name}{body} {{\n"
            f"  static const auto op = c10::Dispatcher::singleton()\n"
            f"      .findSchemaOrThrow(\"{NAMESPACE}::{schema.name}\", \"{schema.overload_name}\")\n"
            f"      .typed<{signature}>();\n"
            f"  return op.call({call_args});\n"
            f"}}\n")


def _cards():
    return [OPS[name] for name in sorted(OPS)]


def render_header(schemas=None) -> str:
    """Text of csrc_stubs/dsv4_ops.h: declarations of `schemas` (default: every registered op)."""
    schemas = [card.schema for card in _cards()] if schemas is None else schemas
    decls = "\n".join(declaration(schema) for schema in schemas)
    extra = sorted({inc for key, inc in _INCLUDES.items() if key in decls})
    includes = "\n".join(f"#include {inc}" for inc in ["<ATen/core/Tensor.h>", "<ATen/core/dispatch/Dispatcher.h>",
                                                         *extra])
    return f"""\
// Generated by `{_COMMAND}` from torch_dsv4_ops.OPS; do not edit.
// Check it is current with `{_COMMAND} --check`.
//
// C++ functions of every {NAMESPACE}:: op, parameters in schema order, each calling the op through
// the dispatcher (so the op must be registered in the process: import torch_dsv4_ops, or load
// dsv4_ops_schema.cpp plus kernels). Mutated arguments (Tensor(a!)) are non-const references.
// C++ has no keyword arguments, so the schema's `*` is a /* *, */ marker, and schema defaults are
// comments only: pass every argument.
#pragma once

{includes}

namespace {NAMESPACE} {{

{decls}
}}  // namespace {NAMESPACE}
"""


def render_source() -> str:
    """Text of csrc_stubs/dsv4_ops_schema.cpp."""
    defs = "\n".join(f"  m.def({json.dumps(card.schema)});" for card in _cards())
    return f"""\
// Generated by `{_COMMAND}` from torch_dsv4_ops.OPS; do not edit.
// Check it is current with `{_COMMAND} --check`.
//
// The {NAMESPACE}:: op schemas, verbatim. The Python package defines these same schemas and
// registers their CPU, CUDA and Meta (fake) implementations when it is imported; this file is
// for C++ builds that need the schemas without Python (e.g. to resolve {NAMESPACE}:: ops by name
// before kernels are attached). Do not load it into a process that also imports
// torch_dsv4_ops: defining a schema twice is an error.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT({NAMESPACE}, m) {{
{defs}
}}
"""


def rendered() -> dict[str, str]:
    """File name -> text, for every file in csrc_stubs/."""
    return {HEADER: render_header(), SOURCE: render_source()}


def check(stub_dir: Path = STUB_DIR) -> str:
    """Unified diff between the files in `stub_dir` and what the registry renders ("" if current)."""
    diff = []
    for name, text in rendered().items():
        path = stub_dir / name
        old = path.read_text() if path.exists() else ""
        diff += difflib.unified_diff(old.splitlines(True), text.splitlines(True), f"a/{stub_dir.name}/{name}",
                                     f"b/{stub_dir.name}/{name}")
    return "".join(diff)


def write(stub_dir: Path = STUB_DIR) -> None:
    """Write every rendered file into `stub_dir`."""
    stub_dir.mkdir(parents=True, exist_ok=True)
    for name, text in rendered().items():
        (stub_dir / name).write_text(text)


def main(argv=None) -> int:
    """CLI: write csrc_stubs/, or with --check report whether it is current."""
    parser = argparse.ArgumentParser(prog=_COMMAND, description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff if csrc_stubs/ is stale")
    args = parser.parse_args(argv)
    if not args.check:
        write()
        return 0
    diff = check()
    if diff:
        sys.stdout.write(diff)
        print(f"csrc_stubs/ is stale: run `{_COMMAND}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
