"""silu_mul (kernels/silu_mul.cpp): the MLP's silu(gate) * up, whose every element has the same bits
wherever it sits in a row, on every ISA; the decode stack and the layer path both call it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.model import kernels

pytestmark = pytest.mark.skipif(kernels.load() is None, reason=f"kernels unavailable: {kernels.load_error()}")

DTYPES = [torch.float32, torch.bfloat16]


def _pair(rows: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, n, generator=g) * 4).to(dtype), torch.randn(rows, n, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1536, 112, 100, 7, 1])
def test_silu_mul_matches_torch_within_a_rounding(each_isa, dtype, n):
    gate, up = _pair(9, n, dtype)
    got = kernels.load().silu_mul(gate, up)
    want = F.silu(gate.float()) * up.float()
    # float32: within a few ulps of exp's; bfloat16: silu and the product each rounded once, as torch does
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-6)
    assert got.dtype == dtype and got.shape == (9, n) and got.is_contiguous()
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_elements_bits_do_not_depend_on_where_it_sits_in_a_row(each_isa, dtype):
    # ATen's silu computes a row's last few elements with another exp than the rest; ours must not
    gate, up = _pair(1, 16 * 3 * 5 * 7, dtype, seed=1)
    module = kernels.load()
    flat = module.silu_mul(gate, up).flatten()
    for width in (1, 3, 7, 8, 15, 16, 21, 35, 105, 112, 120, 240):
        assert torch.equal(module.silu_mul(gate.view(-1, width), up.view(-1, width)).flatten(), flat), width


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_reads_the_halves_of_a_fused_gate_up_output(each_isa, dtype):
    gate, up = _pair(6, 112, dtype, seed=2)
    fused = torch.cat([gate, up], dim=1)
    module = kernels.load()
    assert torch.equal(module.silu_mul(fused[:, :112], fused[:, 112:]), module.silu_mul(gate, up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_has_the_same_bits_on_every_isa(dtype):
    gate, up = _pair(5, 100, dtype, seed=3)
    outs = {}
    for isa in kernels.cpu_isas():
        with kernels.using_isa(isa):
            outs[isa] = kernels.load().silu_mul(gate, up)
    first = next(iter(outs.values()))
    assert all(torch.equal(o, first) for o in outs.values()), list(outs)


def test_a_rows_bits_do_not_depend_on_the_batch_or_the_thread_count(each_isa):
    gate, up = _pair(64, 1536, torch.bfloat16, seed=4)
    module = kernels.load()
    batched = module.silu_mul(gate, up)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([module.silu_mul(gate[i:i + 1], up[i:i + 1]) for i in range(64)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, alone)


def test_extreme_gates_give_silus_limits(each_isa):
    gate = torch.tensor([[0.0, -0.0, 100.0, -100.0, 30.0, -30.0, float("inf"), float("nan")]])
    up = torch.ones_like(gate)
    got = kernels.load().silu_mul(gate, up)[0]
    assert got[0] == 0 and got[1] == 0
    assert got[2] == 100.0 and got[4] == 30.0 and got[6] == float("inf")
    assert -1e-30 < got[3] <= 0 and -1e-10 < got[5] < 0
    assert torch.isnan(got[7])


def test_silu_mul_refuses_mismatched_shapes_and_dtypes():
    module = kernels.load()
    with pytest.raises(ValueError, match="silu_mul"):
        module.silu_mul(torch.zeros(2, 4), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="silu_mul"):
        module.silu_mul(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="silu_mul"):
        module.silu_mul(torch.zeros(4, 2).t(), torch.zeros(4, 2).t())
