"""Compatibility report: which (layer, module) pairs fit the served model."""

from __future__ import annotations

import copy

import pytest

from kiln.adapters.compat import check_compatibility
from kiln.adapters.store import AdapterStore
from kiln.errors import KilnError
from tests.adapters.helpers import MODEL_SPEC, TINY, save_random


@pytest.fixture
def store(tmp_path):
    return AdapterStore(tmp_path / "adapters")


def test_model_spec_from_config_has_gqa_projection_shapes():
    mods = MODEL_SPEC["modules"]
    assert MODEL_SPEC["num_layers"] == TINY.num_hidden_layers
    assert mods["q_proj"] == {"in_features": 16, "out_features": 16}
    assert mods["k_proj"] == {"in_features": 16, "out_features": 8}
    assert mods["down_proj"] == {"in_features": 24, "out_features": 16}


def test_matching_adapter_reports_modules_layers_rank_and_alpha(store):
    save_random(store, "a", r=4, alpha=8, modules=["q_proj", "up_proj"])
    report = check_compatibility(store.load_adapter("a"), MODEL_SPEC)
    assert report.compatible
    assert report.matched == {"q_proj": [0, 1], "up_proj": [0, 1]}
    assert (report.rank, report.lora_alpha, report.use_rslora, report.dtype) == (4, 8, False, "float32")
    assert report.to_dict()["compatible"] is True


def test_shape_mismatch_is_reported_per_layer(store):
    save_random(store, "a", modules=["q_proj", "k_proj"])
    spec = copy.deepcopy(MODEL_SPEC)
    spec["modules"]["k_proj"]["out_features"] = 4
    report = check_compatibility(store.load_adapter("a"), spec)
    assert not report.compatible
    assert report.matched == {"q_proj": [0, 1]}
    assert [(m.layer, m.module, m.expected_out, m.got_out) for m in report.shape_mismatches] == [
        (0, "k_proj", 4, 8), (1, "k_proj", 4, 8)]
    with pytest.raises(KilnError) as e:
        report.raise_if_incompatible()
    assert e.value.code == "adapter_layout_invalid" and "k_proj" in e.value.message


def test_layers_beyond_the_model_are_reported(store):
    save_random(store, "a", modules=["q_proj"])
    spec = copy.deepcopy(MODEL_SPEC) | {"num_layers": 1}
    report = check_compatibility(store.load_adapter("a"), spec)
    assert report.layers_out_of_range == [1] and not report.compatible


def test_adapter_matching_no_module_is_a_400(store):
    save_random(store, "a", modules=["q_proj"])
    spec = copy.deepcopy(MODEL_SPEC)
    spec["modules"]["q_proj"]["in_features"] = 32
    with pytest.raises(KilnError) as e:
        check_compatibility(store.load_adapter("a"), spec)
    assert e.value.status == 400 and e.value.code == "adapter_layout_invalid"


def test_target_modules_without_tensors_are_listed(store):
    save_random(store, "a", modules=["q_proj"], target_modules=["q_proj", "v_proj"])
    report = check_compatibility(store.load_adapter("a"), MODEL_SPEC)
    assert report.missing_targets == ["v_proj"] and report.compatible


def test_hybrid_layers_list_limits_where_a_module_exists(store):
    save_random(store, "a", modules=["q_proj"])
    spec = copy.deepcopy(MODEL_SPEC)
    spec["modules"]["q_proj"]["layers"] = [1]
    report = check_compatibility(store.load_adapter("a"), spec)
    assert report.matched == {"q_proj": [1]} and report.layers_out_of_range == [0]
