"""POST /v1/chat/completions: validate, call the engine, serialize (JSON or SSE).

The pieces the batch endpoint shares live here too: prompt rendering, sampling resolution with the
context clamp, and turning a choice's raw text into content / reasoning / tool calls.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from kiln.api.errors import parse_model, read_json_body
from kiln.api.routers.metrics import KilnMetrics, metrics_for, status_of
from kiln.api.state import ServerState, get_state
from kiln.api.wire.chat import PREFIX, ChatCompletionRequest
from kiln.api.wire.common import GenerationFields, check_adapter_selection
from kiln.config import ServerSettings
from kiln.core.budget_controller import ThinkingBudgetController
from kiln.core.chat_metadata import chat_metadata
from kiln.core.reasoning import ReasoningStreamSplitter, fold_reasoning, resolve_fold, split_reasoning
from kiln.core.sampling import SamplingParams, resolve_sampling, validate_sampling
from kiln.core.thinking_budget import EffectiveBudget, budget_record, check_budget_request, resolve_budget
from kiln.core.thinking_mode import detect_thinking_mode, effective_template_kwargs, thinking_source
from kiln.core.tool_call_stream import ToolCallStreamParser
from kiln.core.tool_calls import parse_tool_calls, tool_parsing_enabled
from kiln.engine.engine import ChoiceEvent
from kiln.engine.lora_slots import AdapterTarget
from kiln.engine.provenance import (
    MAX_STOP_BYTES,
    MAX_STOPS,
    MAX_TEMPLATE_KWARGS,
    PolicyIdentity,
    provenance_problems,
    rollout_provenance,
)
from kiln.engine.records import (
    CANCELLED,
    ChoiceRecord,
    CompletionRecord,
    adapter_identity,
    recent_budget,
    thinking_mode,
)
from kiln.engine.serving import ServingEngine, sampling_dict
from kiln.engine.timing import RequestTimeline, now, performance_metadata
from kiln.errors import KilnError

log = logging.getLogger("kiln.api")
router = APIRouter(tags=["inference"])


def require_engine(request: Request) -> ServingEngine:
    engine = get_state(request).engine
    if engine is None:
        raise KilnError(503, "model_loading", "the model is still loading", hint="Retry when GET /health answers 200.",
                        headers={"Retry-After": "5"})
    return engine


def response_headers(state: ServerState) -> dict[str, str]:
    """semantics.md §4.6: eval mode and the adapter state, on every chat response."""
    active = state.services.get("adapters_active")
    name = getattr(active, "name", None)
    revision = getattr(active, "revision", None)
    return {
        "x-kiln-eval-mode": "true" if state.settings.server.eval_mode else "false",
        "x-kiln-active-adapter": name or "base",
        "x-kiln-loaded-adapter": name or "base",
        "x-kiln-loaded-adapter-revision": revision or "base",
    }


# ---- shared with the batch endpoint ------------------------------------------------------------------

@dataclass
class RenderedPrompt:
    prompt_ids: list[int]
    thinking_enabled: bool


def render_prompt(engine: ServingEngine, messages: list[dict[str, Any]], tools: list[Any] | None,
                  kwargs: dict[str, Any], *, prefix: str) -> RenderedPrompt:
    try:
        prompt = engine.render_chat(messages, tools=tools or None, template_kwargs=kwargs)
    except KilnError:
        raise
    except Exception as e:
        raise KilnError(400, "invalid_messages", f"{prefix}the chat template rejected the messages: {e}",
                        param="messages") from None
    return RenderedPrompt(engine.encode_prompt(prompt), detect_thinking_mode(prompt).thinking_enabled)


def resolve_params(engine: ServingEngine, req: GenerationFields, settings: ServerSettings, *,
                   code: str) -> SamplingParams:
    """Sampling resolved and validated (400 naming the field); stops and ignore_eos applied.
    max_tokens is not clamped to the context yet: that needs the prompt (`clamp_to_context`)."""
    params = resolve_sampling(
        req.explicit_sampling(), preset=req.sampling_preset, qwen3_family=engine.info.qwen3_family,
        has_tools=bool(req.tools), model_defaults=engine.info.generation_defaults, eval_mode=settings.eval_mode,
    )
    validate_sampling(params, code=code)
    params.stop = req.stop_list()
    if req.tools:
        params.stop.append("</tool_call>")  # §4.5: tools-bearing requests stop after a call
    params.ignore_eos = req.ignore_eos
    return params


def clamp_to_context(engine: ServingEngine, prompt_len: int, max_tokens: int, *, param: str = "messages") -> int:
    """§4.5: a prompt at or past the context ceiling is a 400; otherwise max_tokens fits the room left."""
    ceiling = engine.info.max_model_len
    if prompt_len >= ceiling:
        raise KilnError(
            400, "context_length_exceeded",
            f"This model's maximum context length is {ceiling} tokens. However, your messages resulted in "
            f"{prompt_len} tokens (plus {max_tokens} for max_tokens).",
            param=param, hint="Shorten the conversation or start a new one.",
        )
    return min(max_tokens, ceiling - prompt_len)


@dataclass
class FinalText:
    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str


def final_text(text: str, finish: str, *, thinking_enabled: bool, parse_tools: bool, tools: list[Any] | None,
               tool_choice: Any) -> FinalText:
    reasoning, content = split_reasoning(text, thinking_enabled)
    calls: list[dict[str, Any]] = []
    if parse_tools:
        parsed = parse_tool_calls(content, reasoning, tools=tools, tool_choice=tool_choice)
        content, reasoning, calls = parsed.content, parsed.reasoning, parsed.tool_calls
    return FinalText(content, reasoning, calls, "tool_calls" if calls else finish)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class ChoiceOutput:
    """Everything the engine said about one choice."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)
    finish_reason: str = "stop"
    outcome: dict[str, Any] | None = None
    error: str | None = None

    def add(self, ev: ChoiceEvent) -> None:
        self.text += ev.text
        self.token_ids += ev.token_ids
        self.logprobs += ev.logprobs
        self.forced += ev.forced or [False] * len(ev.token_ids)
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
            self.outcome = ev.budget_outcome
            self.error = ev.error


