"""Wire model for POST /v1/completions/batch (inference-api.txt, BatchCompletionRequest: 23 fields).

Validation order follows semantics.md §5.1: prompts present, n >= 1, prompts x n <= 64, then the
adapter rules (kiln.engine.chat_request.resolve_adapter).
"""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from kiln.api.wire.common import MAX_OUTPUTS, AdapterRef, ChatMessageInput, GenerationFields
from kiln.engine.chat_request import ChatInput
from kiln.errors import KilnError

PREFIX = "Invalid batch completion request: "


class BatchCompletionRequest(GenerationFields):
    prompts: list[list[ChatMessageInput]]

    @model_validator(mode="after")
    def _limits(self) -> BatchCompletionRequest:
        if not self.prompts:
            raise KilnError(400, "batch_invalid_request", PREFIX + "prompts must contain at least one prompt",
                            param="prompts", hint="Send prompts as an array of message arrays.")
        for i, messages in enumerate(self.prompts):
            if not messages:
                raise KilnError(400, "batch_invalid_request", PREFIX + f"prompts[{i}] has no messages",
                                param=f"prompts[{i}]", hint="Every prompt needs at least one message.")
        total = len(self.prompts) * self.choices
        if total > MAX_OUTPUTS:
            raise KilnError(400, "batch_too_large",
                            f"Batch would produce {total} completions, which exceeds the cap of {MAX_OUTPUTS}",
                            param="n" if self.choices > 1 else "prompts",
                            hint=f"Keep len(prompts) x n at or below {MAX_OUTPUTS}; split the work into several requests.")
        return self

    @property
    def choices(self) -> int:
        return self.n or 1

    def adapter_fields(self) -> tuple[str | None, list[AdapterRef] | None, bool]:
        """Batch rejects a string adapter together with an adapters array (adapter: null is fine)."""
        return self.adapter, self.adapters, isinstance(self.adapter, str) and self.adapters is not None

    def to_input(self) -> ChatInput:
        """The request-wide fields; the prompts go beside it (`prompt_dicts`)."""
        return self.chat_input([], both_adapters=self.adapter_fields()[2], code="batch_invalid_request",
                               prefix=PREFIX)

    def prompt_dicts(self) -> list[list[dict[str, Any]]]:
        return [[m.model_dump(exclude_none=True) for m in messages] for messages in self.prompts]
