"""Fakes shared by the eval job tests (no model): a scripted Generator and a manager builder.

This module holds no tests; it is named so that it sits with the job tests it serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.core.thinking_budget import ServerBudgetDefaults
from kiln.errors import KilnError
from kiln.evals.generator import GenerationRequest, GenerationResult, GeneratorIdentity
from kiln.evals.intake import IntakeContext, base_target_only
from kiln.evals.job_manager import EvalJobManager
from kiln.evals.job_store import EvalJobStore
from kiln.evals.suite import parse_suite
from kiln.evals.suite_store import SuiteStore

SCHEMA = "kiln-evals-v1.schema.json"
ANSWERS = {"2 + 2?": "4", "3 + 3?": "7", "5 + 5?": "10"}


def question(req: GenerationRequest) -> str:
    return str(req.messages[-1]["content"])


def arithmetic(req: GenerationRequest) -> str:
    """Right for 2+2 and 5+5, wrong for 3+3; sampled requests lead with their seed so it shows."""
    text = ANSWERS.get(question(req), "?")
    return text if req.temperature == 0 else f"[{req.seed}] {text}"


def suite_data(name: str = "math", **overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": name,
        "default_scorer": {"kind": "exact_match"},
        "schema_version": 2,
        "examples": [
            {"id": "two", "messages": [{"role": "user", "content": "2 + 2?"}], "target": "4", "tags": ["easy"]},
            {"id": "three", "messages": [{"role": "user", "content": "3 + 3?"}], "target": "6", "tags": ["easy"]},
            {"id": "five", "messages": [{"role": "user", "content": "5 + 5?"}], "target": "10", "tags": ["hard"]},
        ],
    }
    data.update(overrides)
    return data


class FakeGenerator:
    """Answers from a function; `hold` blocks chosen questions until released (or cancelled)."""

    def __init__(self, answer: Callable[[GenerationRequest], str] = arithmetic, *,
                 provenance: dict[str, Any] | None = None, budget_defaults: ServerBudgetDefaults | None = None,
                 fail_with: str | None = None) -> None:
        self.answer = answer
        self.provenance = provenance or {"engine": "fake", "version": 1}
        self.budget_defaults = budget_defaults or ServerBudgetDefaults()
        self.fail_with = fail_with
        self.calls: list[list[GenerationRequest]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.hold: set[str] = set()
        self.release = asyncio.Event()
        self.started = asyncio.Event()  # set when any call starts
        self.cancelled = 0

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self.calls.append(list(requests))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.started.set()
        try:
            if any(question(r) in self.hold for r in requests):
                await self.release.wait()
            await asyncio.sleep(0)
            if self.fail_with:
                raise RuntimeError(self.fail_with)
            return [GenerationResult(text=self.answer(r), prompt_tokens=5, completion_tokens=2,
                                     latency_ms=10.0 + i) for i, r in enumerate(requests)]
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1

    async def identity(self) -> GeneratorIdentity:
        return GeneratorIdentity(dict(self.provenance), {"schema": "fake-weights", "files": []}, self.budget_defaults)

    def requests(self) -> list[GenerationRequest]:
        return [r for call in self.calls for r in call]


def make_manager(root: Path, generator: FakeGenerator | None = None, *, max_queued: int = 32,
                 max_tracked: int = 1024, adapters: dict[str, str] | None = None,
                 active: str | None = None) -> tuple[EvalJobManager, FakeGenerator]:
    """A manager over `root` with the suite `math` registered; `adapters` maps name -> content digest."""
    gen = generator or FakeGenerator()
    suites = SuiteStore(root / "suites")
    suites.save(parse_suite(suite_data()), force=True)
    known = adapters or {}

    def resolve(adapter: str | None) -> dict[str, Any]:
        if adapter in known:
            return {"adapter": adapter, "adapter_content_sha256": known[adapter]}
        return base_target_only(adapter)

    ctx = IntakeContext(suites=suites, resolve_target=resolve, active_adapter=lambda: active)
    manager = EvalJobManager(EvalJobStore(root / "jobs"), ctx, lambda: gen, max_queued_jobs=max_queued,
                             max_tracked_jobs=max_tracked)
    return manager, gen


def no_model() -> FakeGenerator:
    raise KilnError(503, "model_loading", "the model is still loading")


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def digest(ch: str) -> str:
    return "sha256:" + ch * 64
