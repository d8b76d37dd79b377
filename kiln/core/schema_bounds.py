"""A JSON schema rewritten into what the grammar enforces: bounded values, enforceable keywords.

Two rewrites, each keeping every output valid against the schema as written:

- Bounds (`bounded`): a string without `maxLength` gets `DEFAULT_MAX_LENGTH`; a number or integer without
  a lower / upper bound gets -/+`MAX_SAFE_INTEGER` (2^53 - 1, the I-JSON interoperable range), and a
  `number` without `multipleOf` gets `multipleOf` 10^-`FRACTION_DIGITS`; an array without `maxItems`, and
  an object open to other keys without `maxProperties` (where llguidance can bound it: every listed key
  required), get `DEFAULT_MAX_ITEMS`. Free JSON (`json_object`) is any object whose values are bounded
  the same way, at every depth. A small model otherwise writes an email address, digits or list items
  until `max_tokens`; a schema's own `maxLength`, bounds, `multipleOf`, `maxItems` always win.
- Equivalents (`enforceable`): keywords llguidance does not implement but that have an exact equivalent it
  does: `dependentRequired` (and draft-7 `dependencies` with name lists) becomes, per key, "the key is
  absent or every dependent key is present" (`anyOf` of `properties: {key: false}` and `required`);
  `uniqueItems` that constrains nothing (`false`, or at most one item) is dropped; `not: {"type": ...}`
  becomes the complementary `type`; `if` testing one property against a `const` the property's own `enum`
  lists (`if: {properties: {k: {const: c}}}`, with or without `required: [k]`) becomes `anyOf` of "k is c
  (or absent, as `if` says) and `then`" and "k is another of its values (or absent) and `else`".
  Anything else llguidance cannot enforce stays and is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DEFAULT_MAX_LENGTH = 512
DEFAULT_MAX_ITEMS = 128        # array items, and the keys of an object open to any key
MAX_SAFE_INTEGER = 2**53 - 1
FRACTION_DIGITS = 9

_TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
               "not", "if", "then", "else", "contains", "propertyNames")
# the keywords of a schema that still admits any value
_ANY_KEYS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}


def _walk(schema: Any, rewrite: Any, skip: tuple[str, ...] = ()) -> Any:
    """`rewrite` applied bottom-up to every subschema, except those under the keywords in `skip`."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if key not in skip and isinstance(out.get(key), Mapping):
            out[key] = {k: _walk(v, rewrite, skip) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if key not in skip and isinstance(out.get(key), list):
            out[key] = [_walk(v, rewrite, skip) for v in out[key]]
    for key in _SUBSCHEMAS:
        if key not in skip and isinstance(out.get(key), Mapping):
            out[key] = _walk(out[key], rewrite, skip)
    if isinstance(out.get("items"), list):   # draft-4 tuple items
        out["items"] = [_walk(v, rewrite, skip) for v in out["items"]]
    return rewrite(out)


def _types(schema: Mapping[str, Any]) -> set[str] | None:
    """The types the schema names, or None when it names none."""
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return None


def _bound(schema: dict[str, Any]) -> dict[str, Any]:
    types = _types(schema)
    free = types is None and set(schema) <= _ANY_KEYS   # any value at all: bounded whatever it turns out to be
    if types is None and not free:
        return schema   # a test, a reference or a composition: the schemas it names are bounded themselves
    if (free or "string" in types) and "maxLength" not in schema:
        schema["maxLength"] = max(DEFAULT_MAX_LENGTH, int(schema.get("minLength", 0) or 0))
    if free or types & {"number", "integer"}:
        if "minimum" not in schema and not _number(schema.get("exclusiveMinimum")):
            schema["minimum"] = -MAX_SAFE_INTEGER
        if "maximum" not in schema and not _number(schema.get("exclusiveMaximum")):
            schema["maximum"] = MAX_SAFE_INTEGER
        if (free or "number" in types) and "multipleOf" not in schema:
            schema["multipleOf"] = float(f"1e-{FRACTION_DIGITS}")
    if (free or "array" in types) and "maxItems" not in schema:
        schema["maxItems"] = max(DEFAULT_MAX_ITEMS, int(schema.get("minItems", 0) or 0))
    props = schema.get("properties")
    listed_all_required = not props or (isinstance(props, Mapping) and set(props) <= set(schema.get("required") or []))
    if (free or "object" in types) and schema.get("additionalProperties") is not False \
            and "maxProperties" not in schema and listed_all_required:
        # llguidance bounds the keys of an object only where every listed key is required
        schema["maxProperties"] = max(DEFAULT_MAX_ITEMS, int(schema.get("minProperties", 0) or 0))
    return schema


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def bounded(schema: Any) -> Any:
    """The schema with every string and number bounded (see the module docstring). Subschemas that are
    tests rather than shapes (`not`, `if`, `contains`, `propertyNames`) stay as written: bounding a test
    would change what it accepts."""
    return _walk(schema, _bound, skip=("not", "if", "contains", "propertyNames"))


def bounded_json_object() -> dict[str, Any]:
    """Any JSON object, its values bounded at every depth (the grammar of `json_object`)."""
    value = "#/$defs/kiln_value"
    return _bound({"type": "object", "additionalProperties": {"$ref": value}, "$defs": {"kiln_value": {"anyOf": [
        _bound({"type": "string"}), _bound({"type": "number"}), {"type": "boolean"}, {"type": "null"},
        _bound({"type": "array", "items": {"$ref": value}}),
        _bound({"type": "object", "additionalProperties": {"$ref": value}})]}}})


def _dependent_required(schema: dict[str, Any]) -> dict[str, Any]:
    deps: dict[str, list[str]] = {}
    for key in ("dependentRequired", "dependencies"):
        spec = schema.get(key)
        if not isinstance(spec, Mapping) or not all(isinstance(v, list) for v in spec.values()):
            continue   # draft-7 schema dependencies stay, and are refused
        for name, needs in spec.items():
            deps.setdefault(name, []).extend(n for n in needs if n not in deps.get(name, []))
        del schema[key]
    if deps:
        # allOf, not a sibling anyOf: the schema may have its own anyOf, and an object under allOf stays
        # open as written (closing happens before this rewrite)
        schema["allOf"] = [*schema.get("allOf", []), *(
            {"anyOf": [{"properties": {name: False}}, {"required": [name, *needs]}]} for name, needs in deps.items())]
    return schema


def _unique_items(schema: dict[str, Any]) -> dict[str, Any]:
    unique = schema.get("uniqueItems")
    max_items = schema.get("maxItems")
    if unique is False or (unique is True and _number(max_items) and max_items <= 1):
        del schema["uniqueItems"]
    return schema


def _not_type(schema: dict[str, Any]) -> dict[str, Any]:
    negated = schema.get("not")
    if not isinstance(negated, Mapping) or set(negated) != {"type"}:
        return schema
    excluded = _types(negated) or set()
    if not excluded:
        return schema
    if "number" in excluded:
        excluded.add("integer")   # every integer is a number
    elif "integer" in excluded:
        return schema   # "a number that is not an integer" has no type of its own: refused as written
    allowed = [t for t in _TYPES if t not in excluded]
    own = _types(schema)
    if own is not None:
        allowed = [t for t in allowed if t in own or (t == "integer" and "number" in own)]
    if not allowed:
        return schema   # unsatisfiable: left for llguidance to refuse
    del schema["not"]
    schema["type"] = allowed[0] if len(allowed) == 1 else allowed
    return schema


_DOC_KEYS = {"title", "description", "$comment"}


def _if_const(schema: dict[str, Any]) -> dict[str, Any]:
    test = schema.get("if")
    if not isinstance(test, Mapping) or not set(test) <= {"properties", "required", *_DOC_KEYS}:
        return schema
    tested = test.get("properties")
    if not isinstance(tested, Mapping) or len(tested) != 1:
        return schema
    [(key, cond)] = tested.items()
    required = test.get("required", [])
    if not isinstance(cond, Mapping) or set(cond) != {"const"} or required not in ([], [key]):
        return schema
    own = (schema.get("properties") or {}).get(key)
    values = own.get("enum") if isinstance(own, Mapping) else None
    if not isinstance(values, list) or cond["const"] not in values:
        return schema
    others = [v for v in values if v != cond["const"]]
    absent = {"properties": {key: False}}
    is_c = {"properties": {key: {"const": cond["const"]}}, **({"required": [key]} if required else {})}
    not_c = [{"required": [key], "properties": {key: {"enum": others}}}] if others else []
    if required:   # an absent key fails the test: `else` holds then
        not_c.append(absent)
    branches = [{"allOf": [is_c, schema.get("then", {})]}]
    branches += [{"allOf": [c, schema.get("else", {})]} for c in not_c]
    for k in ("if", "then", "else"):
        schema.pop(k, None)
    schema["allOf"] = [*schema.get("allOf", []), {"anyOf": branches}]
    return schema


def enforceable(schema: Any) -> Any:
    """The schema with the keywords that have an exact enforceable equivalent rewritten to it."""
    return _walk(schema, lambda s: _if_const(_not_type(_unique_items(_dependent_required(s)))))
