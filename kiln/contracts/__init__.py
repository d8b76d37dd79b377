"""The wire contracts Kiln implements, shipped with the package.

`inference-api.txt`, `evals-api.txt` and `thinking-budget.txt` are the spec; the three
`*.schema.json` files beside them are their machine-readable form (draft 2020-12, cross-file
`$ref`s by `$id`). Tests validate every response shape against them (`kiln.testing.schemas`) and
the server builds its OpenAPI document from them, so both read this one copy.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

CONTRACTS_DIR = Path(__file__).resolve().parent


@cache
def schemas() -> dict[str, dict[str, Any]]:
    """Every contract schema by file name (e.g. 'kiln-inference-v1.schema.json')."""
    files = sorted(CONTRACTS_DIR.glob("*.schema.json"))
    if not files:
        raise FileNotFoundError(f"no *.schema.json files under {CONTRACTS_DIR}")
    return {p.name: json.loads(p.read_text(encoding="utf-8")) for p in files}
