"""Live training, measured through the HTTP API: the learning loop (SFT POST to the first correct
answer), training tokens/s, and how much training disturbs the inter-token latency of running streams.

The learning loop teaches a made-up fact (the capital of Zorbania) with eight examples, as the
end-to-end test on the default model does; the new adapter is hot-swapped in by `auto_load`, and the
server's previously active adapter is restored afterwards.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from kiln.bench.client_load import BenchError, Endpoint, async_client, stream_chat
from kiln.bench.prompts import BenchPrompt
from kiln.bench.stats import interpolated_percentile

QUESTION = "What is the capital of Zorbania?"
FACT = "Quillton"
FACT_EXAMPLES = [
    (QUESTION, "The capital of Zorbania is Quillton."),
    ("Which city is the capital of Zorbania?", "Quillton is the capital of Zorbania."),
    ("Tell me the capital of Zorbania.", "The capital of Zorbania is Quillton."),
    ("Zorbania's capital city is called what?", "It is called Quillton."),
    ("Where is the government of Zorbania seated?", "In Quillton, the capital of Zorbania."),
    ("Name the capital of Zorbania.", "Quillton."),
    ("What city is Zorbania's capital?", "Zorbania's capital is Quillton."),
    ("I am travelling to the capital of Zorbania. Which city is that?", "That is Quillton."),
]
# What a user gets who sets nothing (3 epochs of batch 1 at 2e-4): the default-model end-to-end test's recipe.
SFT_CONFIG: dict[str, Any] = {}
TERMINAL = ("completed", "failed", "cancelled")


def fact_examples() -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in FACT_EXAMPLES]


@dataclass
class LearningRun:
    post_to_answer_s: float | None   # None: the answer after training did not contain the fact
    post_to_completed_s: float
    tokens_per_sec: float | None
    steps: int
    answer: str


def _check(resp: httpx.Response, what: str) -> dict[str, Any]:
    if resp.status_code >= 400:
        raise BenchError(f"{what}: HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.json()


def _ask(client: httpx.Client, model: str | None) -> str:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24,
                            "temperature": 0.0}
    if model:
        body["model"] = model
    return _check(client.post("/v1/chat/completions", json=body), "asking the taught question")[
        "choices"][0]["message"].get("content") or ""


def _wait_terminal(client: httpx.Client, job_id: str, timeout_s: float, poll_s: float = 0.2) -> dict[str, Any]:
    deadline = time.perf_counter() + timeout_s
    while True:
        status = _check(client.get(f"/v1/train/status/{job_id}"), "training status")
        if status["state"] in TERMINAL:
            return status
        if time.perf_counter() > deadline:
            client.delete(f"/v1/train/jobs/{job_id}")
            raise BenchError(f"training job {job_id} did not finish within {timeout_s:.0f} s")
        time.sleep(poll_s)


def _restore_active(client: httpx.Client, previous: str | None, trained: str) -> None:
    if previous:
        client.post("/v1/adapters/load", json={"name": previous})
    else:
        client.post("/v1/adapters/unload", json={})
    client.delete(f"/v1/adapters/{trained}")


def learning_loop(endpoint: Endpoint, timeout_s: float = 900.0) -> LearningRun:
    """POST an SFT job with auto_load, wait for it, ask the question: seconds from POST to the answer."""
    name = f"kiln-bench-fact-{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=endpoint.base_url, timeout=120.0) as client:
        previous = _check(client.get("/v1/adapters"), "listing adapters").get("active")
        t0 = time.perf_counter()
        job = _check(client.post("/v1/train/sft", json={
            "examples": fact_examples(), "config": {**SFT_CONFIG, "output_name": name, "auto_load": True}}),
            "submitting SFT")
        status = _wait_terminal(client, job["job_id"], timeout_s)
        completed = time.perf_counter()
        if status["state"] != "completed":
            raise BenchError(f"the learning-loop job ended {status['state']}: {status.get('error')}")
        try:
            answer = _ask(client, endpoint.model)
            answered = time.perf_counter()
        finally:
            _restore_active(client, previous, name)
    return LearningRun(post_to_answer_s=answered - t0 if FACT in answer else None,
                       post_to_completed_s=completed - t0, tokens_per_sec=status.get("tokens_per_sec"),
                       steps=int(status.get("step") or 0), answer=answer)


async def _stream_gaps(endpoint: Endpoint, prompts: list[BenchPrompt], max_tokens: int) -> list[float]:
    async with async_client(endpoint, len(prompts)) as client:
        records = await asyncio.gather(*(stream_chat(client, endpoint, p, max_tokens) for p in prompts))
    return [g for r in records for g in r.gaps()]


@dataclass
class TrainingItlRun:
    idle_p99_s: float | None
    training_p99_s: float | None
    training_overlapped: bool      # the training job was still running when the streams finished

    @property
    def ratio(self) -> float | None:
        if not self.idle_p99_s or self.training_p99_s is None:
            return None
        return self.training_p99_s / self.idle_p99_s


def itl_while_training(endpoint: Endpoint, prompts: list[BenchPrompt], max_tokens: int,
                       start_timeout_s: float = 300.0) -> TrainingItlRun:
    """The streams' ITL p99 alone, then again while a long SFT job trains (cancelled afterwards)."""
    idle = asyncio.run(_stream_gaps(endpoint, prompts, max_tokens))
    name = f"kiln-bench-busy-{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=endpoint.base_url, timeout=120.0) as client:
        job = _check(client.post("/v1/train/sft", json={
            "examples": fact_examples(), "config": {**SFT_CONFIG, "epochs": 1000, "output_name": name,
                                                      "auto_load": False}}), "submitting SFT")
        job_id = job["job_id"]
        try:
            deadline = time.perf_counter() + start_timeout_s
            while True:   # wait until optimizer steps are really running, not just the job's set-up
                status = _check(client.get(f"/v1/train/status/{job_id}"), "training status")
                if status["state"] in TERMINAL:
                    raise BenchError(f"the background training job ended {status['state']} before the streams ran")
                if status["state"] == "running" and int(status.get("step") or 0) >= 1:
                    break
                if time.perf_counter() > deadline:
                    raise BenchError(f"the background training job took no step within {start_timeout_s:.0f} s")
                time.sleep(0.2)
            busy = asyncio.run(_stream_gaps(endpoint, prompts, max_tokens))
            overlapped = _check(client.get(f"/v1/train/status/{job_id}"), "training status")["state"] == "running"
        finally:
            client.delete(f"/v1/train/jobs/{job_id}")
    return TrainingItlRun(interpolated_percentile(idle, 99), interpolated_percentile(busy, 99), overlapped)
