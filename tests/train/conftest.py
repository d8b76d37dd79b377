"""A tiny llama model loaded in-process, and the engine-shaped view of it that planning reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.engine.chat_template import ChatTemplate
from kiln.engine.tokenizer import Tokenizer
from kiln.model.loader import load_model
from kiln.testing.stand_in import StandInEngine
from kiln.testing.tiny import make_tiny_model

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("train-tiny") / "m", arch="llama", init_std=0.3)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_dir)


@pytest.fixture(scope="session")
def qwen_template(tokenizer) -> ChatTemplate:
    return ChatTemplate(tokenizer.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)


@pytest.fixture(scope="session")
def chatml(tokenizer) -> ChatTemplate:
    return ChatTemplate(CHATML, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)


@pytest.fixture
def tiny_model(tiny_dir):
    model, _ = load_model(str(tiny_dir), dtype="float32")
    return model


@pytest.fixture
def engine_view(tokenizer, qwen_template):
    """What planning needs from the serving Engine: the tokenizer and the chat template."""
    return StandInEngine(tokenizer=tokenizer, template=qwen_template)
