"""POST /v1/completions: prompt-logprob scoring only, no generation (semantics.md §5.2).

The forward runs on the engine's actor thread between batching steps; the handler validates,
tokenizes, waits for the scores (bounded by server.request_timeout_secs), decodes the candidate
tokens and builds the response.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from kiln.api.errors import parse_model, read_json_body
from kiln.api.routers.chat import require_engine, usage
from kiln.api.routers.metrics import metrics_for, status_of
from kiln.api.state import ServerState, get_state
from kiln.api.wire.completions import PREFIX, TextCompletionRequest
from kiln.engine.scoring import prompt_logprob_entries
from kiln.engine.serving import ServingEngine
from kiln.engine.timing import now
from kiln.errors import KilnError

router = APIRouter(tags=["inference"])

MAX_PROMPT_TOKENS = 4096
MAX_RETURNED_CANDIDATES = 65_536
CODE = "completion_invalid_request"


def _bad(message: str, param: str, hint: str) -> KilnError:
    return KilnError(400, CODE, PREFIX + message, param=param, hint=hint)


def prompt_ids(engine: ServingEngine, req: TextCompletionRequest) -> list[int]:
    """Tokenize (text) or check (token ids) the prompt against the served vocabulary and limits."""
    vocab = engine.info.config.vocab_size
    if isinstance(req.prompt, str):
        ids = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        ids = list(req.prompt)
        for i, tid in enumerate(ids):
            if not 0 <= tid < vocab:
                raise _bad(f"token id {tid} is outside the served vocabulary 0..{vocab - 1}", f"prompt[{i}]",
                           "Send token ids this model's tokenizer produces.")
    if not ids:
        raise _bad("the prompt is empty", "prompt", "Send non-empty text or at least one token id.")
    ceiling = engine.info.max_model_len
    if len(ids) > ceiling:
        raise KilnError(400, "context_length_exceeded",
                        f"This model's maximum context length is {ceiling} tokens. However, your prompt resulted "
                        f"in {len(ids)} tokens.", param="prompt", hint="Score a shorter prompt.")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise _bad(f"the prompt has {len(ids)} tokens; scoring takes at most {MAX_PROMPT_TOKENS}", "prompt",
                   "Score a shorter prompt, or split it.")
    return ids


def check_request(engine: ServingEngine, state: ServerState, req: TextCompletionRequest) -> None:
    if req.model is not None and req.model != engine.info.served_model_id:
        raise _bad(f"model {req.model!r} is not the served base model {engine.info.served_model_id!r}", "model",
                   "Send the id GET /v1/models lists, or leave model out.")
    vocab = engine.info.config.vocab_size
    if req.prompt_logprobs > vocab:
        raise _bad(f"prompt_logprobs {req.prompt_logprobs} exceeds the vocabulary size {vocab}", "prompt_logprobs",
                   f"Ask for at most {vocab} candidates.")
    active = state.services.get("adapters_active")
    if getattr(active, "name", None):
        raise _bad(f"adapter {active.name!r} is active; prompt scoring runs on the base model only", "model",
                   "Unload the adapter (POST /v1/adapters/unload) before scoring.")


@router.post("/v1/completions")
async def completions(request: Request) -> JSONResponse:
    started = now()
    state = get_state(request)
    metrics = metrics_for(state)
    status = "error"
    try:
        body = await read_json_body(request, code=CODE, prefix=PREFIX)
        req = parse_model(TextCompletionRequest, body, code=CODE, prefix=PREFIX)
        engine = require_engine(request)
        check_request(engine, state, req)
        ids = prompt_ids(engine, req)
        k = req.prompt_logprobs
        returned = (len(ids) - 1) * (k + 1)
        if returned > MAX_RETURNED_CANDIDATES:
            raise _bad(f"{len(ids) - 1} scored positions x {k + 1} candidates = {returned} exceeds the cap of "
                       f"{MAX_RETURNED_CANDIDATES}", "prompt_logprobs", "Ask for fewer candidates or a shorter prompt.")
        result = await _score(engine, ids, k, state.settings.server.request_timeout_secs)
        status = "ok"
        return JSONResponse(result)
    except KilnError as e:
        status = status_of(e.status)
        raise
    finally:
        if metrics is not None:
            metrics.finished(status, now() - started)


async def _score(engine: ServingEngine, ids: list[int], k: int, timeout_s: float) -> dict[str, Any]:
    try:
        scores = await asyncio.wait_for(engine.score(ids, k), timeout=timeout_s)
    except TimeoutError:
        raise KilnError(408, "request_timeout", f"prompt scoring did not finish within {timeout_s:g}s",
                        hint="Retry later or score a shorter prompt.") from None
    # up to 65,536 small decodes: off the event loop
    entries = await run_in_threadpool(prompt_logprob_entries, ids, scores, engine.tokenizer)
    identity = engine.identity
    return {
        "id": "cmpl-" + uuid.uuid4().hex,
        "object": "text_completion",
        "created": int(time.time()),
        "model": engine.info.served_model_id,
        "system_fingerprint": identity.base_model_sha256 if identity is not None else None,
        "choices": [{"index": 0, "text": "", "finish_reason": "length", "prompt_logprobs": entries}],
        "usage": usage(len(ids), 0),
    }
