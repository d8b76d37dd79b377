"""How big the paged KV pool is (engine.kv_cache_memory_mb)."""

from __future__ import annotations

import torch

from kiln.config import Settings
from kiln.engine.build import AUTO_KV_MEMORY_MB, kv_layout
from kiln.model.config import ModelConfig
from kiln.model.kv_cache import KVCache

CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1 << 20)


def _settings(memory_mb: int) -> Settings:
    s = Settings()
    s.engine.kv_cache_memory_mb = memory_mb
    return s


def test_the_default_pool_holds_the_same_tokens_in_float32_as_in_bfloat16():
    assert Settings().engine.kv_cache_memory_mb == 0
    _, bf16_blocks, _ = kv_layout(_settings(0), CFG, torch.bfloat16)
    _, f32_blocks, _ = kv_layout(_settings(0), CFG, torch.float32)
    assert bf16_blocks == f32_blocks == AUTO_KV_MEMORY_MB * 2**20 // KVCache.bytes_per_block(CFG, 16, torch.bfloat16)


def test_a_memory_budget_is_spent_in_the_kv_dtype():
    _, bf16_blocks, _ = kv_layout(_settings(64), CFG, torch.bfloat16)
    _, f32_blocks, _ = kv_layout(_settings(64), CFG, torch.float32)
    assert bf16_blocks == 64 * 2**20 // KVCache.bytes_per_block(CFG, 16, torch.bfloat16)
    assert f32_blocks * 2 == bf16_blocks
