import pytest

from kiln.evals.scorers.json_validity import MISSING, extract_json_text, json_equal, resolve_pointer
from tests.evals._helpers import score

JV = {"kind": "json_validity"}


@pytest.mark.parametrize(
    ("spec", "completion", "target", "outcome"),
    [
        (JV, '{"a": 1}', None, "pass"),
        (JV, 'Here you go: {"a": "}"} trailing', None, "pass"),  # string-aware bracket matching
        (JV, "[1, 2, 3]", None, "pass"),
        (JV, "{not json}", None, "invalid"),
        (JV, '{"a": [1, 2}', None, "invalid"),  # unterminated: rest of text, then a parse error
        (JV, "NaN", None, "invalid"),
        (JV, "42", None, "pass"),  # no bracket: the whole text
        ({"kind": "json_validity", "require_object": True}, "[1]", None, "fail"),
        ({"kind": "json_validity", "required_paths": ["/a/0/b"]}, '{"a": [{"b": null}]}', None, "pass"),
        ({"kind": "json_validity", "required_paths": ["/a/1"]}, '{"a": [0]}', None, "fail"),
        (JV, '{"b": 2, "a": 1}', '{"a": 1, "b": 2}', "pass"),  # key order irrelevant
        (JV, '{"a": 1}', '{"a": 2}', "fail"),
        (JV, '{"a": true}', '{"a": 1}', "fail"),  # true is not 1
        (JV, '{"a": 1}', "not json", "invalid"),
    ],
)
def test_json_validity(spec, completion, target, outcome):
    assert score(spec, completion, target).outcome == outcome


def test_extraction_uses_the_first_opening_bracket():
    assert extract_json_text('x [1, {"a": 2}] y {"b": 3}') == '[1, {"a": 2}]'


@pytest.mark.parametrize(
    ("pointer", "found"),
    [("", True), ("/a~1b", True), ("/m~0n", True), ("/list/01", False), ("/list/1", True), ("nope", False)],
)
def test_json_pointer_escapes_and_indices(pointer, found):
    doc = {"a/b": 1, "m~n": 2, "list": [0, 1]}
    assert (resolve_pointer(doc, pointer) is not MISSING) == found


def test_json_equal_distinguishes_bool_from_number_but_not_int_from_float():
    assert json_equal({"x": [1, 2.0]}, {"x": [1.0, 2]})
    assert not json_equal([True], [1])
