"""PEFT's on-disk LoRA format: adapter_config.json fields and safetensors key names (semantics.md §7.1).

Only what the serving path can apply is accepted: plain LoRA on per-layer linear projections. Anything
PEFT can save that we would silently mis-apply (full-module copies, DoRA, biases, transposed weights)
is a clear 400 instead.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import Tensor

from kiln.errors import KilnError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MANIFEST_FILE = "adapter_manifest.json"
RECEIPT_FILE = "train_receipt.json"

PEFT_PREFIX = "base_model.model."
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Where each projection lives in an HF decoder layer; used to build keys for adapters we write.
MODULE_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}

LAYOUT_INVALID = "adapter_layout_invalid"

ModuleKey = tuple[int, str]  # (layer index, projection name)


class LoraModule(NamedTuple):
    """One adapted projection: delta(x) = scale * (x @ a.T) @ b.T."""

    a: Tensor  # [r, in_features]
    b: Tensor  # [out_features, r]
    scale: float


def layout_error(message: str, *, code: str = LAYOUT_INVALID, param: str | None = None,
                 hint: str | None = None) -> KilnError:
    return KilnError(
        400, code, message, param=param,
        hint=hint or "Save the adapter with PEFT (plain LoRA on q/k/v/o/gate/up/down projections) and retry.",
    )


def _pattern_key(patterns: dict[str, Any], module_path: str) -> str | None:
    # PEFT's rule (peft.utils.other.get_pattern_key): the first pattern that matches a dotted suffix.
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_path):
            return key
    return None


@dataclass(frozen=True)
class LoraConfig:
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str | None
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None
    declares_r: bool = True
    raw: dict[str, Any] = field(default_factory=dict)

    def rank_for(self, module_path: str) -> int:
        key = _pattern_key(self.rank_pattern, module_path)
        return int(self.rank_pattern[key]) if key is not None else self.r

    def alpha_for(self, module_path: str) -> float:
        key = _pattern_key(self.alpha_pattern, module_path)
        return float(self.alpha_pattern[key]) if key is not None else float(self.lora_alpha)

    def scale_for(self, module_path: str, rank: int) -> float:
        alpha = self.alpha_for(module_path)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def target_set(self) -> frozenset[str] | str | None:
        return frozenset(self.target_modules) if isinstance(self.target_modules, tuple) else self.target_modules


def config_dict(r: int, lora_alpha: float, target_modules: list[str] | tuple[str, ...] = DEFAULT_TARGET_MODULES,
                *, use_rslora: bool = False, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """The adapter_config.json Kiln's trainer writes (semantics.md §7.1); PEFT loads it as is."""
    out: dict[str, Any] = {
        "r": int(r),
        "lora_alpha": lora_alpha,
        "target_modules": list(target_modules),
        "task_type": "CAUSAL_LM",
        "bias": "none",
        "peft_type": "LORA",
    }
    if use_rslora:
        out["use_rslora"] = True
    if base_model_name_or_path:
        out["base_model_name_or_path"] = base_model_name_or_path
    return out


def _is_set(value: Any) -> bool:
    return value not in (None, False, [], {}, "", 0)


def parse_lora_config(data: Any, *, code: str = LAYOUT_INVALID) -> LoraConfig:
    """Validate a decoded adapter_config.json; raise a 400 naming the field we cannot serve."""
    param = CONFIG_FILE
    if not isinstance(data, dict):
        raise layout_error(f"{CONFIG_FILE} must be a JSON object", code=code, param=param)
    peft_type = data.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise layout_error(f"unsupported peft_type {peft_type!r}: only LORA adapters can be served",
                           code=code, param=f"{param}.peft_type")
    for key, why in (
        ("modules_to_save", "full copies of modules cannot be applied as a low-rank delta"),
        ("trainable_token_indices", "trainable token embeddings are not supported"),
        ("use_dora", "DoRA magnitude vectors are not supported"),
        ("fan_in_fan_out", "transposed (Conv1D-style) LoRA weights are not supported"),
        ("lora_bias", "LoRA bias terms are not supported"),
        ("target_parameters", "LoRA on raw parameters is not supported"),
        ("layer_replication", "layer replication is not supported"),
    ):
        if _is_set(data.get(key)):
            raise layout_error(f"{key} is set: {why}", code=code, param=f"{param}.{key}",
                               hint=f"Re-train or re-save the adapter without {key}.")
    bias = data.get("bias", "none")
    if bias not in (None, "none"):
        raise layout_error(f"bias {bias!r} is not supported (only 'none')", code=code, param=f"{param}.bias")
    declares_r = "r" in data
    r = data.get("r", 8)  # PEFT's default when a config omits it
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise layout_error(f"r must be a positive integer, got {r!r}", code=code, param=f"{param}.r")
    alpha = data.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise layout_error(f"lora_alpha must be a finite number, got {alpha!r}", code=code,
                           param=f"{param}.lora_alpha")
    targets = data.get("target_modules")
    if isinstance(targets, list):
        if not all(isinstance(t, str) and t for t in targets):
            raise layout_error("target_modules must be a list of module names", code=code,
                               param=f"{param}.target_modules")
        targets = tuple(targets)
    elif targets is not None and not isinstance(targets, str):
        raise layout_error("target_modules must be a list of names or a regex string", code=code,
                           param=f"{param}.target_modules")
    patterns: dict[str, dict] = {}
    for key in ("rank_pattern", "alpha_pattern"):
        value = data.get(key) or {}
        if not isinstance(value, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in value.values()
        ):
            raise layout_error(f"{key} must map module patterns to positive numbers", code=code,
                               param=f"{param}.{key}")
        patterns[key] = value
    base = data.get("base_model_name_or_path")
    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=bool(data.get("use_rslora", False)),
        rank_pattern={k: int(v) for k, v in patterns["rank_pattern"].items()},
        alpha_pattern={k: float(v) for k, v in patterns["alpha_pattern"].items()},
        base_model_name_or_path=base if isinstance(base, str) and base else None,
        declares_r=declares_r,
        raw=dict(data),
    )


