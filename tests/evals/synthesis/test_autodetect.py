"""auto_detect scorer rules (semantics.md §10.4): first matching rule wins, checked table-driven."""

import pytest

from kiln.evals.scorers import parse_scorer
from kiln.evals.synthesis.autodetect import detect_scorer

EXACT = {"kind": "exact_match", "case_sensitive": False, "strip_whitespace": True}
MC = {"kind": "multiple_choice", "choices": ["A", "B", "C", "D", "E"]}
INT = {"kind": "numeric_tolerance", "atol": 0.0, "rtol": 0.0, "integer_only": True}
FLOAT = {"kind": "numeric_tolerance", "atol": 1e-6, "rtol": 1e-3}
TOOL = {"kind": "tool_call", "name_match": {"kind": "case_insensitive"}, "args": {"kind": "auto"}}
LONG = ("The mitochondria produces energy for the cell through respiration.\n"
        "Oxygen accepts electrons at the end of the transport chain.")

RULES = [
    ("rule 0: empty", "   ", EXACT),
    ("rule 1: bare letter", "B", MC),
    ("rule 1: parenthesized letter", "(C)", MC),
    ("rule 1: letter with a period", " D. ", MC),
    ("rule 1: lowercase is not a choice", "b", EXACT),
    ("rule 2: integer", "42", INT),
    ("rule 2: thousands separators", "1,234", INT),
    ("rule 2: negative with spaces", "- 7", INT),
    ("rule 2: exponent that is integral", "1e3", INT),
    ("rule 2: decimal", "3.14", FLOAT),
    ("rule 2: leading dot", ".5", FLOAT),
    ("rule 2: inf is not a number here", "inf", EXACT),
    ("rule 3: canonical tool calls", '{"tool_calls":[{"arguments":{},"name":"f"}]}', TOOL),
    ("rule 3: name and arguments", '{"name": "f", "arguments": {"a": 1}}', TOOL),
    ("rule 3: function key", '{"function": {"name": "f"}}', TOOL),
    ("rule 3: tool_call tag", "<tool_call>\n<function=f>\n</function>\n</tool_call>", TOOL),
    ("rule 3: tool_call fence", '```tool_call\n{"name": "f"}\n```', TOOL),
    ("rule 4: fenced code", "```py\nprint(1)\n```",
     {"kind": "code", "language": "python", "style": {"kind": "token_similarity", "min_jaccard": 0.6}}),
    ("rule 4: needs a closing fence", "```py\nprint(1)", EXACT),
    ("rule 5: JSON object", '{"name": "Ada"}', {"kind": "json_validity", "require_object": True}),
    ("rule 5: JSON array", "[1, 2, 3]", {"kind": "json_validity", "require_object": False}),
    ("rule 5: invalid JSON falls through", "{not json}", EXACT),
    ("rule 6: one short line", "Paris is the capital.", EXACT),
    ("rule 7: long text gets key phrases", LONG,
     {"kind": "contains", "phrases": ["mitochondria produces energy", "cell respiration oxygen",
                                      "accepts electrons transport"], "mode": "any", "case_sensitive": False}),
    ("rule 7: no content words", "a b c " * 20, EXACT),
]


@pytest.mark.parametrize(("rule", "target", "expected"), RULES, ids=[r[0] for r in RULES])
def test_auto_detect_rule(rule, target, expected):
    detection = detect_scorer(target)
    assert detection.scorer == expected
    parse_scorer(detection.scorer)  # every detected scorer is one the suite accepts


@pytest.mark.parametrize(("target", "letter"), [("B", "B"), ("(C)", "C"), (" D. ", "D")])
def test_a_multiple_choice_target_becomes_its_bare_letter(target, letter):
    assert detect_scorer(target).target == letter


def test_other_rules_keep_the_target():
    assert detect_scorer("42").target is None
