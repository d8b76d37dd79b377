"""Request bodies of the eval job routes: EvalRunRequest, EvalCompareSpec, RerunBody, ReplayBody.

Each parser takes decoded JSON and returns a small dataclass, raising a 400 KilnError
(`eval_invalid_request`, "Invalid eval request: ...") that names the offending field. Unknown fields
are ignored except in ReplayBody, which the contract closes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

from pydantic import ValidationError

from kiln.errors import KilnError
from kiln.evals.generation import GenerationParams
from kiln.evals.scorers.base import OutcomeKind
from kiln.evals.seeds import parse_u64
from kiln.evals.suite import EvalSuite, invalid_request, parse_suite

MAX_COMPARE_ADAPTERS = 8
OUTCOME_KINDS: tuple[str, ...] = get_args(OutcomeKind)
DEFAULT_RERUN_KINDS = ("fail", "invalid", "error")
_UNSET: Any = object()


@dataclass(frozen=True)
class RunRequest:
    suite_name: str | None = None
    inline_suite: EvalSuite | None = None
    adapter: Any = _UNSET  # _UNSET = the active adapter; None or "" = base; else a name
    seed: int | None = None
    generation: GenerationParams | None = None

    @property
    def adapter_given(self) -> bool:
        return self.adapter is not _UNSET


@dataclass(frozen=True)
class CompareSpec:
    suite_name: str
    adapters: list[str]
    seed: int | None = None
    generation: GenerationParams | None = None


@dataclass(frozen=True)
class RerunSpec:
    adapter: Any = _UNSET
    outcome_kinds: tuple[str, ...] = DEFAULT_RERUN_KINDS
    include_pass: bool = False
    seed: int | None = None

    @property
    def adapter_given(self) -> bool:
        return self.adapter is not _UNSET and self.adapter is not None


def _object(body: Any, what: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid_request(f"{what} must be a JSON object", param=None)
    return body


def _string(body: dict[str, Any], key: str, *, nullable: bool = False) -> Any:
    value = body.get(key)
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        kind = "a string or null" if nullable else "a string"
        raise invalid_request(f"{key}: must be {kind}, got {type(value).__name__}", param=key)
    return value


def _generation(value: Any) -> GenerationParams | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_request("generation: must be an object of eval decode parameters", param="generation")
    try:
        return GenerationParams.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        param = f"generation.{loc}" if loc else "generation"
        raise invalid_request(f"{param}: {first.get('msg', 'invalid value')}", param=param) from None


def _seed(body: dict[str, Any]) -> int | None:
    return parse_u64(body["seed"], param="seed") if body.get("seed") is not None else None


def _inline_suite(value: Any) -> EvalSuite:
    try:
        return parse_suite(value)
    except KilnError as e:
        e.param = "inline_suite" + ("." + e.param if e.param else "")
        raise


def parse_run_request(body: Any) -> RunRequest:
    body = _object(body, "run request")
    has_suite, has_inline = body.get("suite") is not None, body.get("inline_suite") is not None
    if has_suite == has_inline:
        raise invalid_request("give exactly one of suite (a registered suite name) or inline_suite",
                              param="suite" if has_suite else None,
                              hint="Send {\"suite\": \"NAME\"} for a registered suite, or the suite itself "
                                   "as inline_suite.")
    return RunRequest(
        suite_name=_string(body, "suite") if has_suite else None,
        inline_suite=_inline_suite(body["inline_suite"]) if has_inline else None,
        adapter=_string(body, "adapter", nullable=True) if "adapter" in body else _UNSET,
        seed=_seed(body),
        generation=_generation(body.get("generation")),
    )


def parse_compare_spec(body: Any) -> CompareSpec:
    body = _object(body, "compare request")
    suite = _string(body, "suite")
    adapters = body.get("adapters")
    if not isinstance(adapters, list) or not 1 <= len(adapters) <= MAX_COMPARE_ADAPTERS:
        raise invalid_request(f"adapters: must be a list of 1 to {MAX_COMPARE_ADAPTERS} adapter names "
                              "(\"\" = the base model)", param="adapters")
    for i, a in enumerate(adapters):
        if not isinstance(a, str):
            raise invalid_request(f"adapters[{i}]: must be a string (\"\" = the base model)", param=f"adapters[{i}]")
    return CompareSpec(suite, list(adapters), _seed(body), _generation(body.get("generation")))


def parse_rerun_body(body: Any) -> RerunSpec:
    body = _object(body if body is not None else {}, "re-run request")
    kinds = body.get("outcome_kinds")
    if kinds is not None and (not isinstance(kinds, list) or any(k not in OUTCOME_KINDS for k in kinds)):
        raise invalid_request(f"outcome_kinds: must be a list of {', '.join(OUTCOME_KINDS)}",
                              param="outcome_kinds")
    include_pass = body.get("include_pass", False)
    if not isinstance(include_pass, bool):
        raise invalid_request("include_pass: must be true or false", param="include_pass")
    return RerunSpec(
        adapter=_string(body, "adapter", nullable=True) if "adapter" in body else _UNSET,
        outcome_kinds=tuple(kinds) if kinds is not None else DEFAULT_RERUN_KINDS,
        include_pass=include_pass, seed=_seed(body),
    )


def parse_replay_body(body: Any) -> int:
    """The run index (default 0); the contract rejects unknown fields here."""
    body = _object(body if body is not None else {}, "replay request")
    unknown = sorted(set(body) - {"run_index"})
    if unknown:
        raise invalid_request(f"{unknown[0]}: unknown field (a replay body has only run_index)", param=unknown[0])
    index = body.get("run_index", 0)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise invalid_request("run_index: must be a whole number >= 0", param="run_index")
    return index
