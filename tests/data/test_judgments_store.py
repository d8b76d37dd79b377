from __future__ import annotations

import json
import os

import pytest

from kiln.data.judgment_compile import default_holdout, plan_compile
from kiln.data.judgment_rows import JudgmentRow
from kiln.errors import KilnError
from kiln.testing.schemas import validate
from tests.data.conftest import judgment

EVALS = "kiln-evals-v1.schema.json"


def test_create_makes_an_empty_set_with_a_valid_manifest(judgments):
    manifest = judgments.create("prefs", "Concise answers")
    validate(EVALS, "JudgmentManifest", manifest)
    assert manifest["num_rows"] == 0 and manifest["winner_histogram"] == {}
    assert (judgments.root / "prefs" / "judgments.jsonl").read_bytes() == b""


def test_create_existing_name_is_dataset_exists(judgments):
    judgments.create("prefs")
    with pytest.raises(KilnError) as e:
        judgments.create("prefs")
    assert e.value.status == 409 and e.value.code == "dataset_exists"


def test_append_assigns_an_id_and_returns_the_updated_manifest(judgments):
    judgments.create("prefs")
    resp = judgments.append("prefs", judgment(1, "b", adapter_a="", adapter_b="concise-v1", tags=["style"]))
    validate(EVALS, "AppendJudgmentResponse", resp)
    assert len(resp["judgment_id"]) == 36 and resp["num_rows"] == 1 and resp["winner_histogram"] == {"b": 1}
    stored = json.loads((judgments.root / "prefs" / "judgments.jsonl").read_text())
    assert stored["id"] == resp["judgment_id"] and stored["adapter_a"] is None
    assert stored["adapter_b"] == "concise-v1" and stored["tags"] == ["style"] and "note" not in stored
    assert stored["submitted_at"].endswith("Z")


def test_append_keeps_a_given_id_and_rejects_a_duplicate(judgments):
    judgments.create("prefs")
    assert judgments.append("prefs", judgment(id="j-1"))["judgment_id"] == "j-1"
    with pytest.raises(KilnError) as e:
        judgments.append("prefs", judgment(id="j-1"))
    assert e.value.status == 409


@pytest.mark.parametrize(("body", "param"), [
    ({"winner": "c"}, "winner"), ({"response_a": None}, "response_a"), ({"prompt": "hi"}, "prompt"),
    ({"prompt": [{"content": "x"}]}, "prompt[0]"), ({"tags": "x"}, "tags"), ({"id": "a/b"}, "id"),
])
def test_bad_append_bodies_are_judgment_invalid(judgments, body, param):
    judgments.create("prefs")
    with pytest.raises(KilnError) as e:
        judgments.append("prefs", {**judgment(), **body})
    assert e.value.code == "judgment_invalid" and e.value.param == param
    assert e.value.message.startswith("Invalid judgment: ")


def test_append_to_a_missing_set_is_judgment_not_found(judgments):
    with pytest.raises(KilnError) as e:
        judgments.append("nope", judgment())
    assert e.value.status == 404 and e.value.code == "judgment_not_found"


def test_rows_are_appended_in_order_and_counted_in_the_histogram(judgments):
    judgments.create("prefs")
    for i, w in enumerate(["a", "b", "a", "tie", "skip"]):
        judgments.append("prefs", judgment(i, w))
    manifest = judgments.get("prefs")
    assert manifest["num_rows"] == 5 and manifest["winner_histogram"] == {"a": 2, "b": 1, "tie": 1, "skip": 1}
    assert [r["prompt"][0]["content"] for r in judgments.rows("prefs")] == [f"question {i}" for i in range(5)]


def test_counts_come_from_the_rows_even_when_the_manifest_is_stale(judgments):
    judgments.create("prefs")
    judgments.append("prefs", judgment(1))
    path = judgments.root / "prefs" / "judgments.jsonl"
    row = {**json.loads(path.read_text()), "id": "late", "winner": "b"}
    with open(path, "a") as f:  # as if killed after the append, before the manifest rewrite
        f.write(json.dumps(row) + "\n")
    assert judgments.get("prefs")["winner_histogram"] == {"a": 1, "b": 1}


def test_a_torn_line_is_skipped_and_later_appends_still_read(judgments):
    judgments.create("prefs")
    judgments.append("prefs", judgment(1))
    with open(judgments.root / "prefs" / "judgments.jsonl", "ab") as f:
        f.write(b'{"id": "torn", "prom')
    judgments.append("prefs", judgment(2))
    assert [r["prompt"][0]["content"] for r in judgments.rows("prefs")] == ["question 1", "question 2"]


def test_delete_row_removes_one_row_and_keeps_unparseable_lines(judgments):
    judgments.create("prefs")
    ids = [judgments.append("prefs", judgment(i))["judgment_id"] for i in range(3)]
    path = judgments.root / "prefs" / "judgments.jsonl"
    with open(path, "ab") as f:
        f.write(b"garbage\n")
    manifest = judgments.delete_row("prefs", ids[1])
    validate(EVALS, "JudgmentManifest", manifest)
    assert manifest["num_rows"] == 2
    assert [r["id"] for r in judgments.rows("prefs")] == [ids[0], ids[2]]
    assert path.read_bytes().endswith(b"garbage\n")
    with pytest.raises(KilnError) as e:
        judgments.delete_row("prefs", ids[1])
    assert e.value.status == 404 and e.value.code == "judgment_not_found"


