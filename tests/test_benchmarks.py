"""The benchmark runner keeps working: a CPU smoke run (`--quick --device cpu`) writes the JSON it promises."""
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

HEADER_KEYS = ("family", "device", "device_type", "torch", "triton", "date", "quick", "methods", "copy_ceiling",
               "cases", "host_overhead", "targets", "all_targets_pass", "errors")
CASE_KEYS = ("name", "series", "params", "method", "bytes", "nsets", "us", "gbps", "pct_of_copy", "check")
TARGETS = ("bf16_T65536_pct_of_copy", "fp8_T65536_pct_of_copy", "graph_us_per_call_T_le_64_cold",
           "graph_us_per_call_T_le_64_decode_step",
           "eager_host_overhead_ratio_T1_bf16", "eager_host_overhead_ratio_T1_fp8")


def test_quick_cpu_run_writes_json(tmp_path):
    # The CPU run times the reference implementation: keep the conftest's interpreter switch out of it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--device", "cpu", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "==== summary: cache" in proc.stdout

    doc = json.loads((tmp_path / "bench_cache.json").read_text())
    for key in HEADER_KEYS:
        assert key in doc, key
    assert doc["family"] == "cache" and doc["device"] == "cpu" and doc["errors"] == []
    assert doc["copy_ceiling"]["gbps"] > 0
    assert len(doc["cases"]) >= 6
    for case in doc["cases"]:
        assert "error" not in case, case
        for key in CASE_KEYS:
            assert key in case, (case["name"], key)
        assert case["method"] == "wall" and case["us"] > 0 and case["gbps"] > 0 and case["bytes"] > 0
        assert case["check"] == "ok", case
    assert {c["params"]["layout"] for c in doc["cases"]} == {"nhd", "head_major", "diffkv", "kv"}

    host = doc["host_overhead"]
    assert host["errors"] == {}
    assert {"x.add_(1)", "public reshape_and_cache_flash (bf16)", "public reshape_and_cache_flash (fp8)",
            "no-op op, same schema (dispatcher only)"} <= set(host["us_per_call"])
    assert host["ratio_to_add"]["bf16"]["median"] > 0 and host["ratio_to_add"]["fp8"]["median"] > 0

    assert set(TARGETS) <= set(doc["targets"])
    assert all(t["pass"] is None for t in doc["targets"].values())   # targets are judged on a GPU only
    assert doc["all_targets_pass"] is None
    assert "targets: 8 not judged (no GPU" in proc.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert doc["plot"] == "bench_cache.png" and (tmp_path / "bench_cache.png").stat().st_size > 0


def test_topk_phase_probe_matches_kernel():
    """benchmarks/probe_topk_phases.py stamps a copy of kernels/topk.py at text anchors: they still match (one
    clock read per phase boundary and one store per phase), and the stamped copy is valid Python."""
    import ast

    from benchmarks import probe_topk_phases

    src = probe_topk_phases.stamped_source()
    ast.parse(src)
    one_tile = src[src.index("def _one_tile("):src.index("def _tiles_histogram(")]
    assert one_tile.count("= _clock(") == probe_topk_phases.STAMPS + 1
    assert one_tile.count("_stamp(out_row") == probe_topk_phases.STAMPS


def test_git_revision_marks_a_dirty_tree(tmp_path):
    """The JSON's `git` field names the commit, and says so where the tracked files differ from it."""
    from benchmarks import harness
    if shutil.which("git") is None:
        pytest.skip("no git")

    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    rev = git("rev-parse", "--short", "HEAD")
    assert harness._git_revision(str(tmp_path)) == rev
    (tmp_path / "untracked.txt").write_text("x")
    assert harness._git_revision(str(tmp_path)) == rev
    (tmp_path / "a.txt").write_text("two")
    assert harness._git_revision(str(tmp_path)) == rev + "+dirty"