# ---- chat ----------------------------------------------------------------------------------------

@dataclass
class PreparedChat:
    req: ChatCompletionRequest
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
    user_stops: list[str] = field(default_factory=list)
    timeline: RequestTimeline = field(default_factory=lambda: RequestTimeline(now()))
    include_performance: bool = False
    include_config_hashes: bool = False
    policy: PolicyIdentity | None = None
    adapter: AdapterTarget | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)

    def controllers(self) -> list[ThinkingBudgetController | None] | None:
        if not self.budget_applies:
            return None
        return [ThinkingBudgetController(self.close_ids, max_thinking_tokens=self.budget.max_tokens,
                                         max_time_ms=self.budget.max_time_ms, max_completion_tokens=p.max_tokens)
                for p in self.params]

    def budget_record(self, outcome: dict[str, Any] | None) -> dict[str, Any]:
        return budget_record(self.budget, applied=self.budget_applies, outcome=outcome)

    def budget_limits(self) -> dict[str, int] | None:
        if not self.budget_applies:
            return None
        limits = {"max_tokens": self.budget.max_tokens, "max_time_ms": self.budget.max_time_ms}
        return {k: v for k, v in limits.items() if v is not None}


def prepare_chat(engine: ServingEngine, req: ChatCompletionRequest, settings: ServerSettings, *,
                 started: float | None = None) -> PreparedChat:
    timeline = RequestTimeline(started if started is not None else now())
    adapter, adapters, both = req.adapter_fields()
    check_adapter_selection(adapter, adapters, both_given=both, prefix=PREFIX)
    target = engine.resolve_adapter(adapter_given="adapter" in req.model_fields_set, adapter=adapter,
                                    adapters=adapters)
    kwargs = effective_template_kwargs(req.chat_template_kwargs,
                                       default_thinking_enabled=settings.default_thinking_enabled)
    t0 = now()
    rendered = render_prompt(engine, req.message_dicts(), req.tools, kwargs, prefix=PREFIX)
    timeline.tokenization_ms = (now() - t0) * 1000.0
    params = resolve_params(engine, req, settings, code="chat_invalid_request")
    params.max_tokens = clamp_to_context(engine, len(rendered.prompt_ids), params.max_tokens)
    budget = resolve_budget(req.budget_fields(), settings)
    close_ids = engine.close_think_ids
    applies = check_budget_request(budget, thinking_enabled=rendered.thinking_enabled, max_tokens=params.max_tokens,
                                   stops=req.stop_list(keep_empty=True), close_ids=close_ids,
                                   close_decoded=engine.tokenizer.decode(close_ids))
    policy = _check_rollout(engine, req, params, kwargs) if req.rollout_provenance else None
    if policy is not None and target is not None:
        if len(target.key) != 1:
            raise KilnError(400, "chat_invalid_request", PREFIX + "rollout_provenance records one saved adapter; "
                            "a composition has no single adapter identity", param="adapters",
                            hint="Use one adapter, or drop rollout_provenance.")
        name, _, sha = target.key[0]
        policy = dataclasses.replace(policy, adapter=(name, sha))
    return PreparedChat(
        req, rendered.prompt_ids, engine.choice_params(params, req.n or 1), rendered.thinking_enabled,
        thinking_source(req.chat_template_kwargs, default_thinking_enabled=settings.default_thinking_enabled),
        settings.default_thinking_enabled, budget, applies, close_ids,
        resolve_fold(req.fold_reasoning_into_content, settings.fold_reasoning_into_content),
        tool_parsing_enabled(req.tools, req.tool_choice), engine.info.served_model_id,
        template_kwargs=kwargs, user_stops=req.stop_list(), timeline=timeline,
        include_performance=_flag(req.include_performance, settings.chat_performance_metadata),
        include_config_hashes=_flag(req.include_config_hashes, settings.chat_config_hash_metadata),
        policy=policy, adapter=target,
    )


