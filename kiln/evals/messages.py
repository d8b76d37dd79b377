"""Chat message content as text (semantics.md §3.8): a string, null, or an OpenAI parts array."""

from __future__ import annotations

from typing import Any

_TEXT_PART_TYPES = {"text", "input_text", "output_text"}


def message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES and isinstance(part.get("text"), str)
        )
    return ""
