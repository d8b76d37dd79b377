"""How many parameters the benched model has, read from its file's tensor table (no weights loaded):
the bench holds a 135M model and a 1-8B one to different targets (`kiln.bench.targets`)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from kiln.model.gguf_file import read_gguf_tensor_infos


def parameter_count(path: str | Path) -> int | None:
    """The weights' element count of a GGUF file or an HF safetensors directory; None for anything else
    or a file that cannot be read."""
    p = Path(path)
    try:
        if p.is_file() and p.suffix == ".gguf":
            return sum(math.prod(t.shape) for t in read_gguf_tensor_infos(p))
        if p.is_dir():
            files = sorted(p.glob("*.safetensors"))
            return sum(_safetensors_elements(f) for f in files) if files else None
    except Exception:  # noqa: BLE001 - an unreadable table only leaves the small model's targets
        return None
    return None


def _safetensors_elements(path: Path) -> int:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def describe_parameters(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"
