"""POST /v1/completions/batch: many conversations x n choices, non-streaming (semantics.md §5.1).

Parse, then `kiln.engine.chat_request.prepare_batch` (every prompt rendered and checked; one that
cannot run fails alone) and `kiln.engine.chat_response.run_batch` (all of them in one continuous batch).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.api.errors import parse_body
from kiln.api.state import get_state
from kiln.api.wire.batch import PREFIX, BatchCompletionRequest
from kiln.engine.chat_request import prepare_batch
from kiln.engine.chat_response import run_batch
from kiln.engine.timing import now

router = APIRouter(tags=["inference"])
CODE = "batch_invalid_request"


@router.post("/v1/completions/batch")
async def batch_completions(request: Request) -> JSONResponse:
    started = now()
    state = get_state(request)
    with state.services.traffic.refusals(started, "batch") as seen:
        req = await parse_body(request, BatchCompletionRequest, code=CODE, prefix=PREFIX)
        seen.inp, seen.prompts = req.to_input(), req.prompt_dicts()
        engine = state.require_engine()
        batch = prepare_batch(engine.prompt_context(), seen.inp, seen.prompts, state.settings.server, started=started)
        admission = engine.admit([len(pl.prompt_ids) for pl in batch.runnable])
    batch.client_request_id = seen.request_id
    return JSONResponse(await run_batch(engine, batch, admission))
