"""Low-overhead launches of @triton.jit kernels.

`kernel[grid](...)` re-binds and re-specialises every argument on each call, which costs several
microseconds for kernels with thirty arguments. An op builds one `Launch` per argument signature
(grid, int arguments and constexprs fixed); its first call goes through Triton's JIT (compiling if
needed) and keeps the compiled kernel, and later calls hand the raw tensor addresses straight to
Triton's compiled launcher.

That direct path depends on the argument layout of Triton-internal functions, so it is taken only
on Triton versions whose layout the GPU suite has verified (`VERIFIED_TRITON`); on any other version
every launch takes Triton's public `kernel[grid](...)` path (correct, ~20 us slower per call) and one
warning per process names the version. `TORCH_DSV4_DIRECT_LAUNCH=1` forces the direct path (to
verify a new version with the GPU suite), `=0` forbids it. Under the interpreter, on ROCm (whose
pointer specialisation also depends on the storage size) and while Triton launch hooks (profilers)
are set, launches always take the public path.
"""
from __future__ import annotations

import os
import warnings
from functools import reduce
from operator import or_

import torch
import triton

from .. import platform

VERIFIED_TRITON = ("3.6",)
"""major.minor versions whose compiled-launcher argument layout tests/test_launch.py has verified on a GPU."""

ENV_DIRECT = "TORCH_DSV4_DIRECT_LAUNCH"
ALL_ALIGNED = -1

