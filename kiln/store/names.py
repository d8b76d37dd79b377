"""Resource names (adapters, datasets, suites, judgments) as one safe path segment (semantics.md §7.3)."""

from __future__ import annotations

from kiln.errors import KilnError

MAX_NAME_LEN = 128


def name_problem(name: object) -> str | None:
    """Why `name` is not a safe single path segment, or None when it is."""
    if not isinstance(name, str):
        return "must be a string"
    if not name or not name.strip():
        return "must not be empty or blank"
    if name != name.strip():
        return "must not start or end with whitespace"
    if len(name) > MAX_NAME_LEN:
        return f"must be at most {MAX_NAME_LEN} characters"
    if "/" in name or "\\" in name:
        return "must not contain path separators"
    if ".." in name:
        return "must not contain '..'"
    if name.startswith("."):
        return "must not start with '.' (hidden)"
    if "\x00" in name or any(ord(c) < 32 for c in name):
        return "must not contain control characters"
    return None


def validate_name(name: object, *, kind: str = "resource", param: str = "name", code: str = "invalid_name") -> str:
    """Return `name` if safe, else raise a 400 KilnError naming the parameter."""
    problem = name_problem(name)
    if problem is not None:
        raise KilnError(
            400,
            code,
            f"Invalid {kind} name {name!r}: {problem}.",
            param=param,
            hint="Use one path segment without separators or '..', e.g. 'my-adapter_v2'.",
        )
    return name  # type: ignore[return-value]
