"""Which tokens of a conversation are trained: the assistant turns, found with the model's own template.

The conversation is rendered once (no generation prompt) and tokenized with offsets. For assistant
message i, the turn starts where the rendered prefix `messages[:i]` + generation prompt stops matching
the full text (templates that add an empty think block to the generation prompt diverge inside it),
and ends just after the first end-of-turn token that follows. A token is trained when its first
character lies in such a span: what the model itself would have to generate after the generation
prompt, up to and including the end-of-turn token. System, user and tool turns, the role headers and
the newline after the end-of-turn token are masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Template(Protocol):
    def render(self, messages: Sequence[Any], tools: Sequence[Any] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str: ...


@dataclass
class MaskedSequence:
    input_ids: list[int]
    trained: list[bool]           # trained[t]: token t is a target (predicted from position t - 1)
    truncated: bool = False

    @property
    def num_trained(self) -> int:
        # Position 0 has no preceding position to predict it from.
        return sum(self.trained[1:])


class MaskError(ValueError):
    """The conversation cannot be masked (no assistant turn, template quirk); `field` names where."""

    def __init__(self, message: str, field: str = "messages") -> None:
        super().__init__(message)
        self.field = field


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def end_of_turn_strings(tokenizer: Any) -> list[str]:
    """The text of every EOS token id (chat templates close turns with one of them)."""
    out = []
    for tid in getattr(tokenizer, "eos_token_ids", []) or []:
        text = tokenizer.id_to_token(tid)
        if text and text not in out:
            out.append(text)
    if not out and getattr(tokenizer, "eos_token", None):
        out.append(tokenizer.eos_token)
    return out


def assistant_spans(template: Template, messages: Sequence[dict[str, Any]], eot: Sequence[str],
                    *, only_last: bool = False, tools: Sequence[Any] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """(full rendered text, character spans of the trained assistant turns)."""
    full = template.render(messages, tools=tools, add_generation_prompt=False)
    indices = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not indices:
        raise MaskError("the conversation has no assistant message to learn from")
    if only_last:
        indices = indices[-1:]
    spans = []
    for i in indices:
        before = template.render(messages[:i], tools=tools, add_generation_prompt=False) if i else ""
        prompt = template.render(messages[:i], tools=tools, add_generation_prompt=True) if i else ""
        start = _common_prefix(prompt, full)
        if not full.startswith(before) or start < len(before):
            raise MaskError(f"the chat template renders the turns before messages[{i}] differently once the "
                            "conversation continues, so its assistant turn cannot be located",
                            field=f"messages[{i}]")
        end = _turn_end(full, start, eot)
        if end is None:
            after = template.render(messages[: i + 1], tools=tools, add_generation_prompt=False)
            end = _common_prefix(after, full)
        if end <= start:
            raise MaskError(f"messages[{i}] renders to no text", field=f"messages[{i}]")
        spans.append((start, end))
    return full, spans


def _turn_end(full: str, start: int, eot: Sequence[str]) -> int | None:
    best = None
    for s in eot:
        j = full.find(s, start)
        if j >= 0 and (best is None or j + len(s) < best):
            best = j + len(s)
    return best


def mask_conversation(template: Template, tokenizer: Any, messages: Sequence[dict[str, Any]], *,
                      max_len: int | None = None, only_last: bool = False,
                      tools: Sequence[Any] | None = None) -> MaskedSequence:
    """Token ids of the rendered conversation and the per-token training mask, cut at `max_len`."""
    full, spans = assistant_spans(template, messages, end_of_turn_strings(tokenizer), only_last=only_last, tools=tools)
    enc = tokenizer.backend.encode(full, add_special_tokens=False)
    ids = list(enc.ids)
    trained = []
    for begin, _ in enc.offsets:
        trained.append(any(s <= begin < e for s, e in spans))
    truncated = max_len is not None and len(ids) > max_len
    if truncated:
        ids, trained = ids[:max_len], trained[:max_len]
    return MaskedSequence(ids, trained, truncated)
