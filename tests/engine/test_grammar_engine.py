"""Output grammars in the engine on the tiny model: constrained rows parse and validate, their batch-mates
keep their bytes, refusals are 400s naming the field, and a failing grammar fails its own choice only."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from kiln.config import DataSettings, EngineSettings, ModelSettings, Settings
from kiln.core.output_grammar import choice_grammar, json_schema_grammar, lark_grammar, regex_grammar
from kiln.core.sampling import SamplingParams
from kiln.core.tool_calls import extract_tool_calls
from kiln.core.tool_grammar import tool_grammar
from kiln.engine.actor import GenerationRequest
from kiln.engine.grammar import GrammarCompiler, GrammarRefusal
from kiln.errors import KilnError
from kiln.model.sampler import Sampler, apply_token_masks

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from kiln.engine.build import build_engine
    from kiln.testing.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("grammar")
    model = make_tiny_model(root / "m", arch="llama", init_std=0.3)
    eng = build_engine(Settings(model=ModelSettings(path=str(model), dtype="float32"),
                                data=DataSettings(data_dir=str(root / "data")),
                                engine=EngineSettings(kv_cache_memory_mb=8)))
    yield eng
    eng.shutdown()


def run(engine, requests):
    async def go():
        out: dict[tuple[int, int], dict] = {}
        async for i, ev in engine.submit(requests):
            o = out.setdefault((i, ev.index), {"text": "", "ids": [], "finish": None, "error": None})
            o["text"] += ev.text
            o["ids"] += ev.token_ids
            if ev.finish_reason is not None:
                o["finish"], o["error"] = ev.finish_reason, ev.error
        return out
    return asyncio.run(go())


def params(engine, n=1, *, seed=1, temperature=1.0, max_tokens=80):
    return engine.choice_params(SamplingParams(max_tokens=max_tokens, seed=seed, temperature=temperature), n)


def compiled(engine, spec):
    return engine.grammars.compile(spec, code="chat_invalid_request")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_constrained_choice_parses_and_validates(engine, temperature):
    g = compiled(engine, json_schema_grammar(SCHEMA, kind="json_schema", param="json_schema"))
    prompt = engine.encode_prompt("Question: who wrote it? Answer:")
    out = run(engine, [GenerationRequest(prompt, params(engine, 3, temperature=temperature), grammar=g)])
    assert len(out) == 3
    for o in out.values():
        assert o["finish"] == "stop", o
        jsonschema.validate(json.loads(o["text"]), SCHEMA)


def test_json_output_uses_json_dumps_spacing_only(engine):
    g = compiled(engine, json_schema_grammar({"type": "object"}, kind="json_object", param="response_format"))
    out = run(engine, [GenerationRequest(engine.encode_prompt("Tell me"), params(engine, 2, max_tokens=60),
                                         grammar=g)])
    for o in out.values():
        assert "\n" not in o["text"] and "  " not in o["text"]
        if o["finish"] == "stop":
            assert isinstance(json.loads(o["text"]), dict)


def test_unconstrained_batch_mates_keep_their_exact_tokens(engine):
    prompt_a = engine.encode_prompt("Question: How many days are there in a week? Answer:")
    prompt_b = engine.encode_prompt("Tell me about rivers")
    g = compiled(engine, json_schema_grammar(SCHEMA, kind="json_schema", param="json_schema"))
    for temperature in (0.0, 1.0):
        free = GenerationRequest(prompt_b, params(engine, 1, seed=7, temperature=temperature, max_tokens=24))
        plain = run(engine, [GenerationRequest(prompt_a, params(engine, 2, seed=3, temperature=temperature)), free])
        free = GenerationRequest(prompt_b, params(engine, 1, seed=7, temperature=temperature, max_tokens=24))
        mixed = run(engine, [GenerationRequest(prompt_a, params(engine, 2, seed=3, temperature=temperature),
                                               grammar=g), free])
        assert mixed[(1, 0)]["ids"] == plain[(1, 0)]["ids"]
        assert mixed[(0, 0)]["ids"] != plain[(0, 0)]["ids"]   # the constraint did change its own row


def test_choice_and_regex_grammars(engine):
    choice = compiled(engine, choice_grammar(["yes", "no", "maybe later"], param="guided_choice"))
    regex = compiled(engine, regex_grammar(r"[0-9]{3}-[a-z]{2,4}", param="guided_regex"))
    prompt = engine.encode_prompt("Answer:")
    out = run(engine, [GenerationRequest(prompt, params(engine, 4, seed=5), grammar=choice),
                       GenerationRequest(prompt, params(engine, 4, seed=6), grammar=regex)])
    for (i, _), o in out.items():
        assert o["finish"] == "stop"
        if i == 0:
            assert o["text"] in ("yes", "no", "maybe later")
        else:
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", o["text"]), o["text"]


def test_forced_tool_call_is_a_parsable_call_with_valid_arguments(engine):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}}}]
    g = compiled(engine, tool_grammar(tools, "required", False, code="x", tag_ids=engine.tool_tag_ids))
    out = run(engine, [GenerationRequest(engine.encode_prompt("weather?"), params(engine, 2, max_tokens=60),
                                         grammar=g)])
    for o in out.values():
        assert o["finish"] == "stop", o
        calls = extract_tool_calls(o["text"], tools)
        assert [c.name for c in calls] == ["get_weather"]
        jsonschema.validate(calls[0].arguments, tools[0]["function"]["parameters"])


def test_a_failing_grammar_fails_its_own_choice_and_not_the_batch(engine):
    g = compiled(engine, json_schema_grammar(SCHEMA, kind="json_schema", param="json_schema"))
    broken = engine.grammars.compile(lark_grammar('start: "x"', kind="grammar", param="grammar"), code="c")
    x = engine.tokenizer.encode("x")[0]
    # a matcher already in llguidance's error state (it consumed a token its grammar forbids twice)
    broken.matcher = broken.matcher.deep_copy()
    broken.matcher.consume_token(x)
    broken.matcher.consume_token(x)
    assert broken.matcher.is_error()
    prompt = engine.encode_prompt("Answer:")
    out = run(engine, [GenerationRequest(prompt, params(engine, 1), grammar=broken),
                       GenerationRequest(prompt, params(engine, 1), grammar=g),
                       GenerationRequest(prompt, params(engine, 1, max_tokens=10))])
    assert out[(0, 0)]["finish"] == "error" and "grammar" in out[(0, 0)]["error"]
    assert out[(1, 0)]["finish"] == "stop"
    assert out[(2, 0)]["finish"] == "length" and len(out[(2, 0)]["ids"]) == 10


def test_a_thinking_prompts_grammar_starts_after_the_reasoning_closes(engine):
    g = compiled(engine, choice_grammar(["yes"], param="guided_choice"))
    close = engine.close_think_ids
    state = g.start(close)
    assert not state.wants_mask
    for token in engine.tokenizer.encode("some thoughts") + close:
        state.advance(token)
    assert state.wants_mask and state.error is None
    for token in engine.tokenizer.encode("yes"):
        state.advance(token)
    assert state.done


@pytest.mark.parametrize(("schema", "reason"), [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "unresolvable_ref"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "unsatisfiable"),
    ({"type": "string", "format": "not-a-format"}, "unsupported_feature"),
    ({"not": {"enum": ["a"]}, "x-guidance": {"lenient": True}}, "unsupported_feature"),
])
def test_schemas_llguidance_cannot_enforce_are_400s_naming_the_field(engine, schema, reason):
    with pytest.raises(GrammarRefusal) as e:
        compiled(engine, json_schema_grammar(schema, kind="json_schema", param="response_format.json_schema.schema"))
    assert isinstance(e.value, KilnError) and e.value.status == 400
    assert e.value.param == "response_format.json_schema.schema" and e.value.reason == reason


# thousands of numeric ranges: inside every compile limit, and seconds of compile
PATHOLOGICAL = {"type": "array", "maxItems": 2000,
                "prefixItems": [{"type": "integer", "minimum": i * 7919, "maximum": i * 104729 + 13} for i in range(2000)]}


def test_a_grammar_that_compiles_past_the_deadline_is_a_400_naming_the_field(engine):
    compiler = GrammarCompiler(engine.grammars.tokenizer, engine.grammars.vocab_size, timeout_s=0.05)
    spec = json_schema_grammar(PATHOLOGICAL, kind="json_schema", param="response_format.json_schema.schema")
    for _ in range(2):   # the second time without compiling again: the grammar is remembered
        with pytest.raises(GrammarRefusal) as e:
            compiler.compile(spec, code="chat_invalid_request")
        assert e.value.status == 400 and e.value.reason == "timeout"
        assert e.value.param == "response_format.json_schema.schema" and "did not compile within" in e.value.message
    assert compiler.counters.compiles == 0


def test_a_lark_grammar_that_does_not_compile_is_a_400(engine):
    with pytest.raises(GrammarRefusal) as e:
        compiled(engine, lark_grammar('start: "a" undefined_rule', kind="grammar", param="grammar"))
    assert e.value.param == "grammar" and "undefined_rule" in e.value.message


def test_compiled_grammars_are_cached_by_their_text(engine):
    spec = json_schema_grammar({"type": "object", "properties": {"q": {"type": "boolean"}}}, kind="json_schema",
                               param="json_schema")
    before = engine.grammars.counters.cache_hits
    first = compiled(engine, spec)
    again = compiled(engine, json_schema_grammar({"type": "object", "properties": {"q": {"type": "boolean"}}},
                                                 kind="json_schema", param="json_schema"))
    assert again.matcher is first.matcher and engine.grammars.counters.cache_hits == before + 1


def test_token_masks_leave_other_rows_bit_exact():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    original = logits.clone()
    mask = torch.zeros(1, 3, dtype=torch.int32)
    mask[0, 0] = 0b1010    # tokens 1 and 3 only
    out = apply_token_masks(logits, [1], mask)
    assert torch.equal(out[0], original[0]) and torch.equal(out[2], original[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed == [1, 3]


def test_the_sampler_picks_only_allowed_tokens_for_a_masked_row():
    logits = torch.randn(2, 64)
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 1] = 1 << 5    # token 37 only
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    tokens, logprobs = Sampler()(logits, [SamplingParams(temperature=1.0)] * 2, [[], []], gens, ([0], mask))
    assert tokens[0].item() == 37 and abs(logprobs[0].item()) < 1e-6
