"""The dense path matches transformers for every supported architecture."""

from __future__ import annotations

import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.transformer import Transformer

from .conftest import COMMON, TinyModel


def _hf_logits(tiny: TinyModel, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return tiny.hf(input_ids=ids, attention_mask=mask).logits.float()


def test_dense_logits_match_transformers(tiny: TinyModel) -> None:
    ids = torch.randint(0, 96, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = tiny.ours.forward_dense(ids)
    assert ours.dtype == torch.float32
    assert ours.shape == (3, 37, 96)
    torch.testing.assert_close(ours, _hf_logits(tiny, ids), atol=1e-4, rtol=1e-4)


def test_dense_right_padding_matches_transformers(tiny: TinyModel) -> None:
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 13:] = 0
    with torch.no_grad():
        ours = tiny.ours.forward_dense(ids, attention_mask=mask)
    ref = _hf_logits(tiny, ids, mask)
    torch.testing.assert_close(ours[0], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours[1, :13], ref[1, :13], atol=1e-4, rtol=1e-4)


def test_dense_left_padding_gives_each_row_its_unpadded_logits(tiny_llama: TinyModel) -> None:
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], dim=1)
    with torch.no_grad():
        alone = tiny_llama.ours.forward_dense(ids)
        left = tiny_llama.ours.forward_dense(padded, attention_mask=mask)
    torch.testing.assert_close(left[:, 5:], alone, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(left).all()


def test_dense_path_is_differentiable(tiny_llama: TinyModel) -> None:
    model = Transformer(tiny_llama.ours.config, torch.float32, "cpu")
    ids = torch.randint(0, 96, (2, 9))
    loss = torch.nn.functional.cross_entropy(model.forward_dense(ids)[:, :-1].reshape(-1, 96), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["model.layers.0.self_attn.k_proj.weight"].abs().sum() > 0


def test_module_names_follow_transformers(tiny: TinyModel) -> None:
    ours = set(tiny.ours.state_dict())
    theirs = set(tiny.hf.state_dict())
    assert ours == theirs


def test_tied_head_shares_the_embedding() -> None:
    cfg = ModelConfig("qwen2", 50, 32, 48, 1, 4, 2, 8, tie_word_embeddings=True, attention_bias=True)
    model = Transformer(cfg, torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})


def test_new_model_has_initialised_weights_in_the_requested_dtype() -> None:
    cfg = ModelConfig("qwen3", 50, 32, 48, 1, 4, 2, 8, qk_norm=True)
    model = Transformer(cfg, torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.all(model.model.layers[0].self_attn.q_norm.weight == 1)
    assert model.model.layers[0].mlp.up_proj.weight.std() > 0


ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_scaling_variants_match_transformers(variant: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = LlamaConfig(**{**COMMON, "max_position_embeddings": 32}, rope_scaling=ROPE_VARIANTS[variant])
    hf = LlamaForCausalLM(hf_config).eval()
    model = Transformer(ModelConfig.from_hf_dict(hf_config.to_dict()), torch.float32, "cpu", init_weights=False)
    model.load_state_dict_hf(dict(hf.state_dict()))
    ids = torch.randint(0, 96, (1, 40))  # past max_position_embeddings: dynamic NTK rescales
    with torch.no_grad():
        torch.testing.assert_close(model.forward_dense(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
