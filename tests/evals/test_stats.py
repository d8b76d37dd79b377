import pytest

from kiln.evals.stats import round_half_away, sign_test_p_value, value_at_rounded_rank, wilson_interval


def test_wilson_of_no_trials_is_all_zero():
    ci = wilson_interval(0, 0)
    assert (ci.confidence_level, ci.lower, ci.upper) == (0.95, 0.0, 0.0)


@pytest.mark.parametrize(
    ("passes", "n", "lower", "upper"),
    [
        (1, 1, 0.206549, 1.0),  # 1 / (1 + z^2), and exactly 1
        (5, 10, 0.236593, 0.763407),
        (0, 10, 0.0, 0.277533),  # z^2/n / (1 + z^2/n)
        (8, 10, 0.490162, 0.943318),
    ],
)
def test_wilson_matches_hand_computed_bounds(passes, n, lower, upper):
    ci = wilson_interval(passes, n)
    assert ci.lower == pytest.approx(lower, abs=1e-6)
    assert ci.upper == pytest.approx(upper, abs=1e-6)
    assert ci.confidence_level == 0.95


def test_wilson_bounds_stay_in_the_unit_interval():
    for n in range(1, 30):
        for k in range(n + 1):
            ci = wilson_interval(k, n)
            assert 0.0 <= ci.lower <= k / n <= ci.upper <= 1.0


def test_sign_test_matches_the_documented_example():
    assert sign_test_p_value(9, 2) == pytest.approx(134 / 2048)


def test_sign_test_without_discordant_pairs_is_one():
    assert sign_test_p_value(0, 0) == 1.0


def test_sign_test_is_capped_at_one():
    assert sign_test_p_value(3, 3) == 1.0


def test_sign_test_survives_large_counts():
    assert 0.0 <= sign_test_p_value(5000, 4000) < 1e-10


def test_round_half_away_from_zero_unlike_python_round():
    assert [round_half_away(x) for x in (0.5, 1.5, 2.5, -0.5)] == [1, 2, 3, -1]


def test_nearest_rank_uses_round_of_q_times_n_minus_one():
    values = [10.0, 20.0, 30.0, 40.0]
    assert value_at_rounded_rank(values, 0.5) == 30.0  # round(1.5) = 2
    assert value_at_rounded_rank(values, 0.9) == 40.0
    assert value_at_rounded_rank([], 0.5) == 0.0
