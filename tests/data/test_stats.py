from __future__ import annotations

from kiln.data.stats import STAT_SCAN_ROWS, compute_stats, role_pattern


def test_role_pattern_compresses_consecutive_roles_with_a_times_sign():
    msgs = [{"role": r} for r in ["user", "assistant", "tool", "tool", "tool", "assistant"]]
    assert role_pattern(msgs) == "user assistant tool×3 assistant"


def test_stats_count_turns_tools_and_sizes():
    rows = [
        {"messages": [{"role": "user", "content": "hello"},
                      {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
                      {"role": "tool", "content": "42"}, {"role": "assistant", "content": "it is 42"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "tool_calls": []}]},
    ]
    assert compute_stats("sft_chat", rows) == {
        "num_assistant_turns": 3, "num_tool_messages": 1, "num_with_tool_calls": 1,
        "max_messages_per_conv": 4, "max_content_chars": 8, "avg_messages_per_conv": 3.0,
        "sample_role_patterns": ["user assistant tool assistant", "user assistant"],
    }


def test_raw_datasets_have_zero_stats():
    stats = compute_stats("raw", [{"messages": [{"role": "user"}]}])
    assert stats["num_assistant_turns"] == 0 and stats["sample_role_patterns"] == []
    assert stats["avg_messages_per_conv"] == 0


def test_stats_scan_only_the_first_rows_and_sample_five_patterns():
    rows = [{"messages": [{"role": "user"}]}] * STAT_SCAN_ROWS + [{"messages": [{"role": "user"}] * 9}]
    stats = compute_stats("sft_chat", rows)
    assert stats["max_messages_per_conv"] == 1
    assert len(stats["sample_role_patterns"]) == 5
