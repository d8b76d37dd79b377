"""From dataset rows to a validated eval suite (semantics.md §10.2).

Per conversation: decompose by strategy; per candidate: drop it for a missing target, a target or
prompt over the limits, or a repeat of (last user message, target); offer the rest to a seeded
reservoir capped at max_examples. The kept examples get their scorers (fixed, judge, or auto-detected
per target), tags and provenance metadata, and the suite goes through `parse_suite` like any other,
so a synthesized suite is never one the registry would refuse. Same rows + same seed -> same suite.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kiln.core.messages import message_text
from kiln.errors import KilnError
from kiln.evals.example_id import derive_example_id
from kiln.evals.scorers import scorer_to_json
from kiln.evals.suite import CURRENT_SCHEMA_VERSION, EvalSuite, aggregation_to_json, parse_suite
from kiln.evals.synthesis.autodetect import EXACT_MATCH, detect_scorer
from kiln.evals.synthesis.config import AutoDetectScorer, FixedScorer, SynthesisConfig
from kiln.evals.synthesis.conversations import Conversation, conversation_from_row
from kiln.evals.synthesis.sampling import Reservoir, SplitMix64, effective_seed
from kiln.evals.synthesis.stats import SynthesisStats
from kiln.evals.synthesis.strategies import Candidate, decompose
from kiln.evals.synthesis.targets import Target

PROVENANCE_KEY = "kiln_dataset_provenance"


@dataclass(frozen=True)
class Draft:
    """An accepted candidate, waiting to learn whether the reservoir keeps it."""

    prompt: list[dict[str, Any]]
    target: Target
    tags: tuple[str, ...]
    conversation: Conversation


@dataclass(frozen=True)
class SynthesisResult:
    suite: EvalSuite
    stats: SynthesisStats

    def suite_json(self) -> dict[str, Any]:
        return self.suite.to_json()


def prompt_chars(prompt: list[dict[str, Any]]) -> int:
    return sum(len(message_text(m.get("content"))) + len(m.get("role", "")) + 4 for m in prompt)


def last_user_text(prompt: list[dict[str, Any]]) -> str:
    for m in reversed(prompt):
        if m.get("role") == "user":
            return message_text(m.get("content"))
    return ""


def _no_examples(stats: SynthesisStats, config: SynthesisConfig, dataset: str, split: str) -> KilnError:
    return KilnError(
        400, "dataset_invalid",
        f"Invalid eval dataset: synthesis produced no examples from dataset {dataset!r} ({split} split) with "
        f"strategy {config.strategy}: {stats.skip_summary()}",
        param="strategy",
        hint="Try another strategy or source_split, or raise sampling.max_prompt_chars / max_target_chars.",
    )


def _admit(c: Candidate, config: SynthesisConfig, stats: SynthesisStats, seen: set[str]) -> Target | None:
    """The candidate's target when it passes every filter; otherwise counts why it did not."""
    sampling, target = config.sampling, c.target
    if target is None or not target.text.strip():
        stats.skipped_no_target += 1
        return None
    if len(target.text) > sampling.max_target_chars:
        stats.skipped_target_too_long += 1
        return None
    if prompt_chars(c.prompt) > sampling.max_prompt_chars:
        stats.skipped_prompt_too_long += 1
        return None
    if sampling.dedupe:
        key = last_user_text(c.prompt) + "|" + target.text
        if key in seen:
            stats.skipped_duplicate += 1
            return None
        seen.add(key)
    return target


def _tags(draft: Draft) -> list[str]:
    tags = [*draft.tags, f"kind:{draft.target.kind}"]
    if draft.target.kind == "code" and draft.target.language:
        tags.append(f"synth:lang_{draft.target.language}")
    return tags


def _metadata(draft: Draft, dataset: str, split: str) -> dict[str, Any]:
    meta = dict(draft.conversation.extra)
    meta["synth_kind"] = draft.target.kind
    if draft.target.language:
        meta["synth_language"] = draft.target.language
    meta[PROVENANCE_KEY] = {"dataset": dataset, "source_split": split, "row_identity": draft.conversation.identity}
    return meta


def _default_scorer(config: SynthesisConfig) -> dict[str, Any]:
    choice = config.scorer
    if isinstance(choice, AutoDetectScorer):
        return dict(EXACT_MATCH)
    if isinstance(choice, FixedScorer):
        return scorer_to_json(choice.scorer)
    judge: dict[str, Any] = {"kind": "llm_judge"}
    if choice.judge_adapter is not None:
        judge["judge_adapter"] = choice.judge_adapter
    return judge


