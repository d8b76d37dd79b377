"""The output grammar: the one request-side notion of "this output must match X".

A request may constrain its output through any of the field families clients send:
- OpenAI `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON
  object; llama.cpp's optional `schema` beside it is honoured), `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (strict or not, the schema is enforced as written);
- vLLM's `structured_outputs` `{json | regex | choice | grammar}` and its older top-level
  `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (Lark, or GBNF converted);
- llama.cpp's top-level `json_schema` and `grammar` (GBNF, or Lark).

At most one family may constrain one request; a malformed one is a 400 naming the field's path, never a
silent fallback to free text. What comes out is an `OutputGrammar`: its kind (the metrics label), the
field that asked for it, and the llguidance grammar text (a JSON document, built here without the
library), whose sha256 keys the engine's compile cache. Compiling it, and refusing what llguidance
cannot enforce, is kiln.engine.grammar.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kiln.core.schema_bounds import bounded, bounded_json_object, enforceable
from kiln.errors import KilnError

# JSON as json.dumps writes it: ", " and ": " between items, no other whitespace, so a small model
# cannot pad an answer with blank lines up to max_tokens; and never lenient (a schema's own x-guidance
# cannot make llguidance skip keywords it does not implement: those are refused, not ignored).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
MAX_CHOICES = 1024
MAX_GRAMMAR_CHARS = 200_000

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "tool_call", "no_tool_call")


@dataclass(frozen=True)
class OutputGrammar:
    kind: str      # one of KINDS
    param: str     # the request field that asked for it (errors name it; compile failures too)
    grammar: str   # llguidance's top-level grammar document

    @property
    def key(self) -> str:
        """sha256 of the canonical (compact) grammar text: the compile cache's key."""
        return hashlib.sha256(self.grammar.encode()).hexdigest()


def _bad(message: str, param: str, hint: str, code: str) -> KilnError:
    return KilnError(400, code, message, param=param, hint=hint)


def canonical_json(value: Any) -> str:
    """Compact JSON; key order is kept, since a schema's property order is the order output follows."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
# not `not`, `if`, `then`, `else`: those are tests or intersected with their parent, where closing would
# exclude the parent's own keys
_SUBSCHEMAS = ("items", "additionalProperties", "contains")


def closed_objects(schema: Any) -> Any:
    """The schema with every object that lists `properties` and says nothing of `additionalProperties`
    (or `patternProperties`) closed to other keys, as OpenAI's strict mode and xgrammar do: every output
    still validates, and a small model cannot invent keys until max_tokens. `allOf` is left as written
    (closing its branches would exclude each other's properties)."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    if "allOf" in out:
        return out
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(v) for v in out[key]]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), Mapping):
            out[key] = closed_objects(out[key])
    if isinstance(out.get("properties"), Mapping) and "additionalProperties" not in out \
            and "patternProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def enforced_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema the grammar enforces: objects closed (`closed_objects`), keywords with an exact
    equivalent rewritten to it, strings and numbers bounded (kiln.core.schema_bounds). A schema too
    malformed to rewrite (a keyword of the wrong JSON type) goes to llguidance closed but otherwise as
    written, and llguidance's refusal names what is wrong."""
    closed = closed_objects(schema)
    try:
        return dict(bounded(enforceable(closed)))
    except (TypeError, ValueError, AttributeError):
        return dict(closed)


def json_schema_grammar(schema: Mapping[str, Any], *, kind: str, param: str) -> OutputGrammar:
    """A JSON-schema grammar: the enforced schema (`enforced_schema`), and Kiln's JSON options (whitespace,
    never lenient) overriding any `x-guidance` the schema carries."""
    schema = enforced_schema(schema)
    guidance = schema.get("x-guidance")
    schema["x-guidance"] = {**(guidance if isinstance(guidance, Mapping) else {}), **JSON_OPTIONS}
    doc = {"grammars": [{"name": "json_schema", "json_schema": schema}]}
    return OutputGrammar(kind, param, canonical_json(doc))


def lark_grammar(lark: str, *, kind: str, param: str) -> OutputGrammar:
    return OutputGrammar(kind, param, canonical_json({"grammars": [{"name": kind, "lark_grammar": lark}]}))


def lark_string(text: str) -> str:
    """`text` as a Lark string literal (JSON string escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def regex_grammar(pattern: str, *, param: str) -> OutputGrammar:
    # a Lark regex literal: the pattern's own slashes escaped, nothing else touched
    return lark_grammar("start: /" + pattern.replace("/", "\\/") + "/", kind="regex", param=param)


def choice_grammar(choices: list[str], *, param: str) -> OutputGrammar:
    return lark_grammar("start: " + " | ".join(lark_string(c) for c in choices), kind="choice", param=param)


def _schema(value: Any, param: str, code: str) -> Mapping[str, Any]:
    """A schema given as an object or as a JSON string (vLLM accepts both); booleans are schemas too."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise _bad(f"{param} is not valid JSON: {e}", param, "Send the JSON schema as an object.", code) from None
    if value is True:
        return {}
    if value is False:
        raise _bad(f"{param} is the schema `false`, which no output satisfies", param,
                   "Send a satisfiable JSON schema.", code)
    if not isinstance(value, Mapping):
        raise _bad(f"{param} must be a JSON schema object, got {type(value).__name__}", param,
                   "Send the JSON schema as an object.", code)
    return value


def _text(value: Any, param: str, code: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(f"{param} must be a non-empty string ({what})", param, f"Send {what} as a string.", code)
    if len(value) > MAX_GRAMMAR_CHARS:
        raise _bad(f"{param} is {len(value)} characters; at most {MAX_GRAMMAR_CHARS} are compiled", param,
                   "Send a smaller grammar.", code)
    return value


def _choices(value: Any, param: str, code: str) -> list[str]:
    if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
            or not all(isinstance(c, str) for c in value)):
        raise _bad(f"{param} must be a non-empty array of at most {MAX_CHOICES} strings", param,
                   'Send the allowed outputs, e.g. ["yes", "no"].', code)
    return list(value)


