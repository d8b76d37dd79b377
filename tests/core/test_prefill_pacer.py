"""Pacing prompt chunks by measured step times: a step that carries decodes aims at the ITL target on
whatever machine runs it; until both rates are measured the fixed price stands."""

import pytest

from kiln.core.block_manager import BlockManager
from kiln.core.prefill_cost import MIN_CHUNK, chunk_cost, tokens_within
from kiln.core.prefill_pacer import (
    AUTO_BOUND_MS,
    AUTO_TARGET_MS,
    DECODE_MULTIPLE,
    MIN_SAMPLE_PRICE,
    PREFILL_SHARE_MS,
    QUEUE_AIM_MS,
    QUEUE_FIXED_MULTIPLE,
    QUEUE_MIN,
    QUEUE_MULTIPLE,
    ItlPacing,
    PrefillPacer,
    auto_itl_pacing,
)
from kiln.core.sampling import SamplingParams
from kiln.core.scheduler import Scheduler
from kiln.core.sequence import Sequence


def _measured(decode_ms: float, ms_per_price: float, target_ms: float = 120.0) -> PrefillPacer:
    """A pacer that has seen decode-only steps of one size take `decode_ms`, and prefill alone cost
    `ms_per_price` per unit of price."""
    pacer = PrefillPacer(target_ms)
    pacer.observe(1, 0.0, decode_ms)
    pacer.observe(0, 100.0, 100.0 * ms_per_price)
    return pacer


def test_until_both_lines_have_data_the_pacer_has_no_budget():
    pacer = PrefillPacer(120.0)
    assert pacer.price_budget(8) is None
    pacer.observe(0, 200.0, 400.0)          # a prefill alone: 2 ms per unit
    assert pacer.price_budget(8) is None
    pacer.observe(8, 0.0, 20.0)             # decodes alone: the decode step
    assert pacer.price_budget(8) == pytest.approx((120.0 - 20.0) / 2.0)


def test_a_slower_machine_gets_a_smaller_price_budget_for_the_same_target():
    fast, slow = _measured(10.0, 1.0), _measured(20.0, 2.5)
    assert fast.price_budget(1) == pytest.approx(110.0)
    assert slow.price_budget(1) == pytest.approx(40.0)


def test_decode_steps_are_fitted_as_a_line_in_their_rows():
    pacer = PrefillPacer(120.0)
    for rows in (1, 8, 16, 1, 8, 16):
        pacer.observe(rows, 0.0, 5.0 + 2.5 * rows)
    assert pacer.decode_ms(32) == pytest.approx(85.0)
    assert pacer.decode_ms(4) == pytest.approx(15.0)


def _with_fixed_cost(target_ms: float, fixed_ms: float, ms_per_price: float) -> PrefillPacer:
    """Decodes of 4 rows take 20 ms; a chunk adds `fixed_ms` plus `ms_per_price` per unit."""
    pacer = PrefillPacer(target_ms)
    pacer.observe(4, 0.0, 20.0)
    for price in (20.0, 60.0, 20.0, 60.0):
        pacer.observe(4, price, 20.0 + fixed_ms + ms_per_price * price)
    return pacer


def test_a_mixed_steps_prefill_share_is_a_fixed_cost_plus_a_rate_beyond_its_decodes():
    pacer = _with_fixed_cost(120.0, 40.0, 1.5)
    assert pacer.prefill_ms(100.0) == pytest.approx(190.0)
    # the step aims at 120 ms: 20 of decodes, 40 fixed, 60 / 1.5 = 40 units of price
    assert pacer.price_budget(4) == pytest.approx(40.0)


def test_a_chunk_is_never_so_small_that_the_fixed_cost_is_most_of_its_share():
    pacer = _with_fixed_cost(60.0, 40.0, 1.0)
    assert pacer.price_budget(4) == pytest.approx(40.0)      # not (60 - 20 - 40) / 1 = 0


def test_steps_too_small_to_tell_from_noise_teach_nothing():
    pacer = _measured(20.0, 1.0)
    pacer.observe(1, MIN_SAMPLE_PRICE / 2, 500.0)
    assert pacer.prefill_ms(100.0) == pytest.approx(100.0)


def test_a_mixed_step_before_any_decode_only_step_teaches_nothing():
    pacer = PrefillPacer(120.0)
    pacer.observe(8, 50.0, 200.0)
    assert pacer.prefill_ms(50.0) is None


