"""The in-process engine eval generator on a tiny generated model (thinking template, real tokenizer)."""

from __future__ import annotations

import asyncio

import pytest

from kiln.config import Settings
from kiln.core.thinking_budget import resolve_budget
from kiln.engine.build import build_engine
from kiln.engine.eval_generator import LocalEngineGenerator
from kiln.evals.generator import GenerationRequest
from kiln.testing.schemas import validate
from kiln.testing.tiny import make_tiny_model

MSG = [{"role": "user", "content": "Tell me a story about the sea."}]


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("gen") / "tiny", arch="qwen3", init_std=0.3, thinking_prompt=True)
    settings = Settings()
    settings.model.path = str(path)
    settings.engine.kv_cache_memory_mb = 16
    engine = build_engine(settings)
    yield LocalEngineGenerator(engine, settings.server)
    engine.shutdown()


def generate(gen, *requests):
    return asyncio.run(gen.generate(list(requests)))


def request(seed=1, **kw):
    return GenerationRequest(messages=MSG, temperature=kw.pop("temperature", 1.0), max_tokens=kw.pop("max_tokens", 12),
                             seed=seed, **kw)


def test_the_same_seed_gives_the_same_bytes_and_another_seed_differs(generator):
    a, b, c = generate(generator, request(seed=1), request(seed=1), request(seed=2))
    assert a.error is None and a.text == b.text
    assert a.text != c.text
    assert 0 < a.completion_tokens <= 12 and a.prompt_tokens > 0


def test_a_batch_of_requests_all_complete(generator):
    results = generate(generator, *[request(seed=s, max_tokens=6) for s in range(10)])
    assert all(r.error is None and r.finish_reason in ("stop", "length") for r in results)


def test_a_thinking_prompt_is_reported_so_the_completion_can_reopen_it(generator):
    (result,) = generate(generator, request())
    assert result.prompt_starts_in_reasoning is True


def test_a_token_budget_applies_and_reports_its_outcome(generator):
    budget = resolve_budget({"thinking_budget_tokens": 0}, {}, scope="suite")
    (result,) = generate(generator, request(thinking_budget=budget, max_tokens=20))
    record = result.thinking_budget
    validate("thinking-budget-v1.schema.json", "record", record)
    assert (record["configured"], record["applied"], record["tokens_source"]) == (True, True, "suite")
    assert (record["triggered"], record["trigger"], record["closed"]) == (True, "tokens", True)
    assert result.text.startswith("</think>")  # budget 0 closes on the first decode step


def test_without_a_budget_the_record_is_unconfigured(generator):
    (result,) = generate(generator, request())
    assert result.thinking_budget["configured"] is False and result.thinking_budget["applied"] is False


def test_adapters_are_refused_until_lora_serving_exists(generator):
    (result,) = generate(generator, request(adapter="tuned"))
    assert result.error is not None and "adapter 'tuned'" in result.error
    assert result.finish_reason == "error"


def test_a_prompt_longer_than_the_context_fails_that_request_only(generator):
    long = [{"role": "user", "content": "sea " * 5000}]
    bad, good = generate(generator, GenerationRequest(messages=long, max_tokens=4), request())
    assert bad.error is not None and bad.error.startswith("prepare failed: ")
    assert good.error is None


def test_identity_hashes_the_weight_files_and_is_stable(generator):
    first = asyncio.run(generator.identity())
    names = [f["name"] for f in first.base_weight_manifest["files"]]
    assert "model.safetensors" in names and "config.json" in names
    assert all(f["sha256"].startswith("sha256:") for f in first.base_weight_manifest["files"])
    assert first.execution_provenance["engine"] == "kiln"
    fresh = LocalEngineGenerator(generator.engine, generator.server)
    assert asyncio.run(fresh.identity()).execution_provenance_sha256 == first.execution_provenance_sha256
