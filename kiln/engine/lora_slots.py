"""Which adapter revision occupies which slot of the model's LoRA bank (actor thread only).

A request names an `AdapterTarget` (one adapter revision, or a composition); at admission the actor
binds it to a slot, writing the factors only when that exact revision is not already resident. A slot
stays pinned while any sequence uses it, so a hot swap never changes the weights under a running
request: the new revision gets its own slot and the old one is reused once its last request finishes.
Each binding also gets a fresh `uid`, the prefix cache's namespace, so K/V computed under one
revision is never reused under another.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from kiln.model.lora import LoraBank
from kiln.model.transformer import Transformer

Factors = Mapping[tuple[int, str], tuple[Tensor, Tensor, float]]


@dataclass(frozen=True, eq=False)
class AdapterTarget:
    key: tuple            # identity: ((name, scale, content_sha256), ...)
    label: str            # what `adapter_used` reports: "name" or "a*1+b*0.5"
    modules: Factors
    rank: int


class LoraSlots:
    def __init__(self, model: Transformer, initial_slots: int = 4, initial_rank: int = 16) -> None:
        self.model = model
        self.initial_slots = initial_slots
        self.initial_rank = initial_rank
        self._slot_of: OrderedDict[tuple, int] = OrderedDict()  # LRU order of resident keys
        self._key_of: dict[int, tuple] = {}
        self._refs: dict[int, int] = {}
        self._uid_of: dict[int, int] = {}
        self._uids = itertools.count(1)

    @property
    def bank(self) -> LoraBank | None:
        return self.model.lora_bank

    def acquire(self, target: AdapterTarget) -> tuple[int, int]:
        """Pin a slot holding `target`'s factors; returns (slot, prefix-cache uid)."""
        slot = self._slot_of.get(target.key)
        if slot is None:
            slot = self._free_slot(target.rank)
            self.bank.set_slot(slot, target.modules)  # type: ignore[union-attr]
            self._slot_of[target.key] = slot
            self._key_of[slot] = target.key
            self._uid_of[slot] = next(self._uids)
        self._slot_of.move_to_end(target.key)
        self._refs[slot] = self._refs.get(slot, 0) + 1
        return slot, self._uid_of[slot]

    def release(self, slot: int) -> None:
        if slot and self._refs.get(slot, 0) > 0:
            self._refs[slot] -= 1

    def _free_slot(self, rank: int) -> int:
        bank = self.bank
        if bank is None:
            p = next(self.model.parameters())
            # factors in the model's dtype: a bfloat16 model's adapters stream half the bytes per
            # decode step (on CPU they are widened to float32 and computed with exactly there)
            dtype = p.dtype if p.device.type != "cpu" or p.dtype == torch.bfloat16 else torch.float32
            bank = LoraBank(self.model.config, self.initial_slots, max(rank, self.initial_rank), dtype, p.device)
            self.model.lora_bank = bank
        elif rank > bank.rank:
            bank = self.model.lora_bank = bank.grown(bank.num_slots, rank)
        used = set(self._key_of)
        for slot in range(1, bank.num_slots):
            if slot not in used:
                return slot
        for key, slot in self._slot_of.items():  # least recently used first
            if self._refs.get(slot, 0) == 0:
                del self._slot_of[key]
                del self._key_of[slot]
                return slot
        old = bank.num_slots
        self.model.lora_bank = bank.grown(old * 2, bank.rank)
        return old


def target_from_modules(key: tuple, label: str, modules: Factors) -> AdapterTarget:
    rank = max((a.shape[0] for a, _, _ in modules.values()), default=1)
    return AdapterTarget(key, label, {k: (v[0], v[1], float(v[2])) for k, v in modules.items()}, rank)
