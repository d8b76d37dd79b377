"""Padding masked sequences into a batch, and the log-probabilities of their trained target tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kiln.model.lora import LoraDelta
from kiln.train.forward import selected_logprobs
from kiln.train.masks import MaskedSequence


@dataclass
class Batch:
    input_ids: Tensor       # [B, T] right-padded
    attention: Tensor       # [B, T] 1 = token
    target_mask: Tensor     # [B, T-1] float: 1 where token t+1 is trained (predicted from position t)

    @property
    def num_targets(self) -> int:
        return int(self.target_mask.sum().item())


def collate(seqs: Sequence[MaskedSequence], device: torch.device | str = "cpu", pad_id: int = 0) -> Batch:
    width = max(len(s.input_ids) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    trained = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids, dtype=torch.long)
        att[i, :n] = 1
        trained[i, :n] = torch.tensor(s.trained, dtype=torch.bool)
    target_mask = (trained[:, 1:] & att[:, 1:].bool()).float()
    return Batch(ids.to(device), att.to(device), target_mask.to(device))


def target_logprobs(model: torch.nn.Module, batch: Batch, lora: LoraDelta | None) -> Tensor:
    """log p of every trained target token, flat `[N]` float32 in (row, position) order."""
    # A batch without padding skips the mask: the plain causal path is cheaper.
    attention = None if bool(batch.attention.all()) else batch.attention
    return selected_logprobs(model, batch.input_ids, attention, batch.target_mask, lora)


def per_target(batch: Batch, per_row: Tensor) -> Tensor:
    """Spread one value per row (`[B]`) over that row's trained targets, flat `[N]` like target_logprobs."""
    return per_row[:, None].expand_as(batch.target_mask)[batch.target_mask.bool()]