def _flag(request_value: bool | None, server_value: bool) -> bool:
    return server_value if request_value is None else request_value


def _check_rollout(engine: ServingEngine, req: ChatCompletionRequest, params: SamplingParams,
                   kwargs: dict[str, Any]) -> PolicyIdentity:
    """§6.1 preconditions that need the served model and the resolved request."""
    def bad(message: str, param: str, hint: str) -> KilnError:
        return KilnError(400, "chat_invalid_request", PREFIX + message, param=param, hint=hint)

    policy = engine.policy()
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
    return policy


def metadata_for(prep: PreparedChat, final: FinalText, outcome: dict[str, Any] | None) -> dict[str, Any]:
    return chat_metadata(
        thinking_enabled=prep.thinking_enabled, thinking_source=prep.thinking_source,  # type: ignore[arg-type]
        default_thinking_enabled=prep.default_thinking_enabled, content=final.content, reasoning=final.reasoning,
        tool_calls=final.tool_calls, fold=prep.fold, thinking_budget=prep.budget_record(outcome),
    )


def _performance(prep: PreparedChat, completion_tokens: int, finish: str) -> dict[str, Any]:
    total_ms = (now() - prep.timeline.started_at) * 1000.0
    return performance_metadata(
        prep.timeline, prompt_tokens=len(prep.prompt_ids), completion_tokens=completion_tokens, total_ms=total_ms,
        adapter_used=prep.adapter.label if prep.adapter else "base", thinking_mode="reasoning" if prep.thinking_enabled else "non_reasoning",
        finish_reason=finish,
    )


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    started = now()
    state = get_state(request)
    metrics = metrics_for(state)
    request_id = client_request_id(request)
    req: ChatCompletionRequest | None = None
    try:
        body = await read_json_body(request, code="chat_invalid_request", prefix=PREFIX)
        req = parse_model(ChatCompletionRequest, body, code="chat_invalid_request", prefix=PREFIX)
        engine = require_engine(request)
        prep = prepare_chat(engine, req, state.settings.server, started=started)
    except KilnError as e:
        if metrics is not None:
            metrics.finished(status_of(e.status), now() - started)
        if req is not None:
            _record_rejected(state, req, request_id, started, e)
        raise
    headers = {**response_headers(state), "x-request-id": request_id}
    served = ServedChat(request_id, req.stream or False)
    if req.stream:
        return EventSourceResponse(_stream(engine, prep, metrics, state, served), ping=15, sep="\n",
                                   headers=headers)
    status = "error"
    try:
        if metrics is not None:
            with metrics.in_flight():
                result = await _complete(engine, prep, metrics, served.outs)
        else:
            result = await _complete(engine, prep, metrics, served.outs)
        status = "ok"
    except KilnError as e:
        status = status_of(e.status)
        served.error = e.message
        raise
    except Exception as e:
        served.error = f"{type(e).__name__}: {e}"   # a bug: a 500 to the client, an error in the record
        raise
    except BaseException:
        served.cancelled = True   # the client went away: the handler's task was cancelled
        raise
    finally:
        if metrics is not None:
            metrics.finished(status, now() - started)
        _record_chat(state, prep, served, status)
    return JSONResponse(result, headers=headers)


