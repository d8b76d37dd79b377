"""The shared optimisation loop: steps, accumulation, cancel, and SFT learning on a tiny model."""

from __future__ import annotations

import pytest
import torch

from kiln.train.loop import Cancelled, LoopConfig, run_loop
from kiln.train.masks import mask_conversation
from kiln.train.sft import SftWork
from kiln.train.trainable_lora import TrainableLora, freeze_base

EXAMPLES = [
    [{"role": "user", "content": "What is the capital of Zorbania?"},
     {"role": "assistant", "content": "The capital of Zorbania is Quillton."}],
    [{"role": "user", "content": "Name the capital of Zorbania."},
     {"role": "assistant", "content": "Quillton is the capital of Zorbania."}],
    [{"role": "user", "content": "Zorbania's capital?"}, {"role": "assistant", "content": "Quillton."}],
]


@pytest.fixture
def work(tokenizer, chatml):
    return SftWork([mask_conversation(chatml, tokenizer, m) for m in EXAMPLES])


def test_total_steps_are_epochs_times_batches_of_batch_size_times_accumulation():
    cfg = LoopConfig(learning_rate=1e-3, epochs=3, batch_size=2, grad_accum=2)
    assert cfg.total_steps(9) == 3 * 3
    assert LoopConfig(learning_rate=1e-3, epochs=2, updates_per_step=2).total_steps(3) == 12


def test_sft_drives_the_training_loss_down(tiny_model, work):
    freeze_base(tiny_model)
    lora = TrainableLora(tiny_model.config, 8, 16, seed=0)
    reports = run_loop(tiny_model, lora, work, LoopConfig(learning_rate=1e-2, epochs=15, batch_size=3, yield_secs=0))
    assert len(reports) == 15
    assert reports[-1].loss < reports[0].loss / 4
    assert all(r.tokens == sum(s.num_trained for s in work.sequences) for r in reports)


def test_accumulated_micro_batches_give_the_same_step_as_one_batch(tiny_dir, work):
    from kiln.model.loader import load_model

    def params_after_one_step(batch_size: int, accum: int) -> list[torch.Tensor]:
        model, _ = load_model(str(tiny_dir), dtype="float32")
        freeze_base(model)
        lora = TrainableLora(model.config, 4, 8, seed=0)
        cfg = LoopConfig(learning_rate=1e-2, epochs=1, batch_size=batch_size, grad_accum=accum, max_grad_norm=0,
                         yield_secs=0)
        run_loop(model, lora, work, cfg)
        return [p.detach().clone() for p in lora.parameters()]

    for a, b in zip(params_after_one_step(3, 1), params_after_one_step(1, 3), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_cancel_stops_at_the_next_step_boundary(tiny_model, work):
    freeze_base(tiny_model)
    lora = TrainableLora(tiny_model.config, 4, 8, seed=0)
    seen = []
    with pytest.raises(Cancelled):
        run_loop(tiny_model, lora, work, LoopConfig(learning_rate=1e-3, epochs=10, yield_secs=0),
                 on_step=seen.append, should_stop=lambda: len(seen) >= 2)
    assert [r.step for r in seen] == [1, 2]


def test_a_non_finite_loss_fails_the_loop(tiny_model, work):
    freeze_base(tiny_model)
    lora = TrainableLora(tiny_model.config, 4, 8, seed=0)
    with torch.no_grad():
        next(iter(lora.b.values())).fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="lower the learning rate"):
        run_loop(tiny_model, lora, work, LoopConfig(learning_rate=1e-3, yield_secs=0))


def test_grpo_updates_after_the_first_on_a_batch_see_the_old_policy_and_clip(tiny_model, tokenizer, chatml):
    from kiln.train.grpo import GrpoWork, prepare_grpo

    rows = [{"messages": [{"role": "user", "content": "Colour?"}],
             "completions": [{"text": "Green.", "reward": 1}, {"text": "Red.", "reward": 0}]}]
    prepared = prepare_grpo(rows, ["groups[0]"], chatml, tokenizer, 128)
    freeze_base(tiny_model)
    lora = TrainableLora(tiny_model.config, 4, 8, seed=0)
    work = GrpoWork(prepared.groups, clip_eps=1e-3, kl_coeff=0.0)
    reports = run_loop(tiny_model, lora, work, LoopConfig(learning_rate=1e-2, updates_per_step=3, yield_secs=0))
    assert [r.metrics["clip_fraction"] for r in reports][0] == 0.0  # ratio is exactly 1 on the first pass
    assert reports[2].metrics["clip_fraction"] > 0.0
