"""A GGUF of K-quant blocks (Q4_K_M's mix of Q4_K and Q6_K) serves every projection and the LM head
from its own blocks, each tensor in its own format, through the layer-by-layer path and the decode
stack alike, and the startup log says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.bench.synthetic_gguf import write_synthetic_gguf
from kiln.model import kernels, loader
from kiln.model.loader import load_model, resolve_quantization
from kiln.model.quant import holds_no_values

from .test_decode_stack import _decode_run

pytestmark = pytest.mark.usefixtures("blocks_only")


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 2 layers: llama.cpp's Q4_K_M keeps layer 1's attn_v and ffn_down at Q6_K, layer 0's at Q4_K
    return write_synthetic_gguf(tmp_path_factory.mktemp("kq") / "tiny-q4_k_m.gguf", "tiny", "q4_k_m")


@pytest.fixture(autouse=True)
def _kernels():
    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")


def test_each_tensor_serves_from_its_own_blocks(q4_k_m: Path) -> None:
    model, weights = load_model(q4_k_m, quantization="gguf-float")
    dense, _ = load_model(q4_k_m, dtype="float32", quantization="none")
    layers = model.model.layers
    assert layers[0].self_attn.v_proj.packed.kind == "q4_k"
    assert layers[1].self_attn.v_proj.packed.kind == "q6_k"
    assert layers[1].mlp.down_proj.packed.kind == "q6_k"
    assert layers[1].self_attn.q_proj.packed.kind == "q4_k"
    assert model.lm_head.packed.kind == "q6_k"   # the tied embedding's blocks
    for name, t in weights.tensor_types.items():
        if t in ("Q4_K", "Q6_K") and name != "model.embed_tokens.weight":
            module = model.get_submodule(name.removesuffix(".weight"))
            # the blocks hold exactly the loader's own dequantization (Q/K rows in HF order)
            reference = dense.get_submodule(name.removesuffix(".weight")).weight
            assert torch.equal(module.packed.dequantize(), reference), name


def test_a_q5_k_m_file_serves_its_q5_k_and_q6_k_blocks(tmp_path) -> None:
    path = write_synthetic_gguf(tmp_path / "tiny-q5_k_m.gguf", "tiny", "q5_k_m")
    model, weights = load_model(path, quantization="gguf-float")
    dense, _ = load_model(path, dtype="float32", quantization="none")
    assert model.model.layers[0].mlp.up_proj.packed.kind == "q5_k"
    assert model.model.layers[1].mlp.down_proj.packed.kind == "q6_k"
    up = model.model.layers[0].mlp.up_proj
    assert torch.equal(up.packed.dequantize(), dense.model.layers[0].mlp.up_proj.weight)
    assert "Q5_K x" in weights.served


def test_the_startup_line_says_what_each_format_is_served_with(q4_k_m: Path) -> None:
    _, weights = load_model(q4_k_m, quantization="gguf-float")
    assert "Q4_K x" in weights.served and "its blocks as q4_k, float32 activations" in weights.served
    assert "Q6_K x" in weights.served and "its blocks as q6_k, float32 activations" in weights.served
    assert "dense" not in weights.served


def test_auto_serves_k_quant_blocks_with_8_bit_activations(q4_k_m: Path) -> None:
    assert resolve_quantization(q4_k_m) == "gguf"


@pytest.mark.parametrize("quantization", ["gguf-float", "gguf"])
def test_decode_steps_through_the_stack_equal_the_layer_by_layer_path(each_isa, q4_k_m: Path, monkeypatch,
                                                                      quantization: str) -> None:
    model, _ = load_model(q4_k_m, quantization=quantization)
    # layer 1's q/k (Q4_K) and v (Q6_K) cannot fuse: the stack runs them as parts
    assert model.model.layers[1].self_attn.fused_qkv is None
    stacked, stacked_cache = _decode_run(model, True, monkeypatch)
    assert model._decode_stack not in (None, False), "the stack should have run"
    layered, layered_cache = _decode_run(model, False, monkeypatch)
    for a, b in zip(stacked, layered, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(stacked_cache.storage, layered_cache.storage)


def test_with_8_bit_activations_the_startup_line_says_so(q4_k_m: Path) -> None:
    _, weights = load_model(q4_k_m, quantization="gguf")
    assert "its blocks as q4_k, 8-bit activations" in weights.served
    assert "its blocks as q6_k, 8-bit activations" in weights.served


def test_with_8_bit_activations_the_logits_stay_near_the_dequantized_models(q4_k_m: Path, monkeypatch) -> None:
    served, _ = load_model(q4_k_m, quantization="gguf")
    dense, _ = load_model(q4_k_m, dtype="float32", quantization="none")
    a, _ = _decode_run(served, True, monkeypatch)
    b, _ = _decode_run(dense, False, monkeypatch)
    for x, y in zip(a, b, strict=True):
        # int8 activations per superblock of 256 (llama.cpp's Q8_K rounding): a few percent of the logits' range
        assert (x.float() - y).abs().max() <= 0.05 * y.abs().max()


def test_the_served_logits_are_the_dequantized_models(q4_k_m: Path, monkeypatch) -> None:
    served, _ = load_model(q4_k_m, quantization="gguf-float")
    dense, _ = load_model(q4_k_m, dtype="float32", quantization="none")
    a, _ = _decode_run(served, True, monkeypatch)
    b, _ = _decode_run(dense, False, monkeypatch)
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max() <= 1e-3 * y.abs().max() + 1e-5


def test_quantization_none_serves_the_dense_weights_and_says_so(q4_k_m: Path) -> None:
    model, weights = load_model(q4_k_m, quantization="none")
    assert getattr(model.model.layers[0].mlp.up_proj, "packed", None) is None
    assert "Q4_K x" in weights.served and "its blocks" not in weights.served


def test_a_weight_served_from_its_blocks_has_no_dense_copy(q4_k_m: Path) -> None:
    model, weights = load_model(q4_k_m, quantization="gguf-float")
    for name, t in weights.tensor_types.items():
        if t in ("Q4_K", "Q6_K"):
            weight = model.get_submodule(name.removesuffix(".weight")).weight
            assert holds_no_values(weight) and weight.untyped_storage().nbytes() <= 4, name
    assert "held only as blocks" in weights.held


def test_a_model_whose_dense_copy_fits_the_budget_keeps_it_beside_its_blocks(q4_k_m: Path, monkeypatch) -> None:
    monkeypatch.setattr(loader, "DENSE_COPY_MAX_BYTES", loader.dense_copy_bytes(q4_k_m, torch.float32))
    model, weights = load_model(q4_k_m, dtype="float32", quantization="gguf-float")
    up = model.model.layers[0].mlp.up_proj
    assert up.packed is not None and not holds_no_values(up.weight)
    assert "held only as blocks" not in weights.held


def test_the_dense_path_over_the_blocks_gives_the_dense_copys_logits_and_gradients(q4_k_m: Path) -> None:
    blocks, _ = load_model(q4_k_m, quantization="gguf-float")
    dense, _ = load_model(q4_k_m, dtype="float32", quantization="none")
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 1000, 49000]])
    assert torch.equal(blocks.model.embed_tokens(ids), dense.model.embed_tokens(ids))
    assert torch.equal(blocks.forward_dense(ids), dense.forward_dense(ids))
    grads = []
    for model in (blocks, dense):
        x = model.model.embed_tokens(ids).detach().float().requires_grad_()
        model.model.layers[1].mlp(x).square().sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_an_embedding_held_as_blocks_dequantizes_only_the_rows_looked_up(q4_k_m: Path) -> None:
    model, _ = load_model(q4_k_m, quantization="gguf-float")
    emb = model.model.embed_tokens
    ids = torch.tensor([[5, 17, 5], [40000, 0, 31]])
    rows = emb.packed.dequantize_rows(ids)
    assert rows.shape == (2, 3, model.config.hidden_size)
    assert torch.equal(rows, emb.packed.dequantize()[ids])


def test_the_startup_log_says_why_auto_chose_8_bit_activations(q4_k_m) -> None:
    reason = loader.auto_quantization_reason(q4_k_m)
    assert reason is not None and "8-bit activations" in reason and "--quantization gguf-float" in reason
