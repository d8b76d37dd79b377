from kiln.bench.measurements import ADAPTER_RATIO, ITL_SPREAD, LEARNING_LOOP, TRAINING_ITL_RATIO, decode_spec
from kiln.bench.results import KILN, LLAMACPP
from kiln.bench.targets import MET, MISSED, NOT_MEASURED, evaluate_targets


def outcomes(result):
    return {t.name: o for t, o in evaluate_targets(result)}


def test_decode_target_is_met_at_one_times_llamacpp_on_every_prompt(result):
    o = outcomes(result)["single-stream decode"]
    assert o.status == MET
    assert "2.00x" in o.measured


def test_decode_target_is_missed_when_any_prompt_length_falls_short(result):
    result.record(decode_spec(500), KILN, 20.0)   # llama.cpp: 25
    assert outcomes(result)["single-stream decode"].status == MISSED


def test_prefill_target_needs_three_times_llamacpp(result):
    assert outcomes(result)["prefill"].status == MET


def test_aggregate_target_needs_five_times_llamacpps_server(result):
    o = outcomes(result)["aggregate throughput, 8 streams"]
    assert o.status == MISSED
    assert "3.00x" in o.measured


def test_itl_target_compares_p99_with_kilns_own_median(result):
    assert outcomes(result)["ITL p99 during a long-prompt arrival"].status == MET
    result.record(ITL_SPREAD, KILN, 3.5)
    assert outcomes(result)["ITL p99 during a long-prompt arrival"].status == MISSED


def test_llamacpp_targets_are_not_measured_without_llamacpp(result_without_llamacpp):
    o = outcomes(result_without_llamacpp)
    assert o["single-stream decode"].status == NOT_MEASURED
    assert o["aggregate throughput, 8 streams"].status == NOT_MEASURED


def test_transformers_figures_never_stand_in_for_llamacpp_in_a_target(result_without_llamacpp):
    assert result_without_llamacpp.value(decode_spec(100).key, LLAMACPP) is None
    assert outcomes(result_without_llamacpp)["single-stream decode"].measured == "needs Kiln and llama.cpp figures"


def test_adapter_target_needs_seven_tenths_of_the_base_streams(result):
    assert outcomes(result)["streams over 4 adapters"].status == NOT_MEASURED
    result.record(ADAPTER_RATIO, KILN, 0.69)
    assert outcomes(result)["streams over 4 adapters"].status == MISSED
    result.record(ADAPTER_RATIO, KILN, 0.7)
    assert outcomes(result)["streams over 4 adapters"].status == MET


def test_learning_loop_target_is_thirty_seconds_at_most(result):
    result.record(LEARNING_LOOP, KILN, 31.0)
    o = outcomes(result)["learning loop"]
    assert o.status == MISSED and o.measured == "31.0 s"
    result.record(LEARNING_LOOP, KILN, 29.5)
    assert outcomes(result)["learning loop"].status == MET


def test_itl_while_training_target_is_five_times_at_most(result):
    result.record(TRAINING_ITL_RATIO, KILN, 5.2)
    assert outcomes(result)["ITL p99 while training"].status == MISSED
    result.record(TRAINING_ITL_RATIO, KILN, 4.9)
    assert outcomes(result)["ITL p99 while training"].status == MET
