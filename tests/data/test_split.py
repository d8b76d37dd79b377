from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.data.identity import (
    content_sha256,
    corpus_sha256,
    normalized_corpus_sha256,
    normalized_sha256,
    row_link_id,
)
from kiln.data.split import (
    RowIdentity,
    SplitConfig,
    assign_splits,
    bucket,
    build_split_manifest,
    parse_split_config,
    split_manifest_bytes,
)
from kiln.errors import KilnError
from tests.data.conftest import sft


def identities(values: list[dict]) -> list[RowIdentity]:
    return [RowIdentity(i + 1, content_sha256(v), normalized_sha256(v), row_link_id(v, "group_id"),
                        row_link_id(v, "session_id")) for i, v in enumerate(values)]


# ---- config ----------------------------------------------------------------------------------

def test_split_config_defaults_to_seed_0_and_80_10():
    assert parse_split_config({}) == SplitConfig(0, 80, 10)
    assert SplitConfig().to_json() == {"seed": "0", "train_percent": 80, "validation_percent": 10}


def test_seed_accepts_a_number_or_a_decimal_string_up_to_u64_max():
    assert parse_split_config({"seed": "18446744073709551615"}).seed == 2**64 - 1
    assert parse_split_config({"seed": 42}).seed == 42


@pytest.mark.parametrize("body", [
    {"seed": "-1"}, {"seed": "18446744073709551616"}, {"seed": "01"}, {"seed": 1.5}, {"seed": True},
    {"train_percent": 0}, {"train_percent": 99}, {"train_percent": 90, "validation_percent": 10},
    {"validation_percent": -1}, {"train_percent": "80"}, {"holdout_percent": 10},
])
def test_bad_split_configs_are_dataset_invalid(body):
    with pytest.raises(KilnError) as e:
        parse_split_config(body)
    assert e.value.status == 400 and e.value.code == "dataset_invalid" and e.value.param


# ---- assignment ------------------------------------------------------------------------------

def test_bucket_is_sha256_of_domain_seed_and_key_mod_100():
    digest = hashlib.sha256(b"kiln.dataset-split-assignment.v1\0" + (7).to_bytes(8, "big") + b"sha256:ab").digest()
    assert bucket(7, "sha256:ab") == int.from_bytes(digest[:8], "big") % 100


def test_normalized_duplicates_share_a_partition():
    rows = identities([sft(f"question {i}") for i in range(30)] + [sft("QUESTION   7 ")])
    splits = assign_splits(rows, SplitConfig(seed=3))
    assert splits[-1] == splits[7]


def test_group_and_session_links_are_transitive():
    values = [sft(f"q{i}") for i in range(40)]
    values[1]["group_id"] = "g"
    values[2]["group_id"] = "g"
    values[2]["session_id"] = "s"
    values[30]["metadata"] = {"session_id": "s"}
    splits = assign_splits(identities(values), SplitConfig(seed=11))
    assert splits[1] == splits[2] == splits[30]


def test_small_dataset_repair_fills_train_holdout_and_validation():
    for seed in range(20):
        splits = assign_splits(identities([sft(f"q{i}") for i in range(3)]), SplitConfig(seed=seed))
        assert sorted(splits) == ["holdout", "train", "validation"], seed


def test_single_row_goes_to_train():
    assert assign_splits(identities([sft("only")]), SplitConfig(seed=5)) == ["train"]


def test_two_components_land_in_train_and_one_other_partition():
    seen = set()
    for seed in range(40):
        splits = assign_splits(identities([sft("a"), sft("b")]), SplitConfig(seed=seed))
        assert "train" in splits and len(set(splits)) == 2, (seed, splits)
        seen.add(tuple(sorted(splits)))
    assert ("holdout", "train") in seen


def test_zero_validation_percent_leaves_validation_empty():
    splits = assign_splits(identities([sft(f"q{i}") for i in range(10)]), SplitConfig(1, 80, 0))
    assert "validation" not in splits and "train" in splits and "holdout" in splits


# ---- properties ------------------------------------------------------------------------------

TEXTS = ["alpha", "Alpha ", "ALPHA", "beta", "beta  gamma", "Beta Gamma", "delta", "epsilon", "zeta", "eta"]
row_strategy = st.tuples(
    st.sampled_from(TEXTS),
    st.one_of(st.none(), st.sampled_from(["g1", "g2", "g3"])),
    st.one_of(st.none(), st.sampled_from(["s1", "s2"])),
    st.integers(0, 3),
)


