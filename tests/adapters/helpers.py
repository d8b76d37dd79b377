"""Tiny adapters for tests: a 2-layer llama-shaped model spec and random LoRA factors."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kiln.adapters.compat import model_spec_from_config
from kiln.adapters.peft_format import DEFAULT_TARGET_MODULES, config_dict
from kiln.adapters.store import AdapterStore

# Same sizes as the transformers LlamaConfig in the PEFT interop tests.
TINY = SimpleNamespace(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=4)
MODEL_SPEC = model_spec_from_config(TINY)


def random_factors(r: int = 4, *, modules=DEFAULT_TARGET_MODULES, layers: int = 2, seed: int = 0,
                   spec: dict = MODEL_SPEC) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(layers):
        for m in modules:
            shape = spec["modules"][m]
            a = torch.randn(r, shape["in_features"], generator=g)
            b = torch.randn(shape["out_features"], r, generator=g)
            out[(layer, m)] = (a, b)
    return out


def save_random(store: AdapterStore, name: str, *, r: int = 4, alpha: float = 8, modules=DEFAULT_TARGET_MODULES,
                seed: int = 0, rslora: bool = False, **config_extra) -> dict:
    factors = random_factors(r, modules=modules, seed=seed)
    config = config_dict(r, alpha, list(modules), use_rslora=rslora) | config_extra
    store.save_adapter(name, factors, config)
    return factors


def delta(a: torch.Tensor, b: torch.Tensor, scale: float, x: torch.Tensor) -> torch.Tensor:
    return (x @ a.T @ b.T) * scale
