"""kernels/_launch.py: when launches skip Triton's JIT (direct) and when they take its public path.

The policy and the public-path fallback are tested on CPU with a fake jit function; the GPU test
checks, for every op example, that direct launches, public launches and launches with a Triton
launch hook write the same bytes (direct launches rely on Triton-internal argument layouts).
"""
import contextlib
import dataclasses
import importlib
import pkgutil
import warnings

import pytest
import torch
import triton

import torch_dsv4_ops.kernels
from torch_dsv4_ops import library
from torch_dsv4_ops.kernels import _launch
from torch_dsv4_ops.ops._plans import ByAlignment
from torch_dsv4_ops.testing import assert_bitwise_equal


# --- policy ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["3.6.0", "3.6.1", "3.6.0+git1234abc"])
def test_policy_verified_versions_launch_directly(version):
    assert _launch.direct_launch_policy(version, "") == (True, None)


@pytest.mark.parametrize("version", ["3.7.1", "3.9.0", "4.0.0+git", "3.60.0", "13.6.0", "3.5.0"])
def test_policy_unverified_versions_take_the_public_path(version):
    allowed, message = _launch.direct_launch_policy(version, "")
    assert allowed is False
    assert version in message and "TORCH_DSV4_DIRECT_LAUNCH=1" in message


@pytest.mark.parametrize("version", ["3.6.0", "3.9.0"])
def test_policy_environment_overrides(version, monkeypatch):
    assert _launch.direct_launch_policy(version, "1") == (True, None)
    assert _launch.direct_launch_policy(version, "0") == (False, None)     # forbidden: no warning either
    for bad in ("yes", "true", " 1", "2"):
        with pytest.raises(ValueError, match="TORCH_DSV4_DIRECT_LAUNCH"):
            _launch.direct_launch_policy(version, bad)
    monkeypatch.setenv(_launch.ENV_DIRECT, "1")                          # env=None reads the environment
    assert _launch.direct_launch_policy(version) == (True, None)
    monkeypatch.setenv(_launch.ENV_DIRECT, "0")
    assert _launch.direct_launch_policy(version) == (False, None)
    monkeypatch.setenv(_launch.ENV_DIRECT, "on")
    with pytest.raises(ValueError, match="'on'"):
        _launch.direct_launch_policy(version)
    monkeypatch.delenv(_launch.ENV_DIRECT)
    assert _launch.direct_launch_policy(version)[0] is (version == "3.6.0")


def test_arguments_view_or_address(monkeypatch):
    """A public launch hands Triton each tensor as the dtype its bind names: a view where one exists, else (off the
    interpreter, which needs tensors) the tensor's address as that dtype."""
    from torch_dsv4_ops import platform

    rows = torch.zeros(3, 133, dtype=torch.uint8)[:, 1:]           # 132 bytes a row, 133 apart: no int32 view
    words = torch.zeros(3, 132, dtype=torch.uint8)
    assert _launch._as(words, torch.int32).shape == (3, 33)
    monkeypatch.setattr(platform, "INTERPRET", True)
    with pytest.raises(RuntimeError):
        _launch._as(rows, torch.int32)
    monkeypatch.setattr(platform, "INTERPRET", False)
    typed = _launch._as(rows, torch.int32)
    assert isinstance(typed, _launch.PointerAs)
    assert typed.dtype == torch.int32 and typed.data_ptr() == rows.data_ptr()


def test_hook_set():
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not _launch._hook_set(None)
    assert not _launch._hook_set(Chain([]))
    assert _launch._hook_set(Chain([print]))
    assert _launch._hook_set(print)         # a plain function (Triton before HookChain)


# --- the public path, with a fake jit function -------------------------------------------------------
class FakeJit:
    """Stands in for a @triton.jit function: `fn[grid](*args, **meta)` records the call."""

    params = []

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return None
        return launch


class Runtime:
    def __init__(self, enter=None, exit=None):
        self.launch_enter_hook, self.launch_exit_hook = enter, exit


def _fake_launch(monkeypatch, policy, runtime=None):
    jit = FakeJit()
    launcher = _launch.FastLauncher(jit)
    monkeypatch.setattr(launcher, "available", True)      # as on a CUDA machine
    monkeypatch.setattr(launcher, "runtime", runtime or Runtime())
    monkeypatch.setattr(launcher, "_policy", policy)
    monkeypatch.setattr(_launch, "_warned", False)
    launch = launcher.bind((4, 2), (torch.float32, torch.uint8), (7, 9), {"BLOCK": 16, "num_warps": 4},
                           torch.device("cpu"))
    return jit, launcher, launch


