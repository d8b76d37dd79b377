"""IncrementalDetokenizer over a real byte-level BPE (the tiny models' tokenizer, no weights)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.tokenizer import Tokenizer
from kiln.testing.tiny import tiny_tokenizer

TOK = Tokenizer(tiny_tokenizer(), source="tiny", eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _stream(ids: list[int], prompt: list[int] | None = None, skip: bool = False) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(TOK, prompt or [], skip_special_tokens=skip)
    pieces = [detok.step(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(pieces) + tail
    return pieces, tail


def test_multi_byte_characters_span_several_tokens() -> None:
    for char in ("🎉", "你", "€"):
        assert len(TOK.encode(char)) == len(char.encode("utf-8"))


@pytest.mark.parametrize("char", ["🎉", "你", "👨‍👩‍👧"])
def test_partial_characters_are_held_back_until_complete(char: str) -> None:
    ids = TOK.encode("a" + char + "b")
    pieces, tail = _stream(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "a" + char + "b" and tail == ""


def test_a_cjk_character_appears_on_its_last_byte() -> None:
    ids = TOK.encode("你")
    pieces, _ = _stream(ids)
    assert pieces == ["", "", "你"]


def test_flush_emits_an_unfinished_character_as_replacement() -> None:
    ids = TOK.encode("ok🎉")[:-1]
    pieces, tail = _stream(ids)
    assert "".join(pieces) == "ok"
    assert tail == TOK.decode(ids)[2:] and tail.startswith("\ufffd")


def test_special_tokens_are_skipped_when_asked() -> None:
    ids = TOK.encode("Hi<|im_end|>there")
    assert "".join(_stream(ids)[0]) == "Hi<|im_end|>there"
    assert "".join(_stream(ids, skip=True)[0]) == "Hithere"


def test_prompt_context_does_not_leak_into_output() -> None:
    prompt = TOK.encode("<|im_start|>user\nSay 你好<|im_end|>\n<|im_start|>assistant\n")
    ids = TOK.encode("你好 world")
    pieces, tail = _stream(ids, prompt)
    assert "".join(pieces) + tail == "你好 world"


def test_prompt_ending_inside_a_character_is_not_used_as_context() -> None:
    emoji = TOK.encode("🎉")
    pieces, tail = _stream(emoji[2:] + TOK.encode("x"), prompt=TOK.encode("go ") + emoji[:2])
    assert "".join(pieces) + tail == TOK.decode(emoji[2:] + TOK.encode("x"))


TEXT = st.lists(
    st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from(["🎉", "你", "é", " ", "\n", "<|im_end|>", "<think>", "the", "Ġ"]),
    ),
    max_size=40,
).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=TEXT, prompt=TEXT, skip=st.booleans())
def test_pieces_add_up_to_decoding_all_generated_ids(text: str, prompt: str, skip: bool) -> None:
    ids = TOK.encode(text)
    pieces, tail = _stream(ids, TOK.encode(prompt), skip)
    assert "".join(pieces) + tail == TOK.decode(ids, skip_special_tokens=skip)
    assert all(not p.endswith("\ufffd") for p in pieces)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, TOK.vocab_size - 1), max_size=30), skip=st.booleans())
def test_arbitrary_ids_including_invalid_utf8_still_add_up(ids: list[int], skip: bool) -> None:
    pieces, tail = _stream(ids, skip=skip)
    assert "".join(pieces) + tail == TOK.decode(ids, skip_special_tokens=skip)
