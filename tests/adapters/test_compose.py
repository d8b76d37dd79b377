"""Per-request composition: stacked factors equal the scaled sum of deltas; an LRU cache in front."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.adapters.compose import MAX_COMPOSE, CompositionCache
from kiln.adapters.store import AdapterStore
from kiln.errors import KilnError
from tests.adapters.helpers import save_random


@pytest.fixture
def store(tmp_path):
    s = AdapterStore(tmp_path / "adapters")
    save_random(s, "a", r=4, alpha=8, modules=["q_proj", "v_proj"], seed=1)
    save_random(s, "b", r=2, alpha=6, modules=["q_proj", "down_proj"], seed=2, rslora=True)
    return s


def test_composition_equals_the_scaled_sum_of_deltas(store):
    composed = CompositionCache(store).compose([{"name": "a", "scale": 0.5}, {"name": "b", "scale": -2.0}])
    ma, mb = store.load_lora_tensors("a"), store.load_lora_tensors("b")
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(0))
    assert set(composed.modules) == set(ma) | set(mb)
    for key, (a, b, scale) in composed.modules.items():
        assert scale == 1.0
        xin = x[:, : a.shape[1]]
        expected = torch.zeros(3, b.shape[0])
        for mods, s in ((ma, 0.5), (mb, -2.0)):
            if key in mods:
                la, lb, ls = mods[key]
                expected += s * ls * (xin @ la.T @ lb.T)
        # the same sums in another order: float32 rounding, not the default's near-bitwise tolerance
        torch.testing.assert_close(xin @ a.T @ b.T, expected, rtol=1e-4, atol=1e-5)


def test_shared_module_rank_is_the_sum_of_ranks(store):
    composed = CompositionCache(store).compose([("a", 1.0), ("b", 1.0)])
    assert composed.modules[(0, "q_proj")].a.shape[0] == 6
    assert composed.modules[(0, "v_proj")].a.shape[0] == 4


def test_repeat_request_is_a_cache_hit(store):
    cache = CompositionCache(store)
    first = cache.compose([("a", 1.0), ("b", 0.5)])
    assert cache.compose([("a", 1.0), ("b", 0.5)]) is first
    assert cache.stats()["hits"] == 1 and cache.stats()["misses"] == 1


def test_different_scales_are_different_entries(store):
    cache = CompositionCache(store)
    assert cache.compose([("a", 1.0)]) is not cache.compose([("a", 2.0)])
    assert len(cache) == 2


def test_a_changed_adapter_is_never_served_stale(store):
    cache = CompositionCache(store)
    before = cache.compose([("a", 1.0)])
    path = store.root / "a" / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"lora_alpha": 16}))
    after = cache.compose([("a", 1.0)])
    assert after is not before
    torch.testing.assert_close(after.modules[(0, "q_proj")].b, 2 * before.modules[(0, "q_proj")].b)


def test_lru_evicts_the_oldest_beyond_max_entries(store):
    cache = CompositionCache(store, max_entries=2)
    one = cache.compose([("a", 1.0)])
    cache.compose([("a", 2.0)])
    cache.compose([("a", 1.0)])  # refresh: now the newest
    cache.compose([("a", 3.0)])
    assert len(cache) == 2
    assert cache.compose([("a", 1.0)]) is one


def test_byte_bound_limits_the_cache(store):
    probe = CompositionCache(store).compose([("a", 1.0)])
    cache = CompositionCache(store, max_bytes=probe.nbytes * 2 - 1)
    cache.compose([("a", 1.0)])
    cache.compose([("a", 2.0)])
    assert len(cache) == 1 and cache.stats()["bytes"] == probe.nbytes


@pytest.mark.parametrize("refs", [[], [("a", float("inf"))], [("a", True)], [("a", 1.0)] * (MAX_COMPOSE + 1)])
def test_bad_compositions_are_invalid_compose_request(store, refs):
    with pytest.raises(KilnError) as e:
        CompositionCache(store).compose(refs)
    assert e.value.status == 400 and e.value.code == "invalid_compose_request"


def test_unknown_and_unsafe_names(store):
    with pytest.raises(KilnError) as e:
        CompositionCache(store).compose([("nope", 1.0)])
    assert e.value.code == "adapter_not_found" and e.value.param == "adapters[0].name"
    with pytest.raises(KilnError) as e:
        CompositionCache(store).compose([("a", 1.0), ("../a", 1.0)])
    assert e.value.code == "invalid_adapter_name" and e.value.param == "adapters[1].name"
