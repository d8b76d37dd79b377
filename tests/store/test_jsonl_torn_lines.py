from __future__ import annotations

import json

import pytest

from kiln.store.atomic import append_jsonl, read_jsonl


def test_a_torn_line_followed_by_appends_is_skipped_with_skip_invalid(tmp_path):
    path = tmp_path / "rows.jsonl"
    append_jsonl(path, [{"n": 1}])
    with open(path, "ab") as f:
        f.write(b'{"n": 2, "tor')
    append_jsonl(path, [{"n": 3}])
    assert read_jsonl(path, skip_invalid=True) == [{"n": 1}, {"n": 3}]
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)


def test_a_tail_torn_inside_a_multibyte_character_is_dropped(tmp_path):
    path = tmp_path / "rows.jsonl"
    append_jsonl(path, [{"n": 1}])
    with open(path, "ab") as f:
        f.write('{"s": "é'.encode()[:-1])
    assert read_jsonl(path) == [{"n": 1}]
