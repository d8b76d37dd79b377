"""Crash-test writer: mutates a data dir through the store API forever, printing what it did.

`BEGIN <op> ...` goes out before an operation starts and `ACK <op> ...` only after the store call
returned, i.e. after the change is durable. The test SIGKILLs this process at a random moment.
Usage: python crash_writer.py DATA_DIR SEED
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kiln.data.datasets import DatasetStore  # noqa: E402
from kiln.data.judgments import JudgmentStore  # noqa: E402
from kiln.errors import KilnError  # noqa: E402

JUDGMENTS = "prefs"


def say(*parts: object) -> None:
    print(*parts, flush=True)


def corpus(rnd: random.Random, n: int) -> bytes:
    rows = []
    for i in range(n):
        row = {"messages": [{"role": "user", "content": f"q {rnd.random()} {i}"},
                            {"role": "assistant", "content": "x" * rnd.randint(1, 400)}]}
        if rnd.random() < 0.3:
            row["group_id"] = f"g{rnd.randint(0, 5)}"
        rows.append(row)
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def main() -> None:
    root, seed = Path(sys.argv[1]), int(sys.argv[2])
    rnd = random.Random(seed)
    datasets, judgments = DatasetStore(root / "datasets"), JudgmentStore(root / "judgments")
    with contextlib.suppress(KilnError):  # created by an earlier run
        judgments.create(JUDGMENTS)
    names = [m["name"] for m in datasets.list()]
    tag = f"{os.getpid()}-{seed}"
    for i in range(10**9):
        op = rnd.choice(["append"] * 4 + ["upload", "split", "compile", "delete_row"])
        if op == "append":
            row_id = f"{tag}-{i}"
            say("BEGIN append", row_id)
            judgments.append(JUDGMENTS, {"id": row_id, "prompt": [{"role": "user", "content": f"q{i}"}],
                                         "response_a": "a" * rnd.randint(1, 2000), "response_b": "b",
                                         "winner": rnd.choice(["a", "b", "tie", "skip"])})
            say("ACK append", row_id)
        elif op == "upload":
            name = f"up-{tag}-{i}"
            say("BEGIN upload", name)
            datasets.create(name, corpus(rnd, rnd.randint(1, 150)))
            names.append(name)
            say("ACK upload", name)
        elif op == "split" and names:
            name, new_seed = rnd.choice(names), rnd.randint(0, 2**64 - 1)
            say("BEGIN split", name, new_seed)
            datasets.set_split(name, {"seed": str(new_seed), "train_percent": rnd.randint(1, 89)})
            say("ACK split", name, new_seed)
        elif op == "compile":
            name = f"comp-{tag}-{i}"
            say("BEGIN compile", name)
            try:
                judgments.compile(JUDGMENTS, datasets, name, holdout_n=0)
            except KilnError as e:  # e.g. only skip rows so far
                say("SKIP compile", name, e.code)
                continue
            names.append(name)
            say("ACK compile", name)
        elif op == "delete_row":
            rows = judgments.rows(JUDGMENTS)
            own = [r["id"] for r in rows if r["id"].startswith(f"{tag}-")]
            if own:
                row_id = rnd.choice(own)
                say("BEGIN delete_row", row_id)
                judgments.delete_row(JUDGMENTS, row_id)
                say("ACK delete_row", row_id)


if __name__ == "__main__":
    main()
