"""Thinking-budget configuration: resolution, applicability, pre-decode checks and the records.

Contract: thinking-budget.txt (+ thinking-budget-v1.schema.json); behaviour: semantics.md §2.1-2.3, §2.5.
The runtime per-step controller lives in `kiln.core.budget_controller`.

The token and time dimensions resolve independently. A request field has three states, told apart by
the caller's dict: key absent = inherit the server default, value None = explicitly unlimited, an
integer >= 0 = a finite limit (0 closes at the first decode candidate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kiln.errors import KilnError

CLOSE_TEXT = "</think>"
OPEN_TEXT = "<think>"

Scope = Literal["request", "suite", "run_override", "example"]
SOURCES = (
    "unlimited",
    "server_default",
    "request",
    "request_unlimited",
    "suite",
    "suite_unlimited",
    "run_override",
    "run_override_unlimited",
    "example",
    "example_unlimited",
    "unknown",
)
TOKENS_FIELD = "thinking_budget_tokens"
TIME_FIELD = "thinking_budget_ms"


@dataclass(frozen=True)
class ServerBudgetDefaults:
    """Server-wide defaults; None means the dimension is unlimited."""

    tokens: int | None = None
    time_ms: int | None = None

    @classmethod
    def from_settings(cls, server: Any) -> ServerBudgetDefaults:
        """From `ServerSettings`-like attributes or a serverDefaults mapping; "unlimited" reads as None."""
        get = server.get if isinstance(server, Mapping) else lambda k, d=None: getattr(server, k, d)
        return cls(
            tokens=_default_value(get("default_thinking_budget_tokens", None)),
            time_ms=_default_value(get("default_thinking_budget_ms", None)),
        )

    def to_dict(self) -> dict[str, int | None]:
        """The `serverDefaults` shape shown by GET /v1/config."""
        return {"default_thinking_budget_tokens": self.tokens, "default_thinking_budget_ms": self.time_ms}


def _default_value(v: Any) -> int | None:
    if v is None or (isinstance(v, str) and v.strip().lower() == "unlimited"):
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(
            f"server thinking-budget default must be a non-negative integer or unlimited, got {v!r}"
        )
    return v


@dataclass(frozen=True)
class EffectiveBudget:
    """The `effective` fragment: both dimensions resolved, before applicability is known."""

    max_tokens: int | None
    max_time_ms: int | None
    tokens_source: str
    time_source: str

    @property
    def configured(self) -> bool:
        return self.max_tokens is not None or self.max_time_ms is not None

    @property
    def limiting_param(self) -> str:
        """The request field to name when a configured budget cannot be honoured."""
        return TOKENS_FIELD if self.max_tokens is not None else TIME_FIELD

    def to_dict(self) -> dict[str, Any]:
        """Batch `metadata.thinking_budget` (configuration only), in the serialized field order."""
        out: dict[str, Any] = {"configured": self.configured}
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.max_time_ms is not None:
            out["max_time_ms"] = self.max_time_ms
        out["tokens_source"] = self.tokens_source
        out["time_source"] = self.time_source
        return out


def _resolve_dimension(
    fields: Mapping[str, Any], name: str, default: int | None, scope: Scope, code: str
) -> tuple[int | None, str]:
    if name not in fields:
        return (default, "server_default") if default is not None else (None, "unlimited")
    value = fields[name]
    if value is None:
        return None, f"{scope}_unlimited"
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KilnError(
            400,
            code,
            f"{name} must be null or a non-negative integer, got {value!r}",
            param=name,
            hint=f"Omit {name} to inherit the server default, send null for unlimited, or a whole number >= 0.",
        )
    return value, scope


def resolve_budget(
    request_fields_present: Mapping[str, Any],
    server_defaults: ServerBudgetDefaults | Mapping[str, Any] | Any,
    *,
    scope: Scope = "request",
    code: str = "chat_invalid_request",
) -> EffectiveBudget:
    """Resolve tokens and time independently (§2.2); an explicit null beats a finite server default."""
    defaults = (
        server_defaults
        if isinstance(server_defaults, ServerBudgetDefaults)
        else ServerBudgetDefaults.from_settings(server_defaults)
    )
    max_tokens, tokens_source = _resolve_dimension(
        request_fields_present, TOKENS_FIELD, defaults.tokens, scope, code
    )
    max_time, time_source = _resolve_dimension(
        request_fields_present, TIME_FIELD, defaults.time_ms, scope, code
    )
    return EffectiveBudget(max_tokens, max_time, tokens_source, time_source)


def resolve_eval_budget(
    example_generation: Mapping[str, Any] | None,
    run_generation: Mapping[str, Any] | None,
    suite_generation: Mapping[str, Any] | None,
    server_defaults: ServerBudgetDefaults | Mapping[str, Any] | Any,
) -> EffectiveBudget:
    """Eval scope: the first generation object present wins whole (no field-by-field merge)."""
    for scope, generation in (
        ("example", example_generation),
        ("run_override", run_generation),
        ("suite", suite_generation),
    ):
        if generation is not None:
            return resolve_budget(generation, server_defaults, scope=scope, code="eval_invalid_request")
    return resolve_budget({}, server_defaults, code="eval_invalid_request")


def parse_source(value: Any) -> str:
    """Readers map any string outside the closed vocabulary to `unknown`."""
    return value if value in SOURCES else "unknown"


def applies(effective: EffectiveBudget, *, thinking_enabled: bool, max_tokens: int) -> bool:
    """§2.3: configured, generation starts inside a reasoning block, and >= 1 completion token is allowed.

    A budget never turns thinking on: with a non-thinking prompt it stays inert.
    """
    return effective.configured and thinking_enabled and max_tokens >= 1


# ---- pre-decode checks (only when a controller will be built) -------------------------------------


def stop_conflicts_with_close(stop: str, close: str = CLOSE_TEXT) -> bool:
    """A stop string could fire on (part of) the close sequence, or the close could hide it."""
    if stop == "" or close in stop or stop in close:
        return True
    for n in range(1, min(len(stop), len(close)) + 1):
        if stop.endswith(close[:n]) or close.endswith(stop[:n]):
            return True
    return False


def check_stop_strings(
    stops: Sequence[str], *, close: str = CLOSE_TEXT, param: str = "stop", code: str = "chat_invalid_request"
) -> None:
    for i, stop in enumerate(stops):
        if stop_conflicts_with_close(stop, close):
            raise KilnError(
                400,
                code,
                f"stop string {stop!r} overlaps the reasoning close sequence {close!r}, which a thinking "
                "budget may have to force",
                param=param if len(stops) == 1 else f"{param}[{i}]",
                hint=f"Remove that stop string, or send {TOKENS_FIELD}: null and {TIME_FIELD}: null.",
            )


def check_close_sequence(
    close_ids: Sequence[int], decoded: str, *, param: str = TOKENS_FIELD, code: str = "chat_invalid_request"
) -> None:
    """The tokenizer's encoding of `</think>` must be non-empty and decode back to exactly `</think>`."""
    if not close_ids or decoded != CLOSE_TEXT:
        raise KilnError(
            400,
            code,
            f"this model's tokenizer cannot represent the reasoning close sequence {CLOSE_TEXT!r} "
            f"(encodes to {list(close_ids)}, decodes to {decoded!r}), so a thinking budget cannot be enforced",
            param=param,
            hint=f"Send {TOKENS_FIELD}: null and {TIME_FIELD}: null for this model.",
        )


