"""Validate instances against a named entrypoint of the contract schemas in kiln/contracts.

All three schema files go into one `referencing` registry so their cross-file `$ref`s resolve
without the network (see kiln/contracts/README.md).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from kiln.contracts import CONTRACTS_DIR
from kiln.contracts import schemas as _schemas

# Where the contract files live (tests read the JSON Schemas beside the .txt pages).
SPEC_DIR = CONTRACTS_DIR


@cache
def _registry() -> Registry:
    return Registry().with_resources(
        (s["$id"], Resource.from_contents(s)) for s in _schemas().values()
    )


@cache
def validator_for(file_name: str, entrypoint: str) -> Draft202012Validator:
    schemas = _schemas()
    if file_name not in schemas:
        raise KeyError(f"unknown schema file {file_name!r}; have {sorted(schemas)}")
    schema = schemas[file_name]
    if entrypoint not in schema.get("$defs", {}):
        raise KeyError(f"{file_name} has no $defs/{entrypoint}")
    return Draft202012Validator({"$ref": f"{schema['$id']}#/$defs/{entrypoint}"}, registry=_registry())


def schema_errors(file_name: str, entrypoint: str, instance: Any) -> list[str]:
    """Every violation as 'json.path: message', in a stable order."""
    errors = validator_for(file_name, entrypoint).iter_errors(instance)
    return sorted(f"{e.json_path}: {e.message}" for e in errors)


def validate(file_name: str, entrypoint: str, instance: Any) -> None:
    """Raise AssertionError listing all errors when `instance` does not match the entrypoint."""
    errors = schema_errors(file_name, entrypoint, instance)
    if errors:
        listing = "\n  ".join(errors)
        raise AssertionError(f"{entrypoint} ({file_name}) rejected the instance:\n  {listing}")
