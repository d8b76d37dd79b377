"""One suite against one model target: generate every completion concurrently, score, judge, reduce.

All examples x k completions go to the generator at once (one `generate` call per example, gathered),
so a local engine batches the whole run. Each example is scored as soon as its k completions are
back, which drives live progress and lets a cancel keep every fully finished example. Judge-scored
examples wait for a second pass that asks the judge model once per distinct prompt.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kiln.errors import KilnError
from kiln.evals.aggregate import aggregate_example
from kiln.evals.generation import GenerationParams
from kiln.evals.generator import GenerationRequest, GenerationResult, Generator, GeneratorIdentity
from kiln.evals.outcome import Completion, ExampleOutcome, apply_judge, build_outcome
from kiln.evals.replay import (
    build_replay_record,
    effective_budget,
    effective_generation_sha256,
    judge_adapter_of,
    required_judge_adapters,
    resolved_budget_record,
    suite_sha256,
)
from kiln.evals.result import aggregate_suite
from kiln.evals.scorers import requires_judge
from kiln.evals.scorers.base import PASS
from kiln.evals.seeds import derive_generation_seed, seed_root_for
from kiln.evals.suite import CODE, PREFIX, EvalSuite, ResolvedExample, resolve_examples

log = logging.getLogger("kiln.evals")


@dataclass(frozen=True)
class RunPlan:
    suite: EvalSuite
    effective_seed: int
    adapter: str | None = None  # None = base model
    model_target: Mapping[str, Any] = field(default_factory=dict)  # EvalModelTargetIdentity
    generation_override: GenerationParams | None = None
    # judge adapter (None = base) -> its EvalModelTargetIdentity; missing ones count as base ({}).
    judge_targets: Mapping[str | None, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class RunProgress:
    examples_completed: int
    examples_total: int
    running_accuracy: float
    running_mean_score: float

    def to_wire(self) -> dict[str, Any]:
        return {"examples_completed": self.examples_completed, "examples_total": self.examples_total,
                "running_accuracy": self.running_accuracy, "running_mean_score": self.running_mean_score}


@dataclass(frozen=True)
class RunResult:
    suite_result: dict[str, Any]  # the contract's SuiteResult
    cancelled: bool


ProgressFn = Callable[[RunProgress], None]


def check_completions_per_example(examples: Sequence[ResolvedExample], k: int) -> None:
    """At run time the effective n (a run-level override included) must equal the aggregation's k."""
    for ex in examples:
        n = ex.generation.params.n
        if n != k:
            where = "the run's generation override" if ex.generation.scope == "run_override" else "its generation"
            raise KilnError(400, CODE, f"{PREFIX}example {ex.id}: n = {n} from {where}, but aggregation k = {k}",
                            param="generation.n", hint="Set generation.n to the suite aggregation's k.")


def example_requests(plan: RunPlan, ex: ResolvedExample, budget: Any) -> list[GenerationRequest]:
    params = ex.generation.params
    root = seed_root_for(params.seed, plan.effective_seed)
    return [
        GenerationRequest.from_params(params, ex.messages, tools=ex.tools,
                                      seed=derive_generation_seed(root, ex.id, i), budget=budget,
                                      adapter=plan.adapter, label=f"{ex.id}#{i}")
        for i in range(params.n)
    ]