def test_many_decoding_streams_let_prompts_in_at_a_multiple_of_their_step():
    pacer = PrefillPacer(50.0)
    for rows in (1, 32):
        pacer.observe(rows, 0.0, 2.0 * rows)
    pacer.observe(0, 100.0, 100.0)
    assert DECODE_MULTIPLE == 2.5
    assert pacer.price_budget(32) == pytest.approx(96.0)    # a 160 ms step: 2.5 times 64 ms
    assert pacer.price_budget(1) == pytest.approx(48.0)


def test_where_decodes_alone_are_slow_a_prompt_adds_at_most_the_prefill_share():
    # a 1B model: 8 decodes take 115 ms, and 2.5x that would be a 290 ms gap
    pacer = PrefillPacer(AUTO_TARGET_MS)
    pacer.observe(8, 0.0, 115.0)
    pacer.observe(0, 100.0, 300.0)
    assert pacer.step_ms(115.0) == pytest.approx(115.0 + PREFILL_SHARE_MS)
    assert pacer.price_budget(8) == pytest.approx(PREFILL_SHARE_MS / 3.0)


def test_a_paced_step_stays_under_three_times_its_decodes_alone_above_the_target():
    # the bench's case on the AMD EPYC: 8 decodes take 28 ms, so 2.5x that is above the 50 ms floor
    pacer = PrefillPacer(AUTO_TARGET_MS)
    pacer.observe(8, 0.0, 28.0)
    pacer.observe(0, 100.0, 100.0)
    step_ms = 28.0 + pacer.prefill_ms(pacer.price_budget(8))
    assert step_ms == pytest.approx(2.5 * 28.0)
    assert step_ms < 3 * 28.0


def test_a_target_must_be_positive():
    with pytest.raises(ValueError):
        PrefillPacer(0.0)


# ---- the scheduler under a pacer ----------------------------------------------------------------

def _seq(seq_id, n_prompt, max_tokens=8):
    return Sequence(seq_id=seq_id, prompt_token_ids=list(range(1, n_prompt + 1)),
                    params=SamplingParams(max_tokens=max_tokens), arrival_time=float(seq_id))


def _decoding(pacer: PrefillPacer | None, price: int = 64) -> Scheduler:
    sched = Scheduler(BlockManager(400, 16, True), max_num_seqs=8, max_batch_tokens=512,
                      prefill_cost_with_decodes=price, pacer=pacer)
    decoder = _seq(1, 8, max_tokens=1000)
    sched.add(decoder)
    while decoder.num_remaining != 1:
        out = sched.schedule()
        sched.on_step_done(out, {i.seq.seq_id: 7 for i in out.items if i.sample})
    return sched


def _prefilled(out) -> list[int]:
    return [i.num_new_tokens for i in out.items if i.is_prefill]


def test_a_measured_pacer_meters_a_short_prompt_too():
    sched = _decoding(_measured(20.0, 2.0))          # (120 - 20) / 2 = 50 units
    sched.add(_seq(2, 300))
    assert _prefilled(sched.schedule()) == [tokens_within(0, 300, 50.0)]


def test_without_measurements_the_fixed_price_rules_and_short_prompts_go_whole():
    sched = _decoding(PrefillPacer(120.0))
    sched.add(_seq(2, 300))
    assert _prefilled(sched.schedule()) == [300]


def test_paced_chunks_of_a_long_prompt_shrink_as_its_attention_deepens():
    sched = _decoding(_measured(20.0, 1.0))
    sched.add(_seq(2, 3000))
    chunks = []
    for _ in range(8):
        out = sched.schedule()
        chunks.extend(_prefilled(out))
        sched.on_step_done(out, {i.seq.seq_id: 7 for i in out.items if i.sample})
    assert chunks[0] == tokens_within(0, 511, 100.0)
    assert all(a >= b >= MIN_CHUNK for a, b in zip(chunks, chunks[1:], strict=False))


def test_several_short_prompts_share_one_steps_paced_price():
    sched = _decoding(_measured(20.0, 1.0))         # a queue: min(2 x 120, 250) - 20 = 220 units
    for i in range(2, 9):
        sched.add(_seq(i, 40))
    out = sched.schedule()
    assert sum(chunk_cost(0, n) for n in _prefilled(out)) <= 220.0 + 1e-9
    assert _prefilled(out) == [40] * 5 + [tokens_within(0, 40, 220.0 - 5 * chunk_cost(0, 40))]


