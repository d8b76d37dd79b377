"""Strict replay identity (kiln.eval-replay.v1, semantics.md §8.13): build, validate, expect, judge.

Every run writes an EvalReplayRecordV1 naming exactly what produced its completions: the suite, the
run-level generation override, the seed, the resolved thinking budgets, the model and judge targets,
each example's scorer, the execution environment and base weights, and a digest of every raw
completion. A replay re-runs the same inputs and compares two digests: the record's and the raw
completion set's. Both equal -> `matched`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kiln.core.thinking_budget import EffectiveBudget, ServerBudgetDefaults, budget_record, resolve_budget
from kiln.errors import KilnError
from kiln.evals.digests import (
    EFFECTIVE_GENERATION_DOMAIN,
    RAW_COMPLETION_SET_DOMAIN,
    RECORD_DOMAIN,
    SCORER_DOMAIN,
    SUITE_DOMAIN,
    hash_json,
    is_digest,
    text_sha256,
)
from kiln.evals.generation import GenerationParams
from kiln.evals.outcome import ExampleOutcome
from kiln.evals.scorers import judge_adapters, requires_judge, scorer_to_json
from kiln.evals.seeds import SEED_DERIVATION, derive_generation_seed, seed_root_for
from kiln.evals.suite import EvalSuite, ResolvedExample, parse_suite, resolve_examples

RECORD_TYPE = "kiln.eval-replay.v1"
EXPECTATION_TYPE = "kiln.eval-replay-expectation.v1"
_DIGEST_FIELDS = ("suite_sha256", "effective_generation_sha256", "raw_completion_set_sha256", "record_sha256")


# ---- the pieces ---------------------------------------------------------------------------------

def suite_sha256(suite: EvalSuite) -> str:
    return hash_json(SUITE_DOMAIN, suite.to_json())


def effective_budget(example: ResolvedExample, defaults: ServerBudgetDefaults) -> EffectiveBudget:
    """The example's budget: its effective generation object wins whole and names the scope (§2.2)."""
    gen = example.generation
    return resolve_budget(_budget_fields(gen.params), defaults, scope=gen.scope, code="eval_invalid_request")


def _budget_fields(params: GenerationParams) -> dict[str, Any]:
    return {k: getattr(params, k) for k in ("thinking_budget_tokens", "thinking_budget_ms")
            if k in params.model_fields_set}


def resolved_budget_record(budget: EffectiveBudget, applied: bool) -> dict[str, Any]:
    """The pre-decode record of one example (no outcome): what the replay must resolve again."""
    return budget_record(budget, applied=applied and budget.configured)


def effective_generation_sha256(effective_seed: int, suite_digest: str, override: GenerationParams | None,
                                budgets: Sequence[Mapping[str, Any]]) -> str:
    return hash_json(EFFECTIVE_GENERATION_DOMAIN, {
        "seed_derivation": SEED_DERIVATION,
        "effective_seed": str(effective_seed),
        "suite_sha256": suite_digest,
        "generation_override": override.to_json() if override is not None else None,
        "resolved_thinking_budgets": list(budgets),
    })


def scorer_identity(example: ResolvedExample) -> dict[str, Any]:
    out: dict[str, Any] = {
        "example_id": example.id,
        "kind": example.scorer.kind,
        "config_sha256": hash_json(SCORER_DOMAIN, scorer_to_json(example.scorer)),
        "requires_judge": requires_judge(example.scorer),
    }
    judge = judge_adapter_of(example)
    if judge is not None:
        out["judge_adapter"] = judge
    return out


def judge_adapter_of(example: ResolvedExample) -> str | None:
    """The adapter the judge pass uses for this example (None = base); one per example."""
    adapters = judge_adapters(example.scorer)
    return adapters[0] if adapters else None


def required_judge_adapters(examples: Sequence[ResolvedExample]) -> list[str | None]:
    out: list[str | None] = []
    for ex in examples:
        if requires_judge(ex.scorer):
            adapter = judge_adapter_of(ex)
            if adapter not in out:
                out.append(adapter)
    return out


