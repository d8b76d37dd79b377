"""The dense bfloat16 kernel (kernels/dense_bf16.cpp) on every ISA, and its tiled weights."""

from __future__ import annotations

import pytest
import torch

from kiln.model import kernels
from kiln.model.dense_tiles import attach_dense_tiles, dense_linear, tile_weight
from kiln.model.loader import load_model

from .conftest import make_hf


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


@pytest.mark.parametrize(("n", "k", "m"), [(576, 576, 8), (50, 33, 13), (1536, 576, 3), (200, 64, 1), (130, 576, 2)])
def test_every_isa_gives_the_scalar_paths_bits(module, each_isa, n, k, m) -> None:
    w, b, x = _case(n, k, m, seed=1)
    tiles = tile_weight(w).tiles
    level = kernels.ISA_LEVELS[each_isa]
    assert torch.equal(module.linear_bf16(x, tiles, n, k, b), module.linear_bf16(x, tiles, n, k, b, isa=0))
    assert torch.equal(module.linear_bf16(x, tiles, n, k, b, isa=level, out_float=True),
                       module.linear_bf16(x, tiles, n, k, b, isa=0, out_float=True))


def test_denormals_are_flushed_on_every_isa(module, each_isa) -> None:
    # as vdpbf16ps does: denormal results become zero, denormal inputs read as zero
    w = torch.zeros(16, 4)
    w[0] = 1e-20
    w[3] = torch.tensor([0.0, 1.0, 0.0, 1.0])
    x = torch.tensor([[1e-20, 1e-20, 1e-20, 1e-20], [0.0, 1.2e-38, 0.0, 5e-39]]).bfloat16()
    tiles = tile_weight(w.bfloat16()).tiles
    y = module.linear_bf16(x, tiles, 16, 4, None, out_float=True)
    assert torch.equal(y, module.linear_bf16(x, tiles, 16, 4, None, isa=0, out_float=True))
    assert y[0, 0] == 0   # four products of 1e-40
    assert y[1, 3] == x[1, 1].float()   # 1.2e-38 plus a denormal read as zero


def test_a_row_gets_the_same_bits_alone_or_in_any_batch(module, each_isa) -> None:
    w, b, x = _case(1536, 576, 13, seed=2)
    tiles = tile_weight(w).tiles
    batch = module.linear_bf16(x, tiles, 1536, 576, b)
    for i in (0, 7, 12):
        assert torch.equal(module.linear_bf16(x[i:i + 1], tiles, 1536, 576, b)[0], batch[i])
    for lo, hi in ((5, 11), (1, 3), (2, 5), (0, 8)):
        assert torch.equal(module.linear_bf16(x[lo:hi], tiles, 1536, 576, b), batch[lo:hi])


def test_the_thread_count_does_not_change_a_bit(module, each_isa) -> None:
    w, b, x = _case(4096, 576, 3, seed=4)
    tiles = tile_weight(w).tiles
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = module.linear_bf16(x, tiles, 4096, 576, b, out_float=True)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(module.linear_bf16(x, tiles, 4096, 576, b, out_float=True), alone)
    finally:
        torch.set_num_threads(threads)


def test_an_isa_the_cpu_lacks_is_refused(module) -> None:
    if "avx512" in kernels.cpu_isas():
        pytest.skip("this CPU runs every ISA")
    w, b, x = _case(16, 8, 1)
    with pytest.raises(ValueError, match="not supported by this CPU"):
        module.linear_bf16(x, tile_weight(w).tiles, 16, 8, b, isa=kernels.ISA_LEVELS["avx512"])


def test_float_output_is_the_unrounded_sum(module) -> None:
    w, b, x = _case(64, 96, 4, seed=3)
    tiles = tile_weight(w).tiles
    yf = module.linear_bf16(x, tiles, 64, 96, b, out_float=True)
    assert yf.dtype == torch.float32
    assert torch.equal(yf.bfloat16(), module.linear_bf16(x, tiles, 64, 96, b))


def test_a_bfloat16_cpu_model_gets_tiles_on_any_isa_and_a_float32_one_does_not(tmp_path) -> None:
    path = tmp_path / "llama"
    make_hf("llama").save_pretrained(path, safe_serialization=True)
    bf16, _ = load_model(path, dtype="bfloat16")
    fp32, _ = load_model(path, dtype="float32")
    expected = kernels.load() is not None
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