def _assert_public_calls(jit, x, y, count):
    assert len(jit.calls) == count
    for grid, args, kwargs in jit.calls:
        assert grid == (4, 2, 1)
        assert len(args) == 4 and args[0] is x and args[2:] == (7, 9)
        assert args[1].dtype == torch.uint8 and args[1].data_ptr() == y.data_ptr()   # int8 viewed as uint8
        assert kwargs == {"BLOCK": 16, "num_warps": 4}


def test_unverified_version_takes_the_public_path_and_warns_once(monkeypatch):
    jit, launcher, launch = _fake_launch(monkeypatch, _launch.direct_launch_policy("3.99.0", ""))
    assert launcher.direct is False
    x, y = torch.zeros(8), torch.zeros(8, dtype=torch.int8)
    with pytest.warns(RuntimeWarning, match="3.99.0") as record:
        launch(x, y)
        launch(x, y)
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    _assert_public_calls(jit, x, y, 2)
    assert launcher.cache_size() == 0   # nothing kept for direct launches
    with warnings.catch_warnings():     # a second launcher in the same process does not warn again
        warnings.simplefilter("error")
        other = _launch.FastLauncher(FakeJit())
        monkeypatch.setattr(other, "available", True)
        monkeypatch.setattr(other, "runtime", Runtime())
        monkeypatch.setattr(other, "_policy", _launch.direct_launch_policy("3.99.0", ""))
        other.bind((1,), (torch.float32,), (), {}, torch.device("cpu"))(x)


def _launch_twice_without_warnings(jit, launch):
    """Two launches, any warning an error; both must have gone through the (fake) JIT."""
    x, y = torch.zeros(8), torch.zeros(8, dtype=torch.int8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch(x, y)
        launch(x, y)
    _assert_public_calls(jit, x, y, 2)


def test_forbidden_direct_launches_do_not_warn(monkeypatch):
    jit, launcher, launch = _fake_launch(monkeypatch, _launch.direct_launch_policy("3.6.0", "0"))
    _launch_twice_without_warnings(jit, launch)


@pytest.mark.parametrize("which", ["enter", "exit"])
def test_launch_hooks_take_the_public_path(monkeypatch, which):
    """With a profiler's launch hook set, even a verified version launches through the JIT (so the
    hook sees every launch), without warning."""
    hook = lambda *a, **k: None   # noqa: E731
    runtime = Runtime(enter=hook) if which == "enter" else Runtime(exit=hook)
    jit, launcher, launch = _fake_launch(monkeypatch, (True, None), runtime)
    _launch_twice_without_warnings(jit, launch)
    assert launcher.cache_size() == 0


def test_interpreter_launchers_are_public_only():
    """Under the interpreter (or on ROCm) a FastLauncher never launches directly."""
    launcher = torch_dsv4_ops.kernels.cache.LAUNCHER
    if launcher.available:
        pytest.skip("compiled Triton: direct launches are available here")
    assert launcher.direct is False


def test_int_values_select_the_compiled_kernel_only_through_their_specialisation():
    """Binds that differ in a per-step int share a specialisation (one compiled kernel, no JIT per new
    value); an int that Triton specialises differently (== 1, divisible by 16, past int32) does not."""
    from torch_dsv4_ops import platform
    from torch_dsv4_ops.kernels import k_cache

    meta = _launch.launch_options(k_cache.insert_constexprs(64, False, platform.Target("cuda", 90)))
    launcher = k_cache.INSERT_LAUNCHER
    dtypes = (torch.bfloat16, torch.uint8, torch.int64)

    def spec(tokens):
        return launcher.bind((1,), dtypes, (tokens, 512, 1, 128, 37440), meta, torch.device("cpu")).spec

    assert spec(3) == spec(5) == spec(1001)
    assert spec(16) == spec(4096)
    assert len({spec(3), spec(16), spec(1), spec(2**31 + 3)}) == 4
    assert _launch.int_specialisation(2.5) == _launch.int_specialisation(0.25)


def test_launch_options_select_the_compiled_kernel():
    """Two binds that differ only in num_warps (or another launch option) are distinct
    specialisations: a direct launch must not reuse the kernel compiled for the other."""
    from torch_dsv4_ops import platform
    from torch_dsv4_ops.kernels import k_cache

    meta = _launch.launch_options(k_cache.insert_constexprs(64, False, platform.Target("cuda", 90)))
    launcher = k_cache.INSERT_LAUNCHER
    args = ((1,), (torch.bfloat16, torch.uint8, torch.int64), (3, 512, 1, 128, 37440))
    a = launcher.bind(*args, meta, torch.device("cpu"))
    b = launcher.bind(*args, {**meta, "num_warps": 2 * meta["num_warps"]}, torch.device("cpu"))
    c = launcher.bind(*args, dict(meta), torch.device("cpu"))
    assert a.spec != b.spec
    assert a.spec == c.spec


# --- GPU: direct, public and hooked launches write the same bytes -------------------------------
def _fast_launchers():
    """Every FastLauncher held at module level by a torch_dsv4_ops.kernels submodule."""
    found = []
    package = torch_dsv4_ops.kernels
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, _launch.FastLauncher) and all(value is not f for f in found):
                found.append(value)
    return found


