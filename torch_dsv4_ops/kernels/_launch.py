"""Low-overhead launches of @triton.jit kernels.

`kernel[grid](...)` re-binds and re-specialises every argument on each call, which costs several
microseconds for kernels with thirty arguments. A `FastLauncher` launches each specialisation
once through Triton's JIT (compiling it if needed), keeps the compiled kernel, and afterwards
calls it directly. The caller supplies `plan_key`: anything that fixes the dtypes and every int
argument (so Triton's int specialisations, == 1, % 16 and i32/i64, are fixed); the launcher adds
the 16-byte alignment of each tensor argument and the device, which Triton also specialises on.
Under the interpreter, on ROCm (whose pointer specialisation also depends on the storage size),
or while Triton launch hooks (profilers) are set, it always takes Triton's own path.
"""
from __future__ import annotations

import torch

from .. import platform


def _hook_set(hook) -> bool:
    """A launch hook is in use: not None and, for Triton's HookChain (3.6+, always present), non-empty."""
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLauncher:
    """Launch one @triton.jit kernel whose constexpr parameters all follow its runtime parameters."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled: dict = {}
        self._ids: dict = {}
        # HIP builds also specialise pointers on their storage size (buffer ops): keep Triton's path
        self.direct = not platform.INTERPRET and not platform.IS_HIP
        # the interpreter's functions have no .params; they always take Triton's own path
        self.constexpr_names = tuple(p.name for p in fn.params if p.is_constexpr) if self.direct else ()
        if self.direct:
            from triton import knobs
            self._runtime = knobs.runtime

    def __call__(self, grid: tuple, args: tuple, num_tensors: int, constexpr_values: tuple, meta: dict,
                 plan_key, device: torch.device) -> None:
        """Launch on `device` (its index must be the current device). `args` are the runtime
        arguments with the `num_tensors` tensors first; `constexpr_values` are meta's constexprs in
        parameter order; `meta` (constexprs by name, plus num_warps) is used for Triton's own path."""
        if not self.direct:
            self.fn[grid](*args, **meta)
            return
        # Tensors go to the compiled launcher as raw device addresses: for a tensor it would call
        # data_ptr() and cuPointerGetAttribute (a driver call) on each, per launch.
        ptrs = [args[i].data_ptr() for i in range(num_tensors)]
        aligned = 0
        for i, p in enumerate(ptrs):
            aligned |= (p & 15 == 0) << i
        key = (plan_key, aligned, device.index)
        compiled = self._compiled.get(key)
        if compiled is None or _hook_set(self._runtime.launch_enter_hook) \
                or _hook_set(self._runtime.launch_exit_hook):
            compiled = self.fn[grid](*args, **meta)
            self._compiled[key] = compiled
            return
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                     compiled.function, compiled.packed_metadata, None, None, None, *ptrs, *args[num_tensors:],
                     *constexpr_values)

    def intern(self, specialisation: tuple) -> int:
        """A small int naming `specialisation` (tensor dtypes, int arguments, constexprs): the
        `plan_key` to pass, so the compiled-kernel cache grows with specialisations, not calls."""
        return self._ids.setdefault(specialisation, len(self._ids))

    def constexpr_values(self, meta: dict) -> tuple:
        """meta's constexprs in the kernel's parameter order (what a direct launch passes)."""
        return tuple(meta[name] for name in self.constexpr_names)

    def cache_size(self) -> int:
        """Specialisations held for direct launches (the launch probe prints it)."""
        return len(self._compiled)
