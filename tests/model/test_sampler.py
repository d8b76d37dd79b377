"""Sampler: penalties, temperature, top_k, min_p, top_p, greedy, seeds (semantics.md §4.3)."""

from __future__ import annotations

import math
from collections import Counter

import torch

from kiln.core.sampling import SamplingParams
from kiln.model.sampler import Sampler, apply_penalties

sampler = Sampler()


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draw(logits: list[float], params: SamplingParams, n: int = 400, seed: int = 0) -> Counter[int]:
    g = gen(seed)
    row = torch.tensor([logits])
    return Counter(int(sampler(row, [params], [[]], [g])[0][0]) for _ in range(n))


def test_greedy_takes_the_argmax_with_its_log_softmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0]])
    tokens, logprobs = sampler(logits, [SamplingParams(temperature=0.0)], [[]], [gen()])
    assert tokens.tolist() == [1]
    assert math.isclose(float(logprobs[0]), float(torch.log_softmax(logits[0], -1)[1]), rel_tol=1e-6)


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    counts = draw([1.0, 1.2, 0.9], SamplingParams(temperature=5.0, top_k=1), n=50)
    assert set(counts) == {1}


def test_temperature_sharpens_and_flattens() -> None:
    logits = [2.0, 1.0, 0.0]
    cold = draw(logits, SamplingParams(temperature=0.2))
    hot = draw(logits, SamplingParams(temperature=5.0))
    assert cold[0] > 380
    assert min(hot[i] for i in range(3)) > 80


def test_logprob_is_under_the_temperature_scaled_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    tokens, logprobs = sampler(logits, [SamplingParams(temperature=0.5)], [[]], [gen(3)])
    expected = torch.log_softmax(logits[0] / 0.5, -1)[tokens[0]]
    assert math.isclose(float(logprobs[0]), float(expected), rel_tol=1e-5)


def test_top_k_keeps_only_the_k_best() -> None:
    counts = draw([3.0, 2.9, 2.8, 2.7, 2.6], SamplingParams(top_k=2))
    assert set(counts) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # probs ~ [0.5, 0.3, 0.2]: top_p 0.6 keeps tokens 0 and 1 only
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2])).tolist()
    counts = draw(logits, SamplingParams(top_p=0.6))
    assert set(counts) == {0, 1}
    assert set(draw(logits, SamplingParams(top_p=0.4))) == {0}
    assert set(draw(logits, SamplingParams(top_p=1.0))) == {0, 1, 2}


def test_top_p_logprob_is_renormalised_over_the_kept_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    tokens, logprobs = sampler(logits, [SamplingParams(top_p=0.6)], [[]], [gen(1)])
    expected = {0: math.log(0.5 / 0.8), 1: math.log(0.3 / 0.8)}[int(tokens[0])]
    assert math.isclose(float(logprobs[0]), expected, rel_tol=1e-5)


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).tolist()
    counts = draw(logits, SamplingParams(min_p=0.25))  # threshold 0.125
    assert set(counts) == {0, 1, 2}
    assert set(draw(logits, SamplingParams(min_p=0.0))) == {0, 1, 2, 3}


def test_top_k_applies_before_top_p() -> None:
    # after top_k=2 the kept probs renormalise to [0.625, 0.375]; top_p 0.6 then keeps only token 0
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2])).tolist()
    assert set(draw(logits, SamplingParams(top_k=2, top_p=0.6))) == {0}


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [[0, 1, 0]])
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_presence_penalty_subtracts_once_per_distinct_token() -> None:
    logits = torch.tensor([[2.0, 2.0, 2.0]])
    out = apply_penalties(logits, [SamplingParams(presence_penalty=0.5)], [[0, 0, 0, 2]])
    assert out.tolist() == [[1.5, 2.0, 1.5]]


def test_frequency_penalty_subtracts_per_occurrence() -> None:
    logits = torch.tensor([[2.0, 2.0, 2.0]])
    out = apply_penalties(logits, [SamplingParams(frequency_penalty=0.5)], [[0, 0, 0, 2]])
    assert out.tolist() == [[0.5, 2.0, 1.5]]


def test_penalties_change_the_greedy_choice_and_leave_the_input_alone() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    tokens, _ = sampler(logits, [SamplingParams(temperature=0.0, presence_penalty=1.0)], [[0]], [gen()])
    assert tokens.tolist() == [1]
    assert logits.tolist() == [[2.0, 1.5, 0.0]]


def test_penalties_apply_per_row() -> None:
    logits = torch.tensor([[2.0, 1.0], [2.0, 1.0]])
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams()]
    out = apply_penalties(logits, params, [[0], [0]])
    assert out.tolist() == [[1.0, 1.0], [2.0, 1.0]]


def test_same_seed_gives_the_same_tokens() -> None:
    logits = torch.randn(1, 50, generator=gen(9))
    params = [SamplingParams(temperature=1.0)]
    a = [int(sampler(logits, params, [[]], [g])[0][0]) for g in [gen(42)] for _ in range(20)]
    g2 = gen(42)
    b = [int(sampler(logits, params, [[]], [g2])[0][0]) for _ in range(20)]
    assert a == b


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(temperature=1.0)]
    g1, g2 = gen(1), gen(2)
    a = [int(sampler(logits, params, [[]], [g1])[0][0]) for _ in range(10)]
    b = [int(sampler(logits, params, [[]], [g2])[0][0]) for _ in range(10)]
    assert a != b


def test_a_row_does_not_depend_on_its_batch_neighbours() -> None:
    logits = torch.randn(3, 40, generator=gen(4))
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.0),
              SamplingParams(top_k=5)]
    alone = sampler(logits[2:], params[2:], [[]], [gen(7)])
    batched = sampler(logits, params, [[], [], []], [gen(1), gen(2), gen(7)])
    assert int(batched[0][2]) == int(alone[0][0])
    assert math.isclose(float(batched[1][2]), float(alone[1][0]), rel_tol=1e-6)
    assert int(batched[0][1]) == int(logits[1].argmax())


def test_draws_follow_the_distribution_and_never_pick_a_zero_probability_token() -> None:
    from kiln.model.sampler import _draw

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]] * 4)
    g = gen(11)
    counts: Counter[int] = Counter()
    for _ in range(2500):
        counts.update(_draw(probs, [g, g, g, g]).tolist())
    assert set(counts) == {1, 3, 4}
    for token, p in ((1, 0.5), (3, 0.3), (4, 0.2)):
        assert abs(counts[token] / 10_000 - p) < 0.03
