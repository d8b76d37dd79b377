"""Kiln's Prometheus series (semantics.md §13.1, thinking-budget metrics §2.6), served by GET /metrics
(kiln/api/routers/metrics.py).

Request-level series are recorded by `KilnMetrics` (`state.services.metrics`), fed by the server's one
traffic observer (kiln.api.observer.TrafficObserver): every finished chat and batch completion
(`completion_finished`), every request refused before the engine took it or completed by its route
(`finished`), and every recorded request (`observe_record`, the recorder's listener); engine-level series (scheduler, KV blocks, prefix cache, token totals,
memory) are read from the engine at scrape time. Each app has its own registry, so several apps in
one process (tests) never share series.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kiln.api.state import ServerState
from kiln.core.output_grammar import KINDS
from kiln.core.thinking_budget import outcome_label
from kiln.engine.chat_response import FinishedCompletion
from kiln.engine.grammar import REFUSAL_REASONS
from kiln.engine.view import EngineView

log = logging.getLogger("kiln.api")

REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 180, 240, 300, 420, 600, 900)
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
STATUSES = ("ok", "error", "timeout", "rejected")
# Adapter label values of kiln_requests_finished_total: "base", a saved adapter's name, "composition"
# for any `adapters` mix; past this many distinct names the rest count as "other" (bounded cardinality).
MAX_ADAPTER_LABELS = 32


class KilnMetrics:
    def __init__(self, state: ServerState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kiln_requests", "Inference requests by outcome.", ["status"], registry=r)
        for status in STATUSES:
            self.requests.labels(status=status)
        self.duration = Histogram("kiln_request_duration_seconds", "Request latency, handler entry to last byte.",
                                  buckets=REQUEST_BUCKETS, registry=r)
        self.prefill = Histogram("kiln_request_prefill_duration_seconds",
                                 "Model time of the steps that carried a request's prompt.",
                                 buckets=PHASE_BUCKETS, registry=r)
        self.decode = Histogram("kiln_request_decode_duration_seconds",
                                "Model time of the steps that carried a request's decode tokens.",
                                buckets=PHASE_BUCKETS, registry=r)
        self.queue = Histogram("kiln_request_queue_duration_seconds",
                               "Time from submission to admission into the running batch.",
                               buckets=PHASE_BUCKETS, registry=r)
        self.ttft = Histogram("kiln_request_ttft_seconds", "Time to the first generated token.",
                              buckets=PHASE_BUCKETS, registry=r)
        self.itl = Histogram("kiln_request_itl_seconds", "Inter-token latency (every gap of every request).",
                             buckets=PHASE_BUCKETS, registry=r)
        self.active = Gauge("kiln_active_requests", "Inference requests in flight.", registry=r)
        self.active_peak = Gauge("kiln_active_requests_peak", "Most inference requests in flight at once.",
                                 registry=r)
        self.budget_source = Counter("kiln_thinking_budget_source", "Resolved thinking-budget sources.",
                                     ["dimension", "source"], registry=r)
        self.budget_outcomes = Counter("kiln_thinking_budget_outcomes", "Terminal thinking-budget outcomes.",
                                       ["outcome"], registry=r)
        self.budget_tokens = Histogram("kiln_thinking_budget_effective_tokens",
                                       "Effective finite thinking-token limits.", buckets=TOKEN_BUCKETS, registry=r)
        self.budget_seconds = Histogram("kiln_thinking_budget_effective_seconds",
                                        "Effective finite thinking-time limits.", buckets=REQUEST_BUCKETS, registry=r)
        self.stream_stalls = Counter("kiln_stream_stalls", "Streamed inter-token gaps longer than "
                                     "server.stream_stall_grace_ms.", registry=r)
        self.finished_requests = Counter(
            "kiln_requests_finished", "Finished chat and batch requests by kind, finish reason and adapter.",
            ["kind", "finish_reason", "adapter"], registry=r)
        self.prompt_tokens = Histogram("kiln_request_prompt_tokens", "Prompt tokens of each finished request.",
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram("kiln_request_generation_tokens",
                                           "Completion tokens of each finished request.", buckets=TOKEN_BUCKETS,
                                           registry=r)
        self.state = state
        r.register(_EngineCollector(state))
        self._in_flight = 0
        self._peak = 0
        self._adapter_labels: set[str] = set()

    # ---- request lifecycle (kiln.engine.serving.CompletionObserver, through TrafficObserver) ---------
    def completion_started(self) -> None:
        self._in_flight += 1
        self._peak = max(self._peak, self._in_flight)
        self.active.set(self._in_flight)
        self.active_peak.set(self._peak)

    def completion_finished(self, done: FinishedCompletion) -> None:
        self._in_flight -= 1
        self.active.set(self._in_flight)
        if done.status == "ok":
            if done.timeline is not None:
                self.observe_timeline(done.timeline)
            if done.budget is not None:
                self.observe_budget(done.budget, done.budget_outcomes)
        if done.status != "cancelled":  # a client that went away is neither a success nor a failure
            self.finished(done.status, done.seconds)
        if done.streamed and done.timeline is not None:
            self._count_stalls(done)

    def _count_stalls(self, done: FinishedCompletion) -> None:
        """server.stream_stall_grace_ms: a streamed gap between two tokens longer than this is a stall
        a reader notices; each is counted and logged with the phase that held the token up."""
        grace = self.state.settings.server.stream_stall_grace_ms
        timeline = done.timeline
        assert timeline is not None
        for rec, gap_ms in timeline.gaps():
            if gap_ms > grace:
                self.stream_stalls.inc()
                phase, _ = timeline.blocking_phase(rec)
                log.warning("stream %s stalled %.0f ms before token %d (over the %.0f ms grace; mostly %s)",
                            done.request_id, gap_ms, rec.index, grace, phase or "unmeasured")

    def finished(self, status: str, seconds: float) -> None:
        self.requests.labels(status=status).inc()
        self.duration.observe(max(0.0, seconds))

    def observe_timeline(self, timeline: Any) -> None:
        """Engine phases of one choice (kiln.engine.timing.RequestTimeline)."""
        s = timeline.stats
        if s is not None:
            self.prefill.observe(s.prefill_ms / 1000.0)
            self.decode.observe(s.decode_ms / 1000.0)
            if s.admitted_at is not None:
                self.queue.observe(max(0.0, s.admitted_at - s.submitted_at))
        ttft = timeline.ttft_ms()
        if ttft is not None:
            self.ttft.observe(ttft / 1000.0)
        for _, gap in timeline.gaps():
            self.itl.observe(gap / 1000.0)

    def observe_budget(self, record: Mapping[str, Any], outcomes: list[Mapping[str, Any] | None]) -> None:
        """One request's resolved sources, and per choice its terminal outcome (None: no controller ran)."""
        self.budget_source.labels(dimension="tokens", source=record["tokens_source"]).inc()
        self.budget_source.labels(dimension="time", source=record["time_source"]).inc()
        if "max_tokens" in record:
            self.budget_tokens.observe(record["max_tokens"])
        if "max_time_ms" in record:
            self.budget_seconds.observe(record["max_time_ms"] / 1000.0)
        for outcome in outcomes:
            self.budget_outcomes.labels(outcome=outcome_label({**record, **(outcome or {})})).inc()


    def observe_record(self, rec: Any) -> None:
        """A finished request's record (kiln.traffic.records.CompletionRecord): the recorder's listener."""
        self.finished_requests.labels(kind=rec.kind, finish_reason=rec.finish_reason,
                                      adapter=self._adapter_label(rec)).inc()
        self.prompt_tokens.observe(rec.prompt_tokens)
        self.generation_tokens.observe(rec.completion_tokens)

    def _adapter_label(self, rec: Any) -> str:
        if len(rec.adapters) > 1 or (rec.adapters and rec.adapters[0].get("scale", 1.0) != 1.0):
            return "composition"
        name = rec.adapters[0]["name"] if rec.adapters else "base"
        if name not in self._adapter_labels:
            if len(self._adapter_labels) >= MAX_ADAPTER_LABELS:
                return "other"
            self._adapter_labels.add(name)
        return name


