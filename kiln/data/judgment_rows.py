"""One pairwise judgment: a prompt, two exact replies and a human verdict (semantics.md §11.1)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from kiln.core.messages import message_text
from kiln.errors import KilnError
from kiln.store.names import name_problem

WINNERS = ("a", "b", "tie", "skip")
INVALID = "Invalid judgment: "


def judgment_invalid(message: str, *, param: str | None = None, hint: str | None = None) -> KilnError:
    return KilnError(400, "judgment_invalid", INVALID + message, param=param, hint=hint)


@dataclass
class JudgmentRow:
    id: str
    prompt: list[dict[str, str]]
    response_a: str
    response_b: str
    winner: str
    submitted_at: str
    adapter_a: str | None = None
    adapter_b: str | None = None
    note: str | None = None
    tags: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "prompt": self.prompt, "adapter_a": self.adapter_a,
                               "adapter_b": self.adapter_b, "response_a": self.response_a,
                               "response_b": self.response_b, "winner": self.winner}
        if self.note is not None:
            out["note"] = self.note
        if self.tags:
            out["tags"] = self.tags
        out["submitted_at"] = self.submitted_at
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> JudgmentRow:
        return cls(id=d["id"], prompt=d["prompt"], response_a=d["response_a"], response_b=d["response_b"],
                   winner=d["winner"], submitted_at=d.get("submitted_at", ""), adapter_a=d.get("adapter_a"),
                   adapter_b=d.get("adapter_b"), note=d.get("note"), tags=list(d.get("tags") or []))


def _optional_str(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise judgment_invalid(f"`{key}` must be a string or null", param=key)
    return value


def _required_str(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise judgment_invalid(f"`{key}` is required and must be a string", param=key)
    return value


def row_from_body(body: Any, submitted_at: str) -> JudgmentRow:
    """Check an AppendJudgmentBody (unknown fields ignored) and build the stored row.

    A missing or blank id becomes a UUIDv4; empty adapter names are stored as null (the base model).
    """
    if not isinstance(body, dict):
        raise judgment_invalid("the body must be a JSON object")
    raw_id = _optional_str(body, "id")
    row_id = raw_id.strip() if raw_id and raw_id.strip() else str(uuid.uuid4())
    problem = name_problem(row_id)
    if problem:
        raise judgment_invalid(f"id {row_id!r} {problem}", param="id")
    prompt = body.get("prompt")
    if not isinstance(prompt, list):
        raise judgment_invalid("`prompt` is required and must be an array of messages", param="prompt")
    messages = []
    for i, msg in enumerate(prompt):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise judgment_invalid(f"prompt[{i}] must be a message object with a string `role`",
                                   param=f"prompt[{i}]")
        content = msg.get("content")
        if content is not None and not isinstance(content, str | list):
            raise judgment_invalid(f"prompt[{i}].content must be a string, an array or null",
                                   param=f"prompt[{i}].content")
        messages.append({"role": msg["role"], "content": message_text(content)})
    winner = body.get("winner")
    if winner not in WINNERS:
        raise judgment_invalid(f"`winner` must be one of {', '.join(WINNERS)}, got {winner!r}", param="winner")
    tags = body.get("tags")
    if tags is None:
        tags = []
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise judgment_invalid("`tags` must be an array of strings", param="tags")
    return JudgmentRow(
        id=row_id, prompt=messages,
        response_a=_required_str(body, "response_a"), response_b=_required_str(body, "response_b"),
        winner=winner, submitted_at=submitted_at,
        adapter_a=_optional_str(body, "adapter_a") or None, adapter_b=_optional_str(body, "adapter_b") or None,
        note=_optional_str(body, "note"), tags=tags,
    )
