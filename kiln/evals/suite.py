"""Eval suites (semantics.md §8.1): models, parsing with errors naming the example and field, resolution.

`parse_suite(data)` is the one way in: it validates the JSON types, then every semantic rule of the
contract, raising a 400 KilnError `eval_invalid_request` ("Invalid eval request: example <id>: <field>
...") or `invalid_suite_name`. `resolve_examples(suite)` gives what a run needs per example: its
resolved id, prompt messages, effective scorer, generation object and tools.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kiln.errors import KilnError
from kiln.evals.example_id import resolve_example_id
from kiln.evals.generation import MAX_N, EffectiveGeneration, GenerationParams, effective_generation
from kiln.evals.scorers import ScorerSpec, scorer_to_json
from kiln.store.hashing import sha256_json
from kiln.store.names import validate_name

CODE = "eval_invalid_request"
PREFIX = "Invalid eval request: "
CURRENT_SCHEMA_VERSION = 2


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


class ChatMessage(_Model):
    role: str
    content: str | None | list[Any] = None
    tool_calls: list[Any] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)


class _Aggregation(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class SingleAggregation(_Aggregation):
    kind: Literal["single"] = "single"

    @property
    def k(self) -> int:
        return 1

    label: ClassVar[str] = "single"


class MeanAtK(_Aggregation):
    kind: Literal["mean_at_k"] = "mean_at_k"
    k: int = Field(ge=1, le=MAX_N)
    label: ClassVar[str] = "mean@k"


class PassAtK(_Aggregation):
    kind: Literal["pass_at_k"] = "pass_at_k"
    k: int = Field(ge=1, le=MAX_N)
    label: ClassVar[str] = "pass@k"


class MajorityAtK(_Aggregation):
    kind: Literal["majority_at_k"] = "majority_at_k"
    k: int = Field(ge=1, le=MAX_N)
    label: ClassVar[str] = "majority@k"


Aggregation = Annotated[SingleAggregation | MeanAtK | PassAtK | MajorityAtK, Field(discriminator="kind")]


def aggregation_to_json(agg: Any) -> dict[str, Any]:
    return {"kind": "single"} if agg.kind == "single" else {"kind": agg.kind, "k": agg.k}


class EvalExample(_Model):
    id: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    target: str | None = None
    aliases: list[str] = []
    tags: list[str] = []
    metadata: Any = None
    scorer: ScorerSpec | None = None
    generation: GenerationParams | None = None
    weight: float = Field(default=1.0, ge=0)
    tools: list[Any] | None = None


class EvalSuite(_Model):
    name: str
    description: str | None = None
    default_scorer: ScorerSpec
    generation: GenerationParams = GenerationParams()
    aggregation: Aggregation = SingleAggregation()
    system_prompt: str | None = None
    examples: list[EvalExample] = []
    schema_version: Literal[1, 2] = 1
    tools: list[Any] | None = None

    @field_validator("schema_version", mode="before")
    @classmethod
    def _not_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):  # Literal[1, 2] would take True as 1
            raise ValueError("must be the integer 1 or 2")
        return v

    @property
    def k(self) -> int:
        return self.aggregation.k

    def to_json(self) -> dict[str, Any]:
        """The suite as submitted (unknown fields dropped), the form that is stored and hashed."""
        out = self.model_dump(mode="json", exclude_unset=True)
        out["default_scorer"] = scorer_to_json(self.default_scorer)
        for ex_json, ex in zip(out.get("examples", []), self.examples, strict=True):
            if ex.scorer is not None:
                ex_json["scorer"] = scorer_to_json(ex.scorer)
        return out


@dataclass(frozen=True)
class ResolvedExample:
    """One example as a run sees it; satisfies the scorers' `Example` protocol."""

    id: str
    index: int
    messages: list[dict[str, Any]]  # prompt, with the suite system prompt prepended when it applies
    target: str | None
    aliases: list[str]
    tags: list[str]
    metadata: Any
    scorer: ScorerSpec
    generation: EffectiveGeneration
    weight: float
    tools: list[Any]  # effective catalogue; [] = none


def invalid_request(message: str, *, param: str | None, hint: str | None = None) -> KilnError:
    return KilnError(400, CODE, PREFIX + message, param=param,
                     hint=hint or "Fix the suite as the message says; see EvalSuite in the evals contract.")