_LARK_HINT = re.compile(r"^\s*(start|%[a-z]+)\b", re.MULTILINE)


def is_lark(text: str) -> bool:
    """A grammar is Lark when it defines `start` or uses a `%` directive; otherwise it is GBNF (`::=`)."""
    return "::=" not in text or bool(_LARK_HINT.search(text))


def _grammar_text(value: Any, param: str, code: str, gbnf_to_lark: Any) -> OutputGrammar:
    text = _text(value, param, code, "a Lark or GBNF grammar")
    if not is_lark(text):
        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter's own error says where the GBNF is wrong
            raise _bad(f"{param}: the GBNF grammar does not convert: {e}", param,
                       "Check the GBNF syntax (root ::= ...), or send Lark with a start rule.", code) from None
    return lark_grammar(text, kind="grammar", param=param)


def _response_format(rf: Any, code: str) -> OutputGrammar | None:
    if not isinstance(rf, Mapping):
        raise _bad("response_format must be an object with a type", "response_format",
                   'Send {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}.', code)
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        # llama.cpp lets a schema ride along with json_object
        if rf.get("schema") is not None:
            return json_schema_grammar(_schema(rf["schema"], "response_format.schema", code), kind="json_schema",
                                       param="response_format.schema")
        return json_schema_grammar(bounded_json_object(), kind="json_object", param="response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, Mapping):
            raise _bad("response_format.json_schema is missing; type json_schema needs one", "response_format.json_schema",
                       'Send "json_schema": {"name": "answer", "schema": {...}, "strict": true}.', code)
        if spec.get("schema") is None:
            raise _bad("response_format.json_schema.schema is missing", "response_format.json_schema.schema",
                       "Send the JSON schema the output must match, or use type json_object.", code)
        param = "response_format.json_schema.schema"
        return json_schema_grammar(_schema(spec["schema"], param, code), kind="json_schema", param=param)
    raise _bad(f"response_format.type {kind!r} is not supported", "response_format.type",
               'Use "text", "json_object" or "json_schema".', code)


def _structured_outputs(so: Any, code: str, gbnf_to_lark: Any) -> OutputGrammar | None:
    if not isinstance(so, Mapping):
        raise _bad("structured_outputs must be an object", "structured_outputs",
                   'Send one of {"json": {...}}, {"regex": "..."}, {"choice": [...]}, {"grammar": "..."}.', code)
    given = [k for k in ("json", "regex", "choice", "grammar") if so.get(k) is not None]
    if so.get("json_object"):
        given.append("json_object")
    unsupported = [k for k in ("structural_tag",) if so.get(k) is not None]
    if unsupported:
        raise _bad(f"structured_outputs.{unsupported[0]} is not supported", f"structured_outputs.{unsupported[0]}",
                   "Use json, regex, choice or grammar.", code)
    if len(given) > 1:
        raise _bad(f"structured_outputs gives {', '.join(given)}; give exactly one", "structured_outputs",
                   "Send one of json, regex, choice, grammar.", code)
    if not given:
        return None
    return _vllm_field(given[0], so[given[0]], f"structured_outputs.{given[0]}", code, gbnf_to_lark)


def _vllm_field(name: str, value: Any, param: str, code: str, gbnf_to_lark: Any) -> OutputGrammar:
    if name == "json":
        return json_schema_grammar(_schema(value, param, code), kind="json_schema", param=param)
    if name == "json_object":
        return json_schema_grammar(bounded_json_object(), kind="json_object", param=param)
    if name == "regex":
        return regex_grammar(_text(value, param, code, "a regular expression"), param=param)
    if name == "choice":
        return choice_grammar(_choices(value, param, code), param=param)
    return _grammar_text(value, param, code, gbnf_to_lark)


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def output_grammar(fields: Mapping[str, Any], *, code: str, gbnf_to_lark: Any) -> OutputGrammar | None:
    """The request's output grammar, or None when it asks for free text.

    `fields` holds the request's constraint fields that were present (None values count as absent);
    `gbnf_to_lark` converts llama.cpp's GBNF (the engine passes llguidance's converter).
    """
    present = {k: v for k, v in fields.items() if v is not None}
    families = []
    if "response_format" in present:
        families.append(("response_format", lambda: _response_format(present["response_format"], code)))
    if "structured_outputs" in present:
        families.append(("structured_outputs",
                         lambda: _structured_outputs(present["structured_outputs"], code, gbnf_to_lark)))
    for key, name in _GUIDED.items():
        if key in present:
            families.append((key, lambda key=key, name=name: _vllm_field(name, present[key], key, code, gbnf_to_lark)))
    if "json_schema" in present:
        families.append(("json_schema", lambda: json_schema_grammar(_schema(present["json_schema"], "json_schema", code),
                                                                    kind="json_schema", param="json_schema")))
    if "grammar" in present:
        families.append(("grammar", lambda: _grammar_text(present["grammar"], "grammar", code, gbnf_to_lark)))
    built = []
    for name, make in families:
        try:
            built.append((name, make()))
        except RecursionError:
            raise _bad(f"{name} is nested too deeply to compile", name, "Flatten the schema or grammar.",
                       code) from None
    active = [(name, g) for name, g in built if g is not None]
    if len(active) > 1:
        names = ", ".join(name for name, _ in active)
        raise _bad(f"{names} each constrain the output; give one", active[1][0],
                   "Send a single response_format, structured_outputs, json_schema or grammar.", code)
    return active[0][1] if active else None
