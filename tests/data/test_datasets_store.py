from __future__ import annotations

import hashlib
import json
import os

import pytest

from kiln.data.datasets import DatasetStore
from kiln.errors import KilnError
from kiln.testing.schemas import validate
from tests.data.conftest import jsonl, sft

EVALS = "kiln-evals-v1.schema.json"
ROWS = [sft(f"question {i}", f"answer {i}") for i in range(30)]


def entries(store: DatasetStore) -> list[str]:
    return sorted(e for e in os.listdir(store.root) if e != ".locks")


def test_create_writes_every_file_and_a_schema_valid_v2_manifest(datasets):
    manifest = datasets.create("math", jsonl(ROWS), fmt="sft", description="  arithmetic ")
    validate(EVALS, "DatasetManifest", manifest)
    assert manifest["format"] == "sft_chat" and manifest["description"] == "arithmetic"
    assert manifest["num_rows"] == 30 and sum(manifest["split_counts"].values()) == 30
    files = sorted(os.listdir(datasets.root / "math"))
    assert files == ["data.jsonl", "holdout.jsonl", "identity.json", "manifest.json", "split.json",
                     "train.jsonl", "validation.jsonl"]
    assert (datasets.root / "math" / "data.jsonl").read_bytes() == jsonl(ROWS)
    assert manifest["size_bytes"] == len(jsonl(ROWS))


def test_split_manifest_hash_matches_the_persisted_split_json(datasets):
    manifest = datasets.create("math", jsonl(ROWS))
    split_bytes = (datasets.root / "math" / "split.json").read_bytes()
    assert manifest["split_manifest_sha256"] == "sha256:" + hashlib.sha256(split_bytes).hexdigest()
    split = datasets.split_manifest("math")
    validate(EVALS, "DatasetSplitManifest", split)
    assert split["corpus_sha256"] == manifest["corpus_sha256"]


def test_partition_files_hold_exactly_the_rows_assigned_to_them(datasets):
    datasets.create("math", jsonl(ROWS))
    split = datasets.split_manifest("math")
    for part in ("train", "validation", "holdout"):
        expected = [ROWS[r["row_number"] - 1] for r in split["rows"] if r["split"] == part]
        assert datasets.read_rows("math", part) == expected


def test_same_bytes_and_config_give_byte_identical_split_manifests(tmp_path):
    a, b = DatasetStore(tmp_path / "a"), DatasetStore(tmp_path / "b")
    a.create("same", jsonl(ROWS))
    b.create("same", jsonl(ROWS))
    assert (a.root / "same" / "split.json").read_bytes() == (b.root / "same" / "split.json").read_bytes()


def test_json_array_upload_is_rewritten_as_compact_jsonl(datasets):
    manifest = datasets.create("arr", json.dumps(ROWS[:3], indent=2).encode())
    assert manifest["num_rows"] == 3
    data = (datasets.root / "arr" / "data.jsonl").read_bytes()
    assert data == b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in ROWS[:3])


def test_raw_dataset_is_stored_verbatim_even_when_it_starts_with_a_bracket(datasets):
    body = b"[not an array\nplain text\n\n{\"k\": 1}\n"
    manifest = datasets.create("raw", body, fmt="raw")
    assert manifest["num_rows"] == 3
    assert (datasets.root / "raw" / "data.jsonl").read_bytes() == body
    assert datasets.read_rows("raw") == ["[not an array", "plain text", {"k": 1}]


def test_invalid_row_names_its_line_and_leaves_nothing_behind(datasets):
    body = jsonl(ROWS[:2]) + b"\n" + b'{"messages": "nope"}\n'
    with pytest.raises(KilnError) as e:
        datasets.create("bad", body)
    assert e.value.status == 400 and e.value.code == "dataset_invalid"
    assert "line 4 is not an SFT chat row" in e.value.message
    assert entries(datasets) == []


def test_json_array_item_errors_name_the_item(datasets):
    with pytest.raises(KilnError) as e:
        datasets.create("bad", json.dumps([ROWS[0], {"messages": []}]).encode())
    assert "array item 2 is not an SFT chat row" in e.value.message


def test_empty_file_is_rejected(datasets):
    with pytest.raises(KilnError) as e:
        datasets.create("empty", b"\n  \n")
    assert e.value.code == "dataset_invalid" and "at least one non-empty row" in e.value.message
    assert entries(datasets) == []


def test_existing_name_is_a_409_and_keeps_the_original(datasets):
    first = datasets.create("math", jsonl(ROWS))
    with pytest.raises(KilnError) as e:
        datasets.create("math", jsonl(ROWS[:1]))
    assert e.value.status == 409 and e.value.code == "dataset_exists"
    assert datasets.get("math") == first


def test_list_is_newest_first(datasets):
    for name in ("one", "two", "three"):
        datasets.create(name, jsonl(ROWS[:2]))
    assert [m["name"] for m in datasets.list()] == ["three", "two", "one"]


