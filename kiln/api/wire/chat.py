"""Wire models for POST /v1/chat/completions (inference-api.txt, ChatCompletionRequest: 29 fields).

Unknown request fields are accepted and ignored, as the contract says.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kiln.errors import KilnError

U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
CHAT_MAX_CHOICES = 64


class ChatMessageInput(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[Any] | None = ""
    reasoning_content: str | None = None
    tool_calls: list[Any] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class AdapterRef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    scale: float


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    messages: list[ChatMessageInput]
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0, le=U32_MAX)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    sampling_preset: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    # Absent vs null matters for these two (absent = inherit, null = unlimited): see model_fields_set.
    thinking_budget_tokens: int | None = Field(default=None, ge=0)
    thinking_budget_ms: int | None = Field(default=None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=U64_MAX)
    adapter: str | None = None
    adapters: list[AdapterRef] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    fold_reasoning_into_content: bool | None = None
    include_performance: bool | None = None
    include_config_hashes: bool | None = None
    rollout_provenance: bool = False

    @field_validator("messages")
    @classmethod
    def _messages_nonempty(cls, v: list[ChatMessageInput]) -> list[ChatMessageInput]:
        if not v:
            raise ValueError("must contain at least one message")
        return v

    @field_validator("n")
    @classmethod
    def _n_range(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= CHAT_MAX_CHOICES:
            raise ValueError(f"must be between 1 and {CHAT_MAX_CHOICES}")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> ChatCompletionRequest:
        # KilnError passes through pydantic untouched, so the 400 names the right field.
        if self.stream and (self.n or 1) > 1:
            raise KilnError(400, "chat_invalid_request",
                            "Invalid chat completion request: n > 1 is not supported with stream: true",
                            param="n", hint="Send n: 1 when streaming, or drop stream for several choices.")
        if self.adapter is not None and self.adapters is not None:
            raise KilnError(400, "invalid_compose_request",
                            "Invalid chat completion request: give either adapter or adapters, not both",
                            param="adapters")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def explicit_sampling(self) -> dict[str, Any]:
        """Sampling fields the request set to a value (None and absent both mean 'not set')."""
        keys = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "seed")
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        mt = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        if mt is not None:
            out["max_tokens"] = mt
        return out
