import pytest

from kiln.evals.scorers import parse_scorer
from kiln.evals.scorers.base import ScoreContext
from kiln.evals.scorers.llm_judge import AWAITING_JUDGE, awaiting_judge, build_judge_prompt, parse_verdict
from tests.evals._helpers import example, score

JUDGE = {"kind": "llm_judge"}


def test_prompt_fills_question_target_and_answer_in_order():
    spec = parse_scorer({"kind": "llm_judge", "template": "Q={question} T={target} A={answer}"})
    ex = example("4", messages=[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "hm"}])
    # An answer quoting a placeholder is not substituted again.
    assert build_judge_prompt(spec, "{question} 4", ex) == "Q=2+2? T=4 A={question} 4"


def test_prompt_question_falls_back_to_the_last_message_then_empty():
    spec = parse_scorer({"kind": "llm_judge", "template": "[{question}]"})
    assert build_judge_prompt(spec, "", example(messages=[{"role": "system", "content": "sys"}])) == "[sys]"


def test_default_template_ends_asking_for_a_score():
    prompt = build_judge_prompt(parse_scorer(JUDGE), "four", example("4", user="2+2?"))
    assert "2+2?" in prompt and "four" in prompt and prompt.rstrip().endswith("Score:")


@pytest.mark.parametrize(
    ("reply", "outcome", "value"),
    [("Score: 1", "pass", 1.0), ("score 0.5", "pass", 0.5), ("SCORE: 0.25", "fail", 0.25), ("Score:0", "fail", 0.0)],
)
def test_verdict_parsing(reply, outcome, value):
    r = parse_verdict(parse_scorer(JUDGE), reply)
    assert (r.outcome, r.score) == (outcome, value)


def test_verdict_without_score_is_invalid_with_a_preview():
    r = parse_verdict(parse_scorer(JUDGE), "I refuse " + "x" * 200)
    assert r.outcome == "invalid" and "score not found" in r.detail and len(r.detail) < 140


def test_verdict_score_is_clamped_to_one():
    spec = parse_scorer({"kind": "llm_judge", "score_regex": r"(\d+(?:\.\d+)?)/10"})
    assert parse_verdict(spec, "15/10").score == 1.0


def test_regex_without_group_one_is_a_scorer_error():
    r = score({"kind": "llm_judge", "score_regex": "Score"}, "x", ctx=ScoreContext(judge=lambda p: "Score"))
    assert r.outcome == "error" and r.detail.startswith("scorer error:")


def test_no_judge_is_an_error_outcome_with_a_clear_detail():
    r = score(JUDGE, "answer", "4")
    assert r.outcome == "error" and "needs a judge" in r.detail


def test_a_failing_judge_call_is_invalid():
    def broken(prompt: str) -> str:
        raise RuntimeError("adapter missing")

    r = score(JUDGE, "answer", "4", ctx=ScoreContext(judge=broken))
    assert r.outcome == "invalid" and "adapter missing" in r.detail


def test_judge_sees_the_built_prompt():
    seen = []
    r = score(JUDGE, "four", "4", ctx=ScoreContext(judge=lambda p: seen.append(p) or "Score: 0.9"))
    assert r.outcome == "pass" and r.score == pytest.approx(0.9) and "four" in seen[0]


def test_placeholder_marks_a_deferred_judge_pass():
    r = awaiting_judge()
    assert (r.outcome, r.detail) == ("invalid", AWAITING_JUDGE)
