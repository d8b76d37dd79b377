"""Deal one eval's generation requests over several generators: the local engine and replicas.

Each request goes to the target with the fewest requests outstanding, among those under their
concurrency cap (waiting when all are full). A failure worth retrying (HTTP 429 or 5xx, a connection
or timeout error) is retried on the same target with backoff; after its tries the target is marked
down for the rest of the job and the request moves to another one. Nothing is lost while any target
remains. Each request carries its own derived seed, so where it ran does not change what it
generates: the job's scores are those of a single-engine run. Which target answered each request,
and what failed before, is kept in `placement` (recorded beside the job, never inside its results).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.evals.generator import GenerationRequest, GenerationResult, Generator, GeneratorIdentity

# What RemoteGenerator reports for a 429 / 5xx answer or an httpx transport error (ConnectError,
# ReadTimeout, RemoteProtocolError, ...): worth another try, then another target.
_RETRYABLE = re.compile(r"^generation failed: (HTTP (429|5\d\d)\b|[A-Za-z]*(Error|Timeout)\b)")


def retryable(result: GenerationResult) -> bool:
    return result.error is not None and _RETRYABLE.match(result.error) is not None


@dataclass
class Target:
    name: str
    generator: Generator
    capacity: int
    outstanding: int = 0
    down: bool = False
    answered: int = 0


@dataclass
class Placement:
    label: str
    target: str | None = None
    failures: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "target": self.target, "failures": list(self.failures)}


class FanOutGenerator:
    def __init__(self, targets: list[Target], *, tries: int = 3, backoff: float = 0.25,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 on_placed: Callable[[FanOutGenerator], None] | None = None) -> None:
        if not targets:
            raise ValueError("a fan-out needs at least one target")
        self.targets = targets
        self.tries, self.backoff, self._sleep = tries, backoff, sleep
        self.on_placed = on_placed
        self.placement: list[Placement] = []
        self.run_index = -1
        self._changed: asyncio.Condition | None = None

    async def identity(self) -> GeneratorIdentity:
        """The first target's (the local engine's): every target was checked to serve the same base."""
        return await self.targets[0].generator.identity()

    async def aclose(self) -> None:
        for t in self.targets:
            close = getattr(t.generator, "aclose", None)
            if close is not None:
                await close()

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self._changed = asyncio.Condition()
        self.run_index += 1
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    def summary(self) -> dict[str, Any]:
        return {"targets": [{"name": t.name, "capacity": t.capacity, "answered": t.answered, "down": t.down}
                            for t in self.targets],
                "reassigned": sum(1 for p in self.placement if any(f["moved"] == "yes" for f in p.failures)),
                "retries": sum(len(p.failures) for p in self.placement)}

    # -- dealing --------------------------------------------------------------------------------------
    async def _acquire(self, tried: set[str]) -> Target | None:
        assert self._changed is not None
        async with self._changed:
            while True:
                live = [t for t in self.targets if not t.down and t.name not in tried]
                if not live:
                    return None
                free = [t for t in live if t.outstanding < t.capacity]
                if free:
                    target = min(free, key=lambda t: t.outstanding)  # first listed wins a tie
                    target.outstanding += 1
                    return target
                await self._changed.wait()

    async def _release(self, target: Target) -> None:
        assert self._changed is not None
        async with self._changed:
            target.outstanding -= 1
            self._changed.notify_all()

    async def _one(self, req: GenerationRequest) -> GenerationResult:
        placed = Placement(f"{self.run_index}:{req.label}")
        self.placement.append(placed)
        tried: set[str] = set()
        last: GenerationResult | None = None
        while True:
            target = await self._acquire(tried)
            if target is None:
                placed.target = None
                self._placed()
                return last or GenerationResult.failed("generation failed: no generator left to run it")
            try:
                for attempt in range(self.tries):
                    result = (await target.generator.generate([req]))[0]
                    if not retryable(result):
                        target.answered += 1
                        placed.target = target.name
                        self._placed()
                        return result
                    last = result
                    final = attempt == self.tries - 1
                    placed.failures.append({"target": target.name, "error": result.error or "",
                                            "moved": "yes" if final else "no"})
                    if not final:
                        await self._sleep(self.backoff * 2**attempt)
                # out of tries: this request moves on; a target that failed other than by pacing (429) gets
                # no more of this job
                if "HTTP 429" not in (last.error or ""):
                    target.down = True
                tried.add(target.name)
            finally:
                await self._release(target)

    def _placed(self) -> None:
        if self.on_placed is not None:
            self.on_placed(self)
