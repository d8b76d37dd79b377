"""Live decode statistics: a rolling time window of inter-token latencies (pure, no torch).

The engine actor feeds one call per model step with the step's end time and, for every sequence that
got a decode token in it, the gap since that sequence's previous token (its inter-token latency, as
vLLM measures ITL: per sequence, not between unrelated streams). `GET /v1/stats/decode` and
`/metrics` read `snapshot()` from other threads; one lock guards the deque, held for an append or a copy.

Throughput is decode tokens in the window over the span the samples cover (the start of the first
counted token's gap to the last token), so a short burst reads as the speed the engine decoded at,
not diluted by the idle rest of the window, as Kiln's Rust original reads it. Percentiles are nearest-rank over the samples in the window (kiln.core.percentile).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass

from kiln.core.percentile import percentile

DEFAULT_WINDOW_SECS = 60.0
# Bounds memory whatever the rate: at 1000 tok/s a 60 s window holds 60k samples.
DEFAULT_MAX_SAMPLES = 200_000


@dataclass(frozen=True)
class DecodeSnapshot:
    tok_per_sec: float
    mean_itl_ms: float
    p50_itl_ms: float
    p99_itl_ms: float
    sample_count: int
    window_secs: float
    span_secs: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


class DecodeWindow:
    def __init__(self, window_secs: float = DEFAULT_WINDOW_SECS, max_samples: int = DEFAULT_MAX_SAMPLES) -> None:
        if not window_secs > 0:
            raise ValueError(f"window_secs must be positive, got {window_secs}")
        self.window_secs = float(window_secs)
        self._samples: deque[tuple[float, float]] = deque(maxlen=max(1, max_samples))  # (time, itl seconds)
        self._lock = threading.Lock()

    def record_step(self, at: float, gaps: list[float]) -> None:
        """One step's decode tokens: `at` is when the step finished (perf_counter seconds), `gaps` the
        seconds since each decoded sequence's previous token."""
        if not gaps:
            return
        with self._lock:
            self._samples.extend((at, g) for g in gaps)
            self._evict(at)

    def _evict(self, now: float) -> None:
        cutoff = now - self.window_secs
        samples = self._samples
        while samples and samples[0][0] < cutoff:
            samples.popleft()

    def snapshot(self, now: float) -> DecodeSnapshot:
        cutoff = now - self.window_secs
        with self._lock:
            recent = [s for s in self._samples if s[0] >= cutoff]
        if not recent:
            return DecodeSnapshot(0.0, 0.0, 0.0, 0.0, 0, self.window_secs, 0.0)
        itls = sorted(g * 1000.0 for _, g in recent)
        # Each token took its gap to produce, so the samples cover from the earliest such start to
        # the last token (one stream of N tokens d apart: N / (N * d) exactly).
        span = recent[-1][0] - min(t - g for t, g in recent)
        return DecodeSnapshot(
            tok_per_sec=_r(len(recent) / span) if span > 0 else 0.0,
            mean_itl_ms=_r(sum(itls) / len(itls)),
            p50_itl_ms=_r(percentile(itls, 50.0) or 0.0),
            p99_itl_ms=_r(percentile(itls, 99.0) or 0.0),
            sample_count=len(itls),
            window_secs=self.window_secs,
            span_secs=_r(span),
        )


def _r(x: float) -> float:
    return round(x, 4)
