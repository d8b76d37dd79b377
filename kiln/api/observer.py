"""The one observer of served traffic: everything the server records about a request it served or
refused goes through `TrafficObserver`, which feeds the Prometheus series (kiln.api.metrics), the
recent-request ring and the request log (kiln.traffic.records.CompletionRecorder, whose listener is the
metrics' per-record counters), and the request's access line (kiln.api.access_log).

`kiln.server.build_server` builds one (`state.services.traffic`); publishing an engine
(`ServerState.engine = engine`) registers it in `Engine.observers`, so every chat and batch completion
reaches it through `Engine.finish_completion` (`completion_started` / `completion_finished`,
kiln.engine.serving.CompletionObserver). What the engine's completion path never sees comes from the
routes: `refusals(started, kind)` wraps parse, prepare and admit -- a refusal counts in
kiln_requests_total by the class of its status and, for a chat or batch body that parsed, lands in the
ring as a rejected record -- and `served(started, ...)` reports a success the route completed itself
(prompt scoring, legacy completions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.api.access_log import current_request_id, new_request_id, note_request
from kiln.config import ServerSettings
from kiln.core.thinking_budget import resolve_budget
from kiln.engine.chat_response import status_of
from kiln.engine.served_records import record_from_finished
from kiln.engine.timing import now
from kiln.errors import KilnError
from kiln.traffic.records import CompletionRecorder, rejected_record

if TYPE_CHECKING:
    from kiln.api.metrics import KilnMetrics
    from kiln.engine.chat_response import FinishedCompletion


@dataclass
class Seen:
    """What a route learned about a request before it failed (recorded by `TrafficObserver.refusals`)."""

    request_id: str
    inp: Any = None                 # kiln.engine.chat_request.ChatInput, once parsed
    prompts: list | None = None     # a batch's conversations


class TrafficObserver:
    """Completions the engine ran, refusals and route-completed successes, fanned out to every record."""

    def __init__(self, settings: ServerSettings, metrics: KilnMetrics, recorder: CompletionRecorder,
                 served_model: Callable[[], str]) -> None:
        self.settings = settings
        self.metrics = metrics
        self.recorder = recorder
        self._served_model = served_model   # the published engine's model id, "" while it loads

    # ---- kiln.engine.serving.CompletionObserver -----------------------------------------------------
    def completion_started(self) -> None:
        self.metrics.completion_started()

    def completion_finished(self, done: FinishedCompletion) -> None:
        self.metrics.completion_finished(done)
        rec = record_from_finished(done)
        if rec is not None:
            self.recorder.finished(rec)
        # the request's access line: what was generated, for whom, how fast
        ttft = done.timeline.ttft_ms() if done.timeline is not None else None
        note_request(model=done.model, adapter=done.adapter, prompt_tokens=done.prompt_tokens,
                     completion_tokens=sum(len(o.token_ids) for o in done.outputs),
                     ttft_ms=round(ttft, 1) if ttft is not None else None,
                     finish_reason=",".join(sorted(set(done.finish_reasons))) or done.status)

    # ---- what the routes report ---------------------------------------------------------------------
    def served(self, started: float, **access: Any) -> None:
        """A success the route completed outside the engine's completion path; `access` are the
        access line's generation facts (kiln.api.access_log.NOTE_FIELDS)."""
        if access:
            note_request(**access)
        self.metrics.finished("ok", now() - started)

    @contextlib.contextmanager
    def refusals(self, started: float, kind: str | None = None) -> Iterator[Seen]:
        """A request refused before the engine took it (bad body, model loading, a rule the served model
        decides, a 429) still counts in kiln_requests_total; a chat or batch request (`kind`) whose body
        parsed (`seen.inp`) also gets a recent-request record (status rejected/error, finish_reason
        "error", the budget as far as it resolved)."""
        seen = Seen(current_request_id() or new_request_id())
        try:
            yield seen
        except Exception as e:
            status = status_of(e.status) if isinstance(e, KilnError) else "error"
            if kind is not None and seen.inp is not None:
                self.recorder.finished(self._rejected(kind, seen, e, status, started))
            self.metrics.finished(status, now() - started)
            raise

    def _rejected(self, kind: str, seen: Seen, e: Exception, status: str, started: float) -> Any:
        try:
            budget: dict[str, Any] | None = resolve_budget(seen.inp.budget_fields, self.settings).to_dict()
        except KilnError:
            budget = None  # the budget fields themselves were the problem
        return rejected_record(
            kind, seen.inp, model=self._served_model(), request_id=seen.request_id, status=status,
            error=e.message if isinstance(e, KilnError) else f"{type(e).__name__}: {e}",
            duration_ms=(now() - started) * 1000.0, budget=budget, prompts=seen.prompts)
