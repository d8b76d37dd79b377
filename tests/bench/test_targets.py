from kiln.bench.measurements import (
    ADAPTER_RATIO,
    ITL_MAX,
    ITL_SPREAD,
    LEARNING_LOOP,
    TRAINING_ITL_RATIO,
    aggregate_spec,
    decode_spec,
)
from kiln.bench.results import Comparison
from kiln.bench.targets import MET, MISSED, NOT_MEASURED, evaluate_targets

from .conftest import KILN_DEFAULT, KILN_GGUF, REF


def outcomes(result):
    return {t.name: o for t, o in evaluate_targets(result)}


def test_gguf_decode_target_is_one_and_a_half_times_llama_server_on_every_prompt(result):
    o = outcomes(result)["single-stream decode, gguf (avx512)"]
    assert o.status == MET
    assert "2.00x" in o.measured


def test_gguf_decode_target_is_missed_when_any_prompt_length_falls_short(result):
    result.record(decode_spec(500), KILN_GGUF, 30.0)   # llama-server: 25, 1.2x
    assert outcomes(result)["single-stream decode, gguf (avx512)"].status == MISSED


def test_default_weights_must_match_llama_servers_decode(result):
    o = outcomes(result)["single-stream decode, default weights (avx512)"]
    assert o.status == MISSED and "0.80x" in o.measured
    result.record(decode_spec(100), KILN_DEFAULT, 30.0)
    result.record(decode_spec(500), KILN_DEFAULT, 25.0)
    assert outcomes(result)["single-stream decode, default weights (avx512)"].status == MET


def test_prefill_target_needs_two_and_a_half_times_llama_server(result):
    assert outcomes(result)["prefill, gguf (avx512)"].status == MET


def test_aggregate_targets_are_2x_at_8_streams_and_3x_at_32_and_64(result):
    o = outcomes(result)
    assert o["aggregate throughput, 8 streams, gguf (avx512)"].status == MET
    assert o["aggregate throughput, 32 and 64 streams, gguf (avx512)"].status == NOT_MEASURED
    result.record(aggregate_spec(32), KILN_GGUF, 400.0)
    result.record(aggregate_spec(32), REF, 100.0)
    result.record(aggregate_spec(64), KILN_GGUF, 250.0)
    result.record(aggregate_spec(64), REF, 100.0)
    o = outcomes(result)["aggregate throughput, 32 and 64 streams, gguf (avx512)"]
    assert o.status == MISSED and "4.00x" in o.measured and "2.50x" in o.measured


def test_itl_target_bounds_the_spread_and_the_worst_gap(result):
    name = f"ITL during a long-prompt arrival ({KILN_GGUF})"
    assert outcomes(result)[name].status == MET
    result.record(ITL_MAX, KILN_GGUF, 400.0)
    assert outcomes(result)[name].status == MISSED
    result.record(ITL_MAX, KILN_GGUF, 100.0)
    result.record(ITL_SPREAD, KILN_GGUF, 3.5)
    assert outcomes(result)[name].status == MISSED


def test_targets_against_llama_server_are_not_measured_without_it(result_without_reference):
    o = outcomes(result_without_reference)["single-stream decode, gguf (avx512)"]
    assert o.status == NOT_MEASURED
    assert o.measured == f"needs {KILN_GGUF} and {REF} figures"


def test_the_avx2_pair_gets_its_own_targets(result):
    pair = Comparison("kiln gguf avx2", "llama-server avx2", "avx2", "gguf")
    result.comparisons.append(pair)
    result.record(decode_spec(100), "kiln gguf avx2", 40.0)
    result.record(decode_spec(100), "llama-server avx2", 20.0)
    o = outcomes(result)
    assert o["single-stream decode, gguf (avx2)"].status == MET
    assert o["single-stream decode, gguf (avx512)"].status == MET


def test_adapter_target_needs_seven_tenths_of_the_base_streams(result):
    name = f"streams over 4 adapters ({KILN_DEFAULT})"
    assert name not in outcomes(result)
    result.record(ADAPTER_RATIO, KILN_DEFAULT, 0.69)
    assert outcomes(result)[name].status == MISSED
    result.record(ADAPTER_RATIO, KILN_DEFAULT, 0.7)
    assert outcomes(result)[name].status == MET


def test_learning_loop_target_is_ten_seconds_on_avx512_and_twelve_on_avx2(result):
    result.record(LEARNING_LOOP, KILN_DEFAULT, 11.0)
    o = outcomes(result)[f"learning loop ({KILN_DEFAULT})"]
    assert o.status == MISSED and o.measured == "11.0 s"
    result.comparisons.append(Comparison("kiln avx2", "llama-server avx2", "avx2", "default"))
    result.record(LEARNING_LOOP, "kiln avx2", 11.0)
    assert outcomes(result)["learning loop (kiln avx2)"].status == MET


def test_itl_while_training_target_is_five_times_at_most(result):
    name = f"ITL p99 while training ({KILN_DEFAULT})"
    result.record(TRAINING_ITL_RATIO, KILN_DEFAULT, 5.2)
    assert outcomes(result)[name].status == MISSED
    result.record(TRAINING_ITL_RATIO, KILN_DEFAULT, 4.9)
    assert outcomes(result)[name].status == MET


def test_a_real_size_model_is_held_to_the_real_size_targets(result):
    """At 0.5B parameters and more: decode >= 1.0x with either weights, prefill >= 2x, a 300 ms gap."""
    result.model_parameters = 1_240_000_000
    result.record(decode_spec(100), KILN_GGUF, 31.0)   # llama-server: 30
    result.record(decode_spec(500), KILN_GGUF, 26.0)   # llama-server: 25
    result.record(ITL_MAX, KILN_GGUF, 280.0)
    o = outcomes(result)
    assert o["single-stream decode, gguf (avx512)"].status == MET
    assert o["prefill, gguf (avx512)"].status == MET
    assert o[f"ITL during a long-prompt arrival ({KILN_GGUF})"].status == MET
    result.record(ITL_MAX, KILN_GGUF, 320.0)
    assert outcomes(result)[f"ITL during a long-prompt arrival ({KILN_GGUF})"].status == MISSED
    names = [t.name for t, _ in evaluate_targets(result)]
    assert "single-stream decode, gguf (avx512)" in names


def test_a_small_model_keeps_the_small_model_targets(result):
    result.model_parameters = 135_000_000
    result.record(decode_spec(100), KILN_GGUF, 31.0)   # 1.03x: short of 1.5x
    assert outcomes(result)["single-stream decode, gguf (avx512)"].status == MISSED
    result.record(ITL_MAX, KILN_GGUF, 280.0)
    assert outcomes(result)[f"ITL during a long-prompt arrival ({KILN_GGUF})"].status == MISSED


def test_the_learning_loop_target_at_1b_is_thirty_seconds_and_none_above_it(result):
    result.model_parameters = 1_240_000_000
    result.record(LEARNING_LOOP, KILN_DEFAULT, 28.0)
    o = outcomes(result)[f"learning loop ({KILN_DEFAULT})"]
    assert o.status == MET and o.measured == "28.0 s"
    result.model_parameters = 3_200_000_000
    assert f"learning loop ({KILN_DEFAULT})" not in outcomes(result)
