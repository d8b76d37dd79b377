"""Chat message content as text (semantics.md §3.8): a string, null, or an OpenAI parts array.

The one reading of message content that evals (example ids, judges, synthesis) and judgments (the
judge prompt, stored rows) share.
"""

from __future__ import annotations

from typing import Any

_TEXT_PART_TYPES = {"text", "input_text", "output_text"}


def message_text(content: Any) -> str:
    """Strings as they are, null empty; in a parts array the text parts joined (a part is text when it
    is a string, or carries a string `text` and no type or a text type), the others ignored."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(part) for part in content)
    return ""


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and isinstance(part.get("text"), str):
        kind = part.get("type")
        if kind is None or kind in _TEXT_PART_TYPES:
            return part["text"]
    return ""
