"""Dataset rows as conversations to synthesize from; rows that are not conversations are skipped.

A raw-format dataset can hold any line, and a typed one was checked at upload, so a row that does
not have the chat shape here is passed over rather than failing the whole synthesis (§10.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.store.hashing import sha256_json

MESSAGE_KEYS = ("role", "content", "tool_calls", "name", "tool_call_id")
# `completions` is a GRPO group's scored samples: training payload, not something to describe an example by.
NOT_EXTRA = ("messages", "completions")


@dataclass(frozen=True)
class Conversation:
    messages: list[dict[str, Any]]
    extra: dict[str, Any]  # the row's other fields, carried into each example's metadata
    identity: str  # "sha256:" over the row's canonical JSON, the same identity the dataset records


def _message(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        return None
    content = raw.get("content")
    if content is not None and not isinstance(content, str | list):
        return None
    if raw.get("tool_calls") is not None and not isinstance(raw["tool_calls"], list):
        return None
    if any(raw.get(k) is not None and not isinstance(raw[k], str) for k in ("name", "tool_call_id")):
        return None
    return {k: raw[k] for k in MESSAGE_KEYS if k in raw}


def conversation_from_row(row: Any, *, strip_system_prompt: bool = False) -> Conversation | None:
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        return None
    messages = [_message(m) for m in row["messages"]]
    if any(m is None for m in messages):
        return None
    kept = [m for m in messages if m is not None and not (strip_system_prompt and m["role"] == "system")]
    extra = {k: v for k, v in row.items() if k not in NOT_EXTRA}
    return Conversation(kept, extra, "sha256:" + sha256_json(row))
