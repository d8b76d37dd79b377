from __future__ import annotations

from kiln.data.judge_prompt import JUDGE_SYSTEM_PROMPT, judge_label, judge_messages, render_judge_prompt


def test_judge_prompt_is_the_exact_pairwise_layout():
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Explain the answer."}]
    assert render_judge_prompt(prompt, "A long answer", "A concise answer") == (
        "Compare the following two assistant replies to this conversation:\n"
        "\n"
        "# Conversation\n"
        "[system] Be brief.\n"
        "[user] Explain the answer.\n"
        "\n"
        "# Reply A\n"
        "A long answer\n"
        "\n"
        "# Reply B\n"
        "A concise answer\n"
        "\n"
        "Which reply is better? Answer with `Winner: A`, `Winner: B`, or `Winner: Tie`."
    )


def test_structured_content_renders_its_text_parts():
    prompt = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"text": "b"}]}]
    assert "[user] ab\n" in render_judge_prompt(prompt, "", "")


def test_label_has_an_optional_reason_line():
    assert judge_label("a") == "Winner: A"
    assert judge_label("tie", "  both fine ") == "Winner: Tie\nReason: both fine"
    assert judge_label("b", "   ") == "Winner: B"


def test_judge_messages_are_system_then_user():
    msgs = judge_messages([{"role": "user", "content": "q"}], "x", "y")
    assert msgs[0] == {"role": "system", "content": JUDGE_SYSTEM_PROMPT}
    assert "Winner: A" in JUDGE_SYSTEM_PROMPT and "Reason:" in JUDGE_SYSTEM_PROMPT
    assert msgs[1]["role"] == "user" and msgs[1]["content"].startswith("Compare the following")
