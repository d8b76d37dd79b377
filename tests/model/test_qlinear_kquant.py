"""K-quant weights from their own blocks (kernels/qlinear_kquant.cpp, qlinear_kquant_q8.cpp,
kiln/model/kquant.py): GGUF Q4_K, Q5_K and Q6_K blocks repacked into tiles of the same bytes, multiplied
with float activations (the dequantized weight's product up to float32 rounding) or with 8-bit ones
(llama.cpp's arithmetic: the product with the activations quantized per superblock of 256, the
sub-block scales applied in integers), the same bits on every ISA, for any batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from kiln.model import kernels, kquant, quant
from kiln.model.quant import (
    concat_packed,
    kernels_available,
    quant_linear,
    quant_linear_reference,
    quantize_activations_reference,
)
from kiln.testing.kquant_blocks import BLOCK_BYTES, GGUF_TYPES, random_blocks

from .test_quant import activations, same_with_one_and_two_threads

needs_kernels = pytest.mark.skipif(not kernels_available(), reason=f"kernels unavailable: {kernels.load_error()}")
KINDS = ["q4_k", "q5_k", "q6_k"]
ACTIVATIONS = ["float", "int8"]


def packed(kind: str, n: int, k: int, activations: str = "float", seed: int = 0) -> quant.PackedWeight:
    pw = kquant.pack_from_gguf(kind, random_blocks(kind, n, k, seed=seed), (n, k))
    pw.float_act = activations == "float"
    return pw


def gguf_dense(kind: str, blocks: np.ndarray, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks.reshape(-1), GGUF_TYPES[kind]).reshape(n, k).copy())


def supported_isas() -> list[str]:
    return kernels.cpu_isas() if kernels.load() is not None else []


@pytest.mark.parametrize("kind", KINDS)
def test_the_tiles_keep_the_blocks_bytes(kind: str) -> None:
    pw = kquant.pack_from_gguf(kind, random_blocks(kind, 32, 512), (32, 512))
    assert pw.nbytes == 32 * 2 * BLOCK_BYTES[kind]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [16, 37])
def test_the_tiles_dequantize_exactly_as_gguf_does(kind: str, n: int) -> None:
    blocks = random_blocks(kind, n, 768, seed=n)
    pw = kquant.pack_from_gguf(kind, blocks, (n, 768))
    assert torch.equal(pw.dequantize(), gguf_dense(kind, blocks, n, 768))


@pytest.mark.parametrize("kind", KINDS)
def test_a_few_tiles_at_a_time_or_only_the_rows_asked_for_dequantize_to_the_same_values(kind: str, monkeypatch) -> None:
    blocks = random_blocks(kind, 37, 512, seed=3)
    pw = kquant.pack_from_gguf(kind, blocks, (37, 512))
    whole = gguf_dense(kind, blocks, 37, 512)
    monkeypatch.setattr(quant, "DEQUANT_CHUNK_TILES", 1)   # 3 tiles, the last one partial
    assert torch.equal(pw.dequantize(), whole)
    rows = torch.tensor([[36, 0, 17], [17, 5, 36]])
    assert torch.equal(pw.dequantize_rows(rows), whole[rows])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_looked_up_rows_are_the_gguf_values_with_or_without_the_kernels(kind: str, dtype: torch.dtype,
                                                                         monkeypatch) -> None:
    blocks = random_blocks(kind, 37, 512, seed=5)
    pw = kquant.pack_from_gguf(kind, blocks, (37, 512))
    want = gguf_dense(kind, blocks, 37, 512).to(dtype)
    rows = torch.tensor([[36, 0, 17], [17, 5, 36]])
    assert torch.equal(pw.dequantize_rows(rows, dtype), want[rows])   # the C++ pass where it is built
    monkeypatch.setenv(quant.DISABLE_ENV, "1")
    quant.refresh_from_env()
    try:
        assert torch.equal(pw.dequantize_rows(rows, dtype), want[rows])   # the torch ops
    finally:
        monkeypatch.delenv(quant.DISABLE_ENV)
        quant.refresh_from_env()


@pytest.mark.parametrize("kind", KINDS)
def test_row_selection_and_concatenation_move_whole_rows(kind: str) -> None:
    blocks = random_blocks(kind, 40, 256)
    pw = kquant.pack_from_gguf(kind, blocks, (40, 256))
    dense = gguf_dense(kind, blocks, 40, 256)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pw.select_rows(order).dequantize(), dense[order])
    assert torch.equal(kquant.pack_from_gguf(kind, blocks, (40, 256), order).dequantize(), dense[order])
    both = concat_packed([pw, pw.select_rows(range(5))])
    assert torch.equal(both.dequantize(), torch.cat([dense, dense[:5]]))


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k"), [(40, 1536), (64, 256), (33, 512)])
def test_the_result_is_the_dequantized_weights_product(kind: str, n: int, k: int) -> None:
    blocks = random_blocks(kind, n, k)
    pw = kquant.pack_from_gguf(kind, blocks, (n, k))
    x = activations(6, k)
    want = x.double() @ gguf_dense(kind, blocks, n, k).double().T
    got = quant_linear(x, pw)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max() + 1e-6


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_activations_are_quantized_per_superblock_exactly_as_the_reference(dtype: torch.dtype) -> None:
    x = (activations(5, 1024) * torch.logspace(-3, 3, 5)[:, None]).to(dtype)
    x[2, 256:512] = 0.0
    want_q, want_d, _ = quantize_activations_reference(x, 256)
    sums16 = want_q.view(5, -1, 16).sum(-1).to(torch.int16)
    sums32 = want_q.view(5, -1, 32).sum(-1).to(torch.int16)
    for isa in supported_isas():
        q, d, b16, b32 = kernels.load().quantize_activations_256(x, kernels.ISA_LEVELS[isa])
        assert torch.equal(q, want_q) and torch.equal(d, want_d), isa
        assert torch.equal(b16, sums16) and torch.equal(b32, sums32), isa
    assert int(q.abs().max()) == 127 and float(d[2, 1]) == 0.0


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k"), [(40, 1536), (33, 512)])
def test_with_8_bit_activations_the_result_is_the_product_with_the_quantized_activations(kind: str, n: int,
                                                                                          k: int) -> None:
    pw = packed(kind, n, k, "int8")
    x = activations(6, k)
    want = quant_linear_reference(x.double(), pw).double()
    got = quant_linear(x, pw)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max() + 1e-6


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("acts", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# one row (side-by-side tiles), 2 rows (tile pairs), blocks of 3-8 rows (AVX2: 3-4), then rests of 1-3 rows
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11])
def test_every_code_path_gives_identical_bits(kind: str, acts: str, dtype: torch.dtype, m: int) -> None:
    pw = packed(kind, 88, 512, acts)
    x = activations(m, 512, dtype)
    bias = torch.randn(88)
    outputs = [quant_linear(x, pw, bias, isa=isa) for isa in supported_isas()]
    assert outputs[0].dtype == dtype
    assert len(outputs) >= 2 or kernels.cpu_isas() == ["scalar"]
    for y in outputs[1:]:
        assert torch.equal(y, outputs[0])


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 2, 3])
# 6 and 8 tiles: whole groups of side-by-side tiles, and groups with one or two tiles left over
@pytest.mark.parametrize(("n", "k"), [(88, 8192), (120, 3072)])
def test_long_rows_read_side_by_side_give_every_code_paths_bits(kind: str, m: int, n: int, k: int) -> None:
    # K = 8192 (32 superblocks): one and two rows read several tiles side by side on AVX512-VNNI; from
    # K = 3072 (12), one row of Q6_K reads three side by side on AVX2 (and four on AVX512-VNNI from 2048)
    pw = packed(kind, n, k, "int8")
    x = activations(m, k)
    alone = torch.cat([quant_linear(x[i: i + 1], pw, isa="scalar") for i in range(m)])
    for isa in supported_isas():
        assert torch.equal(quant_linear(x, pw, isa=isa), alone), isa


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("acts", ACTIVATIONS)
def test_a_row_gives_the_same_bits_alone_or_in_any_batch(kind: str, acts: str) -> None:
    pw = packed(kind, 100, 512, acts)
    x = activations(9, 512)
    batched = quant_linear(x, pw)
    for i in range(9):
        assert torch.equal(quant_linear(x[i: i + 1], pw)[0], batched[i])
    assert torch.equal(quant_linear(x[2:7], pw), batched[2:7])


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("acts", ACTIVATIONS)
def test_more_threads_give_the_same_result(kind: str, acts: str) -> None:
    pw = packed(kind, 1024, 512, acts)
    assert same_with_one_and_two_threads(pw, activations(6, 512))


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_many_row_blocks_give_each_rows_bits_on_every_isa_and_thread_count(kind: str) -> None:
    # 8-bit activations, M past several row blocks (AVX2: a block of 32 rows over each tile's codes and a
    # rest of 5; AVX512-VNNI: blocks of 8)
    pw = packed(kind, 72, 768, "int8")
    x = activations(37, 768)
    alone = torch.cat([quant_linear(x[i: i + 1], pw, isa="scalar") for i in range(37)])
    for isa in supported_isas():
        assert torch.equal(quant_linear(x, pw, isa=isa), alone), isa
    assert same_with_one_and_two_threads(pw, x)


def test_k_not_whole_superblocks_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        kquant.pack_from_gguf("q4_k", np.zeros(4 * 144, np.uint8), (4, 288))


@pytest.mark.parametrize("kind", KINDS)
def test_without_the_kernels_torch_multiplies_the_dequantized_weight(kind: str, monkeypatch) -> None:
    from kiln.model import quant

    blocks = random_blocks(kind, 24, 512)
    pw = kquant.pack_from_gguf(kind, blocks, (24, 512))
    x = activations(3, 512)
    monkeypatch.setenv(quant.DISABLE_ENV, "1")
    quant.refresh_from_env()
    try:
        got = quant_linear(x, pw)
    finally:
        monkeypatch.delenv(quant.DISABLE_ENV)
        quant.refresh_from_env()
    assert torch.allclose(got, x @ gguf_dense(kind, blocks, 24, 512).T, rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [None, [36, 0, 17, 5, 36, 2, 9, 1, 3, 4, 6, 7, 8, 10, 11, 12, 13, 14]])
def test_the_load_time_packer_writes_the_same_tiles_as_the_reference_path(kind: str, rows: list[int] | None) -> None:
    blocks = random_blocks(kind, 37, 512, seed=5)
    got = kquant.pack_from_gguf(kind, blocks, (37, 512), rows)
    rec = torch.from_numpy(kquant._records(kind, blocks.reshape(-1, BLOCK_BYTES[kind]))).view(37, 2, -1)
    want = kquant.tile(kind, 512, rec if rows is None else rec[torch.tensor(rows)])
    assert got.out_features == want.out_features
    assert torch.equal(got.qs, want.qs) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("with_kernels", [True, False])
def test_weights_packed_into_consecutive_slots_concatenate_without_a_copy(kind: str, with_kernels: bool,
                                                                           monkeypatch) -> None:
    if with_kernels and not kernels_available():
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    if not with_kernels:
        monkeypatch.setenv(quant.DISABLE_ENV, "1")
        quant.refresh_from_env()
    try:
        sizes, rows = (32, 16, 21), [None, list(range(15, -1, -1)), None]
        blocks = [random_blocks(kind, n, 512, seed=i) for i, n in enumerate(sizes)]
        shapes = [kquant.tile_shapes(kind, n, 512) for n in sizes]
        tiles = sum(q[0] for q, _ in shapes)
        # one tile of sentinels on each side: the slots are written, nothing around them
        qs = torch.full((tiles + 2, *shapes[0][0][1:]), 0xA5, dtype=torch.uint8)
        scales = torch.full((tiles + 2, *shapes[0][1][1:]), 0xA5, dtype=torch.uint8)
        parts, start = [], 1
        for b, n, r, (q, _) in zip(blocks, sizes, rows, shapes, strict=True):
            slot = (qs[start:start + q[0]], scales[start:start + q[0]])
            pw = kquant.pack_from_gguf(kind, b, (n, 512), r, out=slot)
            alone = kquant.pack_from_gguf(kind, b, (n, 512), r)
            assert pw.qs.data_ptr() == slot[0].data_ptr() and pw.scales.data_ptr() == slot[1].data_ptr()
            assert torch.equal(pw.qs, alone.qs) and torch.equal(pw.scales, alone.scales)
            parts.append(pw)
            start += q[0]
        assert bool((qs[0] == 0xA5).all() and (qs[-1] == 0xA5).all() and (scales[-1] == 0xA5).all())
        fused = concat_packed(parts)
        assert fused.qs.data_ptr() == qs[1:].data_ptr() and fused.qs.shape[0] == tiles   # a view, no copy
        assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    finally:
        monkeypatch.delenv(quant.DISABLE_ENV, raising=False)
        quant.refresh_from_env()


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_dequantize_to_the_torch_paths_values(kind: str, dtype: torch.dtype) -> None:
    pw = packed(kind, 37, 512, seed=9)
    assert torch.equal(pw.dequantize(dtype), pw._dequantize_whole(dtype))
