"""The six decompositions (semantics.md §10.3): which turns become candidates, with which prompt."""

from kiln.evals.synthesis.strategies import decompose

CALL = {"function": {"name": "search", "arguments": "{}"}}


def u(text):
    return {"role": "user", "content": text}


def a(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def tool(text):
    return {"role": "tool", "content": text}


def summary(candidates):
    return [(c.turn, len(c.prompt), c.target.text if c.target else None, c.tags) for c in candidates]


TOOL_TRAJECTORY = [u("q"), a("", tool_calls=[CALL]), tool("r1"), tool("r2"), a("done"), u("more"), a("bye")]


def test_final_assistant_takes_the_last_turn_with_a_target():
    msgs = [u("q1"), a("first"), u("q2"), a("second"), u("q3"), a("  ")]
    assert summary(decompose(msgs, "final_assistant")) == [(3, 3, "second", ("synth:final_assistant",))]


def test_final_assistant_reports_a_conversation_without_targets_as_no_target():
    assert summary(decompose([u("q"), a("")], "final_assistant")) == [(1, 1, None, ("synth:final_assistant",))]


def test_final_assistant_does_not_apply_without_an_assistant():
    assert decompose([u("q")], "final_assistant") == []


def test_final_assistant_trims_trailing_tool_messages_off_the_prompt():
    msgs = [u("q"), a("", tool_calls=[CALL]), tool("r"), a("answer")]
    [c] = decompose(msgs, "final_assistant")
    assert [m["role"] for m in c.prompt] == ["user", "assistant"]


def test_first_assistant_turn_skips_turns_before_the_first_user_message():
    msgs = [a("greeting"), u("q"), a("  "), a("reply")]
    assert summary(decompose(msgs, "first_assistant_turn")) == [(3, 3, "reply", ("synth:first_assistant",))]


def test_first_assistant_turn_needs_a_user_message():
    assert decompose([{"role": "system", "content": "s"}, a("x")], "first_assistant_turn") == []


def test_every_assistant_turn_yields_each_turn_with_a_prompt():
    got = summary(decompose([a("opening"), u("q"), a("one"), u("q2"), a("")], "every_assistant_turn"))
    assert got == [(2, 2, "one", ("synth:every_assistant", "synth:turn_2")),
                   (4, 4, None, ("synth:every_assistant", "synth:turn_4"))]


def test_tool_call_predict_keeps_only_tool_call_targets():
    got = summary(decompose(TOOL_TRAJECTORY, "tool_call_predict"))
    assert got == [(1, 1, '{"tool_calls":[{"arguments":{},"name":"search"}]}',
                    ("synth:tool_call_predict", "synth:turn_1"))]


def test_tool_response_followup_prompt_ends_on_the_tool_results():
    [c] = decompose(TOOL_TRAJECTORY, "tool_response_followup")
    assert (c.turn, c.target.text, c.tags) == (4, "done", ("synth:tool_response_followup", "synth:turn_4"))
    assert [m["role"] for m in c.prompt] == ["user", "assistant", "tool", "tool"]


def test_tool_response_followup_needs_a_tool_message_between_call_and_answer():
    assert decompose([u("q"), a("", tool_calls=[CALL]), a("no results seen")], "tool_response_followup") == []


def test_tool_response_followup_counts_inline_tool_calls_too():
    msgs = [u("q"), a('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'), tool("r"), a("ok")]
    assert summary(decompose(msgs, "tool_response_followup"))[0][2] == "ok"


def test_end_of_trajectory_answer_takes_the_first_answer_after_the_last_tool_message():
    [c] = decompose(TOOL_TRAJECTORY, "end_of_trajectory_answer")
    assert (c.turn, c.target.text, c.tags) == (4, "done", ("synth:end_of_trajectory",))
    assert [m["role"] for m in c.prompt] == ["user", "assistant"]


def test_end_of_trajectory_answer_needs_a_tool_message():
    assert decompose([u("q"), a("x")], "end_of_trajectory_answer") == []
    assert decompose([u("q"), a("", tool_calls=[CALL]), tool("r")], "end_of_trajectory_answer") == []
