"""Suites on disk as a user writes them (semantics.md §8.1 file layouts).

Either one JSON file holding everything, or a header JSON (without `examples`) next to an
`examples.jsonl` with one example per line. A directory means `<dir>/suite.json` (+ examples.jsonl).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.evals.suite import EvalSuite, invalid_request, parse_suite
from kiln.store.strict_json import loads_strict

HEADER_NAME = "suite.json"
EXAMPLES_NAME = "examples.jsonl"


def _read_json(path: Path) -> Any:
    try:
        return loads_strict(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise invalid_request(f"suite file {str(path)!r} does not exist", param="path") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise invalid_request(f"suite file {str(path)!r} is not valid JSON: {e}", param="path") from None


def read_examples_jsonl(path: Path) -> list[Any]:
    examples = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = loads_strict(line)
        except ValueError as e:
            raise invalid_request(f"invalid example at line {n} of {path.name}: {e}", param=f"{path.name}:{n}") from None
        if not isinstance(row, dict):
            raise invalid_request(f"invalid example at line {n} of {path.name}: expected a JSON object",
                                  param=f"{path.name}:{n}")
        examples.append(row)
    return examples


def load_suite_data(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    header_path = path / HEADER_NAME if path.is_dir() else path
    data = _read_json(header_path)
    if not isinstance(data, dict):
        raise invalid_request(f"suite file {str(header_path)!r} must hold a JSON object", param="path")
    examples_path = header_path.parent / EXAMPLES_NAME
    if examples_path.is_file():
        if "examples" in data:
            raise invalid_request(
                f"{header_path.name} must not contain examples when {EXAMPLES_NAME} sits next to it",
                param="examples", hint=f"Keep the examples in one place: the header or {EXAMPLES_NAME}.",
            )
        data = {**data, "examples": read_examples_jsonl(examples_path)}
    return data


def load_suite_file(path: str | Path) -> EvalSuite:
    return parse_suite(load_suite_data(path))
