"""Merging saved adapters into a new one (semantics.md §7.4): weighted_average, ties, concat.

All arithmetic is float32 on CPU; the output is a new adapter written atomically (a failure leaves no
partial output). The config is copied from the first source.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kiln.adapters.peft_format import group_modules
from kiln.adapters.store import AdapterStore
from kiln.errors import KilnError
from kiln.store.names import name_problem

MODES = ("weighted_average", "ties", "concat")
DEFAULT_DENSITY = 0.2
INVALID = "adapter_merge_invalid"


@dataclass(frozen=True)
class MergeSource:
    name: str
    weight: float = 1.0


def _invalid(message: str, param: str | None = None, hint: str | None = None) -> KilnError:
    return KilnError(400, INVALID, f"Invalid adapter merge: {message}", param=param,
                     hint=hint or "Merge adapters trained with the same rank and target modules, "
                                  "or use mode 'concat' for different ranks.")


# -- the math ---------------------------------------------------------------------------------------

def weighted_average(tensor_sets: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """out[k] = sum_i w_i * t_i[k]; the weights are deliberately not normalized."""
    return {k: sum((w * ts[k].float() for ts, w in zip(tensor_sets, weights, strict=True)),
                   torch.zeros_like(tensor_sets[0][k], dtype=torch.float32))
            for k in tensor_sets[0]}


def _half_up(x: float) -> int:
    return math.floor(x + 0.5)


def trim_to_density(t: Tensor, density: float) -> Tensor:
    """Keep the values whose |v| is at least the keep_count-th largest |v| (ties at the cut all stay)."""
    n = t.numel()
    keep = _half_up(density * n)
    if keep <= 0:
        return torch.zeros_like(t)
    if keep >= n:
        return t
    threshold = torch.topk(t.abs().flatten(), keep).values[-1]
    return torch.where(t.abs() >= threshold, t, torch.zeros_like(t))


def ties_tensor(tensors: Sequence[Tensor], weights: Sequence[float], density: float) -> Tensor:
    stacked = torch.stack([trim_to_density(t.float(), density) for t in tensors])
    w = torch.tensor(list(weights), dtype=torch.float32).view(-1, *([1] * tensors[0].dim()))
    elected = torch.sign((w * stacked).sum(0))
    agree = (torch.sign(stacked) == elected) & (elected != 0)
    num = (w * stacked * agree).sum(0)
    den = (w * agree).sum(0)
    safe = torch.where(den == 0, torch.ones_like(den), den)
    return torch.where(den == 0, torch.zeros_like(num), num / safe)


def ties(tensor_sets: Sequence[Mapping[str, Tensor]], weights: Sequence[float], density: float) -> dict[str, Tensor]:
    """TIES (Yadav et al. 2023): trim per tensor and adapter, elect a sign, average the agreeing values."""
    return {k: ties_tensor([ts[k] for ts in tensor_sets], weights, density) for k in tensor_sets[0]}


def concat(tensor_sets: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """lora_A stacked along rank (unscaled), lora_B side by side scaled by w_i: B@A = sum_i w_i B_i A_i."""
    out: dict[str, Tensor] = {}
    for k in tensor_sets[0]:
        if k.endswith("lora_A.weight"):
            out[k] = torch.cat([ts[k].float() for ts in tensor_sets], dim=0)
        else:
            out[k] = torch.cat([w * ts[k].float() for ts, w in zip(tensor_sets, weights, strict=True)], dim=1)
    return out


def concat_alpha(alpha_first: float, r_first: int, r_total: int, *, rslora: bool = False) -> int | float:
    """alpha_first * r_total / r_first, so the output keeps the first source's alpha/r scale.

    With rslora the scale is alpha/sqrt(r), so the same intent needs sqrt(r_total / r_first).
    """
    ratio = math.sqrt(r_total / r_first) if rslora else r_total / r_first
    alpha = alpha_first * ratio
    if isinstance(alpha_first, int) and float(alpha).is_integer():
        return int(alpha)
    return alpha


# -- validation and the store operation ------------------------------------------------------------

def _check_output_name(raw: Any) -> str:
    if not isinstance(raw, str):
        raise KilnError(400, "adapter_merge_bad_name", "output_name must be a string", param="output_name")
    name = raw.strip()
    problem = name_problem(name)
    if problem is not None or name in (".", ".."):
        raise KilnError(400, "adapter_merge_bad_name", f"Invalid merge output_name {raw!r}: {problem}.",
                        param="output_name", hint="Use one path segment without separators, e.g. 'merged-v1'.")
    return name


def _check_same_layout(names: list[str], configs: list, tensor_sets: list[dict[str, Tensor]], mode: str) -> None:
    first, first_cfg, first_tensors = names[0], configs[0], tensor_sets[0]
    for i in range(1, len(names)):
        other, cfg, ts = names[i], configs[i], tensor_sets[i]
        where = f"sources[{i}]"
        if mode != "concat" and cfg.r != first_cfg.r:
            raise _invalid(f"{other!r} has r={cfg.r} but {first!r} has r={first_cfg.r}", where,
                           hint="Use mode 'concat' to merge adapters of different ranks.")
        if mode != "concat" and cfg.target_set() != first_cfg.target_set():
            raise _invalid(f"{other!r} and {first!r} target different modules", where)
        if (mode != "concat" and cfg.base_model_name_or_path and first_cfg.base_model_name_or_path
                and cfg.base_model_name_or_path != first_cfg.base_model_name_or_path):
            raise _invalid(f"{other!r} was trained on {cfg.base_model_name_or_path!r} but {first!r} on "
                           f"{first_cfg.base_model_name_or_path!r}", where)
        if set(ts) != set(first_tensors):
            missing = sorted(set(first_tensors) ^ set(ts))[:1]
            raise _invalid(f"{other!r} and {first!r} hold different tensors (e.g. {missing[0]!r})", where)
        for k, t in ts.items():
            ref = first_tensors[k]
            if mode == "concat":
                axis = 1 if k.endswith("lora_A.weight") else 0
                if t.shape[axis] != ref.shape[axis]:
                    raise _invalid(f"{k!r}: in/out features differ between {other!r} and {first!r}", where)
            elif t.shape != ref.shape:
                raise _invalid(f"{k!r} is {list(t.shape)} in {other!r} but {list(ref.shape)} in {first!r}", where)


def merge_adapters(store: AdapterStore, sources: Sequence[MergeSource | Mapping[str, Any] | tuple[str, float]],
                   output_name: Any, mode: str | None = None, density: float | None = None) -> dict[str, Any]:
    """Validate, merge and save; returns the wire response of POST /v1/adapters/merge."""
    mode = mode or "weighted_average"
    if mode not in MODES:
        raise _invalid(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}", "mode")
    if density is not None and mode != "ties":
        raise _invalid("density applies only to mode 'ties'", "density")
    if mode == "ties":
        density = DEFAULT_DENSITY if density is None else density
        if not (isinstance(density, int | float) and math.isfinite(density) and 0 < density <= 1):
            raise _invalid(f"density must be in (0, 1], got {density!r}", "density")
    srcs = [_as_source(s) for s in sources]
    if not srcs:
        raise _invalid("sources must name at least one adapter", "sources")
    for i, s in enumerate(srcs):
        store.path(s.name, param=f"sources[{i}].name")
        if not math.isfinite(s.weight):
            raise _invalid(f"weight of {s.name!r} must be a finite number", f"sources[{i}].weight")
    out_name = _check_output_name(output_name)
    if store.path(out_name, param="output_name").exists():
        raise KilnError(409, "adapter_merge_output_exists", f"Adapter {out_name!r} already exists.",
                        param="output_name", hint="Choose a new output_name or delete the existing adapter.")
    for i, s in enumerate(srcs):
        store.require(s.name, param=f"sources[{i}].name")

    configs, tensor_sets, hashes = [], [], []
    for i, s in enumerate(srcs):
        try:
            cfg = store.read_config(s.name)
            ts = store.read_peft_tensors(s.name)
            group_modules(ts, cfg)
            hashes.append(store.content_hash(s.name))
        except KilnError as e:
            if e.status != 400:
                raise
            raise _invalid(f"source {s.name!r}: {e.message}", f"sources[{i}].name") from None
        configs.append(cfg)
        tensor_sets.append(ts)
    names = [s.name for s in srcs]
    weights = [float(s.weight) for s in srcs]
    if mode == "concat":
        for i, (s, cfg) in enumerate(zip(srcs, configs, strict=True)):
            if not cfg.declares_r:
                raise _invalid(f"{s.name!r} does not declare r in its adapter_config.json", f"sources[{i}]")
            if cfg.rank_pattern or cfg.alpha_pattern:
                raise _invalid(f"{s.name!r} uses rank_pattern/alpha_pattern, which concat cannot carry",
                               f"sources[{i}]")
            if not all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in tensor_sets[i]):
                raise _invalid(f"{s.name!r} holds tensors other than lora_A/lora_B weights", f"sources[{i}]")
    _check_same_layout(names, configs, tensor_sets, mode)

    config = dict(configs[0].raw)
    if mode == "weighted_average":
        merged = weighted_average(tensor_sets, weights)
    elif mode == "ties":
        assert density is not None
        merged = ties(tensor_sets, weights, density)
    else:
        merged = concat(tensor_sets, weights)
        r_total = sum(c.r for c in configs)
        config["r"] = r_total
        config["lora_alpha"] = concat_alpha(configs[0].raw.get("lora_alpha", configs[0].lora_alpha),
                                            configs[0].r, r_total, rslora=configs[0].use_rslora)
    lineage = {
        "parent_adapter": names[0],
        "merge": {"mode": mode, "density": density,
                  "sources": [{"name": n, "weight": w, "content_sha256": h}
                              for n, w, h in zip(names, weights, hashes, strict=True)]},
    }
    try:
        store.save_adapter(out_name, merged, config, lineage=lineage)
    except KilnError:
        raise
    except OSError as e:
        raise KilnError(500, "adapter_merge_failed", f"writing merged adapter {out_name!r} failed: {e}",
                        param="output_name") from None
    return {
        "status": "merged",
        "output_name": out_name,
        "mode": mode,
        "sources": [{"name": n, "weight": w} for n, w in zip(names, weights, strict=True)],
        "num_tensors": len(merged),
    }


def _as_source(s: MergeSource | Mapping[str, Any] | tuple[str, float]) -> MergeSource:
    if isinstance(s, MergeSource):
        return s
    if isinstance(s, Mapping):
        return MergeSource(s["name"], float(s.get("weight", 1.0)))
    return MergeSource(s[0], float(s[1]))
