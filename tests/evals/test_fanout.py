"""Dealing eval requests over several generators: least outstanding under caps, retry, move, record."""

from __future__ import annotations

import asyncio

from kiln.evals.fanout import FanOutGenerator, Target, retryable
from kiln.evals.generator import GenerationRequest, GenerationResult


class Echo:
    """Answers with the request's seed after a short wait; counts the most requests it held at once."""

    def __init__(self, fail_with: str | None = None, fail_times: int = 10**9) -> None:
        self.fail_with, self.fail_times = fail_with, fail_times
        self.inflight = self.peak = self.calls = 0

    async def generate(self, requests):
        self.calls += 1
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        await asyncio.sleep(0.001)
        self.inflight -= 1
        if self.fail_with is not None and self.fail_times > 0:
            self.fail_times -= 1
            return [GenerationResult.failed(self.fail_with)]
        return [GenerationResult(text=f"seed {r.seed}") for r in requests]

    async def identity(self):
        return "identity"


async def _no_wait(_: float) -> None:
    return None


def _requests(n: int) -> list[GenerationRequest]:
    return [GenerationRequest(messages=[{"role": "user", "content": "x"}], seed=i, label=f"ex{i}#0") for i in range(n)]


def test_requests_are_dealt_under_each_cap_and_answers_keep_their_order():
    a, b = Echo(), Echo()
    fan = FanOutGenerator([Target("local", a, 2), Target("r0", b, 3)], sleep=_no_wait)
    results = asyncio.run(fan.generate(_requests(20)))
    assert [r.text for r in results] == [f"seed {i}" for i in range(20)]
    assert a.peak <= 2 and b.peak <= 3 and a.calls > 0 and b.calls > 0
    assert {p.target for p in fan.placement} == {"local", "r0"}


def test_a_dead_target_retries_with_backoff_then_its_requests_move_and_it_gets_no_more():
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    dead, alive = Echo("generation failed: ConnectError: refused"), Echo()
    fan = FanOutGenerator([Target("r-dead", dead, 1), Target("local", alive, 1)], tries=3, backoff=0.5, sleep=sleep)
    results = asyncio.run(fan.generate(_requests(5)))
    assert [r.text for r in results] == [f"seed {i}" for i in range(5)]
    assert dead.calls == 3 and waits == [0.5, 1.0]
    moved = [p for p in fan.placement if p.failures]
    assert len(moved) == 1 and moved[0].target == "local" and moved[0].failures[-1]["moved"] == "yes"
    assert fan.summary()["reassigned"] == 1 and fan.summary()["targets"][0]["down"] is True


def test_a_transient_503_is_retried_on_the_same_target():
    flaky = Echo("generation failed: HTTP 503: busy", fail_times=1)
    fan = FanOutGenerator([Target("r0", flaky, 1)], sleep=_no_wait)
    (result,) = asyncio.run(fan.generate(_requests(1)))
    assert result.text == "seed 0" and fan.placement[0].target == "r0" and len(fan.placement[0].failures) == 1


def test_a_request_that_fails_everywhere_comes_back_failed_not_lost():
    fan = FanOutGenerator([Target("r0", Echo("generation failed: ReadTimeout: slow"), 2)], tries=2, sleep=_no_wait)
    results = asyncio.run(fan.generate(_requests(3)))
    assert all(r.finish_reason == "error" and r.error for r in results)
    assert "ReadTimeout" in results[0].error  # the last error seen, else "no generator left"
    assert all(p.target is None for p in fan.placement)


def test_only_transport_429_and_5xx_failures_are_retried():
    assert retryable(GenerationResult.failed("generation failed: HTTP 429: slow down"))
    assert retryable(GenerationResult.failed("generation failed: RemoteProtocolError: closed"))
    assert not retryable(GenerationResult.failed("generation failed: HTTP 400: bad request"))
    assert not retryable(GenerationResult.failed("prepare failed: prompt too long"))
    assert not retryable(GenerationResult(text="ok"))
