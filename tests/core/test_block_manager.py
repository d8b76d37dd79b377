import pytest

from kiln.core.block_manager import BlockManager
from kiln.core.sampling import SamplingParams
from kiln.core.sequence import Sequence

BS = 4


def make_seq(seq_id, tokens, adapter_slot=0):
    return Sequence(
        seq_id=seq_id, prompt_token_ids=list(tokens), params=SamplingParams(), adapter_slot=adapter_slot
    )


def compute_all(bm, seq):
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)


def test_allocate_takes_blocks_for_every_token_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(1, range(10))
    bm.allocate(seq)
    assert len(seq.block_table) == 3
    assert (bm.num_used_blocks, bm.num_free_blocks) == (3, 5)
    assert all(bm.ref_count(b) == 1 for b in seq.block_table)
    bm.free(seq)
    assert seq.block_table == []
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.usage) == (0, 8, 0.0)


def test_slot_of_a_position_follows_the_block_table():
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.allocate(make_seq(0, range(4)))
    seq = make_seq(1, range(6))
    bm.allocate(seq)
    slots = [seq.block_table[p // BS] * BS + p % BS for p in range(6)]
    assert len(set(slots)) == 6
    assert all(0 <= s < 8 * BS for s in slots)


def test_can_allocate_is_false_when_the_pool_is_too_small():
    bm = BlockManager(num_blocks=2, block_size=BS)
    assert not bm.can_allocate(make_seq(1, range(9)))
    assert bm.can_allocate(make_seq(2, range(8)))


def test_allocate_refuses_to_overcommit():
    bm = BlockManager(num_blocks=2, block_size=BS)
    with pytest.raises(RuntimeError):
        bm.allocate(make_seq(1, range(9)))
    assert bm.num_free_blocks == 2


def test_shared_system_prompt_hits_the_prefix_cache():
    bm = BlockManager(num_blocks=16, block_size=BS)
    system = list(range(100, 108))  # two full blocks
    first = make_seq(1, system + [1, 2, 3])
    bm.allocate(first)
    compute_all(bm, first)
    second = make_seq(2, system + [7, 8])
    bm.allocate(second)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert (second.num_cached_tokens, second.num_computed_tokens) == (8, 8)
    assert [bm.ref_count(b) for b in second.block_table] == [2, 2, 1]
    assert (bm.stats.lookups, bm.stats.hit_blocks, bm.stats.hit_tokens) == (2, 2, 8)


def test_blocks_are_hashed_only_after_they_are_computed():
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = make_seq(1, range(9))
    bm.allocate(first)
    second = make_seq(2, range(9))
    bm.allocate(second)
    assert second.num_cached_tokens == 0
    first.num_computed_tokens = 4  # one chunk: only the first block is done
    bm.mark_computed(first)
    third = make_seq(3, range(9))
    bm.allocate(third)
    assert third.num_cached_tokens == 4
    assert third.block_table[0] == first.block_table[0]


def test_partial_last_block_is_never_cached():
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = make_seq(1, range(6))
    bm.allocate(first)
    compute_all(bm, first)
    assert bm.num_cached_blocks == 1


def test_a_full_hit_still_leaves_one_token_to_compute_in_a_private_block():
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = make_seq(1, range(8))
    bm.allocate(first)
    compute_all(bm, first)
    again = make_seq(2, range(8))
    bm.allocate(again)
    assert (again.num_computed_tokens, again.num_remaining) == (4, 4)
    assert again.block_table[0] == first.block_table[0]
    assert again.block_table[1] != first.block_table[1]
    assert bm.ref_count(again.block_table[1]) == 1


def test_one_token_over_a_cached_prefix_computes_only_that_token():
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = make_seq(1, range(8))
    bm.allocate(first)
    compute_all(bm, first)
    longer = make_seq(2, [*range(8), 99])
    bm.allocate(longer)
    assert longer.num_remaining == 1


def test_different_adapter_slots_do_not_share_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    base = make_seq(1, range(9))
    bm.allocate(base)
    compute_all(bm, base)
    lora = make_seq(2, range(9), adapter_slot=1)
    bm.allocate(lora)
    assert lora.num_cached_tokens == 0


def test_prefix_is_chained_so_equal_blocks_after_different_prefixes_do_not_hit():
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = make_seq(1, [1, 1, 1, 1, 5, 5, 5, 5, 0])
    bm.allocate(first)
    compute_all(bm, first)
    second = make_seq(2, [2, 2, 2, 2, 5, 5, 5, 5, 0])
    bm.allocate(second)
    assert second.num_cached_tokens == 0


def test_freed_blocks_stay_reusable_until_handed_out_again():
    bm = BlockManager(num_blocks=4, block_size=BS)
    first = make_seq(1, range(9))
    bm.allocate(first)
    compute_all(bm, first)
    bm.free(first)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    again = make_seq(2, range(9))
    assert bm.can_allocate(again)
    bm.allocate(again)
    assert again.num_cached_tokens == 8
    assert bm.num_free_blocks == 1


def test_unhashed_free_blocks_are_handed_out_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=BS)
    cached = make_seq(1, range(8))
    bm.allocate(cached)
    compute_all(bm, cached)
    cached_blocks = set(cached.block_table)
    bm.free(cached)
    other = make_seq(2, range(50, 58))
    bm.allocate(other)  # two fresh blocks: the never-used ones, not the cached ones
    assert set(other.block_table).isdisjoint(cached_blocks)
    assert bm.num_cached_blocks == 2


def test_handing_out_a_cached_block_evicts_its_hash():
    bm = BlockManager(num_blocks=2, block_size=BS)
    first = make_seq(1, range(8))
    bm.allocate(first)
    compute_all(bm, first)
    bm.free(first)
    other = make_seq(2, range(50, 54))
    bm.allocate(other)
    assert bm.num_cached_blocks == 1
    bm.free(other)
    # The tail block went first; the chain's first block survives and still hits.
    again = make_seq(3, range(8))
    bm.allocate(again)
    assert again.num_cached_tokens == 4


def test_can_allocate_counts_free_cached_hits_as_taken():
    bm = BlockManager(num_blocks=3, block_size=BS)
    first = make_seq(1, range(9))
    bm.allocate(first)
    compute_all(bm, first)
    bm.free(first)
    # 2 cached hits (free, on the list) + 2 fresh blocks = 4 > 3 blocks in the pool.
    assert not bm.can_allocate(make_seq(2, [*range(8), 1, 2, 3, 4, 5]))
    assert bm.can_allocate(make_seq(3, [*range(8), 1, 2, 3, 4]))


def test_append_grows_the_table_for_a_decode_token():
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(1, range(4))
    bm.allocate(seq)
    compute_all(bm, seq)
    seq.append_token(42)
    assert bm.can_append(seq, 1)
    bm.append(seq, 1)
    assert len(seq.block_table) == 2
    bm.append(seq, 1)  # already room: no new block
    assert len(seq.block_table) == 2


def test_can_append_is_false_when_the_pool_is_full():
    bm = BlockManager(num_blocks=1, block_size=BS)
    seq = make_seq(1, range(4))
    bm.allocate(seq)
    seq.num_computed_tokens = 4
    assert not bm.can_append(seq, 1)
    with pytest.raises(RuntimeError):
        bm.append(seq, 1)


def test_shared_block_is_freed_only_when_its_last_user_frees_it():
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = make_seq(1, range(9))
    bm.allocate(first)
    compute_all(bm, first)
    second = make_seq(2, range(9))
    bm.allocate(second)
    shared = first.block_table[0]
    bm.free(first)
    assert bm.ref_count(shared) == 1
    bm.free(second)
    assert bm.ref_count(shared) == 0
    assert bm.num_free_blocks == 8


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    first = make_seq(1, range(9))
    bm.allocate(first)
    compute_all(bm, first)
    second = make_seq(2, range(9))
    bm.allocate(second)
    assert second.num_cached_tokens == 0
    assert bm.stats.lookups == 0


def test_reset_prefix_cache_forgets_every_prefix():
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = make_seq(1, range(9))
    bm.allocate(first)
    compute_all(bm, first)
    bm.reset_prefix_cache()
    first.append_token(1)
    first.append_token(2)
    first.append_token(3)
    compute_all(bm, first)  # computed before the reset: not registered afterwards either
    assert bm.num_cached_blocks == 0
    second = make_seq(2, range(9))
    bm.allocate(second)
    assert second.num_cached_tokens == 0