async def _complete(engine: ServingEngine, prep: PreparedChat, metrics: KilnMetrics | None,
                    outs: list[ChoiceOutput]) -> dict[str, Any]:
    n = len(prep.params)
    outs.extend(ChoiceOutput() for _ in range(n))
    async for ev in engine.generate(prep.prompt_ids, prep.params, prep.id, prep.controllers(), prep.adapter):
        if ev.error:
            raise KilnError(500, "generation_error", f"generation failed: {ev.error}")
        outs[ev.index].add(ev)
        if ev.index == 0:
            prep.timeline.on_event(ev)
    choices = []
    finals = []
    for i, out in enumerate(outs):
        final = final_text(out.text, out.finish_reason, thinking_enabled=prep.thinking_enabled,
                           parse_tools=prep.parse_tools, tools=prep.req.tools, tool_choice=prep.req.tool_choice)
        finals.append(final)
        content = fold_reasoning(final.reasoning, final.content) if prep.fold else final.content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if final.reasoning:
            message["reasoning_content"] = final.reasoning
        if final.tool_calls:
            message["tool_calls"] = final.tool_calls
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": final.finish_reason}
        if out.outcome is not None:
            choice["thinking_budget"] = out.outcome
        if prep.policy is not None:
            choice["rollout_provenance"] = _provenance(prep, out, content)
        choices.append(choice)
    completion_tokens = sum(len(o.token_ids) for o in outs)
    metadata = metadata_for(prep, finals[0], outs[0].outcome)
    if prep.include_config_hashes and engine.config_hashes() is not None:
        metadata["config_hashes"] = engine.config_hashes()
    prep.timeline.finished_at = now()
    if prep.include_performance:
        metadata["performance"] = _performance(prep, completion_tokens, finals[0].finish_reason)
    if metrics is not None:
        metrics.observe_timeline(prep.timeline)
        metrics.observe_budget(prep.budget_record(None), [o.outcome for o in outs])
    return {
        "id": prep.id, "object": "chat.completion", "created": prep.created, "model": prep.model_id,
        "choices": choices, "usage": usage(len(prep.prompt_ids), completion_tokens), "metadata": metadata,
    }


def _provenance(prep: PreparedChat, out: ChoiceOutput, content: str) -> dict[str, Any]:
    assert prep.policy is not None
    record = rollout_provenance(
        policy=prep.policy, prompt_ids=prep.prompt_ids, token_ids=out.token_ids, logprobs=out.logprobs,
        forced=out.forced, messages=prep.req.message_dicts(), response_text=content,
        template_kwargs=prep.template_kwargs, params=prep.params[0], stops=prep.user_stops,
        budget_limits=prep.budget_limits(), close_ids=prep.close_ids,
    )
    problems = provenance_problems(record)
    if problems:
        raise KilnError(500, "generation_error", "cannot emit rollout provenance for this completion: "
                        + "; ".join(problems), param="rollout_provenance",
                        hint="Retry with a larger max_tokens or without a thinking budget.")
    return record


