"""The batching actor's additions: requests submitted together start together, prompt scoring runs on
the actor between steps, and every token carries the timestamps the latency diagnostics need."""

from __future__ import annotations

import asyncio

import pytest

from kiln.config import DataSettings, EngineSettings, ModelSettings, Settings
from kiln.core.sampling import SamplingParams
from kiln.engine.actor import GenerationRequest


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from kiln.engine.build import build_engine
    from kiln.testing.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("actor")
    model = make_tiny_model(root / "m", arch="llama", init_std=0.3)
    eng = build_engine(Settings(model=ModelSettings(path=str(model), dtype="float32"),
                                        data=DataSettings(data_dir=str(root / "data")),
                                        engine=EngineSettings(kv_cache_memory_mb=8)))
    yield eng
    eng.shutdown()


def params(engine, n: int, seed: int, max_tokens: int = 4) -> list[SamplingParams]:
    return engine.choice_params(SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True), n)


def collect(engine, requests):
    async def run():
        out = []
        async for i, ev in engine.submit(requests):
            out.append((i, ev))
        return out
    return asyncio.run(run())


def test_requests_submitted_together_are_admitted_in_the_same_step(engine):
    prompts = [engine.encode_prompt(f"prompt number {i} about rivers") for i in range(3)]
    events = collect(engine, [GenerationRequest(p, params(engine, 1, i)) for i, p in enumerate(prompts)])
    finals = [ev for _, ev in events if ev.finish_reason is not None]
    assert len(finals) == 3
    assert len({ev.stats.admitted_at for ev in finals}) == 1


def test_events_of_each_request_keep_their_request_index(engine):
    prompts = [engine.encode_prompt("first"), engine.encode_prompt("second one")]
    events = collect(engine, [GenerationRequest(p, params(engine, 2, 9)) for p in prompts])
    counts = {(i, ev.index): 0 for i, ev in events}
    for i, ev in events:
        counts[(i, ev.index)] += len(ev.token_ids)
    assert counts == {(0, 0): 4, (0, 1): 4, (1, 0): 4, (1, 1): 4}


def test_every_token_event_is_timed_in_order(engine):
    events = collect(engine, [GenerationRequest(engine.encode_prompt("time me"), params(engine, 1, 3))])
    for _, ev in events:
        assert ev.step is not None
        assert ev.token_times[0] <= ev.delivered_at <= ev.received_at
    assert events[0][1].stats is not None  # the first token's timing needs queue and prefill times
    stats = events[-1][1].stats
    assert stats.submitted_at <= stats.received_at <= stats.admitted_at <= stats.first_token_at
    assert stats.prefill_ms > 0 and stats.decode_ms > 0
    assert events[0][1].step.had_prefill and not events[-1][1].step.had_prefill


def test_scoring_runs_on_the_actor_while_requests_generate(engine):
    async def run():
        gen = engine.generate(engine.encode_prompt("keep going"), params(engine, 1, 1, max_tokens=30))
        first = await gen.__anext__()
        scores = await engine.score(engine.encode_prompt("score this prompt"), 3)
        rest = [ev async for ev in gen]
        return first, scores, rest
    first, scores, rest = asyncio.run(run())
    assert len(scores.top_ids) == len(engine.encode_prompt("score this prompt")) - 1
    assert sum(len(e.token_ids) for e in [first, *rest]) == 30
    assert engine.stats().counters.prompts_scored >= 1


def test_scoring_errors_reach_the_caller(engine):
    with pytest.raises(Exception):  # noqa: B017 - the engine's own error type is not the point
        asyncio.run(engine.score([10**9], 1))


def test_an_auto_itl_target_bounds_the_fixed_prefill_price_by_time_for_a_float32_model(engine):
    assert EngineSettings().itl_target_ms == "auto"
    pacer = engine.actor.scheduler.pacer
    assert pacer is not None and pacer.below_fixed_price
    assert engine.actor.scheduler.prefill_cost_with_decodes == EngineSettings().prefill_cost_with_decodes


def test_with_an_itl_target_the_actor_paces_prompt_chunks_by_the_steps_it_ran(tmp_path):
    from kiln.engine.build import build_engine
    from kiln.testing.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "m", arch="llama", init_std=0.3)
    paced = build_engine(Settings(model=ModelSettings(path=str(model), dtype="float32"),
                                  data=DataSettings(data_dir=str(tmp_path / "data")),
                                  engine=EngineSettings(kv_cache_memory_mb=8, itl_target_ms=150)))
    try:
        pacer = paced.actor.scheduler.pacer
        assert pacer is not None and pacer.target_ms == 150
        collect(paced, [GenerationRequest(paced.encode_prompt("a prompt long enough to price " * 4),
                                          params(paced, 1, 5, max_tokens=6))])
        assert (pacer.decode_ms(1) or 0) > 0
        assert (pacer.prefill_ms(32.0) or 0) > 0
    finally:
        paced.shutdown()
