"""Held-out judgments -> the `judge-validate-<name>` eval suite (semantics.md §11.4).

The suite scores a judge adapter on the most recent judgments, the ones compile keeps out of
training: each example asks for a verdict with the same system and user text the judge was trained
on, and a case-insensitive regex pulls `Winner: A|B|Tie` out of the reply and compares it to the
human label. The suite is returned as plain EvalSuite JSON (data/ does not import evals/); the
caller parses and queues it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.data.judge_prompt import LABELS, WINNER_REGEX, judge_messages
from kiln.data.judgment_rows import JudgmentRow, judgment_invalid
from kiln.store.names import MAX_NAME_LEN

SUITE_PREFIX = "judge-validate-"
DEFAULT_HOLDOUT_N = 20
MAX_TOKENS = 64
# Group 1 is the verdict; case-insensitive so "Winner: a" counts as A.
WINNER_SCORER: dict[str, Any] = {"kind": "regex", "pattern": WINNER_REGEX, "capture_group": 1,
                                 "case_sensitive": False}
GENERATION: dict[str, Any] = {"temperature": 0.0, "max_tokens": MAX_TOKENS}


@dataclass
class ValidationPlan:
    suite: dict[str, Any]  # EvalSuite JSON
    holdout_n: int  # rows taken from the end (skips included)
    first_row: int  # index of the first row taken
    warnings: list[str] = field(default_factory=list)

    @property
    def suite_name(self) -> str:
        return self.suite["name"]


def validation_suite_name(name: str) -> str:
    suite_name = SUITE_PREFIX + name
    if len(suite_name) > MAX_NAME_LEN:
        raise judgment_invalid(f"the validation suite name {suite_name!r} would be longer than {MAX_NAME_LEN} "
                               "characters", param="name",
                               hint=f"Use a judgment set name of at most {MAX_NAME_LEN - len(SUITE_PREFIX)} "
                                    "characters.")
    return suite_name


def validation_example(name: str, row: JudgmentRow) -> dict[str, Any]:
    """One held-out judgment as an eval example whose target is the human verdict."""
    example: dict[str, Any] = {
        "id": row.id,
        "messages": judge_messages(row.prompt, row.response_a, row.response_b),
        "target": LABELS[row.winner],
        "tags": list(row.tags),
        "scorer": dict(WINNER_SCORER),
        "generation": dict(GENERATION),
        "metadata": {"judgment": name, "judgment_id": row.id, "winner": row.winner},
    }
    for key in ("adapter_a", "adapter_b"):
        if getattr(row, key) is not None:
            example["metadata"][key] = getattr(row, key)
    return example


def _overlap_warnings(first_row: int, last_compiled_split: int | None) -> list[str]:
    if last_compiled_split is None:
        return ["this judgment set was never compiled, so the judge may have been trained on the validated rows "
                "and accuracy may include training rows"]
    if first_row < last_compiled_split:
        overlap = last_compiled_split - first_row
        return [f"the validated rows overlap the last compile's training rows: {overlap} of them come before its "
                f"train/validation split ({last_compiled_split}), so accuracy includes rows the judge was trained on"]
    return []


def plan_validation(name: str, rows: list[JudgmentRow], *, holdout_n: int | None = None,
                    last_compiled_split: int | None = None) -> ValidationPlan:
    """Build the validation suite from the last max(holdout_n, 1) rows, skip rows left out."""
    suite_name = validation_suite_name(name)
    if holdout_n is None:
        holdout_n = DEFAULT_HOLDOUT_N
    if isinstance(holdout_n, bool) or not isinstance(holdout_n, int) or holdout_n < 0:
        raise judgment_invalid(f"holdout_n must be a non-negative integer, got {holdout_n!r}", param="holdout_n")
    total = len(rows)
    if total < 2:
        raise judgment_invalid(f"{name!r} has {total} judgment(s); validation needs at least 2", param="name",
                               hint="Append more judgments with POST /v1/judgments/{name}/rows.")
    taken = min(max(holdout_n, 1), total)
    first_row = total - taken
    held_out = rows[first_row:]
    labelled = [row for row in held_out if row.winner != "skip"]
    if not labelled:
        raise judgment_invalid(f"the last {taken} judgment(s) of {name!r} are all skips; nothing to validate",
                               param="holdout_n", hint="Use a larger holdout_n, or append a, b or tie judgments.")
    warnings = _overlap_warnings(first_row, last_compiled_split)
    skipped = len(held_out) - len(labelled)
    if skipped:
        warnings.append(f"{skipped} skip judgment(s) among the last {taken} have no label and were left out")
    suite = {
        "name": suite_name,
        "description": f"Held-out validation of a judge on the last {taken} judgment(s) of {name!r} "
                       f"({len(labelled)} labelled).",
        "default_scorer": dict(WINNER_SCORER),
        "generation": dict(GENERATION),
        "examples": [validation_example(name, row) for row in labelled],
        "schema_version": 1,
    }
    return ValidationPlan(suite=suite, holdout_n=taken, first_row=first_row, warnings=warnings)
