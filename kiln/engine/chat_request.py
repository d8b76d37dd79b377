"""Chat preparation: a validated chat request becomes engine work (the one request path's first half).

Chat, batch and the local eval generator all come through here, so a prompt is rendered, sampled,
clamped to the context and given its thinking-budget controllers one way. The wire layer turns its
pydantic models into a `ChatInput` (plain data); `prepare_chat` / `prepare_batch` check what needs the
served model -- read from a `PromptContext` (kiln.engine.prompt_context: model info, template, tokenizer,
grammar compiler, adapter resolution), never from `Engine` itself -- and return prepared requests whose
`work()` is exactly what `Engine.submit` runs.
Turning engine events back into choices and stream chunks is `kiln.engine.chat_response`.

Imports: core (sampling, thinking budget, reasoning/tool-call rules), the engine's own modules, store.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kiln.config import ServerSettings
from kiln.core.budget_controller import ThinkingBudgetController
from kiln.core.output_grammar import OutputGrammar, output_grammar
from kiln.core.sampling import SamplingParams, resolve_sampling, validate_sampling
from kiln.core.thinking_budget import (
    EffectiveBudget,
    applies,
    budget_record,
    check_budget_request,
    check_close_sequence,
    check_max_tokens_fits,
    check_stop_strings,
    resolve_budget,
)
from kiln.core.thinking_mode import detect_thinking_mode, effective_template_kwargs, thinking_source
from kiln.core.tool_calls import TAG_CLOSE, tool_parsing_enabled
from kiln.core.tool_grammar import tool_grammar
from kiln.engine.actor import GenerationRequest
from kiln.engine.grammar import CompiledGrammar, GrammarRefusal, gbnf_to_lark
from kiln.engine.lora_slots import AdapterTarget
from kiln.engine.model_selection import ModelSelection, select_model
from kiln.engine.prompt_context import PromptContext
from kiln.engine.provenance import MAX_STOP_BYTES, MAX_STOPS, MAX_TEMPLATE_KWARGS, PolicyIdentity
from kiln.engine.timing import RequestTimeline, now
from kiln.errors import KilnError
from kiln.store.names import validate_name

MAX_COMPOSE_ADAPTERS = 16
CHAT_CODE = "chat_invalid_request"


# ---- what the wire layer hands over ---------------------------------------------------------------

@dataclass
class AdapterSelection:
    """The request's `adapter` / `adapters` fields (semantics.md §4.7, §5.1)."""

    adapter: str | None = None
    adapters: list[Any] | None = None   # refs with .name and .scale
    adapter_given: bool = False         # the `adapter` key was present (even null)
    both_given: bool = False            # the endpoint's "not both" rule was broken
    model: str | None = None            # the request's `model`: the served id, or a stored adapter (vLLM)

    @property
    def explicit(self) -> bool:
        """`adapter` or `adapters` was sent: it wins over `model`."""
        return self.adapter_given or self.adapters is not None


