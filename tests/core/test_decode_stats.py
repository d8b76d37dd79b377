"""The rolling decode window: per-sequence ITL samples, throughput over their span, eviction."""

from __future__ import annotations

import threading

import pytest

from kiln.core.decode_stats import DecodeWindow


def test_an_empty_window_reports_zeros_and_its_length():
    snap = DecodeWindow(60.0).snapshot(100.0)
    assert snap.sample_count == 0 and snap.tok_per_sec == 0.0 and snap.p99_itl_ms == 0.0
    assert snap.window_secs == 60.0


def test_one_stream_ten_ms_apart_decodes_a_hundred_tokens_per_second():
    w = DecodeWindow(60.0)
    for i in range(1, 101):
        w.record_step(10.0 + i * 0.010, [0.010])
    snap = w.snapshot(11.0)
    assert snap.sample_count == 100
    assert snap.tok_per_sec == pytest.approx(100.0, rel=1e-6)
    assert snap.mean_itl_ms == pytest.approx(10.0) and snap.p50_itl_ms == pytest.approx(10.0)


def test_concurrent_streams_add_up_to_the_batch_throughput():
    w = DecodeWindow(60.0)
    for i in range(1, 51):
        w.record_step(i * 0.020, [0.020] * 8)   # 8 sequences, one token each every 20 ms
    snap = w.snapshot(1.0)
    assert snap.tok_per_sec == pytest.approx(400.0, rel=1e-6)
    assert snap.p99_itl_ms == pytest.approx(20.0)


def test_p99_sees_the_slow_tail_while_p50_stays_put():
    w = DecodeWindow(60.0)
    t = 0.0
    for _ in range(95):
        t += 0.010
        w.record_step(t, [0.010])
    for _ in range(5):
        t += 0.200
        w.record_step(t, [0.200])
    snap = w.snapshot(t)
    assert snap.p50_itl_ms == pytest.approx(10.0)
    assert snap.p99_itl_ms == pytest.approx(200.0)


def test_samples_older_than_the_window_are_left_out():
    w = DecodeWindow(5.0)
    w.record_step(1.0, [0.5, 0.5])
    w.record_step(20.0, [0.1])
    snap = w.snapshot(21.0)
    assert snap.sample_count == 1 and snap.mean_itl_ms == pytest.approx(100.0)
    assert w.snapshot(100.0).sample_count == 0


def test_a_step_without_decode_tokens_records_nothing():
    w = DecodeWindow(60.0)
    w.record_step(1.0, [])
    assert w.snapshot(1.0).sample_count == 0


def test_the_sample_cap_bounds_memory():
    w = DecodeWindow(60.0, max_samples=10)
    for i in range(100):
        w.record_step(1.0 + i * 0.01, [0.01])
    assert w.snapshot(2.0).sample_count == 10


def test_a_window_must_be_positive():
    with pytest.raises(ValueError):
        DecodeWindow(0)


def test_readers_on_other_threads_see_consistent_snapshots():
    w = DecodeWindow(60.0)
    stop = threading.Event()
    seen = []

    def read():
        while not stop.is_set():
            seen.append(w.snapshot(1e9).sample_count)

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(2000):
        w.record_step(1e9 - 10 + i * 0.001, [0.001, 0.001])
    stop.set()
    reader.join()
    assert w.snapshot(1e9).sample_count == 4000
    assert all(n % 2 == 0 for n in seen)   # a step's samples land together
