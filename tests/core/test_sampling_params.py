import math

import pytest

from kiln.core.sampling import PRESETS, SamplingParams, resolve_sampling, validate_sampling
from kiln.errors import KilnError


def resolve(explicit=None, *, preset=None, qwen3=True, tools=False, model_defaults=None, eval_mode=False):
    return resolve_sampling(
        explicit or {},
        preset=preset,
        qwen3_family=qwen3,
        has_tools=tools,
        model_defaults=model_defaults or {},
        eval_mode=eval_mode,
    )


def test_presets_match_the_table():
    assert PRESETS["greedy"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "presence_penalty": 0.0}
    assert PRESETS["qwen3-thinking-general"]["presence_penalty"] == 1.5
    assert PRESETS["qwen3-thinking-coding"]["temperature"] == 0.6
    assert PRESETS["qwen3-non-thinking-general"]["top_p"] == 0.8
    assert set(PRESETS) == {
        "greedy",
        "qwen3-thinking-general",
        "qwen3-thinking-coding",
        "qwen3-non-thinking-general",
        "qwen3-non-thinking-reasoning",
    }


def test_named_preset_applies_with_table_defaults_for_the_rest():
    p = resolve(preset="qwen3-non-thinking-general")
    assert (p.temperature, p.top_p, p.top_k, p.presence_penalty) == (0.7, 0.8, 20, 1.5)
    assert (p.min_p, p.repetition_penalty, p.frequency_penalty, p.max_tokens) == (0.0, 1.0, 0.0, 2048)


def test_preset_name_is_trimmed_and_lowercased():
    assert resolve(preset="  Qwen3-Thinking-Coding ").temperature == 0.6


def test_qwen35_alias_maps_to_qwen3_preset():
    assert resolve(preset="qwen3.5-non-thinking-general") == resolve(preset="qwen3-non-thinking-general")


def test_unknown_preset_falls_back_to_thinking_general():
    assert resolve(preset="no-such-preset") == resolve(preset="qwen3-thinking-general")


def test_named_preset_applies_even_for_non_qwen_models():
    p = resolve(preset="greedy", qwen3=False, model_defaults={"temperature": 0.3})
    assert p.temperature == 0.0 and p.is_greedy


def test_qwen3_without_preset_uses_thinking_general():
    p = resolve()
    assert (p.temperature, p.top_p, p.top_k, p.presence_penalty) == (1.0, 0.95, 20, 1.5)


def test_qwen3_with_tools_and_no_preset_uses_thinking_coding():
    assert resolve(tools=True) == resolve(preset="qwen3-thinking-coding")


def test_non_qwen_model_uses_generation_config_over_neutral_defaults():
    p = resolve(
        qwen3=False, model_defaults={"temperature": 0.6, "top_p": 0.9, "do_sample": True, "bos_token_id": 1}
    )
    assert (p.temperature, p.top_p) == (0.6, 0.9)
    assert (p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (
        0,
        0.0,
        0.0,
        0.0,
        1.0,
    )


def test_non_qwen_model_without_generation_config_gets_openai_neutral_defaults():
    assert resolve(qwen3=False) == SamplingParams()


def test_unusable_generation_config_values_are_ignored():
    p = resolve(qwen3=False, model_defaults={"temperature": "hot", "top_p": 7.0, "top_k": 40})
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 40)


def test_explicit_fields_override_the_preset():
    p = resolve({"temperature": 0.2, "top_k": 5, "stop": "END", "seed": 7}, preset="qwen3-thinking-general")
    assert (p.temperature, p.top_k, p.top_p, p.stop, p.seed) == (0.2, 5, 0.95, ["END"], 7)


def test_explicit_fields_override_generation_config():
    assert resolve({"top_p": 0.5}, qwen3=False, model_defaults={"top_p": 0.9}).top_p == 0.5


def test_none_values_count_as_unset():
    assert resolve({"temperature": None}).temperature == 1.0


def test_max_tokens_defaults_to_2048():
    assert resolve().max_tokens == 2048


def test_max_completion_tokens_is_an_alias_that_max_tokens_beats():
    assert resolve({"max_completion_tokens": 100}).max_tokens == 100
    assert resolve({"max_completion_tokens": 100, "max_tokens": 50}).max_tokens == 50


def test_eval_mode_defaults_unset_fields_to_deterministic_values():
    p = resolve(preset="qwen3-thinking-general", eval_mode=True)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.seed) == (0.0, 0.0, 1.0, 0)
    assert p.max_tokens == 2048


def test_eval_mode_keeps_explicit_fields():
    p = resolve({"temperature": 0.8, "seed": 3}, eval_mode=True)
    assert (p.temperature, p.seed, p.top_p) == (0.8, 3, 1.0)


def test_is_greedy_for_zero_temperature_or_top_k_one():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy
    assert not SamplingParams(temperature=math.inf, top_k=1).is_greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 1.5),
        ("top_p", -0.1),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("top_k", -1),
        ("max_tokens", -1),
        ("seed", -1),
        ("seed", 2**64),
    ],
)
def test_validate_rejects_out_of_range_field_with_400_naming_it(field, value):
    with pytest.raises(KilnError) as exc:
        validate_sampling(SamplingParams(**{field: value}))
    err = exc.value
    assert (err.status, err.code, err.param) == (400, "chat_invalid_request", field)
    assert err.hint


def test_validate_accepts_every_preset_and_range_edges():
    for name in PRESETS:
        validate_sampling(resolve(preset=name))
    validate_sampling(
        SamplingParams(top_p=0.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0, seed=2**64 - 1)
    )


def test_validate_uses_the_callers_error_code():
    with pytest.raises(KilnError) as exc:
        validate_sampling(SamplingParams(top_p=2.0), code="completion_invalid_request")
    assert exc.value.code == "completion_invalid_request"


def test_a_temperature_too_small_to_divide_by_is_greedy():
    # found by the contract fuzzer: 2.4e-163 became 0 in float32 and the whole batch step failed
    from kiln.core.sampling import SamplingParams

    assert SamplingParams(temperature=2.4e-163).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
