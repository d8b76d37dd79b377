"""Pack a folder as the tar.gz an adapter upload takes (the CLI's `adapters upload`, `--lora-modules`)."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path


def pack_folder(path: Path) -> bytes:
    """tar.gz of a folder's regular files, flat; symlinks and special files are skipped."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for dirpath, _, filenames in os.walk(path):
            for fname in sorted(filenames):
                full = Path(dirpath, fname)
                if not stat.S_ISREG(full.lstat().st_mode):
                    continue
                tar.add(full, arcname=full.relative_to(path).as_posix(), recursive=False)
    return buf.getvalue()
