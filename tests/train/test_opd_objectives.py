"""The OPD objectives as pure functions, without a model: each divergence over the teacher's top-K plus the
rest bucket, its value and its gradient on small hand-computed distributions; reverse KL unchanged; the
config's default per training mode and its validation."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.api.errors import parse_model
from kiln.errors import KilnError
from kiln.train.opd import _rest, topk_divergence, topk_kl
from kiln.train.requests import OpdRequest

# Vocabulary of 4; the teacher's top-2 are tokens 0 and 1 (0.5, 0.3), the rest bucket {2, 3} holds 0.2.
TOP_IDS = torch.tensor([[0, 1]])
TOP_LOGP = torch.log(torch.tensor([[0.5, 0.3]]))
UNIFORM = torch.zeros(1, 4)      # student logits: 0.25 each, its rest bucket 0.5


def divergence(objective: str, logits: torch.Tensor) -> torch.Tensor:
    return topk_divergence(objective, torch.log_softmax(logits, -1), TOP_IDS, TOP_LOGP)


def test_forward_kl_is_the_teachers_kl_to_the_student_over_the_top_k_and_the_rest():
    expected = 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.25) + 0.2 * math.log(0.2 / 0.5)
    assert float(divergence("forward_kl", UNIFORM)) == pytest.approx(expected, rel=1e-5)


def test_forward_kl_gradient_is_student_minus_teacher_on_the_top_k_and_shares_the_rest_by_the_students_odds():
    logits = UNIFORM.detach().clone().requires_grad_(True)
    divergence("forward_kl", logits).sum().backward()
    # d/dz_j = p_s(j) - p_t(j) for j in the top-K; p_s(j) - p_t(R) p_s(j) / p_s(R) for j in the rest
    assert logits.grad[0].tolist() == pytest.approx([0.25 - 0.5, 0.25 - 0.3, 0.25 - 0.2 * 0.5, 0.25 - 0.2 * 0.5],
                                                    abs=1e-6)


def test_reverse_kl_is_the_students_kl_to_the_teacher():
    expected = 0.25 * math.log(0.25 / 0.5) + 0.25 * math.log(0.25 / 0.3) + 0.5 * math.log(0.5 / 0.2)
    assert float(divergence("reverse_kl", UNIFORM)) == pytest.approx(expected, rel=1e-5)


def test_jsd_is_the_mean_kl_of_each_side_to_their_mixture():
    s, t = [0.25, 0.25, 0.5], [0.5, 0.3, 0.2]
    m = [(a + b) / 2 for a, b in zip(s, t, strict=True)]
    expected = 0.5 * sum(a * math.log(a / c) for a, c in zip(s, m, strict=True)) + \
        0.5 * sum(b * math.log(b / c) for b, c in zip(t, m, strict=True))
    assert float(divergence("jsd", UNIFORM)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("objective", ["reverse_kl", "forward_kl", "jsd"])
def test_every_objective_is_zero_when_the_student_is_the_teacher(objective):
    teacher = torch.log_softmax(torch.tensor([[3.0, 1.0, 0.0, -1.0]]), -1)
    top = teacher.topk(2, -1)
    assert float(topk_divergence(objective, teacher, top.indices, top.values)) == pytest.approx(0.0, abs=1e-6)


def test_reverse_kl_is_bit_identical_to_the_top_k_kl_it_always_was():
    gen = torch.Generator().manual_seed(0)
    student = torch.log_softmax(torch.randn(7, 50, generator=gen), -1)
    top = torch.log_softmax(torch.randn(7, 50, generator=gen), -1).topk(16, -1)
    gathered = student.gather(-1, top.indices)
    s_rest, t_rest = _rest(gathered), _rest(top.values)
    before = (gathered.exp() * (gathered - top.values)).sum(-1) + s_rest.exp() * (s_rest - t_rest)
    assert torch.equal(topk_divergence("reverse_kl", student, top.indices, top.values), before)
    assert torch.equal(topk_kl(student, top.indices, top.values)[0], before)


def test_forward_kl_pulls_up_a_teacher_token_the_student_ignores_where_reverse_kl_barely_does():
    # the teacher gives token 1 0.4; the student gives it ~1e-4 (the fact's first token on SmolLM2)
    logits = torch.tensor([[4.0, -5.2, 0.0, 0.0]])
    grads = {}
    for objective in ("reverse_kl", "forward_kl"):
        z = logits.clone().requires_grad_(True)
        topk_divergence(objective, torch.log_softmax(z, -1), TOP_IDS,
                        torch.log(torch.tensor([[0.5, 0.4]]))).sum().backward()
        grads[objective] = float(z.grad[0, 1])
    assert grads["forward_kl"] < -0.39 and abs(grads["reverse_kl"]) < 0.01, grads


def test_the_objective_defaults_to_reverse_kl_on_policy_and_forward_kl_off_policy():
    on = parse_model(OpdRequest, {"prompts": ["hi"], "teacher": "t"})
    off = parse_model(OpdRequest, {"prompts": ["hi"], "teacher": "t", "config": {"training_mode": "off_policy"}})
    chosen = parse_model(OpdRequest, {"prompts": ["hi"], "teacher": "t",
                                      "config": {"training_mode": "off_policy", "objective": "jsd"}})
    assert (on.config.objective, off.config.objective, chosen.config.objective) == ("reverse_kl", "forward_kl", "jsd")


def test_an_unknown_objective_is_a_400_naming_config_objective():
    with pytest.raises(KilnError) as e:
        parse_model(OpdRequest, {"prompts": ["hi"], "teacher": "t", "config": {"objective": "kl"}})
    assert (e.value.status, e.value.param) == (400, "config.objective")
