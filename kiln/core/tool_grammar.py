"""tool_choice as an output grammar: "required" and a named function force a call, "none" forbids one.

The forced form is the Hermes block every supported template teaches and kiln.core.tool_calls parses:
`<tool_call>\n{"name": "NAME", "arguments": {...}}\n</tool_call>`, with `arguments` held to the
function's `parameters` schema. `parallel_tool_calls: false` allows exactly one block; otherwise one or
more, one per line. "none" lets the model write anything that does not contain `<tool_call>`.
"auto" (or no tool_choice) constrains nothing. Where the tokenizer has the tags as tokens of their own
(Qwen's added tokens), the grammar names those tokens (`<[id]>`): llguidance never spells such a token
out of text, and a model writes the tag as that one token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kiln.core.output_grammar import (
    JSON_OPTIONS,
    OutputGrammar,
    canonical_json,
    closed_objects,
    lark_grammar,
    lark_string,
)
from kiln.core.tool_calls import TAG_CLOSE, TAG_OPEN
from kiln.errors import KilnError


def _functions(tools: Sequence[Any] | None) -> list[tuple[str, Mapping[str, Any]]]:
    """(name, parameters schema) of every function tool, in order."""
    out = []
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        name = fn.get("name")
        if isinstance(name, str) and name:
            params = fn.get("parameters")
            out.append((name, params if isinstance(params, Mapping) else {"type": "object"}))
    return out


def _call_schema(name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": closed_objects(parameters)},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_OPTIONS}


def _tag(text: str, token_id: int | None) -> str:
    return f"<[{token_id}]>" if token_id is not None else lark_string(text)


def forced_call_grammar(functions: list[tuple[str, Mapping[str, Any]]], *, parallel: bool, param: str,
                        tag_ids: tuple[int, int] | None = None) -> OutputGrammar:
    bodies = " | ".join(f"%json {canonical_json(_call_schema(n, p))}" for n, p in functions)
    repeat = ' ("\\n" call)*' if parallel else ""
    open_id, close_id = tag_ids or (None, None)
    lark = (f"start: call{repeat}\n"
            f'call: {_tag(TAG_OPEN, open_id)} "\\n" body "\\n" {_tag(TAG_CLOSE, close_id)}\n'
            f"body: {bodies}\n")
    return lark_grammar(lark, kind="tool_call", param=param)


def no_call_grammar(*, param: str) -> OutputGrammar:
    # any text at all, except text containing the opening tag (llguidance's regex and-not)
    tag = TAG_OPEN.replace("/", "\\/")
    lark = f"start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*{tag}.*)/\n"
    return lark_grammar(lark, kind="no_tool_call", param=param)


def _nested_guard(build: Any, code: str) -> OutputGrammar:
    try:
        return build()
    except RecursionError:
        raise KilnError(400, code, "tools[].function.parameters is nested too deeply to compile", param="tools",
                        hint="Flatten the parameters schema.") from None


def tool_grammar(tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None, *,
                 code: str, tag_ids: tuple[int, int] | None = None) -> OutputGrammar | None:
    """The grammar tool_choice asks for, or None; a 400 naming `tool_choice` when it cannot be met.
    `tag_ids`: the token ids of `<tool_call>` and `</tool_call>` when each is one token."""
    def bad(message: str, param: str, hint: str) -> KilnError:
        return KilnError(400, code, message, param=param, hint=hint)

    if tool_choice is None or tool_choice == "auto":
        return None
    functions = _functions(tools)
    if tool_choice == "none":
        return no_call_grammar(param="tool_choice") if functions else None
    if tool_choice == "required":
        if not functions:
            raise bad('tool_choice "required" needs at least one function in tools', "tool_choice",
                      "Send the functions in tools, or use tool_choice \"auto\".")
        return _nested_guard(lambda: forced_call_grammar(functions, parallel=parallel_tool_calls is not False,
                                                         param="tool_choice", tag_ids=tag_ids), code)
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if tool_choice.get("type") not in (None, "function") or not isinstance(name, str):
            raise bad("tool_choice must be \"none\", \"auto\", \"required\" or "
                      '{"type": "function", "function": {"name": ...}}', "tool_choice",
                      "Name the function to call under tool_choice.function.name.")
        chosen = [(n, p) for n, p in functions if n == name]
        if not chosen:
            raise bad(f"tool_choice names function {name!r}, which tools does not define",
                      "tool_choice.function.name", "Name one of the functions in tools.")
        return _nested_guard(lambda: forced_call_grammar(chosen, parallel=False, param="tool_choice.function.name",
                                                         tag_ids=tag_ids), code)
    raise bad(f"tool_choice {tool_choice!r} is not supported", "tool_choice",
              'Use "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.')
