"""Merge (semantics.md §7.4): each mode against a direct computation, and its validation errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kiln.adapters.merge import concat_alpha, merge_adapters, trim_to_density
from kiln.adapters.store import AdapterStore
from kiln.errors import KilnError
from tests.adapters.helpers import save_random

MODS = ["q_proj", "down_proj"]


@pytest.fixture
def store(tmp_path):
    s = AdapterStore(tmp_path / "adapters")
    save_random(s, "a", r=4, alpha=8, modules=MODS, seed=1)
    save_random(s, "b", r=4, alpha=8, modules=MODS, seed=2)
    return s


def raw(store, name):
    return store.read_peft_tensors(name)


def test_weighted_average_is_the_unnormalized_weighted_sum(store):
    out = merge_adapters(store, [("a", 0.7), ("b", 0.5)], "m")
    assert out == {"status": "merged", "output_name": "m", "mode": "weighted_average",
                   "sources": [{"name": "a", "weight": 0.7}, {"name": "b", "weight": 0.5}], "num_tensors": 8}
    ta, tb, tm = raw(store, "a"), raw(store, "b"), raw(store, "m")
    for k in ta:
        torch.testing.assert_close(tm[k], 0.7 * ta[k] + 0.5 * tb[k])
        assert tm[k].dtype == torch.float32


def test_single_source_is_a_rescaled_copy(store):
    merge_adapters(store, [{"name": "a", "weight": 2.0}], "m")
    for k, v in raw(store, "a").items():
        torch.testing.assert_close(raw(store, "m")[k], 2 * v)


def reference_ties(tensors, weights, density):
    """Element by element, straight from the rule in semantics.md §7.4."""
    trimmed = []
    for t in tensors:
        flat = t.flatten().tolist()
        keep = math.floor(density * len(flat) + 0.5)
        if keep <= 0:
            trimmed.append([0.0] * len(flat))
            continue
        cut = sorted((abs(v) for v in flat), reverse=True)[min(keep, len(flat)) - 1]
        trimmed.append([v if abs(v) >= cut else 0.0 for v in flat])
    out = []
    for pos in range(len(trimmed[0])):
        s = sum(w * tr[pos] for w, tr in zip(weights, trimmed, strict=True))
        sign = (s > 0) - (s < 0)
        if sign == 0:
            out.append(0.0)
            continue
        agree = [(w, tr[pos]) for w, tr in zip(weights, trimmed, strict=True) if ((tr[pos] > 0) - (tr[pos] < 0)) == sign]
        out.append(sum(w * v for w, v in agree) / sum(w for w, _ in agree))
    return torch.tensor(out).view(tensors[0].shape)


@pytest.mark.parametrize("density", [0.2, 0.5, 1.0])
def test_ties_matches_the_elementwise_rule(store, density):
    save_random(store, "c", r=4, alpha=8, modules=MODS, seed=3)
    weights = [1.0, 0.6, 0.3]
    merge_adapters(store, [("a", 1.0), ("b", 0.6), ("c", 0.3)], "m", mode="ties", density=density)
    ts = [raw(store, n) for n in "abc"]
    tm = raw(store, "m")
    for k in ts[0]:
        torch.testing.assert_close(tm[k], reference_ties([t[k] for t in ts], weights, density))


def test_ties_trim_keeps_the_top_fraction_by_magnitude():
    t = torch.tensor([0.1, -0.5, 0.3, -0.2, 0.05])
    assert trim_to_density(t, 0.4).tolist() == pytest.approx([0, -0.5, 0.3, 0, 0])
    assert torch.equal(trim_to_density(t, 1.0), t)
    assert trim_to_density(t, 0.05).abs().sum() == 0  # round(0.25) == 0 keeps nothing


def test_ties_default_density_is_0_2(store):
    merge_adapters(store, [("a", 1.0), ("b", 1.0)], "d", mode="ties")
    merge_adapters(store, [("a", 1.0), ("b", 1.0)], "e", mode="ties", density=0.2)
    for k, v in raw(store, "d").items():
        torch.testing.assert_close(v, raw(store, "e")[k])


def test_concat_product_is_the_weighted_sum_of_products(store):
    save_random(store, "r2", r=2, alpha=4, modules=MODS, seed=5)
    merge_adapters(store, [("a", 0.5), ("r2", -1.5)], "m", mode="concat")
    cfg = json.loads((store.root / "m" / "adapter_config.json").read_text())
    assert cfg["r"] == 6 and cfg["lora_alpha"] == 12  # 8 * 6 / 4, kept an integer
    ma, m2, mm = (store.load_lora_tensors(n) for n in ("a", "r2", "m"))
    for key, (a, b, _) in mm.items():
        expected = 0.5 * ma[key].b @ ma[key].a - 1.5 * m2[key].b @ m2[key].a
        torch.testing.assert_close(b @ a, expected)
        assert a.shape[0] == 6


def test_concat_alpha_keeps_the_first_scale():
    assert concat_alpha(16, 8, 12) == 24 and isinstance(concat_alpha(16, 8, 12), int)
    assert concat_alpha(8.0, 4, 6) == 12.0
    assert concat_alpha(8, 4, 16, rslora=True) / math.sqrt(16) == pytest.approx(8 / math.sqrt(4))


def test_merge_writes_lineage_into_the_manifest(store):
    merge_adapters(store, [("a", 1.0), ("b", 2.0)], "m")
    lineage = json.loads((store.root / "m" / "adapter_manifest.json").read_text())["lineage"]
    assert lineage["parent_adapter"] == "a"
    assert [s["name"] for s in lineage["merge"]["sources"]] == ["a", "b"]
    assert lineage["merge"]["sources"][1]["content_sha256"] == store.content_hash("b")


def expect_error(store, status, code, *args, **kwargs):
    with pytest.raises(KilnError) as e:
        merge_adapters(store, *args, **kwargs)
    assert (e.value.status, e.value.code) == (status, code), e.value.message
    return e.value


def test_unknown_mode_is_invalid(store):
    expect_error(store, 400, "adapter_merge_invalid", [("a", 1.0)], "m", mode="svd")


def test_density_outside_ties_is_invalid(store):
    expect_error(store, 400, "adapter_merge_invalid", [("a", 1.0)], "m", density=0.5)


@pytest.mark.parametrize("density", [0.0, 1.5, -0.1, float("nan")])
def test_density_must_be_in_zero_one(store, density):
    expect_error(store, 400, "adapter_merge_invalid", [("a", 1.0)], "m", mode="ties", density=density)


def test_empty_sources_are_invalid(store):
    expect_error(store, 400, "adapter_merge_invalid", [], "m")


def test_missing_source_is_404(store):
    expect_error(store, 404, "adapter_not_found", [("a", 1.0), ("nope", 1.0)], "m")


@pytest.mark.parametrize("name", ["", "  ", ".", "..", "x/y", "x\\y"])
def test_bad_output_name(store, name):
    expect_error(store, 400, "adapter_merge_bad_name", [("a", 1.0)], name)


def test_output_name_is_trimmed(store):
    assert merge_adapters(store, [("a", 1.0)], "  m  ")["output_name"] == "m"
    assert store.exists("m")


def test_existing_output_is_409(store):
    expect_error(store, 409, "adapter_merge_output_exists", [("a", 1.0)], "b")


def test_different_ranks_need_concat(store):
    save_random(store, "r2", r=2, alpha=4, modules=MODS)
    err = expect_error(store, 400, "adapter_merge_invalid", [("a", 1.0), ("r2", 1.0)], "m")
    assert "concat" in err.hint


def test_different_target_modules_are_invalid(store):
    save_random(store, "q", r=4, alpha=8, modules=["q_proj"])
    expect_error(store, 400, "adapter_merge_invalid", [("a", 1.0), ("q", 1.0)], "m")
    expect_error(store, 400, "adapter_merge_invalid", [("a", 1.0), ("q", 1.0)], "m", mode="concat")


def test_different_base_models_are_invalid(store):
    save_random(store, "x", r=4, alpha=8, modules=MODS, base_model_name_or_path="org/one")
    save_random(store, "y", r=4, alpha=8, modules=MODS, base_model_name_or_path="org/two")
    expect_error(store, 400, "adapter_merge_invalid", [("x", 1.0), ("y", 1.0)], "m")


def test_failed_merge_leaves_no_output(store, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("kiln.adapters.store.save_file", boom)
    expect_error(store, 500, "adapter_merge_failed", [("a", 1.0), ("b", 1.0)], "m")
    assert store.names() == ["a", "b"]
