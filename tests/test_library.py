"""Package-level contracts: every op is registered, exported and sync-free."""
import contextlib
import inspect

import pytest
import torch

import torch_dsv4_ops as d
from torch_dsv4_ops import library
from torch_dsv4_ops.testing import sync_debug_error


def _public_name(name: str) -> str:
    """The Python function that calls dsv4::<name>: itself, or for an `_out` form the allocating
    op's function (which takes the caller's buffers, R1)."""
    return name.removesuffix("_out") if name.endswith("_out") and name.removesuffix("_out") in library.OPS else name


def _same_arguments_public(name: str):
    """The public function named `name` if it takes exactly the op's arguments (by name), else None."""
    fn = getattr(d, name, None)
    if fn is None:
        return None
    params = inspect.signature(fn).parameters
    if list(params) != [a.name for a in library.OPS[name].op._schema.arguments]:
        return None
    keyword_only = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    if not keyword_only:
        return fn
    first = len(params) - len(keyword_only)

    def call(*args):   # the op's trailing arguments that the public function takes by keyword only
        return fn(*args[:first], **dict(zip(keyword_only, args[first:])))
    return call


def test_every_card_is_complete_and_exported():
    assert library.OPS, "no ops registered"
    for name, card in library.OPS.items():
        assert getattr(torch.ops.dsv4, name).default is card.op
        assert card.examples is not None and card.examples(), f"{name} has no self-check examples"
        public = _public_name(name)
        assert hasattr(d, public) and callable(getattr(d, public)), f"{public} is not exported at top level"
        assert getattr(d, public).__doc__, f"{public} has no docstring"


def test_registering_a_name_twice_fails():
    card = next(iter(library.OPS.values()))
    with pytest.raises(RuntimeError, match="already registered"):
        library.register_op(card.schema, reference=card.reference, kernel=card.kernel, fake=card.fake)


def test_cpu_implementation_switch_is_scoped():
    before = library._CPU.triton
    with d.cpu_implementation("reference"):
        assert library._CPU.triton is False
    assert library._CPU.triton is before
    with pytest.raises(ValueError, match="reference"):
        with d.cpu_implementation("cuda"):
            pass


@pytest.mark.gpu
def test_every_op_is_sync_free():
    """SPEC §4 i: no op synchronises the host (first call, which plans and compiles, and later calls)."""
    for name, card in library.OPS.items():
        for label, args in card.examples().items():
            dev_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
            torch.cuda.synchronize()
            public = _same_arguments_public(name)
            with sync_debug_error():
                card.op(*dev_args)
                if public is not None:
                    public(*dev_args)
            torch.cuda.synchronize()


# --- version counters of mutated arguments ----------------------------------------------------------
def _examples():
    """(op name, example label) of every example of every registered op."""
    return [(name, label) for name, card in library.OPS.items() for label in card.examples()]


def _written_positions(op) -> set:
    """Positions of the arguments the registered schema marks `(a!)` (read from the dispatcher's
    schema, not from the card)."""
    return {i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write}


