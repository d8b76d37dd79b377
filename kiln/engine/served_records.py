"""The record of a finished completion, built from the request path's own objects (`PreparedChat`,
`PreparedBatch`, the choices' outputs) when `Engine.finish_completion` reports it; kiln.traffic.records
holds the record types and what keeps them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.core.thinking_mode import recent_thinking_mode
from kiln.traffic.records import (
    CANCELLED,
    OK,
    ChoiceRecord,
    CompletionRecord,
    adapter_identity,
    recent_budget,
)

if TYPE_CHECKING:
    from kiln.engine.chat_request import ChatInput
    from kiln.engine.chat_response import FinishedCompletion


def record_from_finished(done: FinishedCompletion) -> CompletionRecord | None:
    """The record of a completion at `Engine.finish_completion` (kiln.engine.chat_response); None for
    one that carries no prepared request (nothing to record)."""
    from kiln.engine.chat_request import PreparedBatch
    from kiln.engine.serving import sampling_dict

    prep = done.prepared
    ended = done.status == OK
    if isinstance(prep, PreparedBatch):
        return _batch_record(done, prep, ended)
    if prep is None:
        return None
    choices = [_choice(out, i, prep.thinking_enabled, prep.parse_tools, prep.fold, prep.inp)
               for i, out in enumerate(done.outputs)]
    outcome = done.outputs[0].outcome if done.outputs and ended else None
    return CompletionRecord(
        id=prep.id, request_id=prep.client_request_id or prep.id, kind="chat", model=prep.model_id,
        status=done.status, finish_reason=_finish(done, choices), created=prep.created,
        adapter=prep.adapter.label if prep.adapter else "base", adapters=adapter_identity(prep.adapter),
        messages=prep.inp.messages, tools=prep.inp.tools, choices=choices,
        sampling={**sampling_dict(prep.params[0]), "n": len(prep.params), "stop": list(prep.inp.user_stops)},
        prompt_tokens=done.prompt_tokens, completion_tokens=sum(c.completion_tokens for c in choices),
        duration_ms=done.seconds * 1000.0, ttft_ms=prep.timeline.ttft_ms(), streamed=done.streamed,
        error=done.error if not ended else None,
        thinking_budget=recent_budget(prep.budget.to_dict(), prep.budget_applies, outcome),
        thinking_mode=recent_thinking_mode(prep.inp.chat_template_kwargs),
    )


def _choice(out: Any, index: int, thinking: bool, parse_tools: bool, fold: bool, inp: ChatInput,
            prompt_index: int | None = None) -> ChoiceRecord:
    from kiln.core.reasoning import fold_reasoning
    from kiln.engine.chat_response import final_text

    if out.error is not None:
        return ChoiceRecord(index, "", "error", len(out.token_ids), prompt_index=prompt_index)
    final = final_text(out.text, out.finish_reason, thinking_enabled=thinking, parse_tools=parse_tools,
                       tools=inp.tools, tool_choice=inp.tool_choice)
    content = fold_reasoning(final.reasoning, final.content) if fold else final.content
    return ChoiceRecord(index, content, final.finish_reason, len(out.token_ids), final.reasoning,
                        final.tool_calls or None, prompt_index)


def _finish(done: FinishedCompletion, choices: list[ChoiceRecord]) -> str:
    if done.status == CANCELLED:
        return CANCELLED
    if done.status != OK or not choices:
        return "error"
    return choices[0].finish_reason


def _batch_record(done: FinishedCompletion, batch: Any, ended: bool) -> CompletionRecord:
    from kiln.engine.serving import sampling_dict

    n = batch.inp.n
    outputs = iter(done.outputs)   # runnable prompts in order, n choices each
    choices = []
    for pl in sorted(batch.runnable, key=lambda p: p.index):
        for c in range(n):
            out = next(outputs, None)
            if out is not None:
                choices.append(_choice(out, c, pl.thinking_enabled, batch.parse_tools, batch.fold, batch.inp,
                                       prompt_index=pl.index))
    for pl in batch.plans:
        if pl.error is not None:
            choices += [ChoiceRecord(c, "", "error", 0, prompt_index=pl.index) for c in range(n)]
    choices.sort(key=lambda ch: (ch.prompt_index or 0, ch.index))
    first = next((pl for pl in batch.runnable), None)
    applied = any(pl.budget_applies for pl in batch.runnable)
    return CompletionRecord(
        id=batch.id, request_id=batch.client_request_id or batch.id, kind="batch", model=batch.model_id,
        status=done.status, finish_reason=_finish(done, choices), created=batch.created,
        adapter=batch.adapter.label if batch.adapter else "base", adapters=adapter_identity(batch.adapter),
        prompts=[pl.messages for pl in batch.plans], tools=batch.inp.tools, choices=choices,
        sampling={**sampling_dict(first.params[0]), "n": n} if first is not None and first.params else {},
        prompt_tokens=done.prompt_tokens * n, completion_tokens=sum(c.completion_tokens for c in choices),
        duration_ms=done.seconds * 1000.0, error=done.error if not ended else None,
        thinking_budget=recent_budget(batch.budget.to_dict(), applied),
        thinking_mode=recent_thinking_mode(batch.inp.chat_template_kwargs),
    )
