"""JSON-schema grammars against generated instances, without a model: for schemas using the keywords
people use, every instance hypothesis-jsonschema generates (within the default bounds on strings and numbers) is
accepted by the mask token by token, and
mutated instances the schema rejects are rejected too; or the schema is refused up front. What is
refused is recorded in grammar_refused_schemas.json, which may only shrink."""

from __future__ import annotations

import copy
import json
import re
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import llguidance
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import utils as _cu
from hypothesis_jsonschema import _from_schema as _hjs
from hypothesis_jsonschema import from_schema

from kiln.core.output_grammar import closed_objects, json_schema_grammar
from kiln.core.schema_bounds import DEFAULT_MAX_LENGTH, FRACTION_DIGITS, MAX_SAFE_INTEGER
from kiln.testing.tiny import tiny_tokenizer

BASELINE = Path(__file__).with_name("grammar_refused_schemas.json")


class _IteratedMany:
    """hypothesis-jsonschema 0.23 draws object entries with the `many(...).more()` of Hypothesis
    internals; today's `many` is a context manager iterated in a for loop. This adapter drives the new
    one through the old calls, for hypothesis-jsonschema's module alone, so its generator runs unchanged."""

    _END = object()

    def __init__(self, data, **sizes) -> None:
        self._many = _cu.many(data, **sizes)
        self._many.__enter__()
        self._steps = iter(self._many)

    def more(self) -> bool:
        if next(self._steps, self._END) is self._END:
            self._many.__exit__(None)
            return False
        return True

    def reject(self, why: str | None = None) -> None:
        self._many.reject(why)


if not hasattr(_cu.many, "more"):
    _hjs.cu = SimpleNamespace(**{**vars(_cu), "many": _IteratedMany})

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

SCHEMAS: dict[str, dict] = {
    "types": {"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
        "z": {"type": "null"}}, "required": ["s", "i", "n", "b", "z"], "additionalProperties": False},
    "enum_const": {"type": "object", "properties": {"color": {"enum": ["red", "green", 3, None]},
                                                    "kind": {"const": "fixed"}},
                   "required": ["color", "kind"], "additionalProperties": False},
    "optional_props": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                       "additionalProperties": False},
    "additional_schema": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
                          "additionalProperties": {"type": "boolean"}},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
        "required": ["name", "tags"], "additionalProperties": False}}, "required": ["user"],
        "additionalProperties": False},
    "bounds": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "name": {"type": "string", "minLength": 2, "maxLength": 6},
        "list": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}},
        "required": ["age", "score", "name", "list"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"], "additionalProperties": False},
    "formats": {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                                 "mail": {"type": "string", "format": "email"},
                                                 "at": {"type": "string", "format": "date-time"}},
                "required": ["day", "mail", "at"], "additionalProperties": False},
    "any_of": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]},
    "one_of_objects": {"oneOf": [
        {"type": "object", "properties": {"t": {"const": "a"}, "x": {"type": "integer"}}, "required": ["t", "x"],
         "additionalProperties": False},
        {"type": "object", "properties": {"t": {"const": "b"}, "y": {"type": "boolean"}}, "required": ["t", "y"],
         "additionalProperties": False}]},
    "all_of": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"a": {"maximum": 10}}}]},
    "refs": {"type": "object", "properties": {"home": {"$ref": "#/$defs/addr"}, "work": {"$ref": "#/$defs/addr"}},
             "required": ["home"], "additionalProperties": False,
             "$defs": {"addr": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                                "required": ["city"], "additionalProperties": False}}},
    "array_of_objects": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "integer"}},
                                                    "required": ["k"], "additionalProperties": False},
                         "maxItems": 3},
    "type_list": {"type": ["string", "null"]},
    "unique_items": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "multiple_of": {"type": "integer", "multipleOf": 5},
    "pattern_properties": {"type": "object", "patternProperties": {"^x-": {"type": "integer"}},
                           "additionalProperties": False},
    "dependent_required": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}},
    "not": {"not": {"type": "string"}},
    "if_then_else": {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}},
                     "required": ["kind"], "additionalProperties": False,
                     "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["n"]},
                     "else": {"properties": {"n": {"maximum": 0}}}},
    "min_properties": {"type": "object", "minProperties": 1, "additionalProperties": {"type": "integer"}},
}


@pytest.fixture(scope="module")
def ll():
    tok = tiny_tokenizer()
    return tok, llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size())


def grammar(name: str) -> str:
    return json_schema_grammar(SCHEMAS[name], kind="json_schema", param="schema").grammar


def refused(name: str, ll) -> str | None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar(name), ll[1])
    return messages[0] if is_error else None


