"""`scatter`: a masked store to addresses without contiguity, kept in the operands' own register layout.

Triton lowers `tl.store` of a pointer tensor whose axis analysis finds no contiguity in a layout of one element per
thread, and converts the pointers, values and mask there through shared memory first: a barrier per chunk (24 for a
16384-element top-k tile on 8 warps) for stores that need no data exchange at all. On NVIDIA `scatter` issues one
predicated `st.global` per element in the layout the operands already have (inline PTX); a value held by several
lanes of a replicated layout is stored by each of them, to the same address. Elsewhere it is `tl.store`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import platform


def use_asm(target: platform.Target) -> bool:
    """The `ASM` constexpr of `scatter` for `target`: inline PTX on NVIDIA, tl.store elsewhere (AMD, interpreter)."""
    return target.backend == "cuda"


@triton.jit
def scatter(ptr, val, mask, ASM: tl.constexpr):
    """tl.store(ptr, val, mask=mask) for 16- or 32-bit values (ints or floats) at any addresses."""
    tl.static_assert(val.dtype.primitive_bitwidth == 16 or val.dtype.primitive_bitwidth == 32,
                     "scatter stores 16- or 32-bit values")
    if ASM:
        if val.dtype.primitive_bitwidth == 16:
            tl.inline_asm_elementwise(
                asm="{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b16 [$1], $2; mov.b32 $0, 0; }",
                constraints="=r,l,h,r", args=[ptr, val.to(tl.int16, bitcast=True), mask.to(tl.int32)],
                dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                asm="{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }",
                constraints="=r,l,r,r", args=[ptr, val.to(tl.int32, bitcast=True), mask.to(tl.int32)],
                dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, val, mask=mask)
