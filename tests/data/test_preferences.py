"""Preference pairs: the row shapes DPO reads, judgment sets as pairs, the held-out split, and the export."""

from __future__ import annotations

import json

import pytest

from kiln.data.judgment_rows import JudgmentRow
from kiln.data.preferences import PreferencePair, heldout_mask, pair_from_row, pairs_from_judgments
from kiln.errors import KilnError
from tests.data.conftest import judgment

PROMPT = [{"role": "user", "content": "Capital of Zorbania?"}]


def test_kiln_trl_and_openai_rows_give_the_same_pair():
    want = PreferencePair(PROMPT, "Quillton.", "Paris.")
    kiln_row = {"messages": PROMPT, "chosen": "Quillton.", "rejected": "Paris."}
    trl_row = {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": "Quillton."}],
               "rejected": [{"role": "assistant", "content": "Paris."}]}
    openai_row = {"input": {"messages": PROMPT, "tools": []},
                  "preferred_output": [{"role": "assistant", "content": "Quillton."}],
                  "non_preferred_output": [{"role": "assistant", "content": "Paris."}]}
    for row in (kiln_row, trl_row, openai_row, want.to_trl(), want.to_openai()):
        assert pair_from_row(row) == (want, None)


def test_a_standard_trl_string_prompt_is_one_user_message():
    pair, problem = pair_from_row({"prompt": "Capital of Zorbania?", "chosen": "Quillton.", "rejected": "Paris."})
    assert problem is None and pair.messages == PROMPT


@pytest.mark.parametrize(("row", "says"), [
    ({"messages": PROMPT, "chosen": "same", "rejected": "same"}, "identical"),
    ({"messages": PROMPT, "chosen": "a"}, "`rejected`"),
    ({"messages": PROMPT, "chosen": "  ", "rejected": "b"}, "`chosen` is empty"),
    ({"messages": [], "chosen": "a", "rejected": "b"}, "non-empty"),
    ({"messages": PROMPT, "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, "assistant message"),
    ({"messages": PROMPT, "chosen": [{"role": "assistant", "content": "a"}] * 2, "rejected": "b"}, "one assistant"),
    ("not an object", "JSON object"),
])
def test_a_row_without_a_preference_is_a_problem_naming_the_field(row, says):
    pair, problem = pair_from_row(row)
    assert pair is None and says in problem


def test_judgment_a_b_rows_become_pairs_and_ties_and_skips_are_counted():
    rows = [JudgmentRow.from_json({"id": str(i), "submitted_at": "", **judgment(i, w)})
            for i, w in enumerate(["a", "b", "tie", "skip", "skip", "a"])]
    found = pairs_from_judgments("prefs", rows)
    assert (found.ties, found.skips, len(found.pairs)) == (1, 2, 3)
    assert found.pairs[0] == PreferencePair([{"role": "user", "content": "question 0"}], "long answer 0", "short 0")
    assert found.pairs[1] == PreferencePair([{"role": "user", "content": "question 1"}], "short 1", "long answer 1")
    assert found.labels == ["judgments 'prefs' row '0'", "judgments 'prefs' row '1'", "judgments 'prefs' row '5'"]


def test_the_held_out_split_is_deterministic_order_free_and_keeps_a_prompt_on_one_side():
    pairs = [PreferencePair([{"role": "user", "content": f"q{i % 12}"}], f"good {i}", f"bad {i}") for i in range(36)]
    mask = heldout_mask(pairs, 25)
    assert 0 < sum(mask) < len(pairs)
    by_prompt: dict[str, set[bool]] = {}
    for pair, held in zip(pairs, mask, strict=True):
        by_prompt.setdefault(pair.messages[0]["content"], set()).add(held)
    assert all(len(sides) == 1 for sides in by_prompt.values())
    reordered = list(reversed(pairs))
    assert heldout_mask(reordered, 25) == list(reversed(mask))
    assert heldout_mask(pairs, 0) == [False] * len(pairs)


def test_export_writes_trl_and_openai_jsonl_of_the_a_b_rows(judgments):
    judgments.create("prefs")
    for i, w in enumerate(["a", "tie", "b", "skip"]):
        judgments.append("prefs", judgment(i, w))
    trl, found = judgments.export("prefs", "trl")
    assert (len(found.pairs), found.ties, found.skips) == (2, 1, 1)
    lines = [json.loads(line) for line in trl.decode().splitlines()]
    assert lines[0] == {"prompt": [{"role": "user", "content": "question 0"}],
                        "chosen": [{"role": "assistant", "content": "long answer 0"}],
                        "rejected": [{"role": "assistant", "content": "short 0"}]}
    assert lines[1]["chosen"][0]["content"] == "short 2"
    openai, _ = judgments.export("prefs", "openai")
    first = json.loads(openai.decode().splitlines()[0])
    assert first == {"input": {"messages": [{"role": "user", "content": "question 0"}], "tools": [],
                               "parallel_tool_calls": True},
                     "preferred_output": [{"role": "assistant", "content": "long answer 0"}],
                     "non_preferred_output": [{"role": "assistant", "content": "short 0"}]}


def test_export_refuses_an_unknown_format_and_an_unknown_set(judgments):
    judgments.create("prefs")
    with pytest.raises(KilnError) as e:
        judgments.export("prefs", "csv")
    assert (e.value.status, e.value.param) == (400, "format")
    with pytest.raises(KilnError) as e:
        judgments.export("nope", "trl")
    assert e.value.status == 404


def test_the_held_out_share_is_the_asked_share_of_the_prompts():
    pairs = [PreferencePair([{"role": "user", "content": f"q{i}"}], "good", "bad") for i in range(40)]
    assert sum(heldout_mask(pairs, 25)) == 10 and sum(heldout_mask(pairs, 10)) == 4
    two = pairs[:2]
    assert sum(heldout_mask(two, 50)) == 1 and sum(heldout_mask(two, 1)) == 1   # at least one, never all
    assert heldout_mask(pairs[:1], 50) == [False]
