"""tool_choice as an output grammar: "required" and a named function force a call, "none" forbids one.

The forced form is the one the model's chat template teaches, as kiln.core.tool_calls parses it
(`tool_call_format` reads it off the template, as vLLM picks its hermes or qwen3_coder parser):
- "json" (Hermes; Qwen2.5, Qwen3): `<tool_call>\n{"name": "NAME", "arguments": {...}}\n</tool_call>`,
  with `arguments` held to the function's `parameters` schema;
- "xml" (Qwen3-Coder): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nvalue\n</parameter>\n...
  </function>\n</tool_call>`, one block per listed parameter in the schema's order (required ones always,
  others optional, no others); a string parameter's value is raw text without `</parameter>`, any
  other value JSON valid against the parameter's schema. A parameter whose value could be a string
  only some of the time (a typeless or mixed-type union with keywords, a patterned or formatted string)
  cannot be told apart from text in this form and is a 400. `parallel_tool_calls: false` allows exactly one block; otherwise one or
more, one per line. "none" lets the model write anything that does not contain `<tool_call>`.
"auto" (or no tool_choice) constrains nothing. Where the tokenizer has the tags as tokens of their own
(Qwen's added tokens), the grammar names those tokens (`<[id]>`): llguidance never spells such a token
out of text, and a model writes the tag as that one token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kiln.core.output_grammar import (
    JSON_OPTIONS,
    OutputGrammar,
    canonical_json,
    enforced_schema,
    lark_grammar,
    lark_string,
)
from kiln.core.schema_bounds import DEFAULT_MAX_LENGTH
from kiln.core.tool_calls import TAG_CLOSE, TAG_OPEN, type_parameter_value
from kiln.errors import KilnError

FORMATS = ("json", "xml")


def tool_call_format(template: str | None) -> str:
    """ "xml" where the chat template teaches Qwen3-Coder's `<function=...><parameter=...>` calls, else
    "json" (the Hermes form)."""
    return "xml" if template and "<function=" in template and "<parameter=" in template else "json"


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
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": enforced_schema(parameters)},
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


_TEXT_KEYS = ("pattern", "format", "enum", "const")
# text the parser (kiln.core.tool_calls.type_parameter_value) reads as a number, array or object when
# the parameter's declared types admit one: such a value would answer to that type's constraints, so raw
# text never looks like one (text it reads as true / false / null is a valid boolean / null)
_RETYPED = {"number": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?", "array": r"[\[{](?s:.*)"}
_RETYPED["integer"], _RETYPED["object"] = _RETYPED["number"], _RETYPED["array"]


class UnforceableParameter(ValueError):
    """A parameter the XML form cannot hold to its schema (the 400 names it)."""


def _resolve(schema: Any, defs: Mapping[str, Any]) -> Mapping[str, Any]:
    """A local `#/$defs/X` (or `#/definitions/X`) reference replaced by its target, once."""
    if isinstance(schema, Mapping) and isinstance(schema.get("$ref"), str):
        *_, name = schema["$ref"].split("/")
        target = defs.get(name)
        if isinstance(target, Mapping):
            return {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema if isinstance(schema, Mapping) else {}


def _union(schema: Mapping[str, Any]) -> tuple[set[str], Mapping[str, Any]] | None:
    """(the types a value may have, the schema its strings answer to): a `type` or type list, or an
    anyOf / oneOf whose branches each name one type (Pydantic's Optional[str]); None otherwise."""
    t = schema.get("type")
    if isinstance(t, str):
        return {t}, schema
    if isinstance(t, list):
        return set(t), schema
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches and all(
            isinstance(b, Mapping) and isinstance(b.get("type"), str) for b in branches):
        strings = [b for b in branches if b["type"] == "string"]
        if len(strings) <= 1:
            return {b["type"] for b in branches}, strings[0] if strings else schema
    return None


def _text(key: str, types: set[str], strings: Mapping[str, Any]) -> str:
    """Raw text for a string value, up to the closing tag (a lazy lexeme: it ends where the tag starts):
    no newline first (the parser trims the one after the opening tag, and would take a second with it),
    and never text the parser would read as another of the declared types."""
    if any(k in strings for k in _TEXT_KEYS):
        raise UnforceableParameter(key)
    low = int(strings.get("minLength", 0) or 0)
    high = int(strings.get("maxLength", max(DEFAULT_MAX_LENGTH, low)))
    text = (f"/(?s:([^\\n].{{0,{max(high - 1, 0)}}})?)/ & /(?s:.{{{low},{high}}})/ "
            f"& ~/(?s:.*<\\/parameter>.*)/")
    retyped = sorted({_RETYPED[t] for t in types if t in _RETYPED})
    if retyped:
        text += f" & ~/(?s:\\s*({'|'.join(retyped)})\\s*)/"
    return text


def _xml_value(key: str, schema: Mapping[str, Any], defs: Mapping[str, Any]) -> tuple[str, str | None]:
    """(the Lark expression of one parameter's value, a raw-text terminal or None) in the XML form."""
    schema = _resolve(schema, defs)
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(choices, list) and choices:
        # each choice as the parser reads it back: strings as text, others as JSON
        if not all(type_parameter_value(c if isinstance(c, str) else json.dumps(c), schema) == c for c in choices):
            raise UnforceableParameter(key)
        return "(" + " | ".join(lark_string(c if isinstance(c, str) else json.dumps(c)) for c in choices) + ")", None
    union = _union(schema)
    if union is None:
        raise UnforceableParameter(key)
    types, strings = union
    if "string" not in types:
        return f"%json {canonical_json({'$defs': dict(defs), **schema} if defs else dict(schema))}", None
    # text (read back as a string, or as true / false / null where the types admit them); numbers, arrays
    # and objects beside strings are left out
    return "", _text(key, types, strings)


def forced_xml_call_grammar(functions: list[tuple[str, Mapping[str, Any]]], *, parallel: bool, param: str,
                            tag_ids: tuple[int, int] | None = None) -> OutputGrammar:
    rules, bodies = [], []
    for f, (name, parameters) in enumerate(functions):
        schema = enforced_schema(parameters)
        defs = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
        props = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        required = set(schema.get("required") or [])
        parts = []
        for p, (key, prop) in enumerate(props.items()):
            try:
                value, text = _xml_value(key, prop, defs)
            except (UnforceableParameter, TypeError, ValueError, AttributeError):   # the latter: malformed
                raise KilnError(400, "tool_call_format", f"parameter {key!r} of function {name!r} cannot be "
                                "held to its schema in the model's XML tool-call form (a value that may or may not "
                                "be a string, or a patterned or formatted string)",
                                param="tools", hint="Give the parameter one plain type, or drop tool_choice.") from None
            opening, closing = lark_string(f"<parameter={key}>\n"), lark_string("\n</parameter>")
            alternatives = []
            if value:
                alternatives.append(f"{value} {closing}")
            if text is not None:   # one lazy lexeme: the text and the closing tag, ending at the first tag
                rules.append(f"t{f}_{p}[lazy]: T{f}_{p} {closing}")
                rules.append(f"T{f}_{p}: {text}")
                alternatives.append(f"t{f}_{p}")
            rules.append(f"p{f}_{p}: {opening} ({' | '.join(alternatives)}) {lark_string(chr(10))}")
            parts.append(f"p{f}_{p}" + ("" if key in required else "?"))
        rules.append(f"f{f}: {lark_string(f'<function={name}>' + chr(10))} {' '.join(parts)} "
                     f"{lark_string('</function>')}")
        bodies.append(f"f{f}")
    repeat = ' ("\\n" call)*' if parallel else ""
    open_id, close_id = tag_ids or (None, None)
    lark = (f"start: call{repeat}\n"
            f'call: {_tag(TAG_OPEN, open_id)} "\\n" body "\\n" {_tag(TAG_CLOSE, close_id)}\n'
            f"body: {' | '.join(bodies)}\n" + "\n".join(rules) + "\n")
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
                 code: str, tag_ids: tuple[int, int] | None = None, fmt: str = "json") -> OutputGrammar | None:
    """The grammar tool_choice asks for, or None; a 400 naming `tool_choice` when it cannot be met.
    `tag_ids`: the token ids of `<tool_call>` and `</tool_call>` when each is one token; `fmt`: the
    template's tool-call form (`tool_call_format`)."""
    forced = forced_xml_call_grammar if fmt == "xml" else forced_call_grammar

    def force(functions: list[tuple[str, Mapping[str, Any]]], *, parallel: bool, param: str) -> OutputGrammar:
        try:
            return forced(functions, parallel=parallel, param=param, tag_ids=tag_ids)
        except KilnError as e:
            e.code = code
            raise

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
        return _nested_guard(lambda: force(functions, parallel=parallel_tool_calls is not False,
                                           param="tool_choice"), code)
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
        return _nested_guard(lambda: force(chosen, parallel=False, param="tool_choice.function.name"), code)
    raise bad(f"tool_choice {tool_choice!r} is not supported", "tool_choice",
              'Use "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.')
