"""What ptxas gives each kernel specialisation, without a GPU: `python -m benchmarks.probe_registers [--target sm_90]
[--filter REGEX]`.

For every compile-matrix case (`torch_dsv4_ops.compile_matrix`: the specialisations the ops launch) of a data-centre
NVIDIA target (sm_80, sm_90, sm_100): warps, registers a thread, spilled bytes, shared memory, and how many programs
an SM holds at once by its registers and by its shared memory. A kernel that holds few programs keeps few bytes in
flight, which a faster memory exposes (benchmarks/NOTES.md, "The first H200", items 2 and 6: the paged decode's
242-register loop and the head-major fp8 write's 168 registers); this finds such kernels before a GPU run. The
numbers are the installed Triton's (the paged bf16 decode takes 249 registers under Triton 3.6, 222 under 3.9).
Estimates: registers are counted in whole allocations of 8 a thread, 1 KB of shared memory a program is the
driver's.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tempfile

from torch_dsv4_ops import compile_matrix as cm
from torch_dsv4_ops import platform

# The data-centre parts' SM (A100, H100/H200, B200): registers, programs, warps, shared memory (bytes, of which the
# driver reserves 1 KB a program)
SM_REGISTERS, SM_PROGRAMS, SM_WARPS, DRIVER_SHARED = 65536, 32, 64, 1024
SM_SHARED = {80: 167936, 90: 233472, 100: 233472}


@dataclasses.dataclass
class Report:
    name: str
    warps: int
    registers: int
    spill_bytes: int
    shared: int
    programs: int            # programs an SM holds at once (registers, shared memory, warp and program limits)

    def line(self) -> str:
        return (f"{self.name:72s} warps {self.warps:2d}  regs {self.registers:3d}  spill {self.spill_bytes:4d} B  "
                f"smem {self.shared:6d} B  programs/SM {self.programs:2d} ({self.programs * self.warps} warps)")


def ptxas_report(ptx: str, arch: int) -> tuple[int, int]:
    """(registers a thread, spill-store bytes) that ptxas reports for `ptx` on sm_<arch> (sm_90a on Hopper)."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/k.ptx"
        with open(src, "w") as f:
            f.write(ptx)
        suffix = "a" if arch in (90, 100) else ""
        out = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", src, "-o", f"{tmp}/k.cubin"],
                             capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    return int(registers.group(1)) if registers else 0, int(spills.group(1)) if spills else 0


def programs_per_sm(warps: int, registers: int, shared: int, arch: int) -> int:
    by_registers = SM_REGISTERS // (max(8, -(-registers // 8) * 8) * 32 * warps)
    by_shared = SM_SHARED[arch] // (shared + DRIVER_SHARED)
    return max(0, min(by_registers, by_shared, SM_PROGRAMS, SM_WARPS // warps))


def report(module: str, name: str, target: platform.Target) -> Report:
    """Compile one matrix case and read its ptxas report."""
    case = cm.module_cases(module, target)[name]
    compiled = cm.compile_case(case, target)
    registers, spills = ptxas_report(compiled.asm["ptx"], target.arch)
    shared = int(compiled.metadata.shared)
    return Report(name, case.num_warps, registers, spills, shared,
                  programs_per_sm(case.num_warps, registers, shared, target.arch))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probe_registers", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="sm_90", choices=[f"sm_{a}" for a in SM_SHARED])
    p.add_argument("--filter", default="", help="only the cases whose name matches this regular expression")
    args = p.parse_args(argv)
    target = cm.TARGETS_BY_NAME[args.target]
    pattern = re.compile(args.filter)
    for module in cm.MATRIX_MODULES:
        for name in sorted(cm.module_cases(module, target)):
            if pattern.search(name):
                try:
                    print(report(module, name, target).line(), flush=True)
                except Exception as exc:   # a failed compile is a line, not the end of the report
                    print(f"{name:72s} error: {str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__}",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
