"""The `dsv4::` schemas, and csrc_stubs/ kept identical to the Python registry.

Update the inline expectations after an intended schema change with
`EXPECTTEST_ACCEPT=1 python -m pytest tests/test_schemas.py`, and csrc_stubs/ with
`python -m torch_dsv4_ops.stubs`.
"""
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from torch_dsv4_ops import OPS, stubs
from torch_dsv4_ops.library import NAMESPACE

try:
    import expecttest
    _TestCase = expecttest.TestCase
except ImportError:   # only the inline expectations need expecttest; every other check runs without it
    expecttest = None

    class _TestCase(unittest.TestCase):
        def assertExpectedInline(self, actual, expect, skip=0):
            self.skipTest("expecttest is not installed (pip install expecttest)")

HEADER = stubs.STUB_DIR / stubs.HEADER
SOURCE = stubs.STUB_DIR / stubs.SOURCE

# Every schema type the generator maps (the compile test checks each mapping is valid C++).
ALL_TYPES = (
    "all_types(Tensor a, Tensor(a!) b, Tensor(b) c, Tensor? d, Tensor[] e, Tensor(c!)[] f, Tensor?[] g, "
    "int h, SymInt i, float j, bool k, str l, Scalar m, ScalarType n, Layout o, MemoryFormat p, Device q, "
    "int[] r, int[2] s, SymInt[] t, float[] u, bool[3] v, int? w=None, str? x=\"mean\", Generator? y=None, "
    "*, float z=1.5, Tensor(d!) out) -> (Tensor(d!), Tensor[], SymInt, float, str, Tensor?)"
)


def _defined_schemas() -> dict[str, str]:
    """Op name -> the schema string of each `m.def("...")` in dsv4_ops_schema.cpp."""
    literals = re.findall(r'm\.def\(("(?:[^"\\]|\\.)*")\);', SOURCE.read_text())
    schemas = [json.loads(lit) for lit in literals]
    return {s.split("(", 1)[0]: s for s in schemas}


def _declared_params(header: str) -> dict[str, dict[str, str]]:
    """Function name -> {parameter name: C++ type} of each function in the header."""
    decls = {}
    for name, params in re.findall(r"^inline [^\n]* (\w+)\((.*?)\) \{$", header, re.M | re.S):
        parsed = {}
        for line in params.splitlines():
            line = re.sub(r"/\*.*?\*/", "", line).strip().rstrip(",").strip()
            if line:
                cpp_type, param = line.rsplit(" ", 1)
                parsed[param] = cpp_type
        decls[name] = parsed
    return decls


