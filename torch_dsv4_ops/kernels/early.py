"""Work before `gdc_wait`: what a programmatic dependent reads while the kernel before it still runs.

A kernel launched with PDL starts once every program of the kernel before it has called `gdc_launch_dependents`, and
`gdc_wait` holds it until that kernel has finished and its writes are visible. Nothing read before the wait may
decide what the kernel computes: the predecessor may still be writing it. It may decide what to bring into L2. A
decode-size call is a chain of dependent round trips (lengths -> block table -> pages, or an index row); walked
early, from values read before the wait, the chain warms L2, and the real loads after the wait find their sectors
there. Where the predecessor did write an input, the early values are stale and the touched sectors merely useless.

* `early_load`: `ld.relaxed.gpu` (a strong load, coherent at L2: no L1 line that a later load could hit stale).
* `touch`: `ld.volatile` of one byte per 32-byte sector, its value dropped. (`prefetch.global.L2`, one instruction
  per thread, measured slower: benchmarks/NOTES.md, "Work before the wait".)

Both are inline PTX on NVIDIA; kernels call them only where `use_early(target)` (PDL targets).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import platform

if platform.INTERPRET:   # the interpreter has no grid dependency control; PDL is False there
    gdc_wait = gdc_launch_dependents = None
else:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

SECTOR = tl.constexpr(32)       # bytes a touch brings into L2
# The EARLY constexpr of a kernel, bit flags: TOUCH, its first inputs touched before the wait; LATE, its dependents
# launched after the wait, not before it (at most one grid ahead: every grid queued behind it
# touching at once measured slower for the window gather).
TOUCH, LATE = tl.constexpr(1), tl.constexpr(2)


def flags(touch: bool = False, late: bool = False) -> int:
    """The EARLY constexpr's value."""
    return (int(TOUCH.value) if touch else 0) | (int(LATE.value) if late else 0)


def use_early(target: platform.Target) -> bool:
    """Whether kernels may read before `gdc_wait` (`early_load`, `touch`): NVIDIA targets with PDL."""
    return platform.supports_pdl(target)


@triton.jit
def pdl_open(PDL: tl.constexpr, EARLY: tl.constexpr):
    """A kernel's first step under PDL: launch the dependents, unless EARLY has LATE. The early work follows."""
    if PDL:
        if (EARLY & LATE) == 0:
            gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr, EARLY: tl.constexpr):
    """Wait for the predecessor's writes (before the kernel's first real load), then launch the dependents if
    EARLY has LATE."""
    if PDL:
        gdc_wait()
        if EARLY & LATE:
            gdc_launch_dependents()


@triton.jit
def early_load(ptr, mask):
    """The 32- or 64-bit integers at `ptr` where `mask` (0 elsewhere), read before `gdc_wait`: addresses to touch,
    never a result."""
    if ptr.dtype.element_ty.primitive_bitwidth == 64:
        val = tl.inline_asm_elementwise(
            asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b64 $0, 0; @p ld.relaxed.gpu.global.b64 $0, [$1]; }",
            constraints="=l,l,r", args=[ptr, mask.to(tl.int32)], dtype=tl.int64, is_pure=False, pack=1)
    else:
        tl.static_assert(ptr.dtype.element_ty.primitive_bitwidth == 32, "early_load reads 32- or 64-bit values")
        val = tl.inline_asm_elementwise(
            asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.relaxed.gpu.global.b32 $0, [$1]; }",
            constraints="=r,l,r", args=[ptr, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    return val


@triton.jit
def touch(ptr, mask):
    """Read the byte at `ptr` (any pointer type, any alignment) where `mask` and drop it (`ld.volatile`, never
    removed, coherent at L2): its 32-byte sector comes into L2, and nothing waits for it."""
    tl.inline_asm_elementwise(
        asm="{ .reg .pred p; .reg .b32 t; setp.ne.b32 p, $2, 0; @p ld.volatile.global.u8 t, [$1]; mov.b32 $0, 0; }",
        constraints="=r,l,r", args=[ptr, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
