from pathlib import Path

import pytest

from kiln.bench.prompts import PromptFactory, deterministic_words, text_with_tokens
from kiln.testing.tiny import make_tiny_model, tiny_tokenizer


class _Bpe:
    """The tiny models' byte-level BPE, with the `encode(text) -> ids` shape the factory expects."""

    def __init__(self) -> None:
        self.backend = tiny_tokenizer()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids


@pytest.fixture(scope="module")
def bpe() -> _Bpe:
    return _Bpe()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bench-tiny") / "tiny", arch="llama")


def test_same_seed_gives_the_same_words():
    assert deterministic_words(5, 40) == deterministic_words(5, 40)


def test_different_seeds_differ_from_the_first_words():
    assert deterministic_words(1, 3) != deterministic_words(2, 3)


@pytest.mark.parametrize("n", [1, 7, 100, 500, 2000])
def test_text_encodes_to_exactly_the_requested_token_count(bpe, n):
    def count(text: str) -> int:
        return len(bpe.encode(text))

    assert count(text_with_tokens(count, n, seed=3)) == n


def test_zero_tokens_is_empty_text(bpe):
    assert text_with_tokens(lambda t: len(bpe.encode(t)), 0, seed=3) == ""


def test_chat_prompt_counts_the_rendered_template(tiny_dir):
    factory = PromptFactory.for_model(str(tiny_dir))
    prompt = factory.chat(120, seed=9)
    assert prompt.num_tokens == 120
    assert prompt.prompt_ids == factory.tokenizer.encode(factory.render(prompt.messages))


def test_chat_prompts_with_different_seeds_diverge_within_the_first_cache_block(tiny_dir):
    factory = PromptFactory.for_model(str(tiny_dir))
    a, b = factory.chat(100, seed=1).prompt_ids, factory.chat(100, seed=2).prompt_ids
    first_diff = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert first_diff < 16


def test_chat_prompt_is_reproducible(tiny_dir):
    factory = PromptFactory.for_model(str(tiny_dir))
    assert factory.chat(64, seed=4) == factory.chat(64, seed=4)
