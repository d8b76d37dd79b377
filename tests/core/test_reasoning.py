"""Reasoning split, fold and the streaming splitter (semantics.md §3.2-3.3)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kiln.core.reasoning import (
    ReasoningStreamSplitter,
    cut_at_stop,
    fold_reasoning,
    resolve_fold,
    split_reasoning,
)


def test_without_a_thinking_prompt_the_whole_output_is_content():
    assert split_reasoning("<think>a</think>b", False) == (None, "<think>a</think>b")


def test_the_first_close_tag_ends_the_reasoning_and_content_is_kept_raw():
    assert split_reasoning("plan\n</think>\n\nAnswer </think> x", True) == ("plan\n", "\n\nAnswer </think> x")


def test_no_close_tag_means_all_reasoning_and_empty_content():
    assert split_reasoning("still thinking", True) == ("still thinking", "")


def test_empty_reasoning_is_none():
    assert split_reasoning("</think>hi", True) == (None, "hi")
    assert split_reasoning("", True) == (None, "")


def test_fold_copies_reasoning_into_content():
    assert fold_reasoning("r", "c") == "<think>\nr</think>\n\nc"
    assert fold_reasoning("r", "") == "<think>\nr</think>"
    assert fold_reasoning(None, "c") == "c"


def test_fold_request_value_beats_the_server_setting():
    assert resolve_fold(None, True) is True
    assert resolve_fold(False, True) is False


def test_stop_cut_truncates_content_at_the_first_occurrence():
    assert cut_at_stop("r STOP", "a STOP b STOP", "STOP") == ("r STOP", "a ")


def test_stop_cut_reaches_reasoning_when_content_ends_up_empty():
    assert cut_at_stop("think STOP more", "STOP tail", "STOP") == ("think ", "")
    assert cut_at_stop("STOP", "", "STOP") == (None, "")


def test_streaming_holds_back_a_partial_close_tag():
    s = ReasoningStreamSplitter(True)
    d = s.feed("abc</th")
    assert (d.reasoning, d.content) == ("abc", "")
    d = s.feed("ink>answer")
    assert (d.reasoning, d.content) == ("", "answer")
    assert not s.in_reasoning


def test_streaming_releases_a_false_alarm_as_reasoning():
    s = ReasoningStreamSplitter(True)
    assert s.feed("a<").reasoning == "a"
    assert s.feed("b").reasoning == "<b"


def test_streaming_flush_emits_pending_text_as_reasoning_while_inside():
    s = ReasoningStreamSplitter(True)
    s.feed("x</thi")
    assert s.flush().reasoning == "</thi"


def test_streaming_without_a_thinking_prompt_passes_content_through():
    s = ReasoningStreamSplitter(False)
    d = s.feed("<think>a</th")
    assert (d.reasoning, d.content) == ("", "<think>a</th")


_alphabet = st.sampled_from(["a", " ", "\n", "<", "/", "t", "h", "i", "n", "k", ">", "</think>", "</th", "<think>"])


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


@given(parts=st.lists(_alphabet, max_size=30), cuts=st.lists(st.integers(0, 400), max_size=12),
       started=st.booleans())
def test_streaming_concatenation_equals_the_non_streaming_split(parts, cuts, started):
    text = "".join(parts)
    s = ReasoningStreamSplitter(started)
    reasoning, content = "", ""
    for chunk in [*_chunks(text, cuts)]:
        d = s.feed(chunk)
        reasoning += d.reasoning
        content += d.content
    d = s.flush()
    reasoning += d.reasoning
    content += d.content
    expected_reasoning, expected_content = split_reasoning(text, started)
    assert (reasoning or None, content) == (expected_reasoning, expected_content)