async def _generate(generator: Generator, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """A generator that raises fails every request it was given, not the run."""
    try:
        results = await generator.generate(requests)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - recorded as each completion's `error` outcome
        log.warning("eval generation failed: %s", e)
        return [GenerationResult.failed(f"generation failed: {e}") for _ in requests]
    if len(results) != len(requests):
        return [GenerationResult.failed("generation failed: the generator returned the wrong number of results")
                for _ in requests]
    return list(results)


def _outcomes(ex: ResolvedExample, requests: Sequence[GenerationRequest],
              results: Sequence[GenerationResult]) -> list[ExampleOutcome]:
    out = []
    for i, (req, res) in enumerate(zip(requests, results, strict=True)):
        budget = res.thinking_budget if res.thinking_budget and res.thinking_budget.get("configured") else None
        completion = Completion(raw_text=res.text, latency_ms=res.latency_ms, prompt_tokens=res.prompt_tokens,
                                completion_tokens=res.completion_tokens, thinking_budget=budget, error=res.error)
        out.append(build_outcome(ex, i, completion, prompt_starts_in_reasoning=res.prompt_starts_in_reasoning,
                                 generation_seed=req.seed, defer_judge=True))
    return out


class _Run:
    def __init__(self, plan: RunPlan, generator: Generator, identity: GeneratorIdentity,
                 on_progress: ProgressFn | None) -> None:
        self.plan, self.generator, self.identity, self.on_progress = plan, generator, identity, on_progress
        self.examples = resolve_examples(plan.suite, plan.generation_override)
        check_completions_per_example(self.examples, plan.suite.k)
        self.budgets = [effective_budget(ex, identity.budget_defaults) for ex in self.examples]
        self.outcomes: dict[int, list[ExampleOutcome]] = {}
        self.applied: dict[int, bool] = {}
        self.final: set[int] = set()
        self._passes = 0
        self._score_sum = 0.0

    async def generate_all(self, stop: asyncio.Event | None) -> bool:
        """Every example concurrently; returns False when `stop` cut the run short."""
        tasks = {asyncio.create_task(self._example(j)) for j in range(len(self.examples))}
        stopper = asyncio.create_task(stop.wait()) if stop is not None else None
        try:
            pending = set(tasks)
            while pending:
                waiting = pending | ({stopper} if stopper else set())
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in done & pending:
                    pending.discard(task)
                    task.result()  # re-raise a scoring bug instead of hiding it
                if stop is not None and stop.is_set() and pending:
                    return False
            return True
        finally:
            for task in (*tasks, *([stopper] if stopper else [])):
                task.cancel()
            await asyncio.gather(*tasks, *([stopper] if stopper else []), return_exceptions=True)

    async def _example(self, j: int) -> None:
        ex = self.examples[j]
        requests = example_requests(self.plan, ex, self.budgets[j])
        results = await _generate(self.generator, requests)
        first = results[0].thinking_budget if results else None
        self.applied[j] = bool(first and first.get("applied"))
        # Scorers may run subprocesses (python_doctest): keep the event loop free.
        self.outcomes[j] = await asyncio.to_thread(_outcomes, ex, requests, results)
        if not requires_judge(ex.scorer):
            self._finalize(j)
        self._report()

    def _finalize(self, j: int) -> None:
        """Count a fully scored example into the running progress (judge examples after their pass)."""
        reduced = aggregate_example(self.plan.suite.aggregation, self.outcomes[j])
        self.final.add(j)
        self._passes += reduced.kind == PASS
        self._score_sum += reduced.score

    def _report(self) -> None:
        if self.on_progress is None:
            return
        n = len(self.final)
        self.on_progress(RunProgress(
            examples_completed=n, examples_total=len(self.examples),
            running_accuracy=self._passes / n if n else 0.0,
            running_mean_score=min(1.0, max(0.0, self._score_sum / n)) if n else 0.0,
        ))

    async def judge_pass(self) -> None:
        """Ask the judge once per distinct (adapter, prompt), then replace the placeholders."""
        waiting = [j for j in sorted(self.outcomes) if j not in self.final]
        if not waiting:
            return
        prompts: dict[tuple[str | None, str], int] = {}
        for j in waiting:
            ex, adapter = self.examples[j], judge_adapter_of(self.examples[j])
            for o in self.outcomes[j]:
                for prompt in await asyncio.to_thread(_judge_prompts, o, ex):
                    prompts.setdefault((adapter, prompt), len(prompts))
        requests = [GenerationRequest.judge(prompt, adapter=adapter, label=f"judge#{n}")
                    for (adapter, prompt), n in prompts.items()]
        results = await _generate(self.generator, requests)
        replies = {key: results[n] for key, n in prompts.items()}
        for j in waiting:
            ex, adapter = self.examples[j], judge_adapter_of(self.examples[j])
            self.outcomes[j] = await asyncio.to_thread(_judged, self.outcomes[j], ex, adapter, replies)
            self._finalize(j)
        self._report()

    def kept(self) -> tuple[list[ResolvedExample], list[ExampleOutcome]]:
        """Fully finished examples in suite order (a cancel drops the rest)."""
        js = sorted(self.final)
        return [self.examples[j] for j in js], [o for j in js for o in self.outcomes[j]]

    def resolved_budgets(self) -> list[dict[str, Any]]:
        return [resolved_budget_record(b, self.applied.get(j, False)) for j, b in enumerate(self.budgets)]


class _CollectPrompts(Exception):
    pass


def _judge_prompts(outcome: ExampleOutcome, ex: ResolvedExample) -> list[str]:
    """The prompts a judge would be asked for this outcome (scoring is deterministic, so pass 2 asks the same)."""
    asked: list[str] = []

    def record(prompt: str) -> str:
        asked.append(prompt)
        raise _CollectPrompts

    apply_judge(outcome, ex, record)
    return asked


def _judged(outcomes: list[ExampleOutcome], ex: ResolvedExample, adapter: str | None,
            replies: Mapping[tuple[str | None, str], GenerationResult]) -> list[ExampleOutcome]:
    def judge(prompt: str) -> str:
        reply = replies.get((adapter, prompt))
        if reply is None:
            raise RuntimeError("no judge reply for this prompt")
        if reply.error is not None:
            raise RuntimeError(reply.error)
        return reply.text

    return [apply_judge(o, ex, judge) for o in outcomes]


def _judge_targets(plan: RunPlan, adapters: Sequence[str | None]) -> list[Mapping[str, Any]]:
    """Identities of the judges used; the base model is {}, an adapter nobody could resolve is left out."""
    return [plan.judge_targets.get(a, {}) for a in adapters if a is None or a in plan.judge_targets]


def _now() -> datetime:
    return datetime.now(UTC)


async def run_suite(plan: RunPlan, generator: Generator, identity: GeneratorIdentity, *,
                    stop: asyncio.Event | None = None, on_progress: ProgressFn | None = None) -> RunResult:
    """Run the whole suite once; `stop` (set by a cancel) ends it at the next example boundary."""
    run = _Run(plan, generator, identity, on_progress)
    started = _now()
    if on_progress is not None:
        on_progress(RunProgress(0, len(run.examples), 0.0, 0.0))
    if await run.generate_all(stop) and not (stop is not None and stop.is_set()):
        await run.judge_pass()
    examples, outcomes = run.kept()
    complete = len(examples) == len(run.examples)
    finished = _now()
    suite_digest = suite_sha256(plan.suite)
    record = None
    gen_digest = None
    if complete:
        judges = required_judge_adapters(run.examples)
        record = build_replay_record(
            suite=plan.suite, examples=run.examples, generation_override=plan.generation_override,
            effective_seed=plan.effective_seed, resolved_budgets=run.resolved_budgets(),
            model_target=plan.model_target, judge_targets=_judge_targets(plan, judges),
            outcomes=outcomes, execution_provenance_sha256=identity.execution_provenance_sha256,
            base_weight_manifest_sha256=identity.base_weight_manifest_sha256,
        )
        gen_digest = effective_generation_sha256(plan.effective_seed, suite_digest, plan.generation_override,
                                                 run.resolved_budgets())
    result = aggregate_suite(
        plan.suite, outcomes, adapter=plan.adapter, started_at=started, finished_at=finished, examples=examples,
        suite_sha256=suite_digest, effective_generation_hash=gen_digest, replay_record=record,
    )
    return RunResult(result, cancelled=not complete)
