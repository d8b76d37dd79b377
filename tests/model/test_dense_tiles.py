"""The AVX512-BF16 dense kernel (kernels/dense_bf16.cpp) and its tiled weights."""

from __future__ import annotations

import pytest
import torch

from kiln.model import kernels
from kiln.model.dense_tiles import attach_dense_tiles, dense_linear, tile_weight
from kiln.model.loader import load_model

from .conftest import make_hf


@pytest.fixture(scope="module")
def module():
    mod = kernels.load()
    if mod is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    return mod


def _case(n: int, k: int, m: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    return w, b, x


def test_tiles_hold_each_weight_at_its_documented_place() -> None:
    w = torch.arange(37 * 9, dtype=torch.float32).view(37, 9).bfloat16()
    t = tile_weight(w).tiles
    assert t.shape == (3, 5, 32)
    for n, k in [(0, 0), (5, 3), (16, 8), (36, 7)]:
        assert t[n // 16, k // 2, 2 * (n % 16) + k % 2] == w[n, k]
    assert t[2, 4, 2 * 4 + 1] == 0   # K padding
    assert bool((t[2, :, 2 * 5:] == 0).all())   # rows past N


@pytest.mark.parametrize(("n", "k"), [(576, 576), (50, 33), (16, 2), (1536, 576)])
@pytest.mark.parametrize("m", [1, 3, 8, 13])
def test_kernel_matches_a_float_matmul_to_bfloat16_rounding(module, n, k, m) -> None:
    w, b, x = _case(n, k, m)
    y = module.linear_bf16(x, tile_weight(w).tiles, n, k, b)
    ref = x.float() @ w.float().T + b.float()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize(("n", "k", "m"), [(576, 576, 8), (50, 33, 13), (1536, 576, 3)])
def test_vector_and_scalar_paths_give_identical_bits(module, n, k, m) -> None:
    if not module.bf16_dot_supported():
        pytest.skip("no AVX512-BF16 on this CPU: only the scalar path runs")
    w, b, x = _case(n, k, m, seed=1)
    tiles = tile_weight(w).tiles
    assert torch.equal(module.linear_bf16(x, tiles, n, k, b), module.linear_bf16(x, tiles, n, k, b, isa=0))
    assert torch.equal(module.linear_bf16(x, tiles, n, k, b, out_float=True),
                       module.linear_bf16(x, tiles, n, k, b, isa=0, out_float=True))


def test_a_row_gets_the_same_bits_alone_or_in_any_batch(module) -> None:
    w, b, x = _case(1536, 576, 13, seed=2)
    tiles = tile_weight(w).tiles
    batch = module.linear_bf16(x, tiles, 1536, 576, b)
    for i in (0, 7, 12):
        assert torch.equal(module.linear_bf16(x[i:i + 1], tiles, 1536, 576, b)[0], batch[i])
    assert torch.equal(module.linear_bf16(x[5:11], tiles, 1536, 576, b), batch[5:11])


def test_float_output_is_the_unrounded_sum(module) -> None:
    w, b, x = _case(64, 96, 4, seed=3)
    tiles = tile_weight(w).tiles
    yf = module.linear_bf16(x, tiles, 64, 96, b, out_float=True)
    assert yf.dtype == torch.float32
    assert torch.equal(yf.bfloat16(), module.linear_bf16(x, tiles, 64, 96, b))


def test_a_bfloat16_cpu_model_gets_tiles_and_a_float32_one_does_not(tmp_path) -> None:
    path = tmp_path / "llama"
    make_hf("llama").save_pretrained(path, safe_serialization=True)
    bf16, _ = load_model(path, dtype="bfloat16")
    fp32, _ = load_model(path, dtype="float32")
    expected = kernels.load() is not None and kernels.load().bf16_dot_supported()
    assert hasattr(bf16.model.layers[0].self_attn.q_proj, "dense_tiles") == expected
    assert hasattr(bf16.lm_head, "dense_tiles") == expected
    assert not hasattr(fp32.model.layers[0].mlp.down_proj, "dense_tiles")
    assert not attach_dense_tiles(fp32)


def test_dense_linear_falls_back_to_torch_under_autograd_and_for_other_dtypes(module) -> None:
    lin = torch.nn.Linear(32, 16).bfloat16()
    lin.dense_tiles = tile_weight(lin.weight)
    x = torch.randn(2, 32).bfloat16()
    torch.testing.assert_close(dense_linear(x, lin), lin(x), atol=2e-2, rtol=1e-2)
    xg = torch.randn(2, 32, dtype=torch.bfloat16, requires_grad=True)
    assert dense_linear(xg, lin).requires_grad   # torch ran: the kernel has no autograd
    assert dense_linear(x.float(), torch.nn.Linear(32, 16)).dtype == torch.float32
