"""Paged K/V tensors and the per-step attention metadata that addresses them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kiln.model.config import ModelConfig
from kiln.model.heap import zeroed


def resolve_torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}") from None


class KVCache:
    """Per layer `k[i]` and `v[i]`: `[num_blocks * block_size, num_kv_heads, head_dim]`.

    All layers live in one allocation so the pool is a single tensor the runner can size up front.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | str,
        device: torch.device | str,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.dtype = resolve_torch_dtype(dtype)
        self.device = torch.device(device)
        shape = (config.num_hidden_layers, 2, self.num_slots, config.num_key_value_heads, config.head_dim)
        # on the CPU, zero pages the kernel maps as blocks are first written: the pool costs no time to
        # clear at start and holds memory as traffic fills it
        self.storage = zeroed(shape, self.dtype) if self.device.type == "cpu" else \
            torch.zeros(*shape, dtype=self.dtype, device=self.device)
        self.k: list[Tensor] = [self.storage[i, 0] for i in range(config.num_hidden_layers)]
        self.v: list[Tensor] = [self.storage[i, 1] for i in range(config.num_hidden_layers)]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype | str) -> int:
        itemsize = torch.empty((), dtype=resolve_torch_dtype(dtype)).element_size()
        return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * itemsize


@dataclass
class PrefillChunk:
    query_start: int              # slice of the flat token array
    query_len: int
    context_slots: Tensor         # [L] slots of tokens 0..L-1 (cached prefix + earlier chunks + this chunk)
    # causal: query i (absolute position L - query_len + i) attends to context 0..L-query_len+i

    @property
    def context_len(self) -> int:
        return int(self.context_slots.shape[0])


@dataclass
class AttentionMetadata:
    slot_mapping: Tensor          # [T] int64: where each input token's K/V is written
    num_decode_tokens: int        # the first Bd tokens are decodes (one per sequence)
    decode_context_slots: Tensor  # [Bd, Lmax] slots of each decode's full context (incl. itself), padded
    decode_context_lens: Tensor   # [Bd] valid lengths (padding masked out)
    prefills: list[PrefillChunk]  # after the decodes, in order

    @property
    def max_context_len(self) -> int:
        """Longest context in the step, known without a device sync (sizes the rotary tables)."""
        lens = [p.context_len for p in self.prefills]
        if self.num_decode_tokens:
            lens.append(int(self.decode_context_slots.shape[1]))
        return max(lens, default=0)


def build_attention_metadata(
    items: Sequence[tuple[Sequence[int], int, int]],
    block_size: int,
    device: torch.device | str,
) -> tuple[AttentionMetadata, list[int]]:
    """`items`: (block_table, num_computed_tokens, num_new_tokens) in flat order, decodes first.

    The leading items with one new token form the decode group. Returns the metadata and the
    absolute position of every flat token.
    """
    num_decodes = 0
    while num_decodes < len(items) and items[num_decodes][2] == 1:
        num_decodes += 1
    positions: list[int] = []
    for table, computed, new in items:
        if new < 1:
            raise ValueError("every scheduled item needs at least one new token")
        if (computed + new + block_size - 1) // block_size > len(table):
            raise ValueError(f"block table of {len(table)} blocks cannot hold {computed + new} tokens")
        positions.extend(range(computed, computed + new))

    slot_parts: list[np.ndarray] = []
    if num_decodes:
        lens = [items[i][1] + 1 for i in range(num_decodes)]
        decode_slots = _context_slots([items[i][0] for i in range(num_decodes)], lens, block_size)
        decode_lens = torch.tensor(lens, dtype=torch.int64)
        # each decode writes its own K/V at its last position
        slot_parts.append(np.asarray([table[(n - 1) // block_size] * block_size + (n - 1) % block_size
                                      for (table, _, _), n in zip(items[:num_decodes], lens, strict=True)],
                                     dtype=np.int64))
    else:
        decode_slots = torch.zeros((0, 0), dtype=torch.int64)
        decode_lens = torch.zeros((0,), dtype=torch.int64)

    prefills: list[PrefillChunk] = []
    start = num_decodes
    for table, computed, new in items[num_decodes:]:
        ctx = _context_slots([table], [computed + new], block_size)[0]
        slot_parts.append(ctx[computed:].numpy())
        prefills.append(PrefillChunk(query_start=start, query_len=new, context_slots=ctx.to(device)))
        start += new

    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slot_parts) if slot_parts else np.zeros(0, dtype=np.int64)).to(device),
        num_decode_tokens=num_decodes,
        decode_context_slots=decode_slots.to(device),
        decode_context_lens=decode_lens.to(device),
        prefills=prefills,
    )
    return meta, positions


def _context_slots(tables: list[Sequence[int]], lens: list[int], block_size: int) -> Tensor:
    """Slots of positions 0..len-1 per sequence, `[N, max(lens)]`, padded with slot 0.

    numpy, not torch: this runs every step on the engine thread, where a dozen small torch ops
    cost more than the decode attention they feed."""
    max_len = max(lens)
    max_blocks = (max_len + block_size - 1) // block_size
    padded = np.zeros((len(tables), max_blocks), dtype=np.int64)
    for row, (table, n) in enumerate(zip(tables, lens, strict=True)):
        nb = (n + block_size - 1) // block_size
        padded[row, :nb] = table[:nb]
    slots = (padded[:, :, None] * block_size + np.arange(block_size, dtype=np.int64)).reshape(len(tables), -1)
    slots = np.ascontiguousarray(slots[:, :max_len])
    slots[np.arange(max_len)[None, :] >= np.asarray(lens, dtype=np.int64)[:, None]] = 0
    return torch.from_numpy(slots)