@dataclass
class ChatInput:
    """One validated chat (or batch) request, as plain data. Sampling fields hold only what the request
    set; `None` flags fall back to the server settings."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # the output-constraint fields that were sent (response_format, structured_outputs, guided_*,
    # json_schema, grammar): kiln.core.output_grammar reads them
    output_fields: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    sampling_preset: str | None = None
    stop: list[str] = field(default_factory=list)       # as sent, empty strings included
    ignore_eos: bool = False
    n: int = 1
    chat_template_kwargs: dict[str, Any] | None = None
    budget_fields: dict[str, Any] = field(default_factory=dict)  # absent = inherit, null = unlimited
    budget: EffectiveBudget | None = None               # already resolved (evals); wins over budget_fields
    adapter: AdapterSelection = field(default_factory=AdapterSelection)
    fold_reasoning: bool | None = None
    include_performance: bool | None = None
    include_config_hashes: bool | None = None
    rollout_provenance: bool = False
    stream: bool = False
    include_usage: bool = False
    max_tokens_param: str = "max_tokens"
    # §4.5: a tools-bearing chat request stops after a call. The eval generator keeps the closing tag
    # in its raw completion text (the tool-call scorers read it), so it turns this off.
    stop_after_tool_call: bool = True
    code: str = CHAT_CODE
    prefix: str = ""

    @property
    def user_stops(self) -> list[str]:
        return [s for s in self.stop if s]


# ---- the pieces ---------------------------------------------------------------------------------

def select_request_model(ctx: PromptContext, selection: AdapterSelection) -> ModelSelection:
    """What `model` selects (kiln.engine.model_selection): nothing, or a stored adapter by name."""
    store = ctx.adapter_store()
    return select_model(selection.model, served_model_id=ctx.info.served_model_id, adapter_store=store,
                        explicit_adapter=selection.explicit)


def resolve_adapter(ctx: PromptContext, selection: AdapterSelection, *, prefix: str = "") -> AdapterTarget | None:
    """The adapter revision a request runs on (None = the base model): the one place that decides it.

    Rules: not both `adapter` and `adapters`; `adapters` not empty, at most 16, every name one safe path
    segment; with neither, a `model` naming a stored adapter selects it exactly as `adapter` would, and
    a `model` that is neither that nor the served id is 404 model_not_found; then the engine's resolver
    says whether the adapter exists and which revision it is.
    """
    adapter, adapters = selection.adapter, selection.adapters
    by_model = select_request_model(ctx, selection).adapter
    if by_model is not None:
        return ctx.resolve_adapter(adapter_given=True, adapter=by_model, adapters=None, param="model")
    if selection.both_given:
        raise KilnError(400, "invalid_compose_request", f"{prefix}give either adapter or adapters, not both",
                        param="adapters", hint="Send one adapter name, or an adapters list to compose.")
    if adapters is not None:
        if not adapters:
            raise KilnError(400, "invalid_compose_request", f"{prefix}adapters must list at least one adapter",
                            param="adapters", hint="Leave adapters out (or null) to use the base model.")
        if len(adapters) > MAX_COMPOSE_ADAPTERS:
            raise KilnError(400, "invalid_compose_request",
                            f"{prefix}adapters lists {len(adapters)} adapters; at most {MAX_COMPOSE_ADAPTERS} compose",
                            param="adapters", hint=f"Compose at most {MAX_COMPOSE_ADAPTERS} adapters.")
        for i, ref in enumerate(adapters):
            validate_name(ref.name, kind="adapter", param=f"adapters[{i}].name", code="invalid_adapter_name")
    elif adapter:
        validate_name(adapter, kind="adapter", param="adapter", code="invalid_adapter_name")
    return ctx.resolve_adapter(adapter_given=selection.adapter_given, adapter=adapter, adapters=adapters)


@dataclass
class RenderedPrompt:
    prompt_ids: list[int]
    thinking_enabled: bool


def render_prompt(ctx: PromptContext, messages: list[dict[str, Any]], tools: list[Any] | None,
                  kwargs: dict[str, Any], *, prefix: str) -> RenderedPrompt:
    try:
        prompt = ctx.render_chat(messages, tools=tools or None, template_kwargs=kwargs)
    except KilnError:
        raise
    except Exception as e:
        raise KilnError(400, "invalid_messages", f"{prefix}the chat template rejected the messages: {e}",
                        param="messages") from None
    return RenderedPrompt(ctx.encode_prompt(prompt), detect_thinking_mode(prompt).thinking_enabled)


def resolve_params(ctx: PromptContext, inp: ChatInput, settings: ServerSettings) -> SamplingParams:
    """Sampling resolved and validated (400 naming the field); stops and ignore_eos applied.
    max_tokens is not clamped to the context yet: that needs the prompt (`clamp_to_context`)."""
    params = resolve_sampling(
        inp.sampling, preset=inp.sampling_preset, qwen3_family=ctx.info.qwen3_family,
        has_tools=bool(inp.tools), model_defaults=ctx.info.generation_defaults, eval_mode=settings.eval_mode,
    )
    validate_sampling(params, code=inp.code)
    params.stop = inp.user_stops
    if inp.tools and inp.stop_after_tool_call:
        params.stop.append("</tool_call>")
    params.ignore_eos = inp.ignore_eos
    return params


def resolve_grammar(ctx: PromptContext, inp: ChatInput) -> CompiledGrammar | None:
    """The chat or batch request's output grammar, compiled (kiln.engine.grammar), or None for free text."""
    return compile_output_grammar(ctx, inp.output_fields, tools=inp.tools, tool_choice=inp.tool_choice,
                                  parallel_tool_calls=inp.parallel_tool_calls, stops=inp.user_stops,
                                  code=inp.code, prefix=inp.prefix)


