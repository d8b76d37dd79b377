"""How evals reach a model: the `Generator` protocol and the values that cross it.

A job runner builds one `GenerationRequest` per (example, completion index) with its own seed and
hands a batch to `Generator.generate`; the generator runs them concurrently (so a local engine batches
them) and returns one `GenerationResult` per request, in order. Per-request failures come back as
results with `error` set, never as exceptions. Two implementations exist: the in-process engine
(`kiln.engine.eval_generator`) and any OpenAI-compatible server (`kiln.evals.remote_generator`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kiln.core.thinking_budget import EffectiveBudget, ServerBudgetDefaults
from kiln.evals.digests import BASE_WEIGHT_MANIFEST_DOMAIN, EXECUTION_PROVENANCE_DOMAIN, hash_json
from kiln.evals.generation import GenerationParams

JUDGE_MAX_TOKENS = 64


@dataclass(frozen=True)
class GenerationRequest:
    messages: list[dict[str, Any]]
    tools: list[Any] = field(default_factory=list)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # The resolved budget (eval scopes and server defaults already applied); None = no budget at all.
    thinking_budget: EffectiveBudget | None = None
    adapter: str | None = None  # None = base model
    label: str = ""  # "<example id>#<completion index>", for request ids and logs

    @classmethod
    def from_params(cls, params: GenerationParams, messages: list[dict[str, Any]], *, tools: list[Any],
                    seed: int, budget: EffectiveBudget, adapter: str | None, label: str) -> GenerationRequest:
        return cls(messages=messages, tools=list(tools), temperature=params.temperature, top_p=params.top_p,
                   top_k=params.top_k, max_tokens=params.max_tokens, stop=list(params.stop), seed=seed,
                   chat_template_kwargs=params.chat_template_kwargs, thinking_budget=budget, adapter=adapter,
                   label=label)

    @classmethod
    def judge(cls, prompt: str, *, adapter: str | None, label: str) -> GenerationRequest:
        """A judge call: greedy, short, thinking off, so the verdict line comes first."""
        return cls(messages=[{"role": "user", "content": prompt}], max_tokens=JUDGE_MAX_TOKENS, seed=0,
                   chat_template_kwargs={"enable_thinking": False}, adapter=adapter, label=label)


@dataclass(frozen=True)
class GenerationResult:
    text: str = ""  # exact decoder text (the stored raw_completion_text)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0
    finish_reason: str = "stop"  # stop | length | error
    # thinking-budget-v1 record (effective + applied + outcome) when the budget was resolved
    thinking_budget: dict[str, Any] | None = None
    # The rendered prompt already opened `<think>`: the stored completion re-attaches it (§3.7).
    prompt_starts_in_reasoning: bool = False
    error: str | None = None  # "prepare failed: ..." / "generation failed: ..."

    @classmethod
    def failed(cls, error: str, *, latency_ms: float = 0.0, thinking_budget: dict[str, Any] | None = None,
               prompt_tokens: int = 0) -> GenerationResult:
        return cls(latency_ms=latency_ms, finish_reason="error", thinking_budget=thinking_budget,
                   prompt_tokens=prompt_tokens, error=error)


@dataclass(frozen=True)
class GeneratorIdentity:
    """What a replay must find unchanged: how generation ran, and on which base weights."""

    execution_provenance: dict[str, Any]
    base_weight_manifest: dict[str, Any]
    # Server-wide thinking-budget defaults the generator applies to "inherit" (§2.2).
    budget_defaults: ServerBudgetDefaults = ServerBudgetDefaults()

    @property
    def execution_provenance_sha256(self) -> str:
        return hash_json(EXECUTION_PROVENANCE_DOMAIN, self.execution_provenance)

    @property
    def base_weight_manifest_sha256(self) -> str:
        return hash_json(BASE_WEIGHT_MANIFEST_DOMAIN, self.base_weight_manifest)


@runtime_checkable
class Generator(Protocol):
    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """One result per request, in order; run the requests concurrently so they batch."""
        ...

    async def identity(self) -> GeneratorIdentity:
        ...
