"""Publish, replace and remove a whole resource directory so a crash leaves the old or the new one.

A resource made of several files (a dataset: data, manifest, split, partitions) is built complete in
a staging directory next to its final place, then moved in with `rename`, which is atomic:

- create:  stage -> final
- replace: final -> .old-*, stage -> final, then the old copy is deleted
- remove:  final -> .trash-*, then deleted

`recover(root, name)` (called under the resource's lock) finishes or rolls back whatever a killed
process left: staging and trash copies are deleted; an `.old-*` copy with no final directory means
the replace died between its two renames, so the old copy is put back.
Scratch names start with "." and embed a 32-hex token before the resource name, which keeps them
apart from real names (those never start with ".").
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from kiln.store.atomic import fsync_path

STAGE, OLD, TRASH = ".tmp-", ".old-", ".trash-"
_TOKEN_LEN = 32


def _scratch(root: Path, prefix: str, name: str) -> Path:
    return root / f"{prefix}{uuid.uuid4().hex}-{name}"


def scratch_owner(entry: str) -> tuple[str, str] | None:
    """(prefix, resource name) of a scratch directory name, or None for anything else."""
    for prefix in (STAGE, OLD, TRASH):
        if entry.startswith(prefix):
            rest = entry[len(prefix):]
            token, sep, name = rest[:_TOKEN_LEN], rest[_TOKEN_LEN:_TOKEN_LEN + 1], rest[_TOKEN_LEN + 1:]
            if sep == "-" and name and all(c in "0123456789abcdef" for c in token):
                return prefix, name
    return None


def make_staging(root: Path, name: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = _scratch(root, STAGE, name)
    path.mkdir()
    return path


def discard(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def publish_new(staging: Path, final: Path) -> None:
    """Move a complete staging directory to a final path that does not exist yet."""
    if final.exists():
        raise FileExistsError(final)
    fsync_path(staging)
    os.rename(staging, final)
    fsync_path(final.parent)


def replace(staging: Path, final: Path) -> None:
    """Swap a complete staging directory in for an existing final directory."""
    fsync_path(staging)
    old = _scratch(final.parent, OLD, final.name)
    os.rename(final, old)
    fsync_path(final.parent)
    try:
        os.rename(staging, final)
    except BaseException:
        os.rename(old, final)
        raise
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove(final: Path) -> None:
    trash = _scratch(final.parent, TRASH, final.name)
    os.rename(final, trash)
    fsync_path(final.parent)
    shutil.rmtree(trash, ignore_errors=True)


def recover(root: Path, name: str) -> list[str]:
    """Settle scratch copies of `name` left by a killed writer. Call with the resource lock held.

    Returns what it did, one line each ("removed <path>", "restored <path>"), for the startup sweep's log."""
    done: list[str] = []
    if not root.is_dir():
        return done
    final = root / name
    olds: list[Path] = []
    for entry in os.listdir(root):
        owner = scratch_owner(entry)
        if owner is None or owner[1] != name:
            continue
        prefix = owner[0]
        if prefix == OLD:
            olds.append(root / entry)
        else:
            shutil.rmtree(root / entry, ignore_errors=True)
            done.append(f"removed {root / entry}")
    if olds and not final.exists():
        # Only one replace runs at a time per name, so there is at most one old copy to restore.
        old = olds.pop()
        os.rename(old, final)
        fsync_path(root)
        done.append(f"restored {final} from {old.name}")
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)
        done.append(f"removed {old}")
    return done


def scratch_names(root: Path) -> set[str]:
    """Names of resources that have scratch copies under `root`."""
    if not root.is_dir():
        return set()
    out = set()
    for entry in os.listdir(root):
        owner = scratch_owner(entry)
        if owner is not None:
            out.add(owner[1])
    return out
