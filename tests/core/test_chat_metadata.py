"""ChatCompletionMetadata thinking/content fields (inference-api.txt; semantics.md §3.1, §3.3-3.4)."""

from __future__ import annotations

from kiln.core.chat_metadata import chat_metadata, content_empty_reason
from kiln.core.thinking_budget import budget_record, resolve_budget
from kiln.testing.schemas import validate

INF = "kiln-inference-v1.schema.json"
INERT = budget_record(resolve_budget({}, {"default_thinking_budget_tokens": None,
                                          "default_thinking_budget_ms": None}), applied=False)


def meta(**kw):
    args = {"thinking_enabled": True, "thinking_source": "template_default", "default_thinking_enabled": None,
            "content": "4", "reasoning": "2+2", "tool_calls": None, "fold": False, "thinking_budget": INERT}
    args.update(kw)
    out = chat_metadata(**args)
    validate(INF, "ChatCompletionMetadata", out)
    return out


def test_the_contract_example_metadata_is_reproduced_in_order():
    out = meta(thinking_enabled=False, reasoning=None)
    assert out == {"thinking_enabled": False, "thinking_mode": "non_reasoning", "thinking_source": "template_default",
                   "final_content_empty": False, "reasoning_folded_into_content": False, "thinking_budget": INERT}
    assert list(out) == ["thinking_enabled", "thinking_mode", "thinking_source", "final_content_empty",
                         "reasoning_folded_into_content", "thinking_budget"]


def test_the_server_default_appears_only_when_set():
    out = meta(default_thinking_enabled=True, thinking_source="server_default")
    assert list(out)[3] == "default_thinking_enabled" and out["default_thinking_enabled"] is True


def test_empty_content_after_reasoning_names_reasoning_first():
    out = meta(content="", reasoning="thinking", tool_calls=[{"id": "x"}])
    assert out["final_content_empty"] is True
    assert out["content_empty_reason"] == "reasoning_without_final_content"
    assert list(out).index("content_empty_reason") == list(out).index("final_content_empty") + 1


def test_empty_content_with_only_tool_calls_is_a_tool_call():
    assert content_empty_reason("", None, [{"id": "x"}]) == "tool_call"


def test_empty_content_with_nothing_else_is_no_content():
    assert content_empty_reason("", "", []) == "no_content"


def test_present_content_has_no_reason():
    assert "content_empty_reason" not in meta()


def test_folded_is_reported_only_when_there_was_reasoning_to_fold():
    assert meta(fold=True)["reasoning_folded_into_content"] is True
    assert meta(fold=True, reasoning=None)["reasoning_folded_into_content"] is False
