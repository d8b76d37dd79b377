"""Separating reasoning from the answer (semantics.md §3.2-3.3).

Only a prompt that starts generation inside `<think>` is split; the first `</think>` ends the
reasoning. The model is not watched for an `<think>` of its own: without a thinking prompt the whole
output is content. The streaming splitter produces the same text as `split_reasoning`, chunked.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.thinking_budget import CLOSE_TEXT


def split_reasoning(text: str, started_in_thinking: bool) -> tuple[str | None, str]:
    """(reasoning_content or None when empty, content). Content after the tag is kept raw, not trimmed."""
    if not started_in_thinking:
        return None, text
    end = text.find(CLOSE_TEXT)
    if end < 0:
        return (text or None), ""
    return (text[:end] or None), text[end + len(CLOSE_TEXT) :]


def fold_reasoning(reasoning: str | None, content: str) -> str:
    """Compatibility mode: reasoning is also copied into content (reasoning_content is still returned)."""
    if not reasoning:
        return content
    folded = "<think>\n" + reasoning + CLOSE_TEXT
    return folded + ("\n\n" + content if content else "")


def resolve_fold(request_value: bool | None, server_value: bool) -> bool:
    return server_value if request_value is None else request_value


def cut_at_stop(reasoning: str | None, content: str, stop: str) -> tuple[str | None, str]:
    """After a user stop string matched: cut content at its first occurrence; if that leaves content
    empty, cut reasoning the same way. Callers skip this when tool calls were parsed."""
    if not stop:
        return reasoning, content
    at = content.find(stop)
    if at >= 0:
        content = content[:at]
    if content == "" and reasoning is not None:
        at = reasoning.find(stop)
        if at >= 0:
            reasoning = reasoning[:at] or None
    return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class ReasoningStreamSplitter:
    """Text deltas in, (reasoning, content) deltas out; reasoning text always precedes content text.

    A delta that crosses `</think>` carries both parts; the caller sends them as two chunks, reasoning
    first, since one chunk carries at most one of content / reasoning_content.
    """

    def __init__(self, started_in_thinking: bool) -> None:
        self.in_reasoning = started_in_thinking
        self._pending = ""

    def feed(self, text: str) -> ReasoningDelta:
        if not self.in_reasoning:
            return ReasoningDelta(content=text)
        buf = self._pending + text
        end = buf.find(CLOSE_TEXT)
        if end >= 0:
            self.in_reasoning = False
            self._pending = ""
            return ReasoningDelta(reasoning=buf[:end], content=buf[end + len(CLOSE_TEXT) :])
        # Hold back what may be the start of `</think>` until the next delta settles it.
        held = _partial_suffix(buf, CLOSE_TEXT)
        self._pending = buf[len(buf) - held :] if held else ""
        return ReasoningDelta(reasoning=buf[: len(buf) - held])

    def flush(self) -> ReasoningDelta:
        pending, self._pending = self._pending, ""
        return ReasoningDelta(reasoning=pending) if self.in_reasoning else ReasoningDelta(content=pending)