def check_max_tokens_fits(
    max_tokens: int, close_len: int, *, param: str = "max_tokens", code: str = "chat_invalid_request"
) -> None:
    """The effective max_tokens (after context clamping) must hold the whole close sequence."""
    if max_tokens < close_len:
        raise KilnError(
            400,
            code,
            f"max_tokens {max_tokens} cannot fit the {close_len}-token reasoning close sequence that a "
            "thinking budget may force",
            param=param,
            hint=f"Raise max_tokens to at least {close_len}, or send {TOKENS_FIELD}: null and {TIME_FIELD}: null.",
        )


def check_budget_request(
    effective: EffectiveBudget,
    *,
    thinking_enabled: bool,
    max_tokens: int,
    stops: Sequence[str],
    close_ids: Sequence[int],
    close_decoded: str,
    code: str = "chat_invalid_request",
) -> bool:
    """Run §2.3's checks in order when a controller will be built; returns whether it applies."""
    if not applies(effective, thinking_enabled=thinking_enabled, max_tokens=max_tokens):
        return False
    check_stop_strings(stops, code=code)
    check_close_sequence(close_ids, close_decoded, param=effective.limiting_param, code=code)
    check_max_tokens_fits(max_tokens, len(close_ids), code=code)
    return True


# ---- records ------------------------------------------------------------------------------------


