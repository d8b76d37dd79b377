"""Atomic writes leave files with the permissions a plain write would."""

from __future__ import annotations

import os
import stat

from kiln.store.atomic import atomic_write_json, atomic_write_text


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_file_gets_the_permissions_open_would_give_it(tmp_path):
    # mkstemp's temp files are 0600: an adapter_config.json or a report written so would be unreadable
    # to another user while the weights beside it (written by open) are not
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic_write_text(tmp_path / "atomic.txt", "x")
    assert _mode(tmp_path / "atomic.txt") == _mode(plain)


def test_replacing_a_file_keeps_its_permissions(tmp_path):
    path = tmp_path / "state.json"
    atomic_write_json(path, {"a": 1})
    os.chmod(path, 0o640)
    atomic_write_json(path, {"a": 2})
    assert _mode(path) == 0o640
    assert path.read_text() == '{\n  "a": 2\n}\n'
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temp file left behind
