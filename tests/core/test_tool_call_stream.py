"""Streaming tool-call gate (semantics.md §3.5) and its equivalence with the non-streaming split."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.core.reasoning import ReasoningStreamSplitter, split_reasoning
from kiln.core.tool_call_stream import ToolCallStreamParser
from kiln.core.tool_calls import parse_tool_calls
from kiln.testing.schemas import validate

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "q": {"type": "string"}, "n": {"type": "integer"}}}}}]
XML = "<tool_call>\n<function=f>\n<parameter=q>\nhi there\n</parameter>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>"
JSON_TAG = '<tool_call>\n{"name": "f", "arguments": {"q": "x"}}\n</tool_call>'


def stream(chunks: list[str], seed: int = 0, reasoning: str | None = None) -> tuple[str, list[dict], list]:
    p = ToolCallStreamParser(TOOLS, rng=random.Random(seed))
    content, calls, deltas = "", [], []
    for c in chunks:
        d = p.feed(c)
        deltas.append(d)
        content += d.content
        calls += d.tool_calls
    d = p.finish(reasoning)
    deltas.append(d)
    return content + d.content, calls + d.tool_calls, deltas


def test_plain_content_streams_eagerly():
    p = ToolCallStreamParser(TOOLS)
    assert p.feed("Hello").content == "Hello"
    assert p.feed(" world.").content == " world."


def test_trailing_whitespace_and_a_partial_tag_are_held_back():
    p = ToolCallStreamParser(TOOLS)
    assert p.feed("Let me check.\n\n<tool").content == "Let me check."
    assert p.feed("box> ok").content == "\n\n<toolbox> ok"


def test_a_closed_block_is_emitted_at_once_with_its_index():
    p = ToolCallStreamParser(TOOLS, rng=random.Random(3))
    d = p.feed("Checking.\n" + XML)
    assert d.content == "Checking."
    (call,) = d.tool_calls
    assert call["index"] == 0 and call["function"] == {"name": "f", "arguments": '{"q":"hi there","n":2}'}
    d = p.feed("\n" + JSON_TAG)
    assert [c["index"] for c in d.tool_calls] == [1]
    assert p.finish() == type(d)()
    assert p.finish_reason == "tool_calls"


def test_an_unclosed_block_is_emitted_at_the_end_of_stream():
    content, calls, deltas = stream([XML.removesuffix("</tool_call>")])
    assert content == "" and len(calls) == 1
    assert deltas[0].tool_calls == [] and deltas[-1].tool_calls == calls


def test_an_unparseable_block_comes_back_as_content_at_the_end():
    text = "Answer:  <tool_call> not a call"
    content, calls, _ = stream([text])
    assert content == text and calls == []


def test_a_leading_json_object_is_held_until_the_end():
    p = ToolCallStreamParser(TOOLS)
    assert p.feed('{"name": "f", ').content == ""
    assert p.feed('"arguments": {}}').content == ""
    d = p.finish()
    assert d.content == "" and d.tool_calls[0]["function"]["name"] == "f"


def test_a_leading_code_fence_that_is_not_a_tool_call_streams():
    p = ToolCallStreamParser(TOOLS)
    assert p.feed("``").content == ""
    assert p.feed("`python\nx = 1").content == "```python\nx = 1"


def test_calls_only_in_reasoning_are_emitted_at_the_end_with_content_untouched():
    content, calls, _ = stream(["The answer."], reasoning="plan " + XML)
    assert content == "The answer." and len(calls) == 1


def test_a_tool_call_chunk_validates_against_the_contract():
    _, calls, _ = stream([XML])
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": "tool_calls"}]}
    validate("kiln-inference-v1.schema.json", "ChatCompletionChunk", chunk)


_pieces = st.sampled_from(["Sure", " ", "\n", "ok.", "<", "tool", "_call", ">", "<tool_call>", "</tool_call>",
                           XML, JSON_TAG, XML.removesuffix("</tool_call>"), "<function=f>", "</function>", "x y"])


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


# Bare JSON / fenced calls are recognised by the stream only at the start of the content.
_leading = st.sampled_from(["", "  ", '{"name": "f", "arguments": {"n": 1}}', '{"a": 1}', "```py\nx\n```",
                            '\n```tool_call\n{"name": "f", "arguments": {}}\n```', "`", "{"])


@settings(max_examples=300, deadline=None)
@given(lead=_leading, parts=st.lists(_pieces, max_size=12), cuts=st.lists(st.integers(0, 2000), max_size=15),
       seed=st.integers(0, 2**32))
def test_streaming_concatenation_equals_the_non_streaming_result(lead, parts, cuts, seed):
    text = lead + "".join(parts)
    content, calls, _ = stream(_chunks(text, cuts), seed)
    expected = parse_tool_calls(text, None, tools=TOOLS, rng=random.Random(seed))
    assert content == expected.content
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert [{k: v for k, v in c.items() if k != "index"} for c in calls] == expected.tool_calls


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.sampled_from(["plan ", "</think>", "</th", "ink>", "\n\n", "Sure.", XML, JSON_TAG]),
                      max_size=8),
       cuts=st.lists(st.integers(0, 2000), max_size=15), started=st.booleans())
def test_reasoning_splitter_feeding_the_gate_matches_the_non_streaming_pipeline(parts, cuts, started):
    text = "".join(parts)
    splitter = ReasoningStreamSplitter(started)
    gate = ToolCallStreamParser(TOOLS, rng=random.Random(0))
    reasoning, content, calls = "", "", []
    for chunk in [*_chunks(text, cuts), None]:
        r = splitter.feed(chunk) if chunk is not None else splitter.flush()
        reasoning += r.reasoning
        d = gate.feed(r.content)
        content += d.content
        calls += d.tool_calls
    d = gate.finish(reasoning or None)
    content += d.content
    calls += d.tool_calls
    split_r, split_c = split_reasoning(text, started)
    expected = parse_tool_calls(split_c, split_r, tools=TOOLS, rng=random.Random(0))
    assert reasoning == (split_r or "")
    assert content == expected.content
    assert [{k: v for k, v in c.items() if k != "index"} for c in calls] == expected.tool_calls
