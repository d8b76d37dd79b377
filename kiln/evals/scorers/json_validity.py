"""json_validity: the answer holds parseable JSON, optionally of a shape or equal to the target (§8.3)."""

from __future__ import annotations

import json
from typing import Any, Literal

from kiln.core.brackets import matching_close
from kiln.evals.scorers.base import Example, ScoreContext, ScoreResult, SpecModel, failed, invalid, passed
from kiln.store.strict_json import loads_strict

MISSING = object()


class JsonValiditySpec(SpecModel):
    kind: Literal["json_validity"] = "json_validity"
    require_object: bool = False
    required_paths: list[str] = []


def extract_json_text(text: str) -> str:
    """From the first '{' or '[' to its matching closer; the whole text when there is no bracket."""
    text = text.strip()
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        return text
    start = min(starts)
    end = matching_close(text, start)
    return text[start:] if end is None else text[start:end]


def parse_json(text: str) -> Any:
    return loads_strict(text)


def resolve_pointer(doc: Any, pointer: str) -> Any:
    """RFC 6901 JSON Pointer; returns MISSING when the path does not exist."""
    if pointer == "":
        return doc
    if not pointer.startswith("/"):
        return MISSING
    node = doc
    for raw in pointer[1:].split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            if token not in node:
                return MISSING
            node = node[token]
        elif isinstance(node, list):
            if not token.isdigit() or (len(token) > 1 and token[0] == "0") or int(token) >= len(node):
                return MISSING
            node = node[int(token)]
        else:
            return MISSING
    return node


def json_equal(a: Any, b: Any) -> bool:
    """Structural equality where true is not 1 (Python's == says it is); numbers compare by value."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def score(spec: JsonValiditySpec, completion_text: str, example: Example, ctx: ScoreContext | None = None) -> ScoreResult:
    try:
        doc = parse_json(extract_json_text(completion_text))
    except (json.JSONDecodeError, ValueError) as e:
        return invalid(f"invalid JSON: {e}")
    if spec.require_object and not isinstance(doc, dict):
        return failed(0.0, f"expected a JSON object, got {type(doc).__name__}")
    missing = [p for p in spec.required_paths if resolve_pointer(doc, p) is MISSING]
    if missing:
        return failed(0.0, "missing required paths: " + ", ".join(missing))
    if example.target is None:
        return passed(1.0, "valid JSON")
    try:
        expected = parse_json(example.target.strip())
    except (json.JSONDecodeError, ValueError) as e:
        return invalid(f"target is not valid JSON: {e}")
    if json_equal(doc, expected):
        return passed(1.0, "JSON equals target")
    return failed(0.0, "JSON differs from target")
