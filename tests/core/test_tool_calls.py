"""Tool-call extraction and the OpenAI shape (semantics.md §3.5-3.6)."""

from __future__ import annotations

import json
import random
import re

import pytest

from kiln.core.tool_calls import (
    ParsedToolCall,
    canonical_json,
    extract_tool_calls,
    new_call_id,
    parse_tool_calls,
    parse_xml_body,
    render_xml,
    schema_issues,
    tool_parsing_enabled,
    type_parameter_value,
    unwrap_tool_response,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def calls(text: str, tools=TOOLS) -> list[tuple[str, dict, str]]:
    return [(c.name, c.arguments, c.format) for c in extract_tool_calls(text, tools)]


def args_of(result) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls]


# ---- extraction ---------------------------------------------------------------------------------


def test_the_xml_form_parses_name_and_typed_parameters():
    assert calls(XML_CALL) == [("get_weather", {"city": "Paris", "days": 3}, "qwen3_xml")]


def test_a_json_body_inside_the_tag_parses():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert calls(text) == [("get_weather", {"city": "Oslo"}, "json_inline")]


def test_every_block_is_extracted_in_order():
    text = XML_CALL + "\n" + XML_CALL.replace("Paris", "Rome")
    assert [a["city"] for _, a, _ in calls(text)] == ["Paris", "Rome"]


def test_an_unclosed_trailing_block_counts_when_its_body_is_whole():
    # Tool requests stop on "</tool_call>", so the close tag is usually missing at the end.
    assert calls(XML_CALL.removesuffix("</tool_call>"))[0][0] == "get_weather"


def test_a_truncated_block_yields_no_call():
    assert calls("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar") == []


def test_a_block_without_a_function_name_yields_no_call():
    assert calls("<tool_call><function= ></function></tool_call>") == []


def test_fenced_tool_call_blocks_parse_when_there_is_no_tag():
    text = 'Sure.\n```tool_call\n{"name": "f", "arguments": {"x": 1}}\n```'
    assert calls(text) == [("f", {"x": 1}, "fenced")]


def test_the_whole_text_as_json_parses():
    assert calls('  {"name": "f", "arguments": "{\\"a\\": 2}"}  ') == [("f", {"a": 2}, "json_inline")]


def test_a_tool_calls_list_gives_every_entry_and_function_wrappers_are_open_ai():
    text = json.dumps({"tool_calls": [{"function": {"name": "a", "arguments": {}}}, {"name": "b", "input": None}]})
    assert calls(text) == [("a", {}, "open_ai"), ("b", {}, "json_inline")]


def test_non_object_arguments_are_wrapped_under_args():
    assert calls('{"name": "f", "parameters": [1, 2]}') == [("f", {"args": [1, 2]}, "json_inline")]


def test_an_embedded_object_that_looks_like_a_call_is_found_in_prose():
    text = 'I will call {"name": "f", "arguments": {"q": "}"}} now. {"other": 1}'
    assert calls(text) == [("f", {"q": "}"}, "json_inline")]


def test_an_embedded_object_that_does_not_look_like_a_call_is_ignored():
    assert calls('Here: {"a": 1, "b": [2]} done.') == []


# ---- XML value typing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("   ", ""),
        ('{"a": [1]}', {"a": [1]}),
        ("[1, 2", "[1, 2"),
        ("True", True),
        ("false", False),
        ("None", None),
        ("-12.5e2", -1250.0),
        ("42", 42),
        ("1e999", "1e999"),
        ("007", "007"),
        ("true\nfalse", "true\nfalse"),
        ("  spaced text ", "  spaced text "),
    ],
)
def test_parameter_values_are_typed_like_the_extractor(raw, expected):
    assert type_parameter_value(raw) == expected


def test_a_value_the_schema_declares_as_string_stays_a_string():
    assert type_parameter_value("02139", {"type": "string"}) == "02139"
    assert type_parameter_value("2139", {"type": "string"}) == "2139"
    assert type_parameter_value("true", {"type": ["string", "null"]}) == "true"


def test_a_value_the_schema_admits_keeps_its_json_type():
    assert type_parameter_value("3", {"type": "integer"}) == 3
    assert type_parameter_value("3", {"type": ["integer", "string"]}) == 3
    assert type_parameter_value("null", {"type": ["string", "null"]}) is None


