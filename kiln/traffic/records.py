"""Records of what was served: one `CompletionRecord` per finished chat or batch request.

The request path builds a record when a request ends -- completed, failed or cancelled -- and hands
it to `CompletionRecorder.finished`, the one "completion finished" point. The recorder fans it out:
the in-memory `RecentRequests` ring (`GET /v1/stats/recent-requests`, previews only on the wire), the
durable request log (`kiln.traffic.request_log`, full rows, when `[request_log] enabled`), and any
listeners (the Prometheus counters). Recording never fails or blocks a request: the ring is a locked
deque append, the log a bounded-queue put, and a listener that raises is logged and skipped.

Corrections (`kiln.train.corrections`) name a served completion by its response id (`chatcmpl-...`);
`messages_for` finds the conversation that produced it, in the ring first, then in the log.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kiln.core.messages import message_text
from kiln.core.thinking_mode import recent_thinking_mode
from kiln.store.clock import utc_now_rfc3339

if TYPE_CHECKING:
    from kiln.engine.chat_request import ChatInput

log = logging.getLogger("kiln.engine")

DEFAULT_CAPACITY = 100
DEFAULT_PREVIEW_CHARS = 200
# The ring keeps a record's full messages (what a correction by id needs) up to this many characters
# of text; a larger conversation keeps its previews only, and the request log holds it in full.
RING_CAPTURE_CHARS = 256 * 1024
LOG_SCHEMA = "kiln.request_log.v1"

OK, ERROR, REJECTED, TIMEOUT, CANCELLED = "ok", "error", "rejected", "timeout", "cancelled"
STATUSES = (OK, ERROR, REJECTED, TIMEOUT, CANCELLED)


@dataclass
class ChoiceRecord:
    """One generated choice as the client received it (streams reassembled)."""

    index: int
    content: str
    finish_reason: str
    completion_tokens: int
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    prompt_index: int | None = None     # batch items: which prompt

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


@dataclass
class CompletionRecord:
    id: str                               # the response id: chatcmpl-... / batchcmpl-...
    request_id: str                       # the client's X-Request-Id, else a generated req-...
    kind: str                             # chat | batch
    model: str
    status: str = OK                      # ok | error | rejected | timeout | cancelled
    finish_reason: str = "stop"           # choice 0's; "error" / "cancelled" when it never finished
    created: int = field(default_factory=lambda: int(time.time()))
    adapter: str = "base"                 # adapter_used: "base", a name, or a composition label
    adapters: list[dict[str, Any]] = field(default_factory=list)   # [{name, scale, revision}]
    messages: list[dict[str, Any]] | None = None          # chat: the request's conversation
    prompts: list[list[dict[str, Any]]] | None = None     # batch: one conversation per prompt
    tools: list[Any] | None = None
    choices: list[ChoiceRecord] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    duration_ms: float = 0.0
    ttft_ms: float | None = None
    streamed: bool = False
    error: str | None = None
    thinking_budget: dict[str, Any] | None = None   # thinking-budget-v1 recentRecord
    thinking_mode: str | None = None
    finished_at: str = field(default_factory=utc_now_rfc3339)

    # ---- wire forms ---------------------------------------------------------------------------
    def recent(self, preview_chars: int = DEFAULT_PREVIEW_CHARS) -> dict[str, Any]:
        """The `GET /v1/stats/recent-requests` row: previews, counts, timing, outcome."""
        out: dict[str, Any] = {
            "id": self.id, "object": "kiln.recent_request", "request_id": self.request_id, "kind": self.kind,
            "created": self.created, "model": self.model, "adapter": self.adapter,
        }
        if self.adapters:
            out["adapters"] = [dict(a) for a in self.adapters]
        out.update({
            "status": self.status, "finish_reason": self.finish_reason, "streamed": self.streamed,
            "prompt_preview": preview(self.prompt_text(), preview_chars),
            "completion_preview": preview(self.choices[0].content if self.choices else "", preview_chars),
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "duration_ms": round(self.duration_ms, 3),
            "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 3),
        })
        if self.kind == "batch":
            out["num_prompts"] = len(self.prompts or [])
        out["num_choices"] = len(self.choices)
        if self.thinking_mode is not None:
            out["thinking_mode"] = self.thinking_mode
        if self.thinking_budget is not None:
            out["thinking_budget"] = dict(self.thinking_budget)
        if self.error is not None:
            out["error"] = self.error
        out["correctable"] = self.correctable
        return out

    def log_row(self) -> dict[str, Any]:
        """One request-log line: everything needed to replay, audit or train on the request."""
        row: dict[str, Any] = {
            "schema": LOG_SCHEMA, "id": self.id, "request_id": self.request_id, "kind": self.kind,
            "created": self.created, "finished_at": self.finished_at, "model": self.model,
            "adapter": self.adapter, "adapters": [dict(a) for a in self.adapters], "status": self.status,
            "finish_reason": self.finish_reason, "streamed": self.streamed,
        }
        if self.messages is not None:
            row["messages"] = self.messages
        if self.prompts is not None:
            row["prompts"] = self.prompts
        if self.tools:
            row["tools"] = self.tools
        row["choices"] = [_choice_row(c) for c in self.choices]
        row["sampling"] = self.sampling
        row["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                        "total_tokens": self.prompt_tokens + self.completion_tokens}
        row["duration_ms"] = round(self.duration_ms, 3)
        row["ttft_ms"] = None if self.ttft_ms is None else round(self.ttft_ms, 3)
        if self.thinking_budget is not None:
            row["thinking_budget"] = self.thinking_budget
        if self.error is not None:
            row["error"] = self.error
        return row

    # ---- reading ------------------------------------------------------------------------------
    @property
    def correctable(self) -> bool:
        """The full conversation is held, so a correction can name this record by id."""
        return self.messages is not None or bool(self.prompts)

    def prompt_text(self) -> str:
        conv = self.messages if self.messages is not None else (self.prompts[0] if self.prompts else [])
        return last_user_text(conv)

    def conversation(self, prompt_index: int = 0) -> list[dict[str, Any]] | None:
        if self.messages is not None:
            return self.messages
        if self.prompts and 0 <= prompt_index < len(self.prompts):
            return self.prompts[prompt_index]
        return None

    def answer(self, prompt_index: int = 0) -> ChoiceRecord | None:
        for c in self.choices:
            if (c.prompt_index or 0) == prompt_index:
                return c
        return None


def _choice_row(c: ChoiceRecord) -> dict[str, Any]:
    row: dict[str, Any] = {"index": c.index}
    if c.prompt_index is not None:
        row["prompt_index"] = c.prompt_index
    row.update({"message": c.message(), "finish_reason": c.finish_reason, "completion_tokens": c.completion_tokens})
    return row


def record_from_log_row(row: dict[str, Any]) -> CompletionRecord:
    """A request-log line back as a record (corrections look requests up by id in the log)."""
    choices = []
    for c in row.get("choices") or []:
        msg = c.get("message") or {}
        choices.append(ChoiceRecord(int(c.get("index", 0)), msg.get("content") or "", c.get("finish_reason", "stop"),
                                    int(c.get("completion_tokens", 0)), msg.get("reasoning_content"),
                                    msg.get("tool_calls"), c.get("prompt_index")))
    usage = row.get("usage") or {}
    return CompletionRecord(
        id=row["id"], request_id=row.get("request_id", ""), kind=row.get("kind", "chat"), model=row.get("model", ""),
        status=row.get("status", OK), finish_reason=row.get("finish_reason", "stop"),
        created=int(row.get("created", 0)), adapter=row.get("adapter", "base"), adapters=row.get("adapters") or [],
        messages=row.get("messages"), prompts=row.get("prompts"), tools=row.get("tools"), choices=choices,
        sampling=row.get("sampling") or {}, prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)), duration_ms=float(row.get("duration_ms") or 0),
        ttft_ms=row.get("ttft_ms"), streamed=bool(row.get("streamed")), error=row.get("error"),
        thinking_budget=row.get("thinking_budget"), finished_at=row.get("finished_at", ""),
    )


def last_user_text(messages: Iterable[dict[str, Any]]) -> str:
    msgs = list(messages)
    for m in reversed(msgs):
        if m.get("role") == "user":
            return message_text(m.get("content"))
    return message_text(msgs[-1].get("content")) if msgs else ""


def preview(text: str, limit: int) -> str:
    """At most `limit` characters, with an ellipsis when cut (never splits a code point)."""
    if limit <= 0:
        return ""
    return text if len(text) <= limit else text[:limit] + "…"


def text_chars(messages: Iterable[dict[str, Any]] | None) -> int:
    return sum(len(message_text(m.get("content"))) for m in messages or [])


def recent_budget(effective: dict[str, Any], applied: bool | None = None,
                  outcome: dict[str, Any] | None = None) -> dict[str, Any]:
    """thinking-budget-v1 `recentRecord`: the effective fragment, then `applied` once applicability
    was established, then the terminal outcome only when one is known (absent when inert)."""
    out = dict(effective)
    if applied is None:
        return out
    out["applied"] = applied
    if applied and outcome is not None:
        out["triggered"] = bool(outcome.get("triggered"))
        for key in ("trigger", "closed", "thinking_tokens", "thinking_time_ms"):
            if key in outcome:
                out[key] = outcome[key]
    return out


def adapter_identity(target: Any) -> list[dict[str, Any]]:
    """[{name, scale, revision}] of an AdapterTarget (its key); [] for the base model."""
    if target is None:
        return []
    return [{"name": name, "scale": scale, "revision": revision} for name, scale, revision in target.key]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def rehearsal_rows(records: Iterable[CompletionRecord], n: int, *, exclude_ids: Iterable[str] = (),
                   exclude_prompts: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Up to `n` sft_chat rows of answers the server gave and nobody corrected, newest first: trained
    beside a few corrections they hold the rest of the model's behaviour in place (rehearsal), so
    teaching one country's capital does not make every capital the new one.

    Eligible: a finished single-choice chat (status ok, finish stop) without tools whose prompt is not
    one of the corrected prompts; one row per distinct last user turn.
    """
    ids = set(exclude_ids)
    seen = {_norm(p) for p in exclude_prompts}
    rows: list[dict[str, Any]] = []
    for rec in records:
        if len(rows) >= n:
            break
        if (rec.kind != "chat" or rec.status != OK or rec.id in ids
                or rec.request_id in ids or rec.messages is None or rec.tools or len(rec.choices) != 1):
            continue
        answer = rec.choices[0]
        key = _norm(rec.prompt_text())
        if key in seen or answer.finish_reason != "stop" or not answer.content.strip() or answer.tool_calls:
            continue
        seen.add(key)
        rows.append({"messages": [*rec.messages, {"role": "assistant", "content": answer.content}]})
    return rows


