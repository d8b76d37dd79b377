"""One generation stream (one choice of one request) as the scheduler and block manager see it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kiln.core.sampling import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    # Choice i>0 of a request waits until choice 0's prompt is computed, so it hits the prefix cache.
    wait_for: Sequence | None = None
    adapter_slot: int = 0  # 0 = base; part of the prefix-cache key (a unique id per adapter revision)
    lora_slot: int = 0     # row of the model's LoRA bank this sequence reads (0 = base)
    arrival_time: float = field(default_factory=time.monotonic)
    finish_reason: str | None = None
    # the engine's output-grammar state of this choice (kiln.engine.grammar.GrammarState), None = free text
    grammar: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens the next steps must feed before the model can sample again."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def prompt_computed(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