def test_groups_and_sessions_are_counted(datasets):
    rows = [sft("a", group_id="g1"), sft("b", group_id="g1"), sft("c", metadata={"session_id": "s"}), sft("d")]
    manifest = datasets.create("linked", jsonl(rows))
    assert (manifest["num_groups"], manifest["num_sessions"]) == (1, 1)


def test_read_rows_limit_and_empty_partition_error(datasets):
    datasets.create("tiny", jsonl(ROWS[:1]))
    assert datasets.read_rows("tiny", limit=1) == ROWS[:1]
    assert datasets.read_rows("tiny", "holdout") == []
    with pytest.raises(KilnError) as e:
        datasets.read_rows("tiny", "holdout", nonempty=True)
    assert e.value.code == "dataset_invalid"


def test_set_split_resplits_and_keeps_identity(datasets):
    before = datasets.create("math", jsonl(ROWS))
    split = datasets.set_split("math", {"seed": "7", "train_percent": 50, "validation_percent": 30})
    after = datasets.get("math")
    assert split["config"] == {"seed": "7", "train_percent": 50, "validation_percent": 30}
    assert after["split_config"] == split["config"] and after["split_counts"] == split["counts"]
    assert after["corpus_sha256"] == before["corpus_sha256"] and after["created_at"] == before["created_at"]
    assert after["updated_at"] > before["updated_at"]
    assert len(datasets.read_rows("math", "validation")) == split["counts"]["validation"]
    assert entries(datasets) == ["math"]


def test_resplitting_back_restores_the_original_bytes(datasets):
    datasets.create("math", jsonl(ROWS))
    original = (datasets.root / "math" / "split.json").read_bytes()
    datasets.set_split("math", {"seed": 1})
    datasets.set_split("math", {"seed": 0, "train_percent": 80, "validation_percent": 10})
    assert (datasets.root / "math" / "split.json").read_bytes() == original


def test_an_open_row_iterator_survives_a_split_change(datasets):
    datasets.create("math", jsonl(ROWS))
    it = datasets.iter_rows("math")
    first = next(it)
    datasets.set_split("math", {"seed": 3})
    assert [first, *it] == ROWS


def test_delete_removes_the_dataset(datasets):
    datasets.create("math", jsonl(ROWS))
    datasets.delete("math")
    assert entries(datasets) == []
    with pytest.raises(KilnError) as e:
        datasets.get("math")
    assert e.value.status == 404 and e.value.code == "dataset_not_found"
    with pytest.raises(KilnError):
        datasets.delete("math")


def test_an_old_manifest_is_rebuilt_on_first_access(datasets):
    current = datasets.create("math", jsonl(ROWS), description="kept")
    path = datasets.root / "math" / "manifest.json"
    path.write_text(json.dumps({"schema_version": 1, "name": "math", "format": "sft_chat",
                                "description": "kept", "created_at": current["created_at"]}))
    rebuilt = datasets.get("math")
    validate(EVALS, "DatasetManifest", rebuilt)
    assert rebuilt["description"] == "kept" and rebuilt["corpus_sha256"] == current["corpus_sha256"]
    assert rebuilt["split_manifest_sha256"] == current["split_manifest_sha256"]


def test_a_missing_manifest_is_rebuilt_from_data(datasets):
    current = datasets.create("math", jsonl(ROWS))
    (datasets.root / "math" / "manifest.json").unlink()
    assert datasets.get("math")["normalized_corpus_sha256"] == current["normalized_corpus_sha256"]


def test_a_newer_manifest_schema_is_rejected(datasets):
    datasets.create("math", jsonl(ROWS))
    path = datasets.root / "math" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema_version": 3}))
    with pytest.raises(KilnError) as e:
        datasets.get("math")
    assert "schema_version 3" in e.value.message


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "", " ", "  x", "x ", ".hidden", "a\\b", "a..b"])
def test_hostile_names_are_rejected_by_every_operation(datasets, name):
    calls = [
        lambda: datasets.create(name, jsonl(ROWS[:1])), lambda: datasets.get(name),
        lambda: datasets.read_rows(name), lambda: datasets.iter_rows(name), lambda: datasets.split_manifest(name),
        lambda: datasets.set_split(name, {}), lambda: datasets.delete(name),
    ]
    for call in calls:
        with pytest.raises(KilnError) as e:
            call()
        assert e.value.status == 400 and e.value.code == "dataset_invalid"
    assert entries(datasets) == []
    assert not (datasets.root.parent / "x").exists()


def test_unavailable_store_is_a_503(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = DatasetStore(blocker / "datasets")
    with pytest.raises(KilnError) as e:
        store.list()
    assert e.value.status == 503 and e.value.code == "dataset_registry_unavailable"


def test_listing_does_not_wait_for_an_upload_in_progress(datasets):
    from kiln.store import dirswap
    from kiln.store.locks import resource_lock

    datasets.create("done", jsonl(ROWS[:2]))
    with resource_lock(datasets.root, "busy"):  # as an upload of "busy" holds it
        staging = dirswap.make_staging(datasets.root, "busy")
        assert [m["name"] for m in datasets.list()] == ["done"]
        assert staging.exists()  # a live writer's staging copy is not swept away
