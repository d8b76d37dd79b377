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
from kiln.core.tool_calls import TAG_CLOSE, TAG_OPEN
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


_TEXT_KEYS = ("pattern", "format", "enum", "const", "anyOf", "oneOf", "allOf", "not", "$ref")
_DOC_KEYS = ("title", "description", "default", "examples")


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


def _types(schema: Mapping[str, Any]) -> set[str] | None:
    """The types a schema's value may have: its `type`, or the union of an anyOf / oneOf of bare types."""
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return set(t)
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and all(isinstance(b, Mapping) and set(b) <= {"type", *_DOC_KEYS}
                                          and isinstance(b.get("type"), str) for b in branches):
        return {b["type"] for b in branches}
    return None


def _xml_value(key: str, schema: Mapping[str, Any], defs: Mapping[str, Any]) -> str:
    """The Lark expression of one parameter's value in the XML form."""
    schema = _resolve(schema, defs)
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return "(" + " | ".join(lark_string(c) for c in choices) + ")"
    types = _types(schema)
    if types is None or ("string" in types and any(k in schema for k in _TEXT_KEYS if k not in ("anyOf", "oneOf"))):
        raise UnforceableParameter(key)
    if "string" in types:
        low = int(schema.get("minLength", 0) or 0)
        high = int(schema.get("maxLength", max(DEFAULT_MAX_LENGTH, low)))
        # raw text up to the closing tag (a lazy lexeme: it ends where the tag starts); no newline first,
        # as the parser trims the one after the opening tag and would take a second one with it
        return (f"/(?s:([^\\n].{{0,{max(high - 1, 0)}}})?)/ & /(?s:.{{{low},{high}}})/ "
                f"& ~/(?s:.*<\\/parameter>.*)/")
    return f"%json {canonical_json({'$defs': dict(defs), **schema} if defs else dict(schema))}"


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
                value = _xml_value(key, prop, defs)
            except UnforceableParameter:
                raise KilnError(400, "tool_call_format", f"parameter {key!r} of function {name!r} cannot be "
                                "held to its schema in the model's XML tool-call form (a value that may or may not "
                                "be a string, or a patterned or formatted string)",
                                param="tools", hint="Give the parameter one plain type, or drop tool_choice.") from None
            if value.startswith(("%json", "(")):
                rules.append(f"p{f}_{p}: {lark_string(f'<parameter={key}>' + chr(10))} v{f}_{p} "
                             f"{lark_string(chr(10) + '</parameter>' + chr(10))}")
                rules.append(f"v{f}_{p}: {value}")
            else:   # one lazy lexeme: the text and the closing tag, ending at the first closing tag
                rules.append(f"p{f}_{p}: {lark_string(f'<parameter={key}>' + chr(10))} v{f}_{p} {lark_string(chr(10))}")
                rules.append(f"v{f}_{p}[lazy]: T{f}_{p} {lark_string(chr(10) + '</parameter>')}")
                rules.append(f"T{f}_{p}: {value}")
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