def rejected_record(kind: str, inp: ChatInput, *, model: str, request_id: str, status: str, error: str,
                    duration_ms: float, budget: dict[str, Any] | None,
                    prompts: list[list[dict[str, Any]]] | None = None) -> CompletionRecord:
    """A parsed request that failed before it ran: no tokens, the budget as far as it resolved."""
    prefix = "batchcmpl-" if kind == "batch" else "chatcmpl-"
    return CompletionRecord(
        id=prefix + uuid.uuid4().hex, request_id=request_id, kind=kind, model=model, status=status,
        finish_reason="error", messages=None if kind == "batch" else inp.messages, prompts=prompts,
        tools=inp.tools, duration_ms=duration_ms, streamed=inp.stream, error=error,
        thinking_budget=None if budget is None else recent_budget(budget),
        thinking_mode=recent_thinking_mode(inp.chat_template_kwargs),
    )


class RecentRequests:
    """The last `capacity` records, newest first; thread-safe (handlers on the loop, threadpool readers)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, capture_chars: int = RING_CAPTURE_CHARS,
                 preview_chars: int = DEFAULT_PREVIEW_CHARS) -> None:
        self.capacity = max(1, capacity)
        self.preview_chars = preview_chars   # what `rows` previews of each prompt and completion
        self.capture_chars = capture_chars
        self._items: deque[CompletionRecord] = deque(maxlen=self.capacity)
        self._lock = threading.Lock()

    def add(self, rec: CompletionRecord) -> None:
        held = text_chars(rec.messages) + sum(text_chars(p) for p in rec.prompts or [])
        if held > self.capture_chars:
            rec = replace(rec, messages=None, prompts=None)
        with self._lock:
            self._items.append(rec)

    def list(self, limit: int | None = None) -> list[CompletionRecord]:
        with self._lock:
            items = list(reversed(self._items))
        return items if limit is None else items[:limit]

    def rows(self, limit: int | None = None, *, status: str | None = None,
             kind: str | None = None) -> list[dict[str, Any]]:
        """The wire rows of GET /v1/stats/recent-requests, newest first."""
        recs = [r for r in self.list() if (status is None or r.status == status) and (kind is None or r.kind == kind)]
        return [r.recent(self.preview_chars) for r in recs[:limit]]

    def find(self, record_id: str) -> CompletionRecord | None:
        """By response id (chatcmpl-...), else by the client's request id; the newest match."""
        with self._lock:
            items = list(reversed(self._items))
        for rec in items:
            if rec.id == record_id:
                return rec
        for rec in items:
            if rec.request_id == record_id:
                return rec
        return None

    def __len__(self) -> int:
        return len(self._items)


