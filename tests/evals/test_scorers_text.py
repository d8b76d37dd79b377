"""exact_match, contains, regex, multiple_choice, numeric_tolerance (semantics.md §8.3)."""

import pytest

from tests.evals._helpers import score

EXACT = {"kind": "exact_match"}
EXACT_CI = {"kind": "exact_match", "case_sensitive": False}


@pytest.mark.parametrize(
    ("spec", "completion", "target", "aliases", "outcome"),
    [
        (EXACT, "4", "4", (), "pass"),
        (EXACT, "  4\n", "4", (), "pass"),  # strip_whitespace defaults on
        (EXACT, "Paris", "paris", (), "fail"),  # case-sensitive by default
        (EXACT_CI, "PARIS", "paris", (), "pass"),
        (EXACT, "four", "4", ("four",), "pass"),
        ({"kind": "exact_match", "strip_whitespace": False}, " 4", "4", (), "fail"),
        (EXACT, "cafe\u0301", "caf\u00e9", (), "pass"),  # Unicode NFC
        (EXACT, "5", "4", (), "fail"),
    ],
)
def test_exact_match(spec, completion, target, aliases, outcome):
    assert score(spec, completion, target, aliases=aliases).outcome == outcome


def test_exact_match_without_target_is_a_scorer_error():
    r = score(EXACT, "4", None)
    assert (r.outcome, r.score) == ("error", 0.0)
    assert r.detail.startswith("scorer error: ")


def test_exact_match_detail_previews_are_truncated():
    r = score(EXACT, "x" * 50, "y" * 40)
    assert "y" * 32 + "…" in r.detail and "x" * 32 + "…" in r.detail


@pytest.mark.parametrize(
    ("spec", "completion", "outcome", "value"),
    [
        ({"kind": "contains", "phrases": ["blue", "green"]}, "the sky is blue", "pass", 1.0),
        ({"kind": "contains", "phrases": ["blue"]}, "the sky is grey", "fail", 0.0),
        ({"kind": "contains", "phrases": ["Blue"]}, "blue", "fail", 0.0),
        ({"kind": "contains", "phrases": ["Blue"], "case_sensitive": False}, "BLUE sky", "pass", 1.0),
        ({"kind": "contains", "phrases": ["a", "b", "c", "d"], "mode": "all"}, "a b c", "fail", 0.75),
        ({"kind": "contains", "phrases": ["a", "b"], "mode": "all"}, "b a", "pass", 1.0),
        ({"kind": "contains", "phrases": ["sorry"], "mode": "none"}, "here you go", "pass", 1.0),
        ({"kind": "contains", "phrases": ["sorry"], "mode": "none"}, "sorry, no", "fail", 0.0),
        ({"kind": "contains", "phrases": []}, "anything", "invalid", 0.0),
    ],
)
def test_contains(spec, completion, outcome, value):
    r = score(spec, completion)
    assert (r.outcome, r.score) == (outcome, pytest.approx(value))


@pytest.mark.parametrize(
    ("spec", "completion", "target", "outcome"),
    [
        ({"kind": "regex", "pattern": r"\d+"}, "it is 42", None, "pass"),  # search, not full match
        ({"kind": "regex", "pattern": r"^\d+$"}, "it is 42", None, "fail"),
        ({"kind": "regex", "pattern": r"winner:\s*(A|B)", "capture_group": 1}, "Winner: B", "B", "fail"),
        ({"kind": "regex", "pattern": r"winner:\s*(a|b|tie)", "capture_group": 1, "case_sensitive": False},
         "Winner: Tie", "tie", "pass"),
        ({"kind": "regex", "pattern": r"(?i)Winner:\s*(A|B|Tie)", "capture_group": 1}, "winner: A", "A", "pass"),
        ({"kind": "regex", "pattern": r"x(\d)?y", "capture_group": 1}, "xy", "1", "invalid"),  # unbound group
        ({"kind": "regex", "pattern": r"(\d+)", "capture_group": 1}, "7", "seven", "fail"),
    ],
)
def test_regex(spec, completion, target, outcome):
    assert score(spec, completion, target).outcome == outcome


def test_regex_capture_matches_an_alias():
    spec = {"kind": "regex", "pattern": r"= (\w+)", "capture_group": 1}
    assert score(spec, "x = four", "4", aliases=("four",)).outcome == "pass"


def test_regex_bad_pattern_is_a_scorer_error():
    r = score({"kind": "regex", "pattern": "(unclosed"}, "text")
    assert r.outcome == "error" and "invalid regex" in r.detail


def test_regex_capture_without_target_is_a_scorer_error():
    assert score({"kind": "regex", "pattern": r"(\d)", "capture_group": 1}, "1", None).outcome == "error"


MC = {"kind": "multiple_choice"}


@pytest.mark.parametrize(
    ("completion", "target", "outcome"),
    [
        ("Answer: B", "B", "pass"),
        ("I think C is wrong. Final answer: b", "B", "pass"),
        ("The answer is (D).", "D", "pass"),
        ("Answer: E but really C", "C", "pass"),  # E is not a label: first valid label after the marker
        ("C", "B", "fail"),
        ("B) because reasons", "b", "pass"),  # target trimmed and uppercased
        ("no letter here", "A", "invalid"),
        ("Answer: 7", "A", "invalid"),
    ],
)
def test_multiple_choice(completion, target, outcome):
    assert score(MC, completion, target).outcome == outcome


def test_multiple_choice_accepts_multi_character_labels():
    spec = {"kind": "multiple_choice", "choices": ["yes", "no"]}
    assert score(spec, "final answer: NO", "no").outcome == "pass"


def test_multiple_choice_adds_the_target_to_the_labels():
    assert score(MC, "Answer: E", "E").outcome == "pass"


NUM = {"kind": "numeric_tolerance"}


@pytest.mark.parametrize(
    ("spec", "completion", "target", "outcome"),
    [
        (NUM, "The total is 42.", "42", "pass"),
        (NUM, "first 3 then finally 42", "42", "pass"),  # the LAST number counts
        (NUM, "42 then 43", "42", "fail"),
        (NUM, "It costs $1,234.50", "1234.5", "pass"),
        (NUM, "growth of 12%", "12", "pass"),
        (NUM, "-7", "-7", "pass"),
        (NUM, "about .5", "0.5", "pass"),
        (NUM, "3e2", "300", "pass"),
        (NUM, "no digits", "1", "invalid"),
        ({"kind": "numeric_tolerance", "atol": 0.5}, "10.4", "10", "pass"),
        ({"kind": "numeric_tolerance", "rtol": 0.01}, "101", "100", "pass"),
        ({"kind": "numeric_tolerance", "rtol": 0.01}, "102", "100", "fail"),
        ({"kind": "numeric_tolerance", "atol": 1, "integer_only": True}, "4.5", "4", "fail"),
        ({"kind": "numeric_tolerance", "integer_only": True}, "4.0", "4", "pass"),
    ],
)
def test_numeric_tolerance(spec, completion, target, outcome):
    assert score(spec, completion, target).outcome == outcome


@pytest.mark.parametrize("target", [None, "n/a", "between 3 and 4"])
def test_numeric_target_must_hold_exactly_one_number(target):
    r = score(NUM, "3", target)
    assert r.outcome == "error" and r.detail.startswith("scorer error:")
