"""The active-adapter holder: validates, runs the engine's swap callbacks, records the name."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from kiln.adapters.active import STATE_FILE, ActiveAdapter, model_spec_for
from kiln.adapters.store import AdapterStore
from kiln.errors import KilnError
from kiln.testing.stand_in import StandInEngine
from tests.adapters.helpers import MODEL_SPEC, TINY, save_random


@pytest.fixture
def active(tmp_path):
    store = AdapterStore(tmp_path / "adapters")
    save_random(store, "a", modules=["q_proj"])
    return ActiveAdapter(store)


def test_load_records_name_and_revision(active):
    out = active.load("a")
    assert out["status"] == "loaded" and out["name"] == "a"
    assert active.name == "a" and active.revision == active.store.content_hash("a")


def test_callbacks_receive_the_adapter_then_none_on_unload(active):
    seen = []
    active.callbacks.append(lambda loaded: seen.append(loaded and loaded.name))
    active.load("a")
    assert active.unload() == {"status": "unloaded"}
    assert seen == ["a", None] and active.name is None


def test_each_change_of_the_default_adapter_is_logged(active, caplog):
    with caplog.at_level("INFO", logger="kiln.adapters"):
        active.load("a")
        active.unload()
        active.unload()   # already on the base model: nothing changed, nothing to say
    lines = [r.getMessage() for r in caplog.records if r.name == "kiln.adapters"]
    revision = active.store.content_hash("a").removeprefix("sha256:")[:12]
    assert lines == [f"serving adapter a (revision {revision}) by default, instead of the base model",
                     "serving the base model by default, instead of adapter a"]


def test_failed_swap_keeps_the_previous_state(active):
    def boom(_):
        raise RuntimeError("cuda oom")

    active.callbacks.append(boom)
    with pytest.raises(KilnError) as e:
        active.load("a")
    assert (e.value.status, e.value.code) == (500, "adapter_load_failed") and active.name is None


def test_incompatible_adapter_is_refused_with_a_model_spec(active):
    spec = copy.deepcopy(MODEL_SPEC)
    spec["modules"]["q_proj"]["out_features"] = 4
    with pytest.raises(KilnError) as e:
        active.load("a", spec)
    assert e.value.code == "adapter_layout_invalid" and active.name is None


def test_load_reports_compatibility_when_a_model_is_known(active):
    assert active.load("a", MODEL_SPEC)["compatibility"]["matched"] == {"q_proj": [0, 1]}


def test_missing_adapter_is_404(active):
    with pytest.raises(KilnError) as e:
        active.load("nope")
    assert e.value.status == 404


def test_model_spec_comes_from_the_engine_config():
    assert model_spec_for(None) is None
    assert model_spec_for(StandInEngine(info=SimpleNamespace(config=TINY))) == MODEL_SPEC


def test_a_new_holder_on_the_same_store_restores_the_last_loaded_adapter(active):
    active.load("a")
    again = ActiveAdapter(active.store)
    assert again.restore() == "a"
    assert again.name == "a" and again.revision == active.store.content_hash("a")


def test_after_an_unload_a_restart_serves_the_base_model(active):
    active.load("a")
    active.unload()
    again = ActiveAdapter(active.store)
    assert again.restore() is None and again.name is None


def test_a_remembered_adapter_that_is_gone_is_not_restored(active, caplog):
    active.load("a")
    active.store.delete("a")
    again = ActiveAdapter(active.store)
    with caplog.at_level("WARNING", logger="kiln.adapters"):
        assert again.restore() is None
    assert again.name is None and "not restoring" in caplog.text


def test_a_remembered_adapter_that_no_longer_fits_the_model_is_not_restored(active):
    active.load("a")
    spec = copy.deepcopy(MODEL_SPEC)
    spec["modules"]["q_proj"]["out_features"] = 4
    again = ActiveAdapter(active.store)
    assert again.restore(spec) is None and again.name is None


def test_a_torn_state_file_means_the_base_model(active):
    (active.store.root / ".active.json").write_text('{"name": "a"')
    assert ActiveAdapter(active.store).restore() is None


def test_the_startup_sweep_removes_a_torn_write_of_the_default_adapter_record(tmp_path):
    store = AdapterStore(tmp_path / "adapters")
    store.root.mkdir(parents=True)
    torn = store.root / f".{STATE_FILE}.abc123.tmp"
    torn.write_text("{")
    kept = store.root / STATE_FILE
    kept.write_text('{"name": null}')
    assert any(str(torn) in line for line in store.sweep())
    assert not torn.exists() and kept.exists()
