"""GRPO: group-normalised advantages and the clipped, KL-penalised token loss, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.errors import KilnError
from kiln.train.grpo import group_advantages, grpo_token_loss, prepare_grpo
from kiln.train.rewards import scorer_reward_fn

PROMPT = [{"role": "user", "content": "Capital of France?"}]


def test_advantages_are_rewards_minus_mean_over_population_std():
    # mean 0.5, population std 0.5
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # mean 4, population std sqrt(8/3)
    s = math.sqrt(8 / 3)
    assert group_advantages([2.0, 4.0, 6.0]) == pytest.approx([-2 / s, 0.0, 2 / s])


def test_groups_with_equal_rewards_or_one_completion_are_skipped():
    assert group_advantages([0.7, 0.7, 0.7]) is None
    assert group_advantages([1.0]) is None


def test_positive_advantage_with_ratio_above_the_clip_uses_the_clipped_term():
    logp, old, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.2]]), torch.tensor([[-0.9]])
    loss, _ = grpo_token_loss(logp, old, ref, torch.tensor([[2.0]]), torch.ones(1, 1), clip_eps=0.2, kl_coeff=0.1,
                              kl_estimator="k1")
    # ratio e^0.2 = 1.2214 > 1.2: -min(1.2214*2, 1.2*2) = -2.4; KL k1 = -1.0 - (-0.9) = -0.1
    assert loss.item() == pytest.approx(-2.4 + 0.1 * -0.1)


def test_positive_advantage_with_ratio_below_the_clip_keeps_the_unclipped_term():
    logp, old, ref = torch.tensor([[-2.0]]), torch.tensor([[-1.5]]), torch.tensor([[-2.5]])
    loss, _ = grpo_token_loss(logp, old, ref, torch.tensor([[2.0]]), torch.ones(1, 1), clip_eps=0.2, kl_coeff=0.1,
                              kl_estimator="k1")
    # ratio e^-0.5 = 0.6065: -min(0.6065*2, 0.8*2) = -1.2131; KL = 0.5
    assert loss.item() == pytest.approx(-math.exp(-0.5) * 2 + 0.1 * 0.5)


def test_negative_advantage_takes_the_pessimistic_side():
    logp, old = torch.tensor([[-1.0]]), torch.tensor([[-1.2]])
    loss, _ = grpo_token_loss(logp, old, logp.clone(), torch.tensor([[-1.0]]), torch.ones(1, 1),
                              clip_eps=0.2, kl_coeff=0.1)
    # -min(1.2214*-1, 1.2*-1) = 1.2214; no KL (policy == reference)
    assert loss.item() == pytest.approx(math.exp(0.2))


def test_loss_sums_only_masked_tokens_and_counts_clipped_ones():
    logp = torch.tensor([[-1.0, -2.0, -9.0]])
    old = torch.tensor([[-1.2, -1.5, 0.0]])
    ref = torch.tensor([[-0.9, -2.5, 0.0]])
    loss, stats = grpo_token_loss(logp, old, ref, torch.tensor([[2.0]]), torch.tensor([[1.0, 1.0, 0.0]]),
                                  clip_eps=0.2, kl_coeff=0.1, kl_estimator="k1")
    assert loss.item() == pytest.approx((-2.4 - 0.01) + (-math.exp(-0.5) * 2 + 0.05))
    assert stats["kl"].item() == pytest.approx(-0.1 + 0.5)
    assert stats["clipped"].item() == 1.0


def test_k3_kl_estimator_is_exp_d_minus_d_minus_one():
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    loss, _ = grpo_token_loss(logp, logp.clone(), ref, torch.tensor([[0.0]]), torch.ones(1, 1),
                              clip_eps=0.2, kl_coeff=1.0, kl_estimator="k3")
    d = -0.5
    assert loss.item() == pytest.approx(math.exp(d) - d - 1)


def test_at_ratio_one_the_gradient_is_minus_advantage_times_grad_logp():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = grpo_token_loss(logp, logp.detach(), logp.detach(), torch.tensor([[3.0]]), torch.ones(1, 2),
                              clip_eps=0.2, kl_coeff=0.5, kl_estimator="k1")
    loss.backward()
    # d/dlogp [-ratio*A] = -A at ratio 1; k1 KL adds kl_coeff
    assert logp.grad[0].tolist() == pytest.approx([-3.0 + 0.5, -3.0 + 0.5])


def test_k3_penalty_has_no_gradient_at_the_base_and_pulls_back_toward_it():
    at_base = torch.tensor([[-1.0]], requires_grad=True)
    grpo_token_loss(at_base, at_base.detach(), at_base.detach(), torch.tensor([[0.0]]), torch.ones(1, 1),
                    clip_eps=0.2, kl_coeff=1.0)[0].backward()
    assert at_base.grad.item() == 0.0
    above = torch.tensor([[-0.5]], requires_grad=True)
    grpo_token_loss(above, above.detach(), torch.tensor([[-1.0]]), torch.tensor([[0.0]]), torch.ones(1, 1),
                    clip_eps=0.2, kl_coeff=1.0)[0].backward()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp) > 0: descent lowers logp to ref
    assert above.grad.item() == pytest.approx(1 - math.exp(-0.5))


def test_prepare_skips_zero_variance_groups(tokenizer, chatml):
    rows = [
        {"messages": PROMPT, "completions": [{"text": "Paris", "reward": 1}, {"text": "Rome", "reward": 0}]},
        {"messages": PROMPT, "completions": [{"text": "Paris", "reward": 1}, {"text": "Paris!", "reward": 1}]},
    ]
    prepared = prepare_grpo(rows, ["groups[0]", "groups[1]"], chatml, tokenizer, 256)
    assert prepared.skipped == [1]
    assert len(prepared.groups) == 1 and prepared.groups[0].advantages == pytest.approx([1.0, -1.0])


def test_prepare_refuses_when_every_group_is_skipped(tokenizer, chatml):
    rows = [{"messages": PROMPT, "completions": [{"text": "a", "reward": 1}, {"text": "b", "reward": 1}]}]
    with pytest.raises(KilnError) as e:
        prepare_grpo(rows, ["groups[0]"], chatml, tokenizer, 256)
    assert e.value.status == 400 and e.value.param == "groups"


def test_reward_scorer_defines_the_rewards(tokenizer, chatml):
    reward = scorer_reward_fn({"scorer": {"kind": "exact_match"}, "target": "Paris"})
    rows = [{"messages": PROMPT, "completions": [{"text": "Paris"}, {"text": "Rome"}, {"text": " Paris "}]}]
    prepared = prepare_grpo(rows, ["groups[0]"], chatml, tokenizer, 256, reward)
    assert prepared.groups[0].rewards == [1.0, 0.0, 1.0]


def test_a_group_target_overrides_the_scorer_target(tokenizer, chatml):
    reward = scorer_reward_fn({"scorer": {"kind": "exact_match"}, "target": "Paris"})
    rows = [{"messages": PROMPT, "target": "Rome", "completions": [{"text": "Paris"}, {"text": "Rome"}]}]
    prepared = prepare_grpo(rows, ["groups[0]"], chatml, tokenizer, 256, reward)
    assert prepared.groups[0].rewards == [0.0, 1.0]


def test_a_judge_scorer_cannot_define_rewards():
    with pytest.raises(KilnError) as e:
        scorer_reward_fn({"scorer": {"kind": "llm_judge", "rubric": "is it right?"}})
    assert e.value.param == "reward_scorer.scorer"
