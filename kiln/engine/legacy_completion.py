"""OpenAI's legacy completions (generation, `echo`, `logprobs`), as vLLM serves them, over Kiln's engine.

lm-evaluation-harness's `local-completions` model scores multiple-choice answers with
`{"prompt": [[ids...]], "max_tokens": 1, "echo": true, "logprobs": 1, "temperature": 0}` and reads
`choices[i].logprobs.token_logprobs[ctxlen:-1]` and `top_logprobs` (dicts of token text -> logprob).
Each choice is generated on the batching engine (all prompts and choices submitted together); the
log-probabilities are then read from one causal forward over prompt + output on the actor thread,
the same scoring the contract's `/v1/completions` uses (kiln.engine.scoring), so they are the model's
raw distribution (before temperature or filters), as vLLM reports by default. Under an adapter
(`model` naming a stored one, or the server's default adapter) that forward adds the same adapter
revision the generation used, so lm-eval's loglikelihood tasks evaluate adapters too.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.core.sampling import SamplingParams
from kiln.engine.actor import GenerationRequest
from kiln.engine.grammar import CompiledGrammar
from kiln.engine.lora_slots import AdapterTarget
from kiln.engine.scoring import prompt_logprob_entries
from kiln.engine.serving import Admission
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.view import EngineView


@dataclass
class LegacyPrompt:
    ids: list[int]
    text: str          # what `echo` repeats: the prompt as sent, or its ids decoded


@dataclass
class LegacyChoiceOut:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"


@dataclass
class LegacyPlan:
    prompts: list[LegacyPrompt]
    params: SamplingParams          # max_tokens already fits each prompt's context
    max_tokens: list[int]           # per prompt
    n: int
    echo: bool
    logprobs: int | None
    adapter: AdapterTarget | None = None
    grammar: CompiledGrammar | None = None   # the output grammar every choice is held to
    request_id: str = field(default_factory=lambda: "cmpl-" + uuid.uuid4().hex)
    first_token_at: float | None = None   # perf_counter when the first generated token arrived

    def admission_tokens(self) -> list[int]:
        """What `Engine.admit` is asked for: one place per generating prompt, holding its prompt tokens;
        a request that only scores (every max_tokens 0) takes one place for all of its prompts."""
        generating = [len(p.ids) for p, m in zip(self.prompts, self.max_tokens, strict=True) if m > 0]
        return generating or [sum(len(p.ids) for p in self.prompts)]


async def run_legacy_completion(engine: EngineView, plan: LegacyPlan, *, timeout_s: float,
                                admission: Admission | None = None) -> dict[str, Any]:
    """The response body minus `model` (which the caller names): choices in prompt-major order.
    `admission` (from `Engine.admit(plan.admission_tokens())`) is given back when the body is done."""
    try:
        return await _complete(engine, plan, timeout_s, admission)
    finally:
        if admission is not None:
            admission.release()


async def _complete(engine: EngineView, plan: LegacyPlan, timeout_s: float, admission: Admission | None) -> dict[str, Any]:
    outs = await _generate(engine, plan, admission if any(m > 0 for m in plan.max_tokens) else None)
    choices = []
    completion_tokens = 0
    for p_index, prompt in enumerate(plan.prompts):
        for j in range(plan.n):
            out = outs[p_index][j]
            completion_tokens += len(out.token_ids)
            text = (prompt.text if plan.echo else "") + out.text
            choice: dict[str, Any] = {"index": p_index * plan.n + j, "text": text, "logprobs": None,
                                      "finish_reason": out.finish_reason}
            if plan.logprobs is not None:
                choice["logprobs"] = await _logprobs(engine, prompt, out, plan, timeout_s)
            choices.append(choice)
    prompt_tokens = sum(len(p.ids) for p in plan.prompts)
    return {"id": plan.request_id, "object": "text_completion", "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


async def _generate(engine: EngineView, plan: LegacyPlan, admission: Admission | None) -> list[list[LegacyChoiceOut]]:
    outs = [[LegacyChoiceOut() for _ in range(plan.n)] for _ in plan.prompts]
    requests: list[GenerationRequest] = []
    index: list[int] = []
    for i, prompt in enumerate(plan.prompts):
        if plan.max_tokens[i] == 0:
            continue
        base = SamplingParams(**{**plan.params.__dict__, "max_tokens": plan.max_tokens[i],
                                 "stop": list(plan.params.stop)})
        requests.append(GenerationRequest(prompt.ids, engine.choice_params(base, plan.n),
                                          request_id=f"{plan.request_id}-{i}", adapter=plan.adapter,
                                          grammar=plan.grammar))
        index.append(i)
    if not requests:
        return outs
    async for r, ev in engine.submit(requests, admission):
        if ev.error:
            raise KilnError(500, "generation_error", f"generation failed: {ev.error}")
        out = outs[index[r]][ev.index]
        if ev.token_ids and plan.first_token_at is None:
            plan.first_token_at = ev.received_at or time.perf_counter()
        out.token_ids += ev.token_ids
        out.text += ev.text
        if ev.finish_reason is not None:
            out.finish_reason = ev.finish_reason
    return outs


async def _logprobs(engine: EngineView, prompt: LegacyPrompt, out: LegacyChoiceOut, plan: LegacyPlan,
                    timeout_s: float) -> dict[str, Any]:
    """OpenAI's `logprobs` object over the echoed prompt (first token: null) and the generated tokens."""
    k = plan.logprobs or 0
    ids = prompt.ids + out.token_ids
    first = 0 if plan.echo else len(prompt.ids)
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    if first == 0 and ids:
        tokens.append(engine.tokenizer.decode([ids[0]]))
        token_logprobs.append(None)
        top.append(None)
    if len(ids) > 1 and len(ids) > first:
        try:
            scores = await asyncio.wait_for(engine.score(ids, k, plan.adapter), timeout=timeout_s)
        except TimeoutError:
            raise KilnError(408, "request_timeout", f"scoring did not finish within {timeout_s:g}s",
                            hint="Retry later, or send shorter prompts.") from None
        entries = prompt_logprob_entries(ids, scores, engine.tokenizer)
        for p in range(max(1, first), len(ids)):
            entry = entries[p]
            assert entry is not None
            observed = entry[str(ids[p])]
            tokens.append(observed["decoded_token"])
            token_logprobs.append(observed["logprob"])
            ranked = sorted(entry.values(), key=lambda e: e["rank"])
            # keyed by text, as OpenAI and vLLM do: tokens that read the same (e.g. partial UTF-8 bytes,
            # U+FFFD) share a key, which keeps the best of them so max() is still the top logprob
            best: dict[str, float] = {}
            for e in ranked:
                best.setdefault(e["decoded_token"], e["logprob"])
            top.append(best)
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