def compile_output_grammar(ctx: PromptContext, fields: dict[str, Any], *, tools: list[Any] | None = None,
                           tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                           stops: list[str] | None = None, code: str, prefix: str = "") -> CompiledGrammar | None:
    """One grammar per request: response_format-like fields and a forcing tool_choice cannot both
    constrain it, and stop strings cannot cut a constrained output (the grammar decides where it ends).
    Every request with a grammar counts by kind, every refusal by reason (/metrics)."""
    counters = ctx.grammars().counters
    try:
        spec = output_grammar(fields, code=code, gbnf_to_lark=gbnf_to_lark)
        forced = tool_grammar(tools, tool_choice, parallel_tool_calls, code=code, tag_ids=ctx.tool_tag_ids,
                              fmt=ctx.tool_format)
        if spec is not None and forced is not None and forced.kind == "tool_call":
            raise KilnError(400, code, f"{prefix}{spec.param} and tool_choice both constrain the output; "
                            "give one", param=spec.param,
                            hint='Drop response_format, or use tool_choice "auto" / "none".')
        chosen: OutputGrammar | None = spec or forced
        if chosen is None:
            return None
        if stops:
            raise KilnError(400, code, f"{prefix}stop strings cannot be combined with {chosen.param}: "
                            "the output grammar decides where the output ends", param="stop",
                            hint="Drop stop, or express the end in the grammar.")
        compiled = ctx.grammars().compile(chosen, code=code)
    except GrammarRefusal as e:
        counters.refusals[e.reason] += 1
        raise
    except KilnError:
        counters.refusals["invalid_field"] += 1
        raise
    counters.requests[chosen.kind] += 1
    return compiled


def _grammar_params(params: SamplingParams, grammar: CompiledGrammar | None) -> None:
    """A forced tool call's grammar ends the output itself (after one or several calls): the stop on the
    closing tag, which would cut a parallel second call, goes."""
    if grammar is not None and grammar.spec.kind == "tool_call":
        params.stop = [s for s in params.stop if s != TAG_CLOSE]


def clamp_to_context(ctx: PromptContext, prompt_len: int, max_tokens: int, *, param: str = "messages") -> int:
    """§4.5: a prompt at or past the context ceiling is a 400; otherwise max_tokens fits the room left."""
    ceiling = ctx.info.max_model_len
    if prompt_len >= ceiling:
        raise KilnError(
            400, "context_length_exceeded",
            f"This model's maximum context length is {ceiling} tokens. However, your messages resulted in "
            f"{prompt_len} tokens (plus {max_tokens} for max_tokens).",
            param=param, hint="Shorten the conversation or start a new one.",
        )
    return min(max_tokens, ceiling - prompt_len)


def budget_controllers(close_ids: list[int], budget: EffectiveBudget,
                       params: list[SamplingParams]) -> list[ThinkingBudgetController | None]:
    """One thinking-budget controller per choice (the only place they are built)."""
    return [ThinkingBudgetController(close_ids, max_thinking_tokens=budget.max_tokens,
                                     max_time_ms=budget.max_time_ms, max_completion_tokens=p.max_tokens)
            for p in params]


