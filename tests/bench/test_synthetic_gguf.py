"""Random-weight GGUFs with real model shapes (kiln/bench/synthetic_gguf.py): an F16 file for
llama.cpp's llama-quantize, or K-quant blocks laid out as llama.cpp's Q4_K_M lays them out."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from kiln.bench.synthetic_gguf import BODIES, tensor_shapes, write_synthetic_gguf
from kiln.model.loader import load_weights


def test_an_f16_file_has_the_bodys_shapes_and_the_embedded_tokenizer(tmp_path) -> None:
    path = write_synthetic_gguf(tmp_path / "tiny-f16.gguf", "tiny", "f16")
    reader = GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.ffn_down.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 49152
    weights = load_weights(path, "float32")
    cfg = weights.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (256, 2, 512)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 2, 49152)
    w = weights.tensors["model.layers.0.mlp.up_proj.weight"]
    assert 0.01 < float(w.std()) < 0.03   # about a trained layer's scale, not zeros


def test_q4_k_m_keeps_llama_cpps_more_bits_tensors_at_q6_k(tmp_path) -> None:
    path = write_synthetic_gguf(tmp_path / "tiny-q4_k_m.gguf", "tiny", "q4_k_m")
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    assert types["token_embd.weight"] == "Q6_K"   # tied: the output's type
    assert types["blk.0.attn_v.weight"] == "Q4_K" and types["blk.1.attn_v.weight"] == "Q6_K"
    assert types["blk.1.ffn_down.weight"] == "Q6_K" and types["blk.1.ffn_up.weight"] == "Q4_K"


@pytest.mark.parametrize(("size", "billions"), [("0.5b", 0.4), ("1b", 1.07), ("3b", 2.97), ("8b", 7.38)])
def test_the_bodies_have_their_models_parameter_counts_with_smollm2s_vocabulary(size: str, billions: float) -> None:
    total = sum(int(np.prod(shape)) for _, shape, _ in tensor_shapes(BODIES[size], 49152))
    assert abs(total / 1e9 - billions) < 0.15 * billions


def test_an_unknown_size_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="size must be one of"):
        write_synthetic_gguf(tmp_path / "x.gguf", "70b")
