import pytest

from kiln.evals.scorers.code import extract_code, fenced_blocks, looks_like_code, normalize_language
from tests.evals._helpers import score

PY_TARGET = "```python\ndef add(a, b):\n    return a + b\n```"


@pytest.mark.parametrize(("tag", "norm"), [("py", "python"), ("TSX", "typescript"), ("mjs", "javascript"),
                                          ("sh", "bash"), ("yml", "yaml"), ("kt", "kotlin"), ("go", "go")])
def test_language_tags_are_normalized(tag, norm):
    assert normalize_language(tag) == norm


def test_blocks_carry_their_normalized_language():
    assert fenced_blocks("x\n```py\nprint(1)\n```\n```\nraw\n```") == [("python", "print(1)\n"), (None, "raw\n")]


def test_requested_language_selects_the_matching_block():
    text = "```js\nlet a = 1;\n```\n```python\nx = 1\n```"
    assert extract_code(text, "python") == "x = 1\n"
    assert extract_code(text, "rust") is None


def test_unfenced_text_counts_only_when_it_looks_like_code():
    assert looks_like_code("def f(x):\n    return x")
    assert not looks_like_code("Just prose.\nMore prose.")
    assert extract_code("def f(x):\n    return x", None) is not None


@pytest.mark.parametrize(
    ("style", "completion", "outcome"),
    [
        ({"kind": "any_block"}, "```py\nanything\n```", "pass"),
        ({"kind": "any_block"}, "```\nuntagged\n```", "fail"),  # a language was requested
        ({"kind": "any_block"}, "no code at all", "fail"),
        ({"kind": "exact_block"}, "Sure:\n```py\ndef add(a, b):\n    return a + b   \n\n```", "pass"),
        ({"kind": "exact_block"}, "```python\ndef add(a, b):\n    return b + a\n```", "fail"),
        ({"kind": "exact_block", "strip_comments": True},
         "```python\ndef add(a, b):  # sum\n    return a + b\n```", "pass"),
        ({"kind": "exact_block"}, "```python\ndef add(a, b):  # sum\n    return a + b\n```", "fail"),
        ({"kind": "token_similarity"}, "```python\ndef plus(x, y):\n    return x * y\n```", "fail"),  # 2/4
        ({"kind": "token_similarity", "min_jaccard": 0.3}, "```python\ndef plus(x, y):\n    return x * y\n```", "pass"),
        ({"kind": "line_coverage"}, "```python\ndef add(a, b):\n    # hi\n    return a + b\n```", "pass"),
        ({"kind": "line_coverage"}, "```python\ndef plus(a, b):\n    return a - b\n```", "fail"),
        ({"kind": "token_similarity"}, "no code here", "invalid"),
    ],
)
def test_code_styles(style, completion, outcome):
    assert score({"kind": "code", "language": "python", "style": style}, completion, PY_TARGET).outcome == outcome


def test_comment_marker_inside_quotes_is_kept():
    spec = {"kind": "code", "language": "python", "style": {"kind": "exact_block", "strip_comments": True}}
    target = '```python\nx = "a # b"\n```'
    assert score(spec, '```python\nx = "a # b"  # note\n```', target).outcome == "pass"
    assert score(spec, '```python\nx = "a "\n```', target).outcome == "fail"


def test_token_similarity_score_is_the_jaccard():
    spec = {"kind": "code", "style": {"kind": "token_similarity"}}
    r = score(spec, "```\nalpha beta\n```", "```\nalpha gamma\n```")
    assert r.score == pytest.approx(1 / 3)


def test_default_style_is_token_similarity_at_0_6():
    r = score({"kind": "code"}, PY_TARGET, PY_TARGET)
    assert (r.outcome, r.score) == ("pass", 1.0)


def test_code_scorer_needs_a_target_except_for_any_block():
    assert score({"kind": "code"}, "```\nx\n```", None).outcome == "error"
    assert score({"kind": "code", "style": {"kind": "any_block"}}, "```\nx\n```", None).outcome == "pass"
