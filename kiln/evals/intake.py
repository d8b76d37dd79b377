"""Turning run, compare, rerun and replay requests into queued jobs (semantics.md §8.10, §8.12, §8.13).

Everything that can be refused is refused here, before a job exists: unknown suites and adapters,
a run-level n that disagrees with the suite's k, a rerun with nothing to re-run, a replay whose
identity no longer holds on this server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError
from kiln.evals.generation import GenerationParams
from kiln.evals.generator import GeneratorIdentity
from kiln.evals.jobs import EvalJob, new_job_id
from kiln.evals.replay import replay_expectation, required_judge_adapters, validate_replay_record
from kiln.evals.requests import CompareSpec, RerunSpec, RunRequest
from kiln.evals.runner import check_completions_per_example
from kiln.evals.seeds import effective_job_seed
from kiln.evals.suite import (
    CODE,
    PREFIX,
    EvalSuite,
    example_id,
    invalid_request,
    parse_suite,
    resolve_examples,
)
from kiln.evals.suite_store import SuiteStore

# adapter name (None = base) -> EvalModelTargetIdentity; raises 404 adapter_not_found for unknown names.
TargetResolver = Callable[[str | None], dict[str, Any]]


@dataclass
class IntakeContext:
    suites: SuiteStore | None
    resolve_target: TargetResolver
    active_adapter: Callable[[], str | None]


def base_target_only(adapter: str | None) -> dict[str, Any]:
    """The resolver when no adapter store knows any adapter: only the base model exists."""
    if adapter is None:
        return {}
    raise KilnError(404, "adapter_not_found", f"adapter {adapter!r} is not available", param="adapter",
                    hint="GET /v1/adapters lists the adapters this server has; \"\" selects the base model.")


def _registered(ctx: IntakeContext, name: str) -> EvalSuite:
    if ctx.suites is None:
        raise KilnError(503, "eval_registry_unavailable", "the eval suite registry is not available",
                        hint="Send the suite as inline_suite instead.")
    return ctx.suites.get(name)


def _adapter_name(value: str | None) -> str | None:
    return value or None  # "" selects the base model


def _check_override(suite: EvalSuite, override: GenerationParams | None) -> None:
    check_completions_per_example(resolve_examples(suite, override), suite.k)


def job_for_run(ctx: IntakeContext, req: RunRequest) -> EvalJob:
    suite = req.inline_suite if req.inline_suite is not None else _registered(ctx, req.suite_name or "")
    # Omitted or null: the adapter the server applies by default; "" is the base model.
    adapter = ctx.active_adapter() if not req.adapter_given or req.adapter is None else _adapter_name(req.adapter)
    ctx.resolve_target(adapter)
    _check_override(suite, req.generation)
    seed = effective_job_seed(req.seed, req.generation.seed if req.generation else None, suite.generation.seed)
    return EvalJob(new_job_id(), suite, [adapter], "on_demand", seed, req.generation)


def job_for_compare(ctx: IntakeContext, spec: CompareSpec) -> EvalJob:
    suite = _registered(ctx, spec.suite_name)
    adapters = [_adapter_name(a) for a in spec.adapters]
    for i, adapter in enumerate(adapters):
        try:
            ctx.resolve_target(adapter)
        except KilnError as e:
            e.param = f"adapters[{i}]"
            raise
    _check_override(suite, spec.generation)
    seed = effective_job_seed(spec.seed, spec.generation.seed if spec.generation else None, suite.generation.seed)
    return EvalJob(new_job_id(), suite, adapters, "compare", seed, spec.generation)


def job_for_rerun(ctx: IntakeContext, source: EvalJob, spec: RerunSpec) -> EvalJob:
    kinds = set(spec.outcome_kinds) | ({"pass"} if spec.include_pass else set())
    ids = {a["example_id"] for run in source.runs for a in run["aggregated_outcomes"] if a["kind"] in kinds}
    if not ids:
        raise invalid_request(f"no matching outcomes to re-run (looked for {', '.join(sorted(kinds))} in "
                              f"{len(source.runs)} finished run(s))", param="outcome_kinds",
                              hint="Widen outcome_kinds, or set include_pass to re-run passing examples too.")
    suite_json = source.suite.to_json()
    examples = [raw for raw, ex in zip(suite_json["examples"], source.suite.examples, strict=True)
                if example_id(ex) in ids]
    seed = spec.seed if spec.seed is not None else source.effective_seed
    generation = {**source.suite.generation.to_json(), "seed": seed}
    suite = parse_suite({**suite_json, "examples": examples, "generation": generation})
    adapter = _adapter_name(spec.adapter) if spec.adapter_given else source.adapters[0]
    ctx.resolve_target(adapter)
    return EvalJob(new_job_id(), suite, [adapter], "on_demand", seed, source.generation_override)


def job_for_replay(ctx: IntakeContext, source: EvalJob, run_index: int, current: GeneratorIdentity) -> EvalJob:
    """Strict intake: the record must be sound, match its job, and match this server now."""
    if source.state != "completed":
        raise invalid_request(f"job {source.job_id} is {source.state}; only completed jobs can be replayed",
                              param="job_id")
    if run_index >= len(source.runs):
        raise invalid_request(f"run_index: job {source.job_id} has {len(source.runs)} run(s)", param="run_index")
    run = source.runs[run_index]
    record = run.get("replay_record")
    if record is None:
        raise invalid_request(f"run {run_index} of job {source.job_id} carries no replay record", param="run_index")
    problems = validate_replay_record(record, outcomes=run.get("outcomes"), budget_defaults=current.budget_defaults)
    if not problems:
        problems = _identity_problems(ctx, source, run, record, current)
    if problems:
        raise KilnError(400, CODE, f"{PREFIX}strict replay refused: {'; '.join(problems)}", param="run_index",
                        hint="Replay needs the same model, adapters, scorers and server settings as the source "
                             "run; start a fresh run instead.")
    suite = parse_suite(record["suite"])
    override = record.get("generation_override")
    job = EvalJob(new_job_id(), suite, [run["adapter"]], "on_demand", source.effective_seed,
                  GenerationParams.model_validate(override) if override is not None else None)
    job.replay_expectation = replay_expectation(source.job_id, run_index, record)
    return job


def _identity_problems(ctx: IntakeContext, source: EvalJob, run: Mapping[str, Any],
                       record: Mapping[str, Any], current: GeneratorIdentity) -> list[str]:
    out = []
    if record["suite_sha256"] != run.get("suite_hash"):
        out.append("the record's suite digest differs from the run's suite_hash")
    if record["effective_generation_sha256"] != run.get("effective_generation_hash"):
        out.append("the record's generation digest differs from the run's effective_generation_hash")
    if record["effective_seed"] != str(source.effective_seed):
        out.append("the record's seed differs from the job's effective seed")
    if record["model_target"].get("adapter") != run.get("adapter"):
        out.append("the record's model target is not the run's adapter")
    source_identity = GeneratorIdentity(source.execution_provenance or {}, source.base_weight_manifest or {})
    if source.execution_provenance is None or \
            record["execution_provenance_sha256"] != source_identity.execution_provenance_sha256:
        out.append("the record's execution provenance differs from the job's")
    if source.base_weight_manifest is None or \
            record["base_weight_manifest_sha256"] != source_identity.base_weight_manifest_sha256:
        out.append("the record's base weight manifest differs from the job's")
    if current.execution_provenance_sha256 != record["execution_provenance_sha256"]:
        out.append("this server's execution provenance differs from the source run's")
    if current.base_weight_manifest_sha256 != record["base_weight_manifest_sha256"]:
        out.append("this server's base weights differ from the source run's")
    out += _target_problems(ctx, record)
    return out


def _target_problems(ctx: IntakeContext, record: Mapping[str, Any]) -> list[str]:
    wanted = [record["model_target"], *record.get("judge_targets", [])]
    out = []
    for target in wanted:
        name = target.get("adapter")
        try:
            now = ctx.resolve_target(name)
        except KilnError as e:
            out.append(f"adapter {name!r} is no longer available: {e.message}")
            continue
        if now.get("adapter_content_sha256") != target.get("adapter_content_sha256"):
            out.append(f"adapter {name!r} changed since the source run")
    return out


def judge_targets_for(ctx: IntakeContext, suite: EvalSuite,
                      override: GenerationParams | None) -> dict[str | None, dict[str, Any]]:
    """Identity of each judge adapter the suite's scorers need; unknown ones are left out."""
    out: dict[str | None, dict[str, Any]] = {}
    for adapter in required_judge_adapters(resolve_examples(suite, override)):
        try:
            out[adapter] = ctx.resolve_target(adapter)
        except KilnError:
            continue
    return out