def sorted_targets(targets: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Judge targets sorted by adapter name (base first) and deduplicated."""
    unique = {(t.get("adapter") or "", t.get("adapter_content_sha256") or ""): dict(t) for t in targets}
    return [unique[k] for k in sorted(unique)]


def raw_completion_refs(outcomes: Sequence[ExampleOutcome]) -> list[dict[str, Any]]:
    refs = []
    for i, o in enumerate(outcomes):
        raw = o.raw_completion_text if o.raw_completion_text is not None else o.completion_text
        ref: dict[str, Any] = {"outcome_index": i, "example_id": o.example_id, "completion_index": o.completion_index}
        if o.generation_seed is not None:
            ref["generation_seed"] = str(o.generation_seed)
        ref.update(
            raw_completion_pointer=f"/outcomes/{i}/raw_completion_text",
            raw_completion_sha256=text_sha256(raw),
            raw_completion_bytes=len(raw.encode("utf-8")),
            normalized_completion_sha256=text_sha256(o.completion_text),
            normalized_completion_bytes=len(o.completion_text.encode("utf-8")),
        )
        refs.append(ref)
    return refs


def _hash_body(record: Mapping[str, Any]) -> dict[str, Any]:
    """Every identity field but the record digest, in order; absent options as null."""
    return {
        "schema_version": record.get("schema_version"),
        "record_type": record.get("record_type"),
        "suite": record.get("suite"),
        "generation_override": record.get("generation_override"),
        "effective_seed": record.get("effective_seed"),
        "seed_derivation": record.get("seed_derivation"),
        "resolved_thinking_budgets": record.get("resolved_thinking_budgets"),
        "model_target": record.get("model_target"),
        "judge_targets": list(record.get("judge_targets") or []),
        "scorer_identities": record.get("scorer_identities"),
        "raw_completions": record.get("raw_completions"),
        "suite_sha256": record.get("suite_sha256"),
        "effective_generation_sha256": record.get("effective_generation_sha256"),
        "raw_completion_set_sha256": record.get("raw_completion_set_sha256"),
        "execution_provenance_sha256": record.get("execution_provenance_sha256"),
        "base_weight_manifest_sha256": record.get("base_weight_manifest_sha256"),
    }


def record_sha256(record: Mapping[str, Any]) -> str:
    return hash_json(RECORD_DOMAIN, _hash_body(record))


def build_replay_record(
    *,
    suite: EvalSuite,
    examples: Sequence[ResolvedExample],
    generation_override: GenerationParams | None,
    effective_seed: int,
    resolved_budgets: Sequence[Mapping[str, Any]],
    model_target: Mapping[str, Any],
    judge_targets: Sequence[Mapping[str, Any]],
    outcomes: Sequence[ExampleOutcome],
    execution_provenance_sha256: str | None,
    base_weight_manifest_sha256: str | None,
) -> dict[str, Any]:
    suite_digest = suite_sha256(suite)
    refs = raw_completion_refs(outcomes)
    record: dict[str, Any] = {"schema_version": 1, "record_type": RECORD_TYPE, "suite": suite.to_json()}
    if generation_override is not None:
        record["generation_override"] = generation_override.to_json()
    record.update(
        effective_seed=str(effective_seed),
        seed_derivation=SEED_DERIVATION,
        resolved_thinking_budgets=[dict(b) for b in resolved_budgets],
        model_target=dict(model_target),
        judge_targets=sorted_targets(judge_targets),
        scorer_identities=[scorer_identity(ex) for ex in examples],
        raw_completions=refs,
        suite_sha256=suite_digest,
        effective_generation_sha256=effective_generation_sha256(effective_seed, suite_digest, generation_override,
                                                                resolved_budgets),
        raw_completion_set_sha256=hash_json(RAW_COMPLETION_SET_DOMAIN, refs),
    )
    if execution_provenance_sha256 is not None:
        record["execution_provenance_sha256"] = execution_provenance_sha256
    if base_weight_manifest_sha256 is not None:
        record["base_weight_manifest_sha256"] = base_weight_manifest_sha256
    record["record_sha256"] = record_sha256(record)
    return record


# ---- strict validation --------------------------------------------------------------------------

def validate_replay_record(record: Any, *, outcomes: Sequence[Mapping[str, Any]] | None = None,
                           budget_defaults: ServerBudgetDefaults | None = None) -> list[str]:
    """Every problem that makes the record unusable for a strict replay; [] when it is sound.

    `outcomes` (the run's wire outcomes) are checked against the raw digests; `budget_defaults`
    (the current server's) re-resolve each example's thinking budget.
    """
    if not isinstance(record, dict):
        return ["replay record is not an object"]
    problems: list[str] = []
    if record.get("schema_version") != 1 or record.get("record_type") != RECORD_TYPE:
        problems.append(f"record is not a {RECORD_TYPE} schema_version 1 record")
    if record.get("seed_derivation") != SEED_DERIVATION:
        problems.append(f"seed_derivation is not {SEED_DERIVATION}")
    for name in (*_DIGEST_FIELDS, "execution_provenance_sha256", "base_weight_manifest_sha256"):
        if not is_digest(record.get(name)):
            problems.append(f"{name} is missing or malformed")
    if problems:
        return problems
    try:
        suite = parse_suite(record["suite"])
        override = (GenerationParams.model_validate(record["generation_override"])
                    if record.get("generation_override") is not None else None)
        seed = int(record["effective_seed"])
    except (KilnError, ValueError, TypeError) as e:
        return [f"record suite, generation override or seed is invalid: {getattr(e, 'message', e)}"]
    examples = resolve_examples(suite, override)
    budgets = record.get("resolved_thinking_budgets")
    problems += _check_digests(record, budgets)
    problems += _check_targets(record, examples)
    if record.get("scorer_identities") != [scorer_identity(ex) for ex in examples]:
        problems.append("scorer identities do not match the suite's scorers")
    problems += _check_budgets(budgets, examples, budget_defaults)
    problems += _check_completions(record.get("raw_completions") or [], examples, suite.k, seed, outcomes)
    return problems


def _check_digests(record: Mapping[str, Any], budgets: Any) -> list[str]:
    out = []
    suite_digest = hash_json(SUITE_DOMAIN, record["suite"])
    if suite_digest != record["suite_sha256"]:
        out.append("suite_sha256 does not match the recorded suite")
    override = record.get("generation_override")
    gen_digest = hash_json(EFFECTIVE_GENERATION_DOMAIN, {
        "seed_derivation": SEED_DERIVATION, "effective_seed": record.get("effective_seed"),
        "suite_sha256": suite_digest, "generation_override": override, "resolved_thinking_budgets": budgets,
    })
    if gen_digest != record["effective_generation_sha256"]:
        out.append("effective_generation_sha256 does not match the recorded generation inputs")
    if hash_json(RAW_COMPLETION_SET_DOMAIN, record.get("raw_completions")) != record["raw_completion_set_sha256"]:
        out.append("raw_completion_set_sha256 does not match the recorded raw completions")
    if record_sha256(record) != record["record_sha256"]:
        out.append("record_sha256 does not match the record")
    return out


def _check_targets(record: Mapping[str, Any], examples: Sequence[ResolvedExample]) -> list[str]:
    out = []
    target = record.get("model_target")
    if not isinstance(target, dict):
        return ["model_target is missing"]
    if ("adapter" in target) != ("adapter_content_sha256" in target):
        out.append("model_target must name an adapter together with its content digest")
    elif "adapter_content_sha256" in target and not is_digest(target["adapter_content_sha256"]):
        out.append("model_target adapter digest is malformed")
    recorded = record.get("judge_targets") or []
    names = sorted((t.get("adapter") if isinstance(t, dict) else "?") or "" for t in recorded)
    required = sorted(a or "" for a in required_judge_adapters(examples))
    if names != required:
        out.append(f"judge targets {names} differ from the judge adapters the scorers need {required}")
    for t in recorded:
        if isinstance(t, dict) and "adapter" in t and not is_digest(t.get("adapter_content_sha256")):
            out.append(f"judge target {t['adapter']!r} has no content digest")
    return out


def _check_budgets(budgets: Any, examples: Sequence[ResolvedExample],
                   defaults: ServerBudgetDefaults | None) -> list[str]:
    if not isinstance(budgets, list) or len(budgets) != len(examples):
        return [f"resolved_thinking_budgets must hold one record per example ({len(examples)})"]
    if defaults is None:
        return []
    for ex, rec in zip(examples, budgets, strict=True):
        expected = effective_budget(ex, defaults).to_dict()
        got = {k: rec.get(k) for k in expected} if isinstance(rec, dict) else None
        if got != expected:
            return [f"example {ex.id}: thinking budget {got} differs from what this server resolves {expected}"]
    return []


def _check_completions(refs: list[Any], examples: Sequence[ResolvedExample], k: int, seed: int,
                       outcomes: Sequence[Mapping[str, Any]] | None) -> list[str]:
    expected = {(ex.id, i) for ex in examples for i in range(k)}
    seen = [(r.get("example_id"), r.get("completion_index")) for r in refs if isinstance(r, dict)]
    if len(seen) != len(refs) or len(set(seen)) != len(seen) or set(seen) != expected:
        return [f"raw completions do not cover each example's completions 0..{k - 1} exactly once"]
    by_id = {ex.id: ex for ex in examples}
    for i, ref in enumerate(refs):
        ex = by_id[ref["example_id"]]
        root = seed_root_for(ex.generation.params.seed, seed)
        if ref.get("generation_seed") != str(derive_generation_seed(root, ex.id, ref["completion_index"])):
            return [f"raw completion {i}: generation_seed is not the derived {SEED_DERIVATION} seed"]
        if not (is_digest(ref.get("raw_completion_sha256")) and is_digest(ref.get("normalized_completion_sha256"))):
            return [f"raw completion {i}: a completion digest is missing"]
        if ref.get("outcome_index") != i or ref.get("raw_completion_pointer") != f"/outcomes/{i}/raw_completion_text":
            return [f"raw completion {i}: outcome index or pointer is wrong"]
        if outcomes is not None:
            problem = _check_against_outcome(i, ref, outcomes)
            if problem:
                return [problem]
    return []


def _check_against_outcome(i: int, ref: Mapping[str, Any], outcomes: Sequence[Mapping[str, Any]]) -> str | None:
    if i >= len(outcomes):
        return f"raw completion {i}: the run has no outcome {i}"
    o = outcomes[i]
    raw = o.get("raw_completion_text", o.get("completion_text", ""))
    if (o.get("example_id"), o.get("completion_index")) != (ref["example_id"], ref["completion_index"]):
        return f"raw completion {i}: points at a different outcome"
    if text_sha256(raw) != ref["raw_completion_sha256"] or \
            text_sha256(o.get("completion_text", "")) != ref["normalized_completion_sha256"]:
        return f"raw completion {i}: the stored completion bytes do not match their digests"
    return None


# ---- expectation and verdict --------------------------------------------------------------------

def replay_expectation(source_job_id: str, run_index: int, record: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "expectation_type": EXPECTATION_TYPE,
        "source_job_id": source_job_id,
        "source_run_index": run_index,
        "expected_record_sha256": record["record_sha256"],
        "expected_raw_completion_set_sha256": record["raw_completion_set_sha256"],
    }


def replay_verdict(expectation: Mapping[str, Any], actual: Mapping[str, Any] | None,
                   *, error: str | None = None) -> dict[str, Any]:
    """matched iff both digests are equal; mismatch needs both actual digests; error otherwise."""
    out: dict[str, Any] = {
        "source_job_id": expectation["source_job_id"],
        "source_run_index": expectation["source_run_index"],
        "expected_record_sha256": expectation["expected_record_sha256"],
    }
    actual_record = actual.get("record_sha256") if actual else None
    actual_raw = actual.get("raw_completion_set_sha256") if actual else None
    if actual_record is not None:
        out["actual_record_sha256"] = actual_record
    out["expected_raw_completion_set_sha256"] = expectation["expected_raw_completion_set_sha256"]
    if actual_raw is not None:
        out["actual_raw_completion_set_sha256"] = actual_raw
    if error is not None or actual_record is None or actual_raw is None:
        status, message = "error", f"replay did not produce a comparable run: {error or 'no replay record'}"
    else:
        same_record = actual_record == expectation["expected_record_sha256"]
        same_raw = actual_raw == expectation["expected_raw_completion_set_sha256"]
        if same_record and same_raw:
            status, message = "matched", "replay reproduced the source run's identity and raw completion bytes"
        else:
            what = [name for name, same in (("record", same_record), ("raw completion set", same_raw)) if not same]
            status, message = "mismatch", f"replay differs from the source run: {' and '.join(what)} digest changed"
    return {"status": status, **out, "message": message}
