"""Wire pieces shared by the chat and batch requests (inference-api.txt): messages, adapter refs, the
sampling and thinking-budget fields, and `chat_input`, which hands a request to the engine side. The
adapter-selection rules live with adapter resolution (kiln.engine.chat_request.resolve_adapter)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from kiln.engine.chat_request import AdapterSelection, ChatInput
from kiln.errors import KilnError

U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
MAX_OUTPUTS = 64  # CHAT_MAX_CHOICES and BATCH_MAX_TOTAL_OUTPUTS
OUTPUT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "json_schema", "grammar")


class ChatMessageInput(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

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
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    name: str = Field(min_length=1)
    scale: float


class BeyondContract(BaseModel):
    """Output constraints beyond the contract (OpenAI, vLLM, llama.cpp spellings; kiln.core.output_grammar)
    and parallel_tool_calls: read beside a model's declared fields, not declared themselves, so the wire
    model stays exactly the contract's. They change what a response says, never its shape."""

    _beyond: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _read_beyond(cls, data: Any, handler: Any) -> Any:
        model = handler(data)
        if isinstance(data, dict):
            model._beyond = {k: data[k] for k in (*OUTPUT_FIELDS, "parallel_tool_calls") if data.get(k) is not None}
        return model

    def output_fields(self) -> dict[str, Any]:
        """The output-constraint fields the request sent (None values count as absent)."""
        return {k: v for k, v in self._beyond.items() if k in OUTPUT_FIELDS}

    @property
    def parallel_tool_calls(self) -> bool | None:
        value = self._beyond.get("parallel_tool_calls")
        if value is not None and not isinstance(value, bool):
            raise KilnError(400, "chat_invalid_request", f"parallel_tool_calls must be a boolean, got {value!r}",
                            param="parallel_tool_calls", hint="Send true or false.")
        return value


class GenerationFields(BeyondContract):
    """Sampling, length, stop, seed, thinking-budget, adapter and template fields of chat and batch."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
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
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=U64_MAX)
    adapter: str | None = None
    adapters: list[AdapterRef] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    @field_validator("n")
    @classmethod
    def _n_positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("'n' must be >= 1 when set")
        return v

    def stop_list(self, *, keep_empty: bool = False) -> list[str]:
        """The stop sequences as a list; empty strings dropped unless asked for (the thinking-budget
        check rejects an empty stop, the engine just ignores it)."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return stops if keep_empty else [s for s in stops if s]

    def explicit_sampling(self) -> dict[str, Any]:
        """Sampling fields the request set to a value (None and absent both mean 'not set')."""
        keys = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "seed")
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if self.effective_max_tokens is not None:
            out["max_tokens"] = self.effective_max_tokens
        return out

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_tokens is not None else "max_completion_tokens"

    def chat_input(self, messages: list[dict[str, Any]], *, both_adapters: bool, code: str,
                   prefix: str) -> ChatInput:
        """The engine-side request (kiln.engine.chat_request): plain data, nothing decided yet."""
        return ChatInput(
            messages=messages, tools=self.tools, tool_choice=self.tool_choice, sampling=self.explicit_sampling(),
            sampling_preset=self.sampling_preset, stop=self.stop_list(keep_empty=True), ignore_eos=self.ignore_eos,
            n=self.n or 1, chat_template_kwargs=self.chat_template_kwargs, budget_fields=self.budget_fields(),
            adapter=AdapterSelection(self.adapter, self.adapters, "adapter" in self.model_fields_set, both_adapters,
                                     model=self.model),
            max_tokens_param=self.max_tokens_param, code=code, prefix=prefix,
            parallel_tool_calls=self.parallel_tool_calls, output_fields=self.output_fields(),
        )

    def budget_fields(self) -> dict[str, Any]:
        """The thinking-budget fields the request carried (absent = inherit, null = unlimited)."""
        return {k: getattr(self, k) for k in ("thinking_budget_tokens", "thinking_budget_ms")
                if k in self.model_fields_set}
