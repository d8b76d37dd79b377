"""Training on CPU takes every core while the server is idle and leaves the actor one while it serves."""

from __future__ import annotations

import torch

from kiln.testing.stand_in import StandInEngine
from kiln.train.executor import CoreShare, engine_busy
from kiln.train.loop import LoopConfig, run_loop


def test_an_engine_with_sequences_or_completions_in_flight_is_busy():
    assert not engine_busy(StandInEngine())
    assert engine_busy(StandInEngine(running=1))
    assert engine_busy(StandInEngine(waiting=2))
    assert engine_busy(StandInEngine(in_flight=1))


def test_an_idle_engine_lends_training_every_thread_and_a_busy_one_keeps_one():
    engine = StandInEngine()
    share = CoreShare(engine, total=4)
    assert share.threads() == 4
    engine.running = 3
    assert share.threads() == 3
    assert CoreShare(StandInEngine(running=1), total=1).threads() == 1


def test_the_thread_count_is_set_in_the_training_thread_before_each_step():
    before = torch.get_num_threads()
    try:
        share = CoreShare(StandInEngine(running=1), total=2)
        share()
        assert torch.get_num_threads() == share.current == 1
    finally:
        torch.set_num_threads(before)


class CountingWork:
    items = [0, 1, 2, 3]

    @staticmethod
    def tokens(item) -> int:
        return 1

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.ones(1))

    def loss(self, model, lora, items, normalizer, memo):
        return (self.w * len(items)).sum() / normalizer, {}


def test_run_loop_calls_before_step_once_per_step():
    work = CountingWork()
    lora = torch.nn.Module()
    lora.w = work.w
    calls = []
    reports = run_loop(torch.nn.Linear(1, 1), lora, work, LoopConfig(learning_rate=1e-3, epochs=3, batch_size=2,
                                                                     yield_secs=0),
                       before_step=lambda: calls.append(1))
    assert len(reports) == len(calls) == 6


def test_a_narrow_model_trains_on_one_thread_on_a_small_idle_machine():
    """Off the main thread libgomp's throttled workers make a step of small operations faster on one
    thread (SmolLM2-135M); a wide model, or a machine with more cores, keeps every thread."""
    engine = StandInEngine()
    assert CoreShare(engine, total=2, small_model=True).threads() == 1
    assert CoreShare(engine, total=2, small_model=False).threads() == 2
    assert CoreShare(engine, total=8, small_model=True).threads() == 8
    engine.running = 1
    assert CoreShare(engine, total=2, small_model=True).threads() == 1
