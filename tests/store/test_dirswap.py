from __future__ import annotations

import os

import pytest

from kiln.store import dirswap


def make(root, name: str, content: str):
    path = root / name
    path.mkdir(parents=True)
    (path / "f").write_text(content)
    return path


def staged(root, name: str, content: str):
    path = dirswap.make_staging(root, name)
    (path / "f").write_text(content)
    return path


def test_publish_moves_a_staging_directory_into_place(tmp_path):
    dirswap.publish_new(staged(tmp_path, "ds", "new"), tmp_path / "ds")
    assert (tmp_path / "ds" / "f").read_text() == "new" and os.listdir(tmp_path) == ["ds"]


def test_publish_refuses_to_overwrite(tmp_path):
    make(tmp_path, "ds", "old")
    with pytest.raises(FileExistsError):
        dirswap.publish_new(staged(tmp_path, "ds", "new"), tmp_path / "ds")


def test_replace_swaps_and_drops_the_old_copy(tmp_path):
    make(tmp_path, "ds", "old")
    dirswap.replace(staged(tmp_path, "ds", "new"), tmp_path / "ds")
    assert (tmp_path / "ds" / "f").read_text() == "new" and os.listdir(tmp_path) == ["ds"]


def test_remove_deletes_the_directory(tmp_path):
    make(tmp_path, "ds", "old")
    dirswap.remove(tmp_path / "ds")
    assert os.listdir(tmp_path) == []


def test_recover_deletes_an_unpublished_staging_copy(tmp_path):
    make(tmp_path, "ds", "old")
    staged(tmp_path, "ds", "half-built")
    dirswap.recover(tmp_path, "ds")
    assert os.listdir(tmp_path) == ["ds"] and (tmp_path / "ds" / "f").read_text() == "old"


def test_recover_restores_the_old_copy_when_a_replace_died_between_renames(tmp_path):
    make(tmp_path, "ds", "old")
    stage = staged(tmp_path, "ds", "new")
    os.rename(tmp_path / "ds", tmp_path / f"{dirswap.OLD}{'0' * 32}-ds")  # first rename only
    dirswap.recover(tmp_path, "ds")
    assert (tmp_path / "ds" / "f").read_text() == "old"
    assert not stage.exists() and os.listdir(tmp_path) == ["ds"]


def test_recover_drops_the_old_copy_when_the_replace_finished(tmp_path):
    make(tmp_path, "ds", "new")
    make(tmp_path, f"{dirswap.OLD}{'1' * 32}-ds", "old")
    dirswap.recover(tmp_path, "ds")
    assert os.listdir(tmp_path) == ["ds"] and (tmp_path / "ds" / "f").read_text() == "new"


def test_recover_finishes_a_removal(tmp_path):
    make(tmp_path, f"{dirswap.TRASH}{'2' * 32}-ds", "old")
    dirswap.recover(tmp_path, "ds")
    assert os.listdir(tmp_path) == []


def test_recover_leaves_other_names_alone(tmp_path):
    other = staged(tmp_path, "other", "x")
    dirswap.recover(tmp_path, "ds")
    assert other.exists()


def test_scratch_names_parse_names_containing_dashes(tmp_path):
    staged(tmp_path, "my-data-set", "x")
    make(tmp_path, "plain", "y")
    assert dirswap.scratch_names(tmp_path) == {"my-data-set"}
    assert dirswap.scratch_owner("plain") is None
