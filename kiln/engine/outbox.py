"""Outbox: the actor's token events, handed to the handlers' event loops in batches.

The actor thread and the HTTP event loop share one GIL. An event handed over the moment its token
is sampled wakes the loop while the actor is still in Python, building the next step, and the two
then take turns at the lock: each of the actor's small torch calls releases it, the loop's SSE work
takes it, and the actor waits for the loop to let go before its next line. So the actor posts each
event here and flushes just before the next forward is launched, when the model runs in C++ without
the GIL for milliseconds: the loop's work overlaps the step instead of stretching it. A flush makes
one `call_soon_threadsafe` per loop, however many streams the step advanced.

An emit callback that carries `sink = (loop, deliver)` is delivered through its loop (`deliver` runs
on the loop's thread); any other callback is called as it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kiln.engine")

Emit = Callable[[Any], None]


class Outbox:
    def __init__(self) -> None:
        self._events: list[tuple[Emit, Any]] = []

    def __len__(self) -> int:
        return len(self._events)

    def post(self, emit: Emit, event: Any) -> None:
        self._events.append((emit, event))

    def flush(self) -> None:
        """Hand every posted event over, in the order posted."""
        if not self._events:
            return
        events, self._events = self._events, []
        now = time.perf_counter()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[Any], None], Any]]] = {}
        for emit, event in events:
            if hasattr(event, "delivered_at"):
                event.delivered_at = now
            sink = getattr(emit, "sink", None)
            if sink is None:
                emit(event)
                continue
            loop, deliver = sink
            by_loop.setdefault(loop, []).append((deliver, event))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, batch)
            except RuntimeError:  # that loop is closed: its handlers are gone
                log.debug("%d token events had no one waiting", len(batch))


def sink_emit(loop: asyncio.AbstractEventLoop, deliver: Callable[[Any], None]) -> Emit:
    """An emit callback for `loop`: called alone it schedules `deliver` there; an outbox batches it."""
    def emit(event: Any) -> None:
        loop.call_soon_threadsafe(deliver, event)
    emit.sink = (loop, deliver)  # type: ignore[attr-defined]
    return emit


def _deliver_all(batch: list[tuple[Callable[[Any], None], Any]]) -> None:
    for deliver, event in batch:
        deliver(event)
