"""What an assistant message is graded against: its target text and kind (semantics.md §10.3).

Priority: structured `tool_calls` -> canonical `{"tool_calls": [{"arguments", "name"}]}` JSON; blank
content -> no target; tool calls written into the content (`<tool_call>` blocks, ```tool_call fences,
bare Qwen XML, a JSON call object) -> the same canonical JSON; the first fenced code block (two or more
lines, or a known language) -> its body; otherwise the whole content (prose).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from kiln.core.messages import message_text
from kiln.core.tool_calls import (
    ParsedToolCall,
    iter_tag_blocks,
    json_entries,
    parse_block_body,
    parse_xml_body,
)
from kiln.evals.scorers.code import normalize_language
from kiln.evals.thinking import split_thinking

TargetKind = Literal["prose", "tool_call", "code"]

_TOOL_FENCE_RE = re.compile(r"```tool_call[ \t]*\r?\n(.*?)```", re.DOTALL)
_CODE_FENCE_RE = re.compile(r"```[ \t]*([^\n`]*)\n(.*?)```", re.DOTALL)
_CALL_KEYS = ("tool_calls", "tool_call", "function")
KNOWN_LANGUAGES = frozenset({
    "python", "rust", "typescript", "javascript", "ruby", "kotlin", "yaml", "bash", "go", "java", "c", "cpp",
    "c++", "csharp", "cs", "swift", "scala", "php", "perl", "lua", "r", "julia", "elixir", "haskell", "sql",
    "html", "css", "toml", "json", "xml", "makefile", "dockerfile", "powershell", "zig", "dart", "ocaml",
})


@dataclass(frozen=True)
class Target:
    text: str
    kind: TargetKind
    language: str | None = None
    # The text auto-detection reads (§10.4): the fenced block as written for code (its language tag
    # and closing fence are what rule 4 looks for), the target itself otherwise.
    source: str = ""

    @property
    def detect_text(self) -> str:
        return self.source or self.text


def canonical_calls(calls: list[ParsedToolCall]) -> str:
    """Compact JSON with sorted keys, so equal calls always give the same target bytes."""
    entries = [{"name": c.name, "arguments": c.arguments} for c in calls]
    return json.dumps({"tool_calls": entries}, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _structured_calls(tool_calls: list[Any]) -> list[ParsedToolCall]:
    # json_entries unwraps the OpenAI `function` wrapper and decodes string arguments.
    return json_entries({"tool_calls": tool_calls})


def _mentions_call(obj: Any) -> bool:
    if isinstance(obj, list):
        return bool(obj) and all(_mentions_call(item) for item in obj)
    if not isinstance(obj, dict):
        return False
    return any(k in obj for k in _CALL_KEYS) or ("name" in obj and "arguments" in obj)


def _inline_calls(text: str) -> list[ParsedToolCall]:
    calls = [c for _, _, body, _ in iter_tag_blocks(text) for c in parse_block_body(body)]
    if calls:
        return calls
    for m in _TOOL_FENCE_RE.finditer(text):
        try:
            calls.extend(json_entries(json.loads(m.group(1).strip())))
        except ValueError:
            continue
    if calls:
        return calls
    stripped = text.strip()
    if stripped.startswith("<function="):
        xml = parse_xml_body(stripped)
        return [xml] if xml is not None else []
    if stripped[:1] in ("{", "["):
        try:
            obj = json.loads(stripped)
        except ValueError:
            return []
        # A JSON answer such as {"name": "Ada", "age": 36} is data, not a call: it must say so.
        if _mentions_call(obj):
            items = obj if isinstance(obj, list) else [obj]
            return [c for item in items for c in json_entries(item)]
    return []


def _code_block(text: str) -> tuple[str, str | None, str] | None:
    """(body, normalized language, the fence as written) of the first qualifying code block."""
    for m in _CODE_FENCE_RE.finditer(text):
        info = m.group(1).strip().split()
        language = normalize_language(info[0]) if info else None
        body = m.group(2).strip("\n")
        if not body.strip():
            continue
        if len(body.splitlines()) >= 2 or language in KNOWN_LANGUAGES:
            return body, language, m.group(0)
    return None


def answer_text(content: Any) -> str:
    """The visible answer of an assistant message: text parts joined, a leading thinking block removed."""
    return split_thinking(message_text(content)).answer


def extract_target(message: dict[str, Any]) -> Target | None:
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list) and tool_calls:
        calls = _structured_calls(tool_calls)
        if calls:
            return Target(canonical_calls(calls), "tool_call")
    content = answer_text(message.get("content"))
    if not content.strip():
        return None
    calls = _inline_calls(content)
    if calls:
        return Target(canonical_calls(calls), "tool_call")
    block = _code_block(content)
    if block is not None:
        body, language, fence = block
        return Target(body, "code", language, fence.strip())
    return Target(content.strip(), "prose")
