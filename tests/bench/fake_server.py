"""A tiny OpenAI-style SSE chat server for testing the load client without a model."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kiln.bench.servers import free_port


def make_app(token_delay: float = 0.002, serial: bool = False) -> Starlette:
    """Streams `max_tokens` one-word chunks, `token_delay` apart. `serial`: one request at a time,
    like a server with a single slot. A message containing FAIL gets a 400."""
    lock = asyncio.Lock()
    bodies: list[dict] = []

    async def chat(request: Request):
        body = await request.json()
        bodies.append(body)
        if any("FAIL" in str(m.get("content")) for m in body["messages"]):
            return JSONResponse({"error": {"message": "bad prompt", "code": "bad"}}, status_code=400)
        n = int(body["max_tokens"])
        prompt_tokens = sum(len(str(m["content"]).split()) for m in body["messages"])

        async def events():
            def data(obj) -> str:
                return f"data: {json.dumps(obj)}\n\n"

            yield data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            if serial:
                await lock.acquire()
            try:
                for _ in range(n):
                    await asyncio.sleep(token_delay)
                    yield data({"choices": [{"index": 0, "delta": {"content": " tok"}}]})
            finally:
                if serial:
                    lock.release()
            yield data({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield data({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/v1/models", models)])
    app.state.bodies = bodies
    return app


@contextmanager
def serve(app: Starlette) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
