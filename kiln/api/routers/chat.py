"""POST /v1/chat/completions: validate, call the engine, serialize (JSON or SSE)."""

from __future__ import annotations

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
from kiln.api.state import get_state
from kiln.api.wire.chat import ChatCompletionRequest
from kiln.config import ServerSettings
from kiln.core.budget_controller import ThinkingBudgetController
from kiln.core.chat_metadata import chat_metadata
from kiln.core.reasoning import ReasoningStreamSplitter, fold_reasoning, resolve_fold, split_reasoning
from kiln.core.sampling import SamplingParams, resolve_sampling, validate_sampling
from kiln.core.thinking_budget import EffectiveBudget, budget_record, check_budget_request, resolve_budget
from kiln.core.thinking_mode import detect_thinking_mode, effective_template_kwargs, thinking_source
from kiln.core.tool_call_stream import ToolCallStreamParser
from kiln.core.tool_calls import parse_tool_calls, tool_parsing_enabled
from kiln.engine.serving import ServingEngine
from kiln.errors import KilnError

log = logging.getLogger("kiln.api")
router = APIRouter(tags=["inference"])

PREFIX = "Invalid chat completion request: "


def require_engine(request: Request) -> ServingEngine:
    engine = get_state(request).engine
    if engine is None:
        raise KilnError(503, "model_loading", "the model is still loading", hint="Retry when GET /health answers 200.",
                        headers={"Retry-After": "5"})
    return engine


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


def prepare_chat(engine: ServingEngine, req: ChatCompletionRequest, settings: ServerSettings) -> PreparedChat:
    info = engine.info
    if req.adapter or req.adapters:
        name = req.adapter or req.adapters[0].name  # type: ignore[index]
        raise KilnError(404, "adapter_not_found", f"adapter {name!r} is not available", param="adapter",
                        hint="GET /v1/adapters lists the adapters this server has.")
    kwargs = effective_template_kwargs(req.chat_template_kwargs,
                                       default_thinking_enabled=settings.default_thinking_enabled)
    try:
        prompt = engine.render_chat([m.model_dump(exclude_none=True) for m in req.messages],
                                    tools=req.tools or None, template_kwargs=kwargs)
    except KilnError:
        raise
    except Exception as e:
        raise KilnError(400, "invalid_messages", f"{PREFIX}the chat template rejected the messages: {e}",
                        param="messages") from None
    prompt_ids = engine.encode_prompt(prompt)
    ceiling = info.max_model_len
    params = resolve_sampling(
        req.explicit_sampling(), preset=req.sampling_preset, qwen3_family=info.qwen3_family,
        has_tools=bool(req.tools), model_defaults=info.generation_defaults, eval_mode=settings.eval_mode,
    )
    validate_sampling(params)
    if len(prompt_ids) >= ceiling:
        raise KilnError(
            400, "context_length_exceeded",
            f"This model's maximum context length is {ceiling} tokens. However, your messages resulted in "
            f"{len(prompt_ids)} tokens (plus {params.max_tokens} for max_tokens).",
            param="messages", hint="Shorten the conversation or start a new one.",
        )
    params.max_tokens = min(params.max_tokens, ceiling - len(prompt_ids))
    parse_tools = tool_parsing_enabled(req.tools, req.tool_choice)
    params.stop = req.stop_list()
    user_stops = list(params.stop)
    if req.tools:
        params.stop.append("</tool_call>")  # §4.5: tools-bearing requests stop after a call
    params.ignore_eos = req.ignore_eos
    thinking = detect_thinking_mode(prompt).thinking_enabled
    present = {k: getattr(req, k) for k in ("thinking_budget_tokens", "thinking_budget_ms")
               if k in req.model_fields_set}
    budget = resolve_budget(present, settings)
    close_ids = engine.close_think_ids
    applies_ = check_budget_request(budget, thinking_enabled=thinking, max_tokens=params.max_tokens,
                                    stops=user_stops, close_ids=close_ids,
                                    close_decoded=engine.tokenizer.decode(close_ids))
    return PreparedChat(
        req, prompt_ids, engine.choice_params(params, req.n or 1), thinking,
        thinking_source(req.chat_template_kwargs, default_thinking_enabled=settings.default_thinking_enabled),
        settings.default_thinking_enabled, budget, applies_, close_ids,
        resolve_fold(req.fold_reasoning_into_content, settings.fold_reasoning_into_content), parse_tools,
        info.served_model_id,
    )


