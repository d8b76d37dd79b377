"""Which saved adapter the server applies by default, and the hook the engine swaps it through.

`load` validates outside the lock (reads the weights, checks them against the served model), then
runs the swap callbacks and records the new name under a short lock (semantics.md §7.7). The engine
registers a callback in `callbacks`; it receives the LoadedAdapter to apply, or None to revert to base.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kiln.adapters.compat import CompatibilityReport, check_compatibility, model_spec_from_config
from kiln.adapters.store import AdapterStore, LoadedAdapter
from kiln.errors import KilnError

log = logging.getLogger("kiln.adapters")

SwapCallback = Callable[[LoadedAdapter | None], None]


def model_spec_for(engine: Any) -> dict[str, Any] | None:
    """The served model's projection shapes, or None without an engine (then no model check runs).

    An engine may expose `lora_model_spec()`; otherwise its `info.config` (ModelConfig) is used.
    """
    if engine is None:
        return None
    provider = getattr(engine, "lora_model_spec", None)
    if callable(provider):
        return provider()
    config = getattr(getattr(engine, "info", None), "config", None)
    return model_spec_from_config(config) if config is not None else None


class ActiveAdapter:
    def __init__(self, store: AdapterStore) -> None:
        self.store = store
        self.name: str | None = None
        self.revision: str | None = None
        self.callbacks: list[SwapCallback] = []
        # Held across a transition (swap or delete) so a delete never races a load of the same name.
        self.lock = threading.RLock()

    def load(self, name: str, model_spec: dict[str, Any] | None = None) -> dict[str, Any]:
        loaded = self.store.load_adapter(name)
        report: CompatibilityReport | None = None
        if model_spec is not None:
            report = check_compatibility(loaded, model_spec)
            report.raise_if_incompatible()
        with self.lock:
            if not self.store.exists(name):  # deleted while we validated
                self.store.require(name)
            self._notify(loaded, f"loading adapter {name!r}", "adapter_load_failed")
            before = self.name or "the base model"
            self.name, self.revision = name, loaded.content_sha256
        log.info("serving adapter %s (revision %s) by default, instead of %s", name,
                 (loaded.content_sha256 or "?").removeprefix("sha256:")[:12], before)
        out: dict[str, Any] = {"status": "loaded", "name": name, "content_sha256": loaded.content_sha256}
        if report is not None:
            out["compatibility"] = report.to_dict()
        return out

    def unload(self) -> dict[str, Any]:
        with self.lock:
            self._notify(None, "reverting to the base model", "adapter_unload_failed")
            before, self.name, self.revision = self.name, None, None
        if before is not None:
            log.info("serving the base model by default, instead of adapter %s", before)
        return {"status": "unloaded"}

    def _notify(self, loaded: LoadedAdapter | None, what: str, code: str) -> None:
        for callback in list(self.callbacks):
            try:
                callback(loaded)
            except KilnError:
                raise
            except Exception as e:
                raise KilnError(500, code, f"{what} failed: {type(e).__name__}: {e}",
                                param="name") from e
