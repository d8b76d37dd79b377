"""Tool-call argument content policies: keys_only, structural, per_key, auto (semantics.md §8.4)."""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from kiln.evals.scorers.base import ExampleView, ScoreContext, ScorerError, SpecModel
from kiln.evals.scorers.json_validity import json_equal
from kiln.evals.shell_similarity import command_similarity
from kiln.evals.text_similarity import code_tokens, jaccard, phrase_similarity

if TYPE_CHECKING:
    from kiln.evals.scorers.base import Example
    from kiln.evals.scorers.registry import ScorerSpec

COMMAND_KEYS = frozenset({"command", "cmd", "script", "shell", "bash", "code"})
_FENCE_RE = re.compile(r"```")


class KeysOnlyArgs(SpecModel):
    kind: Literal["keys_only"] = "keys_only"


class StructuralArgs(SpecModel):
    kind: Literal["structural"] = "structural"


class AutoArgs(SpecModel):
    kind: Literal["auto"] = "auto"


class PerKeyArgs(SpecModel):
    kind: Literal["per_key"] = "per_key"
    scorers: dict[str, ScorerSpec]
    extra_key_penalty: float = 0.0


ArgsScoring = Annotated[KeysOnlyArgs | StructuralArgs | AutoArgs | PerKeyArgs, Field(discriminator="kind")]


def stringify(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)


def structure_score(target: dict[str, Any], predicted: dict[str, Any]) -> float:
    if not target:
        return 1.0 if not predicted else 0.0
    return len(target.keys() & predicted.keys()) / len(target)


def content_score(policy: Any, target: dict[str, Any], predicted: dict[str, Any], example: Example,
                  ctx: ScoreContext | None) -> float:
    if not target or isinstance(policy, KeysOnlyArgs):
        return 1.0
    if isinstance(policy, StructuralArgs):
        return 1.0 if json_equal(target, predicted) else 0.0
    if isinstance(policy, PerKeyArgs):
        return _per_key(policy, target, predicted, example, ctx)
    return sum(auto_value_score(k, v, predicted.get(k, _MISSING), k in predicted) for k, v in target.items()) / len(target)


_MISSING = object()


def _per_key(policy: PerKeyArgs, target: dict[str, Any], predicted: dict[str, Any], example: Example,
             ctx: ScoreContext | None) -> float:
    from kiln.evals.scorers.registry import run_scorer  # the registry imports this module

    scores = []
    for key, spec in policy.scorers.items():
        if key not in predicted:
            scores.append(0.0)
            continue
        view = ExampleView(example.id, example.messages, stringify(target[key]) if key in target else None)
        try:
            scores.append(run_scorer(spec, stringify(predicted[key]), view, ctx).score)
        except ScorerError:
            scores.append(0.0)
    mean = sum(scores) / len(scores) if scores else 1.0
    extra = sum(1 for k in predicted if k not in policy.scorers and k not in target)
    return min(1.0, max(0.0, mean - policy.extra_key_penalty * extra))


def auto_value_score(key: str, target: Any, predicted: Any, present: bool) -> float:
    if not present:
        return 0.0
    if json_equal(target, predicted):
        return 1.0
    if _is_number(target) and _is_number(predicted):
        return 1.0 if abs(target - predicted) <= abs(target) * 1e-3 + 1e-6 else 0.0
    if isinstance(target, str) and isinstance(predicted, str):
        if key.lower() in COMMAND_KEYS:
            return command_similarity(target, predicted)
        return string_similarity(target, predicted)
    # A typed value against its text form ("5" vs 5) is the same argument.
    return 1.0 if stringify(target) == stringify(predicted) else 0.0


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def string_similarity(target: str, predicted: str) -> float:
    if _FENCE_RE.search(target) and _FENCE_RE.search(predicted):
        return jaccard(code_tokens(target), code_tokens(predicted))
    return phrase_similarity(target, predicted, limit=5)
