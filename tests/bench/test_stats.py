import pytest

from kiln.bench.stats import format_ratio, format_value, interpolated_percentile, median, speedup


def test_interpolated_percentile_interpolates_linearly_between_order_statistics():
    assert interpolated_percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert interpolated_percentile([10.0, 0.0, 20.0], 25) == 5.0


def test_interpolated_percentile_extremes_are_min_and_max():
    values = [3.0, 1.0, 7.0, 5.0]
    assert interpolated_percentile(values, 0) == 1.0
    assert interpolated_percentile(values, 100) == 7.0


def test_p99_of_a_hundred_values_sits_just_below_the_maximum():
    values = [float(i) for i in range(1, 101)]
    assert interpolated_percentile(values, 99) == pytest.approx(99.01)


def test_interpolated_percentile_of_nothing_is_none_not_zero():
    assert interpolated_percentile([], 50) is None
    assert median([]) is None


def test_interpolated_percentile_rejects_q_outside_0_to_100():
    with pytest.raises(ValueError):
        interpolated_percentile([1.0], 101)


def test_speedup_of_a_throughput_is_value_over_reference():
    assert speedup(30.0, 10.0, higher_is_better=True) == 3.0


def test_speedup_of_a_latency_is_reference_over_value():
    assert speedup(50.0, 100.0, higher_is_better=False) == 2.0


def test_speedup_is_none_without_both_positive_figures():
    assert speedup(None, 10.0, True) is None
    assert speedup(10.0, None, True) is None
    assert speedup(0.0, 10.0, False) is None
    assert speedup(float("nan"), 10.0, True) is None


def test_format_ratio_uses_two_decimals_and_an_x():
    assert format_ratio(1.2345) == "1.23x"
    assert format_ratio(250.4) == "250x"


def test_format_ratio_keeps_small_ratios_visible():
    assert format_ratio(0.01234) == "0.0123x"


def test_missing_ratio_and_value_render_as_a_dash():
    assert format_ratio(None) == "—"
    assert format_value(None) == "—"


def test_format_value_groups_thousands():
    assert format_value(12345.6) == "12,346"
    assert format_value(12.345, 2) == "12.35"