def _values(specs) -> list[dict]:
    out = []
    for text, group, session, variant in specs:
        row = sft(text, f"answer {variant}")
        if group:
            row["group_id"] = group
        if session:
            row["metadata"] = {"session_id": session}
        out.append(row)
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(row_strategy, min_size=1, max_size=30), st.integers(0, 2**64 - 1), st.integers(1, 90))
def test_rows_sharing_content_group_or_session_never_straddle_partitions(specs, seed, train):
    rows = identities(_values(specs))
    splits = assign_splits(rows, SplitConfig(seed, train, min(9, 99 - train)))
    by_key: dict[str, set[str]] = {}
    for row, split in zip(rows, splits, strict=True):
        keys = [f"n:{row.normalized_sha256}"]
        keys += [f"g:{row.group_id}"] if row.group_id else []
        keys += [f"s:{row.session_id}"] if row.session_id else []
        for key in keys:
            by_key.setdefault(key, set()).add(split)
    assert all(len(parts) == 1 for parts in by_key.values()), by_key


@settings(max_examples=150, deadline=None)
@given(st.lists(row_strategy, min_size=1, max_size=30), st.integers(0, 2**64 - 1), st.randoms())
def test_any_row_order_puts_every_row_in_the_same_partition(specs, seed, rnd):
    values = _values(specs)
    order = list(range(len(values)))
    rnd.shuffle(order)
    config = SplitConfig(seed=seed)
    first = assign_splits(identities(values), config)
    shuffled = assign_splits(identities([values[i] for i in order]), config)
    assert [first[i] for i in order] == shuffled


def test_shuffling_unrelated_groups_keeps_each_row_in_its_partition():
    groups = [[sft(f"g{g} turn {t}", group_id=f"conv-{g}") for t in range(3)] for g in range(25)]
    config = SplitConfig(seed=99)
    flat = [r for g in groups for r in g]
    reordered = [r for g in reversed(groups) for r in g]
    where = dict(zip((r["messages"][0]["content"] for r in flat), assign_splits(identities(flat), config),
                     strict=True))
    again = assign_splits(identities(reordered), config)
    assert [where[r["messages"][0]["content"]] for r in reordered] == again


# ---- golden manifest -------------------------------------------------------------------------

GOLDEN_ROWS = [
    sft("What is 2+2?", "4"),
    sft("what is  2+2?", "4"),
    sft("Capital of France?", "Paris", group_id="geo"),
    sft("Capital of Spain?", "Madrid", group_id="geo"),
    sft("Hi", "Hello!", metadata={"session_id": "chat-1"}),
    sft("How are you?", "Fine.", metadata={"session_id": "chat-1"}),
    sft("Translate 'cat' to French", "chat"),
    sft("Largest planet?", "Jupiter"),
    sft("Boiling point of water in C?", "100"),
    sft("Author of Hamlet?", "Shakespeare", provenance={"group_id": "lit"}),
    sft("Author of Faust?", "Goethe", provenance={"group_id": "lit"}),
    sft("Square root of 81?", "9"),
]
GOLDEN_SPLIT_SHA256 = "d6c004dc2dd80c602a475e1661d752fd275a652f4662597e910278479b0ecd9e"
GOLDEN_SPLITS = ["validation", "validation", "validation", "validation", "holdout", "holdout", "validation",
                 "train", "train", "train", "train", "train"]


def golden_manifest_bytes() -> bytes:
    rows = identities(GOLDEN_ROWS)
    config = SplitConfig(seed=2024, train_percent=60, validation_percent=20)
    manifest = build_split_manifest("golden", corpus_sha256(r.content_sha256 for r in rows),
                                    normalized_corpus_sha256(r.normalized_sha256 for r in rows), config, rows,
                                    assign_splits(rows, config))
    return split_manifest_bytes(manifest)


def test_golden_split_manifest_bytes_are_stable():
    manifest = json.loads(golden_manifest_bytes())
    assert [r["split"] for r in manifest["rows"]] == GOLDEN_SPLITS
    assert hashlib.sha256(golden_manifest_bytes()).hexdigest() == GOLDEN_SPLIT_SHA256


def test_golden_split_is_the_same_in_another_process_with_another_hash_seed():
    code = "import hashlib; from tests.data.test_split import golden_manifest_bytes as g; " \
           "print(hashlib.sha256(g()).hexdigest())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == GOLDEN_SPLIT_SHA256


def test_split_manifest_bytes_are_pretty_json_with_a_trailing_newline():
    data = golden_manifest_bytes()
    assert data.startswith(b'{\n  "schema": "kiln.dataset-split.v1",\n  "dataset_name": "golden",')
    assert data.endswith(b"}\n")