@dataclass(frozen=True)
class ParsedKey:
    layer: int
    module: str
    factor: str  # "A" | "B"
    module_path: str  # e.g. model.layers.3.self_attn.q_proj (what PEFT's rank/alpha patterns match)


def parse_key(key: str) -> ParsedKey | None:
    """Place a PEFT tensor key, or None when it is not a per-layer lora_A/lora_B weight."""
    parts = key.split(".")
    if len(parts) < 4 or parts[-1] != "weight":
        return None
    factor_at = next((i for i, p in enumerate(parts) if p in ("lora_A", "lora_B")), None)
    # After lora_A/lora_B PEFT may keep the adapter name (lora_A.default.weight) before "weight".
    if factor_at is None or factor_at < 1 or len(parts) - factor_at not in (2, 3):
        return None
    layer_at = max((i for i in range(factor_at - 1) if parts[i] == "layers" and parts[i + 1].isdigit()),
                   default=None)
    if layer_at is None:
        return None
    path = ".".join(parts[:factor_at])
    if path.startswith(PEFT_PREFIX):
        path = path[len(PEFT_PREFIX):]
    return ParsedKey(int(parts[layer_at + 1]), parts[factor_at - 1], parts[factor_at][-1], path)


def peft_key(layer: int, module: str, factor: str) -> str:
    parent = MODULE_PARENT.get(module)
    if parent is None:
        raise layout_error(f"unknown module {module!r}; expected one of {', '.join(MODULE_PARENT)}")
    return f"{PEFT_PREFIX}model.layers.{layer}.{parent}.{module}.lora_{factor}.weight"


def group_modules(tensors: dict[str, Tensor], config: LoraConfig, *, code: str = LAYOUT_INVALID
                  ) -> dict[ModuleKey, LoraModule]:
    """Pair lora_A/lora_B per (layer, module) and attach PEFT's scale; every key must be placed."""
    pairs: dict[ModuleKey, dict[str, Tensor]] = {}
    paths: dict[ModuleKey, str] = {}
    for key, tensor in tensors.items():
        parsed = parse_key(key)
        if parsed is None:
            raise layout_error(f"tensor {key!r} is not a per-layer lora_A/lora_B weight", code=code,
                               param=WEIGHTS_FILE)
        mk = (parsed.layer, parsed.module)
        if parsed.factor in pairs.setdefault(mk, {}):
            raise layout_error(f"duplicate lora_{parsed.factor} for layer {mk[0]} {mk[1]}", code=code,
                               param=WEIGHTS_FILE)
        if tensor.dim() != 2:
            raise layout_error(f"tensor {key!r} must be 2-D, has shape {list(tensor.shape)}", code=code,
                               param=WEIGHTS_FILE)
        pairs[mk][parsed.factor] = tensor
        paths[mk] = parsed.module_path
    if not pairs:
        raise layout_error(f"{WEIGHTS_FILE} holds no LoRA tensors", code=code, param=WEIGHTS_FILE)
    out: dict[ModuleKey, LoraModule] = {}
    for mk in sorted(pairs):
        pair = pairs[mk]
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise layout_error(f"layer {mk[0]} {mk[1]} has no {missing}", code=code, param=WEIGHTS_FILE)
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise layout_error(
                f"layer {mk[0]} {mk[1]}: lora_A has rank {rank} but lora_B has {b.shape[1]} columns",
                code=code, param=WEIGHTS_FILE)
        expected = config.rank_for(paths[mk])
        if rank != expected:
            raise layout_error(f"layer {mk[0]} {mk[1]}: tensors have rank {rank}, config says r={expected}",
                               code=code, param=f"{CONFIG_FILE}.r")
        out[mk] = LoraModule(a, b, config.scale_for(paths[mk], rank))
    return out
