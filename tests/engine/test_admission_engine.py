"""Bounded admission at the Engine facade: `admit` refuses with 429 before anything reaches
the actor; a request stops waiting at its first event and gives its place back however it ends."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kiln.core.admission import AdmissionGate
from kiln.core.sampling import SamplingParams
from kiln.engine.actor import ChoiceEvent, GenerationRequest
from kiln.engine.serving import Engine
from kiln.errors import KilnError


class FakeActor:
    """Records what reaches it; the test emits the events."""

    def __init__(self) -> None:
        self.submitted: list = []
        self.aborted: list[str] = []
        self.runner = SimpleNamespace(backend="fake")

    def submit_many(self, requests) -> None:
        self.submitted += requests

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def emit(self, i: int, finish: str | None = None) -> None:
        rid, _ids, _params, emit, *_ = self.submitted[i]
        emit(ChoiceEvent(0, "x", [1], [0.0], finish))


def engine(max_waiting: int = 2, max_tokens: int = 0) -> tuple[Engine, FakeActor]:
    actor = FakeActor()
    eng = Engine(SimpleNamespace(), SimpleNamespace(), SimpleNamespace(), actor, None)  # type: ignore[arg-type]
    eng.admission = AdmissionGate(max_waiting, max_tokens)
    return eng, actor


def request(n_tokens: int = 3) -> GenerationRequest:
    return GenerationRequest(list(range(n_tokens)), [SamplingParams(max_tokens=1)])


def test_past_the_limit_admit_is_429_with_retry_after_and_nothing_reaches_the_actor():
    eng, actor = engine(max_waiting=2)
    eng.admit([3])
    eng.admit([3])
    with pytest.raises(KilnError) as e:
        eng.admit([3])
    assert (e.value.status, e.value.code) == (429, "inference_queue_full")
    assert int(e.value.headers["Retry-After"]) >= 1 and actor.submitted == []
    assert eng.admission.refused_by["requests"] == 1


def test_a_request_stops_waiting_at_its_first_event_and_frees_its_place_at_the_end():
    async def main() -> None:
        eng, actor = engine(max_waiting=1)
        admission = eng.admit([3])
        it = eng.submit([request()], admission)
        first = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0)
        assert eng.admission.waiting == 1
        actor.emit(0)
        await first
        assert eng.admission.waiting == 0 and eng.admission.queued_tokens == 0
        eng.admit([3]).release()       # room again while the first one still runs
        actor.emit(0, "length")
        assert [ev.finish_reason async for _, ev in it] == ["length"]

    asyncio.run(main())


def test_a_client_that_leaves_before_its_first_token_gives_its_place_back():
    async def main() -> None:
        eng, actor = engine(max_waiting=1)
        it = eng.submit([request()], eng.admit([3]))
        task = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await it.aclose()
        assert eng.admission.waiting == 0 and actor.aborted

    asyncio.run(main())


def test_queued_prompt_tokens_refuse_too_and_internal_work_is_not_gated():
    eng, actor = engine(max_waiting=100, max_tokens=10)
    eng.admit([8])
    with pytest.raises(KilnError) as e:
        eng.admit([8])
    assert "prompt tokens" in e.value.message and eng.admission.refused_by["tokens"] == 1

    async def internal() -> None:
        it = eng.submit([request(50)])      # no admission: an eval job's work
        task = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0)
        assert len(actor.submitted) == 1
        actor.emit(0, "length")
        await task

    asyncio.run(internal())
