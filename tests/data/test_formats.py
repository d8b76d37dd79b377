from __future__ import annotations

import pytest

from kiln.data.formats import normalize_format, parse_row
from kiln.errors import KilnError


@pytest.mark.parametrize(("given", "canonical"), [
    ("sft_chat", "sft_chat"), ("sft", "sft_chat"), (" sft ", "sft_chat"), ("grpo_groups", "grpo_groups"),
    ("grpo", "grpo_groups"), ("raw", "raw"), (None, "sft_chat"), ("", "sft_chat"),
])
def test_format_aliases_normalise_to_the_canonical_name(given, canonical):
    assert normalize_format(given) == canonical


def test_unknown_format_is_dataset_invalid_naming_the_format():
    with pytest.raises(KilnError) as e:
        normalize_format("parquet")
    assert e.value.status == 400 and e.value.code == "dataset_invalid" and e.value.param == "format"
    assert e.value.message == "Invalid eval dataset: unknown format `parquet`"


def test_sft_row_needs_messages_with_string_roles():
    with pytest.raises(KilnError) as e:
        parse_row('{"messages": [{"content": "hi"}]}', "sft_chat", "line 4")
    assert "line 4 is not an SFT chat row: messages[0].role must be a string" in e.value.message


def test_sft_row_keeps_extra_fields_and_accepts_missing_content():
    row = parse_row('{"messages": [{"role": "assistant"}], "group_id": "g"}', "sft_chat", "line 1")
    assert row == {"messages": [{"role": "assistant"}], "group_id": "g"}


def test_grpo_group_needs_completions_with_finite_rewards():
    with pytest.raises(KilnError) as e:
        parse_row('{"messages": [{"role": "user", "content": "q"}], "completions": [{"text": "a"}]}',
                  "grpo_groups", "line 2")
    assert "line 2 is not a GRPO group: completions[0].reward must be a finite number" in e.value.message


def test_non_json_line_of_a_typed_format_is_rejected_with_its_line():
    with pytest.raises(KilnError) as e:
        parse_row("not json", "sft_chat", "line 9")
    assert e.value.message.startswith("Invalid eval dataset: line 9 is not valid JSON")


def test_nan_is_not_json():
    with pytest.raises(KilnError):
        parse_row('{"messages": [{"role": "user", "content": "x"}], "score": NaN}', "sft_chat", "line 1")


def test_raw_non_json_line_is_its_trimmed_text():
    assert parse_row("  hello world \n", "raw", "line 1") == "hello world"
    assert parse_row('{"a": 1}', "raw", "line 1") == {"a": 1}
