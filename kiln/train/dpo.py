"""DPO (Rafailov et al. 2023; TRL's DPOTrainer is the reference): learn from preference pairs against a
frozen reference policy, with no reward model.

Per pair, with log-probabilities of the whole reply (the assistant turn after the prompt, its end-of-turn
token included) under the policy (pi) and the reference (ref):
  logits = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)
  sigmoid: loss = -log sigmoid(beta * logits)          (log 2 while the policy is the reference)
  ipo:     loss = (logits - 1 / (2 beta))^2, on per-token mean log-probabilities (as TRL computes IPO)
The step loss is the mean over the step's pairs. Implicit rewards are beta * (pi - ref); the step reports
their margin (chosen - rejected) and the preference accuracy (the share of pairs whose chosen reward is
higher), as TRL's rewards/margins and rewards/accuracies.

The reference is the starting point of the job: the base model wearing the starting adapter (config.
base_adapter), or the bare base. Its log-probabilities are computed once, before the first step, for the
training and the held-out pairs (`prepare`); a resumed job computes them again from the same start, so
they are the same numbers. Held-out pairs are scored again after training (`evaluate`): how often the
new adapter ranks chosen above rejected, against how often the starting adapter did, and how often its
margin beats the starting adapter's (the win rate against the start). With `min_heldout_win_rate` that
win rate gates activation: below it the adapter is saved but not loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.data.preferences import PreferencePair
from kiln.model.lora import LoraDelta
from kiln.train.batch import collate, target_logprobs
from kiln.train.errors import row_invalid
from kiln.train.loop import Cancelled
from kiln.train.masks import MaskedSequence
from kiln.train.sft import masked

LOSS_TYPES = ("sigmoid", "ipo")


@dataclass
class DpoPair:
    chosen: MaskedSequence
    rejected: MaskedSequence
    label: str
    ref: tuple[float, float] | None = None    # reference log-probs (chosen, rejected), set by `prepare`

    @property
    def num_tokens(self) -> int:
        return self.chosen.num_trained + self.rejected.num_trained


def _reply_ids(seq: MaskedSequence) -> list[int]:
    return [t for t, trained in zip(seq.input_ids[1:], seq.trained[1:], strict=True) if trained]


def prepare_dpo(pairs: Sequence[PreferencePair], labels: Sequence[str], template: Any, tokenizer: Any,
                max_len: int) -> list[DpoPair]:
    """Tokenize each pair as two conversations (prompt + chosen, prompt + rejected), training only the reply."""
    out = []
    for pair, label in zip(pairs, labels, strict=True):
        seqs = [masked(template, tokenizer, [*pair.messages, {"role": "assistant", "content": reply}], label,
                       max_len, only_last=True) for reply in (pair.chosen, pair.rejected)]
        if _reply_ids(seqs[0]) == _reply_ids(seqs[1]):
            raise row_invalid(label, f"chosen and rejected are the same tokens within max_seq_len ({max_len})",
                              hint="Raise config.max_seq_len so the replies' difference is kept, or drop the pair.")
        out.append(DpoPair(seqs[0], seqs[1], label))
    return out


def sequence_logps(model: torch.nn.Module, lora: LoraDelta | None, seqs: Sequence[MaskedSequence], *,
                   average: bool = False) -> Tensor:
    """Each sequence's summed (or per-token mean) log-probability of its trained tokens, `[len(seqs)]`."""
    batch = collate(seqs, device=next(model.parameters()).device)
    logp = target_logprobs(model, batch, lora)
    counts = batch.target_mask.sum(1)
    rows = torch.arange(len(seqs), device=logp.device).repeat_interleave(counts.long())
    sums = torch.zeros(len(seqs), dtype=logp.dtype, device=logp.device).index_add(0, rows, logp)
    return sums / counts.clamp_min(1) if average else sums


