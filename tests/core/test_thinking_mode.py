"""Thinking on/off from the rendered prompt, and who chose it (semantics.md §3.1, §2.3)."""

from __future__ import annotations

import pytest

from kiln.core.thinking_mode import (
    detect_thinking_mode,
    effective_template_kwargs,
    recent_thinking_mode,
    thinking_source,
)

USER = "<|im_start|>user\nhi<|im_end|>\n"


def test_a_prompt_ending_in_an_open_think_block_starts_in_reasoning():
    d = detect_thinking_mode(USER + "<|im_start|>assistant\n<think>\n")
    assert d.thinking_enabled and d.thinking_mode == "reasoning"
    assert d.prefill == "\n"


def test_an_empty_closed_think_block_means_thinking_is_off():
    d = detect_thinking_mode(USER + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not d.thinking_enabled and d.thinking_mode == "non_reasoning"


def test_a_prompt_without_think_is_non_reasoning():
    assert not detect_thinking_mode(USER + "<|im_start|>assistant\n").thinking_enabled


def test_an_assistant_prefill_inside_an_open_block_still_starts_in_reasoning():
    d = detect_thinking_mode(USER + "<|im_start|>assistant\n<think>\nLet me see,")
    assert d.thinking_enabled and d.prefill == "\nLet me see,"


def test_think_tags_in_earlier_turns_do_not_count():
    prompt = (USER + "<|im_start|>assistant\n<think>\nold\n</think>\n\nhi<|im_end|>\n"
              + "<|im_start|>user\nsay <think> please<|im_end|>\n<|im_start|>assistant\n")
    assert not detect_thinking_mode(prompt).thinking_enabled


def test_llama_style_headers_are_recognised():
    prompt = "<|start_header_id|>user<|end_header_id|>\n\n<think><|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    assert not detect_thinking_mode(prompt).thinking_enabled
    assert detect_thinking_mode(prompt + "<think>\n").thinking_enabled


def test_without_a_known_header_the_whole_prompt_is_read():
    assert detect_thinking_mode("Question: 2+2?\nAnswer: <think>  \n").thinking_enabled


def test_the_server_default_fills_enable_thinking_only_when_the_request_lacks_it():
    assert effective_template_kwargs(None, default_thinking_enabled=False) == {"enable_thinking": False}
    assert effective_template_kwargs({"enable_thinking": True}, default_thinking_enabled=False) == {
        "enable_thinking": True
    }
    assert effective_template_kwargs({"x": 1}) == {"x": 1}


def test_the_eval_mode_default_applies_when_the_server_default_is_unset():
    assert effective_template_kwargs({}, eval_mode_thinking_default=True) == {"enable_thinking": True}
    assert effective_template_kwargs(
        {}, default_thinking_enabled=False, eval_mode_thinking_default=True
    ) == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("kwargs", "server_default", "expected"),
    [
        ({"enable_thinking": False}, True, "request"),
        ({"enable_thinking": "yes"}, None, "custom"),
        ({"enable_thinking": None}, True, "custom"),
        ({}, False, "server_default"),
        (None, None, "template_default"),
    ],
)
def test_thinking_source_names_the_authority(kwargs, server_default, expected):
    assert thinking_source(kwargs, default_thinking_enabled=server_default) == expected


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"enable_thinking": True}, "explicit_enabled"),
        ({"enable_thinking": False}, "explicit_disabled"),
        ({"enable_thinking": 1}, "custom"),
        ({}, "template_default"),
    ],
)
def test_recent_requests_thinking_mode(kwargs, expected):
    assert recent_thinking_mode(kwargs) == expected