class _EngineCollector(Collector):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        yield from _service_metrics(self.state)
        engine = self.state.engine
        if engine is None:
            return
        st = engine.stats()
        sched, counters, prefix = st.scheduler, st.counters, st.prefix_cache
        yield _gauge("kiln_scheduler_waiting", "Sequences waiting for admission.", sched["waiting"])
        yield _gauge("kiln_scheduler_running", "Sequences in the running batch.", sched["running"])
        yield _gauge("kiln_blocks_used", "KV-cache blocks in use.", sched["blocks_used"])
        yield _gauge("kiln_blocks_total", "KV-cache blocks in the pool.", sched["blocks_total"])
        yield _gauge("kiln_kv_cache_usage_ratio", "Share of KV-cache blocks in use (0..1).", st.kv_usage)
        yield _counter("kiln_tokens_generated", "Tokens sampled by the engine.", counters.tokens_generated)
        yield _counter("kiln_request_prefill_tokens_completed", "Prompt tokens the engine computed.",
                       counters.prefill_tokens)
        yield _counter("kiln_engine_steps", "Model steps the engine ran.", counters.steps)
        yield _counter("kiln_scheduler_preemptions", "Sequences preempted for KV space.", st.preemptions)
        yield _counter("kiln_prompts_scored", "Prompts scored by POST /v1/completions.", counters.prompts_scored)
        yield _counter("kiln_prefix_cache_lookups", "Allocations that consulted the prefix cache.", prefix.lookups)
        yield _counter("kiln_prefix_cache_hit_blocks", "KV blocks reused from the prefix cache.", prefix.hit_blocks)
        yield _counter("kiln_prefix_cache_hit_tokens", "Prompt tokens reused from the prefix cache.",
                       prefix.hit_tokens)
        yield _gauge("kiln_prefix_cache_cached_blocks", "Blocks registered in the prefix cache.",
                     st.prefix_cached_blocks)
        yield _gauge("kiln_prefix_cache_max_blocks", "Most blocks the prefix cache can hold.", st.prefix_max_blocks)
        yield _gauge("kiln_vram_model_bytes", "Bytes of model weights on the device.", st.memory.model_bytes)
        yield _gauge("kiln_vram_kv_cache_bytes", "Bytes of the KV-cache pool.", st.memory.kv_cache_bytes)
        yield _gauge("kiln_active_adapter", "1 when a saved adapter is active, else 0.",
                     1 if self.state.services.active_adapter_name() else 0)
        snap = engine.decode_stats()
        yield _gauge("kiln_decode_tokens_per_second", "Decode throughput over the rolling window.", snap.tok_per_sec)
        yield _gauge("kiln_decode_itl_mean_seconds", "Mean inter-token latency over the rolling window.",
                     snap.mean_itl_ms / 1000.0)
        yield _gauge("kiln_decode_itl_p50_seconds", "Median inter-token latency over the rolling window.",
                     snap.p50_itl_ms / 1000.0)
        yield _gauge("kiln_decode_itl_p99_seconds", "p99 inter-token latency over the rolling window.",
                     snap.p99_itl_ms / 1000.0)
        yield _gauge("kiln_decode_itl_samples", "Inter-token gaps in the rolling window.", snap.sample_count)
        yield _gauge("kiln_decode_window_seconds", "Length of the decode-stats rolling window.", snap.window_secs)

        yield from _grammar_metrics(engine)
        gate = engine.admission
        yield _gauge("kiln_admission_waiting_requests", "Admitted requests still waiting for their first token.",
                     gate.waiting)
        yield _gauge("kiln_admission_waiting_requests_peak", "Most requests ever waiting at once.",
                     gate.peak_waiting)
        yield _gauge("kiln_admission_queued_prompt_tokens", "Prompt tokens the waiting requests hold.",
                     gate.queued_tokens)
        yield _gauge("kiln_admission_max_waiting_requests", "Waiting requests past which new ones get 429.",
                     gate.max_waiting_requests)
        yield _gauge("kiln_admission_max_queued_prompt_tokens", "Queued prompt tokens past which new ones get 429.",
                     gate.max_queued_tokens)
        yield _counter("kiln_admission_admitted", "Requests (batch prompts count one each) admitted.",
                       gate.admitted_total)
        refused = CounterMetricFamily("kiln_admission_refused", "Requests refused with 429, by the limit hit.",
                                      labels=["limit"])
        for limit, n in gate.refused_by.items():
            refused.add_metric([limit], n)
        yield refused


