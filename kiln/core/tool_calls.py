"""Generated tool calls: the Qwen text formats in, OpenAI `tool_calls` out (semantics.md §3.5-3.6).

Extraction precedence: (1) `<tool_call>` blocks, whose body is the XML form
`<function=NAME><parameter=KEY>value</parameter></function>` or a JSON entry; (2) fenced
```` ```tool_call ```` JSON blocks; (3) the whole text as JSON, else the first brace-balanced object
that looks like a call. A trailing `<tool_call>` block without its close tag still counts when its
body parses whole: tool requests stop on `</tool_call>`, so the tag is usually missing at the end.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.core.brackets import matching_close

TAG_OPEN = "<tool_call>"
TAG_CLOSE = "</tool_call>"

_FUNCTION_RE = re.compile(r"<function=([^>]*)>(.*?)</function>", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>]*)>(.*?)</parameter>", re.DOTALL)
_FENCE_RE = re.compile(r"```tool_call[ \t]*\r?\n(.*?)```", re.DOTALL)
_NUMBER_RE = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_SNIFF_CHARS = 384


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: dict[str, Any]
    format: str  # qwen3_xml | json_inline | open_ai | fenced


# ---- tools catalogue ----------------------------------------------------------------------------


def find_tool(tools: Sequence[Mapping[str, Any]] | None, name: str) -> Mapping[str, Any] | None:
    """The parameters schema of the tool called `name` (OpenAI or bare shape), if it has one."""
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        if fn.get("name") == name:
            params = fn.get("parameters")
            return params if isinstance(params, Mapping) else None
    return None


def tool_parsing_enabled(tools: Sequence[Any] | None, tool_choice: Any) -> bool:
    """Tool calls are parsed when tools are given and tool_choice is not "none" (never enforced)."""
    return bool(tools) and tool_choice != "none"


def schema_issues(call: ParsedToolCall, tools: Sequence[Mapping[str, Any]] | None) -> tuple[list[str], list[str]]:
    """(missing required keys, argument keys the schema does not know); empty without a schema."""
    schema = find_tool(tools, call.name)
    props = schema.get("properties") if schema else None
    if not isinstance(props, Mapping) or not props:
        return [], []
    required = schema.get("required") or []
    missing = [k for k in required if k not in call.arguments]
    extra = [k for k in call.arguments if k not in props]
    return missing, extra


# ---- XML form -----------------------------------------------------------------------------------


def _json_types(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _declared_types(schema: Mapping[str, Any] | None) -> list[str] | None:
    """The property's `type`, or the types of an anyOf / oneOf of bare types (Pydantic's Optional[str])."""
    if not isinstance(schema, Mapping):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return declared
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches and all(
            isinstance(b, Mapping) and isinstance(b.get("type"), str) for b in branches):
        return [b["type"] for b in branches]
    return None


def type_parameter_value(raw: str, schema: Mapping[str, Any] | None = None) -> Any:
    """§3.6 value typing; a value the property's declared type rejects stays a string when the
    schema admits strings (a zip code "02139" declared as string is not turned into a number)."""
    value = _generic_value(raw)
    declared = _declared_types(schema)
    if isinstance(value, str) or not isinstance(declared, list):
        return value
    if _json_types(value) & set(declared) or "string" not in declared:
        return value
    return raw


def _generic_value(raw: str) -> Any:
    s = raw.strip()
    if not s:
        return ""
    if s[0] in "{[":
        try:
            return json.loads(s)
        except ValueError:
            return raw
    if "\n" in s:
        return raw
    if s in ("true", "True"):
        return True
    if s in ("false", "False"):
        return False
    if s in ("null", "None"):
        return None
    if _NUMBER_RE.fullmatch(s):
        number = json.loads(s)
        if number == number and number not in (float("inf"), float("-inf")):
            return number
    return raw


def _strip_value_newlines(value: str) -> str:
    if value.startswith("\n\n"):
        value = value[2:]
    elif value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def parse_xml_body(body: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedToolCall | None:
    body = body.strip()
    if not body.startswith("<function="):
        return None
    m = _FUNCTION_RE.match(body)
    if m is None or not m.group(1).strip():
        return None
    name = m.group(1).strip()
    schema = find_tool(tools, name)
    props = schema.get("properties") if schema else None
    args: dict[str, Any] = {}
    for pm in _PARAM_RE.finditer(m.group(2)):
        key = pm.group(1).strip()
        prop = props.get(key) if isinstance(props, Mapping) else None
        args[key] = type_parameter_value(_strip_value_newlines(pm.group(2)), prop)
    return ParsedToolCall(name, args, "qwen3_xml")


# ---- JSON form ----------------------------------------------------------------------------------


def _json_entry(obj: Any) -> ParsedToolCall | None:
    if not isinstance(obj, Mapping):
        return None
    fmt = "json_inline"
    if isinstance(obj.get("function"), Mapping):
        obj, fmt = obj["function"], "open_ai"
    elif isinstance(obj.get("tool_call"), Mapping):
        obj = obj["tool_call"]
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    args: Any = None
    for key in ("arguments", "input", "parameters"):
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        with contextlib.suppress(ValueError):
            args = json.loads(args)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        args = {"args": args}
    return ParsedToolCall(name.strip(), args, fmt)


def json_entries(obj: Any, fmt: str | None = None) -> list[ParsedToolCall]:
    """`{"tool_calls": [...]}` gives each entry; anything else is one entry (possibly none)."""
    if isinstance(obj, Mapping) and isinstance(obj.get("tool_calls"), list):
        items = obj["tool_calls"]
    else:
        items = [obj]
    calls = [c for c in map(_json_entry, items) if c is not None]
    if fmt is not None:
        calls = [ParsedToolCall(c.name, c.arguments, fmt) for c in calls]
    return calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _looks_like_call(candidate: str) -> bool:
    head = candidate[:_SNIFF_CHARS]
    if "tool_call" in head or "function" in head:
        return True
    return "name" in head and any(k in head for k in ("arguments", "input", "parameters"))


def _embedded_json_calls(text: str) -> list[ParsedToolCall]:
    i = text.find("{")
    while i >= 0:
        end = matching_close(text, i)
        if end is None:
            return []
        candidate = text[i:end]
        if _looks_like_call(candidate):
            obj = _loads(candidate)
            if obj is not None:
                calls = json_entries(obj)
                if calls:
                    return calls
                i = text.find("{", end)
                continue
        i = text.find("{", i + 1)
    return []


# ---- extraction ---------------------------------------------------------------------------------


def iter_tag_blocks(text: str, start: int = 0) -> list[tuple[int, int, str, bool]]:
    """(start, end, body, closed) for each `<tool_call>` block; the last may be unclosed."""
    blocks = []
    pos = text.find(TAG_OPEN, start)
    while pos >= 0:
        body_start = pos + len(TAG_OPEN)
        close = text.find(TAG_CLOSE, body_start)
        if close < 0:
            blocks.append((pos, len(text), text[body_start:], False))
            break
        blocks.append((pos, close + len(TAG_CLOSE), text[body_start:close], True))
        pos = text.find(TAG_OPEN, close + len(TAG_CLOSE))
    return blocks


def parse_block_body(body: str, tools: Sequence[Mapping[str, Any]] | None = None) -> list[ParsedToolCall]:
    xml = parse_xml_body(body, tools)
    if xml is not None:
        return [xml]
    obj = _loads(body.strip())
    return json_entries(obj) if obj is not None else []


def extract_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> list[ParsedToolCall]:
    calls = [c for _, _, body, _ in iter_tag_blocks(text) for c in parse_block_body(body, tools)]
    if calls:
        return calls
    calls = [c for m in _FENCE_RE.finditer(text) for c in json_entries(_loads(m.group(1).strip()), "fenced")]
    if calls:
        return calls
    whole = _loads(text.strip())
    calls = json_entries(whole) if whole is not None else []
    return calls or _embedded_json_calls(text)


def strip_tag_blocks(text: str) -> str:
    out, last = [], 0
    for start, end, _, _ in iter_tag_blocks(text):
        out.append(text[last:start])
        last = end
    out.append(text[last:])
    return "".join(out)


@dataclass(frozen=True)
class ToolCallSplit:
    content: str
    reasoning: str | None
    calls: list[ParsedToolCall] = field(default_factory=list)


def split_tool_calls(
    content: str, reasoning: str | None, tools: Sequence[Mapping[str, Any]] | None
) -> ToolCallSplit:
    """§3.5: look in content, then in reasoning; the text part keeps what preceded the calls.

    Calls in content: content = text before the first `<tool_call>`, right-trimmed, or "" when the
    text has no such tag (bare JSON / fenced forms). Calls in reasoning: their blocks leave the
    reasoning, content is untouched.
    """
    found = extract_tool_calls(content, tools)
    if found:
        tag_at = content.find(TAG_OPEN)
        new_content = content[:tag_at].rstrip() if tag_at >= 0 else ""
        return ToolCallSplit(new_content, reasoning, found)
    if reasoning:
        found = extract_tool_calls(reasoning, tools)
        if found:
            cleaned = strip_tag_blocks(reasoning).rstrip()
            return ToolCallSplit(content, cleaned if cleaned.strip() else None, found)
    return ToolCallSplit(content, reasoning)


# ---- OpenAI shape -------------------------------------------------------------------------------


def new_call_id(rng: random.Random | None = None) -> str:
    """"call_" + 32 lowercase hex (a uuid4 without dashes); `rng` makes it reproducible in tests."""
    if rng is None:
        return "call_" + uuid.uuid4().hex
    return "call_" + uuid.UUID(int=rng.getrandbits(128), version=4).hex


def openai_tool_call(call: ParsedToolCall, call_id: str, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {} if index is None else {"index": index}
    out["id"] = call_id
    out["type"] = "function"
    out["function"] = {
        "name": call.name,
        "arguments": json.dumps(call.arguments, ensure_ascii=False, separators=(",", ":")),
    }
    return out


@dataclass(frozen=True)
class ToolCallResult:
    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]]

    @property
    def finish_reason(self) -> str | None:
        """"tool_calls" when any call was parsed; otherwise the engine's own reason stands."""
        return "tool_calls" if self.tool_calls else None


