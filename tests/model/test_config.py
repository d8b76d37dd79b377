"""ModelConfig from HF config.json dicts and from GGUF metadata."""

from __future__ import annotations

import pytest

from kiln.model.config import ModelConfig, UnsupportedModelError

from .conftest import make_hf


def test_llama_config_reads_the_architecture_numbers() -> None:
    cfg = ModelConfig.from_hf_dict(make_hf("llama").config.to_dict())
    assert cfg.architecture == "llama"
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.rope_scaling is None
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    assert not cfg.attention_bias and not cfg.qk_norm


def test_qwen2_has_qkv_bias_and_qwen3_has_qk_norm() -> None:
    qwen2 = ModelConfig.from_hf_dict(make_hf("qwen2").config.to_dict())
    qwen3 = ModelConfig.from_hf_dict(make_hf("qwen3").config.to_dict())
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.tie_word_embeddings
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 24


def test_transformers_v4_rope_fields_are_understood() -> None:
    cfg = ModelConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [5, 6],
    })
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 4
    assert cfg.eos_token_ids == [5, 6]


def test_llama3_rope_parameters_are_kept() -> None:
    cfg = ModelConfig.from_hf_dict(make_hf("llama3_rope").config.to_dict())
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 32


def test_unknown_model_type_is_rejected_with_the_supported_list() -> None:
    with pytest.raises(UnsupportedModelError, match="'mistral'.*supported: llama, qwen2, qwen3"):
        ModelConfig.from_hf_dict({"model_type": "mistral"})
    assert issubclass(UnsupportedModelError, ValueError)


def test_unknown_rope_type_is_rejected() -> None:
    d = make_hf("llama").config.to_dict()
    d["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "longrope"}
    with pytest.raises(UnsupportedModelError, match="longrope"):
        ModelConfig.from_hf_dict(d)


GGUF_QWEN3 = {
    "general.architecture": "qwen3",
    "qwen3.block_count": 28,
    "qwen3.context_length": 40960,
    "qwen3.embedding_length": 1024,
    "qwen3.feed_forward_length": 3072,
    "qwen3.attention.head_count": 16,
    "qwen3.attention.head_count_kv": 8,
    "qwen3.attention.key_length": 128,
    "qwen3.rope.freq_base": 1000000.0,
    "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
    "tokenizer.ggml.tokens": ["a"] * 151936,
    "tokenizer.ggml.eos_token_id": 151645,
    "tokenizer.ggml.eot_token_id": 151645,
    "tokenizer.ggml.bos_token_id": 151643,
}


def test_gguf_metadata_for_qwen3() -> None:
    cfg = ModelConfig.from_gguf_metadata(GGUF_QWEN3, tensor_names=["token_embd.weight", "output.weight"])
    assert cfg.architecture == "qwen3" and cfg.qk_norm
    assert cfg.head_dim == 128 and cfg.vocab_size == 151936
    assert cfg.max_position_embeddings == 40960
    assert cfg.eos_token_ids == [151645]
    assert not cfg.tie_word_embeddings


def test_gguf_metadata_rope_scaling_and_tied_head() -> None:
    md = {
        "general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
        "llama.feed_forward_length": 128, "llama.attention.head_count": 4, "llama.vocab_size": 100,
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0,
    }
    cfg = ModelConfig.from_gguf_metadata(md, tensor_names=["token_embd.weight"])
    assert cfg.tie_word_embeddings
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 16


def test_gguf_with_unsupported_architecture_is_rejected() -> None:
    with pytest.raises(UnsupportedModelError, match="'gemma2'"):
        ModelConfig.from_gguf_metadata({"general.architecture": "gemma2"})
