"""docs/DESIGN.md's three walks name real code: every `name` they cite is defined in kiln/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Cited in the walks but not definitions: wire fields, error codes, settings and payload names.
NOT_CODE = {"DONE", "model_loading", "rollout_provenance", "post_eval", "webhook_url", "thinking_budget", "finally"}
LIBRARY = {"JSONResponse", "EventSourceResponse", "call_soon_threadsafe"}


def walk_names() -> set[str]:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    walks = text[text.index("## Three walks through the code"):]
    names = set()
    for token in re.findall(r"`([^`]+)`", walks):
        for part in re.findall(r"[A-Za-z_][\w.]*(?=\(|$|\s|\))", token):
            last = part.rstrip(".").split(".")[-1]
            if last and not last.endswith(("py", "md")) and last not in NOT_CODE and not last.isupper():
                names.add(last)
    return names


def defined_names() -> set[str]:
    names = set(LIBRARY)
    for path in (ROOT / "kiln").rglob("*.py"):
        names.add(path.stem)
        src = path.read_text()
        names.update(re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", src, re.M))
        names.update(re.findall(r"^\s*(?:self\.)?(\w+)\s*(?::[^=\n]+)?=", src, re.M))
    return names


def test_every_function_a_walk_names_exists():
    assert walk_names() - defined_names() == set()
