"""make_tiny_model writes real, loadable HF model directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kiln.engine.chat_template import ChatTemplate
from kiln.engine.tokenizer import Tokenizer
from kiln.testing.tiny import ADDED_TOKENS, SPECIAL_TOKENS, make_tiny_model

ARCHS = ["llama", "qwen2", "qwen3"]


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_writes_the_files_of_an_hf_checkpoint(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "m", "qwen3")
    names = {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert names <= {p.name for p in d.iterdir()}


@pytest.mark.parametrize("arch", ARCHS)
def test_config_describes_the_architecture(tmp_path: Path, arch: str) -> None:
    d = make_tiny_model(tmp_path / arch, arch, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2)
    config = _json(d / "config.json")
    assert config["model_type"] == arch
    assert (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    ) == (32, 3, 4, 2, 8)
    assert config["vocab_size"] == Tokenizer.from_hf_dir(d).vocab_size


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_every_weight_from_the_file(tmp_path: Path, arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    d = make_tiny_model(tmp_path / arch, arch, tie_word_embeddings=arch != "qwen2")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(d), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tensors = load_file(str(d / "model.safetensors"))
    state = model.state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor), name
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, _json(d / "config.json")["vocab_size"]) and torch.isfinite(logits).all()


def test_arch_specific_weights(tmp_path: Path) -> None:
    qwen2 = load_file(str(make_tiny_model(tmp_path / "q2", "qwen2") / "model.safetensors"))
    qwen3 = load_file(str(make_tiny_model(tmp_path / "q3", "qwen3") / "model.safetensors"))
    llama = load_file(str(make_tiny_model(tmp_path / "l", "llama") / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.bias" in qwen2
    assert (
        "model.layers.0.self_attn.q_norm.weight" in qwen3
        and "model.layers.0.self_attn.q_proj.bias" not in qwen3
    )
    assert not any("bias" in k or "q_norm" in k for k in llama)


def test_tied_embeddings_omit_lm_head(tmp_path: Path) -> None:
    tied = load_file(str(make_tiny_model(tmp_path / "t", tie_word_embeddings=True) / "model.safetensors"))
    untied = load_file(str(make_tiny_model(tmp_path / "u", tie_word_embeddings=False) / "model.safetensors"))
    assert "lm_head.weight" not in tied and "lm_head.weight" in untied


def test_same_seed_gives_identical_files_and_another_seed_different_weights(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", seed=3)
    b = make_tiny_model(tmp_path / "b", seed=3)
    c = make_tiny_model(tmp_path / "c", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_extra_vocab_pads_the_embedding_beyond_the_tokenizer(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "m", extra_vocab=13)
    assert _json(d / "config.json")["vocab_size"] == Tokenizer.from_hf_dir(d).vocab_size + 13


def test_tokenizer_is_a_small_byte_level_bpe_with_chat_tokens(tmp_path: Path) -> None:
    tok = Tokenizer.from_hf_dir(make_tiny_model(tmp_path / "m"))
    assert 500 <= tok.vocab_size <= 1000
    for token in (*SPECIAL_TOKENS, *ADDED_TOKENS):
        assert len(tok.encode(token)) == 1, token
    assert set(SPECIAL_TOKENS) <= tok.special_tokens and not set(ADDED_TOKENS) & tok.special_tokens
    assert len(tok.encode("🎉")) == 4  # unseen characters fall back to byte tokens
    text = "Any text at all: ünïcödé, 你好, \t tabs and 12345."
    assert tok.decode(tok.encode(text)) == text


def test_generation_config_stops_on_im_end_and_endoftext(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "m", generation_defaults={"temperature": 0.6})
    tok = Tokenizer.from_hf_dir(d)
    gen = _json(d / "generation_config.json")
    assert gen["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    assert gen["temperature"] == 0.6


def test_default_template_is_qwen3_style(tmp_path: Path) -> None:
    tok = Tokenizer.from_hf_dir(make_tiny_model(tmp_path / "m"))
    text = ChatTemplate(tok.require_chat_template(), tok.bos_token, tok.eos_token).render(
        [{"role": "user", "content": "Hi"}], enable_thinking=False
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_thinking_prompt_model_starts_generation_inside_think(tmp_path: Path) -> None:
    tok = Tokenizer.from_hf_dir(make_tiny_model(tmp_path / "m", thinking_prompt=True))
    text = ChatTemplate(tok.require_chat_template()).render([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_model_without_chat_template(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "m", chat_template=None)
    assert "chat_template" not in _json(d / "tokenizer_config.json")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_hf_dir(d).require_chat_template()


def test_unknown_architecture_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        make_tiny_model(tmp_path / "m", "gpt2")
