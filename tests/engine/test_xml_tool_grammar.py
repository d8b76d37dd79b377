"""Qwen3-Coder's XML tool calls under tool_choice: the form is read off the chat template, the grammar
accepts exactly the calls kiln.core.tool_calls parses back to arguments valid against the function's
parameters, and a tiny model whose template teaches the form writes such calls when forced."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import llguidance
import pytest

from kiln.core.sampling import SamplingParams
from kiln.core.tool_calls import ParsedToolCall, extract_tool_calls, render_xml
from kiln.core.tool_grammar import tool_call_format, tool_grammar
from kiln.engine.actor import GenerationRequest
from kiln.errors import KilnError
from kiln.testing.tiny import qwen3_chat_template, tiny_tokenizer

PARAMS = {"type": "object", "properties": {
    "city": {"type": "string"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "note": {"type": ["string", "null"], "maxLength": 20},
    "options": {"type": "object", "properties": {"hourly": {"type": "boolean"}}}},
    "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}]
# the part of Qwen3-Coder's template that teaches the form
XML_TEMPLATE = (qwen3_chat_template() + "{#- <tool_call>\n<function=example_function_name>\n"
                "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call> -#}")


@pytest.fixture(scope="module")
def ll():
    tok = tiny_tokenizer()
    tags = (tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>"))
    return tok, llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size()), tags


def grammar(ll, tool_choice="required", parallel=None):
    return tool_grammar(TOOLS, tool_choice, parallel, code="chat_invalid_request", tag_ids=ll[2], fmt="xml").grammar


def accepts(ll, grammar_text: str, text: str) -> bool:
    tok, lt, _ = ll
    matcher = llguidance.LLMatcher(lt, grammar_text, log_level=0)
    return matcher.consume_tokens(tok.encode(text).ids) and matcher.is_accepting()


def xml(name: str, args: dict) -> str:
    return render_xml(ParsedToolCall(name, args, "qwen3_xml"))


def test_the_form_is_read_off_the_chat_template():
    assert tool_call_format(XML_TEMPLATE) == "xml"
    assert tool_call_format(qwen3_chat_template()) == "json"
    assert tool_call_format(None) == "json"


@pytest.mark.parametrize("args", [
    {"city": "Paris", "days": 3},
    {"city": "New York\nNY 10001", "days": 7, "unit": "fahrenheit", "note": "rain", "options": {"hourly": True}},
    {"city": "42", "days": 1, "note": None},
])
def test_valid_calls_are_accepted_and_parse_back_to_their_arguments(ll, args):
    text = xml("get_weather", args)
    assert accepts(ll, grammar(ll), text)
    [call] = extract_tool_calls(text, TOOLS)
    assert call.name == "get_weather" and call.arguments == args
    jsonschema.validate(call.arguments, PARAMS)


@pytest.mark.parametrize(("name", "args"), [
    ("get_weather", {"days": 3}),                                  # a required parameter missing
    ("get_weather", {"city": "Paris", "days": 9}),                 # out of range
    ("get_weather", {"city": "Paris", "days": 3, "unit": "kelvin"}),
    ("get_weather", {"city": "Paris", "days": 3, "wind": 1}),      # a parameter the schema does not list
    ("get_weather", {"city": "a</parameter>b", "days": 3}),        # the closing tag inside a value
    ("get_weather", {"city": "Paris", "days": 3, "note": "x" * 21}),
    ("get_pressure", {"city": "Paris"}),                           # a function tools does not define
])
def test_invalid_calls_are_rejected(ll, name, args):
    assert not accepts(ll, grammar(ll), xml(name, args))


def test_several_calls_unless_parallel_tool_calls_is_false_and_a_named_function_alone(ll):
    two = xml("get_weather", {"city": "Oslo", "days": 2}) + "\n" + xml("get_time", {"zone": "CET"})
    assert accepts(ll, grammar(ll), two)
    assert not accepts(ll, grammar(ll, parallel=False), two)
    named = grammar(ll, {"type": "function", "function": {"name": "get_time"}})
    assert accepts(ll, named, xml("get_time", {"zone": "UTC"}))
    assert not accepts(ll, named, xml("get_weather", {"city": "Oslo", "days": 2}))


def test_free_text_is_not_a_call(ll):
    assert not accepts(ll, grammar(ll), "The weather in Paris is sunny.")


def test_a_parameter_that_is_sometimes_a_string_is_a_400_naming_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": {"anyOf": [{"type": "string", "pattern": "^a"}, {"type": "integer"}]}}}}}]
    with pytest.raises(KilnError) as e:
        tool_grammar(tools, "required", None, code="chat_invalid_request", fmt="xml")
    assert e.value.status == 400 and e.value.param == "tools" and e.value.code == "chat_invalid_request"
    assert "'v'" in e.value.message


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from kiln.config import DataSettings, EngineSettings, ModelSettings, Settings
    from kiln.engine.build import build_engine
    from kiln.testing.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("xml_tools")
    model = make_tiny_model(root / "m", arch="qwen3", init_std=0.3, chat_template=XML_TEMPLATE)
    eng = build_engine(Settings(model=ModelSettings(path=str(model), dtype="float32"),
                                data=DataSettings(data_dir=str(root / "data")),
                                engine=EngineSettings(kv_cache_memory_mb=8)))
    yield eng
    eng.shutdown()


def test_a_tiny_model_with_an_xml_template_writes_xml_calls_valid_against_the_parameters(engine):
    from kiln.engine.chat_request import compile_output_grammar

    ctx = engine.prompt_context()
    assert ctx.tool_format == "xml"
    compiled = compile_output_grammar(ctx, {}, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                      code="chat_invalid_request", prefix="")
    prompt = engine.encode_prompt(engine.render_chat([{"role": "user", "content": "Weather?"}], tools=TOOLS))

    async def go(seed: int) -> list[int]:
        params = engine.choice_params(SamplingParams(max_tokens=200, seed=seed, temperature=1.0), 1)
        ids: list[int] = []
        async for _, ev in engine.submit([GenerationRequest(prompt, params, grammar=compiled)]):
            ids += ev.token_ids
            assert ev.finish_reason in (None, "stop"), ev.error
        return ids

    for seed in range(3):
        text = engine.tokenizer.decode(asyncio.run(go(seed)))
        [call] = extract_tool_calls(text, TOOLS)
        assert "<function=" in text and call.format == "qwen3_xml"
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.name)
        jsonschema.validate(json.loads(json.dumps(call.arguments)), schema)


def test_an_optional_string_parameter_keeps_number_like_text_a_string(ll):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": {"anyOf": [{"type": "string"}, {"type": "null"}]}}, "required": ["v"]}}}]
    g = tool_grammar(tools, "required", None, code="chat_invalid_request", tag_ids=ll[2], fmt="xml").grammar
    for value in ("42", None, "true"):
        text = xml("f", {"v": value})
        assert accepts(ll, g, text)
        [call] = extract_tool_calls(text, tools)
        assert call.arguments == {"v": value}


def test_text_beside_a_number_type_never_reads_as_a_number(ll):
    # "42" would come back as the integer 42, held to the integer's own bounds: only text is written
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": {"type": ["string", "integer"], "maximum": 5}}, "required": ["v"]}}}]
    g = tool_grammar(tools, "required", None, code="chat_invalid_request", tag_ids=ll[2], fmt="xml").grammar
    assert accepts(ll, g, xml("f", {"v": "abc"}))
    assert not accepts(ll, g, xml("f", {"v": 42})) and not accepts(ll, g, xml("f", {"v": "42"}))
