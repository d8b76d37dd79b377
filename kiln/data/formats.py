"""Dataset formats and the row shapes each one accepts (semantics.md §9.1).

Upload accepts aliases (`sft` -> `sft_chat`, `grpo` -> `grpo_groups`); manifests store the canonical
name. `sft_chat` rows are conversations, `grpo_groups` rows are a prompt conversation plus scored
completions, `raw` accepts any line (a non-JSON line counts as the JSON string of the trimmed line).
"""

from __future__ import annotations

import math
from typing import Any

from kiln.errors import KilnError
from kiln.store.strict_json import loads_strict

SFT_CHAT, GRPO_GROUPS, RAW = "sft_chat", "grpo_groups", "raw"
CANONICAL_FORMATS = (SFT_CHAT, GRPO_GROUPS, RAW)
FORMAT_ALIASES = {"sft_chat": SFT_CHAT, "sft": SFT_CHAT, "grpo_groups": GRPO_GROUPS, "grpo": GRPO_GROUPS, "raw": RAW}
DEFAULT_FORMAT = SFT_CHAT
INVALID = "Invalid eval dataset: "


def invalid(message: str, *, param: str | None = None, hint: str | None = None) -> KilnError:
    return KilnError(400, "dataset_invalid", INVALID + message, param=param, hint=hint)


def normalize_format(value: str | None) -> str:
    """Canonical format name for an upload field; blank means the default (sft_chat)."""
    key = (value or "").strip()
    if not key:
        return DEFAULT_FORMAT
    if key not in FORMAT_ALIASES:
        raise invalid(f"unknown format `{key}`", param="format",
                      hint="Use one of sft_chat, sft, grpo_groups, grpo, raw.")
    return FORMAT_ALIASES[key]


def message_problem(msg: Any, where: str) -> str | None:
    if not isinstance(msg, dict):
        return f"{where} must be an object"
    if not isinstance(msg.get("role"), str):
        return f"{where}.role must be a string"
    content = msg.get("content")
    if content is not None and not isinstance(content, str | list):
        return f"{where}.content must be a string, an array of parts or null"
    if msg.get("tool_calls") is not None and not isinstance(msg["tool_calls"], list):
        return f"{where}.tool_calls must be an array or null"
    for key in ("name", "tool_call_id"):
        if msg.get(key) is not None and not isinstance(msg[key], str):
            return f"{where}.{key} must be a string or null"
    return None


def messages_problem(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "`messages` must be a non-empty array"
    for i, msg in enumerate(messages):
        problem = message_problem(msg, f"messages[{i}]")
        if problem:
            return problem
    return None


def sft_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return "expected a JSON object with `messages`"
    return messages_problem(row.get("messages"))


def grpo_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return "expected a JSON object with `messages` and `completions`"
    problem = messages_problem(row.get("messages"))
    if problem:
        return problem
    completions = row.get("completions")
    if not isinstance(completions, list) or not completions:
        return "`completions` must be a non-empty array"
    for i, c in enumerate(completions):
        if not isinstance(c, dict):
            return f"completions[{i}] must be an object"
        if not isinstance(c.get("text"), str):
            return f"completions[{i}].text must be a string"
        reward = c.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            return f"completions[{i}].reward must be a finite number"
    return None


_KIND = {SFT_CHAT: "an SFT chat row", GRPO_GROUPS: "a GRPO group"}
_CHECK = {SFT_CHAT: sft_problem, GRPO_GROUPS: grpo_problem}
_HINT = {
    SFT_CHAT: 'Each row is {"messages": [{"role": "user", "content": "..."}, ...]}.',
    GRPO_GROUPS: 'Each row is {"messages": [...], "completions": [{"text": "...", "reward": 1.0}, ...]}.',
}


def check_row(value: Any, fmt: str, where: str) -> Any:
    """Return `value` when it has the shape `fmt` asks for, else raise dataset_invalid naming `where`."""
    if fmt == RAW:
        return value
    problem = _CHECK[fmt](value)
    if problem:
        raise invalid(f"{where} is not {_KIND[fmt]}: {problem}", param="file", hint=_HINT[fmt])
    return value


def parse_row(text: str, fmt: str, where: str) -> Any:
    """Parse one non-blank row and check its shape; `where` is e.g. "line 3"."""
    try:
        value = loads_strict(text)
    except ValueError as e:
        if fmt == RAW:
            return text.strip()
        raise invalid(f"{where} is not valid JSON: {e}", param="file") from None
    return check_row(value, fmt, where)
