"""Argument checks shared by the op families (SPEC R3: dtypes, shapes, devices, ints; never contents)."""
from __future__ import annotations

import torch

INT32_MAX = 2**31 - 1


def check_tensor(name: str, t, *, ndim=None, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() not in ((ndim,) if isinstance(ndim, int) else ndim):
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all tensors on one device)")


def check_shape(name: str, t: torch.Tensor, expected: tuple, what: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}{' ' + what if what else ''}, "
                         f"got {tuple(t.shape)}")


def check_scale(name: str, t, device) -> None:
    check_tensor(name, t, dtypes=(torch.float32,), device=device)
    if t.numel() != 1:
        raise ValueError(f"{name} must be a 1-element float32 tensor, got shape {tuple(t.shape)}")


def check_int32_extent(name: str, t: torch.Tensor, first_dim: int = 1) -> None:
    """Kernels address inside one row/page with int32 offsets; refuse views that reach further."""
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape[first_dim:], t.stride()[first_dim:]) if n > 0)
    if extent > INT32_MAX:
        raise NotImplementedError(f"{name}: one page/row spans {extent} elements, over int32 offsets")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def check_float(name: str, value) -> None:
    """A float argument (an int is accepted; a SymFloat while torch.compile traces)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.SymFloat)):
        raise ValueError(f"{name} must be a float, got {value!r}")


def check_int(name: str, value, lo: int) -> None:
    """An int argument >= lo; a SymInt (torch.compile tracing) is accepted unchecked."""
    if isinstance(value, torch.SymInt):
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


def known(*values) -> bool:
    """All plain ints (no SymInt), so they can be compared without adding compile guards."""
    return all(isinstance(v, int) for v in values)


def check_rows(name: str, t: torch.Tensor, n) -> None:
    """t has at least n rows (checked when both are plain ints)."""
    if known(n, t.shape[0]) and t.shape[0] < n:
        raise ValueError(f"{name} has {t.shape[0]} rows, fewer than the {n} needed")
