"""Trainable LoRA factors over a frozen base: the `LoraDelta` the trainer hands to `forward_dense`.

Each adapted projection gets A `[r, in]` (kaiming-uniform, as PEFT initialises it) and B `[out, r]`
(zeros), so a fresh adapter starts as the exact base model. The factors live in float32 whatever the
base dtype (a bfloat16 base would lose most of a small update to rounding); `delta` casts them to the
activation dtype, so gradients reach the float32 masters through the cast.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from kiln.adapters.peft_format import LoraModule
from kiln.model.config import ModelConfig
from kiln.model.lora import MODULES, module_shapes


def _key(layer: int, name: str) -> str:
    return f"{layer}_{name}"  # ParameterDict keys may not contain "."


class TrainableLora(nn.Module):
    def __init__(self, config: ModelConfig, rank: int, alpha: float, target_modules: Iterable[str] = MODULES,
                 *, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        super().__init__()
        targets = tuple(dict.fromkeys(target_modules))
        unknown = [m for m in targets if m not in MODULES]
        if unknown:
            raise ValueError(f"unknown target modules {unknown}; choose from {list(MODULES)}")
        if rank < 1:
            raise ValueError("rank must be at least 1")
        self.rank = rank
        self.alpha = float(alpha)
        self.scale = self.alpha / rank
        self.target_modules = targets
        self.num_layers = config.num_hidden_layers
        shapes = module_shapes(config)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self.a = nn.ParameterDict()
        self.b = nn.ParameterDict()
        for layer in range(config.num_hidden_layers):
            for name in targets:
                fan_in, fan_out = shapes[name]
                a = torch.empty(rank, fan_in, dtype=torch.float32)
                _kaiming_uniform(a, gen)
                self.a[_key(layer, name)] = nn.Parameter(a.to(device))
                self.b[_key(layer, name)] = nn.Parameter(torch.zeros(fan_out, rank, dtype=torch.float32, device=device))

    # -- LoraDelta ---------------------------------------------------------------------------------
    def apply(self, y: Tensor, x: Tensor, layer: int, name: str) -> Tensor:
        delta = self.delta(x, layer, name)
        return y if delta is None else y + delta   # not in place: autograd needs y

    def delta(self, x: Tensor, layer: int, name: str) -> Tensor | None:
        key = _key(layer, name)
        if key not in self.a:
            return None
        # The factors are cast (not the activations): autograd saves no float32 copy of x, and the
        # delta is computed in the model dtype exactly as the serving bank computes it.
        a, b = self.a[key].to(x.dtype), self.b[key].to(x.dtype)
        return (x @ a.T) @ (b.T * self.scale)

    # -- conversion --------------------------------------------------------------------------------
    def factors(self) -> dict[tuple[int, str], tuple[Tensor, Tensor]]:
        """(layer, module) -> (A, B), detached float32 copies: what AdapterStore.save_adapter takes."""
        out = {}
        for layer in range(self.num_layers):
            for name in self.target_modules:
                key = _key(layer, name)
                out[(layer, name)] = (self.a[key].detach().clone(), self.b[key].detach().clone())
        return out

    @torch.no_grad()
    def load_factors(self, modules: Mapping[tuple[int, str], LoraModule]) -> None:
        """Start from a saved adapter. Its effective update scale*B@A is kept exactly: B is rescaled
        when the saved scale differs from ours (e.g. rsLoRA), and missing modules stay zero."""
        for (layer, name), (a, b, scale) in modules.items():
            key = _key(layer, name)
            if key not in self.a:
                raise ValueError(f"the base adapter adapts {name} of layer {layer}, which this adapter does not target")
            if tuple(a.shape) != tuple(self.a[key].shape) or tuple(b.shape) != tuple(self.b[key].shape):
                raise ValueError(f"the base adapter's {name} factors of layer {layer} have shapes "
                                 f"{tuple(a.shape)}/{tuple(b.shape)}, expected {tuple(self.a[key].shape)}/"
                                 f"{tuple(self.b[key].shape)}")
            self.a[key].copy_(a.float())
            self.b[key].copy_(b.float() * (float(scale) / self.scale))

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _kaiming_uniform(t: Tensor, gen: torch.Generator | None) -> None:
    # nn.init.kaiming_uniform_(a=sqrt(5)) -- PEFT's lora_A init -- with an explicit generator so a
    # job's seed alone decides the starting point.
    fan_in = t.shape[1]
    gain = math.sqrt(2.0 / (1 + 5.0))
    bound = math.sqrt(3.0) * gain / math.sqrt(fan_in)
    with torch.no_grad():
        t.uniform_(-bound, bound, generator=gen)


def freeze_base(model: nn.Module) -> None:
    """The base never trains: no parameter asks for a gradient (the serving actor reads them as is)."""
    for p in model.parameters():
        if p.requires_grad:
            p.requires_grad_(False)
