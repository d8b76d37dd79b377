"""K-quant tiles back into dense weights (kernels/kquant_dequant.cpp), the weights training and scoring
from blocks use: every ISA gives the scalar path's bits, in float32 and bfloat16, for any number of rows
and superblocks, and the scalar path gives gguf.quants.dequantize's values."""

from __future__ import annotations

import pytest
import torch

from kiln.model import kernels, kquant
from kiln.model.quant import _KIND_IDS, kernels_available
from kiln.testing.kquant_blocks import random_blocks

from .test_qlinear_kquant import gguf_dense

needs_kernels = pytest.mark.skipif(not kernels_available(), reason=f"kernels unavailable: {kernels.load_error()}")
KINDS = ["q4_k", "q5_k", "q6_k"]
SHAPES = [(1, 256), (7, 512), (16, 768), (37, 512), (53, 1024)]


def dense(kind: str, n: int, k: int, isa: str, bf16: bool, seed: int = 0, scale: float = 0.01) -> torch.Tensor:
    blocks = random_blocks(kind, n, k, seed=seed, scale=scale)
    pw = kquant.pack_from_gguf(kind, blocks, (n, k))
    return kernels.load().kquant_dequantize(pw.qs, pw.scales, _KIND_IDS[kind], n, k, bf16,
                                            isa=kernels.ISA_LEVELS[isa])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(view), b.view(view))


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bf16", [False, True])
def test_every_isa_dequantizes_to_the_scalar_paths_bits(kind: str, shape: tuple[int, int], bf16: bool) -> None:
    n, k = shape
    want = dense(kind, n, k, "scalar", bf16, seed=n)
    for isa in kernels.cpu_isas()[1:]:
        assert same_bits(dense(kind, n, k, isa, bf16, seed=n), want), isa


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale", [1e-6, 30.0])
def test_subnormal_and_large_factors_give_the_same_bits_on_every_isa(kind: str, scale: float) -> None:
    # float16 factors below 6e-5 are subnormal; large ones make products that round in float32
    for bf16 in (False, True):
        want = dense(kind, 37, 512, "scalar", bf16, seed=4, scale=scale)
        for isa in kernels.cpu_isas()[1:]:
            assert same_bits(dense(kind, 37, 512, isa, bf16, seed=4, scale=scale), want), (isa, bf16)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_the_scalar_path_gives_gguf_values(kind: str) -> None:
    blocks = random_blocks(kind, 37, 512, seed=37)
    assert same_bits(dense(kind, 37, 512, "scalar", False, seed=37), gguf_dense(kind, blocks, 37, 512))


@needs_kernels
def test_a_call_naming_no_isa_runs_the_forced_one_to_the_same_bits(each_isa: str) -> None:
    pw = kquant.pack_from_gguf("q4_k", random_blocks("q4_k", 20, 256, seed=2), (20, 256))
    got = kernels.load().kquant_dequantize(pw.qs, pw.scales, _KIND_IDS["q4_k"], 20, 256, False)
    assert same_bits(got, dense("q4_k", 20, 256, "scalar", False, seed=2))


def dense_t(kind: str, n: int, k: int, k0: int, k1: int, isa: str, bf16: bool, *, torch_threads: bool = False,
            seed: int = 0, scale: float = 0.01) -> torch.Tensor:
    blocks = random_blocks(kind, n, k, seed=seed, scale=scale)
    pw = kquant.pack_from_gguf(kind, blocks, (n, k))
    return kernels.load().kquant_dequantize_t(pw.qs, pw.scales, _KIND_IDS[kind], n, k, k0, k1, bf16,
                                              isa=kernels.ISA_LEVELS[isa], torch_threads=torch_threads)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [*SHAPES, (64, 512), (600, 256)])
@pytest.mark.parametrize("bf16", [False, True])
def test_the_transposed_pass_gives_the_columns_bits_on_every_isa(kind: str, shape: tuple[int, int], bf16: bool) -> None:
    """Any whole superblocks of columns, transposed: the row-major pass's bits (partial tiles, several
    tile blocks, one and many superblocks)."""
    n, k = shape
    want = dense(kind, n, k, "scalar", bf16, seed=n)
    for k0, k1 in {(0, k), (0, 256), (k - 256, k), (256, k), (0, 0)}:
        if k0 > k1 or k0 < 0:
            continue
        cols = want[:, k0:k1].t().contiguous()
        for isa in kernels.cpu_isas():
            for torch_threads in (False, True):
                got = dense_t(kind, n, k, k0, k1, isa, bf16, torch_threads=torch_threads, seed=n)
                assert same_bits(got, cols), (isa, k0, k1, torch_threads)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale", [1e-6, 30.0])
def test_the_transposed_pass_keeps_subnormal_and_large_factors_bits(kind: str, scale: float) -> None:
    for bf16 in (False, True):
        want = dense(kind, 37, 512, "scalar", bf16, seed=4, scale=scale).t().contiguous()
        for isa in kernels.cpu_isas():
            assert same_bits(dense_t(kind, 37, 512, 0, 512, isa, bf16, seed=4, scale=scale), want), (isa, bf16)


@needs_kernels
def test_the_passes_give_the_same_bits_on_torchs_threads() -> None:
    pw = kquant.pack_from_gguf("q5_k", random_blocks("q5_k", 90, 512, seed=3), (90, 512))
    module = kernels.load()
    for bf16 in (False, True):
        pool = module.kquant_dequantize(pw.qs, pw.scales, _KIND_IDS["q5_k"], 90, 512, bf16)
        torch_pool = module.kquant_dequantize(pw.qs, pw.scales, _KIND_IDS["q5_k"], 90, 512, bf16, torch_threads=True)
        assert same_bits(torch_pool, pool)
        out = torch.empty(256, 90, dtype=pool.dtype)
        got = module.kquant_dequantize_t(pw.qs, pw.scales, _KIND_IDS["q5_k"], 90, 512, 256, 512, bf16, out=out)
        assert got.data_ptr() == out.data_ptr() and same_bits(out, pool[:, 256:].t().contiguous())


@needs_kernels
@pytest.mark.parametrize("k0, k1", [(0, 100), (128, 512), (256, 768), (512, 256)])
def test_the_transposed_pass_takes_only_whole_superblocks_within_the_weight(k0: int, k1: int) -> None:
    pw = kquant.pack_from_gguf("q4_k", random_blocks("q4_k", 16, 512, seed=1), (16, 512))
    with pytest.raises(ValueError, match="whole superblocks"):
        kernels.load().kquant_dequantize_t(pw.qs, pw.scales, _KIND_IDS["q4_k"], 16, 512, k0, k1, True)


@needs_kernels
def test_a_packed_weights_transposed_columns_are_its_dense_columns() -> None:
    pw = kquant.pack_from_gguf("q6_k", random_blocks("q6_k", 40, 768, seed=5), (40, 768))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(pw.dequantize_t(dtype, 256, 768), pw.dequantize(dtype)[:, 256:].t())
