"""POST /v1/completions/batch: many conversations x n choices, non-streaming (semantics.md §5.1).

Every prompt is rendered and checked first; then all of them go to the actor in one inbox message,
so they run as one continuous batch. Completion (p, c) samples with seed + p*n + c. A prompt that
cannot run (the template rejects it, it overflows the context) fails alone: its items carry
finish_reason "error" and the other items are still returned (§0).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.api.errors import parse_model, read_json_body
from kiln.api.routers.chat import (
    ChoiceOutput,
    clamp_to_context,
    client_request_id,
    final_text,
    render_prompt,
    require_engine,
    resolve_params,
    usage,
)
from kiln.api.routers.metrics import KilnMetrics, metrics_for, status_of
from kiln.api.state import get_state
from kiln.api.wire.batch import PREFIX, BatchCompletionRequest
from kiln.api.wire.common import check_adapter_selection
from kiln.config import ServerSettings
from kiln.core.budget_controller import ThinkingBudgetController
from kiln.core.reasoning import fold_reasoning
from kiln.core.sampling import SamplingParams
from kiln.core.thinking_budget import (
    EffectiveBudget,
    applies,
    check_close_sequence,
    check_max_tokens_fits,
    check_stop_strings,
    resolve_budget,
)
from kiln.core.thinking_mode import effective_template_kwargs
from kiln.core.tool_calls import tool_parsing_enabled
from kiln.engine.engine import GenerationRequest
from kiln.engine.lora_slots import AdapterTarget
from kiln.engine.records import (
    CANCELLED,
    ChoiceRecord,
    CompletionRecord,
    adapter_identity,
    recent_budget,
    thinking_mode,
)
from kiln.engine.serving import ServingEngine, sampling_dict
from kiln.engine.timing import now
from kiln.errors import KilnError

log = logging.getLogger("kiln.api")
router = APIRouter(tags=["inference"])
CODE = "batch_invalid_request"


@dataclass
class PromptPlan:
    """One prompt ready to run, or the reason it cannot."""

    index: int
    prompt_ids: list[int]
    thinking_enabled: bool = False
    max_tokens: int = 0
    budget_applies: bool = False
    error: str | None = None


@router.post("/v1/completions/batch")
async def batch_completions(request: Request) -> JSONResponse:
    started = now()
    state = get_state(request)
    metrics = metrics_for(state)
    served = ServedBatch("batchcmpl-" + uuid.uuid4().hex, client_request_id(request), started)
    status = "error"
    try:
        body = await read_json_body(request, code=CODE, prefix=PREFIX)
        req = parse_model(BatchCompletionRequest, body, code=CODE, prefix=PREFIX)
        served.req = req
        engine = require_engine(request)
        adapter, adapters, both = req.adapter_fields()
        check_adapter_selection(adapter, adapters, both_given=both, prefix=PREFIX)
        target = engine.resolve_adapter(adapter_given="adapter" in req.model_fields_set, adapter=adapter,
                                        adapters=adapters)
        served.target = target
        if metrics is not None:
            with metrics.in_flight():
                result = await _run(engine, req, state.settings.server, metrics, target, served)
        else:
            result = await _run(engine, req, state.settings.server, metrics, target, served)
        status = "ok"
        return JSONResponse(result, headers={"x-request-id": served.request_id})
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
        _record_batch(state, served, status)


def _plan(engine: ServingEngine, req: BatchCompletionRequest, params: SamplingParams, budget: EffectiveBudget,
          kwargs: dict[str, Any]) -> list[PromptPlan]:
    plans = []
    for p, messages in enumerate(req.prompts):
        plan = PromptPlan(p, [])
        try:
            rendered = render_prompt(engine, [m.model_dump(exclude_none=True) for m in messages], req.tools, kwargs,
                                     prefix=PREFIX)
            plan.prompt_ids, plan.thinking_enabled = rendered.prompt_ids, rendered.thinking_enabled
            plan.max_tokens = clamp_to_context(engine, len(rendered.prompt_ids), params.max_tokens,
                                               param=f"prompts[{p}]")
        except KilnError as e:
            plan.error = e.message
        plans.append(plan)
    close_ids = engine.close_think_ids
    runnable = [pl for pl in plans if pl.error is None]
    if any(applies(budget, thinking_enabled=pl.thinking_enabled, max_tokens=pl.max_tokens) for pl in runnable):
        # request-wide §2.3 checks: the same stops and max_tokens go to every prompt
        check_stop_strings(req.stop_list(keep_empty=True), code=CODE)
        check_close_sequence(close_ids, engine.tokenizer.decode(close_ids), param=budget.limiting_param, code=CODE)
        check_max_tokens_fits(params.max_tokens, len(close_ids), param=req.max_tokens_param, code=CODE)
    for pl in runnable:
        pl.budget_applies = applies(budget, thinking_enabled=pl.thinking_enabled, max_tokens=pl.max_tokens)
        if pl.budget_applies and pl.max_tokens < len(close_ids):
            pl.error = (f"the room left in the context ({pl.max_tokens} tokens) cannot fit the "
                        f"{len(close_ids)}-token reasoning close sequence")
    return plans


async def _run(engine: ServingEngine, req: BatchCompletionRequest, settings: ServerSettings,
               metrics: KilnMetrics | None, target: AdapterTarget | None = None,
               served: ServedBatch | None = None) -> dict[str, Any]:
    served = served or ServedBatch("batchcmpl-" + uuid.uuid4().hex, "", now())
    params = resolve_params(engine, req, settings, code=CODE)
    served.params = params
    budget = resolve_budget(req.budget_fields(), settings, code=CODE)
    served.budget = budget
    kwargs = effective_template_kwargs(req.chat_template_kwargs, default_thinking_enabled=settings.default_thinking_enabled)
    plans = _plan(engine, req, params, budget, kwargs)
    served.plans = plans
    n = req.choices
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    close_ids = engine.close_think_ids
    requests: list[GenerationRequest] = []
    runnable = [pl for pl in plans if pl.error is None]
    for pl in runnable:
        base = replace(params, stop=list(params.stop), max_tokens=pl.max_tokens, seed=(seed + pl.index * n) % 2**64)
        choice_params = engine.choice_params(base, n)
        budgets: list[ThinkingBudgetController | None] | None = None
        if pl.budget_applies:
            budgets = [ThinkingBudgetController(close_ids, max_thinking_tokens=budget.max_tokens,
                                                max_time_ms=budget.max_time_ms, max_completion_tokens=pl.max_tokens)
                       for _ in range(n)]
        requests.append(GenerationRequest(pl.prompt_ids, choice_params, budgets, adapter=target))
    outputs = {pl.index: [ChoiceOutput() for _ in range(n)] for pl in runnable}
    served.outputs = outputs
    if requests:
        async for i, ev in engine.generate_many(requests):
            outputs[runnable[i].index][ev.index].add(ev)
    parse_tools = tool_parsing_enabled(req.tools, req.tool_choice)
    items = []
    for pl in plans:
        for c in range(n):
            items.append(_item(pl, c, outputs.get(pl.index, [None] * n)[c], parse_tools, req, settings))
    served.items = items
    if metrics is not None:
        applied = {pl.index: pl.budget_applies for pl in runnable}
        metrics.observe_budget(budget.to_dict(), [{"applied": applied[p], **(o.outcome or {})}
                                                  for p, outs in outputs.items() for o in outs])
    total_prompt = sum(it["usage"]["prompt_tokens"] for it in items)
    total_completion = sum(it["usage"]["completion_tokens"] for it in items)
    return {
        "id": served.id,
        "object": "batch.completion",
        "created": served.created,
        "model": engine.info.served_model_id,
        "completions": items,
        "usage": usage(total_prompt, total_completion),
        "metadata": {"thinking_budget": budget.to_dict()},
    }


def _item(plan: PromptPlan, c: int, out: ChoiceOutput | None, parse_tools: bool, req: BatchCompletionRequest,
          settings: ServerSettings) -> dict[str, Any]:
    prompt_tokens = len(plan.prompt_ids)
    if plan.error is not None or out is None or out.error is not None:
        log.warning("batch prompt %d completion %d failed: %s", plan.index, c,
                    plan.error or (out.error if out else "no output"))
        completion_tokens = len(out.token_ids) if out is not None else 0
        return {"prompt_index": plan.index, "completion_index": c, "text": "", "finish_reason": "error",
                "usage": usage(prompt_tokens, completion_tokens)}
    final = final_text(out.text, out.finish_reason, thinking_enabled=plan.thinking_enabled, parse_tools=parse_tools,
                       tools=req.tools, tool_choice=req.tool_choice)
    text = fold_reasoning(final.reasoning, final.content) if settings.fold_reasoning_into_content else final.content
    item: dict[str, Any] = {"prompt_index": plan.index, "completion_index": c, "text": text}
    if final.reasoning:
        item["reasoning_content"] = final.reasoning
    if final.tool_calls:
        item["tool_calls"] = final.tool_calls
    item["finish_reason"] = final.finish_reason
    if out.outcome is not None:
        item["thinking_budget"] = out.outcome
    item["usage"] = usage(prompt_tokens, len(out.token_ids))
    return item


# ---- recording what was served (kiln.engine.records) ---------------------------------------------------

@dataclass
class ServedBatch:
    id: str
    request_id: str
    started: float
    created: int = field(default_factory=lambda: int(time.time()))
    req: BatchCompletionRequest | None = None
    target: AdapterTarget | None = None
    params: SamplingParams | None = None
    budget: EffectiveBudget | None = None
    plans: list[PromptPlan] = field(default_factory=list)
    outputs: dict[int, list[ChoiceOutput]] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    cancelled: bool = False


def _record_batch(state: Any, served: ServedBatch, status: str) -> None:
    recorder = state.services.get("recorder")
    req = served.req
    if recorder is None or req is None:
        return
    if served.items:
        choices = [ChoiceRecord(it["completion_index"], it["text"], it["finish_reason"],
                                it["usage"]["completion_tokens"], it.get("reasoning_content"), it.get("tool_calls"),
                                prompt_index=it["prompt_index"]) for it in served.items]
    else:  # failed or cancelled before assembly: what each choice had produced
        choices = [ChoiceRecord(c, o.text, CANCELLED if served.cancelled else "error", len(o.token_ids),
                                prompt_index=p) for p, outs in served.outputs.items() for c, o in enumerate(outs)]
    applied = None
    if served.plans:
        applied = any(pl.budget_applies for pl in served.plans if pl.error is None)
    budget = served.budget
    if budget is None:
        try:
            budget = resolve_budget(req.budget_fields(), state.settings.server, code=CODE)
        except KilnError:
            budget = None
    finished = status == "ok" and not served.cancelled
    engine = state.engine
    recorder.finished(CompletionRecord(
        id=served.id, request_id=served.request_id, kind="batch",
        model=engine.info.served_model_id if engine is not None else (req.model or ""),
        status=CANCELLED if served.cancelled else status,
        finish_reason=(choices[0].finish_reason if choices else "error") if finished
        else (CANCELLED if served.cancelled else "error"),
        created=served.created, adapter=served.target.label if served.target else "base",
        adapters=adapter_identity(served.target),
        prompts=[[m.model_dump(exclude_none=True) for m in msgs] for msgs in req.prompts], tools=req.tools,
        choices=choices,
        sampling={**sampling_dict(served.params), "n": req.choices} if served.params is not None else {},
        prompt_tokens=sum(len(pl.prompt_ids) for pl in served.plans) * (req.choices if served.plans else 0),
        completion_tokens=sum(c.completion_tokens for c in choices),
        duration_ms=(now() - served.started) * 1000.0, error=served.error if status != "ok" else None,
        thinking_budget=recent_budget(budget.to_dict(), applied) if budget is not None else None,
        thinking_mode=thinking_mode(req.chat_template_kwargs),
    ))
