"""Streaming tool-call gate (semantics.md §3.5): content flows eagerly, tool calls leave as deltas.

Held back: the trailing whitespace run and any tail that may begin `<tool_call>` (the non-streaming
content is the text before the first tag, right-trimmed, so neither may leave early); and the whole
content while it may still be a bare JSON or ```` ```tool_call ```` call, i.e. while it starts with
`{` or with a prefix of that fence. Each `<tool_call>` block is emitted as a tool_calls delta with
its `index` as soon as it closes; `finish()` runs the non-streaming split on the full text, so the
concatenated stream equals `parse_tool_calls` (same seeded `rng`, same ids). One divergence remains
by design: a bare JSON or fenced call in the middle of prose is recognised only at the end, after the
prose around it has already been streamed as content.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.core.tool_calls import (
    TAG_CLOSE,
    TAG_OPEN,
    ParsedToolCall,
    new_call_id,
    openai_tool_call,
    parse_block_body,
    split_tool_calls,
)

_FENCE = "```tool_call"
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ToolCallDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def _partial_tag(text: str) -> int:
    for n in range(min(len(TAG_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TAG_OPEN[:n]):
            return n
    return 0


class ToolCallStreamParser:
    def __init__(self, tools: Sequence[Mapping[str, Any]] | None, *, rng: random.Random | None = None) -> None:
        self.tools = tools
        self._rng = rng
        self._parts: list[str] = []  # everything fed, joined once at the end
        self._sent = 0  # chars released as content, all from the start of the text
        self._tail = ""  # before the first tag: text not yet released
        self._scanned = 0  # how much of _tail has been searched for the tag
        self._bare: bool | None = None  # may the whole content be a bare JSON / fenced call?
        self._tag_seen = False
        self._buf = ""  # after the first tag: text from the start of the current, unclosed block
        self._close_from = 0  # where in _buf the search for the close tag resumes
        self.tool_calls: list[dict[str, Any]] = []  # every call emitted, with index

    @property
    def finish_reason(self) -> str | None:
        return "tool_calls" if self.tool_calls else None

    def _decide_bare(self) -> None:
        head = self._tail.lstrip(_WHITESPACE)
        if head.startswith("{") or head.startswith(_FENCE):
            self._bare = True
        elif head and not _FENCE.startswith(head):
            self._bare = False

    def _release(self, n: int) -> str:
        out, self._tail = self._tail[:n], self._tail[n:]
        self._sent += n
        self._scanned = len(self._tail)
        return out

    def feed(self, text: str) -> ToolCallDelta:
        self._parts.append(text)
        if self._tag_seen:
            return ToolCallDelta(tool_calls=self._scan_blocks(text))
        self._tail += text
        at = self._tail.find(TAG_OPEN, max(0, self._scanned - len(TAG_OPEN) + 1))
        self._scanned = len(self._tail)
        if at >= 0:
            self._tag_seen = True
            rest = self._tail[at:]
            content = self._release(len(self._tail[:at].rstrip(_WHITESPACE)))
            self._tail = ""
            return ToolCallDelta(content=content, tool_calls=self._scan_blocks(rest))
        if self._sent == 0 and self._bare is None:
            self._decide_bare()
        if self._bare is not False:
            return ToolCallDelta()
        held = _partial_tag(self._tail)
        return ToolCallDelta(content=self._release(len(self._tail[: len(self._tail) - held].rstrip(_WHITESPACE))))

    def _scan_blocks(self, text: str) -> list[dict[str, Any]]:
        """Parse each `<tool_call>` block as soon as its close tag arrives (as `iter_tag_blocks` cuts them)."""
        self._buf += text
        new: list[dict[str, Any]] = []
        while True:
            open_at = self._buf.find(TAG_OPEN)
            if open_at < 0:
                keep = _partial_tag(self._buf)
                self._buf = self._buf[len(self._buf) - keep :] if keep else ""
                return new
            if open_at > 0:
                self._buf, self._close_from = self._buf[open_at:], 0
            close_at = self._buf.find(TAG_CLOSE, max(self._close_from, len(TAG_OPEN)))
            if close_at < 0:
                self._close_from = max(len(TAG_OPEN), len(self._buf) - len(TAG_CLOSE) + 1)
                return new
            for call in parse_block_body(self._buf[len(TAG_OPEN) : close_at], self.tools):
                new.append(self._emit(call))
            self._buf, self._close_from = self._buf[close_at + len(TAG_CLOSE) :], 0

    def _emit(self, call: ParsedToolCall) -> dict[str, Any]:
        out = openai_tool_call(call, new_call_id(self._rng), index=len(self.tool_calls))
        self.tool_calls.append(out)
        return out

    def finish(self, reasoning: str | None = None) -> ToolCallDelta:
        """End of stream: the rest of the content and any calls not yet sent.

        `reasoning` (the full streamed reasoning) is searched when content holds no call; it was
        already streamed, so it is not cleaned here.
        """
        text = "".join(self._parts)
        split = split_tool_calls(text, reasoning, self.tools)
        sent = text[: self._sent]
        content = split.content[len(sent) :] if split.content.startswith(sent) else ""
        self._sent, self._tail, self._buf = len(text), "", ""
        new = [self._emit(call) for call in split.calls[len(self.tool_calls) :]]
        return ToolCallDelta(content=content, tool_calls=new)
