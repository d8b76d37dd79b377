"""Load generation over the OpenAI chat API with streaming: one stream, N concurrent streams, and
streams that keep decoding while a long prompt arrives. Works against any OpenAI-compatible server
(Kiln, llama.cpp's server); every time is `time.perf_counter()` on the client.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kiln.bench.prompts import BenchPrompt
from kiln.bench.stats import interpolated_percentile


class BenchError(RuntimeError):
    """A server answered a benchmark request with an error, or broke the stream."""


@dataclass
class Endpoint:
    name: str
    base_url: str                     # http://host:port (no /v1)
    model: str | None = None
    # Fields merged into every request body: how this server is told to ignore EOS.
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 900.0


@dataclass
class StreamRecord:
    start: float
    token_times: list[float] = field(default_factory=list)   # arrival of each chunk carrying output
    end: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def decode_tps(self) -> float | None:
        """(tokens - 1) / (last token time - first token time): the first token is the prefill's."""
        if len(self.token_times) < 2 or self.num_tokens < 2:
            return None
        span = self.token_times[-1] - self.token_times[0]
        return (self.num_tokens - 1) / span if span > 0 else None

    @property
    def prefill_tps(self) -> float | None:
        ttft = self.ttft
        return self.prompt_tokens / ttft if self.prompt_tokens and ttft else None

    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def chat_body(endpoint: Endpoint, prompt: BenchPrompt, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": prompt.messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint.model:
        body["model"] = endpoint.model
    return {**body, **endpoint.extra_body, **prompt.extra}


def _has_output(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


async def stream_chat(client: httpx.AsyncClient, endpoint: Endpoint, prompt: BenchPrompt, max_tokens: int,
                      on_token: Callable[[StreamRecord], None] | None = None) -> StreamRecord:
    """Send one streaming chat completion; record when each output chunk arrives."""
    record = StreamRecord(start=time.perf_counter())
    body = chat_body(endpoint, prompt, max_tokens)
    async with client.stream("POST", endpoint.base_url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code >= 400:
            text = (await resp.aread()).decode(errors="replace")
            raise BenchError(f"{endpoint.name}: HTTP {resp.status_code}: {text[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(payload)
            if "error" in chunk:
                raise BenchError(f"{endpoint.name}: error in stream: {chunk['error']}")
            if _has_output(chunk):
                record.token_times.append(now)
                if on_token is not None:
                    on_token(record)
            usage = chunk.get("usage")
            if usage:
                record.prompt_tokens = usage.get("prompt_tokens")
                record.completion_tokens = usage.get("completion_tokens")
    record.end = time.perf_counter()
    if record.prompt_tokens is None:
        record.prompt_tokens = prompt.num_tokens
    if not record.token_times:
        raise BenchError(f"{endpoint.name}: the stream ended without any output token")
    return record


def async_client(endpoint: Endpoint, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections + 2, max_keepalive_connections=connections + 2)
    return httpx.AsyncClient(timeout=httpx.Timeout(endpoint.timeout_s, connect=30.0), limits=limits)


async def single_stream(endpoint: Endpoint, prompt: BenchPrompt, max_tokens: int) -> StreamRecord:
    async with async_client(endpoint, 1) as client:
        return await stream_chat(client, endpoint, prompt, max_tokens)


@dataclass
class LoadRun:
    """N requests through `concurrency` streams; also what the sequential references report."""
    concurrency: int
    wall_s: float
    latencies_s: list[float]
    completion_tokens: int

    @property
    def aggregate_tps(self) -> float | None:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else None

    def latency_percentile(self, q: float) -> float | None:
        return interpolated_percentile(self.latencies_s, q)


async def concurrent_streams(endpoint: Endpoint, prompts: Sequence[BenchPrompt], concurrency: int,
                             max_tokens: int) -> LoadRun:
    """Closed loop: `concurrency` workers each send their next request as soon as the last one ends."""
    queue: asyncio.Queue[BenchPrompt] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    records: list[StreamRecord] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            records.append(await stream_chat(client, endpoint, prompt, max_tokens))

    async with async_client(endpoint, concurrency) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return LoadRun(concurrency=concurrency, wall_s=wall, latencies_s=[r.latency for r in records],
                   completion_tokens=sum(r.num_tokens for r in records))


@dataclass
class ItlRun:
    gaps_s: list[float]          # inter-token gaps of the decoding streams over the whole run
    long_prompt_tokens: int
    long_ttft_s: float | None
    triggered_after_tokens: int  # fewest tokens any stream had produced when the long prompt was sent

    def gap_percentile(self, q: float) -> float | None:
        return interpolated_percentile(self.gaps_s, q)


async def streams_with_long_arrival(endpoint: Endpoint, stream_prompts: Sequence[BenchPrompt],
                                    long_prompt: BenchPrompt, max_tokens: int, trigger_tokens: int,
                                    long_max_tokens: int = 8) -> ItlRun:
    """Start the streams; once each has produced `trigger_tokens` (or one has finished, for servers
    that run one request at a time) send the long prompt; collect the streams' inter-token gaps."""
    trigger = asyncio.Event()
    produced = [0] * len(stream_prompts)

    def on_token_for(i: int) -> Callable[[StreamRecord], None]:
        def on_token(rec: StreamRecord) -> None:
            produced[i] = len(rec.token_times)
            if min(produced) >= trigger_tokens:
                trigger.set()
        return on_token

    async def stream(client: httpx.AsyncClient, i: int) -> StreamRecord:
        try:
            return await stream_chat(client, endpoint, stream_prompts[i], max_tokens, on_token_for(i))
        finally:
            trigger.set()   # a finished (or failed) stream must not leave the long request waiting

    async def long_request(client: httpx.AsyncClient) -> tuple[StreamRecord, int]:
        await trigger.wait()
        at = min(produced)
        return await stream_chat(client, endpoint, long_prompt, long_max_tokens), at

    async with async_client(endpoint, len(stream_prompts) + 1) as client:
        results = await asyncio.gather(*(stream(client, i) for i in range(len(stream_prompts))),
                                       long_request(client))
    streams: list[StreamRecord] = list(results[:-1])  # type: ignore[arg-type]
    long_rec, at = results[-1]  # type: ignore[misc]
    return ItlRun(gaps_s=[g for r in streams for g in r.gaps()], long_prompt_tokens=long_rec.prompt_tokens or 0,
                  long_ttft_s=long_rec.ttft, triggered_after_tokens=at)


async def discover_model(endpoint: Endpoint) -> str | None:
    """The first model id the server lists (Kiln and llama.cpp each serve one model)."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        try:
            resp = await client.get(endpoint.base_url + "/v1/models")
            data = resp.json().get("data") or []
        except (httpx.HTTPError, ValueError):
            return None
    return data[0].get("id") if data else None


async def _json_field(endpoint: Endpoint, route: str, *keys: str) -> str | None:
    """GET `route` and follow `keys` into its JSON answer; None when any of them is missing."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        try:
            value = (await client.get(endpoint.base_url + route)).json()
            for key in keys:
                value = value.get(key)
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
    return None if value is None else str(value)


async def config_model_field(endpoint: Endpoint, name: str) -> str | None:
    """One field of the model block of the server's /v1/config answer (Kiln's resolved `quantization`),
    None when it has none."""
    return await _json_field(endpoint, "/v1/config", "model", name)


async def health_field(endpoint: Endpoint, name: str) -> str | None:
    """One field of the server's /health answer (Kiln's `cpu_isa`), None when it has none."""
    return await _json_field(endpoint, "/health", name)