def test_ab_variants_loads_a_module_copy(tmp_path):
    """benchmarks/ab_variants.py: LABEL=PATH:NAME=VALUE parses, and the copy is a module of its own inside the
    package (its relative imports resolve) with the constants set, the original module untouched."""
    from benchmarks import ab_variants
    from torch_dsv4_ops import platform
    from torch_dsv4_ops.kernels import topk

    label, path, consts = ab_variants.parse("cap=torch_dsv4_ops/kernels/topk.py:REG_CAP=80,MAX_HALVINGS=1")
    assert (label, path, consts) == ("cap", "torch_dsv4_ops/kernels/topk.py", {"REG_CAP": 80, "MAX_HALVINGS": 1})
    module = ab_variants.load_variant(0, path, consts, str(tmp_path))
    assert module is not topk and module.REG_CAP == {"cuda": 80} and module.MAX_HALVINGS == 1
    assert topk.REG_CAP != {"cuda": 80} and topk.MAX_HALVINGS == 2
    cuda = next(t for t in platform.MATRIX_TARGETS if t.backend == "cuda")
    assert module.constexprs(topk.MODE_PREFILL, 8192, 512, cuda)["HALVINGS"] == 1


def test_ab_variants_families_name_what_they_swap(tmp_path):
    """Each ab_variants family names an attribute of its op module that holds the kernel module a variant replaces,
    and plan caches that exist; a copy of the sparse MLA Gluon module loads as a module of its own."""
    from benchmarks import ab_variants
    from torch_dsv4_ops.kernels import sparse_mla_gluon
    from torch_dsv4_ops.ops._plans import PlanCache

    for ops, attribute, plans, _ in ab_variants.FAMILIES.values():
        assert getattr(ops, attribute).__name__.startswith("torch_dsv4_ops.kernels.")
        assert all(isinstance(getattr(ops, name), PlanCache) for name in plans)
    ops, attribute, _, _ = ab_variants.FAMILIES["sparse_mla"]
    assert getattr(ops, attribute) is sparse_mla_gluon
    module = ab_variants.load_variant(1, "torch_dsv4_ops/kernels/sparse_mla_gluon.py", {}, str(tmp_path))
    assert module is not sparse_mla_gluon and module.DECODE_SHARED_MEMORY == sparse_mla_gluon.DECODE_SHARED_MEMORY


def test_sm_rate_probe_configs_make_decode_plans():
    """benchmarks/probe_sm_rates.py's config strings give the tile dicts the decode plan takes (so the GPU-only probe
    keeps working as the plan's keys change)."""
    import torch

    from benchmarks import probe_sm_rates
    from torch_dsv4_ops import platform
    from torch_dsv4_ops.kernels import attention as kernels

    target = platform.target_for(torch.device("cpu"))
    geo = kernels.Geometry(hq=32, hkv=8, d=128, bs=16, x=8, k_std=True, v_align=16)
    numerics = kernels.make_numerics(torch.bfloat16, None, torch.bfloat16, target)
    block_h = kernels.decode_tiles(geo, torch.bfloat16, False, target)["BLOCK_H"]
    assert probe_sm_rates.decode_tiles("default", geo, target, block_h) is None
    chunks = probe_sm_rates.decode_tiles("16:1:3:11:c", geo, target, block_h)
    assert chunks["loop"] == kernels.LOOP_TABLE_CHUNKS and chunks["at_most"] and chunks["num_warps"] == 1
    assert chunks["chunk"] == kernels.table_chunk(16, 16, target)
    pipeline = probe_sm_rates.decode_tiles("64:2:2:4:p", geo, target, block_h)
    assert pipeline["loop"] == kernels.LOOP_PIPELINE and pipeline["BLOCK_H"] == 16
    for tiles in (chunks, pipeline):
        meta = kernels.decode_constexprs(geo, kernels.Features(), numerics, tiles, 3)
        assert meta["BLOCK_N"] == tiles["BLOCK_N"] and meta["LOOP"] == tiles["loop"] and meta["SPLIT"]


def test_register_probe_counts_programs_per_sm():
    """benchmarks/probe_registers.py: the programs an SM holds, against what ncu reported on an H200 (the head-major
    fp8 write: 2 warps, 168 registers, 4 KB of shared memory -> 6 programs by registers), and the command's report
    of one case (in a process without TRITON_INTERPRET, which the compiles need)."""
    from benchmarks import probe_registers

    assert probe_registers.programs_per_sm(2, 168, 4096, 90) == 6
    assert probe_registers.programs_per_sm(1, 249, 16576, 90) == 8
    assert probe_registers.programs_per_sm(8, 64, 200 * 1024, 90) == 1        # shared memory bound
    assert probe_registers.programs_per_sm(1, 32, 0, 90) == 32                 # the program limit
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.probe_registers", "--filter", "^gather_lens.len32$"],
                         cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    line, = out.splitlines()
    registers = int(line.split("regs")[1].split()[0])
    assert line.startswith("gather_lens.len32") and registers > 0 and "programs/SM" in line, out


