"""Quantized weights with float activations (kernels/qlinear_float.cpp, `--quantization gguf-float`):
the dequantized weight's product up to float32 rounding, the same bits on every ISA, for any batch."""

from __future__ import annotations

import pytest
import torch

from kiln.model import kernels
from kiln.model.quant import PackedWeight, kernels_available, pack_q4_1, pack_q8_0, quant_linear

from .test_quant import activations, same_with_one_and_two_threads, weight

needs_kernels = pytest.mark.skipif(not kernels_available(), reason=f"kernels unavailable: {kernels.load_error()}")
KINDS = ["q4_1", "q8_0"]


def float_packed(kind: str, w: torch.Tensor) -> PackedWeight:
    packed = pack_q4_1(w) if kind == "q4_1" else pack_q8_0(w)
    packed.float_act = True
    return packed


def supported_isas() -> list[str]:
    return kernels.cpu_isas() if kernels.load() is not None else []


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k"), [(40, 1536), (576, 576), (33, 100)])
def test_the_result_is_the_dequantized_weights_product(kind: str, n: int, k: int) -> None:
    packed = float_packed(kind, weight(n, k))
    x = activations(6, k)
    want = x.double() @ packed.dequantize(torch.float64).T
    got = quant_linear(x, packed)
    assert got.dtype == torch.float32
    # float32 rounding only: far tighter than 8-bit activations could be
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max() + 1e-6


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# one-row decode, side-by-side tiles, the prefill panel (AVX2: 3-row blocks, then a 2- or 1-row rest;
# AVX-512: tiles in pairs, 4-row blocks, then a 1- to 3-row rest)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 11])
def test_every_code_path_gives_identical_bits(kind: str, dtype: torch.dtype, m: int) -> None:
    packed = float_packed(kind, weight(72, 1000))
    x = activations(m, 1000, dtype)
    bias = torch.randn(72)
    outputs = [quant_linear(x, packed, bias, isa=isa) for isa in supported_isas()]
    assert outputs[0].dtype == dtype
    for y in outputs[1:]:
        assert torch.equal(y, outputs[0])


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gives_the_same_bits_alone_or_in_any_batch(kind: str) -> None:
    packed = float_packed(kind, weight(100, 576))
    x = activations(9, 576)
    batched = quant_linear(x, packed)
    for i in range(9):
        assert torch.equal(quant_linear(x[i : i + 1], packed)[0], batched[i])
    assert torch.equal(quant_linear(x[2:7], packed), batched[2:7])


@needs_kernels
def test_more_threads_give_the_same_result() -> None:
    assert same_with_one_and_two_threads(float_packed("q4_1", weight(3072, 576)), activations(6, 576))


@needs_kernels
def test_float_activations_are_closer_than_8_bit_ones() -> None:
    w = weight(64, 576)
    x = activations(4, 576)
    floats = float_packed("q4_1", w)
    ints = pack_q4_1(w)
    want = x.double() @ floats.dequantize(torch.float64).T
    err_float = (quant_linear(x, floats).double() - want).abs().max()
    err_int = (quant_linear(x, ints).double() - want).abs().max()
    assert err_float * 100 < err_int


@needs_kernels
def test_leading_dimensions_and_bias_are_kept() -> None:
    packed = float_packed("q8_0", weight(20, 64))
    x = activations(6, 64).view(2, 3, 64)
    bias = torch.randn(20)
    y = quant_linear(x, packed, bias)
    assert y.shape == (2, 3, 20)
    assert torch.allclose(y, x @ packed.dequantize().T + bias, atol=1e-4)


def test_the_flag_survives_moves_row_selection_and_concatenation() -> None:
    from kiln.model.quant import concat_packed

    a, b = float_packed("q4_1", weight(32, 64)), float_packed("q4_1", weight(16, 64, seed=3))
    assert a.to("cpu").float_act and a.select_rows([1, 0, 2]).float_act
    assert concat_packed([a, b]).float_act and concat_packed([b, a, b]).float_act
