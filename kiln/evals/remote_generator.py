"""The eval Generator over any OpenAI-compatible server (vLLM, another Kiln, ...), with httpx.

One chat completion per request (each completion has its own derived seed), at most `concurrency`
in flight. Eval decode parameters are sent explicitly, penalties neutral, so the server's own
sampling defaults cannot leak in. The server returns parsed messages, so the raw text is rebuilt:
reasoning as a `<think>` block, then content, then tool calls in Qwen's XML form, which is what the
eval scorers read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx

from kiln.evals.generator import GenerationRequest, GenerationResult, GeneratorIdentity

DEFAULT_CONCURRENCY = 32


class RemoteGenerator:
    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 concurrency: int = DEFAULT_CONCURRENCY, timeout: float = 600.0,
                 client: httpx.AsyncClient | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.AsyncClient(timeout=timeout, headers=headers)
        self._owns_client = client is None
        self._limit = asyncio.Semaphore(max(1, concurrency))

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    # -- Generator ------------------------------------------------------------------------------------
    async def identity(self) -> GeneratorIdentity:
        model = await self.resolve_model()
        return GeneratorIdentity(
            execution_provenance={"schema": "kiln.execution-provenance.v1", "engine": "openai-compatible",
                                  "base_url": self.base_url, "model": model},
            # A remote server's weights cannot be attested from here: the manifest names the model only.
            base_weight_manifest={"schema": "kiln.base-weight-manifest.v1", "format": "remote", "model": model,
                                  "files": []},
        )

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        model = await self.resolve_model()
        return list(await asyncio.gather(*(self._one(model, r) for r in requests)))

    # -- helpers --------------------------------------------------------------------------------------
    async def resolve_model(self) -> str:
        """The configured model, else the first one the server lists."""
        if self.model is None:
            resp = await self._client.get(self.base_url + "/models")
            resp.raise_for_status()
            data = resp.json().get("data") or []
            if not data:
                raise RuntimeError(f"{self.base_url}/models lists no model; pass the model name explicitly")
            self.model = str(data[0]["id"])
        return self.model

    async def _one(self, model: str, req: GenerationRequest) -> GenerationResult:
        async with self._limit:
            started = time.perf_counter()
            try:
                resp = await self._client.post(self.base_url + "/chat/completions", json=request_body(model, req))
            except httpx.HTTPError as e:
                return GenerationResult.failed(f"generation failed: {type(e).__name__}: {e}",
                                               latency_ms=_ms_since(started))
            latency = _ms_since(started)
        if resp.status_code >= 400:
            return GenerationResult.failed(f"generation failed: HTTP {resp.status_code}: {_error_text(resp)}",
                                           latency_ms=latency)
        try:
            return parse_response(resp.json(), latency)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            return GenerationResult.failed(f"generation failed: unreadable response: {e}", latency_ms=latency)


def request_body(model: str, req: GenerationRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": req.messages,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "stream": False,
    }
    if req.top_k > 0:  # 0 is "off" for Kiln but not for every server: leave it out
        body["top_k"] = req.top_k
    if req.seed is not None:
        body["seed"] = req.seed
    if req.stop:
        body["stop"] = list(req.stop)
    if req.tools:
        body["tools"] = list(req.tools)
    if req.chat_template_kwargs:
        body["chat_template_kwargs"] = dict(req.chat_template_kwargs)
    if req.adapter is not None:
        body["adapter"] = req.adapter
    budget = req.thinking_budget
    if budget is not None:
        # Only what the suite set explicitly: "inherit" leaves the server's own default in charge.
        for field, value, source in (("thinking_budget_tokens", budget.max_tokens, budget.tokens_source),
                                     ("thinking_budget_ms", budget.max_time_ms, budget.time_source)):
            if source not in ("unlimited", "server_default"):
                body[field] = value
    return body


def raw_text(message: dict[str, Any]) -> str:
    """The completion as the model wrote it, rebuilt from the parsed message."""
    out = ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        out += f"<think>\n{reasoning}\n</think>\n\n"
    out += message.get("content") or ""
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        with contextlib.suppress(ValueError):  # unparseable: keep the text the server gave
            args = json.loads(args) if isinstance(args, str) else args
        payload = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
        out += ("\n" if out else "") + f"<tool_call>\n{payload}\n</tool_call>"
    return out


def parse_response(body: dict[str, Any], latency_ms: float) -> GenerationResult:
    choice = body["choices"][0]
    usage = body.get("usage") or {}
    metadata = body.get("metadata") or {}
    budget = metadata.get("thinking_budget") if isinstance(metadata, dict) else None
    finish = choice.get("finish_reason") or "stop"
    return GenerationResult(
        text=raw_text(choice["message"]),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        latency_ms=latency_ms,
        finish_reason="stop" if finish == "tool_calls" else finish,
        thinking_budget=budget if isinstance(budget, dict) else None,
    )


def _error_text(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error")
    except ValueError:
        return resp.text[:200]
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err or resp.text[:200])


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000.0