def _holds_launch(plan) -> bool:
    """A Launch, a ByAlignment of one, or a plan dataclass with a Launch field (attention's ChunkedPlan)."""
    if isinstance(plan, _launch.Launch):
        return True
    if isinstance(plan, ByAlignment):
        return _holds_launch(plan.aligned) or _holds_launch(plan.other)
    return dataclasses.is_dataclass(plan) and any(_holds_launch(getattr(plan, f.name))
                                                  for f in dataclasses.fields(plan))


def _plan_caches():
    """(module, name) of every module-level dict of torch_dsv4_ops.ops holding Launch objects."""
    import torch_dsv4_ops.ops as ops

    found = []
    for info in pkgutil.iter_modules(ops.__path__):
        module = importlib.import_module(f"{ops.__name__}.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, dict) and any(_holds_launch(v) for v in value.values()):
                found.append((module, name))
    return found


def test_launchers_are_found():
    assert any(f is torch_dsv4_ops.kernels.cache.LAUNCHER for f in _fast_launchers())


def _examples():
    return [(name, label) for name, card in library.OPS.items() for label in card.examples()]


@contextlib.contextmanager
def _launch_hook(hook):
    """Set a Triton launch-enter hook (HookChain.add on Triton 3.6+, else assignment), restore after."""
    from triton import knobs

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            yield
        finally:
            chain.remove(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
        try:
            yield
        finally:
            knobs.runtime.launch_enter_hook = chain


@pytest.mark.gpu
@pytest.mark.parametrize("name,label", _examples(), ids=lambda x: x)
def test_direct_public_and_hooked_launches_write_the_same_bytes(monkeypatch, name, label):
    card = library.OPS[name]
    launchers = _fast_launchers()
    assert launchers
    if not all(f.available for f in launchers):
        pytest.skip("direct launches are not used here (ROCm)")
    policy = _launch.direct_launch_policy()
    if not policy[0]:
        pytest.skip(f"triton {triton.__version__} is not verified for direct launches "
                    f"({', '.join(_launch.VERIFIED_TRITON)}) and {_launch.ENV_DIRECT} is not 1")
    for f in launchers:
        monkeypatch.setattr(f, "_policy", policy)
    monkeypatch.setattr(_launch, "_warned", False)
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in card.examples()[label]]

    def fresh():
        return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]

    for _ in range(2):              # the first launch of a signature compiles through the JIT
        card.op(*fresh())
    torch.cuda.synchronize()

    entered = []
    for f in launchers:
        jit_run = f.fn.run
        monkeypatch.setattr(f.fn, "run", lambda *a, _run=jit_run, **k: (entered.append(1), _run(*a, **k))[1])

    # (a) direct: Triton's JIT is not entered
    direct = fresh()
    card.op(*direct)
    torch.cuda.synchronize()
    assert entered == [], f"{name} [{label}]: a repeated launch went through Triton's JIT"
    assert _launch._warned is False

    # (c) with a launch hook set: the public path, and the hook sees the launch
    hooked, calls = fresh(), []
    with _launch_hook(lambda *a, **k: calls.append(1)):
        card.op(*hooked)
        torch.cuda.synchronize()
    assert entered and calls, f"{name} [{label}]: with a launch hook set, the launch skipped Triton's JIT/hook"

    # (b) public: an unverified-version policy, on fresh plans (a Launch keeps its direct entries)
    entered.clear()
    for f in launchers:
        monkeypatch.setattr(f, "_policy", (False, None))
    for module, cache in _plan_caches():
        monkeypatch.setattr(module, cache, type(getattr(module, cache))())
    public = fresh()
    card.op(*public)
    torch.cuda.synchronize()
    assert entered, f"{name} [{label}]: the public-path run did not go through Triton's JIT"

    for i in card.mutated:
        what = f"{name} [{label}] {card.op._schema.arguments[i].name}"
        assert_bitwise_equal(direct[i], public[i], f"{what}: direct vs public launch")
        assert_bitwise_equal(hooked[i], public[i], f"{what}: hooked vs public launch")
        # something was written: non-zero bytes, or (an op that writes zeros) bytes that differ from the input's
        written = direct[i].count_nonzero() > 0 or not torch.equal(direct[i], args[i])
        assert written, f"{what}: nothing written"