def test_delete_removes_the_set(judgments):
    judgments.create("prefs")
    judgments.delete("prefs")
    assert [e for e in os.listdir(judgments.root) if e != ".locks"] == []
    with pytest.raises(KilnError):
        judgments.get("prefs")


def test_list_shows_every_set(judgments):
    judgments.create("one")
    judgments.create("two")
    judgments.append("one", judgment())
    assert [m["name"] for m in judgments.list()] == ["one", "two"]


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "", " ", "x "])
def test_hostile_names_are_rejected(judgments, datasets, name):
    with pytest.raises(KilnError) as e:
        judgments.create(name)
    assert e.value.code == "dataset_invalid"
    for call in (lambda: judgments.get(name), lambda: judgments.append(name, judgment()),
                 lambda: judgments.delete_row(name, "x"), lambda: judgments.delete(name),
                 lambda: judgments.compile(name, datasets, "out")):
        with pytest.raises(KilnError) as e:
            call()
        assert e.value.status == 400 and e.value.code == "judgment_invalid"


# ---- compile ---------------------------------------------------------------------------------

def rows_of(winners: list[str]) -> list[JudgmentRow]:
    return [JudgmentRow(id=f"r{i}", prompt=[{"role": "user", "content": f"q{i}"}], response_a=f"A{i}",
                        response_b=f"B{i}", winner=w, submitted_at="2026-01-01T00:00:00Z", adapter_a="left",
                        note="because" if i == 0 else None) for i, w in enumerate(winners)]


def test_default_holdout_is_min_20_and_a_fifth():
    assert [default_holdout(n) for n in (1, 4, 5, 9, 10, 100, 101, 1000)] == [0, 0, 1, 1, 2, 20, 20, 20]


def test_every_training_row_is_emitted_twice_with_the_swap_flipping_the_label():
    plan = plan_compile("p", rows_of(["a", "b", "tie", "a", "b"]), holdout_n=1)
    assert plan.train_validation_split == 4 and len(plan.sft_rows) == 8
    labels = [r["messages"][2]["content"].split("\n")[0] for r in plan.sft_rows]
    assert labels == ["Winner: A", "Winner: B", "Winner: B", "Winner: A", "Winner: Tie", "Winner: Tie",
                      "Winner: A", "Winner: B"]
    original, swapped = plan.sft_rows[0], plan.sft_rows[1]
    assert "# Reply A\nA0\n\n# Reply B\nB0" in original["messages"][1]["content"]
    assert "# Reply A\nB0\n\n# Reply B\nA0" in swapped["messages"][1]["content"]
    assert swapped["messages"][2]["content"] == "Winner: B\nReason: because"
    assert (original["metadata"]["adapter_a"], swapped["metadata"]["adapter_b"]) == ("left", "left")
    assert original["group_id"] == swapped["group_id"]


def test_the_most_recent_rows_are_held_out():
    plan = plan_compile("p", rows_of(["a"] * 10), holdout_n=None)
    assert plan.holdout_n == 2
    assert {r["metadata"]["judgment_id"] for r in plan.sft_rows} == {f"r{i}" for i in range(8)}


def test_skips_are_dropped_and_include_skips_warns():
    plan = plan_compile("p", rows_of(["a", "skip", "b"]), holdout_n=0, include_skips=True)
    assert len(plan.sft_rows) == 4
    assert any("holdout_n is 0" in w for w in plan.warnings)
    assert any("skip" in w for w in plan.warnings)


@pytest.mark.parametrize(("winners", "holdout"), [([], None), (["a", "b"], 2), (["skip", "skip", "a"], 1)])
def test_nothing_to_train_on_is_judgment_invalid(winners, holdout):
    with pytest.raises(KilnError) as e:
        plan_compile("p", rows_of(winners), holdout_n=holdout)
    assert e.value.code == "judgment_invalid"


def test_compile_writes_an_sft_dataset_and_records_the_split(judgments, datasets):
    judgments.create("prefs")
    for i in range(6):
        judgments.append("prefs", judgment(i, "ab"[i % 2]))
    resp = judgments.compile("prefs", datasets, "prefs-sft")
    validate(EVALS, "CompileJudgmentResponse", resp)
    assert (resp["rows"], resp["holdout_n"], resp["train_validation_split"]) == (10, 1, 5)
    assert resp["dataset"]["format"] == "sft_chat" and resp["dataset"]["num_rows"] == 10
    assert resp["dataset"]["num_groups"] == 5
    manifest = judgments.get("prefs")
    assert manifest["last_compiled_split"] == 5 and "last_compiled_at" in manifest
    split = datasets.split_manifest("prefs-sft")
    by_group: dict[str, set[str]] = {}
    for row in split["rows"]:
        by_group.setdefault(row["group_id"], set()).add(row["split"])
    assert all(len(s) == 1 for s in by_group.values())


def test_compile_into_an_existing_dataset_is_a_conflict(judgments, datasets):
    judgments.create("prefs")
    judgments.append("prefs", judgment())
    judgments.compile("prefs", datasets, "out", holdout_n=0)
    with pytest.raises(KilnError) as e:
        judgments.compile("prefs", datasets, "out", holdout_n=0)
    assert e.value.status == 409 and e.value.code == "dataset_exists"


def test_unavailable_store_is_a_503(tmp_path):
    from kiln.data.judgments import JudgmentStore

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = JudgmentStore(blocker / "judgments")
    for call in (store.list, lambda: store.create("prefs")):
        with pytest.raises(KilnError) as e:
            call()
        assert e.value.status == 503 and e.value.code == "judgment_store_unavailable"