_current_device = getattr(torch._C, "_cuda_getDevice", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class PointerAs:
    """A tensor's address as a pointer argument of another element type (what Triton's launch reads of a tensor:
    `data_ptr()` and `dtype`): a cache's bytes as int32 words, a float32 workspace allocated as bf16, without a
    view (a non-contiguous uint8 tensor cannot be viewed as int32)."""

    __slots__ = ("address", "dtype")

    def __init__(self, t: torch.Tensor, dtype: torch.dtype):
        self.address, self.dtype = t.data_ptr(), dtype

    def data_ptr(self) -> int:
        return self.address


def _as(t: torch.Tensor, dtype: torch.dtype):
    """t viewed as dtype; a `PointerAs` where no view exists (a uint8 cache of odd strides read as int32 words)."""
    try:
        return t.view(dtype)
    except RuntimeError:
        if platform.INTERPRET:
            raise
        return PointerAs(t, dtype)


def triton_minor(version: str) -> str:
    """"3.6.0" -> "3.6"."""
    return ".".join(version.split("+")[0].split(".")[:2])


def direct_launch_policy(version: str = triton.__version__, env: str | None = None) -> tuple[bool, str | None]:
    """(direct launches allowed, the warning to give or None) for a Triton `version` and the
    TORCH_DSV4_DIRECT_LAUNCH value (read from the environment when None)."""
    env = os.environ.get(ENV_DIRECT, "") if env is None else env
    if env in ("0", "1"):
        return env == "1", None
    if env:
        raise ValueError(f"{ENV_DIRECT} must be 0 or 1, got {env!r}")
    if triton_minor(version) in VERIFIED_TRITON:
        return True, None
    return False, (f"torch_dsv4_ops: triton {version} is not among the versions whose launcher layout has been "
                   f"verified ({', '.join(VERIFIED_TRITON)}); kernels launch through triton's public path "
                   f"(~20 us more per call). Set {ENV_DIRECT}=1 to try the direct path.")


_warned = False


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def int_specialisation(value) -> tuple:
    """What Triton's JIT compiles a non-constexpr scalar argument as: an int equal to 1 becomes a
    constant, other ints are i32, i64 or u64 with a divisible-by-16 flag; floats are fp32. Two values
    with the same result run the same compiled kernel (`kernels/matrix.py::specialise` mirrors this)."""
    if isinstance(value, bool):
        return ("i1", value)
    if isinstance(value, int):
        if value == 1:
            return ("constexpr", 1)
        width = "i32" if -2**31 <= value < 2**31 else "u64" if value >= 2**63 else "i64"
        return (width, value % 16 == 0)
    if isinstance(value, float):
        return ("fp32",)
    return ("value", value)


def launch_options(meta: dict) -> dict:
    """meta plus the Triton launch options it implies: programmatic dependent launch with PDL."""
    return dict(meta, launch_pdl=True) if meta.get("PDL") else meta


def _hook_set(hook) -> bool:
    """A launch hook is in use: not None and, for Triton's HookChain (3.6+, always present), non-empty."""
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLauncher:
    """Launches of one @triton.jit kernel whose constexpr parameters all follow its runtime parameters."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled: dict = {}     # (specialisation id, aligned mask, device index) -> compiled kernel
        self._ids: dict = {}
        # the interpreter's functions have no .params; they always take Triton's own path
        self.available = not platform.INTERPRET and not platform.IS_HIP
        self.constexpr_names = tuple(p.name for p in fn.params if p.is_constexpr) if self.available else ()
        self.runtime = None
        if self.available:
            from triton import knobs
            self.runtime = knobs.runtime
        self._policy = None

    @property
    def direct(self) -> bool:
        """Whether launches after the first of a specialisation skip Triton's JIT."""
        if not self.available:
            return False
        if self._policy is None:
            self._policy = direct_launch_policy()
        return self._policy[0]

    def bind(self, grid: tuple, dtypes: tuple, ints: tuple, meta: dict, device: torch.device) -> "Launch":
        """A launch of `grid` with these int arguments and `meta` (constexprs by name, num_warps and
        launch options). `dtypes`: per tensor argument, the dtype Triton sees (a tensor of another
        dtype is viewed as it)."""
        constexpr_values = tuple(meta[n] for n in self.constexpr_names)
        # num_warps, num_stages and launch options select a compiled kernel too
        options = tuple(sorted((k, v) for k, v in meta.items() if k not in self.constexpr_names))
        # ints select it only through Triton's specialisation of them, so binds that differ in a
        # per-step int (a token count, a query length) share one compiled kernel
        key = (dtypes, tuple(int_specialisation(v) for v in ints), constexpr_values, options)
        spec = self._ids.setdefault(key, len(self._ids))
        return Launch(self, grid, dtypes, ints, constexpr_values, meta, device, spec)

    def cache_size(self) -> int:
        """Compiled specialisations held for direct launches (the launch probe prints it)."""
        return len(self._compiled)


def _direct_entry(compiled) -> tuple:
    """(function, the arguments between the stream and the kernel arguments) for a compiled kernel.

    Triton 3.6: `compiled.run` is a CudaLauncher whose `__call__` allocates scratch space (none for
    our kernels) and calls its C `launch(gx, gy, gz, stream, function, cooperative, pdl, scratch,
    profile_scratch, metadata, launch_metadata, enter_hook, exit_hook, *args)`; calling `launch`
    itself saves a Python frame. Otherwise the documented-by-use `run(gx, gy, gz, stream, function,
    metadata, launch_metadata, enter_hook, exit_hook, *args)`.
    """
    runner = compiled.run
    c_launch = getattr(runner, "launch", None)
    if (c_launch is not None and getattr(runner, "global_scratch_size", 1) == 0
            and getattr(runner, "profile_scratch_size", 1) == 0 and hasattr(runner, "launch_pdl")):
        return c_launch, (compiled.function, runner.launch_cooperative_grid, runner.launch_pdl, None, None,
                          compiled.packed_metadata, None, None, None)
    return runner, (compiled.function, compiled.packed_metadata, None, None, None)


class Launch:
    """One specialisation of one kernel on one device: call it with the tensor arguments."""

    __slots__ = ("launcher", "runtime", "grid", "dtypes", "ints", "tail", "meta", "device", "device_index",
                 "check_device", "spec", "_entries", "_ready")

    def __init__(self, launcher, grid, dtypes, ints, constexpr_values, meta, device, spec):
        self.launcher, self.dtypes, self.ints, self.meta, self.device, self.spec = \
            launcher, dtypes, ints, meta, device, spec
        self.runtime = launcher.runtime if launcher.available else None   # None: always Triton's path
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.tail = ints + constexpr_values
        self.device_index = device.index if device.type == "cuda" else None
        # with one visible GPU every CUDA tensor is on the current device: no per-call device check
        self.check_device = self.device_index is not None and torch.cuda.device_count() > 1
        self._entries: dict = {}      # aligned mask -> (function, middle arguments)
        # the usual case, once known: direct path, no device check, every pointer 16-byte aligned
        self._ready = None

    def arguments(self, tensors) -> tuple:
        """The runtime arguments of Triton's public path: the tensors viewed as `dtypes` (as typed addresses where
        a view is impossible, off the interpreter, which needs tensors), then the ints."""
        return tuple(t if t.dtype == d else _as(t, d) for t, d in zip(tensors, self.dtypes)) + self.ints

    def public(self, tensors):
        """Launch through Triton's JIT (`kernel[grid](...)`); returns Triton's compiled kernel."""
        return self.launcher.fn[self.grid](*self.arguments(tensors), **self.meta)

    def __call__(self, *tensors) -> None:
        ready = self._ready
        if ready is not None:
            function, grid, middle, tail, index, rt = ready
            # Tensors go to the compiled launcher as raw addresses: for a tensor it would call
            # data_ptr() and cuPointerGetAttribute (a driver call) on each, per launch.
            ptrs = [t.data_ptr() for t in tensors]
            try:       # Triton 3.6+: HookChains, empty unless a profiler added a hook
                hooked = rt.launch_enter_hook.calls or rt.launch_exit_hook.calls
            except AttributeError:
                hooked = True
            if not hooked and not reduce(or_, ptrs) & 15:
                function(*grid, _raw_stream(index), *middle, *ptrs, *tail)
                return
        self._general(tensors)

    def _general(self, tensors) -> None:
        """Every case: another current device, Triton's path, launch hooks, unaligned pointers."""
        if self.check_device and _current_device() != self.device_index:
            with torch.cuda.device(self.device_index):
                self._general(tensors)
            return
        rt = self.runtime
        if rt is None or _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook):
            self.public(tensors)
            return
        ptrs = [t.data_ptr() for t in tensors]
        aligned = ALL_ALIGNED if reduce(or_, ptrs) & 15 == 0 else \
            sum(((p & 15) == 0) << i for i, p in enumerate(ptrs))
        entry = self._entries.get(aligned)
        if entry is None:
            entry = self._first_launch(tensors, aligned)
            if entry is None:
                return
        function, middle = entry
        function(*self.grid, _raw_stream(self.device_index), *middle, *ptrs, *self.tail)

    def _first_launch(self, tensors, aligned):
        """Launch through Triton's JIT if no compiled kernel is known for this alignment (returns None),
        else the direct-launch entry. Warns once per process when the Triton version is unverified."""
        launcher = self.launcher
        if not launcher.direct:
            if launcher._policy[1]:
                _warn_once(launcher._policy[1])
            self.public(tensors)
            return None
        key = (self.spec, aligned, self.device_index)
        compiled = launcher._compiled.get(key)
        if compiled is None:
            launcher._compiled[key] = self.public(tensors)
            return None
        self._entries[aligned] = entry = _direct_entry(compiled)
        if aligned == ALL_ALIGNED and not self.check_device:
            self._ready = (entry[0], self.grid, entry[1], self.tail, self.device_index, self.runtime)
        return entry