def test_parameter_values_lose_one_leading_and_one_trailing_newline():
    body = "<function=f><parameter=a>\n\n  x\n\n</parameter><parameter=b>y</parameter></function>"
    assert parse_xml_body(body).arguments == {"a": "  x\n", "b": "y"}


def test_schema_issues_list_missing_required_and_unknown_keys():
    call = ParsedToolCall("get_weather", {"zip": "1", "units": "c"}, "qwen3_xml")
    assert schema_issues(call, TOOLS) == (["city"], ["units"])
    assert schema_issues(ParsedToolCall("nope", {"a": 1}, "json_inline"), TOOLS) == ([], [])


# ---- §3.5 split and OpenAI shape ----------------------------------------------------------------


def test_parsing_needs_tools_and_a_tool_choice_other_than_none():
    assert tool_parsing_enabled(TOOLS, "auto")
    assert not tool_parsing_enabled(TOOLS, "none")
    assert not tool_parsing_enabled([], None)
    result = parse_tool_calls(XML_CALL, None, tools=TOOLS, tool_choice="none")
    assert result.tool_calls == [] and result.content == XML_CALL and result.finish_reason is None


def test_content_keeps_the_text_before_the_first_tag_right_trimmed():
    result = parse_tool_calls("Checking the weather.\n\n" + XML_CALL, None, tools=TOOLS)
    assert result.content == "Checking the weather."
    assert args_of(result) == [("get_weather", {"city": "Paris", "days": 3})]
    assert result.finish_reason == "tool_calls"


def test_content_is_empty_when_the_call_came_from_bare_json():
    result = parse_tool_calls('{"name": "get_weather", "arguments": {"city": "X"}}', None, tools=TOOLS)
    assert result.content == "" and len(result.tool_calls) == 1


def test_calls_found_only_in_reasoning_leave_it_and_content_is_untouched():
    result = parse_tool_calls("", "I should look.\n" + XML_CALL + "\n", tools=TOOLS)
    assert result.content == "" and result.reasoning == "I should look."
    assert len(result.tool_calls) == 1
    only_call = parse_tool_calls("", XML_CALL, tools=TOOLS)
    assert only_call.reasoning is None


def test_without_any_call_content_and_reasoning_are_unchanged():
    result = parse_tool_calls("plain answer", "thoughts", tools=TOOLS)
    assert (result.content, result.reasoning, result.tool_calls) == ("plain answer", "thoughts", [])


def test_the_openai_shape_has_a_call_id_function_type_and_compact_arguments():
    (call,) = parse_tool_calls(XML_CALL, None, tools=TOOLS, rng=random.Random(1)).tool_calls
    assert list(call) == ["id", "type", "function"]
    assert re.fullmatch(r"call_[0-9a-f]{32}", call["id"])
    assert call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris","days":3}'}


def test_ids_come_from_the_injected_random_source():
    assert new_call_id(random.Random(7)) == new_call_id(random.Random(7))
    assert new_call_id(random.Random(7)) != new_call_id(random.Random(8))
    assert re.fullmatch(r"call_[0-9a-f]{32}", new_call_id())


def test_non_ascii_arguments_are_kept_as_text():
    text = '<tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>'
    (call,) = parse_tool_calls(text, None, tools=TOOLS).tool_calls
    assert call["function"]["arguments"] == '{"city":"Zürich"}'


# ---- canonical forms ----------------------------------------------------------------------------


def test_rendered_xml_parses_back_to_the_same_call():
    call = ParsedToolCall("get_weather", {"city": "New York", "days": 2, "opts": {"a": None}}, "qwen3_xml")
    text = render_xml(call)
    assert text.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n")
    assert extract_tool_calls(text, TOOLS) == [call]


def test_canonical_json_sorts_keys():
    assert canonical_json(ParsedToolCall("f", {"b": 1, "a": 2}, "x")) == '{"arguments": {"a": 2, "b": 1}, "name": "f"}'


def test_tool_response_wrappers_come_off():
    assert unwrap_tool_response("<tool_response>\n42\n</tool_response>") == "42"
    assert unwrap_tool_response("no wrapper") == "no wrapper"
