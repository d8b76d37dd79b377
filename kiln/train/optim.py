"""AdamW for the trained LoRA factors, without `torch.optim`.

Building any `torch.optim` optimizer imports torch's compiler, torch._dynamo (its `add_param_group` is
wrapped to keep the compiler out of it): ~1.5 s of CPU and ~70 MB resident, which a server paid at its
first training step, or ahead of time on a thread of its own once it was ready. Nothing else a training
step runs imports it.

`AdamW` is `torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)` with torch's other defaults
(betas (0.9, 0.999), eps 1e-8, no amsgrad, no maximize) as torch runs it for CPU tensors (its
single-tensor path), the same tensor operations in the same order: the parameters it updates are
bit-identical to torch's, step after step (tests/train/test_optim.py). Its `state_dict` has torch's
layout (per parameter index: `step`, a float32 CPU scalar tensor, `exp_avg`, `exp_avg_sq`; one parameter
group with torch's keys), so a checkpoint written by either optimizer resumes in the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

BETAS = (0.9, 0.999)
EPS = 1e-8


class AdamW:
    """Decoupled-weight-decay Adam over `params` (one parameter group)."""

    def __init__(self, params: Iterable[Tensor], lr: float, weight_decay: float = 0.0) -> None:
        self.params = list(params)
        # torch's keys and defaults, so state_dict() is what torch.optim.AdamW's would be
        self.param_groups: list[dict[str, Any]] = [{
            "lr": lr, "betas": BETAS, "eps": EPS, "weight_decay": weight_decay, "amsgrad": False,
            "foreach": None, "maximize": False, "capturable": False, "differentiable": False, "fused": None,
            "decoupled_weight_decay": True, "params": self.params,
        }]
        self.state: dict[Tensor, dict[str, Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for p in self.params:
            grad = p.grad
            if grad is None:
                continue
            state = self.state.get(p)
            if not state:
                state = self.state[p] = {
                    # torch keeps the step count as a float32 CPU scalar tensor
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
            exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
            # torch.optim.adam._single_tensor_adam with decoupled weight decay, line for line
            step_t += 1
            if weight_decay != 0:
                p.mul_(1 - lr * weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = step_t.item()
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            step_size = lr / bias_correction1
            bias_correction2_sqrt = bias_correction2**0.5
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-step_size)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout: the state by parameter index, the group's settings with the indices."""
        index = {id(p): i for i, p in enumerate(self.params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.params)))
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items()}, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A state_dict of this optimizer or of `torch.optim.AdamW` (as torch loads one: the saved settings
        replace the current ones, the moments take each parameter's dtype and device)."""
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError("the optimizer state has a different number of parameters or groups")
        saved = groups[0]
        if saved.get("amsgrad") or saved.get("maximize") or not saved.get("decoupled_weight_decay", True):
            raise ValueError("the optimizer state is not plain AdamW (amsgrad, maximize or coupled weight decay)")
        self.param_groups[0].update({k: v for k, v in saved.items() if k != "params"})
        self.param_groups[0]["params"] = self.params
        self.state = {}
        for i, p in zip(saved["params"], self.params, strict=True):
            s = state_dict["state"].get(i)
            if s is None:
                continue
            self.state[p] = {k: v if k == "step" else v.to(dtype=p.dtype, device=p.device) for k, v in s.items()}
