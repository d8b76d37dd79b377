"""The output grammar a request asks for, and the 400s for asking wrongly (no model, no llguidance)."""

from __future__ import annotations

import json

import pytest

from kiln.core.output_grammar import output_grammar
from kiln.core.tool_grammar import tool_grammar
from kiln.errors import KilnError

CODE = "chat_invalid_request"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def build(**fields):
    return output_grammar(fields, code=CODE, gbnf_to_lark=lambda text: "start: " + text.split("::=")[1])


def refusal(**fields) -> KilnError:
    with pytest.raises(KilnError) as e:
        build(**fields)
    assert e.value.status == 400 and e.value.code == CODE
    return e.value


def doc(grammar) -> dict:
    return json.loads(grammar.grammar)["grammars"][0]


def test_no_constraint_fields_mean_free_text():
    assert build() is None
    assert build(response_format={"type": "text"}) is None
    assert build(response_format=None) is None


def test_json_object_is_any_object_with_bounded_whitespace():
    g = build(response_format={"type": "json_object"})
    assert g.kind == "json_object" and g.param == "response_format"
    schema = doc(g)["json_schema"]
    assert schema["type"] == "object"
    assert schema["x-guidance"]["whitespace_flexible"] is False


@pytest.mark.parametrize("strict", [True, False, None])
def test_json_schema_is_enforced_strict_or_not(strict):
    g = build(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": strict}})
    assert g.kind == "json_schema" and g.param == "response_format.json_schema.schema"
    assert doc(g)["json_schema"]["required"] == ["name"]


def test_kiln_whitespace_rule_overrides_the_schemas_own_x_guidance():
    g = build(json_schema={**SCHEMA, "x-guidance": {"whitespace_flexible": True, "coerce_one_of": True,
                                                    "lenient": True}})
    guidance = doc(g)["json_schema"]["x-guidance"]
    assert guidance["whitespace_flexible"] is False and guidance["coerce_one_of"] is True
    assert guidance["lenient"] is False   # unimplemented keywords are refused, never skipped


def test_a_schema_sent_as_text_or_object_has_the_same_cache_key():
    schema = {"type": "object", "required": ["x"], "properties": {"x": {}}}
    a = build(structured_outputs={"json": schema})
    b = build(structured_outputs={"json": json.dumps(schema, indent=2)})
    assert a.key == b.key


def test_property_order_is_kept_since_output_follows_it():
    g = build(json_schema={"type": "object", "properties": {"b": {}, "a": {}}})
    assert list(doc(g)["json_schema"]["properties"]) == ["b", "a"]


def test_unknown_response_format_type_names_the_path():
    assert refusal(response_format={"type": "yaml"}).param == "response_format.type"


def test_json_schema_without_a_schema_names_the_path():
    assert refusal(response_format={"type": "json_schema", "json_schema": {"name": "a"}}).param == \
        "response_format.json_schema.schema"
    assert refusal(response_format={"type": "json_schema"}).param == "response_format.json_schema"


def test_a_schema_that_is_not_an_object_is_refused():
    assert refusal(structured_outputs={"json": "[1, 2"}).param == "structured_outputs.json"
    assert refusal(json_schema=False).param == "json_schema"
    assert refusal(guided_json=3).param == "guided_json"


def test_vllm_structured_outputs_regex_choice_and_grammar():
    assert build(structured_outputs={"regex": "[a-z]+"}).kind == "regex"
    choice = build(structured_outputs={"choice": ["yes", "no"]})
    assert choice.kind == "choice" and doc(choice)["lark_grammar"] == 'start: "yes" | "no"'
    lark = build(structured_outputs={"grammar": 'start: "a"+'})
    assert lark.kind == "grammar" and doc(lark)["lark_grammar"] == 'start: "a"+'


def test_structured_outputs_takes_exactly_one_kind():
    assert refusal(structured_outputs={"regex": "a", "choice": ["a"]}).param == "structured_outputs"
    assert refusal(structured_outputs={"choice": []}).param == "structured_outputs.choice"
    assert refusal(structured_outputs={"structural_tag": {}}).param == "structured_outputs.structural_tag"


def test_llama_cpp_gbnf_is_converted_and_lark_is_kept():
    gbnf = build(grammar='root ::= "yes" | "no"')
    assert doc(gbnf)["lark_grammar"] == 'start:  "yes" | "no"'
    assert doc(build(grammar='start: "x"'))["lark_grammar"] == 'start: "x"'


def test_two_families_at_once_are_refused():
    e = refusal(response_format={"type": "json_object"}, guided_regex="a+")
    assert e.param == "guided_regex"


def test_regex_slashes_are_escaped_for_lark():
    assert doc(build(guided_regex="a/b"))["lark_grammar"] == "start: /a\\/b/"


# ---- tool_choice ------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def tools(choice, parallel=None):
    return tool_grammar(TOOLS, choice, parallel, code=CODE)


def test_auto_and_absent_tool_choice_constrain_nothing():
    assert tools(None) is None and tools("auto") is None


def test_required_allows_every_function_and_several_calls_by_default():
    g = tools("required")
    lark = doc(g)["lark_grammar"]
    assert g.kind == "tool_call" and '"get_weather"' in lark and '"get_time"' in lark
    assert '("\\n" call)*' in lark


def test_parallel_tool_calls_false_allows_one_call():
    assert '("\\n" call)*' not in doc(tools("required", parallel=False))["lark_grammar"]


def test_a_named_function_is_the_only_one_allowed():
    g = tools({"type": "function", "function": {"name": "get_time"}})
    lark = doc(g)["lark_grammar"]
    assert '"get_time"' in lark and "get_weather" not in lark
    assert g.param == "tool_choice.function.name"


def test_a_named_function_that_tools_lacks_is_a_400():
    with pytest.raises(KilnError) as e:
        tools({"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice.function.name"


def test_required_without_tools_is_a_400():
    with pytest.raises(KilnError) as e:
        tool_grammar(None, "required", None, code=CODE)
    assert e.value.param == "tool_choice"


def test_none_forbids_the_tool_call_tag():
    g = tools("none")
    assert g.kind == "no_tool_call" and "<tool_call>" in doc(g)["lark_grammar"]


def test_an_unknown_tool_choice_is_a_400():
    with pytest.raises(KilnError):
        tools("sometimes")


def test_objects_listing_properties_are_closed_unless_the_schema_says_otherwise():
    g = build(json_schema={"type": "object", "properties": {
        "inner": {"type": "object", "properties": {"x": {}}},
        "open": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
        "list": {"type": "array", "items": {"type": "object", "properties": {"z": {}}}},
        "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}}})
    schema = doc(g)["json_schema"]
    props = schema["properties"]
    assert schema["additionalProperties"] is False and props["inner"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False
    assert all("additionalProperties" not in branch for branch in props["both"]["allOf"])


def test_a_schema_nested_past_the_recursion_limit_is_a_400_not_a_crash():
    deep: dict = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    assert refusal(json_schema=deep).param == "json_schema"
    with pytest.raises(KilnError) as e:
        tool_grammar([{"type": "function", "function": {"name": "f", "parameters": deep}}], "required", None,
                     code=CODE)
    assert e.value.status == 400 and e.value.param == "tools"