def test_a_queue_of_prompts_lets_a_step_aim_higher_up_to_the_queue_bound():
    pacer = _measured(40.0, 2.0, target_ms=150.0)    # 1 decode alone: 40 ms; its usual aim 150 ms
    assert QUEUE_MIN == 2 and QUEUE_MULTIPLE == 2.0 and QUEUE_FIXED_MULTIPLE * 40.0 < QUEUE_AIM_MS
    assert pacer.step_ms(40.0, queued=1) == pytest.approx(150.0)
    assert pacer.step_ms(40.0, queued=2) == pytest.approx(QUEUE_AIM_MS)     # not 300 ms
    assert pacer.step_ms(40.0, queued=30) == pytest.approx(QUEUE_AIM_MS)
    assert pacer.price_budget(1, queued=7) == pytest.approx((QUEUE_AIM_MS - 40.0) / 2.0)
    small = _measured(10.0, 1.0, target_ms=50.0)     # a fast machine: twice its aim, under the bound
    assert small.step_ms(10.0, queued=4) == pytest.approx(100.0)


def test_a_queue_never_lowers_the_aim():
    pacer = PrefillPacer(150.0)
    pacer.observe(1, 0.0, 30.0)
    pacer.observe(8, 0.0, 200.0)                     # 8 decodes alone near the bound: aim 300 ms
    assert pacer.step_ms(200.0, queued=8) == pacer.step_ms(200.0) == pytest.approx(300.0)


def test_where_steps_cost_much_before_their_rows_a_queue_aims_at_several_times_that_cost():
    pacer = PrefillPacer(150.0)                      # a big model: a one-decode step takes 70 ms
    pacer.observe(1, 0.0, 70.0)
    pacer.observe(6, 0.0, 145.0)
    assert pacer.fixed_ms() == pytest.approx(70.0)
    assert pacer.step_ms(70.0, queued=1) == pytest.approx(170.0)     # a lone arrival: the usual aim
    assert pacer.step_ms(70.0, queued=4) == pytest.approx(QUEUE_FIXED_MULTIPLE * 70.0)   # over the 250 ms bound


def test_the_fixed_cost_follows_one_decode_steps_alone():
    pacer = PrefillPacer(150.0)
    assert pacer.fixed_ms() == 0.0
    pacer.observe(8, 0.0, 100.0)                     # wider steps teach it nothing
    pacer.observe(1, 30.0, 200.0)                    # nor a step carrying a prompt
    assert pacer.fixed_ms() == 0.0
    pacer.observe(1, 0.0, 40.0)
    pacer.observe(1, 0.0, 20.0)
    assert pacer.fixed_ms() == pytest.approx(0.75 * 40.0 + 0.25 * 20.0)


def test_a_lone_prompt_arriving_among_streams_is_paced_at_the_usual_aim():
    sched = _decoding(_measured(20.0, 2.0))          # (120 - 20) / 2 = 50 units
    sched.add(_seq(2, 3000))
    assert _prefilled(sched.schedule()) == [tokens_within(0, 511, 50.0)]


def test_prompts_admitted_with_prompt_left_still_count_as_queued():
    sched = _decoding(_measured(20.0, 2.0))
    sched.add(_seq(2, 3000))
    sched.add(_seq(3, 3000))
    out = sched.schedule()                           # a queue of two: (240 - 20) / 2 = 110 units
    assert sum(chunk_cost(0, n) for n in _prefilled(out)) == pytest.approx(110.0, abs=2.0)
    sched.on_step_done(out, {i.seq.seq_id: 7 for i in out.items if i.sample})
    assert sched.num_waiting == 1 and sched._queued() == 2


def test_a_step_without_decodes_is_not_paced():
    sched = Scheduler(BlockManager(400, 16, True), max_num_seqs=8, max_batch_tokens=512,
                      prefill_cost_with_decodes=64, pacer=_measured(20.0, 50.0))
    sched.add(_seq(1, 3000))
    assert _prefilled(sched.schedule()) == [512]


def test_observe_teaches_the_pacer_the_steps_decodes_price_and_time():
    pacer = PrefillPacer(120.0)
    sched = _decoding(pacer)
    out = sched.schedule()                           # the decoder alone
    assert (out.num_decodes, out.prefill_price) == (1, 0.0)
    sched.observe(out, 12.0)
    sched.on_step_done(out, {i.seq.seq_id: 7 for i in out.items if i.sample})
    assert pacer.decode_ms(1) == 12.0
    sched.add(_seq(2, 700))
    out = sched.schedule()
    assert out.prefill_price == pytest.approx(chunk_cost(0, _prefilled(out)[0]))
    sched.observe(out, 12.0 + out.prefill_price * 2.0)
    assert pacer.prefill_ms(10.0) == pytest.approx(20.0)


