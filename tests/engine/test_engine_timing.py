"""Request latency accounting (kiln.engine.timing): measured intervals only, nulls for the rest."""

from __future__ import annotations

from types import SimpleNamespace

from kiln.core.percentile import percentile
from kiln.engine.timing import (
    MAX_GAP_SAMPLES,
    PHASE_FIELDS,
    STALL_REASONS,
    STALL_THRESHOLD_MS,
    ChoiceStats,
    RequestTimeline,
    StepTiming,
    decode_tokens_per_sec,
    performance_metadata,
)
from kiln.testing.schemas import validate

INF = "kiln-inference-v1.schema.json"
DECODE = StepTiming(forward_ms=2.0, sampling_ms=0.5, readback_ms=0.1)


def event(token: int, ready: float, *, step: StepTiming | None = DECODE, idle_ms: float = 0.0,
          stats: ChoiceStats | None = None, received: float | None = None):
    return SimpleNamespace(token_ids=[token], token_times=[ready], delivered_at=ready + 0.0001,
                           received_at=received if received is not None else ready + 0.0002,
                           step=step, idle_ms=idle_ms, stats=stats)


def timeline_with_gaps(gaps_s: list[float], start: float = 100.0) -> RequestTimeline:
    tl = RequestTimeline(start)
    stats = ChoiceStats(start + 0.001, received_at=start + 0.002, admitted_at=start + 0.003,
                        first_token_at=start + 0.010, prefill_ms=5.0, decode_ms=2.0 * len(gaps_s))
    t = start + 0.010
    tl.on_event(event(1, t, step=StepTiming(5.0, 0.5, 0.1, had_prefill=True)))
    for i, gap in enumerate(gaps_s):
        t += gap
        tl.on_event(event(i + 2, t, stats=stats if i == len(gaps_s) - 1 else None))
    if not gaps_s:
        tl.stats = stats
    return tl


def test_percentile_is_nearest_rank():
    values = sorted(float(v) for v in range(1, 101))
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 99.9) == 100.0
    assert percentile([], 50) is None


def test_gaps_and_ttft_come_from_handler_receipt_times():
    tl = timeline_with_gaps([0.010, 0.020])
    diag = tl.diagnostics(total_ms=50.0)
    assert diag["emitted_tokens"] == 3 and diag["gap_samples"] == 2
    assert abs(diag["ttft_ms"] - 10.2) < 1e-6
    assert abs(diag["max_itl_ms"] - 20.0) < 1e-6


def test_gap_at_the_threshold_is_a_stall_attributed_to_its_dominant_phase():
    tl = timeline_with_gaps([0.005, STALL_THRESHOLD_MS / 1000.0])
    # the stalled token's step spent nearly the whole gap in the model
    tl.tokens[-1].step = StepTiming(forward_ms=STALL_THRESHOLD_MS * 0.9, sampling_ms=1.0, readback_ms=0.1)
    diag = tl.diagnostics(total_ms=400.0)
    assert diag["stall_count"] == 1
    assert diag["stall_reasons"]["actor_decode"] == 1 and diag["unexplained_stall_count"] == 0
    assert set(diag["stall_reasons"]) == set(STALL_REASONS)


def test_stall_no_phase_explains_is_unexplained():
    tl = timeline_with_gaps([0.400])
    diag = tl.diagnostics(total_ms=500.0)
    assert diag["stall_count"] == 1 and diag["unexplained_stall_count"] == 1
    assert diag["stall_reasons"]["unexplained"] == 1


def test_gap_samples_are_bounded_and_truncation_reported():
    tl = timeline_with_gaps([0.001] * (MAX_GAP_SAMPLES + 10))
    diag = tl.diagnostics(total_ms=10_000.0)
    assert diag["gap_samples"] == MAX_GAP_SAMPLES + 10
    assert diag["retained_gap_samples"] == MAX_GAP_SAMPLES and diag["gap_samples_truncated"] is True


def test_unmeasured_phases_are_null_and_measured_ones_numbers():
    phases = timeline_with_gaps([0.01]).phases(total_ms=40.0)
    assert list(phases) == list(PHASE_FIELDS)
    for name in ("gpu_lock_wait_ms", "graph_capture_ms", "graph_replay_ms", "synchronization_ms", "resize_ms",
                 "trim_ms", "adapter_ms", "training_ms"):
        assert phases[name] is None
    assert phases["prefill_ms"] == 5.0 and phases["actor_queue_ms"] == 1.0
    assert phases["tokenization_ms"] is None  # the handler did not time tokenization here


def test_first_token_blocking_phase_is_the_actor_prefill():
    tl = timeline_with_gaps([0.001])
    phase, phase_ms = tl.blocking_phase(tl.tokens[0])
    assert phase == "actor_prefill" and abs(phase_ms - 7.0) < 1e-6


def test_token_timing_event_matches_the_contract():
    tl = timeline_with_gaps([0.002])
    rec = tl.tokens[1]
    rec.enqueued_at = rec.received_at + 0.0003
    ev = tl.token_timing_event(rec)
    validate(INF, "StreamingTokenTiming", ev)
    assert ev["token_index"] == 1 and ev["source"] == "batching_engine"
    assert abs(ev["queue_delay_ms"] - (ev["response_delivery_ms"] + ev["handler_queue_ms"])) < 1e-3


def test_decode_tokens_per_sec_follows_the_fallback_order():
    assert decode_tokens_per_sec(0, 10.0, 100.0, 5.0) == 0.0
    assert decode_tokens_per_sec(10, 500.0, 1000.0, 100.0) == 20.0
    assert decode_tokens_per_sec(10, 0.0, 1000.0, 500.0) == 20.0   # total - ttft
    assert decode_tokens_per_sec(10, None, 1000.0, None) == 10.0   # total


def test_performance_metadata_is_schema_valid():
    tl = timeline_with_gaps([0.003, 0.004])
    perf = performance_metadata(tl, prompt_tokens=7, completion_tokens=3, total_ms=30.0, adapter_used="base",
                                thinking_mode="non_reasoning", finish_reason="length")
    validate(INF, "ChatCompletionPerformanceMetadata", perf)
    assert perf["resident_prefill_used"] is None and perf["actor_prefill_wall_ms"] == 7.0
