"""Paged KV-cache bookkeeping: which cache blocks each sequence owns, and the prefix cache.

No tensors live here. The cache holds `num_blocks` blocks of `block_size` token slots. A block is
shared by several sequences (ref count > 1) only through a prefix-cache hit, and a shared block is
never written: hits are whole, already-computed blocks, and computing always resumes at a block
boundary in a block the sequence owns alone.

The prefix cache maps a chained hash of a full block (previous block's hash, its token ids, the
adapter slot) to the block holding its K/V. A block is registered only once its K/V are computed.
A freed block keeps its hash and stays reusable until its id is handed out for new tokens; the free
list hands out unhashed blocks first, then hashed ones least recently freed first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from kiln.core.sequence import Sequence


@dataclass
class PrefixCacheStats:
    lookups: int = 0  # allocations that consulted the prefix cache
    queried_tokens: int = 0  # tokens those allocations asked for
    hit_blocks: int = 0
    hit_tokens: int = 0


def block_hash(parent: bytes | None, token_ids: list[int], adapter_slot: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(adapter_slot.to_bytes(8, "little", signed=True))
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        # Insertion order is hand-out order: head = reused first.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # Hashes of each live sequence's leading full blocks that are computed (the chain so far);
        # None once a cache reset made the sequence's K/V unfit for sharing.
        self._seq_hashes: dict[int, list[bytes] | None] = {}
        self.stats = PrefixCacheStats()

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or free but still reusable)."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation --------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._find_hits(seq)
        # A hit block that sits on the free list is taken off it, so it is not available for new tokens.
        free_hits = sum(1 for b in hits if self._ref_counts[b] == 0)
        fresh = self.blocks_needed(seq.num_tokens) - len(hits)
        return fresh <= self.num_free_blocks - free_hits

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing cached full blocks of its prefix."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already has blocks")
        hits = self._find_hits(seq)
        fresh = self.blocks_needed(seq.num_tokens) - len(hits)
        free_hits = sum(1 for b in hits if self._ref_counts[b] == 0)
        if fresh > self.num_free_blocks - free_hits:
            raise RuntimeError(f"not enough free blocks for sequence {seq.seq_id}")
        if self.enable_prefix_caching:
            self.stats.lookups += 1
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_blocks += len(hits)
            self.stats.hit_tokens += len(hits) * self.block_size
        for block in hits:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        seq.block_table = list(hits) + [self._take_free_block() for _ in range(fresh)]
        self._seq_hashes[seq.seq_id] = [self._block_hashes[b] for b in hits]  # type: ignore[misc]
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens

    def _find_hits(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        tokens = seq.all_token_ids
        bs = self.block_size
        # At least one token must be computed so the step has logits to sample from. Stopping one
        # token short also keeps that token out of any shared block: when every block would hit,
        # the last one is dropped and recomputed in a block of the sequence's own.
        max_hits = (len(tokens) - 1) // bs
        hits: list[int] = []
        parent: bytes | None = None
        for i in range(max_hits):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs], seq.adapter_slot)
            block = self._cached.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        stale = self._block_hashes[block]
        if stale is not None:  # evict: the slot is about to hold other tokens
            del self._cached[stale]
            self._block_hashes[block] = None
        self._ref_counts[block] = 1
        return block

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to hold the computed tokens plus `num_new_tokens` more."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"not enough free blocks to extend sequence {seq.seq_id}")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def mark_computed(self, seq: Sequence) -> None:
        """Register the full blocks whose K/V the last step completed."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        if hashes is None:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if len(hashes) >= num_full:
            return
        tokens = seq.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_full):
            h = block_hash(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs], seq.adapter_slot)
            hashes.append(h)
            block = seq.block_table[i]
            # Two sequences with the same prefix computed side by side: the first one registered wins,
            # the other block simply stays private.
            if h not in self._cached and self._block_hashes[block] is None:
                self._cached[h] = block
                self._block_hashes[block] = h

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so under pressure a cached chain is evicted from its end, never its start.
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if self._block_hashes[block] is None:
                    self._free.move_to_end(block, last=False)  # worthless to keep: hand out first
        seq.block_table = []
        self._seq_hashes.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. the adapter in a slot changed, so old K/V are stale)."""
        self._cached.clear()
        self._block_hashes = [None] * self.num_blocks
        # Live sequences keep their blocks but never register them: their K/V predate the reset.
        for seq_id in self._seq_hashes:
            self._seq_hashes[seq_id] = None
