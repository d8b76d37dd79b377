"""One request path: a chat request and the eval-generator request that means the same thing give the
engine identical work (prompt ids, sampling per choice, thinking-budget controllers, adapter).

No weights are loaded: the real Engine facade stands over the tiny model's tokenizer and template."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kiln.api.wire.chat import ChatCompletionRequest
from kiln.config import ServerSettings
from kiln.core.thinking_budget import resolve_budget
from kiln.engine.chat_request import prepare_chat
from kiln.engine.eval_generator import LocalEngineGenerator
from kiln.engine.grammar import GrammarCounters
from kiln.evals.generator import GenerationRequest

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a sea."}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from kiln.engine.chat_template import ChatTemplate
    from kiln.engine.serving import Engine, ModelInfo
    from kiln.engine.tokenizer import Tokenizer
    from kiln.model.config import ModelConfig
    from kiln.testing.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("request-path") / "tiny", arch="qwen3", thinking_prompt=True)
    tok = Tokenizer.from_hf_dir(path)
    cfg = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    info = ModelInfo(str(path), "tiny", cfg, "hf", "float32", "cpu", 512, 32, 16, 0, {})
    template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
    runner = SimpleNamespace(backend="kiln-torch-cpu", grammar_counters=GrammarCounters())
    return Engine(info, tok, template, SimpleNamespace(runner=runner), None)


def controller_config(work) -> list[tuple] | None:
    if work.budgets is None:
        return None
    return [(c.close_ids, c.max_thinking_tokens, c.max_time_ms, c.max_completion_tokens) for c in work.budgets]


def engine_inputs(work) -> tuple:
    return (work.prompt_ids, work.params, controller_config(work), work.adapter)


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_and_eval_generator_requests_give_the_engine_the_same_work(engine, thinking):
    server = ServerSettings()
    chat = ChatCompletionRequest.model_validate({
        "messages": MESSAGES, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "max_tokens": 40,
        "stop": ["\n\n"], "seed": 1234, "chat_template_kwargs": {"enable_thinking": thinking},
        "thinking_budget_tokens": 8,
    })
    eval_req = GenerationRequest(messages=MESSAGES, temperature=0.7, top_p=0.9, top_k=20, max_tokens=40,
                                 stop=["\n\n"], seed=1234, chat_template_kwargs={"enable_thinking": thinking},
                                 thinking_budget=resolve_budget({"thinking_budget_tokens": 8}, server))
    from_chat = prepare_chat(engine.prompt_context(), chat.to_input(), server).work()
    from_eval = LocalEngineGenerator(engine, server).prepare(eval_req, None).work()
    assert engine_inputs(from_chat) == engine_inputs(from_eval)
    assert (controller_config(from_chat) is not None) == thinking


def test_a_chat_request_and_an_eval_request_overflow_the_context_with_one_error(engine):
    server = ServerSettings()
    long = [{"role": "user", "content": "sea " * 600}]
    from kiln.errors import KilnError

    with pytest.raises(KilnError) as chat_err:
        prepare_chat(engine.prompt_context(), ChatCompletionRequest.model_validate({"messages": long, "max_tokens": 256}).to_input(),
                     server)
    with pytest.raises(KilnError) as eval_err:
        LocalEngineGenerator(engine, server).prepare(GenerationRequest(messages=long), None)
    assert chat_err.value.code == eval_err.value.code == "context_length_exceeded"
    assert chat_err.value.message == eval_err.value.message
