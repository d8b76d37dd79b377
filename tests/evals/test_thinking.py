import pytest

from kiln.evals.thinking import normalize_completion, split_thinking


@pytest.mark.parametrize(
    ("text", "had", "unclosed", "reasoning", "answer"),
    [
        ("42", False, False, None, "42"),
        ("  \n42", False, False, None, "42"),
        ("<think>\nadd them\n</think>\n\n42", True, False, "add them", "42"),
        ("\n<think>x</think>42", True, False, "x", "42"),
        ("<think>\n\n</think>\n\nok", True, False, "", "ok"),
        ("<think>\nstill going\n", True, True, "still going", ""),
        ("answer first <think>late</think> more", False, False, None, "answer first <think>late</think> more"),
        ("<think>a</think>b</think>c", True, False, "a", "b</think>c"),
    ],
)
def test_split_thinking_follows_the_eval_rules(text, had, unclosed, reasoning, answer):
    split = split_thinking(text)
    assert (split.had_thinking, split.unclosed, split.reasoning, split.answer) == (had, unclosed, reasoning, answer)


def test_normalize_reattaches_the_think_tag_the_prompt_opened():
    assert normalize_completion("plan</think>\n\n4", True) == "<think>\nplan</think>\n\n4"


def test_normalize_leaves_text_that_already_opens_thinking():
    assert normalize_completion("  <think>x</think>4", True) == "  <think>x</think>4"


def test_normalize_is_identity_when_the_prompt_does_not_start_in_reasoning():
    assert normalize_completion("plan</think>4", False) == "plan</think>4"
