"""vLLM-compatible routes that are not in the contracts: tokenizer routes and legacy OpenAI completions.

lm-evaluation-harness finds everything from one base URL: with
`base_url=http://HOST:PORT/compat/v1/completions` its `local-completions` model posts there, and its
remote tokenizer (`tokenizer_backend=remote`) strips `/v1/completions` and calls
`/compat/tokenizer_info`, `/compat/tokenize`, `/compat/detokenize`. The tokenizer routes are also at
the root, where vLLM serves them. The contract's `POST /v1/completions` (prompt scoring) is unchanged.
`/compat/v1/chat/completions` is the chat route plus OpenAI's `logprobs` / `top_logprobs`, which the
contract's closed `Choice` has no room for (kiln.engine.chat_logprobs).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from kiln.api.errors import parse_body
from kiln.api.routers.chat import response_headers
from kiln.api.state import get_state
from kiln.api.wire.chat import PREFIX as CHAT_PREFIX
from kiln.api.wire.compat import (
    CompatChatRequest,
    DetokenizeRequest,
    LegacyCompletionRequest,
    TokenizeRequest,
)
from kiln.engine.chat_logprobs import check_scorable, complete_chat_with_logprobs, stream_chat_with_logprobs
from kiln.engine.chat_request import prepare_chat
from kiln.engine.legacy_completion import run_legacy_completion
from kiln.engine.legacy_request import CODE, PREFIX, prepare_legacy
from kiln.engine.model_selection import select_model
from kiln.engine.timing import now
from kiln.engine.tokenize_request import (
    DETOKENIZE_PREFIX,
    TOKENIZE_CODE,
    TOKENIZE_PREFIX,
    detokenize,
    tokenize,
    tokenizer_info,
)

router = APIRouter(tags=["compat"])
CHAT_CODE = "chat_invalid_request"


def _engine(request: Request) -> Any:
    return get_state(request).require_engine()


def _check_model(request: Request, model: str | None) -> None:
    """Tokenizer routes serve one tokenizer: the served model's (adapters share it)."""
    state = get_state(request)
    select_model(model, served_model_id=state.require_engine().info.served_model_id,
                 adapter_store=state.services.adapter_store)


# ---- tokenizer routes (vLLM's shapes) ------------------------------------------------------------------

async def _tokenizer_info(request: Request) -> dict[str, Any]:
    return tokenizer_info(_engine(request))


async def _tokenize(request: Request) -> dict[str, Any]:
    body = await parse_body(request, TokenizeRequest, code=TOKENIZE_CODE, prefix=TOKENIZE_PREFIX)
    _check_model(request, body.model)
    return tokenize(_engine(request), body)


async def _detokenize(request: Request) -> dict[str, Any]:
    body = await parse_body(request, DetokenizeRequest, code=TOKENIZE_CODE, prefix=DETOKENIZE_PREFIX)
    _check_model(request, body.model)
    return detokenize(_engine(request), body.tokens)


for _base in ("", "/compat"):
    router.add_api_route(f"{_base}/tokenizer_info", _tokenizer_info, methods=["GET"],
                         summary="The served tokenizer's configuration (vLLM's shape)")
    router.add_api_route(f"{_base}/tokenize", _tokenize, methods=["POST"],
                         summary="Text or chat messages to token ids (vLLM's shape)")
    router.add_api_route(f"{_base}/detokenize", _detokenize, methods=["POST"],
                         summary="Token ids to text (vLLM's shape)")


# ---- legacy completions ----------------------------------------------------------------------------------

@router.post("/compat/v1/completions", summary="OpenAI legacy completions: generation, echo, logprobs")
async def legacy_completions(request: Request) -> JSONResponse:
    started = now()
    state = get_state(request)
    with state.services.traffic.refusals(started):
        req = await parse_body(request, LegacyCompletionRequest, code=CODE, prefix=PREFIX)
        engine = state.require_engine()
        plan, model_id = prepare_legacy(engine, req, state.services.adapter_store,
                                        state.settings.server.eval_mode)
        admission = engine.admit(plan.admission_tokens())   # 429 here, before anything is queued
        result = await run_legacy_completion(engine, plan, timeout_s=state.settings.server.request_timeout_secs,
                                             admission=admission)
    usage = result["usage"]
    ttft = None if plan.first_token_at is None else round((plan.first_token_at - started) * 1000.0, 1)
    state.services.traffic.served(
        started, model=model_id, adapter=plan.adapter.label if plan.adapter else "base",
        prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"], ttft_ms=ttft,
        finish_reason=",".join(sorted({c["finish_reason"] for c in result["choices"]})))
    return JSONResponse({**result, "created": int(time.time()), "model": model_id})



# ---- chat with what the contract's closed shapes leave out --------------------------------------------------

@router.post("/compat/v1/chat/completions", summary="OpenAI chat with logprobs / top_logprobs (JSON or SSE)")
async def compat_chat_completions(request: Request):
    started = now()
    state = get_state(request)
    with state.services.traffic.refusals(started, "chat") as seen:
        req = await parse_body(request, CompatChatRequest, code=CHAT_CODE, prefix=CHAT_PREFIX)
        seen.inp = req.to_input()
        engine = state.require_engine()
        prep = prepare_chat(engine.prompt_context(), seen.inp, state.settings.server, started=started)
        top = req.wanted_top_logprobs
        if top is not None:
            check_scorable(prep, code=CHAT_CODE, prefix=CHAT_PREFIX)
        admission = engine.admit([len(prep.prompt_ids)])   # 429 here, before anything is queued
    prep.client_request_id = seen.request_id
    timeout = state.settings.server.request_timeout_secs
    if req.stream:
        return EventSourceResponse(stream_chat_with_logprobs(engine, prep, admission, top, timeout), ping=15,
                                   sep="\n", headers=response_headers(state),
                                   background=BackgroundTask(admission.release))
    body = await complete_chat_with_logprobs(engine, prep, admission, top, timeout)
    return JSONResponse(body, headers=response_headers(state))