def _resolved_budget(inp: ChatInput, settings: ServerSettings) -> EffectiveBudget:
    return inp.budget if inp.budget is not None else resolve_budget(inp.budget_fields, settings, code=inp.code)


def _flag(request_value: bool | None, server_value: bool) -> bool:
    return server_value if request_value is None else request_value


# ---- one chat request ---------------------------------------------------------------------------

@dataclass
class PreparedChat:
    inp: ChatInput
    prompt_ids: list[int]
    params: list[SamplingParams]
    thinking_enabled: bool
    thinking_source: str
    default_thinking_enabled: bool | None
    budget: EffectiveBudget
    budget_applies: bool
    close_ids: list[int]
    fold: bool
    parse_tools: bool
    model_id: str
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    timeline: RequestTimeline = field(default_factory=lambda: RequestTimeline(now()))
    include_performance: bool = False
    include_config_hashes: bool = False
    policy: PolicyIdentity | None = None
    adapter: AdapterTarget | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    client_request_id: str | None = None   # the client's X-Request-Id (kiln.traffic.records)
    grammar: CompiledGrammar | None = None
    grammar_gate: list[int] | None = None   # a thinking prompt's grammar starts after these ids

    def controllers(self) -> list[ThinkingBudgetController | None] | None:
        return budget_controllers(self.close_ids, self.budget, self.params) if self.budget_applies else None

    def work(self) -> GenerationRequest:
        """What the engine runs: prompt ids, one SamplingParams per choice, controllers, adapter."""
        return GenerationRequest(self.prompt_ids, self.params, self.controllers(), self.id, self.adapter,
                                 self.grammar, self.grammar_gate)

    def budget_record(self, outcome: dict[str, Any] | None) -> dict[str, Any]:
        return budget_record(self.budget, applied=self.budget_applies, outcome=outcome)

    def budget_limits(self) -> dict[str, int] | None:
        if not self.budget_applies:
            return None
        limits = {"max_tokens": self.budget.max_tokens, "max_time_ms": self.budget.max_time_ms}
        return {k: v for k, v in limits.items() if v is not None}

    @property
    def adapter_label(self) -> str:
        return self.adapter.label if self.adapter else "base"


_UNRESOLVED: Any = object()


def prepare_chat(ctx: PromptContext, inp: ChatInput, settings: ServerSettings, *, started: float | None = None,
                 request_id: str | None = None, target: AdapterTarget | None = _UNRESOLVED) -> PreparedChat:
    """Everything a chat request needs before the engine runs it; `target` skips adapter resolution
    for a caller that resolved it already (the eval generator reports adapter failures apart)."""
    timeline = RequestTimeline(started if started is not None else now())
    if target is _UNRESOLVED:
        target = resolve_adapter(ctx, inp.adapter, prefix=inp.prefix)
    kwargs = effective_template_kwargs(inp.chat_template_kwargs,
                                       default_thinking_enabled=settings.default_thinking_enabled)
    grammar = resolve_grammar(ctx, inp)   # a field the grammar cannot use is a 400 before any rendering
    t0 = now()
    rendered = render_prompt(ctx, inp.messages, inp.tools, kwargs, prefix=inp.prefix)
    timeline.tokenization_ms = (now() - t0) * 1000.0
    params = resolve_params(ctx, inp, settings)
    params.max_tokens = clamp_to_context(ctx, len(rendered.prompt_ids), params.max_tokens)
    _grammar_params(params, grammar)
    budget = _resolved_budget(inp, settings)
    close_ids = ctx.close_think_ids
    budget_applies = check_budget_request(budget, thinking_enabled=rendered.thinking_enabled,
                                          max_tokens=params.max_tokens, stops=inp.stop, close_ids=close_ids,
                                          close_decoded=ctx.decode(close_ids), code=inp.code)
    policy = _check_rollout(ctx, inp, params, kwargs, target) if inp.rollout_provenance else None
    prep = PreparedChat(
        inp, rendered.prompt_ids, ctx.choice_params(params, inp.n), rendered.thinking_enabled,
        thinking_source(inp.chat_template_kwargs, default_thinking_enabled=settings.default_thinking_enabled),
        settings.default_thinking_enabled, budget, budget_applies, close_ids,
        _flag(inp.fold_reasoning, settings.fold_reasoning_into_content),
        tool_parsing_enabled(inp.tools, inp.tool_choice), select_request_model(ctx, inp.adapter).model_id,
        template_kwargs=kwargs, timeline=timeline,
        include_performance=_flag(inp.include_performance, settings.chat_performance_metadata),
        include_config_hashes=_flag(inp.include_config_hashes, settings.chat_config_hash_metadata),
        policy=policy, adapter=target, grammar=grammar,
        grammar_gate=ctx.close_think_ids if grammar is not None and rendered.thinking_enabled else None,
    )
    if request_id is not None:
        prep.id = request_id
    return prep


