"""Does an adapter fit the served model? A report per (layer, module), checked before any swap.

`model_spec` is a plain dict so this needs no model object:
    {"num_layers": 24,
     "modules": {"q_proj": {"in_features": 896, "out_features": 896}, ...,
                 # optional "layers": [...] when only some layers have the module (hybrid models)
                }}
`model_spec_from_config` builds it from a ModelConfig-like object.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kiln.adapters.peft_format import LAYOUT_INVALID, layout_error
from kiln.adapters.store import LoadedAdapter


def model_spec_from_config(config: Any) -> dict[str, Any]:
    """Projection shapes of an HF-style decoder (hidden_size, heads, kv heads, head_dim, intermediate)."""
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    inter = int(config.intermediate_size)
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    return {
        "num_layers": int(config.num_hidden_layers),
        "modules": {m: {"in_features": i, "out_features": o} for m, (i, o) in shapes.items()},
    }


@dataclass
class ShapeMismatch:
    layer: int
    module: str
    expected_in: int
    expected_out: int
    got_in: int
    got_out: int


@dataclass
class CompatibilityReport:
    adapter: str
    content_sha256: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    dtype: str
    target_modules: list[str] | str | None
    matched: dict[str, list[int]] = field(default_factory=dict)  # module -> layers that fit
    shape_mismatches: list[ShapeMismatch] = field(default_factory=list)
    unknown_modules: list[str] = field(default_factory=list)  # the model has no such projection
    layers_out_of_range: list[int] = field(default_factory=list)
    missing_targets: list[str] = field(default_factory=list)  # named in target_modules, no tensors

    @property
    def compatible(self) -> bool:
        return bool(self.matched) and not (self.shape_mismatches or self.unknown_modules or self.layers_out_of_range)

    def problems(self) -> list[str]:
        out = [f"layer {m.layer} {m.module}: adapter is {m.got_in}->{m.got_out}, model is "
               f"{m.expected_in}->{m.expected_out}" for m in self.shape_mismatches]
        out += [f"the model has no module {m!r}" for m in self.unknown_modules]
        out += [f"the model has no layer {i}" for i in self.layers_out_of_range]
        return out

    def raise_if_incompatible(self) -> None:
        problems = self.problems()
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise layout_error(f"adapter {self.adapter!r} does not fit the served model: "
                               f"{'; '.join(problems[:3])}{more}", param="name",
                               hint="Use an adapter trained for this base model.")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["compatible"] = self.compatible
        return out


def check_compatibility(adapter: LoadedAdapter, model_spec: dict[str, Any]) -> CompatibilityReport:
    """Match every (layer, module) of `adapter` against the model; 400 when nothing matches."""
    num_layers = int(model_spec["num_layers"])
    specs: dict[str, dict[str, Any]] = model_spec["modules"]
    cfg = adapter.config
    targets = cfg.target_modules
    report = CompatibilityReport(
        adapter=adapter.name, content_sha256=adapter.content_sha256, rank=cfg.r, lora_alpha=cfg.lora_alpha,
        use_rslora=cfg.use_rslora, dtype=adapter.dtype,
        target_modules=list(targets) if isinstance(targets, tuple) else targets,
    )
    unknown: set[str] = set()
    out_of_range: set[int] = set()
    for (layer, module), lm in sorted(adapter.modules.items()):
        spec = specs.get(module)
        if spec is None:
            unknown.add(module)
            continue
        layers = spec.get("layers")
        if not 0 <= layer < num_layers or (layers is not None and layer not in layers):
            out_of_range.add(layer)
            continue
        got_in, got_out = lm.a.shape[1], lm.b.shape[0]
        if (got_in, got_out) != (spec["in_features"], spec["out_features"]):
            report.shape_mismatches.append(
                ShapeMismatch(layer, module, spec["in_features"], spec["out_features"], got_in, got_out))
            continue
        report.matched.setdefault(module, []).append(layer)
    report.unknown_modules = sorted(unknown)
    report.layers_out_of_range = sorted(out_of_range)
    present = {m for _, m in adapter.modules}
    if isinstance(targets, tuple):
        report.missing_targets = sorted(set(targets) - present)
    if not report.matched:
        problems = report.problems()
        detail = f": {'; '.join(problems[:3])}" if problems else ""
        raise layout_error(f"adapter {adapter.name!r} matches no module of the served model{detail}",
                           code=LAYOUT_INVALID, param="name",
                           hint="Use an adapter trained for this base model (same layer count and projection sizes).")
    return report
