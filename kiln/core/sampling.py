"""Sampling parameters, the named presets, and how a request's fields resolve into one set.

Resolution (semantics.md §0 "Sampling defaults" and §4.2), lowest to highest priority:
1. the base: a named preset; else for Qwen3-family models Kiln's rule (tools -> qwen3-thinking-coding,
   else qwen3-thinking-general); else the model's generation_config over OpenAI's neutral defaults;
2. eval mode: fields the request left unset take the deterministic eval defaults;
3. every field the request set explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from kiln.errors import KilnError

DEFAULT_MAX_TOKENS = 2048
U64_MAX = 2**64 - 1


GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # EOS ids etc.; not used when ignore_eos
    ignore_eos: bool = False
    seed: int | None = None  # u64; the engine fills a random one when None

    @property
    def is_greedy(self) -> bool:
        """semantics.md §4.3 "effectively greedy"; a temperature too small to divide by (below 1e-5, as
        vLLM's _SAMPLING_EPS) is greedy too: logits / 1e-163 overflow float32 and sampling would fail."""
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            return True
        return self.top_k == 1 and math.isfinite(self.temperature) and self.temperature > 0


# semantics.md §4.1; every preset also has min_p 0, repetition 1.0, frequency 0 (SamplingParams defaults).
PRESETS: dict[str, dict[str, float | int]] = {
    "greedy": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "presence_penalty": 0.0},
    "qwen3-thinking-general": {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "presence_penalty": 1.5},
    "qwen3-thinking-coding": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "presence_penalty": 0.0},
    "qwen3-non-thinking-general": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "presence_penalty": 1.5},
    "qwen3-non-thinking-reasoning": {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "presence_penalty": 1.5},
}
FALLBACK_PRESET = "qwen3-thinking-general"
TOOLS_PRESET = "qwen3-thinking-coding"

# Eval mode (server.eval_mode): what unset fields become, so eval runs are deterministic.
EVAL_DEFAULTS: dict[str, float | int] = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "seed": 0,
}

# The generation_config.json fields a non-Qwen3 model may contribute (§0); others there are not sampling.
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

_INT_FIELDS = {"top_k", "max_tokens"}
_FLOAT_FIELDS = {
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
}
_FIELD_NAMES = {f.name for f in fields(SamplingParams)}


def normalize_preset_name(name: str) -> str | None:
    """The canonical preset for a requested name; None when the name is blank (= no preset).

    Trimmed and lowercased; "qwen3.5-..." is an alias of "qwen3-..."; an unknown name maps to
    qwen3-thinking-general rather than failing (the contract documents that compatibility rule).
    """
    key = name.strip().lower()
    if not key:
        return None
    if key.startswith("qwen3.5-"):
        key = "qwen3-" + key[len("qwen3.5-") :]
    return key if key in PRESETS else FALLBACK_PRESET


def resolve_sampling(
    explicit: dict[str, Any],
    *,
    preset: str | None,
    qwen3_family: bool,
    has_tools: bool,
    model_defaults: dict[str, Any],
    eval_mode: bool = False,
) -> SamplingParams:
    """Resolve one request's sampling parameters.

    `explicit` holds the fields the request set; None values count as unset, and keys that are not
    SamplingParams fields are ignored, except `max_completion_tokens`, the alias max_tokens beats.
    Values are not range-checked here; call `validate_sampling` where the endpoint wants that.
    """
    values: dict[str, Any] = {}
    preset_key = normalize_preset_name(preset) if preset is not None else None
    if preset_key is not None:
        values.update(PRESETS[preset_key])
    elif qwen3_family:
        values.update(PRESETS[TOOLS_PRESET if has_tools else FALLBACK_PRESET])
    else:
        values.update(_usable_model_defaults(model_defaults))

    given = {k: v for k, v in explicit.items() if v is not None}
    if "max_tokens" not in given and "max_completion_tokens" in given:
        given["max_tokens"] = given["max_completion_tokens"]
    given = {k: v for k, v in given.items() if k in _FIELD_NAMES}

    if eval_mode:
        values.update({k: v for k, v in EVAL_DEFAULTS.items() if k not in given})
    values.update(given)
    return SamplingParams(**_coerce(values))


def _usable_model_defaults(model_defaults: dict[str, Any]) -> dict[str, Any]:
    # A generation_config value that cannot be sampled with is skipped, not turned into a client 400:
    # the client did not send it.
    usable: dict[str, Any] = {}
    for name in MODEL_DEFAULT_FIELDS:
        value = model_defaults.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        candidate = SamplingParams(**_coerce({name: value}))
        if _first_problem(candidate) is None:
            usable[name] = value
    return usable


def _coerce(values: dict[str, Any]) -> dict[str, Any]:
    out = dict(values)
    for name in _FLOAT_FIELDS & out.keys():
        if isinstance(out[name], int) and not isinstance(out[name], bool):
            out[name] = float(out[name])
    for name in _INT_FIELDS & out.keys():
        if isinstance(out[name], float) and out[name].is_integer():
            out[name] = int(out[name])
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    for name in ("stop", "stop_token_ids"):
        if name in out:
            out[name] = list(out[name])
    return out


def validate_sampling(params: SamplingParams, *, code: str = "chat_invalid_request") -> None:
    """Raise a 400 KilnError naming the first field that cannot be sampled with."""
    problem = _first_problem(params)
    if problem is not None:
        param, message, hint = problem
        raise KilnError(400, code, message, param=param, hint=hint)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _first_problem(p: SamplingParams) -> tuple[str, str, str] | None:
    def in_range(name: str, lo: float, hi: float) -> tuple[str, str, str] | None:
        value = getattr(p, name)
        if _is_number(value) and lo <= value <= hi:
            return None
        return (
            name,
            f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}",
            f"Send {name} between {lo:g} and {hi:g}.",
        )

    if not _is_number(p.temperature) or p.temperature < 0:
        return (
            "temperature",
            f"temperature must be a finite number >= 0, got {p.temperature!r}",
            "Use 0 for greedy decoding or a positive temperature such as 0.7.",
        )
    for name in ("top_p", "min_p"):
        problem = in_range(name, 0.0, 1.0)
        if problem:
            return problem
    def whole(name: str, hint: str) -> tuple[str, str, str] | None:
        value = getattr(p, name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return None
        return name, f"{name} must be an integer >= 0, got {value!r}", hint

    problem = whole("top_k", "Use 0 to turn top-k filtering off.")
    if problem:
        return problem
    if not _is_number(p.repetition_penalty) or p.repetition_penalty <= 0:
        return (
            "repetition_penalty",
            f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty!r}",
            "Use 1.0 for no repetition penalty.",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        problem = in_range(name, -2.0, 2.0)
        if problem:
            return problem
    problem = whole("max_tokens", "Send a non-negative max_tokens, or leave it out for the default.")
    if problem:
        return problem
    if p.seed is not None and (
        not isinstance(p.seed, int) or isinstance(p.seed, bool) or not 0 <= p.seed <= U64_MAX
    ):
        return (
            "seed",
            f"seed must be an integer in [0, 2^64-1], got {p.seed!r}",
            "Send a non-negative 64-bit seed, or leave it out for a random one.",
        )
    return None
