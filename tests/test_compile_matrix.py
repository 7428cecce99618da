"""The ahead-of-time compile matrix (issue 2): every flash-cache kernel specialisation the ops launch
compiles for every target in `platform.MATRIX_TARGETS`, on this GPU-less machine, and each target
compiles the fp8 path (hardware casts or the software codec) that `platform.native_fp8` promises.

The matrix runs once, in a subprocess without TRITON_INTERPRET (conftest sets it for this process),
through the CLI `python -m torch_dsv4_ops.compile_matrix --scope ci --json`; the tests read its JSON. The CI
scope compiles, on every target, a subset of the flash-cache cases that has every feature these tests check
(`compile_matrix.covering_cases`) plus one case of every other kernel (`compile_matrix.scoped_cases`);
`make compile-matrix` compiles every case on all nine.
"""
import pathlib
import re

import pytest
import torch

import torch_dsv4_ops
from torch_dsv4_ops import compile_matrix, layout, platform
from torch_dsv4_ops.compile_matrix import TARGETS_BY_NAME, error_summary
from torch_dsv4_ops.kernels import _launch, cache as cache_kernels, mqa_logits as mqa_logits_kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "gfx90a", "gfx942", "gfx950")
COPY, FLOAT, BF16, FP8 = cache_kernels.COPY, cache_kernels.FLOAT, cache_kernels.BF16, cache_kernels.FP8
FMT = {f.code: f for f in layout.FP8_FORMATS}
FAMILY = {1: "e4m3", 2: "e4m3", 3: "e5m2"}   # fp8 code -> the hardware conversion family

# The statement of where fp32 <-> fp8 is native (RNE, saturating), per target.
EXPECTED_NATIVE = {
    "sm_80": set(), "sm_86": set(), "gfx90a": set(), "gfx942": {"e4m3fnuz"},
    **{t: {"e4m3fn", "e5m2"} for t in ("sm_89", "sm_90", "sm_100", "sm_120", "gfx950")},
}

# Every codec the flash-cache ops can build, derived by hand from SPEC §3.1 (in_fp8, out_kind, out_fp8,
# scaled): float input -> same float (copy), other float, bf16 bits, or any fp8 (scaled); fp8 input ->
# its own format (copy), a float cache (fp16/fp32: FLOAT, bf16: BF16) or another fp8 format (unscaled).
EXPECTED_CODECS = (
    {(0, COPY, 0, False), (0, FLOAT, 0, False), (0, BF16, 0, False)}
    | {(0, FP8, f, True) for f in FMT}
    | {(g, kind, 0, False) for g in FMT for kind in (COPY, FLOAT, BF16)}
    | {(g, FP8, f, False) for g in FMT for f in FMT if f != g}
)

_ENCODE = {"cuda": re.compile(r"cvt\.rn\.satfinite\.(e4m3|e5m2)x2\.f32$"), "hip": re.compile(r"_(fp8|bf8)_f32$")}
_DECODE = {"cuda": re.compile(r"cvt\.rn\.f16x2\.(e4m3|e5m2)x2$"), "hip": re.compile(r"_f32_(fp8|bf8)(_e32|_sdwa)?$")}
_HIP_FAMILY = {"fp8": "e4m3", "bf8": "e5m2"}


def _backend(target: str) -> str:
    return "cuda" if target.startswith("sm_") else "hip"


@pytest.fixture(scope="module")
def matrix(matrix_run):
    """The CLI's JSON for the whole matrix (all nine targets), plus its exit status and output. The CLI
    runs in a subprocess that conftest starts right after collection (`MatrixRun`)."""
    return matrix_run.result()


CACHE_MODULE = "torch_dsv4_ops.kernels.cache"


def _by_target(matrix, module: str | None = None) -> dict[str, list[dict]]:
    """Results per target, of every kernel module or of `module` only."""
    out = {}
    for r in matrix["results"]:
        if module is None or r["module"] == module:
            out.setdefault(r["target"], []).append(r)
    return out


