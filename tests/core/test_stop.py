from hypothesis import given
from hypothesis import strategies as st

from kiln.core.stop import StopMatcher


def feed_all(matcher, pieces):
    emitted, stopped = "", False
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        emitted += text
        if stopped:
            break
    if not stopped:
        emitted += matcher.flush()
    return emitted, stopped


def test_without_stops_text_passes_through_at_once():
    assert StopMatcher([]).feed("hello") == ("hello", False)


def test_text_before_a_stop_is_emitted_and_the_stop_is_not():
    assert StopMatcher(["END"]).feed("abcENDxyz") == ("abc", True)


def test_stop_split_across_pieces_is_matched():
    assert feed_all(StopMatcher(["</tool_call>"]), ["x</tool", "_ca", "ll>tail"]) == ("x", True)


def test_possible_stop_prefix_is_held_back():
    m = StopMatcher(["END"])
    assert m.feed("abcE") == ("abc", False)
    assert m.feed("N") == ("", False)


def test_held_back_text_is_released_when_it_stops_being_a_prefix():
    m = StopMatcher(["END"])
    m.feed("abcEN")
    assert m.feed("x") == ("ENx", False)


def test_flush_returns_held_back_text_when_stream_ends():
    m = StopMatcher(["END"])
    assert m.feed("abcEN") == ("abc", False)
    assert m.flush() == "EN"


def test_earliest_match_across_stop_strings_wins():
    m = StopMatcher(["zz", "b"])
    assert m.feed("a zz b") == ("a ", True)
    assert m.matched == "zz"


def test_nothing_is_emitted_after_a_stop():
    m = StopMatcher(["."])
    m.feed("one.")
    assert m.feed("two") == ("", True)
    assert m.flush() == ""


def test_empty_stop_strings_are_ignored():
    assert StopMatcher(["", "X"]).feed("abc") == ("abc", False)


@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=10),
)
def test_emitted_text_never_contains_a_stop_and_is_a_prefix_of_the_input(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    emitted, stopped = feed_all(StopMatcher(stops), pieces)
    assert text.startswith(emitted)
    assert not any(s in emitted for s in stops)
    if not stopped:
        assert emitted == text
    else:
        assert any(text[len(emitted) :].startswith(s) for s in stops)