def _examples(kept: list[Draft], config: SynthesisConfig, dataset: str, split: str,
              histogram: Counter[str]) -> list[dict[str, Any]]:
    auto = isinstance(config.scorer, AutoDetectScorer)
    fixed_kind = None if auto else _default_scorer(config)["kind"]
    ids: Counter[str] = Counter()
    out = []
    for draft in kept:
        example: dict[str, Any] = {"messages": draft.prompt, "target": draft.target.text}
        if auto:
            detection = detect_scorer(draft.target.detect_text)
            example["scorer"] = detection.scorer
            if detection.target is not None:
                example["target"] = detection.target
            histogram[detection.kind] += 1
        else:
            histogram[fixed_kind] += 1
        example["tags"] = _tags(draft)
        example["metadata"] = _metadata(draft, dataset, split)
        example["weight"] = 1.0
        # Only dedupe=false can repeat a (prompt, target) pair; ids must stay unique, so repeats get a suffix.
        derived = derive_example_id(example["messages"], example["target"], [])
        ids[derived] += 1
        if ids[derived] > 1:
            example["id"] = f"{derived}-{ids[derived]}"
        out.append(example)
    return out


def _generation(config: SynthesisConfig) -> dict[str, Any] | None:
    """The suite's generation object: n follows the aggregation's k unless the body set n itself."""
    k = config.aggregation.k
    if config.generation is None:
        return {"n": k} if k != 1 else None
    out = config.generation.to_json()
    if "n" not in out and k != 1:
        out["n"] = k
    return out


def _description(config: SynthesisConfig, stats: SynthesisStats, dataset: str, split: str) -> str:
    auto = (f"Synthesized from dataset {dataset!r} ({split} split) with strategy {config.strategy}: "
            f"{stats.sample_kept} example(s) kept of {stats.examples_generated} generated from "
            f"{stats.trajectories_used} of {stats.trajectories_seen} trajectories; seed {stats.effective_seed}.")
    user = config.description
    return f"{user}\n\n{auto}" if user and user.strip() else auto


def synthesize(rows: Iterable[Any], config: SynthesisConfig, *, dataset: str, source_split: str,
               max_conversations: int | None = None,
               clock_ns: Callable[[], int] = time.time_ns) -> SynthesisResult:
    """Build the suite; `max_conversations` bounds how many conversations are read (preview's head_n)."""
    stats = SynthesisStats(effective_seed(config.sampling.seed, config.suite_name, clock_ns))
    reservoir: Reservoir[Draft] = Reservoir(config.sampling.max_examples, SplitMix64(stats.effective_seed))
    seen: set[str] = set()
    for row in rows:
        if max_conversations is not None and stats.trajectories_seen >= max_conversations:
            break
        conversation = conversation_from_row(row, strip_system_prompt=config.strip_system_prompt)
        if conversation is None:
            continue
        stats.trajectories_seen += 1
        candidates = decompose(conversation.messages, config.strategy)
        if not candidates:
            stats.skipped_strategy_match += 1
            continue
        used = False
        for c in candidates:
            target = _admit(c, config, stats, seen)
            if target is not None:
                stats.examples_generated += 1
                reservoir.offer(Draft(c.prompt, target, c.tags, conversation))
                used = True
        if used:
            stats.trajectories_used += 1
    if not reservoir.items:
        raise _no_examples(stats, config, dataset, source_split)
    stats.sample_kept = len(reservoir.items)
    examples = _examples(reservoir.items, config, dataset, source_split, stats.auto_scorer_histogram)
    suite_json: dict[str, Any] = {
        "name": config.suite_name,
        "description": _description(config, stats, dataset, source_split),
        "default_scorer": _default_scorer(config),
        "aggregation": aggregation_to_json(config.aggregation),
        "examples": examples,
        "schema_version": CURRENT_SCHEMA_VERSION,
    }
    generation = _generation(config)
    if generation is not None:
        suite_json["generation"] = generation
    if config.system_prompt is not None:
        suite_json["system_prompt"] = config.system_prompt
    if config.suite_tools is not None:
        suite_json["tools"] = config.suite_tools
    return SynthesisResult(parse_suite(suite_json), stats)
