"""Corrections: what the model should have answered, kept in an append-only store and trained in.

A correction is a conversation (the messages that produced a served answer, found by the completion's
id in the recent-request ring or the request log, or given inline), the corrected assistant message,
and an optional note. Its SFT row is the `sft_chat` row `{"messages": [...conversation, corrected]}`.

Storage: `<data_dir>/corrections/corrections.jsonl`, one event per line, appended and fsynced
(kiln.store.atomic.append_jsonl): `add`, `delete`, `submitted` (a training job took these ids),
`trained` and `released` (the job ended without serving them: failed, cancelled, or its gate did not
promote the adapter). The state is a replay of the events; a torn line from a crash is skipped, so a
kill loses at most the event being written. A correction is `pending` until a job that trained it
completes with its adapter served, then `trained` (with `trained_into`, the adapter, and the job id).

`CORRECTIONS_SFT_DEFAULTS` is the recipe `POST /v1/corrections/train` fills in for fields its config
leaves out: a handful of corrections must stick after one short job, so it trains several epochs over
the few rows at a high LoRA rate, where the general SFT defaults (3 epochs at 1e-4) are meant for
datasets. Beside them it trains up to `DEFAULT_REPLAY` recent answers the server gave and nobody
corrected (kiln.traffic.records.rehearsal_rows), which keeps the edit from spilling over.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.data.formats import message_problem, messages_problem
from kiln.errors import KilnError
from kiln.store.atomic import append_jsonl, read_jsonl
from kiln.store.clock import utc_now_rfc3339

if TYPE_CHECKING:
    from kiln.engine.view import EngineView

PENDING, TRAINED = "pending", "trained"
STATES = (PENDING, TRAINED)
CODE = "correction_invalid"
FILE = "corrections.jsonl"

# A made-up fact sticks on SmolLM2-135M after this (tests/e2e/test_corrections.py); the rows train as one
# batch per step (corrections + rehearsal, up to MAX_BATCH), so a job is `epochs` steps.
CORRECTIONS_SFT_DEFAULTS: dict[str, Any] = {"epochs": 8, "learning_rate": 2e-3, "lora_rank": 8, "lora_alpha": 16}
MAX_BATCH = 8
# Recent served answers trained beside the corrections (rehearsal). Without them one correction
# bleeds: taught "the capital of Zorbania is Quillton", SmolLM2 then names Quillton the capital of
# France too; with six such answers in the batch it still says Berlin and Rome for Germany and Italy.
DEFAULT_REPLAY = 6


def invalid(message: str, param: str | None = None, hint: str | None = None) -> KilnError:
    return KilnError(400, CODE, "Invalid correction: " + message, param=param,
                     hint=hint or 'Send {"request_id": "chatcmpl-...", "corrected": {"role": "assistant", '
                                  '"content": "..."}} or {"messages": [...], "corrected": ...}.')


def not_found(correction_id: str) -> KilnError:
    return KilnError(404, "correction_not_found", f"no correction {correction_id!r}", param="correction_id",
                     hint="GET /v1/corrections lists them.")


@dataclass
class Correction:
    id: str
    messages: list[dict[str, Any]]          # the conversation the answer was given to
    corrected: dict[str, Any]               # the assistant message it should have been
    created_at: str
    request_id: str | None = None           # the served completion's id (chatcmpl-...), when known
    original: dict[str, Any] | None = None  # what the model answered, when known
    adapter: str | None = None              # what served the original ("base", a name, a composition)
    note: str | None = None
    state: str = PENDING
    training_job_id: str | None = None      # the job training it now, or the one that did
    trained_into: str | None = None
    trained_at: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)   # jobs that took it and how they ended

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        return {k: v for k, v in out.items() if v is not None}

    def sft_row(self) -> dict[str, Any]:
        return {"messages": [*self.messages, self.corrected]}


def normalize_corrected(value: Any) -> dict[str, Any]:
    """A string or an assistant message -> a clean assistant message (400 naming the field)."""
    if isinstance(value, str):
        value = {"role": "assistant", "content": value}
    if not isinstance(value, dict):
        raise invalid("`corrected` must be an assistant message or a string", param="corrected")
    msg = {k: v for k, v in value.items() if v is not None}
    msg.setdefault("role", "assistant")
    if msg["role"] != "assistant":
        raise invalid(f"`corrected.role` must be \"assistant\", got {msg['role']!r}", param="corrected.role")
    problem = message_problem(msg, "corrected")
    if problem:
        raise invalid(problem, param="corrected")
    content = msg.get("content")
    if not msg.get("tool_calls") and not (isinstance(content, str) and content.strip()):
        raise invalid("`corrected.content` must be non-empty text (or the message must carry tool_calls)",
                      param="corrected.content")
    return msg


def split_conversation(messages: Any, param: str = "messages") -> tuple[list[dict[str, Any]], dict | None]:
    """Check a conversation; a trailing assistant turn is the answer being corrected, split off."""
    problem = messages_problem(messages)
    if problem:
        raise invalid(problem, param=param)
    msgs = [dict(m) for m in messages]
    original = msgs.pop() if msgs[-1].get("role") == "assistant" else None
    if not msgs:
        raise invalid("the conversation has no turn before the answer", param=param)
    return msgs, original


class CorrectionStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.path = self.root / FILE
        self._lock = threading.Lock()
        self._items: dict[str, Correction] = {}
        self._replay()

    # ---- persistence ------------------------------------------------------------------------------
    def sweep(self) -> list[str]:
        """Startup sweep: temp files an interrupted write left (appends need none; a torn tail is skipped)."""
        from kiln.store.sweep import sweep_temp_files

        return sweep_temp_files(self.root)

    def _replay(self) -> None:
        for ev in read_jsonl(self.path, skip_invalid=True):
            if isinstance(ev, dict):
                self._apply(ev)

    def _append(self, event: dict[str, Any]) -> None:
        append_jsonl(self.path, [event])
        self._apply(event)

    def _apply(self, ev: dict[str, Any]) -> None:
        op = ev.get("op")
        if op == "add":
            data = dict(ev["correction"])
            self._items[data["id"]] = Correction(**{k: v for k, v in data.items()
                                                    if k in Correction.__dataclass_fields__})
            return
        if op == "delete":
            self._items.pop(ev.get("id"), None)
            return
        for cid in ev.get("ids", []):
            c = self._items.get(cid)
            if c is None:
                continue
            if op == "submitted":
                c.training_job_id = ev["job_id"]
            elif op == "trained" and c.training_job_id == ev.get("job_id"):
                c.state, c.trained_into, c.trained_at = TRAINED, ev.get("adapter"), ev.get("at")
                c.history.append({"job_id": ev.get("job_id"), "outcome": "trained", "at": ev.get("at")})
            elif op == "released" and c.training_job_id == ev.get("job_id"):
                c.training_job_id = None
                c.history.append({"job_id": ev.get("job_id"), "outcome": ev.get("outcome"), "at": ev.get("at")})

    # ---- edits ------------------------------------------------------------------------------------
    def add(self, messages: list[dict[str, Any]], corrected: Any, *, request_id: str | None = None,
            original: dict[str, Any] | None = None, adapter: str | None = None,
            note: str | None = None) -> Correction:
        """`original` given (the served answer of a recorded request): `messages` is the request's
        conversation as sent, kept whole; otherwise a trailing assistant turn is the original."""
        if original is not None:
            problem = messages_problem(messages)
            if problem:
                raise invalid(problem, param="messages")
            conversation, trailing = [dict(m) for m in messages], None
        else:
            conversation, trailing = split_conversation(messages)
        c = Correction(id="corr-" + uuid.uuid4().hex[:16], messages=conversation,
                       corrected=normalize_corrected(corrected), created_at=utc_now_rfc3339(),
                       request_id=request_id, original=original or trailing, adapter=adapter,
                       note=note.strip() if isinstance(note, str) and note.strip() else None)
        with self._lock:
            self._append({"op": "add", "correction": c.to_dict()})
            return self._items[c.id]

    def delete(self, correction_id: str) -> Correction:
        with self._lock:
            c = self._items.get(correction_id)
            if c is None:
                raise not_found(correction_id)
            self._append({"op": "delete", "id": correction_id})
            return c

    def submitted(self, ids: list[str], job_id: str) -> None:
        with self._lock:
            self._append({"op": "submitted", "ids": list(ids), "job_id": job_id})

    def resolve(self, job_id: str, *, trained: bool, adapter: str | None = None, outcome: str = "") -> list[str]:
        """A job that took corrections ended: mark them trained into `adapter`, or release them."""
        with self._lock:
            ids = [c.id for c in self._items.values() if c.training_job_id == job_id and c.state == PENDING]
            if not ids:
                return []
            event: dict[str, Any] = {"op": "trained" if trained else "released", "ids": ids, "job_id": job_id,
                                     "at": utc_now_rfc3339()}
            if trained:
                event["adapter"] = adapter
            else:
                event["outcome"] = outcome
            self._append(event)
            return ids

    # ---- queries ----------------------------------------------------------------------------------
    def get(self, correction_id: str) -> Correction:
        with self._lock:
            c = self._items.get(correction_id)
        if c is None:
            raise not_found(correction_id)
        return c

    def list(self, state: str | None = None) -> list[Correction]:
        """Newest first."""
        with self._lock:
            items = list(self._items.values())
        items.reverse()
        return [c for c in items if state is None or c.state == state]

    def trainable(self) -> list[Correction]:
        """Pending corrections no job is training now, oldest first (the order they were made)."""
        with self._lock:
            return [c for c in self._items.values() if c.state == PENDING and c.training_job_id is None]

    def in_flight(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        with self._lock:
            for c in self._items.values():
                if c.state == PENDING and c.training_job_id is not None:
                    out.setdefault(c.training_job_id, []).append(c.id)
        return out

    def counts(self) -> dict[str, int]:
        with self._lock:
            out = dict.fromkeys(STATES, 0)
            for c in self._items.values():
                out[c.state] += 1
            return out


def job_outcome(job: Any) -> tuple[bool, bool, str]:
    """(decided, trained, outcome) for a training job that took corrections.

    Trained means the job completed and its adapter may serve: no gate, or the gate promoted it.
    A gate still pending is not decided yet.
    """
    if not job.terminal:
        return False, False, job.state
    if job.state != "completed":
        return True, False, job.state
    gate = getattr(job, "gate_outcome", None)
    if gate is None:
        return True, True, "completed"
    if gate == "pending":
        return False, False, gate
    return True, gate == "promoted", f"gate {gate}"


def follow_training(store: CorrectionStore, manager: Any) -> None:
    """Mark corrections trained (or release them) as the jobs that took them end; settle what a
    restart left: the archive says how a job ended, and a job that never ended is gone."""

    def on_job(job: Any) -> None:
        if job.job_id not in store.in_flight():
            return
        decided, trained, outcome = job_outcome(job)
        if decided:
            store.resolve(job.job_id, trained=trained, adapter=job.adapter_name, outcome=outcome)

    manager.listeners.append(on_job)
    for job_id in list(store.in_flight()):
        try:
            job = manager.get(job_id)
        except KilnError:
            store.resolve(job_id, trained=False, outcome="job not found after restart")
            continue
        decided, trained, outcome = job_outcome(job)
        if decided:
            store.resolve(job_id, trained=trained, adapter=job.adapter_name, outcome=outcome)
        elif job.state != "completed":
            store.resolve(job_id, trained=False, outcome="interrupted by a restart")


def corrections_config(config: dict[str, Any], active_name: str | None, num_rows: int) -> dict[str, Any]:
    """The SFT config a corrections job runs with: the caller's fields, then the corrections recipe
    (all rows in one batch, up to MAX_BATCH, so an epoch is one step).

    Without `base_adapter` the job continues the active adapter (what served the corrected answers),
    so what it learned before stays; `"base_adapter": null` starts from the base model.
    """
    out = dict(config)
    out.setdefault("batch_size", max(1, min(num_rows, MAX_BATCH)))
    if "base_adapter" not in out and active_name:
        out["base_adapter"] = active_name
    continuing = out.get("base_adapter") is not None
    for key, value in CORRECTIONS_SFT_DEFAULTS.items():
        if continuing and key in ("lora_rank", "lora_alpha"):
            continue  # a continued adapter keeps its shape
        out.setdefault(key, value)
    if out.get("output_name") is None:
        out["output_name"] = "corrections-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return out


async def submit_corrections(store: CorrectionStore, manager: Any, *, config: dict[str, Any],
                             post_eval: dict[str, Any] | None, rehearsal: Callable[[list[Correction]], list[dict]],
                             parse: Callable[[dict[str, Any]], Any], active_name: str | None, engine: EngineView,
                             adapters: Any, datasets: Any, suites: Any) -> dict[str, Any]:
    """The pending corrections (plus `rehearsal(chosen)` rows) as one SFT job through the training
    path (`parse` makes the SftRequest, 400 naming the field); the training receipt plus
    `corrections` (their ids) and `replayed` (rehearsed rows)."""
    from kiln.train.plan import plan_sft
    from kiln.train.submission import submit_training

    chosen = store.trainable()
    if not chosen:
        in_flight = store.in_flight()
        raise KilnError(409 if in_flight else 400, "no_pending_corrections",
                        "no pending corrections to train" + (
                            f" (job {', '.join(in_flight)} is training the others)" if in_flight else ""),
                        hint="POST /v1/corrections adds one; GET /v1/corrections lists them.")
    replay = rehearsal(chosen)
    rows = [c.sft_row() for c in chosen] + replay
    body: dict[str, Any] = {"examples": rows, "config": corrections_config(config, active_name, len(rows))}
    if post_eval is not None:
        body["post_eval"] = post_eval
    req = parse(body)
    ids = [c.id for c in chosen]
    taken: list[str] = []

    def planner(*args: Any) -> Any:
        plan = plan_sft(*args)
        plan.data.source = "corrections"
        plan.stats["correction_ids"] = ids
        plan.stats["replayed_rows"] = len(replay)
        # Taken before the job exists: a tiny job can finish before submission returns.
        store.submitted(ids, plan.job_id)
        taken.append(plan.job_id)
        return plan

    try:
        receipt = await submit_training(manager, req, planner, engine, adapters, datasets, suites)
    except BaseException:
        for job_id in taken:
            await asyncio.to_thread(store.resolve, job_id, trained=False, outcome="not queued")
        raise
    n = len(ids)
    receipt["message"] = (f"Queued SFT job training adapter `{receipt['adapter_name']}` on {n} correction"
                          f"{'s' if n != 1 else ''} and {len(replay)} rehearsed answer"
                          f"{'s' if len(replay) != 1 else ''}" + receipt["message"][receipt["message"].rfind(" ("):])
    return {**receipt, "corrections": ids, "replayed": len(replay)}
