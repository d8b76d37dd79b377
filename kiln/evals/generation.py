"""Eval generation parameters (the contract's EvalGenerationParams) and their defaults (§4.2, §8.1).

Precedence is whole-object: the example's own `generation` object (omitted fields take the DEFAULTS,
not the suite's values), else the run-level override, else the suite's object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 128
DEFAULT_MAX_TOKENS = 256

Scope = Literal["example", "run_override", "suite"]


def u64_from_string(v: Any) -> Any:
    """u64 fields accept a decimal string too (JavaScript clients cannot hold every u64)."""
    if isinstance(v, str) and v.isascii() and v.isdigit():
        return int(v)
    return v


class GenerationParams(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = Field(default=0, ge=0)
    max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: list[str] = []
    seed: int | None = Field(default=None, ge=0, le=(1 << 64) - 1)
    # Omitted = inherit the server default; explicit null = unlimited; a number = that limit.
    thinking_budget_tokens: int | None = Field(default=None, ge=0)
    thinking_budget_ms: int | None = Field(default=None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_from_string(cls, v: Any) -> Any:
        return u64_from_string(v)

    def budget_override(self, field: Literal["thinking_budget_tokens", "thinking_budget_ms"]) -> Literal["inherit"] | int | None:
        """'inherit' when omitted, None for explicit unlimited, else the limit."""
        if field not in self.model_fields_set:
            return "inherit"
        return getattr(self, field)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)


@dataclass(frozen=True)
class EffectiveGeneration:
    params: GenerationParams
    scope: Scope


def effective_generation(example_generation: GenerationParams | None, suite_generation: GenerationParams,
                         run_override: GenerationParams | None = None) -> EffectiveGeneration:
    if example_generation is not None:
        return EffectiveGeneration(example_generation, "example")
    if run_override is not None:
        return EffectiveGeneration(run_override, "run_override")
    return EffectiveGeneration(suite_generation, "suite")