def _check_rollout(ctx: PromptContext, inp: ChatInput, params: SamplingParams, kwargs: dict[str, Any],
                   target: AdapterTarget | None) -> PolicyIdentity:
    """§6.1 preconditions that need the served model and the resolved request."""
    def bad(message: str, param: str, hint: str) -> KilnError:
        return KilnError(400, inp.code, inp.prefix + message, param=param, hint=hint)

    policy = ctx.policy()
    if policy is None:
        raise bad("rollout_provenance needs a content-addressed base-model identity, which this server lacks",
                  "rollout_provenance", "Drop rollout_provenance.")
    if params.max_tokens < 1:
        raise bad("rollout_provenance needs room for at least one completion token", "max_tokens",
                  "Shorten the prompt or raise max_tokens.")
    stops = params.stop
    if len(stops) > MAX_STOPS or sum(len(s.encode()) for s in stops) > MAX_STOP_BYTES:
        raise bad(f"rollout_provenance allows at most {MAX_STOPS} stop sequences of {MAX_STOP_BYTES} bytes in all",
                  "stop", "Send fewer or shorter stop sequences.")
    if len(kwargs) > MAX_TEMPLATE_KWARGS or any(not 1 <= len(k.encode()) <= 256 for k in kwargs):
        raise bad(f"rollout_provenance allows at most {MAX_TEMPLATE_KWARGS} chat_template_kwargs with keys of "
                  "1-256 bytes", "chat_template_kwargs", "Send fewer template arguments.")
    if target is not None:
        if len(target.key) != 1:
            raise bad("rollout_provenance records one saved adapter; a composition has no single adapter identity",
                      "adapters", "Use one adapter, or drop rollout_provenance.")
        name, _, sha = target.key[0]
        policy = dataclasses.replace(policy, adapter=(name, sha))
    return policy


# ---- a batch: many prompts x n choices ------------------------------------------------------------

@dataclass
class PromptPlan:
    """One prompt of a batch ready to run, or the reason it cannot."""

    index: int
    prompt_ids: list[int]
    thinking_enabled: bool = False
    max_tokens: int = 0
    budget_applies: bool = False
    error: str | None = None
    params: list[SamplingParams] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)   # the conversation, for the records


@dataclass
class PreparedBatch:
    inp: ChatInput
    plans: list[PromptPlan]
    budget: EffectiveBudget
    close_ids: list[int]
    parse_tools: bool
    fold: bool
    model_id: str
    adapter: AdapterTarget | None = None
    grammar: CompiledGrammar | None = None
    started_at: float = field(default_factory=now)
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: "batchcmpl-" + uuid.uuid4().hex)
    client_request_id: str | None = None

    @property
    def runnable(self) -> list[PromptPlan]:
        return [pl for pl in self.plans if pl.error is None]

    def work(self) -> list[GenerationRequest]:
        """One engine request per runnable prompt, in prompt order, submitted together."""
        return [GenerationRequest(pl.prompt_ids, pl.params,
                                  budget_controllers(self.close_ids, self.budget, pl.params)
                                  if pl.budget_applies else None, adapter=self.adapter, grammar=self.grammar,
                                  grammar_gate=self.close_ids if self.grammar is not None and pl.thinking_enabled
                                  else None)
                for pl in self.runnable]