def test_attention_parts_probe_fits_its_line():
    """benchmarks/probe_attention_parts.py: the least-squares line through (keys, us) points gives back the fixed
    cost and the per-key time of points on a line, and the cases it times build on the CPU."""
    import torch

    from benchmarks import bench_attention, probe_attention_parts

    intercept, slope = probe_attention_parts.fit([(16384, 10.0 + 16384e-3), (32768, 10.0 + 32768e-3),
                                                  (65536, 10.0 + 65536e-3)])
    assert abs(intercept - 10.0) < 1e-9 and abs(slope - 1e-3) < 1e-12
    assert probe_attention_parts.FIT_FROM in probe_attention_parts.LONG_CONTEXTS
    spec = bench_attention.Spec(1, min(probe_attention_parts.LONG_CONTEXTS), True)
    assert bench_attention.build(spec, torch.device("cpu")).check() == "ok"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_attention_parts_probe_launches_the_ops_kernels(fp8):
    """benchmarks/probe_attention_parts.py times the op's decode and combine launches alone: run one after the other
    they write what the op's kernel path writes (a split plan: two parts at this size on 4 interpreter SMs)."""
    import torch

    from benchmarks import probe_attention_parts as probe
    from torch_dsv4_ops.ops import attention as ops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sets, _, decode, combine = probe.plan_launches(probe.bench.Spec(1, 300, fp8), device)
    assert combine is not None
    output = sets[1][3]
    ops._chunked_kernel(*sets[1])
    expected = output.clone()
    output.fill_(float("nan"))
    decode.run(1)
    combine.run(1)
    assert torch.equal(output, expected)
    ops._CHUNKED_PLANS.clear()


def test_attention_parts_probe_read_kernel_sums_each_part():
    """The probe's one-wave read: program p sums its contiguous part of per_program elements."""
    import torch

    from benchmarks import probe_attention_parts as probe

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.rand(6 * 3 * 64, device=device)
    out = torch.empty(6, device=device)
    probe._read_parts_kernel[(6,)](x, out, 3 * 64, BLOCK=64)
    torch.testing.assert_close(out, x.view(6, -1).sum(1))


@pytest.mark.parametrize("table", [0, 1, 2])
@pytest.mark.parametrize("step", [1, 2])
def test_attention_parts_probe_paged_read_sums_its_pages(table, step):
    """The probe's paged read: program p sums its pages, in place (table 0) or as the page table names them (1, 2)."""
    import torch

    from benchmarks import probe_attention_parts as probe

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    programs, per_program, page = 3, 4, 32
    x = torch.rand(programs * per_program * page, device=device)
    ids = torch.randperm(programs * per_program, device=device, dtype=torch.int32)
    out = torch.empty(programs, device=device)
    probe._read_pages_kernel[(programs,)](x, ids, out, per_program, PAGE=page, STEP=step, TABLE=table)
    owned = ids.view(programs, per_program).long() if table else torch.arange(programs * per_program,
                                                                               device=device).view(programs, -1)
    torch.testing.assert_close(out, x.view(-1, page)[owned].sum((1, 2)))


def test_attention_parts_probe_register_cap_is_fp8_only():
    """`--maxnreg` caps the fp8-cache decode's registers (Triton's maxnreg option in its launch meta), not others."""
    import torch

    from benchmarks import probe_attention_parts as probe
    from torch_dsv4_ops import layout, platform
    from torch_dsv4_ops.kernels import attention as kernels

    target = platform.target_for(torch.device("cpu"))
    capped = probe.fp8_register_cap(168)
    for kv_fmt, expect in ((layout.E4M3FN, 168), (None, None)):
        geo = kernels.Geometry(32, 8, 128, 16, 8 if kv_fmt is None else 16, True)
        numerics = kernels.make_numerics(torch.bfloat16, kv_fmt, torch.bfloat16, target)
        tiles = kernels.decode_tiles(geo, torch.bfloat16, kv_fmt is not None, target)
        assert capped(geo, kernels.Features(), numerics, tiles, 2).get("maxnreg") == expect
