"""The one strict JSON reader: `json.loads` that refuses NaN / Infinity literals, which no other JSON
reader accepts (request bodies, dataset rows, suite files, scorer inputs)."""

from __future__ import annotations

import json
from typing import Any


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not valid JSON")


def loads_strict(text: str | bytes) -> Any:
    return json.loads(text, parse_constant=_reject_constant)
