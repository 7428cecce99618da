"""The public wrappers' eager fast path (library._public_caller): on plain CUDA tensors it calls the
registered CUDA implementation without the dispatcher; everything else goes through the dispatcher."""
import pytest
import torch

import torch_dsv4_ops as d
from torch_dsv4_ops import library
from torch_dsv4_ops.testing import assert_bitwise_equal

pytestmark = pytest.mark.gpu


def _args(device="cuda", seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(5, 2, 16, generator=g).to(torch.bfloat16)
    value = torch.randn(5, 2, 16, generator=g).to(torch.bfloat16)
    kc = torch.zeros(4, 4, 2, 16, dtype=torch.uint8)
    slots = torch.tensor([3, -1, 7, 15, 0])
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in
            (key, value, kc, kc.clone(), slots, "fp8", torch.tensor([0.05]), torch.tensor([0.1]))]


class _Count(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_fast_path_equals_dispatcher_path():
    fast, slow = _args(), _args()
    versions = [t._version for t in fast[2:4]]
    d.reshape_and_cache_flash(*fast)
    torch.ops.dsv4.reshape_and_cache_flash.default(*slow)
    for a, b in zip(fast, slow):
        if isinstance(a, torch.Tensor):
            assert_bitwise_equal(a, b, "fast path vs dispatcher")
    assert [t._version for t in fast[2:4]] == [v + 1 for v in versions]
    assert [t._version for t in slow[2:4]] == [v + 1 for v in versions]


def test_modes_and_the_profiler_see_the_op():
    """A dispatch mode and the profiler are served by the dispatcher path: both see the op."""
    args = _args()
    with _Count() as mode:
        d.reshape_and_cache_flash(*args)
    assert "dsv4.reshape_and_cache_flash.default" in mode.ops
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        d.reshape_and_cache_flash(*args)
    assert any("dsv4::reshape_and_cache_flash" in e.name for e in prof.events())


def test_flag_off_and_subclasses_take_the_dispatcher(monkeypatch):
    calls = []
    original = torch._ops.OpOverload.__call__

    def spy(self, *a, **k):
        calls.append(str(self))
        return original(self, *a, **k)

    monkeypatch.setattr(torch._ops.OpOverload, "__call__", spy)
    d.reshape_and_cache_flash(*_args())
    assert calls == [], "plain CUDA tensors must take the fast path"
    monkeypatch.setattr(library.EAGER_FAST_PATH, "enabled", False)
    d.reshape_and_cache_flash(*_args())
    assert calls == ["dsv4.reshape_and_cache_flash.default"]
    monkeypatch.setattr(library.EAGER_FAST_PATH, "enabled", True)
    args = _args()
    args[2] = torch.nn.Parameter(args[2], requires_grad=False)
    d.reshape_and_cache_flash(*args)
    assert calls[-1] == "dsv4.reshape_and_cache_flash.default" and len(calls) == 2
