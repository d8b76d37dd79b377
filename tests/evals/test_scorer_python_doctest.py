import sys

import pytest

from kiln.evals.scorers.python_doctest import Doctest, extract_code, parse_doctests
from tests.evals._helpers import score

PROMPT = """Write add(a, b).

```python
>>> add(1, 2)
3
>>> add('a',
...     'b')
'ab'
>>> print_nothing()
```
"""


def spec(**extra):
    return {"kind": "python_doctest", "python_bin": sys.executable, **extra}


def test_doctests_are_parsed_with_continuations_and_default_none():
    assert parse_doctests(PROMPT) == [
        Doctest("add(1, 2)", "3"),
        Doctest("add('a',\n    'b')", "'ab'"),
        Doctest("print_nothing()", "None"),
    ]


def test_code_comes_from_the_first_fence_without_its_language_tag():
    assert extract_code("Here:\n```python\ndef f():\n    pass\n```\nbye") == "def f():\n    pass"
    assert extract_code("def f(): pass") == "def f(): pass"


def test_all_doctests_passing_is_a_pass():
    code = "```python\ndef add(a, b):\n    return a + b\ndef print_nothing():\n    print('x')\n```"
    r = score(spec(), code, user=PROMPT)
    assert (r.outcome, r.score) == ("pass", 1.0)


def test_partial_success_scores_the_fraction():
    code = "```python\ndef add(a, b):\n    return a + b\n```"  # print_nothing is missing
    r = score(spec(), code, user=PROMPT)
    assert r.outcome == "fail" and r.score == pytest.approx(2 / 3) and "NameError" in r.detail


def test_code_that_fails_to_import_fails_every_doctest():
    r = score(spec(), "```python\nraise ImportError('nope')\n```", user=PROMPT)
    assert (r.outcome, r.score) == ("fail", 0.0)


def test_code_output_cannot_fake_results():
    code = "```python\nimport sys\nprint('ok')\nsys.stdout.write('[{\"ok\": true}]')\ndef add(a, b):\n    return 0\n```"
    assert score(spec(), code, user=">>> add(1, 2)\n3").outcome == "fail"


def test_timeout_is_an_error_and_the_child_is_killed():
    r = score(spec(timeout_seconds=0.5), "```python\nwhile True:\n    pass\n```", user=">>> 1\n1")
    assert r.outcome == "error" and r.detail == "timeout after 0.5s"


def test_no_doctests_in_the_prompt_is_invalid():
    assert score(spec(), "def f(): pass", user="no examples here").outcome == "invalid"


def test_empty_code_is_invalid():
    assert score(spec(), "```python\n```", user=">>> 1\n1").outcome == "invalid"


def test_missing_interpreter_is_an_error():
    r = score({"kind": "python_doctest", "python_bin": "/nonexistent/python"}, "x = 1", user=">>> 1\n1")
    assert r.outcome == "error" and "could not start" in r.detail


def test_interpreter_comes_from_the_environment_when_unset(monkeypatch):
    monkeypatch.setenv("KILN_DOCTEST_PYTHON", sys.executable)
    assert score({"kind": "python_doctest"}, "x = 1", user=">>> x\n1").outcome == "pass"


def test_timeout_below_the_minimum_is_rejected():
    from pydantic import ValidationError

    from kiln.evals.scorers import parse_scorer

    with pytest.raises(ValidationError):
        parse_scorer({"kind": "python_doctest", "timeout_seconds": 0.05})