def dpo_losses(pi_chosen: Tensor, pi_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, *, beta: float,
               loss_type: str = "sigmoid") -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair losses and the (detached) implicit rewards of chosen and rejected."""
    logits = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return losses, beta * (pi_chosen - ref_chosen).detach(), beta * (pi_rejected - ref_rejected).detach()


@dataclass
class DpoWork:
    """The loop's view of a DPO job: items are pairs; each weighs one in the step mean."""

    pairs: list[DpoPair]
    heldout: list[DpoPair]
    beta: float
    loss_type: str = "sigmoid"
    min_win_rate: float | None = None

    @property
    def items(self) -> list[DpoPair]:
        return self.pairs

    @staticmethod
    def tokens(item: DpoPair) -> int:
        return item.num_tokens

    @staticmethod
    def weight(item: DpoPair) -> int:
        return 1

    @property
    def average(self) -> bool:
        return self.loss_type == "ipo"

    def _logps(self, model: torch.nn.Module, lora: LoraDelta | None, items: Sequence[DpoPair]) -> tuple[Tensor, Tensor]:
        both = sequence_logps(model, lora, [p.chosen for p in items] + [p.rejected for p in items],
                              average=self.average)
        return both[: len(items)], both[len(items):]

    @torch.no_grad()
    def prepare(self, model: torch.nn.Module, lora: LoraDelta, should_stop: Callable[[], bool] = lambda: False) -> None:
        """The reference log-probabilities: `lora` as the job starts (the starting adapter, or zero)."""
        for pair in [*self.pairs, *self.heldout]:
            if should_stop():
                raise Cancelled()
            chosen, rejected = self._logps(model, lora, [pair])
            pair.ref = (float(chosen[0]), float(rejected[0]))

    def loss(self, model: torch.nn.Module, lora: LoraDelta, items: Sequence[DpoPair], normalizer: int,
             memo: dict[str, Any]) -> tuple[Tensor, dict[str, float]]:
        device = next(model.parameters()).device
        pi_chosen, pi_rejected = self._logps(model, lora, items)
        ref = torch.tensor([p.ref for p in items], dtype=pi_chosen.dtype, device=device)
        losses, chosen_r, rejected_r = dpo_losses(pi_chosen, pi_rejected, ref[:, 0], ref[:, 1], beta=self.beta,
                                                  loss_type=self.loss_type)
        n = max(normalizer, 1)
        return losses.sum() / n, {
            "reward_margin": float((chosen_r - rejected_r).sum()) / n,
            "preference_accuracy": float((chosen_r > rejected_r).float().sum()) / n,
            "chosen_reward": float(chosen_r.sum()) / n,
            "rejected_reward": float(rejected_r.sum()) / n,
        }

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, lora: LoraDelta) -> dict[str, Any] | None:
        """The held-out figures of the trained adapter against the starting one; None without held-out pairs."""
        if not self.heldout:
            return None
        ref_margin, margin = [], []
        for pair in self.heldout:
            chosen, rejected = self._logps(model, lora, [pair])
            assert pair.ref is not None
            ref_margin.append(pair.ref[0] - pair.ref[1])
            margin.append(float(chosen[0] - rejected[0]))
        report = heldout_report(ref_margin, margin, beta=self.beta, average=self.average)
        if self.min_win_rate is not None:
            report["min_win_rate"] = self.min_win_rate
            report["passed"] = report["win_rate_vs_start"] >= self.min_win_rate
        return report

    def blocks_activation(self, held_out: dict[str, Any] | None) -> str | None:
        """Why the new adapter must not be loaded (its held-out gate failed), or None."""
        if held_out is None or held_out.get("passed") is not False:
            return None
        return (f"held-out win rate {held_out['win_rate_vs_start']} against the starting adapter is below "
                f"config.min_heldout_win_rate {self.min_win_rate}: the adapter was saved but not loaded")


def heldout_report(ref_margin: Sequence[float], margin: Sequence[float], *, beta: float,
                   average: bool) -> dict[str, Any]:
    """Preference accuracy (chosen log-prob above rejected) before (the starting adapter) and after, the
    mean log-prob margins, the win rate against the start (margin grew) and the mean implicit reward margin."""
    n = len(margin)
    return {
        "pairs": n,
        "logprob": "per-token mean" if average else "sum",
        "preference_accuracy_before": round(sum(m > 0 for m in ref_margin) / n, 6),
        "preference_accuracy_after": round(sum(m > 0 for m in margin) / n, 6),
        "mean_logprob_margin_before": round(sum(ref_margin) / n, 6),
        "mean_logprob_margin_after": round(sum(margin) / n, 6),
        "win_rate_vs_start": round(sum(a > b for a, b in zip(margin, ref_margin, strict=True)) / n, 6),
        "reward_margin": round(beta * sum(a - b for a, b in zip(margin, ref_margin, strict=True)) / n, 6),
    }
