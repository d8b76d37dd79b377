"""`ChatCompletionMetadata` thinking and content fields (inference-api.txt; semantics.md §3.1, §3.3-3.4).

Content emptiness is judged on the separated answer, before any fold: folding copies reasoning into
content for old clients, but the answer the model gave is still empty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from kiln.core.thinking_mode import ThinkingSource

ContentEmptyReason = Literal["no_content", "reasoning_without_final_content", "tool_call"]


def content_empty_reason(
    content: str, reasoning: str | None, tool_calls: Sequence[Any] | None
) -> ContentEmptyReason | None:
    """None when content is present; otherwise reasoning is checked before tool calls (§3.4)."""
    if content != "":
        return None
    if reasoning:
        return "reasoning_without_final_content"
    if tool_calls:
        return "tool_call"
    return "no_content"


def chat_metadata(
    *,
    thinking_enabled: bool,
    thinking_source: ThinkingSource,
    default_thinking_enabled: bool | None,
    content: str,
    reasoning: str | None,
    tool_calls: Sequence[Any] | None,
    fold: bool,
    thinking_budget: Mapping[str, Any],
) -> dict[str, Any]:
    """The metadata object up to `thinking_budget`, keys in §3.1 order; callers append
    `config_hashes` / `performance` when enabled. `content` is the unfolded answer."""
    out: dict[str, Any] = {
        "thinking_enabled": thinking_enabled,
        "thinking_mode": "reasoning" if thinking_enabled else "non_reasoning",
        "thinking_source": thinking_source,
    }
    if default_thinking_enabled is not None:
        out["default_thinking_enabled"] = default_thinking_enabled
    reason = content_empty_reason(content, reasoning, tool_calls)
    out["final_content_empty"] = reason is not None
    if reason is not None:
        out["content_empty_reason"] = reason
    out["reasoning_folded_into_content"] = bool(fold and reasoning)
    out["thinking_budget"] = dict(thinking_budget)
    return out
