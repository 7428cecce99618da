"""DSV4_TEST_SHARD (tests/conftest.py, `testing.shard_members`), with which scripts/gpu_suite.sh runs a test file in
parallel processes: the shards partition the tests, and each holds its share of the kernel tests (the reference
tests, which skip on a GPU, are dealt out apart from them)."""
import pytest

from torch_dsv4_ops.testing import shard_members


@pytest.mark.parametrize("shards", [2, 3, 8])
def test_shards_partition_the_tests_and_share_the_kernel_tests(shards):
    # as the attention file collects: each case's reference test, then its kernel test, then a host test
    ids = [f"test_{name}[cpu-case{i}-{impl}]" for name in "abc" for i in range(5) for impl in ("reference", "kernel")]
    ids += [f"test_plan[{i}]" for i in range(7)]
    members = [shard_members(ids, k, shards) for k in range(shards)]
    assert all(sum(column) == 1 for column in zip(*members))          # every test in exactly one shard
    run = [sum(m and "reference" not in t for m, t in zip(row, ids)) for row in members]
    assert max(run) - min(run) <= 1, run
    skipped = [sum(m and "reference" in t for m, t in zip(row, ids)) for row in members]
    assert max(skipped) - min(skipped) <= 1, skipped
