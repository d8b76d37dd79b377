"""Supervised fine-tuning: conversations -> masked token sequences -> cross-entropy on assistant tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kiln.data.formats import sft_problem
from kiln.model.lora import LoraDelta
from kiln.train.batch import collate, target_logprobs
from kiln.train.errors import row_invalid
from kiln.train.masks import MaskedSequence, MaskError, mask_conversation


def prepare_sft(rows: Sequence[Any], labels: Sequence[str], template: Any, tokenizer: Any,
                max_len: int) -> list[MaskedSequence]:
    """Validate and tokenize every conversation; a bad one is a 400 naming it and the field."""
    out = []
    for row, label in zip(rows, labels, strict=True):
        problem = sft_problem(row)
        if problem:
            raise row_invalid(label, problem)
        seq = masked(template, tokenizer, row["messages"], label, max_len, tools=row.get("tools"))
        out.append(seq)
    return out


def masked(template: Any, tokenizer: Any, messages: list[dict[str, Any]], label: str, max_len: int, *,
           only_last: bool = False, tools: Any = None) -> MaskedSequence:
    try:
        seq = mask_conversation(template, tokenizer, messages, max_len=max_len, only_last=only_last, tools=tools)
    except MaskError as e:
        raise row_invalid(label, str(e), field=e.field,
                          hint="Each conversation needs an assistant message for the model to learn.") from None
    except ValueError as e:  # the template rejected the messages (ChatTemplateError is a ValueError)
        raise row_invalid(label, f"the chat template rejected the messages: {getattr(e, 'message', e)}",
                          field="messages") from None
    if seq.num_trained == 0:
        raise row_invalid(label, f"no assistant token falls within max_seq_len ({max_len} tokens)",
                          field="messages", hint="Raise config.max_seq_len or shorten the conversation.")
    return seq


@dataclass
class SftWork:
    """The loop's view of an SFT job: items are sequences; the loss is the token-mean cross-entropy."""

    sequences: list[MaskedSequence]

    @property
    def items(self) -> list[MaskedSequence]:
        return self.sequences

    @staticmethod
    def tokens(item: MaskedSequence) -> int:
        return item.num_trained

    @staticmethod
    def loss(model: torch.nn.Module, lora: LoraDelta, items: Sequence[MaskedSequence], normalizer: int,
             memo: dict[str, Any]) -> tuple[Tensor, dict[str, float]]:
        """Summed NLL of the micro-batch's trained tokens over the whole step's trained-token count,
        so accumulated micro-batches add up to the step's token mean."""
        batch = collate(items, device=next(model.parameters()).device)
        logp = target_logprobs(model, batch, lora)
        loss = -logp.sum() / max(normalizer, 1)
        return loss, {}
