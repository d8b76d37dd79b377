"""Wire models of the vLLM-compatible routes under /compat (and the tokenizer routes at the root).

Not contract routes: they follow vLLM's shapes so lm-evaluation-harness and other OpenAI-completions
clients work unchanged: `/tokenize`, `/detokenize`, `/tokenizer_info`, and the legacy OpenAI
`/v1/completions` (generation, `echo`, `logprobs`) that the contract's prompt-scoring route is not.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from kiln.api.wire.chat import PREFIX as CHAT_PREFIX
from kiln.api.wire.chat import ChatCompletionRequest
from kiln.api.wire.common import U64_MAX, BeyondContract
from kiln.errors import KilnError

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_N = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class LegacyCompletionRequest(_Body, BeyondContract):
    """OpenAI's legacy completions body, as vLLM takes it (with its sampling extras and its output
    constraints: response_format, structured_outputs, guided_*; llama.cpp's json_schema, grammar)."""

    model: str | None = None
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=16, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=U64_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    stream: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True
    ignore_eos: bool = False
    user: str | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool) -> bool:
        if v:
            raise ValueError("streaming is not supported on /compat/v1/completions; send stream false")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def explicit_sampling(self) -> dict[str, Any]:
        keys = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "seed")
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if self.top_k is not None:
            out["top_k"] = max(0, self.top_k)  # vLLM's -1 (off) is Kiln's 0
        return out


class TokenizeRequest(_Body):
    """vLLM's /tokenize: text (`prompt`) or chat (`messages`, rendered with the served template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt]


class CompatChatRequest(ChatCompletionRequest):
    """The contract's chat body plus what its closed shapes leave out: OpenAI's `logprobs` and
    `top_logprobs` (0-20; needs logprobs true)."""

    logprobs: bool | None = None
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _logprobs(self) -> CompatChatRequest:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise KilnError(400, "chat_invalid_request", f"{CHAT_PREFIX}top_logprobs must be between 0 and "
                                f"{MAX_LOGPROBS}, got {self.top_logprobs}", param="top_logprobs",
                                hint=f"Send 0-{MAX_LOGPROBS} alternatives per token.")
            if not self.logprobs:
                raise KilnError(400, "chat_invalid_request", f"{CHAT_PREFIX}top_logprobs needs logprobs: true",
                                param="top_logprobs", hint="Send logprobs: true with top_logprobs.")
        return self

    @property
    def wanted_top_logprobs(self) -> int | None:
        """None when no logprobs are asked for; else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None