def _assert_versions_bumped(card, call, args, what):
    """Run call(*args): the version of every mutated argument rises, every other tensor's stays."""
    mutated = _written_positions(card.op)
    assert set(card.mutated) == mutated, f"{card.name}: card.mutated {card.mutated} != schema {mutated}"
    tensors = {i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    written_storages = {tensors[i].untyped_storage().data_ptr() for i in mutated}
    before = {i: t._version for i, t in tensors.items()}
    call(*args)
    for i, t in tensors.items():
        name = card.op._schema.arguments[i].name
        if i in mutated:
            assert t._version >= before[i] + 1, f"{what}: {name} was written but its version did not rise"
        elif t.untyped_storage().data_ptr() not in written_storages:   # a view of a written tensor shares its counter
            assert t._version == before[i], f"{what}: {name} is not written but its version changed"


IMPLS = ["reference", "triton"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,label", _examples(), ids=lambda x: x)
def test_every_op_bumps_versions_of_mutated_args_only(device, impl, name, label):
    """Every op, every example, every implementation the device runs, through the dispatcher and
    through the public Python function where it takes the op's arguments (it may skip the dispatcher
    in eager CUDA calls): `tensor._version` of each argument the schema marks (a!) rises, and of no
    other argument (autograd and caches keyed on _version see the write; functional ops write none)."""
    card = library.OPS[name]
    if device.type == "cpu":
        if impl == "triton" and label != next(iter(card.examples())):
            pytest.skip("the interpreter runs the first example of each op only (time)")
        ctx = d.cpu_implementation(impl)
    else:
        if impl == "reference":
            pytest.skip("the reference is the CPU implementation")
        ctx = contextlib.nullcontext()
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in card.examples()[label]]
    with ctx:
        _assert_versions_bumped(card, card.op, args, f"{name} [{label}] {impl}, torch.ops")
        public = _same_arguments_public(name)
        if public is not None:   # functions with other arguments (output_buffers=, out=) are covered by their ops
            fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            _assert_versions_bumped(card, public, fresh, f"{name} [{label}] {impl}, torch_dsv4_ops.{name}")


def test_version_bump_wrapper_positions():
    """The wrapper bumps exactly the (a!)/(b!) positions, once per call, after the implementation ran."""
    seen = []
    run = library._with_version_bump(lambda a, b, c, n=0: seen.append((a._version, c._version)),
                                     "x(Tensor(a!) a, Tensor b, Tensor(b!) c, int n=0) -> ()")
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    run(a, b, c)
    run(a, b, c, 3)
    assert seen == [(0, 0), (1, 1)]
    assert (a._version, b._version, c._version) == (2, 0, 2)
    plain = lambda x: None   # noqa: E731
    assert library._with_version_bump(plain, "x(Tensor x) -> ()") is plain


@pytest.mark.parametrize("schema", ["x(Tensor(a!)? y) -> ()", "x(Tensor y, *, Tensor(a!) z) -> ()",
                                    "x(Tensor(a!)[] y) -> ()"])
def test_version_bump_wrapper_refuses_optional_kwarg_only_and_lists(schema):
    with pytest.raises(NotImplementedError, match="positional, non-optional Tensors"):
        library._with_version_bump(lambda *a: None, schema)


def test_implementations_declare_schema_defaults():
    """The dispatcher calls Python implementations without trailing arguments equal to their
    default: each implementation's default must be the schema's (a missing one is refused at
    registration; a different one would silently change the meaning of the call)."""
    import inspect

    for name, card in library.OPS.items():
        for i, arg in enumerate(card.op._schema.arguments):
            if not arg.has_default_value():
                continue
            for impl in (card.reference, card.kernel, card.fake):
                params = list(inspect.signature(impl).parameters.values())
                assert params[i].default == arg.default_value, f"{name}.{impl.__name__}: {arg.name} default"
    with pytest.raises(TypeError, match="its default"):
        library.register_op("missing_default_probe(Tensor(a!) x, int k=0) -> ()",
                            reference=lambda x, k=0: None, kernel=lambda x, k: None, fake=lambda x, k=0: None)
    assert "missing_default_probe" not in library.OPS and not hasattr(torch.ops.dsv4, "missing_default_probe")


def test_scratch_arguments():
    """`scratch` names mutated arguments the self-check leaves uncompared (workspaces); naming anything else is
    refused before the op is defined."""
    card = library.OPS["flash_mla_with_kvcache_out"]
    assert [card.op._schema.arguments[i].name for i in card.scratch] == ["workspace"]
    assert set(card.scratch) < set(card.mutated)
    with pytest.raises(ValueError, match="scratch arguments"):
        library.register_op("scratch_probe(Tensor(a!) x, Tensor y) -> ()", reference=lambda x, y: None,
                            kernel=lambda x, y: None, fake=lambda x, y: None, scratch=("y",))
    assert "scratch_probe" not in library.OPS and not hasattr(torch.ops.dsv4, "scratch_probe")


def _small_flash_args(device):
    """A small reshape_and_cache_flash call (3 tokens, 2 heads of 16): caches fresh zeros."""
    g = torch.Generator().manual_seed(0)
    key = torch.randn(3, 2, 16, generator=g).to(device)
    return [key, key * 2, torch.zeros(2, 4, 2, 16, device=device), torch.zeros(2, 4, 2, 16, device=device),
            torch.tensor([5, -1, 2], device=device), "auto", torch.ones(1, device=device),
            torch.ones(1, device=device)]


def _expected_caches(args):
    from torch_dsv4_ops.reference import cache as reference

    kc, vc = torch.zeros_like(args[2]).cpu(), torch.zeros_like(args[3]).cpu()
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    reference.reshape_and_cache_flash(cpu[0], cpu[1], kc, vc, *cpu[4:])
    assert kc.count_nonzero() > 0
    return kc, vc


def test_inference_tensors(device):
    """Inference tensors (no version counter) work outside inference mode, mixed with normal
    tensors (whose versions still rise), and inside inference mode."""
    flash = library.OPS["reshape_and_cache_flash"].op
    with torch.inference_mode():
        args = _small_flash_args(device)
    assert all(a.is_inference() for a in args if isinstance(a, torch.Tensor))
    want_k, want_v = _expected_caches(args)
    flash(*args)                                              # outside inference mode: must not raise
    assert torch.equal(args[2].cpu(), want_k) and torch.equal(args[3].cpu(), want_v)

    mixed = _small_flash_args(device)
    with torch.inference_mode():
        mixed[2] = torch.zeros_like(mixed[2])                 # K cache an inference tensor, V cache not
    version = mixed[3]._version
    flash(*mixed)
    assert mixed[3]._version >= version + 1
    assert torch.equal(mixed[2].cpu(), want_k) and torch.equal(mixed[3].cpu(), want_v)

    with torch.inference_mode():
        inside = _small_flash_args(device)
        flash(*inside)
        d.reshape_and_cache_flash(*inside)
    assert torch.equal(inside[2].cpu(), want_k) and torch.equal(inside[3].cpu(), want_v)


def test_inference_tensors_reference():
    """The reference accepts inference tensors outside inference mode, as the kernel does (R6)."""
    with torch.inference_mode():
        args = _small_flash_args("cpu")
    want_k, want_v = _expected_caches(args)
    with d.cpu_implementation("reference"):
        library.OPS["reshape_and_cache_flash"].op(*args)
    assert torch.equal(args[2], want_k) and torch.equal(args[3], want_v)