def _chunk(prep: PreparedChat, choices: list[dict[str, Any]], **extra: Any) -> str:
    body = {"id": prep.id, "object": "chat.completion.chunk", "created": prep.created, "model": prep.model_id,
            "choices": choices, **extra}
    return json.dumps(body, ensure_ascii=False)


def _delta(prep: PreparedChat, **delta: Any) -> dict[str, str]:
    return {"data": _chunk(prep, [{"index": 0, "delta": delta}])}


async def _stream(engine: ServingEngine, prep: PreparedChat, metrics: KilnMetrics | None, state: ServerState,
                  served: ServedChat) -> AsyncIterator[dict[str, str]]:
    status: str | None = "error"
    try:
        if metrics is not None:
            with metrics.in_flight():
                async for item in _stream_events(engine, prep, metrics, served):
                    yield item
        else:
            async for item in _stream_events(engine, prep, metrics, served):
                yield item
        status = "ok"
    except KilnError as e:
        status = status_of(e.status)
        served.error = e.message
        yield {"data": json.dumps(e.to_body())}
        yield {"data": "[DONE]"}
    except Exception as e:  # noqa: BLE001 - a stream has no status code left to change
        log.exception("stream failed")
        served.error = f"generation failed: {e}"
        yield {"data": json.dumps(KilnError(500, "generation_error", f"generation failed: {e}").to_body())}
        yield {"data": "[DONE]"}
    except BaseException:
        status = None  # the client went away: neither a success nor a server failure, so not counted
        served.cancelled = True
        raise
    finally:
        if metrics is not None and status is not None:
            metrics.finished(status, now() - prep.timeline.started_at)
        _record_chat(state, prep, served, status or "error")


async def _stream_events(engine: ServingEngine, prep: PreparedChat, metrics: KilnMetrics | None,
                         served: ServedChat) -> AsyncIterator[dict[str, str]]:
    include_usage = bool(prep.req.stream_options and prep.req.stream_options.include_usage)
    # per-token timing events only when the request itself asks (semantics.md §4.8)
    timing = prep.req.include_performance is True
    yield _delta(prep, role="assistant", content="")
    splitter = ReasoningStreamSplitter(prep.thinking_enabled)
    tools = ToolCallStreamParser(prep.req.tools) if prep.parse_tools else None
    reasoning_all = ""
    out = ChoiceOutput()
    served.outs.append(out)

    def pieces(delta) -> list[dict[str, str]]:
        nonlocal reasoning_all
        found = []
        if delta.reasoning:
            reasoning_all += delta.reasoning
            found.append(_delta(prep, reasoning_content=delta.reasoning))
        if delta.content:
            if tools is None:
                found.append(_delta(prep, content=delta.content))
            else:
                found.extend(tool_pieces(tools.feed(delta.content)))
        return found

    def tool_pieces(td) -> list[dict[str, str]]:
        found = []
        if td.content:
            found.append(_delta(prep, content=td.content))
        if td.tool_calls:
            found.append(_delta(prep, tool_calls=td.tool_calls))
        return found

    async for ev in engine.generate(prep.prompt_ids, prep.params, prep.id, prep.controllers(), prep.adapter):
        if ev.error:
            raise KilnError(500, "generation_error", f"generation failed: {ev.error}")
        out.add(ev)
        records = prep.timeline.on_event(ev)
        if ev.text:
            for piece in pieces(splitter.feed(ev.text)):
                yield piece
        for rec in records:
            rec.enqueued_at = now()
            if timing:
                yield {"data": json.dumps(prep.timeline.token_timing_event(rec))}
    for piece in pieces(splitter.flush()):
        yield piece
    finish = out.finish_reason
    if tools is not None:
        for piece in tool_pieces(tools.finish(reasoning_all or None)):
            yield piece
        if tools.tool_calls:
            finish = "tool_calls"
    prep.timeline.finished_at = now()
    metadata: dict[str, Any] = {"thinking_budget": prep.budget_record(out.outcome)}
    if timing:
        metadata["performance"] = _performance(prep, len(out.token_ids), finish)
    if metrics is not None:
        metrics.observe_timeline(prep.timeline)
        metrics.observe_budget(prep.budget_record(None), [out.outcome])
    yield {"data": _chunk(prep, [{"index": 0, "delta": {}, "finish_reason": finish}], metadata=metadata)}
    if include_usage:
        yield {"data": _chunk(prep, [], usage=usage(len(prep.prompt_ids), len(out.token_ids)))}
    yield {"data": "[DONE]"}


