"""How the C++ kernel library is named in the build cache (no compiler needed)."""

import shutil
from pathlib import Path

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


def test_the_build_directory_is_torchs(monkeypatch, tmp_path) -> None:
    from torch.utils import cpp_extension

    for env in (None, str(tmp_path)):
        if env is None:
            monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCH_EXTENSIONS_DIR", env)
        name = "kiln_kernels_test_dir"
        assert kernels.build_directory(name) == Path(cpp_extension._get_build_directory(name, verbose=False))


def test_a_library_under_construction_is_left_to_torchs_builder(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = kernels.extension_name()
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"half a library")
    (tmp_path / name / "lock").touch()
    assert kernels._cached_library() is None