def _hw_conversions(result) -> set[tuple[str, str]]:
    """{(direction, family)} of the hardware fp8 conversion instructions in a result's assembly."""
    backend, found = _backend(result["target"]), set()
    for ins in result["fp8_instructions"]:
        enc, dec = _ENCODE[backend].search(ins), _DECODE[backend].search(ins)
        assert enc or dec, f"{result['name']} on {result['target']}: unexpected fp8 instruction {ins}"
        family = (enc or dec).group(1)
        found.add(("encode" if enc else "decode", _HIP_FAMILY.get(family, family)))
    return found


def _expected_hw(result) -> set[tuple[str, str]]:
    """The hardware fp8 conversions a result must contain: none where the software codec (SW*) or
    no fp8 at all is used; k_cache insert encodes and gather decodes its format FMT; attention decodes
    its fp8 cache and encodes an fp8 output; sparse MLA decodes each fp8_ds_mla cache it reads; the indexer
    cache insert encodes its format."""
    c = result["constexprs"]
    out = set()
    if result["module"] == "torch_dsv4_ops.kernels.k_cache":
        if not c["SW"]:
            out.add(("encode" if result["name"].startswith("k_cache_insert") else "decode", FAMILY[c["FMT"]]))
        return out
    if result["module"] == "torch_dsv4_ops.kernels.attention":   # fp8 cache codes decoded, fp8 output encoded
        if c.get("KV_FP8") and not c["KV_SW"]:
            out.add(("decode", FAMILY[c["KV_FP8"]]))
        if c.get("O_KIND") == 2 and not c["O_SW"]:
            out.add(("encode", FAMILY[c["O_FP8"]]))
        return out
    if result["module"] == "torch_dsv4_ops.kernels.indexer":   # the insert encodes its format; the gather copies
        if result["name"].startswith("indexer_insert") and not c["SW"]:
            out.add(("encode", FAMILY[c["FMT"]]))
        return out
    if result["module"] == "torch_dsv4_ops.kernels.indexer_q":   # the Q kernel encodes its format; pack/unpack copy
        if result["name"].startswith("indexer_q.") and not c["SW"]:
            out.add(("encode", FAMILY[c["FMT"]]))
        return out
    if result["module"] == "torch_dsv4_ops.kernels.mqa_logits":   # codes decoded only on the 16-bit dot paths
        if c.get("DOT_MODE") in (mqa_logits_kernels.DOT_F16, mqa_logits_kernels.DOT_BF16):
            for fmt, sw in ((c["Q_FMT"], c["Q_SW"]), (c["K_FMT"], c["K_SW"])):
                if not sw:
                    out.add(("decode", FAMILY[fmt]))
        return out
    if result["module"] == "torch_dsv4_ops.kernels.sparse_mla":   # the main and extra caches' codes decoded
        for fmt, sw, used in ((c.get("FMT"), c.get("SW"), True), (c.get("X_FMT"), c.get("X_SW"), c.get("EXTRA"))):
            if fmt and used and not sw:
                out.add(("decode", FAMILY[fmt]))
        return out
    if result["module"] != CACHE_MODULE:
        return out
    if c["OUT_KIND"] == FP8 and not c["SW_OUT"]:
        out.add(("encode", FAMILY[c["OUT_FP8"]]))
    if c["IN_FP8"] and c["OUT_KIND"] != COPY and not c["SW_IN"]:
        out.add(("decode", FAMILY[c["IN_FP8"]]))
    return out


def test_every_case_compiles_on_every_target(matrix):
    by_target = _by_target(matrix)
    assert tuple(by_target) == TARGETS == tuple(TARGETS_BY_NAME)
    failed = [f"{r['target']:<7} {r['name']}: {error_summary(r['error'])}" for r in matrix["results"] if not r["ok"]]
    assert not failed, f"{len(failed)} of {len(matrix['results'])} compiles failed:\n" + "\n".join(failed[:30])
    assert matrix["returncode"] == 0, matrix["stdout"][-3000:]
    for target, results in by_target.items():
        names = [r["name"] for r in results]
        assert len(names) == len(set(names)) >= 50, target
        # >2 GiB caches lose AMD's buffer-op specialisation: a distinct kernel on HIP only
        assert any(n.endswith(".bigcache") for n in names) == (_backend(target) == "hip"), target


