"""Wire model for POST /v1/completions, prompt-logprob scoring only (inference-api.txt,
TextCompletionRequest: 7 fields; semantics.md §5.2)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, field_validator

PREFIX = "Invalid completion request: "
MAX_PROMPT_LOGPROBS = 256


class TextCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    prompt: str | list[StrictInt]
    max_tokens: Any = 1
    prompt_logprobs: StrictInt
    n: Any = 1
    stream: Any = False
    add_special_tokens: bool = True

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: Any) -> Any:
        if v is None or (type(v) is int and v in (0, 1)):
            return v
        raise ValueError("must be null, 0 or 1: this endpoint scores prompt log-probabilities and does not generate")

    @field_validator("prompt_logprobs")
    @classmethod
    def _k(cls, v: int) -> int:
        if not 0 <= v <= MAX_PROMPT_LOGPROBS:
            raise ValueError(f"{v} is outside 0..{MAX_PROMPT_LOGPROBS} (exceeds kiln's cap of {MAX_PROMPT_LOGPROBS})")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: Any) -> Any:
        if v is None or (type(v) is int and v == 1):
            return v
        raise ValueError("must be missing, null or 1: prompt scoring returns a single choice")

    @field_validator("stream")
    @classmethod
    def _stream(cls, v: Any) -> Any:
        if v is False:
            return v
        raise ValueError("must be false: prompt-logprob scoring is non-streaming only")
