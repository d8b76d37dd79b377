"""GRPO rewards from an eval scorer, so training and evals share one definition of "correct".

`reward_scorer: {"scorer": <any eval scorer>, "target": "..."}`: each completion's reward is the
scorer's score (0..1) against the group's own `target` (and `aliases`), or the scorer-wide target.
Reasoning is split off first, exactly as eval scoring does.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kiln.evals.scorers import parse_scorer, requires_judge, score_completion
from kiln.evals.scorers.base import ExampleView
from kiln.train.errors import invalid, row_invalid
from kiln.train.grpo import RewardFn


def scorer_reward_fn(config: dict[str, Any]) -> RewardFn:
    """A reward function from the request's `reward_scorer` block (400s name the bad field)."""
    try:
        spec = parse_scorer(config.get("scorer"))
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid scorer"}
        where = ".".join(str(p) for p in first.get("loc", ()))
        param = "reward_scorer.scorer" + (f".{where}" if where else "")
        raise invalid(f"{param}: {first.get('msg')}", param=param,
                      hint="Use any eval scorer object, e.g. {\"kind\": \"exact_match\"}.") from None
    if requires_judge(spec):
        raise invalid("reward_scorer: llm_judge scorers need a judge model pass, which training does not run",
                      param="reward_scorer.scorer", hint="Use a deterministic scorer (exact_match, contains, ...).")
    default_target = config.get("target")
    if default_target is not None and not isinstance(default_target, str):
        raise invalid("reward_scorer.target must be a string", param="reward_scorer.target")

    def reward(row: dict[str, Any], index: int, label: str) -> float:
        target = row.get("target", default_target)
        aliases = row.get("aliases") or []
        if target is not None and not isinstance(target, str):
            raise row_invalid(label.rsplit(".", 1)[0], "the group's target must be a string", field="target")
        example = ExampleView(id=label, messages=list(row["messages"]), target=target,
                              aliases=[a for a in aliases if isinstance(a, str)])
        result = score_completion(spec, row["completions"][index]["text"], example).result
        if result.outcome == "error":
            raise row_invalid(label, f"the reward scorer could not score this completion: {result.detail}",
                              hint="Give the group a `target` (or reward_scorer.target).")
        return float(result.score)

    return reward
