"""Training over a GGUF served from its quantized blocks holds no dense copy of them. Served with float
activations it learns what training over the dequantized dense copy learns: the same per-step SFT
losses (the frozen weights are dequantized where each projection uses them, in forward and backward,
to the same values); served with 8-bit activations its forward is the served product, near them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.bench.synthetic_gguf import write_synthetic_gguf
from kiln.engine.chat_template import ChatTemplate
from kiln.engine.tokenizer import Tokenizer
from kiln.model.gguf_file import read_gguf_metadata
from kiln.model.loader import load_model
from kiln.model.quant import holds_no_values
from kiln.train.loop import LoopConfig, run_loop
from kiln.train.masks import mask_conversation
from kiln.train.sft import SftWork
from kiln.train.trainable_lora import TrainableLora, freeze_base

from .conftest import CHATML

FACTS = [("What is the capital of Zorbland?", "The capital of Zorbland is Quexton."),
         ("Name the capital of Zorbland.", "Quexton.")]


pytestmark = pytest.mark.usefixtures("blocks_only")


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_gguf(tmp_path_factory.mktemp("blocks") / "tiny-q4_k_m.gguf", "tiny", "q4_k_m")


@pytest.fixture(scope="module")
def work(q4_k_m: Path) -> SftWork:
    tokenizer = Tokenizer.from_gguf_metadata(read_gguf_metadata(q4_k_m))
    template = ChatTemplate(CHATML, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    return SftWork([mask_conversation(template, tokenizer, [{"role": "user", "content": q},
                                                            {"role": "assistant", "content": a}])
                    for q, a in FACTS])


def sft_losses(model: torch.nn.Module, work: SftWork) -> list[float]:
    freeze_base(model)
    lora = TrainableLora(model.config, 16, 32, seed=0)
    cfg = LoopConfig(learning_rate=5e-3, epochs=2, batch_size=1, seed=0, yield_secs=0)
    return [r.loss for r in run_loop(model, lora, work, cfg)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sft_over_the_blocks_gives_the_dense_copys_losses(q4_k_m: Path, work: SftWork, dtype: str) -> None:
    blocks, _ = load_model(q4_k_m, dtype=dtype, quantization="gguf-float")
    dense, _ = load_model(q4_k_m, dtype=dtype, quantization="none")
    up = blocks.model.layers[0].mlp.up_proj
    assert holds_no_values(up.weight) and not holds_no_values(dense.model.layers[0].mlp.up_proj.weight)
    got, want = sft_losses(blocks, work), sft_losses(dense, work)
    assert len(got) == len(want) == 4
    assert want[-1] < want[0]     # the run learns at all
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sft_over_weights_dequantized_in_panels_learns_what_the_dense_copy_learns(
        q4_k_m: Path, work: SftWork, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every weight over a (lowered) scratch bound goes in panels of 16 rows, as a 1B model's LM head
    does: the losses stay the dense copy's, up to the order the panels' input gradients are summed in."""
    from kiln.model import precision
    monkeypatch.setattr(precision, "SCRATCH_MAX_VALUES", 16 * 64)
    monkeypatch.setattr(precision, "PANEL_MAX_VALUES", 16 * 64)
    blocks, _ = load_model(q4_k_m, dtype=dtype, quantization="gguf-float")
    dense, _ = load_model(q4_k_m, dtype=dtype, quantization="none")
    head = blocks.lm_head.packed
    assert holds_no_values(blocks.lm_head.weight) and len(precision._panels(head)) > 1
    got, want = sft_losses(blocks, work), sft_losses(dense, work)
    assert want[-1] < want[0]
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=1e-3 if dtype == "bfloat16" else 1e-5)


def test_sft_over_blocks_served_with_8_bit_activations_learns_near_the_dense_copy(q4_k_m: Path, work: SftWork) -> None:
    """`--quantization gguf` trains through the served product: the losses are the dense copy's up to
    the activations' 8-bit rounding, and the run learns."""
    blocks, _ = load_model(q4_k_m, quantization="gguf")
    dense, _ = load_model(q4_k_m, dtype="float32", quantization="none")
    assert not blocks.model.layers[0].mlp.up_proj.packed.float_act
    got, want = sft_losses(blocks, work), sft_losses(dense, work)
    assert got[-1] < got[0]
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=0.02)