def metadata_for(prep: PreparedChat, content: str, reasoning: str | None, tool_calls: list[Any] | None,
                 outcome: dict[str, Any] | None) -> dict[str, Any]:
    return chat_metadata(
        thinking_enabled=prep.thinking_enabled, thinking_source=prep.thinking_source,  # type: ignore[arg-type]
        default_thinking_enabled=prep.default_thinking_enabled, content=content, reasoning=reasoning,
        tool_calls=tool_calls, fold=prep.fold, thinking_budget=prep.budget_record(outcome),
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = get_state(request)
    body = await read_json_body(request, code="chat_invalid_request", prefix=PREFIX)
    req = parse_model(ChatCompletionRequest, body, code="chat_invalid_request", prefix=PREFIX)
    engine = require_engine(request)
    prep = prepare_chat(engine, req, state.settings.server)
    if req.stream:
        return EventSourceResponse(_stream(engine, prep), ping=15, sep="\n")
    return JSONResponse(await _complete(engine, prep))


async def _complete(engine: ServingEngine, prep: PreparedChat) -> dict[str, Any]:
    n = len(prep.params)
    texts = [""] * n
    tokens = [0] * n
    finish: list[str] = ["stop"] * n
    outcomes: list[dict[str, Any] | None] = [None] * n
    async for ev in engine.generate(prep.prompt_ids, prep.params, prep.id, prep.controllers()):
        if ev.error:
            raise KilnError(500, "generation_error", f"generation failed: {ev.error}")
        texts[ev.index] += ev.text
        tokens[ev.index] += len(ev.token_ids)
        if ev.finish_reason:
            finish[ev.index] = ev.finish_reason
            outcomes[ev.index] = ev.budget_outcome
    choices = []
    first_meta: dict[str, Any] | None = None
    for i in range(n):
        reasoning, content = split_reasoning(texts[i], prep.thinking_enabled)
        calls: list[dict[str, Any]] = []
        if prep.parse_tools:
            parsed = parse_tool_calls(content, reasoning, tools=prep.req.tools, tool_choice=prep.req.tool_choice)
            content, reasoning, calls = parsed.content, parsed.reasoning, parsed.tool_calls
        message: dict[str, Any] = {"role": "assistant",
                                   "content": fold_reasoning(reasoning, content) if prep.fold else content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {"index": i, "message": message,
                                  "finish_reason": "tool_calls" if calls else finish[i]}
        if outcomes[i] is not None:
            choice["thinking_budget"] = outcomes[i]
        choices.append(choice)
        if first_meta is None:
            first_meta = metadata_for(prep, content, reasoning, calls, outcomes[i])
    return {
        "id": prep.id, "object": "chat.completion", "created": prep.created, "model": prep.model_id,
        "choices": choices, "usage": usage(len(prep.prompt_ids), sum(tokens)),
        "metadata": first_meta,
    }


def _chunk(prep: PreparedChat, choices: list[dict[str, Any]], **extra: Any) -> str:
    body = {"id": prep.id, "object": "chat.completion.chunk", "created": prep.created, "model": prep.model_id,
            "choices": choices, **extra}
    return json.dumps(body, ensure_ascii=False)


def _delta(prep: PreparedChat, **delta: Any) -> dict[str, str]:
    return {"data": _chunk(prep, [{"index": 0, "delta": delta}])}


async def _stream(engine: ServingEngine, prep: PreparedChat) -> AsyncIterator[dict[str, str]]:
    include_usage = bool(prep.req.stream_options and prep.req.stream_options.include_usage)
    yield _delta(prep, role="assistant", content="")
    splitter = ReasoningStreamSplitter(prep.thinking_enabled)
    tools = ToolCallStreamParser(prep.req.tools) if prep.parse_tools else None
    reasoning_all = ""
    completion_tokens = 0
    finish = "stop"
    outcome = None

    def pieces(delta) -> list[dict[str, str]]:
        nonlocal reasoning_all
        out = []
        if delta.reasoning:
            reasoning_all += delta.reasoning
            out.append(_delta(prep, reasoning_content=delta.reasoning))
        if delta.content:
            if tools is None:
                out.append(_delta(prep, content=delta.content))
            else:
                out.extend(tool_pieces(tools.feed(delta.content)))
        return out

    def tool_pieces(td) -> list[dict[str, str]]:
        out = []
        if td.content:
            out.append(_delta(prep, content=td.content))
        if td.tool_calls:
            out.append(_delta(prep, tool_calls=td.tool_calls))
        return out

    try:
        async for ev in engine.generate(prep.prompt_ids, prep.params, prep.id, prep.controllers()):
            if ev.error:
                raise KilnError(500, "generation_error", f"generation failed: {ev.error}")
            completion_tokens += len(ev.token_ids)
            if ev.text:
                for piece in pieces(splitter.feed(ev.text)):
                    yield piece
            if ev.finish_reason:
                finish, outcome = ev.finish_reason, ev.budget_outcome
        for piece in pieces(splitter.flush()):
            yield piece
        if tools is not None:
            for piece in tool_pieces(tools.finish(reasoning_all or None)):
                yield piece
            if tools.tool_calls:
                finish = "tool_calls"
    except KilnError as e:
        yield {"data": json.dumps(e.to_body())}
        yield {"data": "[DONE]"}
        return
    except Exception as e:  # noqa: BLE001 - a stream has no status code left to change
        log.exception("stream failed")
        yield {"data": json.dumps(KilnError(500, "generation_error", f"generation failed: {e}").to_body())}
        yield {"data": "[DONE]"}
        return
    yield {"data": _chunk(prep, [{"index": 0, "delta": {}, "finish_reason": finish}],
                          metadata={"thinking_budget": prep.budget_record(outcome)})}
    if include_usage:
        yield {"data": _chunk(prep, [], usage=usage(len(prep.prompt_ids), completion_tokens))}
    yield {"data": "[DONE]"}
