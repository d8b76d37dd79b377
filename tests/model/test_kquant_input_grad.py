"""grad @ W straight from K-quant tiles (kernels/kquant_input_grad.cpp), the backward's input gradient
on a CPU without bfloat16 dot products: every output is one chain of fused multiply-adds over the
weight's rows in order, so every ISA gives the scalar path's bits, whatever the batch or the thread
count, and the values are the product with the dense bfloat16 weight up to float32 rounding."""

from __future__ import annotations

import pytest
import torch

from kiln.model import kernels, kquant
from kiln.model.quant import _KIND_IDS, kernels_available
from kiln.testing.kquant_blocks import random_blocks

needs_kernels = pytest.mark.skipif(not kernels_available(), reason=f"kernels unavailable: {kernels.load_error()}")
KINDS = ["q4_k", "q5_k", "q6_k"]
SHAPES = [(1, 256), (7, 512), (16, 768), (37, 512), (53, 1024)]   # (n, k): partial tiles, several superblocks


def packed(kind: str, n: int, k: int, seed: int = 0, scale: float = 0.01):
    return kquant.pack_from_gguf(kind, random_blocks(kind, n, k, seed=seed, scale=scale), (n, k))


def input_grad(pw, grad: torch.Tensor, isa: str) -> torch.Tensor:
    return kernels.load().kquant_input_grad(pw.qs, pw.scales, _KIND_IDS[pw.kind], pw.out_features, pw.in_features,
                                            grad, isa=kernels.ISA_LEVELS[isa])


def grads(m: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, n, generator=torch.Generator().manual_seed(seed))


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 70])
def test_every_isa_gives_the_scalar_paths_bits(kind: str, shape: tuple[int, int], m: int) -> None:
    n, k = shape
    pw, g = packed(kind, n, k, seed=n), grads(m, n)
    want = input_grad(pw, g, "scalar")
    for isa in kernels.cpu_isas()[1:]:
        assert torch.equal(input_grad(pw, g, isa), want), isa


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_the_product_is_the_dense_bfloat16_weights_up_to_float32_rounding(kind: str) -> None:
    pw, g = packed(kind, 53, 1024, seed=3), grads(9, 53)
    want = g.double() @ pw.dequantize(torch.bfloat16).double()
    got = input_grad(pw, g, kernels.cpu_isas()[-1])
    assert got.dtype == torch.float32 and got.shape == (9, 1024)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=float(want.abs().max()) * 2.0 ** -20)


@needs_kernels
def test_the_scalar_path_sums_each_output_as_one_fused_chain_over_the_rows_in_order() -> None:
    pw, g = packed("q4_k", 37, 256, seed=5), grads(3, 37)
    w = pw.dequantize(torch.bfloat16).double()
    acc = torch.zeros(3, 256, dtype=torch.float64)
    for i in range(37):   # a float32 fma: the exact product and sum, rounded once (exact in float64 here)
        acc = (acc + g[:, i:i + 1].double() * w[i]).float().double()
    assert torch.equal(input_grad(pw, g, "scalar"), acc.float())


@needs_kernels
def test_a_row_gives_the_same_bits_alone_and_in_any_batch() -> None:
    pw, g = packed("q6_k", 40, 512, seed=7), grads(300, 40)   # 300 rows: more than one task's rows
    isa = kernels.cpu_isas()[-1]
    whole = input_grad(pw, g, isa)
    for rows in ([0], [299], list(range(17, 29))):
        assert torch.equal(input_grad(pw, g[rows], isa), whole[rows]), rows


@needs_kernels
def test_the_thread_count_changes_no_bit() -> None:
    pw, g = packed("q5_k", 64, 768, seed=9), grads(40, 64)
    isa = kernels.cpu_isas()[-1]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = input_grad(pw, g, isa)
        torch.set_num_threads(max(2, before))
        assert torch.equal(input_grad(pw, g, isa), one)
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_a_packed_weight_multiplies_any_leading_shape_and_declines_what_it_cannot() -> None:
    pw = packed("q4_k", 32, 512, seed=11)
    g = torch.randn(2, 3, 32)
    got = pw.input_grad(g)
    assert got is not None and got.shape == (2, 3, 512)
    assert torch.equal(got.reshape(6, 512), pw.input_grad(g.reshape(6, 32)))
    assert pw.input_grad(g.double()) is None


@needs_kernels
def test_a_gradient_of_the_wrong_width_is_refused() -> None:
    pw = packed("q4_k", 32, 512)
    with pytest.raises(ValueError, match="grad must be"):
        input_grad(pw, torch.randn(4, 31), "scalar")
