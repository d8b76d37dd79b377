"""Chat assembly: engine events back into choices, stream chunks and batch items (the request path's
second half), and the one place where a completion is finished.

`complete_chat`, `stream_chat` and `run_batch` submit a prepared request (`kiln.engine.chat_request`)
through `Engine.submit`, assemble what the wire contract says, and end in `Engine.finish_completion`
with a `FinishedCompletion`, whatever happened (ok, error, cancelled): the metrics observe it there,
and so can anything else that wants a record of what was served. `collect` is the bare generation the
eval generator uses.

Imports: core (reasoning split, tool-call parsing, chat metadata), the engine's own modules.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.core.chat_metadata import chat_metadata
from kiln.core.reasoning import ReasoningStreamSplitter, fold_reasoning, split_reasoning
from kiln.core.tool_call_stream import ToolCallStreamParser
from kiln.core.tool_calls import parse_tool_calls
from kiln.engine.actor import ChoiceEvent
from kiln.engine.chat_request import PreparedBatch, PreparedChat, PromptPlan
from kiln.engine.provenance import provenance_problems, rollout_provenance
from kiln.engine.timing import RequestTimeline, now, performance_metadata
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.serving import Admission, Engine

log = logging.getLogger("kiln.engine")


# ---- what the engine said -----------------------------------------------------------------------

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


# ---- the completion-finished record ---------------------------------------------------------------

@dataclass
class FinishedCompletion:
    """One chat or batch completion at its end, whatever the end was.

    status: "ok" | "error" | "rejected" | "timeout" (a KilnError's class, `status_of`) | "cancelled"
    (the client went away). `outputs` holds every choice the engine ran (empty when it never ran).
    """

    kind: str                                   # "chat" | "batch"
    request_id: str
    model: str
    adapter: str                                # "base" or the adapter label
    streamed: bool
    status: str
    started_at: float                           # perf_counter, handler entry
    finished_at: float
    prompt_tokens: int
    outputs: list[ChoiceOutput] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    timeline: RequestTimeline | None = None     # choice 0's (chat only)
    budget: dict[str, Any] | None = None        # request-wide effective thinking budget
    budget_outcomes: list[dict[str, Any] | None] = field(default_factory=list)
    error: str | None = None
    prepared: PreparedChat | PreparedBatch | None = None

    @property
    def seconds(self) -> float:
        return max(0.0, self.finished_at - self.started_at)

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def status_of(http_status: int) -> str:
    if http_status == 408:
        return "timeout"
    if 400 <= http_status < 500:
        return "rejected"
    return "error" if http_status >= 500 else "ok"


def _chat_finished(prep: PreparedChat, status: str, outs: list[ChoiceOutput], finishes: list[str], *,
                   error: str | None = None) -> FinishedCompletion:
    return FinishedCompletion(
        "chat", prep.id, prep.model_id, prep.adapter_label, prep.inp.stream, status, prep.timeline.started_at,
        now(), len(prep.prompt_ids), outs, finishes, prep.timeline, prep.budget_record(None),
        [o.outcome for o in outs], error, prep)


# ---- non-streaming chat ---------------------------------------------------------------------------

async def collect(engine: Engine, prep: PreparedChat, *, raise_on_error: bool = True,
                  admission: Admission | None = None) -> list[ChoiceOutput]:
    """Run the request and gather every choice; choice 0's events feed the request timeline."""
    outs = [ChoiceOutput() for _ in prep.params]
    async for _, ev in engine.submit([prep.work()], admission):
        if ev.error and raise_on_error:
            raise KilnError(500, "generation_error", f"generation failed: {ev.error}")
        outs[ev.index].add(ev)
        if ev.index == 0:
            prep.timeline.on_event(ev)
    return outs


@contextlib.contextmanager
def _finishing(engine: Engine, record: Callable[[str, str | None], FinishedCompletion]) -> Iterator[None]:
    """Start a completion; on leaving, however it leaves, finish it with `record(status, error)`: ok,
    the class of a KilnError, "error", or "cancelled" when the task was cancelled (the client left)."""
    engine.start_completion()
    status, error = "cancelled", None
    try:
        yield
        status = "ok"
    except KilnError as e:
        status, error = status_of(e.status), e.message
        raise
    except Exception as e:
        status, error = "error", str(e)
        raise
    finally:
        engine.finish_completion(record(status, error))


async def complete_chat(engine: Engine, prep: PreparedChat, admission: Admission | None = None,
                        outputs: list[ChoiceOutput] | None = None) -> dict[str, Any]:
    """A `chat.completion` body; `outputs`, when given, receives what the engine said per choice."""
    outs: list[ChoiceOutput] = outputs if outputs is not None else []
    with _finishing(engine, lambda status, error: _chat_finished(prep, status, outs, [o.finish_reason for o in outs],
                                                                 error=error)):
        outs += await collect(engine, prep, admission=admission)
        return _completion_body(engine, prep, outs)


def _completion_body(engine: Engine, prep: PreparedChat, outs: list[ChoiceOutput]) -> dict[str, Any]:
    inp = prep.inp
    choices = []
    finals = []
    for i, out in enumerate(outs):
        final = final_text(out.text, out.finish_reason, thinking_enabled=prep.thinking_enabled,
                           parse_tools=prep.parse_tools, tools=inp.tools, tool_choice=inp.tool_choice)
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
    metadata = _metadata(prep, finals[0], outs[0].outcome)
    if prep.include_config_hashes and engine.config_hashes() is not None:
        metadata["config_hashes"] = engine.config_hashes()
    prep.timeline.finished_at = now()
    if prep.include_performance:
        metadata["performance"] = _performance(prep, completion_tokens, finals[0].finish_reason)
    return {
        "id": prep.id, "object": "chat.completion", "created": prep.created, "model": prep.model_id,
        "choices": choices, "usage": usage(len(prep.prompt_ids), completion_tokens), "metadata": metadata,
    }


def _metadata(prep: PreparedChat, final: FinalText, outcome: dict[str, Any] | None) -> dict[str, Any]:
    return chat_metadata(
        thinking_enabled=prep.thinking_enabled, thinking_source=prep.thinking_source,  # type: ignore[arg-type]
        default_thinking_enabled=prep.default_thinking_enabled, content=final.content, reasoning=final.reasoning,
        tool_calls=final.tool_calls, fold=prep.fold, thinking_budget=prep.budget_record(outcome),
    )


def _performance(prep: PreparedChat, completion_tokens: int, finish: str) -> dict[str, Any]:
    total_ms = (now() - prep.timeline.started_at) * 1000.0
    return performance_metadata(
        prep.timeline, prompt_tokens=len(prep.prompt_ids), completion_tokens=completion_tokens, total_ms=total_ms,
        adapter_used=prep.adapter_label, thinking_mode="reasoning" if prep.thinking_enabled else "non_reasoning",
        finish_reason=finish,
    )


def _provenance(prep: PreparedChat, out: ChoiceOutput, content: str) -> dict[str, Any]:
    assert prep.policy is not None
    record = rollout_provenance(
        policy=prep.policy, prompt_ids=prep.prompt_ids, token_ids=out.token_ids, logprobs=out.logprobs,
        forced=out.forced, messages=prep.inp.messages, response_text=content,
        template_kwargs=prep.template_kwargs, params=prep.params[0], stops=prep.inp.user_stops,
        budget_limits=prep.budget_limits(), close_ids=prep.close_ids,
    )
    problems = provenance_problems(record)
    if problems:
        raise KilnError(500, "generation_error", "cannot emit rollout provenance for this completion: "
                        + "; ".join(problems), param="rollout_provenance",
                        hint="Retry with a larger max_tokens or without a thinking budget.")
    return record


# ---- streaming chat -------------------------------------------------------------------------------

def _chunk(prep: PreparedChat, choices: list[dict[str, Any]], **extra: Any) -> str:
    body = {"id": prep.id, "object": "chat.completion.chunk", "created": prep.created, "model": prep.model_id,
            "choices": choices, **extra}
    return json.dumps(body, ensure_ascii=False)


def _delta(prep: PreparedChat, **delta: Any) -> dict[str, str]:
    return {"data": _chunk(prep, [{"index": 0, "delta": delta}])}


async def stream_chat(engine: Engine, prep: PreparedChat, admission: Admission | None = None,
                      annotate: Callable[[AsyncIterator[dict[str, str]], ChoiceOutput],
                                         AsyncIterator[dict[str, str]]] | None = None
                      ) -> AsyncIterator[dict[str, str]]:
    """SSE events (`{"data": ...}`) of a streamed chat completion, ending in `[DONE]`; a failure after
    the first byte becomes an error event (a stream has no status code left to change). `annotate` may
    rewrite the events as they pass, reading the choice's output so far (the /compat route adds each
    chunk's logprobs)."""
    engine.start_completion()
    out = ChoiceOutput()
    finishes: list[str] = []
    status, error = "error", None
    try:
        events = _stream_events(engine, prep, out, finishes, admission)
        async for item in (annotate(events, out) if annotate is not None else events):
            yield item
        status = "ok"
    except KilnError as e:
        status, error = status_of(e.status), e.message
        yield {"data": json.dumps(e.to_body())}
        yield {"data": "[DONE]"}
    except Exception as e:  # noqa: BLE001 - a stream has no status code left to change
        log.exception("stream failed")
        error = str(e)
        yield {"data": json.dumps(KilnError(500, "generation_error", f"generation failed: {e}").to_body())}
        yield {"data": "[DONE]"}
    except BaseException:
        status = "cancelled"  # the client went away: neither a success nor a server failure
        raise
    finally:
        engine.finish_completion(_chat_finished(prep, status, [out], finishes, error=error))


async def _stream_events(engine: Engine, prep: PreparedChat, out: ChoiceOutput, finishes: list[str],
                         admission: Admission | None = None) -> AsyncIterator[dict[str, str]]:
    inp = prep.inp
    # per-token timing events only when the request itself asks (semantics.md §4.8)
    timing = inp.include_performance is True
    yield _delta(prep, role="assistant", content="")
    splitter = ReasoningStreamSplitter(prep.thinking_enabled)
    tools = ToolCallStreamParser(inp.tools) if prep.parse_tools else None
    reasoning_all = ""

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

    async for _, ev in engine.submit([prep.work()], admission):
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
    finishes.append(finish)
    prep.timeline.finished_at = now()
    metadata: dict[str, Any] = {"thinking_budget": prep.budget_record(out.outcome)}
    if timing:
        metadata["performance"] = _performance(prep, len(out.token_ids), finish)
    yield {"data": _chunk(prep, [{"index": 0, "delta": {}, "finish_reason": finish}], metadata=metadata)}
    if inp.include_usage:
        yield {"data": _chunk(prep, [], usage=usage(len(prep.prompt_ids), len(out.token_ids)))}
    yield {"data": "[DONE]"}


# ---- batch ----------------------------------------------------------------------------------------

async def run_batch(engine: Engine, batch: PreparedBatch, admission: Admission | None = None) -> dict[str, Any]:
    """A `batch.completion` body: every runnable prompt in one continuous batch; a prompt that could
    not run, or whose generation failed, gives finish_reason "error" items and the rest still return."""
    n = batch.inp.n
    runnable = batch.runnable
    outputs = {pl.index: [ChoiceOutput() for _ in range(n)] for pl in runnable}
    items: list[dict[str, Any]] = []
    with _finishing(engine, lambda status, error: _batch_finished(batch, outputs, items, status, error)):
        requests = batch.work()
        if requests:
            async for i, ev in engine.submit(requests, admission):
                outputs[runnable[i].index][ev.index].add(ev)
        for pl in batch.plans:
            for c in range(n):
                items.append(_batch_item(batch, pl, c, outputs.get(pl.index, [None] * n)[c]))
    total_prompt = sum(it["usage"]["prompt_tokens"] for it in items)
    total_completion = sum(it["usage"]["completion_tokens"] for it in items)
    return {
        "id": batch.id,
        "object": "batch.completion",
        "created": batch.created,
        "model": batch.model_id,
        "completions": items,
        "usage": usage(total_prompt, total_completion),
        "metadata": {"thinking_budget": batch.budget.to_dict()},
    }


def _batch_finished(batch: PreparedBatch, outputs: dict[int, list[ChoiceOutput]], items: list[dict[str, Any]],
                    status: str, error: str | None) -> FinishedCompletion:
    applied = {pl.index: pl.budget_applies for pl in batch.runnable}
    return FinishedCompletion(
        "batch", batch.id, batch.model_id, batch.adapter.label if batch.adapter else "base", False, status,
        batch.started_at, now(), sum(len(pl.prompt_ids) for pl in batch.plans),
        [o for p in sorted(outputs) for o in outputs[p]], [it["finish_reason"] for it in items], None,
        batch.budget.to_dict(), [{"applied": applied[p], **(o.outcome or {})} for p, outs in outputs.items()
                                 for o in outs], error, batch)


def _batch_item(batch: PreparedBatch, plan: PromptPlan, c: int, out: ChoiceOutput | None) -> dict[str, Any]:
    prompt_tokens = len(plan.prompt_ids)
    if plan.error is not None or out is None or out.error is not None:
        log.warning("batch prompt %d completion %d failed: %s", plan.index, c,
                    plan.error or (out.error if out else "no output"))
        completion_tokens = len(out.token_ids) if out is not None else 0
        return {"prompt_index": plan.index, "completion_index": c, "text": "", "finish_reason": "error",
                "usage": usage(prompt_tokens, completion_tokens)}
    inp = batch.inp
    final = final_text(out.text, out.finish_reason, thinking_enabled=plan.thinking_enabled,
                       parse_tools=batch.parse_tools, tools=inp.tools, tool_choice=inp.tool_choice)
    text = fold_reasoning(final.reasoning, final.content) if batch.fold else final.content
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
