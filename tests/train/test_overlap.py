"""Held-out suites against training rows (semantics.md §8.14): every way an example can overlap, and
what does not count."""

from __future__ import annotations

from typing import Any

from kiln.data.identity import content_sha256
from kiln.evals.suite import parse_suite
from kiln.train.overlap import find_overlaps

SCORER = {"kind": "exact_match"}


def suite(*examples: dict[str, Any], **extra: Any):
    return parse_suite({"name": "held", "default_scorer": SCORER, "schema_version": 2,
                        "examples": list(examples), **extra})


def ex(user: str, target: str = "x", **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": user}], "target": target, **fields}


def sft_row(*turns: tuple[str, str], **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in turns], **fields}


def overlaps(s, rows):
    return find_overlaps(s, rows, [f"examples[{i}]" for i in range(len(rows))])


ROW = sft_row(("user", "What is the capital of France?"), ("assistant", "Paris"))


def test_a_disjoint_suite_has_no_overlap_even_with_equal_targets():
    assert overlaps(suite(ex("Capital of Spain?", target="Paris"), ex("2+2?", target="Paris")), [ROW]) == []


def test_the_same_prompt_overlaps_exactly():
    (o,) = overlaps(suite(ex("What is the capital of France?", id="fr")), [ROW])
    assert o.example_id == "fr" and o.row_label == "examples[0]" and "exactly" in o.reason


def test_case_and_whitespace_do_not_hide_a_prompt():
    (o,) = overlaps(suite(ex("  what IS the   capital of\nfrance? ")), [ROW])
    assert "normalization" in o.reason


def test_system_messages_are_ignored_on_either_side():
    with_system = sft_row(("system", "Be brief."), ("user", "What is the capital of France?"), ("assistant", "Paris"))
    assert len(overlaps(suite(ex("What is the capital of France?")), [with_system])) == 1
    # The suite's system prompt is prepended at run time; the example still matches the bare training prompt.
    assert len(overlaps(suite(ex("What is the capital of France?"), system_prompt="You are a tutor."), [ROW])) == 1


def test_trailing_tool_results_are_ignored():
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                 "function": {"name": "f", "arguments": "{}"}}]}
    prompt = [{"role": "user", "content": "weather?"}, call]
    row = {"messages": [*prompt, {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}
    s = suite({"messages": prompt, "target": "x"})
    assert len(overlaps(s, [row])) == 1


def test_every_prefix_before_an_assistant_turn_is_a_training_prompt():
    row = sft_row(("user", "hi"), ("assistant", "hello"), ("user", "how are you?"), ("assistant", "fine"))
    s = suite({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                            {"role": "user", "content": "how are you?"}], "target": "fine"})
    assert len(overlaps(s, [row])) == 1
    assert overlaps(suite(ex("how are you?")), [row]) == []  # the second turn alone is another prompt


def test_grpo_groups_overlap_through_their_prompt():
    group = {"messages": [{"role": "user", "content": "2+2?"}], "completions": [{"text": "4", "reward": 1.0}]}
    assert len(overlaps(suite(ex("2+2?", target="4")), [group])) == 1


def test_shared_group_or_session_ids_overlap():
    row = sft_row(("user", "a"), ("assistant", "b"), group_id="g-1")
    (o,) = overlaps(suite(ex("unrelated", metadata={"group_id": "g-1"})), [row])
    assert "group_id 'g-1'" in o.reason
    row = sft_row(("user", "a"), ("assistant", "b"), metadata={"session_id": "s-9"})
    assert len(overlaps(suite(ex("unrelated", metadata={"provenance": {"session_id": "s-9"}})), [row])) == 1
    assert overlaps(suite(ex("unrelated", metadata={"group_id": "g-2"})), [row]) == []


def test_a_synthesized_example_names_its_source_row():
    meta = {"kiln_dataset_provenance": {"dataset": "qa", "source_split": "train", "row_identity": content_sha256(ROW)}}
    (o,) = overlaps(suite(ex("a rephrased question", metadata=meta)), [ROW])
    assert "source row" in o.reason


def test_only_the_overlapping_examples_are_reported_in_order():
    s = suite(ex("fresh one", id="a"), ex("What is the capital of France?", id="b"), ex("fresh two", id="c"))
    assert [o.example_id for o in overlaps(s, [ROW])] == ["b"]