@pytest.mark.parametrize("target", TARGETS)
def test_matrix_covers_every_codec_dtype_and_layout(matrix, target):
    results = _by_target(matrix, CACHE_MODULE)[target]
    codecs = {tuple(r["constexprs"][k] for k in ("IN_FP8", "OUT_KIND", "OUT_FP8", "SCALED")) for r in results}
    assert codecs == EXPECTED_CODECS
    assert len(EXPECTED_CODECS) == 21
    sig = [r["signature"] for r in results]
    assert {s["key_ptr"] for s in sig} == {"*bf16", "*fp16", "*fp32", "*u8"}
    assert {s["kc_ptr"] for s in sig} == {"*bf16", "*fp16", "*fp32", "*u8", "*i16"}
    assert {s["slot_ptr"] for s in sig} == {"*i64", "*i32"}
    assert {s["slot_stride"] for s in sig} == {"constexpr", "i32"}
    c = [r["constexprs"] for r in results]
    assert {x["XK"] for x in c} == {1, 4, 8, 16}            # NHD and head-major x for 4-, 2- and 1-byte caches
    assert any(x["DK"] != x["DV"] for x in c)               # diffkv
    assert any(x["H"] == 13 and x["DK"] == 80 for x in c)   # non-power-of-two heads and dims
    assert any(x["BS"] == 544 for x in c)                   # non-power-of-two block size


@pytest.mark.parametrize("target", TARGETS)
def test_software_codec_exactly_where_platform_is_not_native(matrix, target):
    tgt = TARGETS_BY_NAME[target]
    assert {f.name for f in layout.FP8_FORMATS if platform.native_fp8(tgt, f)} == EXPECTED_NATIVE[target]
    for r in _by_target(matrix)[target]:
        c = r["constexprs"]
        if r["module"] != CACHE_MODULE:
            for fmt, sw in (("FMT", "SW"), ("X_FMT", "X_SW")):   # k_cache, sparse_mla: each cache's format
                if c.get(fmt):
                    assert c[sw] == (FMT[c[fmt]].name not in EXPECTED_NATIVE[target]), r["name"]
            if r["ok"]:
                assert _hw_conversions(r) == _expected_hw(r), (r["name"], r["fp8_instructions"])
            continue
        if c["OUT_KIND"] == FP8:
            assert c["SW_OUT"] == (FMT[c["OUT_FP8"]].name not in EXPECTED_NATIVE[target]), r["name"]
        if c["IN_FP8"] and c["OUT_KIND"] != COPY:
            assert c["SW_IN"] == (FMT[c["IN_FP8"]].name not in EXPECTED_NATIVE[target]), r["name"]
        # the assembly holds hardware fp8 conversions exactly where the hardware path was chosen
        if r["ok"]:   # (failures are reported by test_every_case_compiles_on_every_target)
            assert _hw_conversions(r) == _expected_hw(r), (r["name"], r["fp8_instructions"])


def test_both_fp8_paths_are_in_the_matrix(matrix):
    by_target = _by_target(matrix, CACHE_MODULE)

    def paths(target, flag, code_key):
        return {(r["constexprs"][code_key], r["constexprs"][flag]) for r in by_target[target]
                if r["constexprs"]["OUT_KIND"] != COPY and r["constexprs"][code_key]}

    assert paths("sm_80", "SW_OUT", "OUT_FP8") == {(1, True), (2, True), (3, True)}
    assert paths("sm_80", "SW_IN", "IN_FP8") == {(1, True), (2, True), (3, True)}
    assert paths("sm_90", "SW_OUT", "OUT_FP8") == {(1, False), (2, True), (3, False)}
    assert paths("sm_90", "SW_IN", "IN_FP8") == {(1, False), (2, True), (3, False)}
    assert paths("gfx942", "SW_OUT", "OUT_FP8") == {(1, True), (2, False), (3, True)}
    assert paths("gfx90a", "SW_OUT", "OUT_FP8") == {(1, True), (2, True), (3, True)}