# ---- recording what was served (kiln.engine.records) ---------------------------------------------------
# The one place the chat route hands a finished request to the recorder; it moves with the request
# path when preparation and assembly move engine-side.

@dataclass
class ServedChat:
    request_id: str
    streamed: bool
    outs: list[ChoiceOutput] = field(default_factory=list)
    error: str | None = None
    cancelled: bool = False


def client_request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "").strip()
    return given[:128] if given else "req-" + uuid.uuid4().hex


def _recorder(state: ServerState) -> Any:
    return state.services.get("recorder")


def _record_chat(state: ServerState, prep: PreparedChat, served: ServedChat, status: str) -> None:
    recorder = _recorder(state)
    if recorder is None:
        return
    choices = []
    for i, out in enumerate(served.outs):
        final = final_text(out.text, out.finish_reason, thinking_enabled=prep.thinking_enabled,
                           parse_tools=prep.parse_tools, tools=prep.req.tools, tool_choice=prep.req.tool_choice)
        content = fold_reasoning(final.reasoning, final.content) if prep.fold else final.content
        choices.append(ChoiceRecord(i, content, final.finish_reason, len(out.token_ids), final.reasoning,
                                    final.tool_calls or None))
    finished = bool(choices) and not served.cancelled and status == "ok"
    finish = choices[0].finish_reason if finished else (CANCELLED if served.cancelled else "error")
    outcome = served.outs[0].outcome if served.outs and finished else None
    timeline = prep.timeline
    recorder.finished(CompletionRecord(
        id=prep.id, request_id=served.request_id, kind="chat", model=prep.model_id,
        status=CANCELLED if served.cancelled else status, finish_reason=finish, created=prep.created,
        adapter=prep.adapter.label if prep.adapter else "base", adapters=adapter_identity(prep.adapter),
        messages=prep.req.message_dicts(), tools=prep.req.tools, choices=choices,
        sampling={**sampling_dict(prep.params[0]), "n": len(prep.params), "stop": list(prep.user_stops)},
        prompt_tokens=len(prep.prompt_ids), completion_tokens=sum(c.completion_tokens for c in choices),
        duration_ms=(now() - timeline.started_at) * 1000.0, ttft_ms=timeline.ttft_ms(), streamed=served.streamed,
        error=served.error if status != "ok" else None,
        thinking_budget=recent_budget(prep.budget.to_dict(), prep.budget_applies, outcome),
        thinking_mode=thinking_mode(prep.req.chat_template_kwargs),
    ))


def _record_rejected(state: ServerState, req: ChatCompletionRequest, request_id: str, started: float,
                     err: KilnError) -> None:
    """A parsed request that failed before it ran: no tokens, and the budget as far as it resolved."""
    recorder = _recorder(state)
    if recorder is None:
        return
    try:
        budget: dict[str, Any] | None = recent_budget(resolve_budget(req.budget_fields(),
                                                                     state.settings.server).to_dict())
    except KilnError:
        budget = None  # the budget fields themselves were the problem
    engine = state.engine
    recorder.finished(CompletionRecord(
        id="chatcmpl-" + uuid.uuid4().hex, request_id=request_id, kind="chat",
        model=engine.info.served_model_id if engine is not None else (req.model or ""),
        status=status_of(err.status), finish_reason="error", messages=req.message_dicts(), tools=req.tools,
        duration_ms=(now() - started) * 1000.0, streamed=bool(req.stream), error=err.message,
        thinking_budget=budget, thinking_mode=thinking_mode(req.chat_template_kwargs),
    ))
