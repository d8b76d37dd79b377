"""Deterministic prompts of a target length, counted with the model's own tokenizer.

Each seed gives different text from its first words on, so no two benchmark requests share a
prefix that a prefix cache (Kiln's or llama.cpp's) could reuse: every prompt is really prefilled.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

_VOCABULARY = (
    "the river city morning light quiet market baker bread window garden street old new small large "
    "train station ticket journey mountain valley forest path stone bridge water cold warm summer winter "
    "people walk slowly quickly together alone every evening before after during because while although "
    "teacher student book letter story history science music painting theatre museum library school "
    "build carry find follow remember explain describe notice discover imagine answer question reason "
    "clock table chair lamp door road field farm animal horse bird fish tree flower leaf cloud rain snow "
    "wind sun moon star north south east west second third first last bright dark gentle careful simple"
)
_WORDS = tuple(_VOCABULARY.split())
_PAD_CANDIDATES = (" the", " a", " and", ".", ",", " of", " to")


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


@dataclass(frozen=True)
class BenchPrompt:
    seed: int
    messages: list[dict[str, Any]]
    prompt_ids: list[int]        # what the server computes: the rendered chat template, tokenized
    extra: dict[str, Any] = field(default_factory=dict)   # request fields of this prompt only (e.g. adapter)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)


def deterministic_words(seed: int, count: int) -> list[str]:
    """Sentence-like word salad: the same seed always gives the same words."""
    rng = random.Random(seed)
    words: list[str] = []
    sentence = 0
    while len(words) < count:
        if sentence == 0:
            sentence = rng.randint(6, 14)
            words.append(rng.choice(_WORDS).capitalize())
        else:
            words.append(rng.choice(_WORDS))
        sentence -= 1
        if sentence == 0:
            words[-1] += "."
    return words


def text_with_tokens(count_tokens: Callable[[str], int], n_tokens: int, seed: int) -> str:
    """Text that encodes to `n_tokens` tokens (exactly, unless no single-token pad exists)."""
    if n_tokens <= 0:
        return ""
    # Grow until long enough, then binary-search the longest word prefix that still fits.
    words = deterministic_words(seed, max(8, n_tokens))
    while count_tokens(" ".join(words)) < n_tokens:
        words = deterministic_words(seed, len(words) * 2)
    lo, hi = 0, len(words)   # invariant: words[:lo] fits, words[:hi] (hi > lo) may not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_tokens(" ".join(words[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid
    text = " ".join(words[:lo]) if count_tokens(" ".join(words[:hi])) > n_tokens else " ".join(words[:hi])
    # The last word may need several tokens: top up with one-token pieces.
    have = count_tokens(text)
    while have < n_tokens:
        for pad in _PAD_CANDIDATES:
            if count_tokens(text + pad) == have + 1:
                text += pad
                have += 1
                break
        else:
            break
    return text


class PromptFactory:
    """Chat prompts whose *rendered and tokenized* form is ~n tokens long, like the server will see it."""

    def __init__(self, tokenizer: TextTokenizer, render: Callable[[list[dict[str, Any]]], str]):
        self.tokenizer = tokenizer
        self.render = render

    @classmethod
    def for_model(cls, model_path: str) -> PromptFactory:
        from kiln.engine.chat_template import ChatTemplate
        from kiln.engine.tokenizer import Tokenizer

        tok = Tokenizer.load(model_path)
        template = ChatTemplate(tok.require_chat_template(), bos_token=tok.bos_token, eos_token=tok.eos_token)
        return cls(tok, lambda messages: template.render(messages, add_generation_prompt=True))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _messages(self, seed: int, user: str) -> list[dict[str, Any]]:
        # The seed leads the prompt, so prompts differ within their first cache block.
        return [{"role": "system", "content": f"Session {seed}. Continue the text."},
                {"role": "user", "content": user}]

    def chat(self, n_tokens: int, seed: int) -> BenchPrompt:
        overhead = self.count(self.render(self._messages(seed, "")))
        user = text_with_tokens(self.count, max(1, n_tokens - overhead), seed)
        messages = self._messages(seed, user)
        ids = self.tokenizer.encode(self.render(messages), add_special_tokens=False)
        return BenchPrompt(seed=seed, messages=messages, prompt_ids=ids)
