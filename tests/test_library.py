"""Package-level contracts: every op is registered, exported and sync-free."""
import pytest
import torch

import torch_dsv4_ops as d
from torch_dsv4_ops import library
from torch_dsv4_ops.testing import sync_debug_error


def test_every_card_is_complete_and_exported():
    assert library.OPS, "no ops registered"
    for name, card in library.OPS.items():
        assert getattr(torch.ops.dsv4, name).default is card.op
        assert card.examples is not None and card.examples(), f"{name} has no self-check examples"
        assert hasattr(d, name) and callable(getattr(d, name)), f"{name} is not exported at top level"
        assert getattr(d, name).__doc__, f"{name} has no docstring"


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
            with sync_debug_error():
                card.op(*dev_args)
                getattr(d, name)(*dev_args)
            torch.cuda.synchronize()
