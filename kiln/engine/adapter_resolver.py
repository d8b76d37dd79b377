"""Turn a request's `adapter` / `adapters` fields into the adapter revision the engine applies.

semantics.md §4.7: `adapter` absent -> the server's active adapter (or the base when none is active);
null or "" -> the base; a name -> that adapter; `adapters: [{name, scale}]` -> the composition
Σ scaleᵢ·BᵢAᵢ (§7.5). Each (name, content revision) is read from disk and checked against the served
model once, then kept: a retrained adapter has a new revision, so it is read again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kiln.adapters.compat import check_compatibility
from kiln.engine.lora_slots import AdapterTarget, target_from_modules
from kiln.errors import KilnError

_MAX_CACHED = 32


class AdapterResolver:
    def __init__(self, store: Any, compose_cache: Any, active: Any, model_spec: dict[str, Any]) -> None:
        self.store = store
        self.compose_cache = compose_cache
        self.active = active
        self.model_spec = model_spec
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, AdapterTarget] = OrderedDict()

    def resolve(self, *, adapter_given: bool, adapter: str | None, adapters: Sequence[Any] | None,
                param: str = "adapter") -> AdapterTarget | None:
        if adapters is not None:
            return self._composed(adapters)
        if adapter_given:
            return self.named(adapter, param=param) if adapter else None
        default = self.active.name if self.active is not None else None
        return self.named(default, param=param) if default else None

    def named(self, name: str, *, param: str = "adapter") -> AdapterTarget:
        self.store.require(name, param=param)
        revision = self.store.content_hash(name)
        key = ((name, 1.0, revision),)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        loaded = self.store.load_adapter(name)
        self._check(loaded, param)
        target = target_from_modules(((name, 1.0, loaded.content_sha256),), name, loaded.modules)
        self._remember(target)
        return target

    def _composed(self, refs: Sequence[Any]) -> AdapterTarget:
        composed = self.compose_cache.compose(refs)
        with self._lock:
            hit = self._cache.get(composed.key)
            if hit is not None:
                return hit
        for i, (name, _, _) in enumerate(composed.key):
            self._check(self.store.load_adapter(name), f"adapters[{i}].name")
        target = target_from_modules(composed.key, composed.label, composed.modules)
        self._remember(target)
        return target

    def _check(self, loaded: Any, param: str) -> None:
        """An adapter that does not fit the served model is a 400, never served as the base model."""
        try:
            check_compatibility(loaded, self.model_spec).raise_if_incompatible()
        except KilnError as e:
            e.param = param
            raise

    def _remember(self, target: AdapterTarget) -> None:
        with self._lock:
            self._cache[target.key] = target
            while len(self._cache) > _MAX_CACHED:
                self._cache.popitem(last=False)