def test_sm90_ptx_converts_in_hardware_and_sm80_does_not(matrix):
    results = {(r["target"], r["name"]): r for r in matrix["results"]}
    case = "flash_nhd.bf16-fp8:u8.h8d128.bs16"
    for key in (("sm_90", case), ("sm_80", case), ("sm_90", "flash_nhd.e4m3fn-auto:fp32.h8d128.bs16")):
        assert results[key]["ok"], results[key]["error"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in results["sm_90", case]["fp8_instructions"]
    e5m2_case = "flash_nhd.bf16-fp8_e5m2:u8.h8d128.bs16"
    assert "cvt.rn.satfinite.e5m2x2.f32" in results["sm_90", e5m2_case]["fp8_instructions"]
    assert "cvt.rn.f16x2.e4m3x2" in results["sm_90", "flash_nhd.e4m3fn-auto:fp32.h8d128.bs16"]["fp8_instructions"]
    for target in ("sm_80", "sm_86", "gfx90a"):
        assert not [r["name"] for r in matrix["results"] if r["target"] == target and r["fp8_instructions"]]
    assert results["gfx942", case]["fp8_instructions"] == ["v_cvt_pk_fp8_f32"]   # platform e4m3 is FNUZ there


def test_topk_scatter_stores_keep_the_tiles_layout(matrix):
    """On NVIDIA targets the top-k's scattered stores (`kernels.scatter.scatter`, inline PTX) compile without a layout
    conversion; tl.store of pointers without contiguity converts the tile to one element per thread through shared
    memory (7 conversions in the CI case, 24 barriers in a 16384-key tile)."""
    topk = [r for r in matrix["results"] if r["module"] == "torch_dsv4_ops.kernels.topk"]
    assert {r["target"] for r in topk} == set(TARGETS)
    for r in topk:
        assert r["ok"], r["error"]
        if _backend(r["target"]) == "cuda":
            assert r["layout_conversions"] == 0, (r["target"], r["name"])


def test_hardware_fp8_probe_agrees_with_platform(matrix):
    probes = matrix["fp8_probe"]
    assert len(probes) == len(TARGETS) * 3 * 2
    wrong = [p for p in probes if p["native"] and not p["ok"]]
    assert not wrong, wrong
    failing = {(p["target"], p["format"]) for p in probes if not p["ok"]}
    # Triton has no OCP e4m3 below sm_89 and no FNUZ e4m3 on any NVIDIA GPU: why the software codec exists
    assert failing == {("sm_80", "e4m3fn"), ("sm_86", "e4m3fn")} | {(t, "e4m3fnuz") for t in TARGETS[:6]}
    assert all("not supported" in p["error"] for p in probes if not p["ok"])


# --- the matrix describes what the launcher really passes ----------------------------------------

_LAUNCH_SPECS = [
    ("flash", "nhd", torch.bfloat16, "auto", torch.bfloat16, 8, 128, 128, 16),
    ("flash", "nhd", torch.float16, "auto", torch.bfloat16, 13, 80, 80, 16),
    ("flash", "nhd", torch.float8_e4m3fn, "fp8", torch.float8_e4m3fnuz, 8, 128, 128, 16),
    ("flash", "nhd", torch.float32, "fp8_e5m2", torch.float8_e5m2, 8, 128, 128, 16),
    ("flash", "head_major", torch.bfloat16, "fp8", torch.uint8, 8, 128, 128, 16),
    ("flash", "head_major", torch.bfloat16, "auto", torch.float32, 13, 80, 80, 544),
    ("diffkv", "nhd", torch.float8_e5m2, "auto", torch.bfloat16, 13, 80, 48, 16),
    ("diffkv", "nhd", torch.bfloat16, "fp8", torch.uint8, 8, 192, 128, 64),
    ("diffkv", "nhd", torch.bfloat16, "auto", torch.bfloat16, 8, 128, 0, 16),
]
_LAUNCH_OPTIONS = [{}, {"slot_dtype": torch.int32}, {"slot_stride": 2}, {"aligned": False},
                   {"tokens": cache_kernels.GROUP_MIN_TOKENS}]


def _call_op(device, op, lay, in_dtype, kv_cache_dtype, cache_dtype, h, dk, dv, bs, slot_dtype=torch.int64,
             slot_stride=1, aligned=True, tokens=3):
    """Call the op with real tensors shaped as `cache_kernels.matrix_launch` describes them."""
    nb = 4
    if aligned:
        key, value = (torch.randn(tokens, h, d, device=device).to(in_dtype) for d in (dk, dv))
    else:
        packed = torch.randn(tokens, h * (dk + dv) + 1, device=device).to(in_dtype)
        key = packed[:, 1:1 + h * dk].unflatten(1, (h, dk))
        value = packed[:, 1 + h * dk:].unflatten(1, (h, dv))
    slots = torch.arange(0, tokens * slot_stride, dtype=slot_dtype, device=device)[::slot_stride]
    scale = torch.ones(1, device=device)
    zeros = dict(dtype=cache_dtype, device=device)
    if op == "diffkv":
        torch_dsv4_ops.reshape_and_cache_flash_diffkv(key, value, torch.zeros(nb, bs, h, dk + dv, **zeros), slots,
                                                      kv_cache_dtype, scale, scale)
        return
    if lay == "head_major":
        x = layout.head_major_x(cache_dtype)
        kc, vc = torch.zeros(nb, h, dk // x, bs, x, **zeros), torch.zeros(nb, h, dv, bs, **zeros)
    else:
        kc, vc = torch.zeros(nb, bs, h, dk, **zeros), torch.zeros(nb, bs, h, dv, **zeros)
    torch_dsv4_ops.reshape_and_cache_flash(key, value, kc, vc, slots, kv_cache_dtype, scale, scale)


def _record_launches(monkeypatch) -> list:
    """Make every kernel `Launch` record (runtime args as Triton's public path gets them, meta) and
    run nothing; returns the list the records go to."""
    calls = []
    monkeypatch.setattr(_launch.Launch, "__call__", lambda self, *tensors: calls.append(
        (self.arguments(tensors), {k: v for k, v in self.meta.items() if k != "launch_pdl"})))
    return calls


@pytest.mark.parametrize("options", _LAUNCH_OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("spec", _LAUNCH_SPECS, ids=lambda s: f"{s[0]}-{s[1]}-{s[2]}-{s[3]}-{s[4]}")
def test_matrix_launch_matches_the_launcher(monkeypatch, spec, options):
    """The arguments the op hands to the kernel equal those `matrix_launch` describes (so the matrix
    compiles what really launches): tensor dtypes and alignment, every int, every constexpr."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec[7] == 0 and options:
        pytest.skip("Dv = 0: V is an empty slice; only the plain layout is modelled")
    if device.type == "cpu" and not platform.INTERPRET:
        pytest.skip("the CPU ops run the Triton launcher only under TRITON_INTERPRET=1")
    calls = _record_launches(monkeypatch)
    _call_op(device, *spec, **options)
    assert len(calls) == 1
    runtime, meta = calls[0]
    name, tensors, ints, expected_meta = cache_kernels.matrix_launch(platform.target_for(device), *spec, **options)
    n = len(tensors)
    assert [t.dtype for t in runtime[:n]] == [p.dtype for p in tensors], name
    assert [t.data_ptr() % 16 == 0 for t in runtime[:n]] == [p.aligned for p in tensors], name
    assert tuple(runtime[n:]) == tuple(ints), name
    assert meta == expected_meta, name


SPARSE_MLA = "torch_dsv4_ops.kernels.sparse_mla"


def test_shared_memory_limits_of_the_targets():
    limits = {name: platform.shared_memory_limit(t) for name, t in TARGETS_BY_NAME.items()}
    assert limits == {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90": 232448, "sm_100": 232448,
                      "sm_120": 101376, "gfx90a": 65536, "gfx942": 65536, "gfx950": 163840}
    assert platform.shared_memory_limit(platform.INTERPRETER_TARGET) > limits["sm_90"]


@pytest.mark.parametrize("shared,ok", [(65536, True), (65537, False)])
def test_a_case_over_its_targets_shared_memory_fails(monkeypatch, shared, ok):
    """A case that compiles but needs more shared memory than its target has is a failed case."""
    class Compiled:
        metadata = type("Metadata", (), {"shared": shared})()
        asm = {}

    case = type("Case", (), {"num_warps": 8, "signature": {}, "constexprs": {}})()
    monkeypatch.setattr(compile_matrix, "module_cases", lambda module, target: {"case": case})
    monkeypatch.setattr(compile_matrix, "compile_case", lambda case, target: Compiled())
    result = compile_matrix.run_case(SPARSE_MLA, "gfx942", "case")
    assert (result.ok, result.shared) == (ok, shared)
    assert ("65536" in result.error) == (not ok)