def accepts(name: str, ll, value) -> bool:
    """Feed dumps(value) token by token, each checked against the mask first; accepted at the end."""
    tok, lt = ll
    matcher = llguidance.LLMatcher(lt, grammar(name), log_level=0)
    words = (lt.vocab_size + 31) // 32
    for token in tok.encode(dumps(value)).ids:
        mask = matcher.compute_bitmask()
        word = int.from_bytes(mask[4 * (token // 32): 4 * (token // 32) + 4], "little")
        assert len(mask) == 4 * words
        if not (word >> (token % 32)) & 1 or not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def in_schema_order(schema: dict, value, defs: dict | None = None):
    """The instance as the grammar writes it: each object's keys in the order the schema lists them (JSON
    object order carries no meaning), and no keys beyond those of an object Kiln closes."""
    defs = defs if defs is not None else schema.get("$defs", {})
    if isinstance(schema, dict) and "$ref" in schema:
        return in_schema_order(defs[schema["$ref"].split("/")[-1]], value, defs)
    if isinstance(value, dict):
        order: list[str] = []
        for sub in [schema, *schema.get("allOf", []), *schema.get("anyOf", []), *schema.get("oneOf", [])]:
            order += [k for k in sub.get("properties", {}) if k not in order and k in value]
        props = {k: v for sub in [schema, *schema.get("allOf", [])] for k, v in sub.get("properties", {}).items()}
        ordered = {k: in_schema_order(props.get(k, {}), value[k], defs) for k in order}
        if closed_objects(schema).get("additionalProperties") is False:
            return ordered   # Kiln closes objects that list properties: the grammar writes no other keys
        return {**ordered, **{k: v for k, v in value.items() if k not in ordered}}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [in_schema_order(schema["items"], v, defs) for v in value]
    return value


def dumps(value) -> str:
    """json.dumps's text (", " and ": "), numbers written positionally: llguidance's bounded numbers
    take no exponent (1e-06 under `maximum` is refused), and a model writes 0.000001 there anyway."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    if isinstance(value, float):
        text = format(Decimal(repr(value)), "f")
        return text if "." in text or value != int(value) else text + ".0"
    return json.dumps(value, ensure_ascii=False)


def within_default_bounds(value):
    """The instance as the bounded grammar can write it (kiln.core.schema_bounds): floats rounded to the
    default fraction digits (and zero unsigned); None when an integer or a string lies past the default bounds."""
    if isinstance(value, dict):
        inner = {k: within_default_bounds(v) for k, v in value.items()}
        return None if any(v is None and value[k] is not None for k, v in inner.items()) else inner
    if isinstance(value, list):
        inner = [within_default_bounds(v) for v in value]
        return None if any(v is None and o is not None for v, o in zip(inner, value, strict=True)) else inner
    if isinstance(value, float):
        # + 0.0: the bounded grammar writes zero as 0.0, never -0.0
        return round(value, FRACTION_DIGITS) + 0.0 if abs(value) <= MAX_SAFE_INTEGER else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value if abs(value) <= MAX_SAFE_INTEGER else None
    if isinstance(value, str):
        return value if len(value) <= DEFAULT_MAX_LENGTH else None
    return value


def outside_known_differences(value) -> bool:
    """llguidance's JSON strings take no raw DEL (0x7f), which JSON allows; no model writes one. And the
    text holds no special token's name (`<|im_end|>`): the tokenizer encodes that as the special token,
    which the grammar rightly never allows inside JSON."""
    text = dumps(value)
    return "\x7f" not in text and not re.search(r"<\|[a-z_]+\|>|</?(tool_call|think|tool_response)>", text)


def mutated(value, data):
    """One small change: a key dropped or added, or a leaf swapped for a value of another type."""
    if isinstance(value, dict) and value:
        key = data.draw(st.sampled_from(sorted(value)))
        change = data.draw(st.sampled_from(["drop", "swap", "add", "deeper"]))
        if change == "drop":
            return {k: v for k, v in value.items() if k != key}
        if change == "add":
            return {**value, "unexpected_key": 1}
        if change == "deeper":
            return {**value, key: mutated(value[key], data)}
        return {**value, key: "text" if not isinstance(value[key], str) else 7}
    if isinstance(value, list) and value:
        i = data.draw(st.integers(0, len(value) - 1))
        return [*value[:i], mutated(value[i], data), *value[i + 1:]]
    return "text" if not isinstance(value, str) else 7


JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False,
                    allow_infinity=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=6)


def test_the_refused_baseline_matches_exactly_and_may_only_shrink(ll):
    baseline = json.loads(BASELINE.read_text())
    now = {name: refused(name, ll) for name in SCHEMAS}
    newly = sorted(n for n, why in now.items() if why and n not in baseline)
    assert not newly, f"schemas refused that the baseline does not list: {newly} ({[now[n] for n in newly]})"
    fixed = sorted(n for n in baseline if not now.get(n))
    assert not fixed, f"accepted now, remove from {BASELINE.name}: {fixed}"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_generated_instances_are_accepted_and_invalid_ones_rejected(name, ll):
    if refused(name, ll):
        pytest.skip("refused up front (listed in the baseline)")
    schema = SCHEMAS[name]

    @SETTINGS
    @given(valid=from_schema(copy.deepcopy(schema)), other=JSON, data=st.data())   # from_schema rewrites its input
    def check(valid, other, data):
        validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
        valid = within_default_bounds(valid)
        assume(valid is not None and validator.is_valid(valid) and outside_known_differences(valid))
        ordered = in_schema_order(schema, valid)
        assert accepts(name, ll, ordered), valid
        for wrong in (mutated(ordered, data), other):
            if not validator.is_valid(wrong):
                assert not accepts(name, ll, wrong), wrong

    check()
