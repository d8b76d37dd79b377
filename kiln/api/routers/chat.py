"""POST /v1/chat/completions: parse, one call into the engine's request path, serialize (JSON or SSE).

Preparation is `kiln.engine.chat_request.prepare_chat`; assembly and streaming are
`kiln.engine.chat_response.complete_chat` / `stream_chat`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from kiln.api.errors import parse_body
from kiln.api.state import ServerState, get_state
from kiln.api.wire.chat import PREFIX, ChatCompletionRequest
from kiln.engine.chat_request import prepare_chat
from kiln.engine.chat_response import complete_chat, stream_chat
from kiln.engine.timing import now

router = APIRouter(tags=["inference"])
CODE = "chat_invalid_request"


def response_headers(state: ServerState) -> dict[str, str]:
    """semantics.md §4.6: eval mode and the adapter state, on every chat response."""
    active = state.services.adapters_active
    name = getattr(active, "name", None)
    revision = getattr(active, "revision", None)
    return {
        "x-kiln-eval-mode": "true" if state.settings.server.eval_mode else "false",
        "x-kiln-active-adapter": name or "base",
        "x-kiln-loaded-adapter": name or "base",
        "x-kiln-loaded-adapter-revision": revision or "base",
    }


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    started = now()
    state = get_state(request)
    with state.services.traffic.refusals(started, "chat") as seen:
        req = await parse_body(request, ChatCompletionRequest, code=CODE, prefix=PREFIX)
        seen.inp = req.to_input()
        engine = state.require_engine()
        prep = prepare_chat(engine.prompt_context(), seen.inp, state.settings.server, started=started)
        admission = engine.admit([len(prep.prompt_ids)])   # 429 here, before anything is queued
    prep.client_request_id = seen.request_id
    if req.stream:
        # The background task gives the place back should the stream never start (client gone).
        return EventSourceResponse(stream_chat(engine, prep, admission), ping=15, sep="\n",
                                   headers=response_headers(state), background=BackgroundTask(admission.release))
    return JSONResponse(await complete_chat(engine, prep, admission), headers=response_headers(state))
