"""The startup sweep: each store removes its own orphaned temp files and half-made
directories, restores a half-replaced adapter, and never touches a committed file."""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from pathlib import Path

import torch

from kiln.adapters.peft_format import config_dict
from kiln.adapters.store import AdapterStore
from kiln.api.lifecycle import startup_sweep
from kiln.config import Settings
from kiln.data.datasets import DatasetStore
from kiln.data.judgments import JudgmentStore
from kiln.evals.job_store import EvalJobStore
from kiln.evals.suite import parse_suite
from kiln.evals.suite_store import SuiteStore
from kiln.server import build_state
from kiln.store.sweep import LiveLock, sweep_all
from kiln.train.checkpoint import CheckpointStore

ROW = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
SUITE = {"name": "s1", "schema_version": 2, "default_scorer": {"kind": "regex", "pattern": "."},
         "examples": [{"id": "e1", "messages": [{"role": "user", "content": "hi"}]}]}


def committed(root: Path) -> dict[str, str]:
    """Every file whose name does not start with '.' (and not under a dot folder), with its hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for f in filenames:
            if not f.startswith("."):
                p = Path(dirpath, f)
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def scratch(root: Path) -> list[str]:
    return sorted(e for e in os.listdir(root) if e.startswith(".") and e != ".locks")


def tiny_adapter(store: AdapterStore, name: str, value: float) -> None:
    a, b = torch.full((2, 8), value), torch.full((8, 2), value)
    store.save_adapter(name, {(0, "q_proj"): (a, b)}, config_dict(2, 4.0, ["q_proj"]))


def test_dataset_and_judgment_sweeps_remove_staging_and_temp_files_only(tmp_path):
    datasets, judgments = DatasetStore(tmp_path / "datasets"), JudgmentStore(tmp_path / "judgments")
    datasets.create_rows("ds", [ROW] * 3)
    judgments.create("prefs")
    judgments.append("prefs", {"prompt": [{"role": "user", "content": "q"}], "response_a": "a", "response_b": "b",
                               "winner": "a"})
    before = committed(tmp_path)
    (tmp_path / "datasets" / f".tmp-{uuid.uuid4().hex}-new").mkdir()
    (tmp_path / "datasets" / f".trash-{uuid.uuid4().hex}-gone").mkdir()
    (tmp_path / "judgments" / "prefs" / ".judgments.jsonl.abcd1234.tmp").write_bytes(b"half")
    (tmp_path / "judgments" / "prefs" / ".manifest.json.abcd1234.tmp").write_bytes(b"{")
    removed = datasets.sweep() + judgments.sweep()
    assert len(removed) == 4
    assert scratch(tmp_path / "datasets") == [] and scratch(tmp_path / "judgments" / "prefs") == []
    assert committed(tmp_path) == before
    assert len(judgments.rows("prefs")) == 1 and datasets.get("ds")["num_rows"] == 3


def test_a_dataset_replace_killed_between_its_renames_is_rolled_back(tmp_path):
    datasets = DatasetStore(tmp_path / "datasets")
    datasets.create_rows("ds", [ROW] * 2)
    os.rename(tmp_path / "datasets" / "ds", tmp_path / "datasets" / f".old-{uuid.uuid4().hex}-ds")
    assert any(line.startswith("restored") for line in datasets.sweep())
    assert datasets.get("ds")["num_rows"] == 2


def test_suite_sweep_removes_tombs_and_folders_without_a_suite_file(tmp_path):
    suites = SuiteStore(tmp_path / "suites")
    suites.save(parse_suite(SUITE))
    before = committed(tmp_path)
    (tmp_path / "suites" / ".deleting-old-1234abcd").mkdir()
    (tmp_path / "suites" / ".deleting-old-1234abcd" / "suite.json").write_text("{}")
    half = tmp_path / "suites" / "half"
    half.mkdir()
    (half / ".suite.json.zz12ab34.tmp").write_text("{")
    (tmp_path / "suites" / "s1" / ".suite.json.qq12ab34.tmp").write_text("{")
    keep = tmp_path / "suites" / "notes"   # a folder with a file we did not write: not ours to delete
    keep.mkdir()
    (keep / "README").write_text("mine")
    assert len(suites.sweep()) == 4
    assert sorted(os.listdir(tmp_path / "suites")) == ["notes", "s1"]
    assert committed(tmp_path) == {**before, "suites/notes/README": committed(tmp_path)["suites/notes/README"]}
    assert suites.names() == ["s1"]


def test_adapter_sweep_restores_a_replace_killed_between_renames_and_drops_other_scratch(tmp_path):
    store = AdapterStore(tmp_path / "adapters")
    tiny_adapter(store, "kept", 1.0)
    tiny_adapter(store, "replaced", 2.0)
    tiny_adapter(store, "both", 3.0)
    before = committed(tmp_path)
    root = tmp_path / "adapters"
    os.rename(root / "replaced", root / f".old-{uuid.uuid4().hex}-replaced")      # killed mid-replace
    (root / f".old-{uuid.uuid4().hex}-both").mkdir()                              # replace done, not cleaned
    (root / f".tmp-{uuid.uuid4().hex}").mkdir()
    (root / f".trash-{uuid.uuid4().hex}").mkdir()
    actions = store.sweep()
    assert sum(a.startswith("restored") for a in actions) == 1 and len(actions) == 4
    assert scratch(root) == [] and store.names() == ["both", "kept", "replaced"]
    assert committed(tmp_path) == before


def test_record_and_checkpoint_sweeps(tmp_path):
    records = EvalJobStore(tmp_path / "jobs")
    records.write("job1", {"x": 1})
    (tmp_path / "jobs" / ".job1.json.ab12cd34.tmp").write_text("{")
    ckpts = CheckpointStore(tmp_path / "ckpt")
    ckpts.save_request("train-a", "sft", {"examples": [ROW]})
    (ckpts.dir("train-half")).mkdir()                       # killed before its request was written
    (ckpts.dir("train-a") / ".state.pt.ab12cd34.tmp").write_bytes(b"x")
    (tmp_path / "ckpt" / f".trash-{uuid.uuid4().hex}-train-b").mkdir()
    before = committed(tmp_path)
    assert len(records.sweep()) == 1 and len(ckpts.sweep()) == 3
    assert committed(tmp_path) == before and sorted(os.listdir(tmp_path / "ckpt")) == ["train-a"]


def test_the_server_sweeps_every_store_and_logs_what_it_removed(tmp_path, caplog):
    from kiln.api.app import create_app

    settings = Settings()
    settings.data.data_dir = str(tmp_path / "data")
    state = build_state(settings)
    create_app(settings, state)
    orphan = tmp_path / "data" / "eval" / "jobs" / ".j.json.ab12cd34.tmp"
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_text("{")
    with caplog.at_level(logging.INFO, logger="kiln.store"):
        results, locks = startup_sweep(state)
    try:
        assert {"datasets", "judgments", "adapter_store", "eval_suites", "eval_jobs", "training"} <= set(results)
        assert not orphan.exists() and str(orphan) in caplog.text
    finally:
        for lock in locks:
            lock.close()


def test_no_sweep_while_another_live_server_holds_the_data_dir(tmp_path, caplog):
    other = LiveLock(tmp_path)
    other.share()
    orphan = tmp_path / ".x.json.ab12cd34.tmp"
    orphan.write_text("{")

    class Store:
        def sweep(self) -> list[str]:
            orphan.unlink()
            return ["removed"]

    with caplog.at_level(logging.WARNING, logger="kiln.store"):
        results, locks = sweep_all({"s": Store()}, [tmp_path])
    assert results == {} and orphan.exists() and "skipped" in caplog.text
    for lock in [*locks, other]:
        lock.close()
