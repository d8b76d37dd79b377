"""Wire model for POST /v1/chat/completions (inference-api.txt, ChatCompletionRequest: 29 fields).

Unknown request fields are accepted and ignored, as the contract says. Every rule the contract
states about one request is checked here and fails as a 400 naming the field; rules that need the
served model (context length, thinking-budget fit) are checked by kiln.engine.chat_request.
"""

from __future__ import annotations

from typing import Any

from pydantic import field_validator, model_validator

from kiln.api.wire.common import (
    MAX_OUTPUTS,
    AdapterRef,
    ChatMessageInput,
    GenerationFields,
    StreamOptions,
)
from kiln.engine.chat_request import ChatInput
from kiln.errors import KilnError

CHAT_MAX_CHOICES = MAX_OUTPUTS
PREFIX = "Invalid chat completion request: "

__all__ = ["AdapterRef", "ChatCompletionRequest", "ChatMessageInput", "StreamOptions", "CHAT_MAX_CHOICES"]


def _bad(message: str, param: str, hint: str) -> KilnError:
    return KilnError(400, "chat_invalid_request", PREFIX + message, param=param, hint=hint)


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessageInput]
    stream: bool = False
    stream_options: StreamOptions | None = None
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
        if v is not None and v > CHAT_MAX_CHOICES:
            raise ValueError(f"must be between 1 and {CHAT_MAX_CHOICES}")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> ChatCompletionRequest:
        # KilnError passes through pydantic untouched, so the 400 names the right field.
        if self.stream and (self.n or 1) > 1:
            raise _bad("n > 1 is not supported with stream: true", "n",
                       "Send n: 1 when streaming, or drop stream for several choices.")
        if self.rollout_provenance:
            self._check_rollout()
        return self

    def _check_rollout(self) -> None:
        """semantics.md §6.1: one non-streaming sampled choice the engine can account for token by token."""
        hint = "rollout_provenance needs one non-streaming choice without tools; drop it or the conflicting field."
        if self.stream:
            raise _bad("rollout_provenance requires stream: false", "stream", hint)
        if self.n not in (None, 1):
            raise _bad("rollout_provenance requires n to be null or 1", "n", hint)
        if self.ignore_eos:
            raise _bad("rollout_provenance is incompatible with ignore_eos: true", "ignore_eos", hint)
        if self.effective_max_tokens == 0:
            raise _bad("rollout_provenance requires at least one completion token", self.max_tokens_param, hint)
        if self.tools:
            raise _bad("rollout_provenance rejects non-empty tools", "tools", hint)
        if self.tool_choice is not None:
            raise _bad("rollout_provenance requires tool_choice to be null", "tool_choice", hint)

    def adapter_fields(self) -> tuple[str | None, list[AdapterRef] | None, bool]:
        """(adapter, adapters, both given): chat rejects both keys present with an adapters array."""
        both = {"adapter", "adapters"} <= self.model_fields_set and self.adapters is not None
        return self.adapter, self.adapters, both

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def to_input(self) -> ChatInput:
        inp = self.chat_input(self.message_dicts(), both_adapters=self.adapter_fields()[2],
                              code="chat_invalid_request", prefix=PREFIX)
        inp.fold_reasoning = self.fold_reasoning_into_content
        inp.include_performance = self.include_performance
        inp.include_config_hashes = self.include_config_hashes
        inp.rollout_provenance = self.rollout_provenance
        inp.stream = self.stream
        inp.include_usage = bool(self.stream_options and self.stream_options.include_usage)
        return inp
