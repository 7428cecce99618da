"""Backend detection, fp8 capabilities and warp rules, decided once (at import or first use of a device).

Nothing here runs per call on a hot path except cached lookups, and nothing is a graph break:
ops call these from their eager implementations only.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch

from . import layout

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton kernels run under Triton's CPU interpreter (set before triton is imported)."""

IS_HIP: bool = torch.version.hip is not None
HAS_GPU: bool = torch.cuda.is_available()


@dataclasses.dataclass(frozen=True)
class Target:
    """What a kernel is compiled for: backend "cuda", "hip" or "interpreter", and its arch."""

    backend: str
    arch: int | str | None = None   # int compute capability (90) on CUDA, "gfx942" on HIP
    warp_size: int = 32

    @property
    def is_gfx942(self) -> bool:
        return self.backend == "hip" and str(self.arch).startswith("gfx942")


INTERPRETER_TARGET = Target("interpreter", None, 32)

# Targets the compile matrix covers (issue 2): NVIDIA Ampere..Blackwell, AMD CDNA2..CDNA4.
MATRIX_TARGETS = (
    Target("cuda", 80), Target("cuda", 86), Target("cuda", 89), Target("cuda", 90),
    Target("cuda", 100), Target("cuda", 120),
    Target("hip", "gfx90a", 64), Target("hip", "gfx942", 64), Target("hip", "gfx950", 64),
)


@functools.lru_cache(maxsize=None)
def _gpu_target(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    if IS_HIP:
        return Target("hip", props.gcnArchName.split(":")[0], 64)
    return Target("cuda", props.major * 10 + props.minor, 32)


def target_for(device: torch.device) -> Target:
    """The Triton target that runs kernels for tensors on `device`."""
    if device.type == "cpu":
        return INTERPRETER_TARGET
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _gpu_target(index)


def platform_e4m3(target: Target) -> layout.Fp8Format:
    """SPEC R7: FNUZ e4m3 on gfx942 (MI300), OCP e4m3fn everywhere else (CPU included)."""
    return layout.E4M3FNUZ if target.is_gfx942 else layout.E4M3FN


def native_fp8(target: Target, fmt: layout.Fp8Format) -> bool:
    """Whether `target` converts fp32 <-> `fmt` in hardware with IEEE RNE + saturation.

    Elsewhere kernels use the bit-exact software codec (kernels/fp8.py): OCP e4m3 below sm_89,
    FNUZ on every NVIDIA target, OCP formats on gfx90a/gfx942, and always under the interpreter,
    whose fp8 casts are wrong for a few percent of values.
    """
    if target.backend == "cuda":
        return isinstance(target.arch, int) and target.arch >= 89 and fmt is not layout.E4M3FNUZ
    if target.backend == "hip":
        arch = str(target.arch)
        if arch.startswith("gfx942"):
            return fmt is layout.E4M3FNUZ
        if arch.startswith("gfx950"):
            return fmt is not layout.E4M3FNUZ
    return False


def fast_fp64(target: Target) -> bool:
    """Whether fp64 arithmetic runs at a useful rate (datacenter NVIDIA parts, AMD CDNA).

    Kernels divide by a per-tensor scale exactly as fp32(x * fp64(1/scale)) there, and with the
    slower per-element IEEE fp32 division on parts with 1/64-rate fp64 (sm_86, sm_89, sm_120).
    """
    if target.backend == "cuda":
        return target.arch in (80, 90, 100)
    return target.backend in ("hip", "interpreter")


# Shared memory one program may use (bytes, the opt-in maximum per block): NVIDIA data-centre parts (A100, H100,
# B200) and the rest (the 99 KB of sm_86/89/120), AMD LDS (64 KB on CDNA2/3, 160 KB on CDNA4).
_SHARED_MEMORY = {80: 166912, 87: 166912, 90: 232448, 100: 232448, 103: 232448}
_SHARED_MEMORY_OTHER_CUDA = 101376
_SHARED_MEMORY_HIP = {"gfx950": 163840}
_SHARED_MEMORY_OTHER_HIP = 65536


def shared_memory_limit(target: Target) -> int:
    """Bytes of shared memory (LDS on AMD) one program can have on `target`; unbounded under the interpreter.

    Kernels pick tiles that fit it (a launch over the limit fails with "out of resources"); the compile matrix
    checks every case against it."""
    if target.backend == "cuda":
        return _SHARED_MEMORY.get(target.arch, _SHARED_MEMORY_OTHER_CUDA)
    if target.backend == "hip":
        return _SHARED_MEMORY_HIP.get(str(target.arch).split(":")[0], _SHARED_MEMORY_OTHER_HIP)
    return 1 << 62


def supports_pdl(target: Target) -> bool:
    """Programmatic dependent launch (griddepcontrol): NVIDIA sm_90 and newer."""
    return target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 90


def num_warps_for(target: Target, elements: int, per_thread: int = 8) -> int:
    """Warps for a tile of `elements`, about `per_thread` elements per lane, 1..8 warps (64-wide on AMD)."""
    warps = max(1, elements // (per_thread * target.warp_size))
    return min(8, 1 << (warps.bit_length() - 1))
