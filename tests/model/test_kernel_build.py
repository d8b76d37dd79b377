"""How the C++ kernel library is named in the build cache (no compiler needed)."""

import shutil

from kiln.model import kernels


def _copy_sources_to(monkeypatch, folder) -> None:
    folder.mkdir()
    for name in ("SOURCES", "HEADERS"):
        copies = []
        for path in getattr(kernels, name):
            shutil.copy(path, folder / path.name)
            copies.append(folder / path.name)
        monkeypatch.setattr(kernels, name, copies)
    monkeypatch.setattr(kernels, "SOURCE", folder / kernels.SOURCE.name)


def test_two_checkouts_of_the_same_sources_build_apart(monkeypatch, tmp_path):
    here = kernels.extension_name()
    _copy_sources_to(monkeypatch, tmp_path / "elsewhere")
    assert kernels.extension_name() != here


def test_a_changed_source_gets_a_new_name(monkeypatch, tmp_path):
    _copy_sources_to(monkeypatch, tmp_path / "a")
    before = kernels.extension_name()
    kernels.SOURCES[0].write_text(kernels.SOURCES[0].read_text() + "\n// changed\n")
    assert kernels.extension_name() != before


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path) -> None:
    import os
    import time

    from kiln.model import kernels

    lock = tmp_path / "lock"
    lock.touch()
    assert not kernels._clear_stale_lock(tmp_path)        # fresh: a build may be starting
    old = time.time() - kernels.STALE_LOCK_SECS - 5
    os.utime(lock, (old, old))
    assert kernels._clear_stale_lock(tmp_path)
    assert not lock.exists()


def test_a_lock_whose_build_is_running_stays(tmp_path, monkeypatch) -> None:
    import os
    import time

    from kiln.model import kernels

    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - kernels.STALE_LOCK_SECS - 5
    os.utime(lock, (old, old))
    monkeypatch.chdir(tmp_path)   # this process "builds" there, as ninja would
    assert not kernels._clear_stale_lock(tmp_path)
    assert lock.exists()
