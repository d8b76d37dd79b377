"""The actor's outbox: token events wait for a flush, then reach each loop in one batch, in order."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kiln.engine.outbox import Outbox, sink_emit


@dataclass
class _Event:
    n: int
    delivered_at: float | None = None


class _CountingLoop:
    """Stands in for an event loop: records call_soon_threadsafe calls and runs them at once."""

    def __init__(self) -> None:
        self.calls = 0

    def call_soon_threadsafe(self, fn, *args) -> None:
        self.calls += 1
        fn(*args)


def test_posted_events_wait_for_the_flush() -> None:
    got: list[int] = []
    box = Outbox()
    box.post(lambda ev: got.append(ev.n), _Event(1))
    assert got == [] and len(box) == 1
    box.flush()
    assert got == [1] and len(box) == 0


def test_a_flush_delivers_in_the_order_posted() -> None:
    got: list[tuple[str, int]] = []
    loop = _CountingLoop()
    box = Outbox()
    a = sink_emit(loop, lambda ev: got.append(("a", ev.n)))  # type: ignore[arg-type]
    b = sink_emit(loop, lambda ev: got.append(("b", ev.n)))  # type: ignore[arg-type]
    for n, emit in enumerate([a, b, a, b]):
        box.post(emit, _Event(n))
    box.flush()
    assert got == [("a", 0), ("b", 1), ("a", 2), ("b", 3)]


def test_one_wakeup_per_loop_however_many_streams() -> None:
    loops = [_CountingLoop(), _CountingLoop()]
    box = Outbox()
    for i in range(64):
        box.post(sink_emit(loops[i % 2], lambda ev: None), _Event(i))  # type: ignore[arg-type]
    box.flush()
    assert [lp.calls for lp in loops] == [1, 1]


def test_delivered_at_is_the_flush_time() -> None:
    ev = _Event(0)
    box = Outbox()
    box.post(lambda e: None, ev)
    assert ev.delivered_at is None
    box.flush()
    assert ev.delivered_at is not None


def test_an_emit_used_alone_schedules_on_its_loop() -> None:
    loop = _CountingLoop()
    got: list[int] = []
    sink_emit(loop, lambda ev: got.append(ev.n))(_Event(7))  # type: ignore[arg-type]
    assert got == [7] and loop.calls == 1


def test_a_closed_loop_loses_its_events_not_the_others() -> None:
    closed = asyncio.new_event_loop()
    closed.close()
    live = _CountingLoop()
    got: list[int] = []
    box = Outbox()
    box.post(sink_emit(closed, lambda ev: None), _Event(0))
    box.post(sink_emit(live, lambda ev: got.append(ev.n)), _Event(1))  # type: ignore[arg-type]
    box.flush()
    assert got == [1]


def test_real_loop_receives_a_batch_from_another_thread() -> None:
    import threading

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int] = asyncio.Queue()
        box = Outbox()
        emit = sink_emit(loop, lambda ev: queue.put_nowait(ev.n))

        def actor() -> None:
            for n in range(5):
                box.post(emit, _Event(n))
            box.flush()

        t = threading.Thread(target=actor)
        t.start()
        t.join()
        return [await asyncio.wait_for(queue.get(), 5) for _ in range(5)]

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
