"""A remote teacher's top-K log-probabilities over a scored sequence, asked of an OpenAI-compatible server.

The request is the one both Kiln's prompt-scoring `/v1/completions` (semantics.md §5.2) and vLLM's
`/v1/completions` answer: the prompt as token ids, `prompt_logprobs: K`, `max_tokens: 1`. Each answer's
`choices[0].prompt_logprobs` is a list, null first, then per position a map `{token id: {logprob, rank}}`
holding the position's top-K and the observed token (with its full-vocabulary rank when outside the
top-K); the K entries ranked best are the teacher's top-K at that position.

A call that gets no answer, a timeout, a 408, a 429 or a 5xx is retried (`attempts` in all, with a
doubling pause); other answers are final. Either way the failure is a `KilnError` naming the teacher and
what it said, so the job fails with that message before it trains (nothing is saved).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
from torch import Tensor

from kiln.errors import KilnError

CODE = "teacher_unavailable"
RETRYABLE = {408, 429, 500, 502, 503, 504}


def _failed(message: str, hint: str) -> KilnError:
    return KilnError(502, CODE, message, param="teacher", hint=hint)


@dataclass
class RemoteTeacher:
    """A registered remote teacher: where it is, which model, and the key (read from the environment
    variable named at registration, when the job runs)."""

    alias: str
    url: str
    model_id: str
    api_key_env: str | None = None
    attempts: int = 3
    backoff_s: float = 0.5
    timeout_s: float = 60.0
    transport: httpx.BaseTransport | None = None
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)

    def _headers(self) -> dict[str, str]:
        if self.api_key_env is None:
            return {}
        key = os.environ.get(self.api_key_env)
        if not key:
            raise _failed(f"teacher {self.alias!r}: environment variable {self.api_key_env} is not set on this server",
                          "Set it where the server starts, then resume the job.")
        return {"Authorization": f"Bearer {key}"}

    def top_k(self, ids: list[int], first: int, k: int, vocab_size: int) -> tuple[Tensor, Tensor]:
        """The teacher's top-K token ids and log-probs predicting each of `ids[first:]`, `[len - first, K]`."""
        body = {"model": self.model_id, "prompt": list(ids), "prompt_logprobs": k, "max_tokens": 1,
                "temperature": 0}
        entries = self._post(body).get("choices", [{}])[0].get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(ids):
            raise _failed(f"teacher {self.alias!r} at {self.url} answered without prompt_logprobs for the "
                          f"{len(ids)} tokens sent", "The teacher must score prompts (Kiln's or vLLM's /v1/completions).")
        top_ids, top_logp = [], []
        for position in range(first, len(ids)):
            ranked = sorted(((int(tid), float(e["logprob"]), int(e.get("rank") or 0))
                             for tid, e in (entries[position] or {}).items()), key=lambda t: (t[2], -t[1], t[0]))
            best = ranked[:k]
            if len(best) < k or any(not 0 <= t[0] < vocab_size for t in best):
                raise _failed(f"teacher {self.alias!r} at {self.url} gave {len(best)} candidates (ids "
                              f"{[t[0] for t in best]}) at position {position}, not {k} ids of this vocabulary",
                              "The teacher must share the student's tokenizer and return prompt_logprobs of K.")
            top_ids.append([t[0] for t in best])
            top_logp.append([t[1] for t in best])
        return torch.tensor(top_ids, dtype=torch.long), torch.tensor(top_logp, dtype=torch.float32)

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        headers = self._headers()
        last = ""
        for attempt in range(self.attempts):
            if attempt:
                self.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                with httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout_s,
                                  transport=self.transport, follow_redirects=False) as client:
                    resp = client.post("/v1/completions", json=body)
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code == 200:
                try:
                    return resp.json()
                except ValueError:
                    raise _failed(f"teacher {self.alias!r} at {self.url} answered with no JSON",
                                  "The teacher must be a Kiln or vLLM server.") from None
            said = _error_message(resp)
            if resp.status_code not in RETRYABLE:
                raise _failed(f"teacher {self.alias!r} at {self.url} refused to score: {resp.status_code} {said}",
                              "Kiln teachers score on their base model only (unload any adapter); check the key "
                              "and model_id.")
            last = f"{resp.status_code} {said}"
        raise _failed(f"teacher {self.alias!r} at {self.url} did not answer after {self.attempts} attempts: {last}",
                      "Check that the teacher server is running, then resume or resubmit the job.")


def _error_message(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error")
        return str(err.get("message") if isinstance(err, dict) else err)[:300]
    except (ValueError, AttributeError):
        return resp.text[:300]