def _bounding(decode_ms: float, ms_per_price: float) -> Scheduler:
    """A decoding scheduler with the fixed price 64 and a pacer that only bounds it (aim 150 ms)."""
    return _decoding(_measured_bounding(decode_ms, ms_per_price), price=64)


def _measured_bounding(decode_ms: float, ms_per_price: float) -> PrefillPacer:
    """A bounding pacer (aim 150 ms) that has seen one decode take `decode_ms`, prefill `ms_per_price`."""
    pacer = PrefillPacer(150.0, below_fixed_price=True)
    pacer.observe(1, 0.0, decode_ms)
    pacer.observe(0, 100.0, 100.0 * ms_per_price)
    return pacer


def test_a_bounding_pacer_leaves_the_fixed_price_where_its_steps_fit_the_aim():
    sched = _bounding(20.0, 1.0)                    # the pacer would allow 130 units
    sched.add(_seq(2, 100))
    assert _prefilled(sched.schedule()) == [100]    # a short prompt goes whole, as under the fixed price
    sched = _bounding(20.0, 1.0)
    sched.add(_seq(2, 3000))
    assert _prefilled(sched.schedule()) == [tokens_within(0, 511, 64.0)]


def test_a_bounding_pacer_takes_over_where_the_fixed_price_runs_too_long():
    sched = _bounding(115.0, 4.0)                   # (215 - 115) / 4 = 25 units: below 64
    sched.add(_seq(2, 3000))
    assert _prefilled(sched.schedule()) == [tokens_within(0, 511, 25.0)]


def test_a_bounding_pacer_meters_a_short_prompt_where_it_takes_over():
    sched = _bounding(115.0, 4.0)
    sched.add(_seq(2, 100))
    assert _prefilled(sched.schedule()) == [tokens_within(0, 100, 25.0)]


def test_an_itl_pacing_of_zero_makes_no_pacer():
    assert ItlPacing(0.0).pacer() is None
    pacer = ItlPacing(150.0, below_fixed_price=True).pacer()
    assert pacer is not None and (pacer.target_ms, pacer.below_fixed_price) == (150.0, True)


def test_auto_paces_dense_bfloat16_on_the_avx2_and_scalar_kernels():
    assert auto_itl_pacing("cpu", "bfloat16", "none", "avx2") == ItlPacing(AUTO_TARGET_MS)
    assert auto_itl_pacing("cpu", "bfloat16", "none", "scalar") == ItlPacing(AUTO_TARGET_MS)


def test_auto_paces_gguf_blocks_with_float_activations_on_the_avx2_kernels():
    assert auto_itl_pacing("cpu", "float32", "gguf-float", "avx2") == ItlPacing(AUTO_TARGET_MS)
    assert auto_itl_pacing("cpu", "float32", "gguf-float", "scalar") == ItlPacing(AUTO_TARGET_MS)


def test_auto_bounds_the_fixed_price_by_time_elsewhere_on_a_cpu():
    bound = ItlPacing(AUTO_BOUND_MS, below_fixed_price=True)
    assert auto_itl_pacing("cpu", "float32", "gguf-float", "avx512") == bound
    assert auto_itl_pacing("cpu", "bfloat16", "none", "avx512") == bound
    assert auto_itl_pacing("cpu", "bfloat16", "gguf", "avx512") == bound   # a 1B Q4_K_M's default
    assert auto_itl_pacing("cpu", "bfloat16", "gguf", "avx2") == bound
    assert auto_itl_pacing("cpu", "float32", "none", "avx2") == bound
    assert auto_itl_pacing("cpu", "bfloat16", "none", None) == bound      # kernels disabled


def test_auto_keeps_the_fixed_price_alone_off_a_cpu():
    assert auto_itl_pacing("cuda:0", "bfloat16", "none", None) == ItlPacing(0.0)


def test_under_a_bounding_pacer_a_short_prompt_goes_whole_only_within_the_pacers_price():
    sched = _bounding(20.0, 1.0)                    # the fixed price stands; the pacer allows 130 units
    sched.add(_seq(2, 300))                         # whole, it would cost 344: a step far past the aim
    assert _prefilled(sched.schedule()) == [tokens_within(0, 300, 130.0)]
