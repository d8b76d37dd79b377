"""Tiny random transformers checkpoints (llama, qwen2 with bias, qwen3 with q/k norm, llama3 rope)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kiln.model import kernels
from kiln.model.loader import load_model
from kiln.model.transformer import Transformer

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)

KINDS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=24, rms_norm_eps=1e-6)),
    "llama3_rope": lambda: LlamaForCausalLM(
        LlamaConfig(
            **COMMON,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    ),
}


@dataclass
class TinyModel:
    kind: str
    path: Path
    hf: PreTrainedModel
    ours: Transformer


def make_hf(kind: str, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    hf = KINDS[kind]().eval()
    with torch.no_grad():
        # make norms and biases non-trivial so a wrong mapping cannot hide behind ones/zeros
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return hf


@pytest.fixture(scope="session", params=list(KINDS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    kind = request.param
    hf = make_hf(kind)
    path = tmp_path_factory.mktemp(kind)
    hf.save_pretrained(path, safe_serialization=True)
    ours, _ = load_model(path, dtype="float32")
    return TinyModel(kind, path, hf, ours)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    hf = make_hf("llama")
    path = tmp_path_factory.mktemp("llama_only")
    hf.save_pretrained(path, safe_serialization=True)
    ours, _ = load_model(path, dtype="float32")
    return TinyModel("llama", path, hf, ours)


@pytest.fixture(scope="module")
def module():
    """The compiled kernels (the test skips where they are unavailable)."""
    mod = kernels.load()
    if mod is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    return mod


@pytest.fixture(params=kernels.cpu_isas())
def each_isa(request: pytest.FixtureRequest):
    """The test runs once on every ISA this CPU supports, the kernels forced to it."""
    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    with kernels.using_isa(request.param):
        yield request.param
