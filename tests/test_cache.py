"""reshape_and_cache_flash and reshape_and_cache_flash_diffkv (SPEC §3.1, §4 a-c, §5)."""
import contextlib
import math

import pytest
import torch

import torch_dsv4_ops as d
from torch_dsv4_ops import layout, platform
from torch_dsv4_ops.kernels import cache as kernels
from torch_dsv4_ops.reference import cache as reference
from torch_dsv4_ops.testing import (assert_bitwise_equal, changed_mask, check_compile, check_cuda_graph,
                                    nonzero_share, random_bytes_, run_opcheck, triton_cache_entries)

FLASH = torch.ops.dsv4.reshape_and_cache_flash.default
DIFFKV = torch.ops.dsv4.reshape_and_cache_flash_diffkv.default
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def e4m3_for(device) -> layout.Fp8Format:
    return platform.platform_e4m3(platform.target_for(torch.device(device)))


def scale_of(x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Per-tensor scale amax/64 for fp8 caches (SPEC §5), 1 otherwise."""
    if not fp8 or x.numel() == 0:
        return torch.ones(1)
    return (x.float().abs().amax() / 64).reshape(1)


def make_slots(g, n_tokens, num_slots, hostile=True, dtype=torch.int64):
    """Unique random valid slots, with some tokens replaced by negative or out-of-range slots."""
    slots = torch.randperm(num_slots, generator=g)[:n_tokens].to(torch.int64)
    if hostile and n_tokens >= 4:
        bad = [-1, -2, num_slots, num_slots + 97] if dtype == torch.int32 else \
              [-1, INT64_MIN, num_slots, INT64_MAX]
        pos = torch.randperm(n_tokens, generator=g)[:4]
        slots[pos] = torch.tensor(bad)
    return slots.to(dtype)


def head_major_x(dtype, dim):
    """The conventional x, reduced to a divisor of `dim` (D = 46 with bf16 gives x = 2)."""
    return math.gcd(layout.head_major_x(dtype), dim)


class FlashCase:
    """One reshape_and_cache_flash case: inputs on CPU, caches as views into random-byte bases."""

    def __init__(self, *, layout_="nhd", in_dtype=torch.bfloat16, kv_cache_dtype="auto", cache_dtype=None,
                 heads=8, dim=64, bs=16, num_blocks=5, tokens=12, extra_tokens=2, interleaved=False,
                 padded=False, slot_dtype=torch.int64, hostile=True, seed=0, x=None, v_pad=0, v_row_pad=0):
        g = torch.Generator().manual_seed(seed)
        self.layout, self.kv_cache_dtype = layout_, kv_cache_dtype
        cache_dtype = cache_dtype or in_dtype
        fp8_cache = kv_cache_dtype.startswith("fp8")
        src = torch.randn(2, tokens + extra_tokens, heads, dim, generator=g) * 3
        if tokens:
            src[:, 0, 0, :2] = torch.tensor([1e-6, 0.0])   # underflow and zero (saturation: worked example)
        if in_dtype in layout.FP8_BY_DTYPE:
            src = src.clamp(-layout.FP8_BY_DTYPE[in_dtype].max, layout.FP8_BY_DTYPE[in_dtype].max)
        self.key, self.value = src[0].to(in_dtype), src[1].to(in_dtype)
        self.k_scale = scale_of(self.key.float(), fp8_cache and in_dtype not in layout.FP8_BY_DTYPE)
        self.v_scale = scale_of(self.value.float(), fp8_cache and in_dtype not in layout.FP8_BY_DTYPE) * 1.5
        self.slots = make_slots(g, tokens, num_blocks * bs, hostile, slot_dtype)
        self.x = x or head_major_x(cache_dtype, dim)
        self.shape = (num_blocks, bs, heads, dim)
        self.cache_dtype, self.interleaved, self.padded = cache_dtype, interleaved, padded
        # V's own strides (K's stay dense): v_pad more elements after each V page, v_row_pad after
        # each V row (of D elements in NHD, of bs in head-major)
        self.v_pad, self.v_row_pad = v_pad, v_row_pad
        k_part, v_page = self._k_part(), self._v_page()
        pad = 24 if padded else 0
        self.base = random_bytes_(torch.empty(k_part + num_blocks * (v_page + pad + v_pad), dtype=cache_dtype), g)

    def _k_part(self):
        nb, bs, h, dim = self.shape
        return nb * (bs * h * dim + (24 if self.padded else 0))

    def _v_rows(self):
        """(row shape, row length) of one V page: NHD [bs, H] rows of D, head-major [H, D] rows of bs."""
        nb, bs, h, dim = self.shape
        return ((bs, h), dim) if self.layout == "nhd" else ((h, dim), bs)

    def _v_page(self):
        (r0, r1), row = self._v_rows()
        return r0 * r1 * (row + self.v_row_pad)

    def caches(self, base):
        nb, bs, h, dim = self.shape
        page = bs * h * dim
        if self.interleaved:           # K and V of one token side by side in one allocation
            both = base[: 2 * nb * page].view(nb, bs, 2, h, dim)
            return both[:, :, 0], both[:, :, 1]
        pad = 24 if self.padded else 0
        k_part, v_page = self._k_part(), self._v_page()
        k_pages = base[:k_part].view(nb, page + pad)[:, :page]
        v_pages = base[k_part: k_part + nb * (v_page + pad + self.v_pad)].view(nb, -1)[:, :v_page]
        rows, row = self._v_rows()
        vc = v_pages.view(nb, *rows, row + self.v_row_pad)[..., :row]
        if self.layout == "nhd":
            return k_pages.view(nb, bs, h, dim), vc
        x = self.x
        return k_pages.view(nb, h, dim // x, bs, x), vc

    def args(self, device, base):
        kc, vc = self.caches(base)
        return (self.key.to(device), self.value.to(device), kc, vc, self.slots.to(device),
                self.kv_cache_dtype, self.k_scale.to(device), self.v_scale.to(device))


def run_flash(case: FlashCase, device):
    """Run the op on `device` and the reference on CPU from the same random bases; compare every
    byte of the whole allocation (unwritten tokens, padding and skipped slots keep their bytes)."""
    base_dev = case.base.clone().to(device)
    d.reshape_and_cache_flash(*case.args(device, base_dev))
    base_ref = case.base.clone()
    reference.reshape_and_cache_flash(*case.args("cpu", base_ref), e4m3=e4m3_for(device))
    assert_bitwise_equal(base_dev.cpu(), base_ref, "cache allocation")
    return base_dev.cpu()


def written_positions(case: FlashCase):
    """Independent index oracle: the (kind, block, offset) of every token that must be written."""
    nb, bs = case.shape[:2]
    return {(int(s) // bs, int(s) % bs) for s in case.slots.tolist() if 0 <= s < nb * bs}


# --- literal worked examples (SPEC §3.1) ---------------------------------------------------------
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_worked_example_slots_and_fp8_bytes(device, impl):
    if impl == "reference" and device.type != "cpu":
        pytest.skip("the reference is the CPU implementation")
    ctx = d.cpu_implementation("reference") if impl == "reference" else contextlib.nullcontext()
    key = torch.zeros(4, 1, 2, device=device)
    key[0, 0] = torch.tensor([3.0, 300.0])
    key[3, 0] = torch.tensor([-3.0, 1.0])
    kc = torch.zeros(2, 16, 1, 2, dtype=torch.uint8, device=device)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([17, -1, -7, 3], device=device)
    with ctx:
        d.reshape_and_cache_flash(key, key, kc, vc, slots, "fp8", torch.tensor([0.5], device=device),
                                  torch.tensor([1.0], device=device))
    kc = kc.cpu()
    e4m3fnuz = e4m3_for(device) is layout.E4M3FNUZ
    assert kc[1, 1, 0].tolist() == ([0x54, 0x7F] if e4m3fnuz else [0x4C, 0x7E])   # 6.0 and saturated 448/240
    assert kc[0, 3, 0].tolist() == ([0xD4, 0x48] if e4m3fnuz else [0xCC, 0x40])  # -6.0 and 2.0
    written = changed_mask(torch.zeros_like(kc), kc).any(-1).any(-1)
    written[1, 1] = written[0, 3] = False
    assert not written.any(), "skipped tokens (slots -1 and -7) must not be written"


def test_worked_example_diffkv(device):
    key = torch.tensor([[[1.0, 2.0]]], device=device)
    value = torch.tensor([[[3.0, 4.0, 5.0]]], device=device)
    kv = torch.full((2, 4, 1, 5), -9.0, device=device)
    d.reshape_and_cache_flash_diffkv(key, value, kv, torch.tensor([5], device=device), "auto",
                                     torch.ones(1, device=device), torch.ones(1, device=device))
    expected = torch.full((2, 4, 1, 5), -9.0)
    expected[1, 1, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert torch.equal(kv.cpu(), expected)


# --- exactness sweeps ---------------------------------------------------------------------------
SIZES = [(8, 46, 8), (13, 64, 16), (8, 80, 32), (13, 256, 544)]   # (H, D, bs), SPEC §5


@pytest.mark.parametrize("layout_", ["nhd", "head_major"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"H{s[0]}D{s[1]}bs{s[2]}")
def test_auto_exact_whole_cache(device, layout_, dtype, size):
    heads, dim, bs = size
    case = FlashCase(layout_=layout_, in_dtype=dtype, heads=heads, dim=dim, bs=bs, num_blocks=3,
                     tokens=10 if bs < 544 else 6, seed=hash((layout_, str(dtype), size)) % 1000)
    after = run_flash(case, device)
    # independent oracle: exactly the valid slots changed, and they hold the input bits
    kc, vc = case.caches(after)
    kc0, vc0 = case.caches(case.base)
    for t, s in enumerate(case.slots.tolist()):
        if not 0 <= s < case.shape[0] * bs:
            continue
        blk, off = s // bs, s % bs
        if layout_ == "nhd":
            got_k, got_v = kc[blk, off], vc[blk, off]
        else:
            got_k, got_v = kc[blk, :, :, off, :].reshape(heads, dim), vc[blk, :, :, off]
        assert_bitwise_equal(got_k, case.key[t], f"token {t} K")
        assert_bitwise_equal(got_v, case.value[t], f"token {t} V")
    changed = changed_mask(kc0, kc)
    tokens_changed = changed.any(-1).any(-1) if layout_ == "nhd" else \
        changed.permute(0, 3, 1, 2, 4).flatten(2).any(-1)
    assert set(map(tuple, tokens_changed.nonzero().tolist())) <= written_positions(case)


def prefill_run_slots(g, tokens, bs, num_blocks):
    """Slots as a prefill writes them: whole blocks of consecutive slots in random block order, then
    one run that starts mid-block (it straddles two blocks), one -1 inside a run, and a partial last
    group (`tokens` not a multiple of 16)."""
    blocks = torch.randperm(num_blocks, generator=g)
    slots = torch.cat([b * bs + torch.arange(bs) for b in blocks.tolist()])[:tokens].clone()
    if bs >= 19:
        slots[16:32] = blocks[-1] * bs + 3 + torch.arange(16)
    slots[37] = -1
    return slots


@pytest.mark.parametrize("kv", [("auto", torch.bfloat16), ("auto", torch.float32), ("fp8", torch.uint8),
                                ("fp8_e5m2", torch.float8_e5m2)], ids=lambda kv: f"{kv[0]}-{str(kv[1])[6:]}")
@pytest.mark.parametrize("size", [(2, 128, 16), (3, 80, 16), (1, 64, 32), (2, 80, 544)],
                         ids=lambda s: f"H{s[0]}D{s[1]}bs{s[2]}")
@pytest.mark.parametrize("slots", ["prefill_runs", "random", "runs_v_rows_padded"])
def test_head_major_prefill_sizes_exact(device, kv, size, slots):
    """Head-major caches at prefill sizes (the group kernel, GROUP_MIN_TOKENS tokens and more), written
    as a prefill writes them (runs of consecutive slots: the contiguous-run stores; padded V rows),
    or with random and hostile slots (the per-element stores): equal to the reference over the whole
    allocation."""
    heads, dim, bs = size
    kv_cache_dtype, cache_dtype = kv
    tokens = kernels.GROUP_MIN_TOKENS + 29
    num_blocks = -(-tokens // bs) + 2
    case = FlashCase(layout_="head_major", kv_cache_dtype=kv_cache_dtype, cache_dtype=cache_dtype, heads=heads,
                     dim=dim, bs=bs, num_blocks=num_blocks, tokens=tokens,
                     v_row_pad=3 if slots == "runs_v_rows_padded" else 0, seed=hash((kv, size, slots)) % 1000)
    if slots != "random":
        case.slots = prefill_run_slots(torch.Generator().manual_seed(3), tokens, bs, num_blocks)
    run_flash(case, device)


FP8_CACHES = [("fp8", torch.uint8), ("fp8_e4m3", torch.uint8), ("fp8_e5m2", torch.uint8),
              ("fp8", torch.float8_e4m3fn), ("fp8", torch.float8_e4m3fnuz), ("fp8_e5m2", torch.float8_e5m2)]


@pytest.mark.parametrize("layout_", ["nhd", "head_major"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kv", FP8_CACHES, ids=lambda kv: f"{kv[0]}-{str(kv[1])[6:]}")
def test_fp8_cache_bytes_equal_reference(device, layout_, in_dtype, kv):
    kv_cache_dtype, cache_dtype = kv
    heads, dim, bs = SIZES[(FP8_CACHES.index(kv) + [torch.bfloat16, torch.float16, torch.float32].index(in_dtype)) % 3]
    case = FlashCase(layout_=layout_, in_dtype=in_dtype, kv_cache_dtype=kv_cache_dtype, cache_dtype=cache_dtype,
                     heads=heads, dim=dim, bs=bs, num_blocks=3, seed=7)
    after = run_flash(case, device)
    kc, _ = case.caches(after)
    # the written bytes decode (in the cache's format, times the scale) close to the input
    fmt = layout.resolve_kv_cache_format(kv_cache_dtype, cache_dtype, e4m3_for(device))
    rel = 2.0 ** -(fmt.man_bits + 1)
    written = 0
    for t, s in enumerate(case.slots.tolist()):
        if not 0 <= s < case.shape[0] * bs:
            continue
        blk, off = s // bs, s % bs
        raw = kc[blk, off] if layout_ == "nhd" else kc[blk, :, :, off, :].reshape(heads, dim)
        got = raw.view(torch.uint8).view(fmt.dtype).float() * case.k_scale
        want = case.key[t].float().clamp(-fmt.max * case.k_scale.item(), fmt.max * case.k_scale.item())
        half_subnormal_step = 2.0 ** (-fmt.bias - fmt.man_bits) * case.k_scale
        assert bool(((got - want).abs() <= rel * want.abs() + half_subnormal_step).all()), f"token {t} decodes wrong"
        assert nonzero_share(raw) > 0.5
        written += 1
    assert written >= 6


@pytest.mark.parametrize("in_dtype,cache_dtype,kv_cache_dtype", [
    (torch.bfloat16, torch.float32, "auto"), (torch.float32, torch.bfloat16, "bfloat16"),
    (torch.float16, torch.bfloat16, "auto"), (torch.bfloat16, torch.float16, "half"),
    (torch.float32, torch.float16, "float16"),
    (torch.float8_e4m3fn, torch.float8_e4m3fn, "fp8"), (torch.float8_e4m3fn, torch.float8_e4m3fnuz, "fp8"),
    (torch.float8_e5m2, torch.uint8, "fp8"), (torch.float8_e4m3fn, torch.uint8, "fp8_e5m2"),
    (torch.float8_e4m3fn, torch.bfloat16, "auto"), (torch.float8_e5m2, torch.float32, "auto"),
])
def test_conversions(device, in_dtype, cache_dtype, kv_cache_dtype):
    case = FlashCase(in_dtype=in_dtype, cache_dtype=cache_dtype, kv_cache_dtype=kv_cache_dtype, heads=4, dim=32,
                     bs=8, num_blocks=3)
    run_flash(case, device)


@pytest.mark.parametrize("variant", ["interleaved", "padded_pages", "int32_slots", "strided_inputs", "no_tokens",
                                     "padded_key", "strided_slots"])
def test_layout_variants(device, variant):
    kw = dict(interleaved=variant == "interleaved", padded=variant == "padded_pages",
              slot_dtype=torch.int32 if variant == "int32_slots" else torch.int64,
              tokens=0 if variant == "no_tokens" else 10, extra_tokens=5 if variant == "padded_key" else 0)
    case = FlashCase(kv_cache_dtype="fp8", cache_dtype=torch.uint8, heads=3, dim=48, bs=16, num_blocks=2, **kw)
    if variant == "strided_inputs":   # key/value as non-contiguous views: [T, H, D] slices of [H, T, 2D]
        big = torch.randn(case.key.shape[1], case.key.shape[0], 2 * case.key.shape[2]).to(case.key.dtype)
        case.key = big[:, :, ::2].transpose(0, 1)
        case.value = big[:, :, 1::2].transpose(0, 1)
        assert not case.key.is_contiguous()
    if variant == "strided_slots":   # slot_mapping as a strided view
        case.slots = torch.stack([case.slots, torch.full_like(case.slots, -5)], 1)[:, 0]
        assert case.slots.stride(0) == 2
    run_flash(case, device)


def test_only_hostile_slots_write_nothing(device):
    case = FlashCase(tokens=6, hostile=False, num_blocks=2, bs=8, heads=2, dim=16)
    case.slots = torch.tensor([-1, -2, INT64_MIN, 16, 17, INT64_MAX])
    after = run_flash(case, device)
    assert_bitwise_equal(after, case.base, "cache after hostile slots")


DIFFKV_CASES = [(torch.bfloat16, "auto", torch.bfloat16), (torch.float16, "auto", torch.float16),
                (torch.float32, "bfloat16", torch.bfloat16), (torch.bfloat16, "fp8", torch.uint8),
                (torch.bfloat16, "fp8_e5m2", torch.uint8), (torch.float16, "fp8", torch.float8_e4m3fnuz)]


@pytest.mark.parametrize("in_dtype,kv_cache_dtype,cache_dtype", DIFFKV_CASES)
def test_diffkv_exact(device, in_dtype, kv_cache_dtype, cache_dtype):
    g = torch.Generator().manual_seed(3)
    nb, bs, heads, dk, dv, tokens = 3, 8, 3, 40, 24, 10
    key = (torch.randn(tokens + 2, heads, dk, generator=g) * 4).to(in_dtype)
    value = (torch.randn(tokens + 2, heads, dv, generator=g) * 4).to(in_dtype)
    base = random_bytes_(torch.empty(nb, bs, heads, dk + dv + 8, dtype=cache_dtype), g)   # padded rows
    slots = make_slots(g, tokens, nb * bs)
    fp8 = kv_cache_dtype.startswith("fp8")
    ks, vs = scale_of(key, fp8), scale_of(value, fp8) * 0.75
    dev = base.clone().to(device)
    d.reshape_and_cache_flash_diffkv(key.to(device), value.to(device), dev[..., : dk + dv], slots.to(device),
                                     kv_cache_dtype, ks.to(device), vs.to(device))
    ref = base.clone()
    reference.reshape_and_cache_flash_diffkv(key, value, ref[..., : dk + dv], slots, kv_cache_dtype, ks, vs,
                                             e4m3=e4m3_for(device))
    assert_bitwise_equal(dev.cpu(), ref, "diffkv cache")
    if kv_cache_dtype == "auto":   # independent check of placement
        for t, s in enumerate(slots.tolist()):
            if 0 <= s < nb * bs:
                assert_bitwise_equal(dev.cpu()[s // bs, s % bs, :, :dk], key[t], "K half")
                assert_bitwise_equal(dev.cpu()[s // bs, s % bs, :, dk:dk + dv], value[t], "V half")


# --- errors -------------------------------------------------------------------------------------
def _good_args(device="cpu"):
    case = FlashCase(heads=2, dim=16, bs=4, num_blocks=2, tokens=3, hostile=False)
    return list(case.args(device, case.base.clone().to(device)))


@pytest.mark.parametrize("mutate,exc,words", [
    (lambda a: a.__setitem__(4, a[4].float()), ValueError, "slot_mapping"),
    (lambda a: a.__setitem__(4, a[4].view(1, -1)), ValueError, "slot_mapping"),
    (lambda a: a.__setitem__(0, a[0][0]), ValueError, "key"),
    (lambda a: a.__setitem__(1, a[1].float()), ValueError, "value"),
    (lambda a: a.__setitem__(0, a[0][:1]), ValueError, "fewer than slot_mapping"),
    (lambda a: a.__setitem__(5, "fp4"), ValueError, "kv_cache_dtype"),
    (lambda a: a.__setitem__(5, "fp8"), ValueError, "kv_cache_dtype"),         # bf16 cache with fp8 string
    (lambda a: a.__setitem__(6, torch.ones(2)), ValueError, "k_scale"),
    (lambda a: a.__setitem__(7, torch.ones(1, dtype=torch.float16)), ValueError, "v_scale"),
    (lambda a: a.__setitem__(3, a[3][:, :, :1]), ValueError, "value_cache"),
    (lambda a: a.__setitem__(2, a[2].unsqueeze(0)), ValueError, "key_cache"),
    (lambda a: a.__setitem__(3, a[3].float()), ValueError, "value_cache"),
])
def test_bad_input_errors(mutate, exc, words):
    args = _good_args()
    mutate(args)
    with pytest.raises(exc, match=words):
        d.reshape_and_cache_flash(*args)


def test_bad_input_uint8_cache_with_auto():
    args = _good_args()
    args[2] = torch.zeros(2, 4, 2, 16, dtype=torch.uint8)
    args[3] = torch.zeros(2, 4, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_cache_dtype='auto'"):
        d.reshape_and_cache_flash(*args)


def test_bad_input_head_major_x():
    args = _good_args()
    args[2] = torch.zeros(2, 2, 3, 4, 5)   # x = 5 does not divide D = 16
    args[3] = torch.zeros(2, 2, 16, 4)
    args[0], args[1] = args[0].float(), args[1].float()
    with pytest.raises(ValueError, match="x = 5"):
        d.reshape_and_cache_flash(*args)


def test_bad_input_zero_block_size():
    args = _good_args()
    args[2], args[3] = torch.zeros(2, 0, 2, 16), torch.zeros(2, 0, 2, 16)
    with pytest.raises(ValueError, match="block size 0"):
        d.reshape_and_cache_flash(*args)


def test_zero_heads_is_a_no_op(device):
    key = torch.zeros(3, 0, 16, device=device)
    cache = torch.zeros(2, 4, 0, 16, device=device)
    d.reshape_and_cache_flash(key, key, cache, cache.clone(), torch.tensor([0, 1, 2], device=device), "auto",
                              torch.ones(1, device=device), torch.ones(1, device=device))


def test_bad_input_diffkv_shape():
    key, value = torch.zeros(3, 2, 4), torch.zeros(3, 2, 5)
    with pytest.raises(ValueError, match="kv_cache"):
        d.reshape_and_cache_flash_diffkv(key, value, torch.zeros(2, 4, 2, 8), torch.zeros(3, dtype=torch.long),
                                         "auto", torch.ones(1), torch.ones(1))


@pytest.mark.gpu
def test_bad_input_device_mismatch():
    args = _good_args("cuda")
    args[4] = args[4].cpu()
    with pytest.raises(ValueError, match="slot_mapping"):
        d.reshape_and_cache_flash(*args)


# --- composition --------------------------------------------------------------------------------
def _opcheck_cases(device):
    auto = FlashCase(heads=2, dim=16, bs=4, num_blocks=2, tokens=5)
    fp8 = FlashCase(heads=2, dim=16, bs=4, num_blocks=2, tokens=5, kv_cache_dtype="fp8", cache_dtype=torch.uint8)
    hm = FlashCase(layout_="head_major", heads=2, dim=16, bs=4, num_blocks=2, tokens=5)
    return {"auto": auto.args(device, auto.base.clone().to(device)),
            "fp8": fp8.args(device, fp8.base.clone().to(device)),
            "head_major": hm.args(device, hm.base.clone().to(device))}


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("kind", ["auto", "fp8", "head_major"])
def test_opcheck_flash(device, impl, kind):
    if impl == "reference" and device.type != "cpu":
        pytest.skip("the reference is the CPU implementation")
    ctx = d.cpu_implementation(impl) if device.type == "cpu" else contextlib.nullcontext()
    args = _opcheck_cases(device)[kind]
    with ctx:
        # caches stay as given (their layout is the op's contract); inputs get non-contiguous copies
        run_opcheck(FLASH, args, permute=lambda i, t: i in (0, 1))


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_opcheck_diffkv(device, impl):
    if impl == "reference" and device.type != "cpu":
        pytest.skip("the reference is the CPU implementation")
    ctx = d.cpu_implementation(impl) if device.type == "cpu" else contextlib.nullcontext()
    key, value = torch.randn(5, 2, 8, device=device), torch.randn(5, 2, 4, device=device)
    kv = torch.zeros(3, 4, 2, 12, device=device)
    args = (key, value, kv, torch.tensor([0, 5, -1, 11, 3], device=device), "auto",
            torch.ones(1, device=device), torch.ones(1, device=device))
    with ctx:
        run_opcheck(DIFFKV, args, permute=lambda i, t: i in (0, 1))


def test_compile_no_recompile(device):
    """fullgraph + dynamic: one graph for several token counts (sizes >= 2 avoid 0/1 specialisation)."""
    kc = torch.zeros(4, 8, 2, 16, dtype=torch.uint8, device=device)

    def step(key, value, key_cache, value_cache, slots, k_scale, v_scale):
        d.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "fp8", k_scale, v_scale)
        return key_cache, value_cache

    inputs = []
    for n in (3, 7, 12):
        g = torch.Generator().manual_seed(n)
        inputs.append((torch.randn(n, 2, 16, generator=g).to(device), torch.randn(n, 2, 16, generator=g).to(device),
                       kc.clone(), kc.clone(), torch.randperm(32, generator=g)[:n].to(device),
                       torch.tensor([0.05], device=device), torch.tensor([0.1], device=device)))
    counted = device.type == "cuda"   # the interpreter compiles nothing: there is nothing to count
    before = triton_cache_entries(kernels.flash_cache_write_kernel) if counted else None
    check_compile(step, inputs)
    if counted:   # one Triton specialisation for all token counts
        assert triton_cache_entries(kernels.flash_cache_write_kernel) - before <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype,cache_dtype", [("auto", torch.bfloat16), ("fp8", torch.uint8)])
def test_cuda_graph_replay(kv_cache_dtype, cache_dtype):
    heads, dim, nb, bs, n = 8, 128, 64, 16, 48

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        key = torch.randn(n, heads, dim, generator=g).to(torch.bfloat16)
        value = torch.randn(n, heads, dim, generator=g).to(torch.bfloat16)
        slots = make_slots(g, n, nb * bs)
        caches = random_bytes_(torch.empty(2, nb, bs, heads, dim, dtype=cache_dtype), g)
        return [key.cuda(), value.cuda(), caches[0].cuda(), caches[1].cuda(), slots.cuda(),
                torch.tensor([0.04 + seed / 100]).cuda(), torch.tensor([0.03]).cuda()]

    def step(key, value, kc, vc, slots, ks, vs):
        d.reshape_and_cache_flash(key, value, kc, vc, slots, kv_cache_dtype, ks, vs)

    check_cuda_graph(step, inputs(0), [inputs(1), inputs(2)])


@pytest.mark.gpu
def test_large_random_batch_matches_reference():
    """Benchmark-sized shapes: T = 4096, H = 8, D = 128, bs = 16, random slots, bf16 and fp8."""
    for kv, cdt in (("auto", torch.bfloat16), ("fp8", torch.uint8), ("fp8_e5m2", torch.uint8)):
        case = FlashCase(kv_cache_dtype=kv, cache_dtype=cdt, heads=8, dim=128, bs=16, num_blocks=600,
                         tokens=4096, seed=11)
        run_flash(case, "cuda")


@pytest.mark.gpu
def test_repeated_launches_bypass_triton_jit(monkeypatch):
    """After the first call of a signature, launches go straight to the compiled kernel (the
    eager host-overhead path): Triton's JIT run is not entered again, whatever the slot values."""
    case = FlashCase(kv_cache_dtype="fp8", cache_dtype=torch.uint8, heads=8, dim=128, bs=16, num_blocks=8, tokens=4)
    args = case.args("cuda", case.base.clone().cuda())
    d.reshape_and_cache_flash(*args)
    entered = []
    jit_run = kernels.flash_cache_write_kernel.run
    monkeypatch.setattr(kernels.flash_cache_write_kernel, "run",
                        lambda *a, **k: (entered.append(1), jit_run(*a, **k))[1])
    for shift in range(3):
        args[4].copy_(torch.roll(args[4], 1))
        d.reshape_and_cache_flash(*args)
    torch.cuda.synchronize()
    assert entered == [], "repeated launches went through Triton's JIT path"


@pytest.mark.parametrize("div64", [True, False], ids=["fp64-reciprocal", "fp32-div_rn"])
@pytest.mark.parametrize("fmt", layout.FP8_FORMATS, ids=lambda f: f.name)
def test_scaled_fp8_division_is_exact(device, div64, fmt):
    """Both ways the kernel divides by the per-tensor scale (fp32(x * fp64(1/s)) where fp64 is fast,
    IEEE fp32 division elsewhere) give the bytes of torch's clamp(x / s).to(fp8): every finite bf16
    value and random finite fp32 bit patterns, against scales chosen to stress rounding."""
    target = platform.target_for(device)
    codec = kernels.Codec(layout.NOT_FP8, kernels.FP8, fmt.code, True, False,
                          not platform.native_fp8(target, fmt), div64)
    g = torch.Generator().manual_seed(5)
    every_bf16 = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    patterns = torch.randint(-2**31, 2**31, (65536,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([every_bf16, patterns])
    x = x[torch.isfinite(x)]
    tokens, dim = 32, 4096
    x = torch.cat([x, torch.randn(tokens * dim - x.numel(), generator=g)])[: tokens * dim].view(tokens, 1, dim)
    for k_scale, v_scale in ((1 / 3, 0.0517), (7.0, 1e-30), (3e30, 1.1754944e-38), (1e-40, 0.3)):
        ks, vs = torch.tensor([k_scale]), torch.tensor([v_scale])
        kc = torch.zeros(tokens, 1, 1, dim, dtype=torch.uint8, device=device)
        vc = torch.zeros_like(kc)
        geo = kernels.nhd_geometry(kc)
        meta = kernels.constexprs(1, dim, dim, geo, geo, 1, codec, target)
        xd = x.to(device)
        ints = kernels.runtime_args(tokens, 1, 0, xd.stride(), xd.stride(), geo, geo)
        kernels.flash_cache_write_kernel[(tokens, 1)](xd, xd, kc, vc, torch.arange(tokens, device=device),
                                                      ks.to(device), vs.to(device), *ints, **meta)
        for cache, scale in ((kc, ks), (vc, vs)):
            want = (x / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8).view(tokens, 1, 1, dim)
            assert_bitwise_equal(cache.cpu(), want, f"{fmt.name} x / {scale.item():g}")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype,cache_dtype", [("auto", torch.bfloat16), ("fp8", torch.uint8)])
def test_stream_order_in_graph(kv_cache_dtype, cache_dtype):
    """Launched with programmatic dependent launch (sm_90+), the op still sees its predecessor's
    writes, and two writes to one slot land in stream order, inside a captured graph."""
    heads, dim, bs = 8, 128, 16
    key = torch.randn(4, heads, dim, device="cuda").to(torch.bfloat16)
    key2 = torch.randn(4, heads, dim, device="cuda").to(torch.bfloat16)
    kc = torch.zeros(8, bs, heads, dim, dtype=cache_dtype, device="cuda")
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, 17, 40, 99], device="cuda")
    scale = torch.full((1,), 0.05, device="cuda")
    snapshot = torch.empty_like(kc)

    def step():
        key.mul_(-2)                                  # a torch kernel writes what the op reads
        d.reshape_and_cache_flash(key, key, kc, vc, slots, kv_cache_dtype, scale, scale)
        key2.add_(1)
        d.reshape_and_cache_flash(key2, key2, kc, vc, slots, kv_cache_dtype, scale, scale)   # same slots
        snapshot.copy_(kc)                            # a torch kernel reads what the op wrote

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        before2 = key2.clone()
        graph.replay()
        torch.cuda.synchronize()
        expected = torch.zeros_like(kc).cpu()
        reference.reshape_and_cache_flash((before2 + 1).cpu(), (before2 + 1).cpu(), expected, expected.clone(),
                                          slots.cpu(), kv_cache_dtype, scale.cpu(), scale.cpu(),
                                          e4m3=e4m3_for("cuda"))
        written = kc.cpu().view(torch.uint8).view(8 * bs, -1)[slots.cpu()]
        assert_bitwise_equal(written, expected.view(torch.uint8).view(8 * bs, -1)[slots.cpu()], "last write")
        assert_bitwise_equal(snapshot.cpu(), kc.cpu(), "snapshot after the op")


# --- V cache strides independent of K's -------------------------------------------------------------
@pytest.mark.parametrize("layout_", ["nhd", "head_major"])
@pytest.mark.parametrize("v_layout", ["v_pages_padded", "v_rows_padded", "both"])
@pytest.mark.parametrize("kv", [("auto", torch.bfloat16), ("fp8", torch.uint8)], ids=lambda kv: kv[0])
def test_value_cache_strides_differ_from_key_cache(device, layout_, v_layout, kv):
    """K pages dense, V pages padded by 40 elements and/or V rows padded (V a strided view of a
    bigger buffer): V must be addressed with its own strides (every byte of both allocations)."""
    case = FlashCase(layout_=layout_, kv_cache_dtype=kv[0], cache_dtype=kv[1], heads=3, dim=32, bs=8, num_blocks=3,
                     tokens=10, v_pad=0 if v_layout == "v_rows_padded" else 40,
                     v_row_pad=0 if v_layout == "v_pages_padded" else 5, seed=21)
    kc, vc = case.caches(case.base)
    assert kc.is_contiguous() and vc.stride() != vc.contiguous().stride()
    after = run_flash(case, device)
    # independent check of V placement for the float cache
    if kv[0] == "auto":
        _, vc = case.caches(after)
        bs = case.shape[1]
        written = 0
        for t, s in enumerate(case.slots.tolist()):
            if 0 <= s < case.shape[0] * bs:
                got = vc[s // bs, s % bs] if layout_ == "nhd" else vc[s // bs, :, :, s % bs]
                assert_bitwise_equal(got, case.value[t], f"token {t} V")
                written += 1
        assert written >= 4


# --- head size 0 ---------------------------------------------------------------------------------------
def _impls(device):
    """(label, context) of the implementations to compare on `device`: the kernel, and on CPU the reference."""
    impls = [("kernel", contextlib.nullcontext())]
    if device.type == "cpu":
        impls = [("kernel", d.cpu_implementation("triton")), ("reference", d.cpu_implementation("reference"))]
    return impls


@pytest.mark.parametrize("layout_", ["nhd", "head_major"])
@pytest.mark.parametrize("kv", [("auto", torch.bfloat16), ("fp8", torch.uint8)], ids=lambda kv: kv[0])
def test_flash_head_size_zero(device, layout_, kv):
    """D = 0 is valid and writes nothing, kernel and reference alike (caches are empty views into a
    random-byte buffer whose bytes must all survive)."""
    kv_cache_dtype, cache_dtype = kv
    g = torch.Generator().manual_seed(4)
    nb, bs, heads, tokens = 2, 4, 3, 5
    key = torch.empty(tokens, heads, 0, dtype=torch.bfloat16)
    slots = torch.tensor([0, 7, -1, 3, 5])
    base = random_bytes_(torch.empty(nb, heads, bs, 8, dtype=cache_dtype), g)
    results = []
    for label, ctx in _impls(device):
        b = base.clone().to(device)                        # [nb, H, bs, 8]: the caches are 0-wide views into it
        if layout_ == "nhd":
            kc, vc = b[..., :0].transpose(1, 2), b[..., 4:4].transpose(1, 2)        # [nb, bs, H, 0]
        else:
            x = layout.head_major_x(cache_dtype)
            kc = b[..., :0].unsqueeze(-1).expand(nb, heads, bs, 0, x).transpose(2, 3)   # [nb, H, 0, bs, x]
            vc = b[..., 4:4].transpose(2, 3)                                             # [nb, H, 0, bs]
        with ctx:
            d.reshape_and_cache_flash(key.to(device), key.to(device), kc, vc, slots.to(device), kv_cache_dtype,
                                      torch.ones(1, device=device), torch.ones(1, device=device))
        results.append((label, b.cpu()))
    for label, b in results:
        assert_bitwise_equal(b, base, f"{label}: bytes around D = 0 caches")


@pytest.mark.parametrize("which", ["dv0", "dk0", "both0"])
@pytest.mark.parametrize("kv", [("auto", torch.bfloat16), ("fp8", torch.uint8)], ids=lambda kv: kv[0])
def test_diffkv_head_size_zero(device, which, kv):
    """Dv = 0 writes K only, Dk = 0 writes V only, both 0 nothing: kernel and reference write the
    same bytes (cache rows padded, inside a random-byte buffer)."""
    kv_cache_dtype, cache_dtype = kv
    g = torch.Generator().manual_seed(5)
    nb, bs, heads, tokens = 2, 4, 3, 6
    dk, dv = {"dv0": (24, 0), "dk0": (0, 24), "both0": (0, 0)}[which]
    key = (torch.randn(tokens, heads, dk, generator=g) * 3).to(torch.bfloat16)
    value = (torch.randn(tokens, heads, dv, generator=g) * 3).to(torch.bfloat16)
    slots = torch.tensor([6, -1, 0, 3, 100, 7])
    fp8 = kv_cache_dtype.startswith("fp8")
    ks, vs = scale_of(key, fp8), scale_of(value, fp8)
    base = random_bytes_(torch.empty(nb, bs, heads, dk + dv + 5, dtype=cache_dtype), g)
    results = {}
    for label, ctx in _impls(device):
        b = base.clone().to(device)
        with ctx:
            d.reshape_and_cache_flash_diffkv(key.to(device), value.to(device), b[..., : dk + dv], slots.to(device),
                                             kv_cache_dtype, ks.to(device), vs.to(device))
        results[label] = b.cpu()
    want = base.clone()
    reference.reshape_and_cache_flash_diffkv(key, value, want[..., : dk + dv], slots, kv_cache_dtype, ks, vs,
                                             e4m3=e4m3_for(device))
    for label, b in results.items():
        assert_bitwise_equal(b, want, f"{label}: diffkv Dk={dk} Dv={dv}")
    got = results["kernel"]
    changed = changed_mask(base, got)
    assert not changed[..., dk + dv:].any(), "row padding written"
    rows = {(s // bs, s % bs) for s in slots.tolist() if 0 <= s < nb * bs}
    if dk + dv == 0:
        assert not changed.any()
    else:
        assert {tuple(i) for i in changed.any(-1).any(-1).nonzero().tolist()} == rows
    if kv_cache_dtype == "auto":
        for t, s in enumerate(slots.tolist()):
            if 0 <= s < nb * bs:
                assert_bitwise_equal(got[s // bs, s % bs, :, :dk], key[t], "K")
                assert_bitwise_equal(got[s // bs, s % bs, :, dk:dk + dv], value[t], "V")


# --- scales ----------------------------------------------------------------------------------------------
def _flash_kv_args(device, kv_dim=0, kv_cache_dtype="fp8", cache_dtype=torch.uint8, tokens=6, seed=0):
    """(key, value, kv_cache [2, nb, bs, H, D] or [nb, 2, bs, H, D] of random bytes, slots) on `device`."""
    g = torch.Generator().manual_seed(seed)
    nb, bs, heads, dim = 3, 4, 2, 16
    key = (torch.randn(tokens + 1, heads, dim, generator=g) * 3).to(torch.bfloat16)
    value = (torch.randn(tokens + 1, heads, dim, generator=g) * 3).to(torch.bfloat16)
    shape = (2, nb, bs, heads, dim) if kv_dim == 0 else (nb, 2, bs, heads, dim)
    kv = random_bytes_(torch.empty(shape, dtype=cache_dtype), g)
    slots = make_slots(g, tokens, nb * bs)
    return key.to(device), value.to(device), kv.to(device), slots.to(device)


def _call_wrapper(fn_name, device, k_scale, v_scale, kv_cache_dtype="fp8", seed=0):
    """Run one public wrapper on fresh inputs with these scales; returns the written cache (CPU)."""
    key, value, kv, slots = _flash_kv_args(device, kv_cache_dtype=kv_cache_dtype, seed=seed)
    if fn_name == "flash":
        d.reshape_and_cache_flash(key, value, kv[0], kv[1], slots, kv_cache_dtype, k_scale, v_scale)
    elif fn_name == "kv":
        d.reshape_and_cache_flash_kv(key, value, kv, slots, kv_cache_dtype, k_scale, v_scale)
    else:
        cache = kv.permute(1, 2, 3, 0, 4).flatten(3)   # [nb, bs, H, 2D] (strided), Dk = Dv = D
        d.reshape_and_cache_flash_diffkv(key, value, cache, slots, kv_cache_dtype, k_scale, v_scale)
    return kv.cpu()


WRAPPERS = ["flash", "diffkv", "kv"]


@pytest.mark.parametrize("fn_name", WRAPPERS)
def test_python_float_scales_equal_tensor_scales(device, fn_name):
    for k, v in ((0.05, 0.07), (2, 1e-3), (1.0, 3)):          # ints are accepted too
        as_floats = _call_wrapper(fn_name, device, k, v)
        as_tensors = _call_wrapper(fn_name, device, torch.tensor([float(k)], device=device),
                                   torch.tensor([float(v)], device=device))
        assert_bitwise_equal(as_floats, as_tensors, f"{fn_name} scales {k}, {v}")
        assert nonzero_share(as_floats) > 0.3


BAD_FLOAT_SCALES = [0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf"), True, False, "x", None, 1e400]


@pytest.mark.parametrize("fn_name", WRAPPERS)
@pytest.mark.parametrize("bad", BAD_FLOAT_SCALES, ids=repr)
def test_bad_python_scales_raise_and_write_nothing(fn_name, bad):
    for name in ("k_scale", "v_scale"):
        key, value, kv, slots = _flash_kv_args("cpu")
        before = kv.clone()
        scales = {"k_scale": 0.05, "v_scale": 0.05, name: bad}
        with pytest.raises(ValueError, match=name):
            if fn_name == "flash":
                d.reshape_and_cache_flash(key, value, kv[0], kv[1], slots, "fp8", scales["k_scale"],
                                          scales["v_scale"])
            elif fn_name == "kv":
                d.reshape_and_cache_flash_kv(key, value, kv, slots, "fp8", scales["k_scale"], scales["v_scale"])
            else:
                d.reshape_and_cache_flash_diffkv(key, value, kv.permute(1, 2, 3, 0, 4).flatten(3), slots, "fp8",
                                                 scales["k_scale"], scales["v_scale"])
        assert_bitwise_equal(kv, before, f"cache after a bad {name}")


NAN_CODES = {layout.E4M3FN.name: {0x7F, 0xFF}, layout.E4M3FNUZ.name: {0x80},
             layout.E5M2.name: {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}}
# x = [3, -3, +0, -0] stored with a bad scale tensor: IEEE x / scale, saturated (docs/ops/cache.md §6.2).
# NaN (0/0, x/NaN): either NaN code of the format (its sign is the hardware's).
NAN = "nan"
SCALE_BYTES = [   # (scale, e4m3fn bytes, e5m2 bytes)
    (0.0, [0x7E, 0xFE, NAN, NAN], [0x7B, 0xFB, NAN, NAN]),                 # +-max, 0/0 = NaN
    (-0.0, [0xFE, 0x7E, NAN, NAN], [0xFB, 0x7B, NAN, NAN]),
    (-0.5, [0xCC, 0x4C, 0x80, 0x00], [0xC6, 0x46, 0x80, 0x00]),             # -+6.0 and -+0
    (float("inf"), [0x00, 0x80, 0x00, 0x80], [0x00, 0x80, 0x00, 0x80]),
    (float("-inf"), [0x80, 0x00, 0x80, 0x00], [0x80, 0x00, 0x80, 0x00]),
    (float("nan"), [NAN] * 4, [NAN] * 4),
    (1e-40, [0x7E, 0xFE, 0x00, 0x80], [0x7B, 0xFB, 0x00, 0x80]),            # subnormal: x / s overflows
]


def _assert_fp8_bytes_equal(actual, expected, fmt, device, what):
    """Bitwise on CPU (kernel and reference see the same NaN sign there); on a GPU a NaN may carry
    the other sign than on the CPU reference (0/0), so any two NaN codes of `fmt` match."""
    a, e = actual.cpu().view(torch.uint8), expected.cpu().view(torch.uint8)
    if device.type == "cpu":
        assert_bitwise_equal(a, e, what)
        return
    nan = torch.tensor(sorted(NAN_CODES[fmt.name]), dtype=torch.uint8)
    both_nan = torch.isin(a, nan) & torch.isin(e, nan)
    assert_bitwise_equal(torch.where(both_nan, 0, a), torch.where(both_nan, 0, e), what)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("scale,e4m3fn_bytes,e5m2_bytes", SCALE_BYTES, ids=[repr(s[0]) for s in SCALE_BYTES])
def test_bad_scale_tensors_give_ieee_division_saturated(device, kv_cache_dtype, scale, e4m3fn_bytes, e5m2_bytes):
    """Scale tensors are never checked (R3): 0, negative, inf, NaN and subnormal scales give the
    kernel the reference's bytes, and literally the bytes of saturate(IEEE x / scale)."""
    fmt = layout.resolve_kv_cache_format(kv_cache_dtype, torch.uint8, e4m3_for(device))
    # literal bytes, K with `scale` and V with the same scale
    key = torch.tensor([[[3.0, -3.0, 0.0, -0.0]]], dtype=torch.bfloat16)
    kc = torch.zeros(1, 2, 1, 4, dtype=torch.uint8, device=device)
    vc = torch.zeros_like(kc)
    sc = torch.tensor([scale], device=device)
    d.reshape_and_cache_flash(key.to(device), key.to(device), kc, vc, torch.tensor([1], device=device),
                              kv_cache_dtype, sc, sc)
    if fmt is not layout.E4M3FNUZ:
        for cache in (kc, vc):
            got = cache.cpu()[0, 1, 0].tolist()
            for x, g, want in zip([3.0, -3.0, 0.0, -0.0], got, e4m3fn_bytes if kv_cache_dtype == "fp8" else e5m2_bytes):
                if want == NAN:
                    assert g in NAN_CODES[fmt.name], f"{x} / {scale}: {g:#x} is not a NaN of {fmt.name}"
                else:
                    assert g == want, f"{x} / {scale}: {g:#x} != {want:#x}"
        assert not kc.cpu()[0, 0].any(), "slot 0 written"
    # kernel vs reference on random inputs, with a normal scale on the other cache
    for k_scale, v_scale in ((scale, 0.05), (0.05, scale)):
        case = FlashCase(kv_cache_dtype=kv_cache_dtype, cache_dtype=torch.uint8, heads=2, dim=16, bs=4, num_blocks=2,
                         tokens=6, seed=13)
        case.k_scale, case.v_scale = torch.tensor([k_scale]), torch.tensor([v_scale])
        dev = case.base.clone().to(device)
        d.reshape_and_cache_flash(*case.args(device, dev))
        ref = case.base.clone()
        reference.reshape_and_cache_flash(*case.args("cpu", ref), e4m3=e4m3_for(device))
        _assert_fp8_bytes_equal(dev, ref, fmt, device, f"scale {scale}")


# --- reshape_and_cache_flash_kv ------------------------------------------------------------------------
KV = torch.ops.dsv4.reshape_and_cache_flash_kv.default


@pytest.mark.parametrize("kv_dim", [0, 1])
def test_kv_worked_example(device, kv_dim):
    """docs/ops/cache.md §3.3: H 2, D 4, bs 4, 2 blocks, slot_mapping [5, -1, 0]."""
    key = torch.arange(24, dtype=torch.float32).view(3, 2, 4).to(device)
    value = -key - 1
    kv = torch.full((2, 2, 4, 2, 4), -9.0, device=device)
    extra = (kv_dim,) if kv_dim else ()
    d.reshape_and_cache_flash_kv(key, value, kv, torch.tensor([5, -1, 0], device=device), "auto",
                                 torch.ones(1, device=device), torch.ones(1, device=device), *extra)
    want = torch.full((2, 2, 4, 2, 4), -9.0)
    k, v = key.cpu(), value.cpu()
    if kv_dim == 0:
        want[0, 1, 1], want[1, 1, 1], want[0, 0, 0], want[1, 0, 0] = k[0], v[0], k[2], v[2]
    else:
        want[1, 0, 1], want[1, 1, 1], want[0, 0, 0], want[0, 1, 0] = k[0], v[0], k[2], v[2]
    assert_bitwise_equal(kv.cpu(), want, f"kv_dim={kv_dim}")


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize("kv_dim", [0, 1])
@pytest.mark.parametrize("kv", [("auto", torch.bfloat16), ("fp8", torch.uint8), ("fp8_e5m2", torch.uint8)],
                         ids=lambda kv: kv[0])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_kv_equals_flash_on_the_two_halves(device, impl, kv_dim, kv, strided):
    if impl == "reference" and device.type != "cpu":
        pytest.skip("the reference is the CPU implementation")
    ctx = d.cpu_implementation({"kernel": "triton", "reference": "reference"}[impl]) if device.type == "cpu" \
        else contextlib.nullcontext()
    kv_cache_dtype, cache_dtype = kv
    key, value, full, slots = _flash_kv_args(device, kv_dim, kv_cache_dtype, cache_dtype, seed=kv_dim + 3)
    dim = full.shape[-1]
    if strided:   # kv_cache a view of a bigger buffer: rows padded by 3 elements
        g = torch.Generator().manual_seed(9)
        full = random_bytes_(torch.empty(full.shape[:-1] + (dim + 3,), dtype=cache_dtype), g).to(device)
    fp8 = kv_cache_dtype.startswith("fp8")
    ks, vs = scale_of(key.cpu(), fp8).to(device), (scale_of(value.cpu(), fp8) * 1.5).to(device)
    got_full, want_full = full.clone(), full.clone()
    got, want = got_full[..., :dim], want_full[..., :dim]
    assert got.is_contiguous() != strided
    with ctx:
        if kv_dim == 0:
            d.reshape_and_cache_flash_kv(key, value, got, slots, kv_cache_dtype, ks, vs)   # the default kv_dim
        else:
            d.reshape_and_cache_flash_kv(key, value, got, slots, kv_cache_dtype, ks, vs, kv_dim)
        d.reshape_and_cache_flash(key, value, want.select(kv_dim, 0), want.select(kv_dim, 1), slots, kv_cache_dtype,
                                  ks, vs)
    assert_bitwise_equal(got_full.cpu(), want_full.cpu(), f"kv_dim={kv_dim}")
    assert changed_mask(full.cpu(), got_full.cpu()).any(), "nothing written"


def _kv_good(device="cpu"):
    key, value, kv, slots = _flash_kv_args(device, kv_dim=1, kv_cache_dtype="auto", cache_dtype=torch.bfloat16)
    return [key, value, kv, slots, "auto", torch.ones(1, device=device), torch.ones(1, device=device), 1]


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("mutate,words", [
    pytest.param(lambda a: a.__setitem__(2, a[2][0]), "kv_cache must be 5-D", id="4-D"),
    pytest.param(lambda a: a.__setitem__(2, a[2].unsqueeze(0)), "kv_cache must be 5-D", id="6-D"),
    pytest.param(lambda a: a.__setitem__(7, 2), "kv_dim must be 0 or 1", id="kv_dim=2"),
    pytest.param(lambda a: a.__setitem__(7, -1), "kv_dim must be 0 or 1", id="kv_dim=-1"),
    pytest.param(lambda a: a.__setitem__(7, 0), r"kv_cache.shape\[0\] \(kv_dim\) must be 2", id="kv_dim-wrong"),
    pytest.param(lambda a: a.__setitem__(2, torch.cat([a[2], a[2][:, :1]], 1)),
                 r"kv_cache.shape\[1\] \(kv_dim\) must be 2", id="three-halves"),
    pytest.param(lambda a: a.__setitem__(2, a[2][..., :1, :]), r"kv_cache.select\(1, 0\)", id="heads"),
    pytest.param(lambda a: a.__setitem__(2, a[2][..., :8]), r"kv_cache.select\(1, 0\)", id="head-size"),
    pytest.param(lambda a: a.__setitem__(2, a[2][:, :, :0]), r"kv_cache.select\(1, 0\) has block size 0",
                 id="block-size-0"),
    pytest.param(lambda a: a.__setitem__(2, a[2].view(torch.int16)), "kv_cache_dtype", id="int16-cache"),
    pytest.param(lambda a: a.__setitem__(3, a[3].float()), "slot_mapping", id="float-slots"),
    pytest.param(lambda a: a.__setitem__(6, torch.ones(2)), "v_scale", id="v_scale-shape"),
])
def test_kv_bad_input_errors(device, impl, mutate, words):
    if impl == "reference" and device.type != "cpu":
        pytest.skip("the reference is the CPU implementation")
    ctx = d.cpu_implementation(impl) if device.type == "cpu" else contextlib.nullcontext()
    args = _kv_good(device)
    mutate(args)
    before = args[2].clone()
    with ctx, pytest.raises(ValueError, match=words):
        KV(*args)
    assert_bitwise_equal(args[2], before, "kv_cache after an error")


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("kv_dim", [0, 1])
def test_opcheck_kv(device, impl, kv_dim):
    if impl == "reference" and device.type != "cpu":
        pytest.skip("the reference is the CPU implementation")
    ctx = d.cpu_implementation(impl) if device.type == "cpu" else contextlib.nullcontext()
    key, value, kv, slots = _flash_kv_args(device, kv_dim, seed=2, tokens=5)
    scale = torch.tensor([0.05], device=device)
    args = (key, value, kv, slots, "fp8", scale, scale * 2) + ((kv_dim,) if kv_dim else ())
    with ctx:
        run_opcheck(KV, args, permute=lambda i, t: i in (0, 1))


@pytest.mark.parametrize("kv_dim", [0, 1])
def test_compile_kv_no_recompile(device, kv_dim):
    def step(key, value, kv, slots, k_scale, v_scale):
        d.reshape_and_cache_flash_kv(key, value, kv, slots, "fp8", k_scale, v_scale, kv_dim)
        return kv

    inputs = []
    for n in (5, 8, 11):   # token counts (and n + 1 key rows) of no cache dimension: no duck-sizing guard
        key, value, kv, slots = _flash_kv_args(device, kv_dim, tokens=n, seed=n)
        inputs.append((key, value, kv, slots, torch.tensor([0.05], device=device), torch.tensor([0.1], device=device)))
    check_compile(step, inputs)


# --- pytorch/pytorch#198068 and its workaround ---------------------------------------------------------
def _compiled_vs_eager(step, device, kv_dim):
    """Compile `step` (inductor, fullgraph, dynamic); for 3 token counts, the kv buffer written by
    the compiled and the eager step must be bitwise equal."""
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="inductor", fullgraph=True, dynamic=True)
    nb, bs, heads, dim = 2, 4, 2, 16
    for n in (3, 5, 6):
        g = torch.Generator().manual_seed(n)
        key = torch.randn(n, heads, dim, generator=g).to(device)
        value = torch.randn(n, heads, dim, generator=g).to(device)
        slots = torch.randperm(nb * bs, generator=g)[:n].to(device)
        shape = (2, nb, bs, heads, dim) if kv_dim == 0 else (nb, 2, bs, heads, dim)
        kv = torch.randn(shape, generator=g).to(device)
        ones = torch.ones(1, device=device)
        eager, got = kv.clone(), kv.clone()
        step(key, value, eager, slots, ones, ones)
        compiled(key, value, got, slots, ones, ones)
        assert changed_mask(kv, eager).any()
        assert_bitwise_equal(got, eager, f"T={n}: compiled vs eager")


@pytest.mark.xfail(strict=False, reason="pytorch/pytorch#198068: under dynamic shapes inductor drops the symbolic "
                                        "storage offset of a mutated view argument, so kv_cache[1] is written at "
                                        "kv_cache[0]")
def test_compile_flash_on_views_of_one_buffer(device):
    def step(key, value, kv, slots, ks, vs):
        d.reshape_and_cache_flash(key, value, kv[0], kv[1], slots, "auto", ks, vs)

    _compiled_vs_eager(step, device, 0)


@pytest.mark.parametrize("kv_dim", [0, 1])
def test_compile_kv_workaround(device, kv_dim):
    """The workaround for pytorch#198068: one mutated buffer, reshape_and_cache_flash_kv."""
    if kv_dim == 0:
        def step(key, value, kv, slots, ks, vs):
            d.reshape_and_cache_flash_kv(key, value, kv, slots, "auto", ks, vs)
    else:
        def step(key, value, kv, slots, ks, vs):
            d.reshape_and_cache_flash_kv(key, value, kv, slots, "auto", ks, vs, 1)

    _compiled_vs_eager(step, device, kv_dim)
