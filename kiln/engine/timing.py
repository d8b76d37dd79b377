"""Request-local latency accounting: what the actor measures, what the handler adds, and the
`RequestLatencyDiagnostics` / `kiln.token_timing` shapes built from them (inference-api.txt).

Every number here is a measured interval between two `time.perf_counter()` readings. A phase this
serving path never measures (graph capture, GPU lock waits, adapter work, ...) stays None, which the
wire shows as null: nothing is estimated or invented.

Timestamps:
- the actor records, per choice, when the request was submitted, drained from its inbox (received),
  first scheduled (admitted), and for every token when the step that produced it finished (ready)
  and when the event was handed to the handler's loop (delivered);
- the handler records when it dequeued each token (received) and, when streaming, when it queued
  the token's SSE event for the response body (enqueued).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Any

from kiln.core.percentile import percentile

# Retained inter-token gaps per request (RequestLatencyDiagnostics.retained_gap_samples <= 8192).
MAX_GAP_SAMPLES = 8192
# An inter-token gap at or above this is a stall. A quarter second is where a reader of a token
# stream perceives a hitch; a fixed value keeps stall counts comparable across requests.
STALL_THRESHOLD_MS = 250.0
# A stall is "explained" when its dominant measured phase covers at least this share of the gap.
EXPLAINED_SHARE = 0.5

PHASE_FIELDS = (
    "actor_queue_ms", "actor_admission_ms", "tokenization_ms", "prefill_ms", "decode_ms",
    "actor_cycle_idle_ms", "sampling_ms", "readback_ms", "response_delivery_ms", "handler_queue_ms",
    "client_delivery_ms", "gpu_lock_wait_ms", "graph_capture_ms", "graph_replay_ms", "synchronization_ms",
    "resize_ms", "trim_ms", "adapter_ms", "training_ms", "unexplained_ms",
)
STALL_REASONS = (
    "actor_queue", "actor_admission", "actor_prefill", "actor_decode", "actor_cycle_idle",
    "response_delivery", "handler_queue", "client_delivery", "sampling", "readback", "gpu_lock_wait",
    "graph_capture", "graph_replay", "synchronization", "resize", "trim", "adapter", "training",
    "unexplained",
)


def now() -> float:
    return time.perf_counter()


def ms(a: float | None, b: float | None) -> float | None:
    """Milliseconds from a to b, never negative; None when either end was not measured."""
    if a is None or b is None:
        return None
    return max(0.0, (b - a) * 1000.0)


@dataclass(frozen=True)
class StepTiming:
    """One model step on the actor, as the runner measured it."""

    forward_ms: float
    sampling_ms: float
    readback_ms: float
    # the step carried prompt chunks (of this or another request): its forward time is prefill work
    had_prefill: bool = False

    @property
    def phase(self) -> str:
        return "actor_prefill" if self.had_prefill else "actor_decode"


@dataclass
class ChoiceStats:
    """Actor-side timings of one choice; the actor mutates it, the handler reads a copy."""

    submitted_at: float
    received_at: float | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    sampling_ms: float = 0.0
    readback_ms: float = 0.0
    idle_ms: float = 0.0
    prefill_tokens: int = 0
    cached_tokens: int = 0

    def snapshot(self) -> ChoiceStats:
        return replace(self)


@dataclass
class TokenRecord:
    index: int
    token_id: int
    ready_at: float
    delivered_at: float
    received_at: float
    step: StepTiming | None
    idle_ms: float
    enqueued_at: float | None = None


@dataclass
class RequestTimeline:
    """Handler-side record of one choice (choice 0 for multi-choice requests)."""

    started_at: float
    tokenization_ms: float | None = None
    tokens: list[TokenRecord] = field(default_factory=list)
    stats: ChoiceStats | None = None
    finished_at: float | None = None

    def on_event(self, ev: Any) -> list[TokenRecord]:
        """Record a ChoiceEvent's tokens; returns the new records (one per generated token)."""
        received = ev.received_at or now()
        out = []
        for i, token in enumerate(ev.token_ids):
            ready = ev.token_times[i] if i < len(ev.token_times) else received
            rec = TokenRecord(len(self.tokens), token, ready, ev.delivered_at or ready, received,
                              ev.step, ev.idle_ms if i == 0 else 0.0)
            self.tokens.append(rec)
            out.append(rec)
        if ev.stats is not None:
            self.stats = ev.stats
        return out

    # ---- per-token ------------------------------------------------------------------------------
    def _components(self, rec: TokenRecord) -> dict[str, float]:
        """Measured intervals that could have held up this token, by stall-reason name."""
        parts: dict[str, float] = {}
        if rec.index == 0 and self.stats is not None:
            s = self.stats
            parts["actor_queue"] = ms(s.submitted_at, s.received_at) or 0.0
            parts["actor_admission"] = ms(s.received_at, s.admitted_at) or 0.0
            parts["actor_prefill"] = ms(s.admitted_at, rec.ready_at) or 0.0
        elif rec.step is not None:
            parts[rec.step.phase] = rec.step.forward_ms
        if rec.step is not None:
            parts["sampling"] = rec.step.sampling_ms
            parts["readback"] = rec.step.readback_ms
        if rec.idle_ms:
            parts["actor_cycle_idle"] = rec.idle_ms
        parts["response_delivery"] = ms(rec.ready_at, rec.delivered_at) or 0.0
        parts["handler_queue"] = ms(rec.delivered_at, rec.received_at) or 0.0
        if rec.enqueued_at is not None:
            parts["client_delivery"] = ms(rec.received_at, rec.enqueued_at) or 0.0
        return parts

    def blocking_phase(self, rec: TokenRecord) -> tuple[str | None, float | None]:
        parts = self._components(rec)
        if not parts:
            return None, None
        name = max(parts, key=lambda k: parts[k])
        return name, parts[name]

    def token_timing_event(self, rec: TokenRecord) -> dict[str, Any]:
        """A `StreamingTokenTiming` object; call after `rec.enqueued_at` is set."""
        start = self.started_at
        ready = ms(start, rec.ready_at) or 0.0
        delivered = ms(start, rec.delivered_at) or 0.0
        received = ms(start, rec.received_at) or 0.0
        enqueued = ms(start, rec.enqueued_at if rec.enqueued_at is not None else rec.received_at) or 0.0
        response = ms(rec.ready_at, rec.delivered_at) or 0.0
        handler = ms(rec.delivered_at, rec.received_at) or 0.0
        phase, phase_ms = self.blocking_phase(rec)
        return {
            "object": "kiln.token_timing", "source": "batching_engine",
            "token_index": rec.index, "token_id": rec.token_id,
            "ready_ms": _r(ready), "producer_delivered_ms": _r(delivered), "handler_received_ms": _r(received),
            "body_enqueued_ms": _r(enqueued), "response_delivery_ms": _r(response),
            "handler_queue_ms": _r(handler), "queue_delay_ms": _r(response + handler),
            "client_delivery_ms": _r(max(0.0, enqueued - received)),
            "blocking_phase": phase, "blocking_phase_ms": None if phase_ms is None else _r(phase_ms),
        }

    # ---- request totals -------------------------------------------------------------------------
    def ttft_ms(self) -> float | None:
        return ms(self.started_at, self.tokens[0].received_at) if self.tokens else None

    def gaps(self) -> list[tuple[TokenRecord, float]]:
        return [(b, (b.received_at - a.received_at) * 1000.0) for a, b in itertools.pairwise(self.tokens)]

    def phases(self, total_ms: float) -> dict[str, float | None]:
        s = self.stats
        out: dict[str, float | None] = dict.fromkeys(PHASE_FIELDS)
        out["tokenization_ms"] = self.tokenization_ms
        if s is not None:
            out["actor_queue_ms"] = ms(s.submitted_at, s.received_at)
            out["actor_admission_ms"] = ms(s.received_at, s.admitted_at)
            out["prefill_ms"] = s.prefill_ms
            out["decode_ms"] = s.decode_ms
            out["actor_cycle_idle_ms"] = s.idle_ms
            out["sampling_ms"] = s.sampling_ms
            out["readback_ms"] = s.readback_ms
        if self.tokens:
            out["response_delivery_ms"] = sum(ms(t.ready_at, t.delivered_at) or 0.0 for t in self.tokens)
            out["handler_queue_ms"] = sum(ms(t.delivered_at, t.received_at) or 0.0 for t in self.tokens)
            if all(t.enqueued_at is not None for t in self.tokens):
                out["client_delivery_ms"] = sum(ms(t.received_at, t.enqueued_at) or 0.0 for t in self.tokens)
            elif self.finished_at is not None:
                # a JSON body is enqueued once, after the last token
                out["client_delivery_ms"] = ms(self.tokens[-1].received_at, self.finished_at)
        covered = sum(v for k, v in out.items() if v is not None and k != "unexplained_ms")
        out["unexplained_ms"] = max(0.0, total_ms - covered)
        return {k: (None if v is None else _r(v)) for k, v in out.items()}

    def diagnostics(self, total_ms: float) -> dict[str, Any]:
        """`RequestLatencyDiagnostics` over this choice's tokens."""
        gaps = self.gaps()
        values = [g for _, g in gaps]
        retained = values[:MAX_GAP_SAMPLES]
        reasons = dict.fromkeys(STALL_REASONS, 0)
        stalls = 0
        for rec, gap in gaps:
            if gap < STALL_THRESHOLD_MS:
                continue
            stalls += 1
            phase, phase_ms = self.blocking_phase(rec)
            if phase is None or phase_ms is None or phase_ms < EXPLAINED_SHARE * gap:
                phase = "unexplained"
            reasons[phase] += 1
        ordered = sorted(retained)
        return {
            "emitted_tokens": len(self.tokens),
            "gap_samples": len(values),
            "retained_gap_samples": len(retained),
            "gap_samples_truncated": len(values) > len(retained),
            "ttft_ms": _opt(self.ttft_ms()),
            "itl_ms_p50": _opt(percentile(ordered, 50.0)),
            "itl_ms_p99": _opt(percentile(ordered, 99.0)),
            "itl_ms_p999": _opt(percentile(ordered, 99.9)),
            "max_itl_ms": _opt(max(values) if values else None),
            "stall_threshold_ms": STALL_THRESHOLD_MS,
            "stall_count": stalls,
            "unexplained_stall_count": reasons["unexplained"],
            "stall_reasons": reasons,
            "phases": self.phases(total_ms),
        }