def parse_tool_calls(
    content: str,
    reasoning: str | None,
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any = None,
    rng: random.Random | None = None,
) -> ToolCallResult:
    """Non-streaming chat / batch: split generated text into content, reasoning and OpenAI tool_calls."""
    if not tool_parsing_enabled(tools, tool_choice):
        return ToolCallResult(content, reasoning, [])
    split = split_tool_calls(content, reasoning, tools)
    calls = [openai_tool_call(c, new_call_id(rng)) for c in split.calls]
    return ToolCallResult(split.content, split.reasoning, calls)


# ---- canonical forms (eval targets and round trips) ---------------------------------------------


def render_xml(call: ParsedToolCall) -> str:
    parts = [f"{TAG_OPEN}\n<function={call.name}>\n"]
    for key, value in call.arguments.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        parts.append(f"<parameter={key}>\n{text}\n</parameter>\n")
    parts.append(f"</function>\n{TAG_CLOSE}")
    return "".join(parts)


def canonical_json(call: ParsedToolCall) -> str:
    return json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False, sort_keys=True)


def unwrap_tool_response(text: str) -> str:
    """`<tool_response>...</tool_response>` wrappers come off, newline-trimmed."""
    s = text.strip()
    if s.startswith("<tool_response>") and s.endswith("</tool_response>"):
        return s[len("<tool_response>") : -len("</tool_response>")].strip("\n")
    return text
