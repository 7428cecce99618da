"""The shared harness catches what it is for: untouched bytes, tolerance misses, bad fakes, recompiles."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_dsv4_ops import testing

_LIB = torch.library.Library("dsv4_harness_test", "DEF")
_LIB.define("scale_rows(Tensor x, int n) -> Tensor")
_LIB.impl("scale_rows", lambda x, n: x[:n] * 2, "CPU")
torch.library.register_fake("dsv4_harness_test::scale_rows", lambda x, n: x.new_empty(x.shape), lib=_LIB)  # wrong
_LIB.define("scale_rows_ok(Tensor x, int n) -> Tensor")
_LIB.impl("scale_rows_ok", lambda x, n: (x[:n] * 2).contiguous(), "CPU")
torch.library.register_fake("dsv4_harness_test::scale_rows_ok", lambda x, n: x.new_empty((n,) + x.shape[1:]),
                            lib=_LIB)


def test_poison_fills_every_byte():
    for dtype in (torch.bfloat16, torch.float32, torch.uint8, torch.int64, torch.float8_e4m3fn):
        t = testing.poison_(torch.zeros(5, 3, dtype=dtype))
        assert bool((testing.as_bytes(t) == testing.SENTINEL_BYTE).all()), dtype


def test_changed_mask_and_bitwise_compare_see_single_bits():
    a = torch.randn(4, 8)
    b = a.clone()
    b.view(torch.int32)[2, 5] ^= 1            # one bit of one element
    assert testing.changed_mask(a, b).nonzero().tolist() == [[2, 5]]
    with pytest.raises(AssertionError, match="1 of 32 elements differ"):
        testing.assert_bitwise_equal(b, a)
    testing.assert_bitwise_equal(torch.tensor([-0.0, float("nan")]), torch.tensor([-0.0, float("nan")]))
    with pytest.raises(AssertionError):
        testing.assert_bitwise_equal(torch.tensor([-0.0]), torch.tensor([0.0]))


def test_assert_close_uses_dtype_tolerances():
    e = torch.ones(10, dtype=torch.bfloat16)
    testing.assert_close(e * 1.01, e)          # within bf16's 1.6e-2
    with pytest.raises(AssertionError, match="out of tolerance"):
        testing.assert_close((e * 1.05), e)
    with pytest.raises(AssertionError, match="NaN positions"):
        testing.assert_close(torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0]))


def test_non_contiguous_copies_keep_values():
    t = torch.randn(3, 4, 5)
    for make in (testing.permuted_copy, testing.padded_copy):
        c = make(t)
        assert not c.is_contiguous() and torch.equal(c, t)


def test_run_opcheck_catches_a_wrong_fake():
    x = torch.randn(6, 4)
    testing.run_opcheck(torch.ops.dsv4_harness_test.scale_rows_ok.default, (x, 3))
    with pytest.raises(AssertionError, match="opcheck"):
        testing.run_opcheck(torch.ops.dsv4_harness_test.scale_rows.default, (x, 3))


def test_check_compile_catches_recompiles():
    def fine(x):
        return x * 2

    def specialises(x):
        return x * 2 if x.shape[0] % 2 else x * 3   # a guard on the exact size: recompiles for odd/even

    inputs = [(torch.randn(n, 4),) for n in (3, 4, 7)]
    assert testing.check_compile(fine, inputs, backend="eager") == 1
    with pytest.raises(AssertionError, match="recompiles"):
        testing.check_compile(specialises, inputs, backend="eager")


def test_triton_cache_entries_counts_or_refuses():
    """It counts compiled specialisations over all devices, and refuses (rather than answering 0)
    where it cannot count: a "no new compilation" check must never pass without counting."""
    class Interpreted:
        pass

    with pytest.raises(RuntimeError, match="device_caches"):
        testing.triton_cache_entries(Interpreted())

    class Jitted:
        # Triton's JITFunction.device_caches: device -> (kernel cache, key cache, target, backend, binder)
        device_caches = {0: ({"a": 1, "b": 2}, {}, None, None, None), 1: ({"c": 3}, {"x": 1}, None, None, None),
                         2: ({}, {}, None, None, None)}

    assert testing.triton_cache_entries(Jitted()) == 3
    Jitted.device_caches = {}
    assert testing.triton_cache_entries(Jitted()) == 0


REPO = Path(__file__).resolve().parent.parent


def test_schemas_module_runs_without_expecttest():
    """tests/test_schemas.py collects and runs where expecttest cannot be imported: the inline
    expectations skip, nothing errors (TRITON_INTERPRET as in this process). One run, collection
    included (a collection error exits 2 and prints ERROR)."""
    code = ("import sys; sys.modules['expecttest'] = None; import pytest; "
            "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', '-W', 'ignore', 'tests/test_schemas.py', "
            "'-k', 'registered_schemas or type_mapping']))")
    ran = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ), timeout=300)
    out = ran.stdout + ran.stderr
    assert ran.returncode in (0, 5), out
    assert "error" not in out.lower(), out
    assert "2 skipped" in out and "expecttest is not installed" in out, out


def test_no_stray_files_are_tracked():
    """No editor or patch leftovers (*.bak, *.orig, *.rej, *~) in the repository."""
    if shutil.which("git") is None:
        pytest.skip("git not found")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    names = [n for n in listed.stdout.decode("utf-8", "replace").split("\0") if n]
    assert names, "git ls-files listed nothing"
    # a copy of the working tree with an older index (the GPU machine's) lists files since removed
    stray = [n for n in names if n.endswith((".bak", ".orig", ".rej", "~")) and (REPO / n).exists()]
    assert stray == [], f"stray files are tracked: {stray}"


def test_comparisons_of_empty_tensors():
    for dtype in (torch.bfloat16, torch.uint8, torch.float32):
        a = torch.zeros(3, 0, 4, dtype=dtype)
        testing.assert_bitwise_equal(a, a.clone())
        assert testing.changed_mask(a, a.clone()).shape == (3, 0, 4)
        with pytest.raises(AssertionError, match="shape"):
            testing.assert_bitwise_equal(a, torch.zeros(3, 0, 5, dtype=dtype))