def _grammar_metrics(engine: EngineView) -> Iterator[Any]:
    """Output grammars (kiln.engine.grammar): requests by kind, refusals by reason, compile and mask time."""
    c = engine.grammar_counters()
    requests = CounterMetricFamily("kiln_structured_requests", "Requests with an output grammar, by kind.",
                                   labels=["kind"])
    for kind in KINDS:
        requests.add_metric([kind], c.requests.get(kind, 0))
    yield requests
    refusals = CounterMetricFamily("kiln_structured_refusals", "Output grammars refused with a 400, by reason.",
                                   labels=["reason"])
    for reason in REFUSAL_REASONS:
        refusals.add_metric([reason], c.refusals.get(reason, 0))
    yield refusals
    yield _counter("kiln_structured_compiles", "Output grammars compiled (cache misses).", c.compiles)
    yield _counter("kiln_structured_compile_cache_hits", "Output grammars found compiled in the cache.", c.cache_hits)
    p50 = c.compile_p50_ms()
    yield _gauge("kiln_structured_compile_p50_seconds", "Median compile time of the last 1024 compiles.",
                 (p50 or 0.0) / 1000.0)
    yield _counter("kiln_structured_mask_seconds", "Time spent computing grammar token masks.", c.mask_seconds)
    yield _counter("kiln_structured_mask_batches", "Steps that computed grammar masks (one call each).", c.masks)
    yield _counter("kiln_structured_mask_rows", "Grammar token masks computed (one per constrained row and step).",
                   c.mask_rows)
    yield _counter("kiln_structured_failures", "Choices whose grammar failed mid-generation (finish_reason error).",
                   c.failures)


def _service_metrics(state: ServerState) -> Iterator[Any]:
    recorder = state.services.recorder
    if recorder is not None:
        yield _gauge("kiln_recent_requests", "Requests held by the recent-request ring.", len(recorder.ring))
        rlog = recorder.request_log
        if rlog is not None:
            yield _counter("kiln_request_log_rows_written", "Rows the request log wrote.", rlog.stats.written)
            yield _counter("kiln_request_log_rows_dropped", "Rows the request log dropped (queue full or closed).",
                           rlog.stats.dropped)
            yield _counter("kiln_request_log_write_errors", "Rows or flushes the disk refused.", rlog.stats.errors)
            yield _gauge("kiln_request_log_queued_rows", "Rows waiting for the request-log writer.", rlog.queued)
    corrections = state.services.corrections
    if corrections is not None:
        family = GaugeMetricFamily("kiln_corrections", "Stored corrections by state.", labels=["state"])
        for st, n in corrections.counts().items():
            family.add_metric([st], n)
        yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
