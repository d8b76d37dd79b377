"""The engine's warm-up forward: a model held only as quantized blocks warms through the serving path,
never dequantizing its weights for the dense path it does not serve with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.bench.synthetic_gguf import write_synthetic_gguf
from kiln.engine.runner import ModelRunner
from kiln.model import kernels, loader
from kiln.model.loader import load_model
from kiln.model.quant import TILE_ROWS, PackedWeight


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_gguf(tmp_path_factory.mktemp("warm") / "tiny-q4_k_m.gguf", "tiny", "q4_k_m")


def _runner(path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    monkeypatch.setattr(loader, "DENSE_COPY_MAX_BYTES", 0)   # hold only the blocks, as a real-size model does
    model, _ = load_model(path, quantization="gguf")
    return ModelRunner(model, num_blocks=4, block_size=16, device=torch.device("cpu"), kv_dtype=torch.bfloat16)


def test_a_blocks_only_model_warms_up_without_dequantizing_a_weight(q4_k_m, monkeypatch):
    runner = _runner(q4_k_m, monkeypatch)
    dequantized: list[int] = []
    real = PackedWeight.dequantize
    monkeypatch.setattr(PackedWeight, "dequantize",
                        lambda self, *a, **k: dequantized.append(self.out_features) or real(self, *a, **k))
    runner.warmup()
    # the two warm-up tokens' embedding rows are looked up from their tiles (one tile: both are token 0);
    # no weight is dequantized whole
    assert dequantized in ([], [TILE_ROWS])


def _prompt_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    from kiln.model.kv_cache import build_attention_metadata
    from kiln.model.lora import build_lora_step

    attn, positions = build_attention_metadata([([0], 0, len(ids))], runner.block_size, runner.device)
    lora = build_lora_step([0], [len(ids)], attn.num_decode_tokens, runner.device)
    with torch.inference_mode():
        return runner.model(torch.tensor(ids), torch.tensor(positions), attn, runner.kv_cache, lora,
                            out_rows=[len(ids) - 1], logits=True)


def test_a_prompt_in_the_warm_up_block_gets_the_logits_a_fresh_pool_gives(q4_k_m, monkeypatch):
    warmed, fresh = _runner(q4_k_m, monkeypatch), _runner(q4_k_m, monkeypatch)
    warmed.warmup()
    ids = [5, 17, 300, 42, 9, 77]
    assert torch.equal(_prompt_logits(warmed, ids), _prompt_logits(fresh, ids))