def budget_record(
    effective: EffectiveBudget, *, applied: bool, outcome: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """`metadata.thinking_budget`: effective + applied + triggered, then the flat outcome when one exists.

    Field order follows §2.5. An outcome exists only when the controller applied.
    """
    if outcome is not None and not applied:
        raise ValueError("an outcome needs an applied controller")
    if applied and not effective.configured:
        raise ValueError("applied needs a configured budget")
    out: dict[str, Any] = {"configured": effective.configured, "applied": applied}
    for key, value in effective.to_dict().items():
        if key != "configured":
            out[key] = value
    out["triggered"] = bool(outcome and outcome["triggered"])
    if outcome is not None:
        if "trigger" in outcome:
            out["trigger"] = outcome["trigger"]
        out["closed"] = outcome["closed"]
        out["thinking_tokens"] = outcome["thinking_tokens"]
        out["thinking_time_ms"] = outcome["thinking_time_ms"]
    return out


OUTCOME_LABELS = (
    "unconfigured",
    "inert",
    "natural_close",
    "tokens",
    "time",
    "max_tokens",
    "unclosed",
    "interrupted",
    "unresolved",
)


def outcome_label(record: Mapping[str, Any]) -> str:
    """Label for kiln_thinking_budget_outcomes_total (§2.6).

    The labels' meaning is not spelled out; read as: applied but no terminal outcome -> unresolved;
    forced but the request ended before the close sequence completed -> interrupted; never closed
    and never forced -> unclosed.
    """
    if not record.get("configured"):
        return "unconfigured"
    if record.get("applied") is False:
        return "inert"
    if "closed" not in record:
        return "unresolved"
    if record.get("triggered"):
        return record["trigger"] if record["closed"] else "interrupted"
    return "natural_close" if record["closed"] else "unclosed"


_OUTCOME_KEYS = ("triggered", "trigger", "closed", "thinking_tokens", "thinking_time_ms")


def read_record(data: Mapping[str, Any]) -> dict[str, Any]:
    """Read a stored record (eval results), accepting the legacy nested `outcome` object.

    Unknown sources become `unknown`; inconsistent records raise ValueError (§2.5 validation).
    """
    rec = dict(data)
    nested = rec.pop("outcome", None)
    if nested is not None:
        if any(k in rec for k in ("trigger", "closed", "thinking_tokens", "thinking_time_ms")):
            raise ValueError("thinking_budget record has both a nested outcome and flat outcome fields")
        rec.update({k: nested[k] for k in _OUTCOME_KEYS if k in nested})
    for key in ("tokens_source", "time_source"):
        rec[key] = parse_source(rec.get(key))
    finite = "max_tokens" in rec or "max_time_ms" in rec
    if rec.get("configured") != finite:
        raise ValueError("thinking_budget.configured must equal 'a finite limit is present'")
    for limit, source in (("max_tokens", "tokens_source"), ("max_time_ms", "time_source")):
        src = rec[source]
        if src != "unknown" and (limit in rec) == (src == "unlimited" or src.endswith("_unlimited")):
            raise ValueError(f"thinking_budget.{source} {src!r} disagrees with {limit}")
    if rec.get("applied") and not rec["configured"]:
        raise ValueError("thinking_budget.applied requires configured")
    if "closed" in rec and not rec.get("applied"):
        raise ValueError("a thinking_budget outcome requires applied")
    if rec.get("triggered", False) != ("trigger" in rec):
        raise ValueError("thinking_budget.triggered must equal 'trigger is present'")
    rec.setdefault("triggered", False)
    return rec
