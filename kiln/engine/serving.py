"""The server-facing `Engine` (kiln/engine/build.py builds it from settings: weights, tokenizer, chat
template, KV pool, the batching actor)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kiln.config import Settings
from kiln.core.admission import AdmissionGate, Ticket
from kiln.core.block_manager import PrefixCacheStats
from kiln.core.decode_stats import DecodeSnapshot
from kiln.core.prefill_pacer import ItlPacing, auto_itl_pacing
from kiln.core.sampling import SamplingParams, resolve_sampling
from kiln.core.thinking_budget import ServerBudgetDefaults
from kiln.core.tool_calls import TAG_CLOSE, TAG_OPEN
from kiln.core.tool_grammar import tool_call_format
from kiln.engine.actor import ActorBridge, ChoiceEvent, EngineActor, EngineCounters, GenerationRequest
from kiln.engine.adapter_resolver import AdapterResolver
from kiln.engine.chat_template import ChatTemplate
from kiln.engine.grammar import GrammarCompiler, GrammarCounters
from kiln.engine.lora_slots import AdapterTarget
from kiln.engine.prompt_context import PromptContext
from kiln.engine.provenance import PolicyIdentity, ServingIdentity, tagged
from kiln.engine.scoring import PromptScores
from kiln.engine.tokenizer import Tokenizer
from kiln.errors import KilnError
from kiln.model import kernels
from kiln.model.config import ModelConfig
from kiln.model.loader import LoadedWeights
from kiln.model.transformer import Transformer

if TYPE_CHECKING:
    from kiln.engine.chat_response import FinishedCompletion

log = logging.getLogger("kiln.engine")


@dataclass
class ModelInfo:
    path: str
    served_model_id: str
    config: ModelConfig
    format: str
    dtype: str
    device: str
    max_model_len: int
    num_blocks: int
    block_size: int
    created: int
    # sampling fields of generation_config.json (HF dirs) used as the no-preset default
    generation_defaults: dict[str, Any]
    # the weights the serving path multiplies with, resolved ("auto" never appears here)
    quantization: str = "none"

    @property
    def qwen3_family(self) -> bool:
        return self.config.architecture == "qwen3"

    def describe(self) -> str:
        c = self.config
        return f"{self.served_model_id} ({c.num_hidden_layers}L, {c.num_attention_heads}H, {c.num_key_value_heads}KV)"

    def default_sampling(self, settings: Settings, *, has_tools: bool = False) -> SamplingParams:
        """What a request that sets no sampling field gets (semantics.md §0, §4.2)."""
        return resolve_sampling({}, preset=None, qwen3_family=self.qwen3_family, has_tools=has_tools,
                                model_defaults=self.generation_defaults, eval_mode=settings.server.eval_mode)


def sampling_dict(p: SamplingParams) -> dict[str, Any]:
    return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p,
            "repetition_penalty": p.repetition_penalty, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty, "max_tokens": p.max_tokens, "seed": p.seed}


def resolved_itl_pacing(settings: Settings, info: ModelInfo) -> ItlPacing:
    """engine.itl_target_ms as the engine runs it: "auto" becomes its pacing for these weights here."""
    target = settings.engine.itl_target_ms
    if target != "auto":
        return ItlPacing(float(target))
    isa = kernels.active_isa() if info.device == "cpu" and kernels.enabled() else None
    return auto_itl_pacing(info.device, info.dtype, info.quantization, isa)


def effective_inference_config(settings: Settings, info: ModelInfo, backend: str) -> dict[str, Any]:
    """The resolved inference policy: everything here can change what a request generates.
    Its canonical-JSON hash is `effective_config_hash` and the provenance `inference_config_sha256`."""
    srv = settings.server
    eng = settings.engine
    pacing = resolved_itl_pacing(settings, info)
    return {
        "served_model_id": info.served_model_id,
        "model": {"architecture": info.config.architecture, "format": info.format, "dtype": info.dtype,
                  "device": info.device, "max_model_len": info.max_model_len,
                  "quantization": info.quantization},
        "backend": backend,
        "engine": {"block_size": info.block_size, "num_blocks": info.num_blocks, "max_num_seqs": eng.max_num_seqs,
                   "max_batch_tokens": eng.max_batch_tokens, "enable_prefix_caching": eng.enable_prefix_caching,
                   "prefill_cost_with_decodes": eng.prefill_cost_with_decodes,
                   "itl_target_ms": pacing.target_ms, "itl_below_fixed_price": pacing.below_fixed_price},
        "server": {"eval_mode": srv.eval_mode, "default_thinking_enabled": srv.default_thinking_enabled,
                   **ServerBudgetDefaults.from_settings(srv).to_dict(),
                   "fold_reasoning_into_content": srv.fold_reasoning_into_content},
        "default_sampling": sampling_dict(info.default_sampling(settings)),
        "default_sampling_with_tools": sampling_dict(info.default_sampling(settings, has_tools=True)),
    }


class CompletionObserver(Protocol):
    """Told when a chat or batch completion starts running and when it is finished (any outcome)."""

    def completion_started(self) -> None: ...

    def completion_finished(self, done: FinishedCompletion) -> None: ...


class Engine:
    """The server-facing engine: tokenizer, template, limits, adapter resolution, `submit`, health and
    stats. It owns the batching actor (`EngineActor`) and talks to it only through its queues."""

    def __init__(self, info: ModelInfo, tokenizer: Tokenizer, template: ChatTemplate, actor: EngineActor,
                 weights: LoadedWeights, identity: ServingIdentity | Future[ServingIdentity] | None = None,
                 effective_config: dict[str, Any] | None = None) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.template = template
        self.actor = actor
        self.weights = weights
        self._bridge = ActorBridge(actor)
        self._grammars: GrammarCompiler | None = None
        self._prompt_context: PromptContext | None = None
        self._identity: ServingIdentity | Future[ServingIdentity] | None = None
        self.identity = identity   # a future while it is computed (see the property)
        self.effective_config = effective_config or {}
        self.effective_config_sha256 = tagged(self.effective_config)
        # Set by `attach_adapters` once the adapter services exist; None serves the base model only.
        self.adapters: AdapterResolver | None = None
        self.observers: list[CompletionObserver] = []
        self.in_flight = 0
        # Bounded admission: `admit` refuses new HTTP work past these limits; build_engine
        # sizes them from the settings and the KV pool.
        self.admission = AdmissionGate()

    @property
    def identity(self) -> ServingIdentity | None:
        """The content identity of what serves requests. `build_engine` hashes the tokenizer on a thread
        of its own (~0.3 s of CPU at a 128k vocabulary) so the server is ready meanwhile: the first
        reader waits for it, and an error computing it is raised to every reader."""
        if isinstance(self._identity, Future):
            return self._identity.result()
        return self._identity

    @identity.setter
    def identity(self, value: ServingIdentity | Future[ServingIdentity] | None) -> None:
        self._identity = value

    def attach_adapters(self, store: Any, compose_cache: Any, active: Any) -> None:
        from kiln.adapters.compat import model_spec_from_config

        self.adapters = AdapterResolver(store, compose_cache, active, model_spec_from_config(self.info.config))

    def resolve_adapter(self, *, adapter_given: bool, adapter: str | None, adapters: Any,
                        param: str = "adapter") -> AdapterTarget | None:
        """The adapter revision a request runs on (None = base), per semantics.md §4.7; callers go
        through `kiln.engine.chat_request.resolve_adapter`, which checks the selection first."""
        if self.adapters is None:
            named = adapters[0].name if adapters else (adapter if adapter_given else None)
            if named:
                raise KilnError(404, "adapter_not_found", f"adapter {named!r} is not available on this server",
                                param="adapters[0].name" if adapters else param,
                                hint="GET /v1/adapters lists saved adapters.")
            return None
        return self.adapters.resolve(adapter_given=adapter_given, adapter=adapter, adapters=adapters, param=param)

    @property
    def backend(self) -> str:
        return self.actor.runner.backend

    @property
    def model(self) -> Transformer:
        """The served model (training shares its frozen base weights)."""
        return self.actor.runner.model

    def policy(self) -> PolicyIdentity | None:
        """The behavior-policy identity for rollout provenance; None without a content identity."""
        if self.identity is None:
            return None
        return PolicyIdentity(self.info.served_model_id, self.identity, self.effective_config_sha256, self.backend)

    def config_hashes(self) -> dict[str, str] | None:
        return None if self.identity is None else self.identity.config_hashes(self.effective_config_sha256)

    # -- health and stats ------------------------------------------------------------------------
    def describe(self) -> str:
        return self.info.describe()

    def is_alive(self) -> bool:
        return self.actor.is_alive()

    @property
    def prewarmed(self) -> bool:
        return self.actor.prewarmed

    def join(self) -> None:
        """Block until the actor thread ends (after `shutdown`)."""
        self.actor.join()

    def shutdown(self) -> None:
        self.actor.shutdown()

    def scheduler_snapshot(self) -> dict[str, int]:
        """Read from another thread without a lock: plain ints, at worst one step stale."""
        bm = self.actor.block_manager
        return {"waiting": self.actor.scheduler.num_waiting, "running": self.actor.scheduler.num_running,
                "blocks_used": bm.num_used_blocks, "blocks_free": bm.num_free_blocks, "blocks_total": bm.num_blocks}

    def memory(self) -> MemoryUse:
        runner = self.actor.runner
        return MemoryUse(runner.model_bytes, runner.kv_cache_bytes)

    def decode_stats(self) -> DecodeSnapshot:
        """Decode throughput and inter-token latency over the actor's rolling window, now."""
        return self.actor.decode_stats.snapshot(time.perf_counter())

    def stats(self) -> EngineStats:
        """The actor's totals and the KV pool's state, for /metrics (lock-free reads, like the snapshot)."""
        actor, bm = self.actor, self.actor.block_manager
        return EngineStats(self.scheduler_snapshot(), bm.usage, actor.counters, actor.scheduler.num_preemptions,
                           bm.stats, bm.num_cached_blocks, bm.num_blocks, self.memory())

    def responsive(self, stall_s: float = 30.0) -> bool:
        """The actor thread lives, and steps regularly while it has work."""
        if not self.actor.is_alive():
            return False
        busy = self.actor.scheduler.has_work()
        return not busy or time.monotonic() - self.actor.last_step_at < stall_s

    # -- requests --------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        return self.template.render(messages, tools=tools, add_generation_prompt=True, **(template_kwargs or {}))

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def choice_params(self, base: SamplingParams, n: int) -> list[SamplingParams]:
        """One SamplingParams per choice; choice i uses seed + i (u64 wrap); no seed -> a random one."""
        seed = base.seed if base.seed is not None else random.getrandbits(63)
        out = []
        for i in range(n):
            p = SamplingParams(**{**base.__dict__})
            p.seed = (seed + i) % (2**64)
            p.stop = list(base.stop)
            p.stop_token_ids = list(base.stop_token_ids or self.tokenizer.eos_token_ids)
            out.append(p)
        return out

    def admit(self, prompt_tokens: list[int]) -> Admission:
        """Take places for new work (one per request, holding its prompt tokens) or refuse it, before
        anything is queued: 429 `inference_queue_full` with Retry-After past either limit."""
        tickets = self.admission.admit(prompt_tokens)
        if isinstance(tickets, str):
            gate = self.admission
            what = (f"{gate.waiting} requests are waiting (the limit is {gate.max_waiting_requests})"
                    if tickets == "requests" else
                    f"{gate.queued_tokens} prompt tokens are queued (the limit is {gate.max_queued_tokens})")
            raise KilnError(429, "inference_queue_full", f"the server is at capacity: {what}",
                            hint=f"Retry after {RETRY_AFTER_SECS} s (the Retry-After header); the limits are "
                                 "[engine] max_waiting_requests and max_queued_prompt_tokens.",
                            headers={"Retry-After": str(RETRY_AFTER_SECS)})
        return Admission(self.admission, tickets)

    def submit(self, requests: list[GenerationRequest], admission: Admission | None = None
               ) -> AsyncIterator[tuple[int, ChoiceEvent]]:
        """The one way work reaches the actor: the requests join the running batch at the same step;
        events come back as (request index, event); leaving the iterator early aborts what still runs.
        With `admission` (from `admit`, one ticket per request), each request stops waiting at its first
        event and every place is given back when the iterator ends; without, the work is internal
        (eval jobs) and unbounded here."""
        if admission is None:
            return self._bridge.submit(requests)
        return self._admitted(requests, admission)

    async def _admitted(self, requests: list[GenerationRequest], admission: Admission
                        ) -> AsyncIterator[tuple[int, ChoiceEvent]]:
        try:
            async for i, ev in self._bridge.submit(requests):
                admission.started(i)
                yield i, ev
        finally:
            admission.release()

    def generate(self, prompt_ids: list[int], params: list[SamplingParams], request_id: str | None = None,
                 budgets: list | None = None, adapter: AdapterTarget | None = None) -> AsyncIterator[ChoiceEvent]:
        """`submit` for one request, yielding its events alone."""
        return self._bridge.generate(prompt_ids, params, request_id, budgets, adapter)

    async def score(self, token_ids: list[int], top_k: int, adapter: AdapterTarget | None = None) -> PromptScores:
        """Prompt log-probs from one dense forward, on the base model or under `adapter`."""
        return await self._bridge.score(token_ids, top_k, adapter)

    # -- completion lifecycle (kiln.engine.chat_response calls these) ---------------------------------
    def start_completion(self) -> None:
        self.in_flight += 1
        for obs in self.observers:
            obs.completion_started()

    def finish_completion(self, done: FinishedCompletion) -> None:
        """Every chat and batch completion ends here exactly once, whatever the outcome."""
        self.in_flight -= 1
        for obs in self.observers:
            try:
                obs.completion_finished(done)
            except Exception:  # noqa: BLE001 - an observer must never fail the request it observes
                log.exception("completion observer failed")

    def cpu_kernels(self) -> dict[str, Any] | None:
        """The C++ kernels' ISA in use, what the CPU offers and whether they run (None off the CPU)."""
        return kernels.isa_report() if self.info.device.startswith("cpu") else None

    @property
    def grammars(self) -> GrammarCompiler:
        """Output grammars (response_format, structured_outputs, tool_choice) are compiled here (compile
        counters) and matched on the actor (the runner counts masks and mid-generation failures)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.info.config.vocab_size,
                                             counters=self.grammar_counters())
        return self._grammars

    def grammar_counters(self) -> GrammarCounters:
        """Output grammars' totals for /metrics, one set: compiles and refusals (counted by `grammars`),
        masks and mid-generation failures (counted by the actor's runner)."""
        return self.actor.runner.grammar_counters

    def prompt_context(self) -> PromptContext:
        """What request preparation reads from this engine (kiln.engine.prompt_context), built once."""
        if self._prompt_context is None:
            self._prompt_context = PromptContext(
                info=self.info, render_chat=self.render_chat, encode_prompt=self.encode_prompt,
                decode=self.tokenizer.decode, choice_params=self.choice_params, resolve_adapter=self.resolve_adapter,
                adapter_store=lambda: self.adapters.store if self.adapters is not None else None,
                grammars=lambda: self.grammars, policy=self.policy, tool_tag_ids=self.tool_tag_ids,
                close_think_ids=self.close_think_ids, tool_format=tool_call_format(self.template.source))
        return self._prompt_context

    @property
    def tool_tag_ids(self) -> tuple[int, int] | None:
        """The ids of `<tool_call>` / `</tool_call>` where each is a token of its own (for tool grammars)."""
        ids = [self.tokenizer.encode(tag, add_special_tokens=False) for tag in (TAG_OPEN, TAG_CLOSE)]
        return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None

    @property
    def close_think_ids(self) -> list[int]:
        """The tokenizer's own encoding of `</think>` (one special token or several ordinary ones)."""
        return self.tokenizer.encode("</think>", add_special_tokens=False)


RETRY_AFTER_SECS = 1


class Admission:
    """The places one HTTP request holds in the admission gate; `release` is idempotent."""

    def __init__(self, gate: AdmissionGate, tickets: list[Ticket]) -> None:
        self.gate = gate
        self.tickets = tickets

    def started(self, index: int) -> None:
        self.gate.started(self.tickets[index])

    def release(self) -> None:
        for t in self.tickets:
            self.gate.done(t)


@dataclass
class MemoryUse:
    model_bytes: int
    kv_cache_bytes: int


@dataclass
class EngineStats:
    scheduler: dict[str, int]
    kv_usage: float
    counters: EngineCounters
    preemptions: int
    prefix_cache: PrefixCacheStats
    prefix_cached_blocks: int
    prefix_max_blocks: int
    memory: MemoryUse