class TestSchemas(_TestCase):
    def test_registered_schemas(self):
        schemas = "\n".join(sorted(str(card.op._schema) for card in OPS.values()))
        self.assertExpectedInline(schemas, """\
dsv4::build_c128a_topk_metadata(Tensor positions, int compress_ratio, SymInt num_decode_tokens, Tensor token_to_req_indices, Tensor block_table, int block_size, Tensor slot_mapping, Tensor(a!) global_decode_buffer, Tensor(b!) decode_lens_buffer, Tensor(c!) prefill_buffer, int max_compressed_tokens=8192) -> ()
dsv4::build_flashinfer_mixed_sparse_indices(Tensor decode_swa_indices, Tensor? decode_compressed_indices, Tensor? decode_compressed_topk_lens, Tensor prefill_topk_indices, Tensor query_start_loc, Tensor seq_lens, Tensor token_to_req_indices, Tensor swa_block_table, int swa_block_size, Tensor? compressed_block_table, int compressed_block_size, int window_size, int compress_ratio, int topk, bool decode_compressed_indices_are_local=False, Tensor? decode_is_valid_token=None, int? swa_block_span=None, int? compressed_block_span=None) -> (Tensor, Tensor)
dsv4::build_flashinfer_mixed_sparse_indices_out(Tensor decode_swa_indices, Tensor? decode_compressed_indices, Tensor? decode_compressed_topk_lens, Tensor prefill_topk_indices, Tensor query_start_loc, Tensor seq_lens, Tensor token_to_req_indices, Tensor swa_block_table, int swa_block_size, Tensor? compressed_block_table, int compressed_block_size, int window_size, int compress_ratio, int topk, bool decode_compressed_indices_are_local, Tensor? decode_is_valid_token, int? swa_block_span, int? compressed_block_span, Tensor(a!) out_indices, Tensor(b!) out_lens) -> ()
dsv4::chunked_prefill_paged_decode(Tensor query, Tensor? key, Tensor? value, Tensor(a!) output, str kv_cache_dtype, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor query_start_loc, Tensor seq_lens, SymInt? max_seq_len, SymInt max_query_len, Tensor k_scale, Tensor v_scale, Tensor? alibi_slopes=None, int? sliding_window=None, float? sm_scale=None, Tensor? output_scale=None, Tensor? sinks=None, bool is_block_table_ptr=False, bool causal=True) -> ()
dsv4::combine_topk_swa_indices(Tensor topk_indices, Tensor query_start_loc, Tensor seq_lens, Tensor gather_lens, int window_size, int compress_ratio, int topk, SymInt M, SymInt N) -> (Tensor, Tensor)
dsv4::combine_topk_swa_indices_out(Tensor topk_indices, Tensor query_start_loc, Tensor seq_lens, Tensor gather_lens, int window_size, int compress_ratio, int topk, SymInt M, SymInt N, Tensor(a!) out_indices, Tensor(b!) out_lens) -> ()
dsv4::compute_dspark_noncausal_swa_indices_and_lens(Tensor(a!) swa_indices, Tensor(b!) swa_lens, int window_size, Tensor query_start_loc, Tensor seq_lens, Tensor token_to_req_indices, Tensor is_valid_token, Tensor block_table, int block_size, SymInt token_offset=0) -> ()
dsv4::compute_global_topk_indices_and_lens(Tensor topk_indices, Tensor token_to_req_indices, Tensor block_table, int block_size, Tensor is_valid_token) -> (Tensor, Tensor)
dsv4::compute_global_topk_indices_and_lens_out(Tensor topk_indices, Tensor token_to_req_indices, Tensor block_table, int block_size, Tensor is_valid_token, Tensor(a!) global_out, Tensor(b!) lens_out) -> ()
dsv4::compute_prefill_gather_lens(Tensor seq_lens, Tensor query_start_loc, SymInt num_decodes, SymInt num_prefills, int window_size) -> Tensor
dsv4::compute_prefill_gather_lens_out(Tensor seq_lens, Tensor query_start_loc, SymInt num_decodes, SymInt num_prefills, int window_size, Tensor(a!) out) -> ()
dsv4::compute_swa_indices_and_lens(Tensor(a!) swa_indices, Tensor(b!) swa_lens, int window_size, Tensor query_start_loc, Tensor seq_lens, Tensor token_to_req_indices, Tensor is_valid_token, Tensor block_table, int block_size, SymInt token_offset=0) -> ()
dsv4::context_attention_fwd(Tensor q, Tensor? k, Tensor? v, Tensor(a!) o, str kv_cache_dtype, Tensor k_cache, Tensor v_cache, Tensor b_loc, Tensor b_start_loc, Tensor b_seq_len, SymInt? max_seq_len, SymInt max_input_len, Tensor k_scale, Tensor v_scale, Tensor? alibi_slopes=None, int? sliding_window=None, float? sm_scale=None, bool skip_decode=False, Tensor? fp8_out_scale=None, Tensor? sinks=None, bool is_block_table_ptr=False, bool causal=True) -> ()
dsv4::cp_gather_indexer_k_quant_cache(Tensor kv_cache, Tensor(a!) dst_k, Tensor(b!) dst_scale, Tensor block_table, Tensor cu_seq_lens) -> ()
dsv4::dequantize_and_gather_k_cache(Tensor(a!) out, Tensor k_cache, Tensor seq_lens, Tensor? gather_lens, Tensor block_table, int block_size, int offset, bool use_fnuz=False) -> ()
dsv4::fill_prefill_chunk_metadata(Tensor query_start_loc, Tensor uncompressed_seq_lens, Tensor compressed_seq_lens, SymInt start_idx, SymInt end_idx, SymInt query_start, SymInt query_end, int compress_ratio, int dcp_rank, int dcp_world_size, int cp_kv_cache_interleave_size, Tensor(a!) cu_seq_lens, Tensor(b!) cu_seqlen_ks, Tensor(c!) cu_seqlen_ke, Tensor(d!) token_to_seq) -> ()
dsv4::fill_short_context_topk_indices(Tensor(a!) topk_indices, Tensor positions, int topk, int compress_ratio) -> ()
dsv4::flash_mla_sparse_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, Tensor? attn_sink=None, Tensor? topk_length=None) -> (Tensor, Tensor, Tensor)
dsv4::flash_mla_sparse_fwd_out(Tensor q, Tensor kv, Tensor indices, float sm_scale, Tensor(a!) out, Tensor(b!) max_logits, Tensor(c!) lse, Tensor? attn_sink=None, Tensor? topk_length=None) -> ()
dsv4::flash_mla_with_kvcache(Tensor q, Tensor k_cache, Tensor indices, Tensor? topk_length, Tensor? attn_sink, Tensor? extra_k_cache, Tensor? extra_indices, Tensor? extra_topk_length, float softmax_scale, bool use_fnuz=False, bool extra_use_fnuz=False) -> (Tensor, Tensor)
dsv4::flash_mla_with_kvcache_out(Tensor q, Tensor k_cache, Tensor indices, Tensor? topk_length, Tensor? attn_sink, Tensor? extra_k_cache, Tensor? extra_indices, Tensor? extra_topk_length, float softmax_scale, Tensor(a!) out, Tensor(b!) lse, Tensor(c!) workspace, bool use_fnuz=False, bool extra_use_fnuz=False) -> ()
dsv4::fp8_fp4_mqa_logits(Tensor q, Tensor k, Tensor k_scale, Tensor weights, Tensor cu_seqlen_ks, Tensor cu_seqlen_ke, bool clean_logits, bool use_fnuz=False) -> Tensor
dsv4::fp8_fp4_mqa_logits_out(Tensor q, Tensor k, Tensor k_scale, Tensor weights, Tensor cu_seqlen_ks, Tensor cu_seqlen_ke, bool clean_logits, Tensor(a!) out, bool use_fnuz=False) -> ()
dsv4::fp8_fp4_paged_mqa_logits(Tensor q, Tensor kv_cache, Tensor weights, Tensor context_lens, Tensor block_tables, SymInt max_model_len, bool clean_logits, bool use_fnuz=False) -> Tensor
dsv4::fp8_fp4_paged_mqa_logits_out(Tensor q, Tensor kv_cache, Tensor weights, Tensor context_lens, Tensor block_tables, SymInt max_model_len, bool clean_logits, Tensor(a!) out, bool use_fnuz=False) -> ()
dsv4::fused_indexer_q_rope_quant(Tensor positions, Tensor index_q, Tensor cos_sin_cache, Tensor index_weights, float softmax_scale, float head_scale, bool use_fp4=False) -> (Tensor, Tensor)
dsv4::fused_indexer_q_rope_quant_out(Tensor positions, Tensor index_q, Tensor cos_sin_cache, Tensor index_weights, float softmax_scale, float head_scale, Tensor(a!) q_fp8, Tensor(b!) weights_out, bool use_fp4=False) -> ()
dsv4::get_compressed_slot_mapping(SymInt num_tokens, Tensor query_start_loc, Tensor seq_lens, Tensor block_table, int block_size, int compress_ratio) -> Tensor
dsv4::get_compressed_slot_mapping_out(SymInt num_tokens, Tensor query_start_loc, Tensor seq_lens, Tensor block_table, int block_size, int compress_ratio, Tensor(a!) out) -> ()
dsv4::get_paged_mqa_logits_metadata(Tensor context_lens, SymInt block_size, SymInt num_sms) -> Tensor
dsv4::get_paged_mqa_logits_metadata_out(Tensor context_lens, SymInt block_size, SymInt num_sms, Tensor(a!) out) -> ()
dsv4::indexer_k_quant_and_cache(Tensor k, Tensor(a!) kv_cache, Tensor slot_mapping, int quant_block_size, str scale_fmt, bool use_fnuz=False) -> ()
dsv4::pack_seq_triton(Tensor x, Tensor lengths, Scalar pad_value, SymInt max_len) -> Tensor
dsv4::pack_seq_triton_out(Tensor x, Tensor lengths, Scalar pad_value, SymInt max_len, Tensor(a!) out) -> ()
dsv4::prepare_native_decode(Tensor query_start_loc, Tensor seq_lens, Tensor(a!) decode_lens, Tensor(b!) decode_seq_lens, SymInt num_decodes, SymInt max_decode_len, int compress_ratio) -> ()
dsv4::prepare_swa_decode(Tensor(a!) swa_indices, Tensor(b!) swa_lens, Tensor(c!) token_to_req_indices, Tensor(d!) is_valid_token, int window_size, Tensor query_start_loc, Tensor seq_lens, Tensor slot_mapping, Tensor block_table, int block_size, SymInt num_decode_tokens, bool noncausal=False) -> ()
dsv4::prepare_token_metadata(Tensor query_start_loc, Tensor slot_mapping, Tensor(a!) token_to_req_indices, Tensor(b!) is_valid_token) -> ()
dsv4::prepare_uniform_decode(Tensor seq_lens, Tensor(a!) decode_seq_lens, Tensor block_table, Tensor(b!) expanded_block_table, Tensor(c!) decode_lens, SymInt max_decode_len, SymInt num_decode_tokens) -> ()
dsv4::prepare_varlen_decode(Tensor query_start_loc, Tensor seq_lens, Tensor block_table, Tensor(a!) decode_seq_lens, Tensor(b!) expanded_block_table, Tensor(c!) decode_lens, Tensor(d!) decode_indices, SymInt num_decodes, SymInt num_decode_tokens) -> ()
dsv4::quantize_and_insert_k_cache(Tensor k, Tensor(a!) k_cache, Tensor slot_mapping, int block_size=64, bool is_ue8m0=True, bool use_fnuz=False) -> ()
dsv4::reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()
dsv4::reshape_and_cache_flash_diffkv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()
dsv4::reshape_and_cache_flash_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale, int kv_dim=0) -> ()
dsv4::top_k_per_row_decode(Tensor logits, int next_n, Tensor seq_lens, Tensor(a!) topk_indices, SymInt num_rows, SymInt stride0, SymInt stride1, int topk) -> ()
dsv4::top_k_per_row_prefill(Tensor logits, Tensor cu_seqlen_ks, Tensor cu_seqlen_ke, Tensor(a!) topk_indices, SymInt num_rows, SymInt stride0, SymInt stride1, int topk) -> ()
dsv4::unpack_seq_triton(Tensor x, Tensor lengths, SymInt total) -> Tensor
dsv4::unpack_seq_triton_out(Tensor x, Tensor lengths, SymInt total, Tensor(a!) out) -> ()""")

    def test_stubs_are_current(self):
        diff = stubs.check()
        self.assertEqual(diff, "", f"csrc_stubs/ is stale; run `python -m torch_dsv4_ops.stubs`:\n{diff}")

    def test_check_cli(self):
        with tempfile.TemporaryDirectory() as tmp:
            stale = Path(tmp)
            self.assertNotEqual(stubs.check(stale), "")
            stubs.write(stale)
            self.assertEqual(stubs.check(stale), "")
        self.assertEqual(stubs.main(["--check"]), 0)

    def test_cpp_defs_equal_registry(self):
        defined = _defined_schemas()
        self.assertEqual(set(defined), set(OPS))
        for name, schema in defined.items():
            parsed = torch._C.parse_schema(schema if "::" in schema.split("(", 1)[0] else f"{NAMESPACE}::{schema}")
            self.assertEqual(str(parsed), str(OPS[name].op._schema))
            self.assertEqual(parsed, OPS[name].op._schema)

    def test_mutated_args_are_mutable_in_header(self):
        """Mutated Tensors are `at::Tensor&`; mutated lists/optionals follow ATen (the handle is not reseated)."""
        expected = {"TensorType": "at::Tensor&", "ListType": "at::TensorList",
                    "OptionalType": "const std::optional<at::Tensor>&"}
        declared = _declared_params(HEADER.read_text())
        self.assertEqual(set(declared), set(OPS))
        for name, card in OPS.items():
            schema = card.op._schema
            self.assertEqual(list(declared[name]), [a.name for a in schema.arguments], name)
            for arg in schema.arguments:
                if arg.alias_info is not None and arg.alias_info.is_write:
                    self.assertEqual(declared[name][arg.name], expected[arg.real_type.kind()], f"{name}.{arg.name}")
                else:
                    self.assertNotEqual(declared[name][arg.name], "at::Tensor&", f"{name}.{arg.name}")

    def test_type_mapping(self):
        self.assertExpectedInline(stubs.declaration(ALL_TYPES), """\
// dsv4::all_types(Tensor a, Tensor(a!) b, Tensor(b) c, Tensor? d, Tensor[] e, Tensor(c!)[] f, Tensor?[] g, int h, SymInt i, float j, bool k, str l, Scalar m, ScalarType n, Layout o, MemoryFormat p, Device q, int[] r, int[2] s, SymInt[] t, float[] u, bool[3] v, int? w=None, str? x="mean", Generator? y=None, *, float z=1.5, Tensor(d!) out) -> (Tensor(d!), Tensor[], SymInt, float, str, Tensor?)
inline std::tuple<at::Tensor, std::vector<at::Tensor>, c10::SymInt, double, std::string, std::optional<at::Tensor>> all_types(
    const at::Tensor& a,
    at::Tensor& b,
    const at::Tensor& c,
    const std::optional<at::Tensor>& d,
    at::TensorList e,
    at::TensorList f,
    const c10::List<std::optional<at::Tensor>>& g,
    int64_t h,
    c10::SymInt i,
    double j,
    bool k,
    c10::string_view l,
    const at::Scalar& m,
    at::ScalarType n,
    at::Layout o,
    at::MemoryFormat p,
    at::Device q,
    at::IntArrayRef r,
    at::IntArrayRef s,
    c10::SymIntArrayRef t,
    at::ArrayRef<double> u,
    std::array<bool, 3> v,
    std::optional<int64_t> w /* = None */,
    std::optional<c10::string_view> x /* = "mean" */,
    std::optional<at::Generator> y /* = None */,
    /* *, */ double z /* = 1.5 */,
    at::Tensor& out) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("dsv4::all_types", "")
      .typed<std::tuple<at::Tensor, std::vector<at::Tensor>, c10::SymInt, double, std::string, std::optional<at::Tensor>>(const at::Tensor&, at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::TensorList, at::TensorList, const c10::List<std::optional<at::Tensor>>&, int64_t, c10::SymInt, double, bool, c10::string_view, const at::Scalar&, at::ScalarType, at::Layout, at::MemoryFormat, at::Device, at::IntArrayRef, at::IntArrayRef, c10::SymIntArrayRef, at::ArrayRef<double>, std::array<bool, 3>, std::optional<int64_t>, std::optional<c10::string_view>, std::optional<at::Generator>, double, at::Tensor&)>();
  return op.call(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y, z, out);
}
""")

    @unittest.skipIf(shutil.which("g++") is None, "g++ not found: cannot compile csrc_stubs/")
    def test_stubs_compile(self):
        """The header (plus one covering every mapped type) and the .cpp pass `g++ -fsyntax-only`."""
        with tempfile.TemporaryDirectory() as tmp:
            all_types = Path(tmp, "all_types.h")
            all_types.write_text(stubs.render_header([ALL_TYPES]))
            tu = Path(tmp, "tu.cpp")
            tu.write_text("".join(f'#include "{p}"\n' for p in (HEADER, all_types, SOURCE)))
            includes = [f"-I{p}" for p in torch.utils.cpp_extension.include_paths()]
            # torch 2.13's headers need C++20 (what torch.utils.cpp_extension builds with).
            start = time.perf_counter()
            result = subprocess.run(["g++", "-fsyntax-only", "-std=c++20", *includes, str(tu)],
                                    capture_output=True, text=True)
            elapsed = time.perf_counter() - start
        self.assertEqual(result.returncode, 0, result.stderr)
        print(f"g++ -fsyntax-only: {elapsed:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    unittest.main()


@unittest.skipIf(shutil.which("g++") is None, "g++ not found: cannot build a C++ caller")
def test_header_functions_call_the_registered_ops(tmp_path):
    """A C++ caller of csrc_stubs/dsv4_ops.h reaches the registered op through the dispatcher and
    writes what the reference writes (so each typed<> signature matches its schema)."""
    import torch
    from torch.utils import cpp_extension

    from torch_dsv4_ops.reference import cache as reference

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        pytest.skip("ninja not found: cannot build a C++ caller")
    # a plain shared library registering its callers as ops (no pybind11 module: torch/extension.h, which
    # load_inline includes, took most of this test's 112 s)
    source = tmp_path / "stub_callers.cpp"
    source.write_text(f'#include "{stubs.STUB_DIR / stubs.HEADER}"\n' + """#include <torch/library.h>

void stub_flash(at::Tensor key, at::Tensor kc, at::Tensor vc, at::Tensor slots, at::Tensor scale) {
  dsv4::reshape_and_cache_flash(key, key, kc, vc, slots, "fp8", scale, scale);
}
void stub_diffkv(at::Tensor key, at::Tensor value, at::Tensor kv, at::Tensor slots, at::Tensor scale) {
  dsv4::reshape_and_cache_flash_diffkv(key, value, kv, slots, "auto", scale, scale);
}
TORCH_LIBRARY(dsv4_stub_callers, m) {
  m.def("stub_flash", stub_flash);
  m.def("stub_diffkv", stub_diffkv);
}
""")
    cpp_extension.load("dsv4_stub_callers", [str(source)], build_directory=str(tmp_path), extra_cflags=["-O0"],
                       is_python_module=False)
    module = torch.ops.dsv4_stub_callers
    key = (torch.randn(4, 2, 16) * 3).to(torch.bfloat16)
    slots, scale = torch.tensor([3, -1, 9, 12]), torch.tensor([0.05])
    kc, vc = torch.zeros(2, 8, 2, 16, dtype=torch.uint8), torch.zeros(2, 8, 2, 16, dtype=torch.uint8)
    module.stub_flash(key, kc, vc, slots, scale)
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    reference.reshape_and_cache_flash(key, key, want_k, want_v, slots, "fp8", scale, scale)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v) and int((kc != 0).sum()) > 32
    value = torch.randn(4, 2, 8).to(torch.bfloat16)
    kv = torch.zeros(2, 8, 2, 24, dtype=torch.bfloat16)
    module.stub_diffkv(key, value, kv, slots, scale)
    want = torch.zeros_like(kv)
    reference.reshape_and_cache_flash_diffkv(key, value, want, slots, "auto", scale, scale)
    assert torch.equal(kv, want)
