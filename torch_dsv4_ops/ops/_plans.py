"""Plans by argument signature, shared by the op families.

An op's `_kernel` builds a signature tuple of every shape, stride, dtype, device and non-tensor
argument of a call (never a tensor's values), validates and plans only when the signature is new,
and otherwise looks the plan (a kernels._launch.Launch, or None for nothing to launch) up and runs it.
"""
from __future__ import annotations

import torch

from ..kernels._launch import launch_options

MISSING = object()
"""`plans.get(sig, MISSING)`: a signature not seen yet (None is a valid plan: nothing to launch)."""


class PlanCache(dict):
    """{signature: plan}, emptied when it reaches `limit` entries (a bound on memory, not an LRU)."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def remember(self, sig, plan):
        """Store and return `plan`."""
        if len(self) >= self.limit:
            self.clear()
        self[sig] = plan
        return plan


class ByAlignment:
    """A plan of two launches: `aligned` where the call's arguments numbered `args` (tensors) all sit at a multiple
    of `align` bytes (a power of two), `other` elsewhere. For fast paths that need aligned vector loads; addresses
    are not part of a plan's signature."""

    __slots__ = ("aligned", "other", "args", "mask")

    def __init__(self, aligned, other, args: tuple[int, ...], align: int):
        self.aligned, self.other, self.args, self.mask = aligned, other, args, align - 1

    def __call__(self, *call):
        aligned = all(call[i].data_ptr() & self.mask == 0 for i in self.args)
        (self.aligned if aligned else self.other)(*call)


def signature(name: str, args) -> tuple:
    """`name` and every shape, stride, dtype, device and scalar of a call (never a tensor's values)."""
    return (name, *[(a.shape, a.stride(), a.dtype, a.get_device()) if isinstance(a, torch.Tensor) else a
                    for a in args])


def bind_rows(launcher, grid: int, tensors, ints, meta, device):
    """`launcher.bind` for a 1-D grid, the Triton dtypes being the tensors' own."""
    return launcher.bind((grid,), tuple(t.dtype for t in tensors), tuple(ints), launch_options(meta), device)