def prepare_batch(ctx: PromptContext, inp: ChatInput, prompts: list[list[dict[str, Any]]], settings: ServerSettings,
                  *, started: float | None = None) -> PreparedBatch:
    """§5.1: every prompt rendered and checked; one that cannot run fails alone (its `error` is set).
    Completion (p, c) samples with seed + p*n + c."""
    target = resolve_adapter(ctx, inp.adapter, prefix=inp.prefix)
    params = resolve_params(ctx, inp, settings)
    grammar = resolve_grammar(ctx, inp)
    _grammar_params(params, grammar)
    budget = _resolved_budget(inp, settings)
    kwargs = effective_template_kwargs(inp.chat_template_kwargs,
                                       default_thinking_enabled=settings.default_thinking_enabled)
    plans = _plan_prompts(ctx, inp, prompts, params, budget, kwargs)
    n = inp.n
    seed = params.seed if params.seed is not None else _random_seed()
    for pl in plans:
        if pl.error is None:
            base = dataclasses.replace(params, stop=list(params.stop), max_tokens=pl.max_tokens,
                                       seed=(seed + pl.index * n) % 2**64)
            pl.params = ctx.choice_params(base, n)
    batch = PreparedBatch(inp, plans, budget, ctx.close_think_ids, tool_parsing_enabled(inp.tools, inp.tool_choice),
                          settings.fold_reasoning_into_content, select_request_model(ctx, inp.adapter).model_id,
                          target, grammar)
    if started is not None:
        batch.started_at = started
    return batch


def _random_seed() -> int:
    import random

    return random.getrandbits(63)


def _plan_prompts(ctx: PromptContext, inp: ChatInput, prompts: list[list[dict[str, Any]]], params: SamplingParams,
                  budget: EffectiveBudget, kwargs: dict[str, Any]) -> list[PromptPlan]:
    plans = []
    for p, messages in enumerate(prompts):
        plan = PromptPlan(p, [], messages=messages)
        try:
            rendered = render_prompt(ctx, messages, inp.tools, kwargs, prefix=inp.prefix)
            plan.prompt_ids, plan.thinking_enabled = rendered.prompt_ids, rendered.thinking_enabled
            plan.max_tokens = clamp_to_context(ctx, len(rendered.prompt_ids), params.max_tokens,
                                               param=f"prompts[{p}]")
        except KilnError as e:
            plan.error = e.message
        plans.append(plan)
    close_ids = ctx.close_think_ids
    runnable = [pl for pl in plans if pl.error is None]
    if any(applies(budget, thinking_enabled=pl.thinking_enabled, max_tokens=pl.max_tokens) for pl in runnable):
        # request-wide §2.3 checks: the same stops and max_tokens go to every prompt
        check_stop_strings(inp.stop, code=inp.code)
        check_close_sequence(close_ids, ctx.decode(close_ids), param=budget.limiting_param,
                             code=inp.code)
        check_max_tokens_fits(params.max_tokens, len(close_ids), param=inp.max_tokens_param, code=inp.code)
    for pl in runnable:
        pl.budget_applies = applies(budget, thinking_enabled=pl.thinking_enabled, max_tokens=pl.max_tokens)
        if pl.budget_applies and pl.max_tokens < len(close_ids):
            pl.error = (f"the room left in the context ({pl.max_tokens} tokens) cannot fit the "
                        f"{len(close_ids)}-token reasoning close sequence")
    return plans
