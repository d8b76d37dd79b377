"""Judgments -> judge SFT rows, with a recent-rows holdout and A/B swap augmentation (semantics.md §11.3).

The most recent `holdout_n` judgments stay out of training so a later validation run scores rows
the judge never saw. Every other labelled judgment is emitted twice, the second time with the
replies (and their adapter labels) swapped and the label flipped, so the judge cannot learn a
position bias. Both copies share a group_id and therefore always land in the same split partition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.data.judge_prompt import judge_label, judge_messages
from kiln.data.judgment_rows import JudgmentRow, judgment_invalid

FLIP = {"a": "b", "b": "a", "tie": "tie"}
MAX_DEFAULT_HOLDOUT = 20


@dataclass
class CompilePlan:
    holdout_n: int
    train_validation_split: int  # number of source rows before the holdout
    sft_rows: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def default_holdout(total: int) -> int:
    return min(MAX_DEFAULT_HOLDOUT, total // 5)


def sft_row(name: str, row: JudgmentRow, *, swapped: bool) -> dict[str, Any]:
    a, b = (row.response_b, row.response_a) if swapped else (row.response_a, row.response_b)
    adapter_a, adapter_b = (row.adapter_b, row.adapter_a) if swapped else (row.adapter_a, row.adapter_b)
    winner = FLIP[row.winner] if swapped else row.winner
    messages = judge_messages(row.prompt, a, b)
    messages.append({"role": "assistant", "content": judge_label(winner, row.note)})
    return {
        "messages": messages,
        "group_id": f"judgment:{name}:{row.id}",
        "metadata": {
            "judgment": name,
            "judgment_id": row.id,
            "orientation": "swapped" if swapped else "original",
            "adapter_a": adapter_a,
            "adapter_b": adapter_b,
            "winner": winner,
            "tags": row.tags,
        },
    }


def plan_compile(name: str, rows: list[JudgmentRow], *, holdout_n: int | None,
                 include_skips: bool = False) -> CompilePlan:
    total = len(rows)
    if total == 0:
        raise judgment_invalid(f"{name!r} has no judgments to compile", param="name",
                               hint="Append judgments with POST /v1/judgments/{name}/rows first.")
    if holdout_n is None:
        holdout_n = default_holdout(total)
    if isinstance(holdout_n, bool) or not isinstance(holdout_n, int) or holdout_n < 0:
        raise judgment_invalid(f"holdout_n must be a non-negative integer, got {holdout_n!r}", param="holdout_n")
    boundary = total - holdout_n
    if boundary <= 0:
        raise judgment_invalid(f"holdout_n {holdout_n} leaves no rows for training ({total} judgments)",
                               param="holdout_n", hint=f"Use a holdout_n below {total}.")
    plan = CompilePlan(holdout_n=holdout_n, train_validation_split=boundary)
    if holdout_n == 0:
        plan.warnings.append("holdout_n is 0: no judgments are held out, so a validation run will score "
                             "rows the judge was trained on")
    training = rows[:boundary]
    skips = sum(1 for r in training if r.winner == "skip")
    if include_skips and skips:
        plan.warnings.append(f"{skips} skip judgment(s) have no label and were left out despite include_skips")
    for row in training:
        if row.winner == "skip":
            continue
        plan.sft_rows.append(sft_row(name, row, swapped=False))
        plan.sft_rows.append(sft_row(name, row, swapped=True))
    if not plan.sft_rows:
        raise judgment_invalid(f"{name!r} has no labelled (a, b or tie) judgments before the holdout",
                               param="name", hint="Skip judgments carry no label; add a, b or tie judgments.")
    return plan
