"""GRPO (semantics.md §12.2): group-normalised advantages and a clipped token-level policy gradient
with a KL penalty to the base policy.

Per completion token: ratio = exp(logp - logp_old), where the old policy is the adapter at the start of
the step; loss = -min(ratio*A, clip(ratio, 1-eps, 1+eps)*A) + kl_coeff * KL against the base model
(the same forward with no adapter). The step loss is the mean over every completion token of the step.

KL estimators: k3 = exp(d) - d - 1 with d = logp_ref - logp (the default: zero with zero gradient at
the base, and its gradient pulls the policy back toward the base), k1 = logp - logp_ref (§12.2's older
formula; as a loss its gradient is plain grad(logp) on the given completions, so it lowers all of them,
the preferred one too), or none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kiln.data.formats import grpo_problem
from kiln.model.lora import LoraDelta
from kiln.train.batch import collate, per_target, target_logprobs
from kiln.train.errors import invalid, row_invalid, row_param
from kiln.train.masks import MaskedSequence
from kiln.train.sft import masked

ADV_EPS = 1e-8
KL_ESTIMATORS = ("k3", "k1", "none")


def group_advantages(rewards: Sequence[float], eps: float = ADV_EPS) -> list[float] | None:
    """(r - mean) / (population std + eps); None for a group with nothing to compare (size <= 1 or
    every reward equal): its advantages would all be zero, so it is skipped."""
    n = len(rewards)
    if n <= 1 or max(rewards) == min(rewards):
        return None
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / n
    std = math.sqrt(var)
    return [(r - mean) / (std + eps) for r in rewards]


def grpo_token_loss(logp: Tensor, logp_old: Tensor, logp_ref: Tensor, advantages: Tensor,
                    mask: Tensor | None = None, *, clip_eps: float, kl_coeff: float,
                    kl_estimator: str = "k3") -> tuple[Tensor, dict[str, Tensor]]:
    """Summed per-token loss (over `mask` when given; `advantages` broadcast to the tokens), plus the
    summed KL and the number of tokens whose clipped term was in force."""
    adv = advantages
    if mask is None:
        mask = torch.ones_like(logp)
    ratio = torch.exp(logp - logp_old)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    pg = -torch.minimum(unclipped, clipped)
    if kl_estimator == "k1":
        kl = logp - logp_ref
    elif kl_estimator == "k3":
        d = logp_ref - logp
        kl = torch.exp(d) - d - 1.0
    else:
        kl = torch.zeros_like(logp)
    per_token = pg + kl_coeff * kl
    was_clipped = (clipped < unclipped).float()  # the clipped term is the one in force
    return (per_token * mask).sum(), {"kl": (kl.detach() * mask).sum(), "clipped": (was_clipped * mask).sum()}


@dataclass
class GrpoGroup:
    sequences: list[MaskedSequence]
    advantages: list[float]
    rewards: list[float]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_trained for s in self.sequences)


@dataclass
class GrpoPrepared:
    groups: list[GrpoGroup]
    skipped: list[int] = field(default_factory=list)   # indices of zero-variance groups
    mean_reward: float = 0.0


RewardFn = Callable[[dict[str, Any], int, str], float]   # (group row, completion index, label) -> reward


def prepare_grpo(rows: Sequence[Any], labels: Sequence[str], template: Any, tokenizer: Any, max_len: int,
                 reward_fn: RewardFn | None = None) -> GrpoPrepared:
    """Validate groups, score them when a scorer defines the reward, drop zero-variance groups and
    tokenize each completion as the assistant turn after the group's prompt."""
    groups: list[GrpoGroup] = []
    skipped: list[int] = []
    all_rewards: list[float] = []
    for gi, (row, label) in enumerate(zip(rows, labels, strict=True)):
        problem = grpo_problem(_with_placeholder_rewards(row) if reward_fn else row)
        if problem:
            raise row_invalid(label, problem)
        completions = row["completions"]
        rewards = [reward_fn(row, ci, f"{label}.completions[{ci}]") if reward_fn else float(c["reward"])
                   for ci, c in enumerate(completions)]
        all_rewards += rewards
        advantages = group_advantages(rewards)
        if advantages is None:
            skipped.append(gi)
            continue
        seqs = [masked(template, tokenizer, [*row["messages"], {"role": "assistant", "content": c["text"]}],
                       f"{label}.completions[{ci}]", max_len, only_last=True, tools=row.get("tools"))
                for ci, c in enumerate(completions)]
        groups.append(GrpoGroup(seqs, advantages, rewards))
    if not groups:
        raise invalid("every group has the same reward for all of its completions (or a single completion), "
                      "so there is nothing to learn", param=row_param_base(labels),
                      hint="Each group needs completions with different rewards.")
    mean = sum(all_rewards) / len(all_rewards) if all_rewards else 0.0
    return GrpoPrepared(groups, skipped, mean)


def row_param_base(labels: Sequence[str]) -> str:
    first = labels[0] if labels else "groups"
    return first.split("[")[0] if first.startswith("groups[") else row_param(first)


def _with_placeholder_rewards(row: Any) -> Any:
    # With a reward scorer the rows need no rewards of their own; check the rest of their shape.
    if not isinstance(row, dict) or not isinstance(row.get("completions"), list):
        return row
    comps = [{**c, "reward": 0.0} if isinstance(c, dict) else c for c in row["completions"]]
    return {**row, "completions": comps}


@dataclass
class GrpoWork:
    """The loop's view of a GRPO job: items are groups; normalizer = completion tokens in the step."""

    groups: list[GrpoGroup]
    clip_eps: float
    kl_coeff: float
    kl_estimator: str = "k3"

    @property
    def items(self) -> list[GrpoGroup]:
        return self.groups

    @staticmethod
    def tokens(item: GrpoGroup) -> int:
        return item.num_tokens

    def loss(self, model: torch.nn.Module, lora: LoraDelta, items: Sequence[GrpoGroup], normalizer: int,
             memo: dict[str, Any]) -> tuple[Tensor, dict[str, float]]:
        """`memo` lives for the step: with several updates per step, the old policy's and the base
        policy's log-probs are the ones computed on the step's first pass."""
        seqs = [s for g in items for s in g.sequences]
        device = next(model.parameters()).device
        batch = collate(seqs, device=device)
        adv = per_target(batch, torch.tensor([a for g in items for a in g.advantages], dtype=torch.float32,
                                             device=device))
        logp = target_logprobs(model, batch, lora)
        if "old" not in memo:
            # The first pass runs on the adapter as the step found it: that is the old policy.
            memo["old"] = logp.detach()
            with torch.no_grad():
                memo["ref"] = target_logprobs(model, batch, None) if self.kl_estimator != "none" else memo["old"]
        total, stats = grpo_token_loss(logp, memo["old"], memo["ref"], adv, clip_eps=self.clip_eps, kl_coeff=self.kl_coeff,
                                       kl_estimator=self.kl_estimator)
        n = max(normalizer, 1)
        return total / n, {"kl": float(stats["kl"]) / n, "clip_fraction": float(stats["clipped"]) / n}
