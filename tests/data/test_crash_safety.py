"""SIGKILL a writer at random instants; every file must still parse and every acknowledged change survive."""

from __future__ import annotations

import hashlib
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kiln.data.datasets import DatasetStore
from kiln.data.identity import corpus_sha256
from kiln.data.ingest import scan
from kiln.data.judgments import JudgmentStore
from kiln.store import dirswap
from kiln.testing.schemas import validate

WRITER = Path(__file__).with_name("crash_writer.py")
EVALS = "kiln-evals-v1.schema.json"
ITERATIONS = 8


def run_writer_and_kill(root: Path, seed: int, delay: float) -> list[list[str]]:
    proc = subprocess.Popen([sys.executable, str(WRITER), str(root), str(seed)], stdout=subprocess.PIPE)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, out
    lines = out.decode().split("\n")
    return [line.split() for line in lines[:-1]]  # the last piece may be a half-printed line


def check_dataset(store: DatasetStore, name: str) -> dict:
    manifest = store.get(name)
    validate(EVALS, "DatasetManifest", manifest)
    folder = store.root / name
    split_bytes = (folder / "split.json").read_bytes()
    assert manifest["split_manifest_sha256"] == "sha256:" + hashlib.sha256(split_bytes).hexdigest()
    split = json.loads(split_bytes)
    validate(EVALS, "DatasetSplitManifest", split)
    assert split["config"] == manifest["split_config"]
    for part, count in manifest["split_counts"].items():
        assert len(store.read_rows(name, part)) == count
    scanned = scan(folder / "data.jsonl", manifest["format"])
    assert corpus_sha256(r.content_sha256 for r in scanned.rows) == manifest["corpus_sha256"]
    assert json.loads((folder / "identity.json").read_text())["corpus_sha256"] == manifest["corpus_sha256"]
    return manifest


def test_killed_writers_leave_old_or_new_state_and_keep_every_acknowledged_change(tmp_path):
    rnd = random.Random(1234)
    acked_rows: set[str] = set()
    deleted_rows: set[str] = set()
    acked_datasets: set[str] = set()
    split_seeds: dict[str, set[str]] = {}  # dataset -> seeds it may have now
    split_acked: set[str] = set()
    for iteration in range(ITERATIONS):
        events = run_writer_and_kill(tmp_path, iteration, rnd.uniform(0.15, 0.6))
        kills = iteration + 1
        for ev in events:
            kind, op, *args = ev
            if op == "append" and kind == "ACK":
                acked_rows.add(args[0])
            elif op == "delete_row":
                deleted_rows.add(args[0])  # may or may not have happened when only begun
                if kind == "ACK":
                    acked_rows.discard(args[0])
            elif op in ("upload", "compile") and kind == "ACK":
                acked_datasets.add(args[0])
            elif op == "split":
                name, seed = args
                if kind == "ACK":
                    split_seeds[name] = {seed}
                    split_acked.add(name)
                else:
                    split_seeds.setdefault(name, set()).add(seed)

        datasets, judgments = DatasetStore(tmp_path / "datasets"), JudgmentStore(tmp_path / "judgments")
        listed = {m["name"] for m in datasets.list()}
        assert acked_datasets <= listed
        for root in (datasets.root, judgments.root):
            assert dirswap.scratch_names(root) == set(), "recovery left scratch directories"
        for name in listed:
            manifest = check_dataset(datasets, name)
            if name in split_seeds:
                allowed = split_seeds[name] | (set() if name in split_acked else {"0"})
                assert manifest["split_config"]["seed"] in allowed, "a split change was lost or torn"

        manifest = judgments.get("prefs")
        validate(EVALS, "JudgmentManifest", manifest)
        json.loads((judgments.root / "prefs" / "manifest.json").read_text())
        ids = {r["id"] for r in judgments.rows("prefs")}
        assert acked_rows - deleted_rows <= ids, "an acknowledged judgment was lost"
        assert manifest["num_rows"] == len(ids)
        raw_lines = (judgments.root / "prefs" / "judgments.jsonl").read_bytes().split(b"\n")
        torn = 0
        for line in raw_lines:
            if line.strip():
                try:
                    json.loads(line)
                except ValueError:
                    torn += 1
        assert torn <= kills, "more unparseable lines than kills"
    assert acked_rows and acked_datasets, "the writer never got far enough to test anything"