def decode_tokens_per_sec(tokens: int, decode_ms: float | None, total_ms: float, ttft_ms: float | None) -> float:
    """semantics.md §4.8: tokens over decode time, else total - ttft, else total; 0 tokens -> 0.0."""
    if tokens <= 0:
        return 0.0
    for span in (decode_ms, None if ttft_ms is None else total_ms - ttft_ms, total_ms):
        if span is not None and span > 0:
            return _r(tokens / (span / 1000.0))
    return 0.0


def _r(x: float) -> float:
    return round(x, 4)


def _opt(x: float | None) -> float | None:
    return None if x is None else _r(x)


def performance_metadata(timeline: RequestTimeline, *, prompt_tokens: int, completion_tokens: int,
                         total_ms: float, adapter_used: str, thinking_mode: str, finish_reason: str) -> dict[str, Any]:
    """`ChatCompletionPerformanceMetadata` (15 fields, semantics.md §4.8) for the timed choice."""
    s = timeline.stats
    ttft = timeline.ttft_ms()
    decode_ms = s.decode_ms if s is not None else None
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "ttft_ms": _opt(ttft),
        "prefill_ms": _opt(s.prefill_ms) if s is not None else None,
        "actor_queue_ms": _opt(ms(s.submitted_at, s.received_at)) if s is not None else None,
        "actor_admission_ms": _opt(ms(s.received_at, s.admitted_at)) if s is not None else None,
        "actor_prefill_wall_ms": _opt(ms(s.admitted_at, s.first_token_at)) if s is not None else None,
        # no recurrent state exists on this path, so nothing to report either way
        "resident_prefill_used": None,
        "decode_ms": _opt(decode_ms),
        "total_latency_ms": _r(total_ms),
        "decode_tokens_per_sec": decode_tokens_per_sec(len(timeline.tokens), decode_ms, total_ms, ttft),
        "adapter_used": adapter_used,
        "thinking_mode": thinking_mode,
        "finish_reason": finish_reason,
        "latency": timeline.diagnostics(total_ms),
    }