class CompletionRecorder:
    """The completion-finished point: ring, request log, listeners. Never raises."""

    def __init__(self, ring: RecentRequests, request_log: Any | None = None,
                 listeners: Iterable[Callable[[CompletionRecord], None]] = ()) -> None:
        self.ring = ring
        self.request_log = request_log      # kiln.traffic.request_log.RequestLog (write/find/close)
        self.listeners = list(listeners)

    def finished(self, rec: CompletionRecord) -> None:
        try:
            self.ring.add(rec)
            if self.request_log is not None:
                self.request_log.write(rec.log_row())
        except Exception:  # noqa: BLE001 - recording must never fail the request it describes
            log.exception("recording request %s failed", rec.id)
        for listener in self.listeners:
            try:
                listener(rec)
            except Exception:  # noqa: BLE001
                log.exception("a completion listener failed on %s", rec.id)

    def find(self, record_id: str) -> CompletionRecord | None:
        """The record of a served completion: the ring, else the request log (newest first)."""
        rec = self.ring.find(record_id)
        if rec is not None and rec.correctable:
            return rec
        if self.request_log is not None:
            row = self.request_log.find(record_id)
            if row is not None:
                return record_from_log_row(row)
        return rec

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until every record handed over so far is in the request log (True when there is none)."""
        return self.request_log.flush(timeout) if self.request_log is not None else True

    def close(self) -> None:
        """Flush the request log and stop its writer; later records still reach the ring. Idempotent."""
        if self.request_log is not None:
            self.request_log.close()
