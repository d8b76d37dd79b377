from __future__ import annotations

import hashlib
import json

from kiln.data.identity import (
    content_sha256,
    corpus_sha256,
    normalize_text,
    normalized_corpus_sha256,
    normalized_sha256,
    row_link_id,
)


def test_normalize_text_collapses_whitespace_and_lowercases():
    assert normalize_text("  Hello\t\n  WORLD\u00a0 x ") == "hello world x"


def test_content_hash_is_sha256_of_sorted_compact_json():
    value = {"b": [1, "é"], "a": True}
    expected = hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":"),
                                         ensure_ascii=False).encode()).hexdigest()
    assert content_sha256(value) == "sha256:" + expected
    assert content_sha256({"a": True, "b": [1, "é"]}) == content_sha256(value)


def test_normalized_hash_ignores_case_and_spacing_of_values_but_not_keys():
    assert normalized_sha256({"k": "Hi  There"}) == normalized_sha256({"k": "hi there"})
    assert normalized_sha256({"K": "x"}) != normalized_sha256({"k": "x"})
    assert content_sha256({"k": "Hi  There"}) != content_sha256({"k": "hi there"})


def test_corpus_hash_chains_length_prefixed_identities_under_a_domain():
    ids = ["sha256:" + "a" * 64, "sha256:" + "b" * 64]
    h = hashlib.sha256(b"kiln.dataset-corpus.v1\0")
    for i in ids:
        h.update(len(i).to_bytes(8, "big") + i.encode())
    assert corpus_sha256(ids) == "sha256:" + h.hexdigest()
    assert normalized_corpus_sha256(ids) != corpus_sha256(ids)
    assert corpus_sha256(reversed(ids)) != corpus_sha256(ids)


def test_group_and_session_ids_come_from_the_root_then_metadata_provenance_extra():
    assert row_link_id({"group_id": " g1 ", "metadata": {"group_id": "m"}}, "group_id") == "g1"
    assert row_link_id({"group_id": "  ", "metadata": {"group_id": "m"}}, "group_id") == "m"
    assert row_link_id({"provenance": {"session_id": "p"}, "extra": {"session_id": "e"}}, "session_id") == "p"
    assert row_link_id({"extra": {"session_id": "e"}}, "session_id") == "e"
    assert row_link_id({"group_id": 3}, "group_id") is None
    assert row_link_id("raw text", "group_id") is None
