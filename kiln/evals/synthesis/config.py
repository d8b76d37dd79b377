"""Synthesis request bodies (semantics.md §10.1): config, sampling, scorer policy, preview/synthesize extras.

`parse_preview_body` / `parse_synthesize_body` are the one way in; a bad field is a 400
`eval_invalid_request` whose `param` is the body path (e.g. `sampling.max_examples`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kiln.errors import KilnError
from kiln.evals.generation import GenerationParams, u64_from_string
from kiln.evals.scorers import ScorerSpec
from kiln.evals.suite import Aggregation, SingleAggregation, tool_name
from kiln.store.names import validate_name

CODE = "eval_invalid_request"
PREFIX = "Invalid eval request: "
U64_MAX = (1 << 64) - 1

Strategy = Literal[
    "final_assistant", "first_assistant_turn", "every_assistant_turn", "tool_call_predict",
    "tool_response_followup", "end_of_trajectory_answer",
]
SourceSplit = Literal["train", "validation", "holdout"]

DEFAULT_MAX_EXAMPLES = 100
DEFAULT_MAX_PROMPT_CHARS = 32768
DEFAULT_MAX_TARGET_CHARS = 4096
DEFAULT_HEAD_N = 5


class _Wire(BaseModel):
    # Unknown fields are accepted and ignored (the contract says so for every synthesis shape).
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


class Sampling(_Wire):
    # None = unlimited. 0 is refused: it could only ever end in "synthesis produced no examples".
    max_examples: int | None = Field(default=None, ge=1)
    max_prompt_chars: int = Field(default=DEFAULT_MAX_PROMPT_CHARS, ge=0)
    max_target_chars: int = Field(default=DEFAULT_MAX_TARGET_CHARS, ge=0)
    seed: int | None = Field(default=None, ge=0, le=U64_MAX)
    dedupe: bool = True

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_from_string(cls, v: Any) -> Any:
        return u64_from_string(v)


# The contract's serde quirk: no `sampling` object at all caps the suite at 100 examples, while an
# object that leaves out max_examples means unlimited.
DEFAULT_SAMPLING = Sampling(max_examples=DEFAULT_MAX_EXAMPLES)


class AutoDetectScorer(_Wire):
    kind: Literal["auto_detect"] = "auto_detect"


class FixedScorer(_Wire):
    kind: Literal["fixed"] = "fixed"
    scorer: ScorerSpec


class JudgeScorer(_Wire):
    kind: Literal["judge"] = "judge"
    judge_adapter: str | None = None


ScorerChoice = Annotated[AutoDetectScorer | FixedScorer | JudgeScorer, Field(discriminator="kind")]


class SynthesisConfig(_Wire):
    suite_name: str
    description: str | None = None
    strategy: Strategy = "final_assistant"
    scorer: ScorerChoice = AutoDetectScorer()
    generation: GenerationParams | None = None
    aggregation: Aggregation = SingleAggregation()
    sampling: Sampling = DEFAULT_SAMPLING
    system_prompt: str | None = None
    strip_system_prompt: bool = False
    suite_tools: list[Any] | None = None


class PreviewBody(SynthesisConfig):
    head_n: int = Field(default=DEFAULT_HEAD_N, ge=0)
    source_split: SourceSplit = "holdout"


class SynthesizeBody(SynthesisConfig):
    force: bool = False
    run_against: list[str] | None = None
    source_split: SourceSplit = "holdout"


def _param_path(data: Any, loc: tuple[Any, ...]) -> str:
    """The body path of an error location, without the union tags pydantic inserts.

    A tagged union reports `scorer.fixed.scorer.exact_match.case_sensitive`; a client wrote
    `scorer.scorer.case_sensitive`. A part is a tag when the object at that point has it as `kind`.
    """
    out, node = "", data
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str) and part not in node and node.get("kind") == part:
            continue
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
        if isinstance(node, dict) and isinstance(part, str):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            node = None
    return out


def invalid_config(message: str, *, param: str | None, hint: str | None = None) -> KilnError:
    return KilnError(400, CODE, PREFIX + message, param=param,
                     hint=hint or "Fix the synthesis body as the message says; see SynthesizeBody in the evals contract.")


def _parse(model: type[_Wire], data: Any) -> Any:
    if not isinstance(data, dict):
        raise invalid_config("the body must be a JSON object", param=None)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        param = _param_path(data, tuple(first.get("loc", ()))) or None
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        raise invalid_config(f"{param or 'body'}: {first.get('msg', 'invalid value')}{more}", param=param) from None
    validate_name(body.suite_name, kind="suite", param="suite_name", code="invalid_suite_name")
    for i, tool in enumerate(body.suite_tools or []):
        if tool_name(tool) is None:
            raise invalid_config(f"suite_tools[{i}]: each tool must be an object with a non-empty function.name or name",
                                 param=f"suite_tools[{i}]")
    return body


def parse_preview_body(data: Any) -> PreviewBody:
    return _parse(PreviewBody, data)


def parse_synthesize_body(data: Any) -> SynthesizeBody:
    return _parse(SynthesizeBody, data)
