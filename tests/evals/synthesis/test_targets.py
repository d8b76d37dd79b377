"""Target extraction from an assistant message (semantics.md §10.3), one priority rule per test."""

import json

from kiln.evals.synthesis.targets import extract_target


def target(content=None, **extra):
    return extract_target({"role": "assistant", "content": content, **extra})


def test_structured_tool_calls_become_canonical_json_with_decoded_arguments():
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}
    t = target("ignored text", tool_calls=[call])
    assert t.kind == "tool_call"
    assert t.text == '{"tool_calls":[{"arguments":{"city":"Oslo"},"name":"get_weather"}]}'


def test_several_structured_calls_keep_their_order():
    calls = [{"function": {"name": "b", "arguments": {}}}, {"function": {"name": "a", "arguments": {"x": 1}}}]
    assert [c["name"] for c in json.loads(target("", tool_calls=calls).text)["tool_calls"]] == ["b", "a"]


def test_blank_content_has_no_target():
    assert target("   \n") is None
    assert target(None) is None
    assert target("", tool_calls=[]) is None


def test_a_qwen_xml_tool_call_in_content_is_canonicalized():
    xml = "<tool_call>\n<function=run>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
    t = target(xml)
    assert (t.kind, t.text) == ("tool_call", '{"tool_calls":[{"arguments":{"n":3},"name":"run"}]}')


def test_a_json_tool_call_in_a_tag_block_is_canonicalized():
    t = target('<tool_call>\n{"name": "f", "arguments": {"a": "b"}}\n</tool_call>')
    assert t.text == '{"tool_calls":[{"arguments":{"a":"b"},"name":"f"}]}'


def test_a_fenced_tool_call_block_is_canonicalized():
    t = target('Calling:\n```tool_call\n{"name": "f", "arguments": {}}\n```')
    assert (t.kind, t.text) == ("tool_call", '{"tool_calls":[{"arguments":{},"name":"f"}]}')


def test_inline_json_that_names_a_function_is_a_tool_call():
    t = target('{"function": {"name": "f", "arguments": "{\\"q\\": 1}"}}')
    assert t.text == '{"tool_calls":[{"arguments":{"q":1},"name":"f"}]}'


def test_json_data_that_does_not_look_like_a_call_stays_prose():
    t = target('{"name": "Ada", "born": 1815}')
    assert (t.kind, t.text) == ("prose", '{"name": "Ada", "born": 1815}')


def test_the_first_fenced_code_block_gives_its_body_and_language():
    t = target("Here you go:\n```py\ndef f():\n    return 1\n```\nand\n```rust\nfn g() {}\n```")
    assert (t.kind, t.text, t.language) == ("code", "def f():\n    return 1", "python")
    assert t.detect_text == "```py\ndef f():\n    return 1\n```"


def test_a_one_line_block_without_a_known_language_is_not_code():
    t = target("Run:\n```\nmake\n```")
    assert t.kind == "prose"


def test_a_one_line_block_in_a_known_language_is_code():
    t = target("```bash\nls -la\n```")
    assert (t.kind, t.text, t.language) == ("code", "ls -la", "bash")


def test_plain_content_is_prose_trimmed():
    t = target("  The answer is forty-two.\n")
    assert (t.kind, t.text, t.language) == ("prose", "The answer is forty-two.", None)


def test_a_leading_thinking_block_is_not_part_of_the_target():
    assert target("<think>\nadd them\n</think>\n\n4").text == "4"


def test_text_parts_are_joined():
    assert target([{"type": "text", "text": "4"}, {"type": "image_url", "image_url": {}}]).text == "4"