def _loc_text(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out


def _from_validation(exc: ValidationError, *, example_label: str | None, param_prefix: str) -> KilnError:
    errors = exc.errors()
    first = errors[0]
    field = _loc_text(tuple(first.get("loc", ())))
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    where = f"example {example_label}: " if example_label is not None else ""
    param = param_prefix + ("." if param_prefix and field else "") + field if field else (param_prefix or None)
    return invalid_request(f"{where}{field or 'value'}: {first.get('msg', 'invalid value')}{more}", param=param)


def _explicit_label(raw: Any, index: int) -> str:
    explicit = raw.get("id") if isinstance(raw, dict) else None
    return explicit if isinstance(explicit, str) and explicit.strip() else f"#{index}"


def parse_example(raw: Any, index: int) -> EvalExample:
    try:
        return EvalExample.model_validate(raw)
    except ValidationError as e:
        raise _from_validation(e, example_label=_explicit_label(raw, index), param_prefix=f"examples[{index}]") from None


def parse_suite(data: Any) -> EvalSuite:
    if not isinstance(data, dict):
        raise invalid_request("suite must be a JSON object", param=None)
    raw_examples = data.get("examples", [])
    if not isinstance(raw_examples, list):
        raise invalid_request("examples: must be an array of examples", param="examples")
    examples = [parse_example(raw, i) for i, raw in enumerate(raw_examples)]
    try:
        suite = EvalSuite.model_validate({**data, "examples": examples})
    except ValidationError as e:
        raise _from_validation(e, example_label=None, param_prefix="") from None
    validate_suite(suite)
    return suite


def tool_name(tool: Any) -> str | None:
    """A tool entry's name: `function.name` (OpenAI shape) or a top-level `name`."""
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
        return fn["name"]
    name = tool.get("name")
    return name if isinstance(name, str) and name else None


def _check_tools(tools: list[Any] | None, *, where: str, param: str) -> None:
    for i, tool in enumerate(tools or []):
        if tool_name(tool) is None:
            raise invalid_request(
                f"{where}tools[{i}]: each tool must be an object with a non-empty function.name or name",
                param=f"{param}[{i}]",
            )


def validate_suite(suite: EvalSuite) -> None:
    """Every semantic rule of §8.1 that JSON types cannot express."""
    validate_name(suite.name, kind="suite", param="name", code="invalid_suite_name")
    if not suite.examples:
        raise invalid_request("examples: a suite needs at least one example", param="examples")
    agg, k = suite.aggregation, suite.k
    if agg.kind == "majority_at_k" and k % 2 == 0:
        raise invalid_request(f"aggregation.k: majority_at_k needs an odd k, got {k}", param="aggregation.k")
    if suite.schema_version == 1 and agg.kind != "single":
        raise invalid_request(
            f"aggregation: schema_version 1 allows only single aggregation, got {agg.kind}",
            param="aggregation", hint="Set schema_version to 2 to use k-completion aggregations.",
        )
    _check_tools(suite.tools, where="", param="tools")
    seen: dict[str, int] = {}
    for i, ex in enumerate(suite.examples):
        # "" means "derive one" (the contract allows empty text); whitespace is a mistake.
        if ex.id and not ex.id.strip():
            raise invalid_request(f"example #{i}: id: must not be blank (omit it to derive one)", param=f"examples[{i}].id")
        label = ex_id = example_id(ex)
        if ex_id in seen:
            raise invalid_request(
                f"example {ex_id}: id: duplicates example #{seen[ex_id]} (resolved ids must be unique)",
                param=f"examples[{i}].id",
            )
        seen[ex_id] = i
        _check_tools(ex.tools, where=f"example {label}: ", param=f"examples[{i}].tools")
        own = ex.generation is not None
        n = (ex.generation or suite.generation).n
        source, param = ("", f"examples[{i}].generation.n") if own else (" (from the suite)", "generation.n")
        if suite.schema_version == 1 and n != 1:
            raise invalid_request(
                f"example {label}: generation.n{source} is {n}, but schema_version 1 requires n = 1",
                param=param, hint="Set schema_version to 2 to sample several completions per example.",
            )
        if n != k:
            raise invalid_request(
                f"example {label}: generation.n{source} is {n}, but it must equal aggregation k = {k}",
                param=param, hint="Set generation.n to the aggregation's k (single means k = 1).",
            )


def example_id(ex: EvalExample) -> str:
    return resolve_example_id(ex.id, (m.to_dict() for m in ex.messages), ex.target, ex.aliases)


def prompt_messages(suite: EvalSuite, ex: EvalExample) -> list[dict[str, Any]]:
    messages = [m.to_dict() for m in ex.messages]
    if suite.system_prompt is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": suite.system_prompt})
    return messages


def resolve_examples(suite: EvalSuite, run_generation: GenerationParams | None = None) -> list[ResolvedExample]:
    out = []
    for i, ex in enumerate(suite.examples):
        # An example's own list wins even when empty (that is how an example opts out of suite tools).
        tools = ex.tools if ex.tools is not None else (suite.tools or [])
        out.append(ResolvedExample(
            id=example_id(ex),
            index=i,
            messages=prompt_messages(suite, ex),
            target=ex.target,
            aliases=list(ex.aliases),
            tags=list(ex.tags),
            metadata=ex.metadata,
            scorer=ex.scorer or suite.default_scorer,
            generation=effective_generation(ex.generation, suite.generation, run_generation),
            weight=ex.weight,
            tools=list(tools),
        ))
    return out


def suite_summary(suite: EvalSuite) -> dict[str, Any]:
    tags = Counter(tag for ex in suite.examples for tag in dict.fromkeys(ex.tags))
    return {
        "name": suite.name,
        "description": suite.description,
        "num_examples": len(suite.examples),
        "completions_per_example": suite.k,
        "aggregation": aggregation_to_json(suite.aggregation),
        "schema_version": suite.schema_version,
        "default_scorer_kind": suite.default_scorer.kind,
        "tags": dict(sorted(tags.items())),
    }


def suite_hash(suite: EvalSuite) -> str:
    return "sha256:" + sha256_json(suite.to_json())
