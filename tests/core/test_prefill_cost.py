"""Prefill pricing while decodes share a step: deeper chunks cost more, so they are shorter."""

from kiln.core.block_manager import BlockManager
from kiln.core.prefill_cost import ATTENTION_SPAN, MIN_CHUNK, chunk_cost, tokens_within
from kiln.core.sampling import SamplingParams
from kiln.core.scheduler import Scheduler
from kiln.core.sequence import Sequence


def test_a_chunk_costs_its_tokens_plus_their_attention_to_earlier_positions():
    assert chunk_cost(0, 1) == 1
    assert chunk_cost(0, 4) == 4 + 6 / ATTENTION_SPAN          # positions 0..3 see 0+1+2+3 earlier ones
    assert chunk_cost(ATTENTION_SPAN, 1) == 2                   # one span deep: twice the price


def test_tokens_within_is_the_longest_chunk_that_fits():
    n = tokens_within(1000, 512, 64.0)
    assert chunk_cost(1000, n) <= 64 < chunk_cost(1000, n + 1)
    assert tokens_within(0, 512, 64.0) > n                      # the same price buys more at the start
    assert tokens_within(0, 10, 1e9) == 10                      # never past the limit
    assert tokens_within(0, 10, 0.5) == 0


def _seq(seq_id, n_prompt, max_tokens=8):
    return Sequence(seq_id=seq_id, prompt_token_ids=list(range(1, n_prompt + 1)),
                    params=SamplingParams(max_tokens=max_tokens), arrival_time=float(seq_id))


def _run_until_decoding(sched, seq):
    while seq.num_remaining != 1:
        out = sched.schedule()
        sched.on_step_done(out, {i.seq.seq_id: 7 for i in out.items if i.sample})


def _scheduler(price: int) -> Scheduler:
    return Scheduler(BlockManager(400, 16, True), max_num_seqs=4, max_batch_tokens=512, prefill_cost_with_decodes=price)


def _with_a_decoder(price: int) -> tuple[Scheduler, Sequence]:
    """A scheduler whose one running sequence is decoding."""
    sched, decoder = _scheduler(price), _seq(1, 8, max_tokens=1000)
    sched.add(decoder)
    _run_until_decoding(sched, decoder)
    return sched, decoder


def test_with_decodes_running_a_long_prompt_arrives_in_priced_chunks():
    sched, decoder = _with_a_decoder(64)
    sched.add(_seq(2, 3000))
    chunks = []
    for _ in range(6):
        out = sched.schedule()
        chunks.append(max(i.num_new_tokens for i in out.items))
        assert any(i.seq is decoder and i.num_new_tokens == 1 for i in out.items)
        sched.on_step_done(out, {i.seq.seq_id: 7 for i in out.items if i.sample})
    assert chunks[0] == tokens_within(0, 512, 64.0)
    assert all(a >= b for a, b in zip(chunks, chunks[1:], strict=False))   # deeper: shorter
    assert chunks[-1] >= MIN_CHUNK


def test_without_decodes_the_whole_token_budget_goes_to_the_prompt():
    sched = _scheduler(64)
    sched.add(_seq(1, 3000))
    assert sched.schedule().items[0].num_new_tokens == 512


def test_a_zero_price_turns_the_cap_off():
    sched, _ = _with_a_decoder(0)
    sched.add(_seq(2, 3000))
    assert max(i.num_new_tokens for i in sched.schedule().items) == 511


def test_a_prompt_that_fits_one_step_is_not_metered():
    sched, _ = _with_a_decoder(64)
    sched.add(_seq(2, 300))
    assert max(i.num_new_tokens for i in sched.schedule().items) == 300
