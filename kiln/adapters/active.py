"""Which saved adapter the server applies by default, and the hook the engine swaps it through.

`load` validates outside the lock (reads the weights, checks them against the served model), then
runs the swap callbacks and records the new name under a short lock (semantics.md §7.7). The engine
registers a callback in `callbacks`; it receives the LoadedAdapter to apply, or None to revert to base.

The choice outlives the process: every load and unload rewrites `<adapter_dir>/.active.json`
atomically, and `restore` at start serves that adapter again when it is still stored and still fits
the model (else the base model, with a warning), so a restart never silently drops what training or
an operator chose.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

from kiln.adapters.compat import CompatibilityReport, check_compatibility, model_spec_from_config
from kiln.adapters.store import AdapterInfo, AdapterStore, LoadedAdapter
from kiln.errors import KilnError
from kiln.store.atomic import atomic_write_json

if TYPE_CHECKING:
    from kiln.engine.view import EngineView

log = logging.getLogger("kiln.adapters")

SwapCallback = Callable[[LoadedAdapter | None], None]
STATE_FILE = ".active.json"


def model_spec_for(engine: EngineView | None) -> dict[str, Any] | None:
    """The served model's projection shapes (from its `info.config`), or None without an engine (then
    no model check runs)."""
    return None if engine is None else model_spec_from_config(engine.info.config)


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
            self._persist()
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
            self._persist()
        if before is not None:
            log.info("serving the base model by default, instead of adapter %s", before)
        return {"status": "unloaded"}

    def restore(self, model_spec: dict[str, Any] | None = None) -> str | None:
        """Serve again the adapter the last process chose (None: the base model)."""
        name = self._saved_name()
        if name is None:
            return None
        try:
            self.load(name, model_spec)
        except KilnError as e:
            log.warning("not restoring the default adapter %r: %s; serving the base model", name, e.message)
            return None
        return name

    def _saved_name(self) -> str | None:
        path = self.store.root / STATE_FILE
        try:
            name = json.loads(path.read_text(encoding="utf-8")).get("name")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, AttributeError) as e:
            log.warning("ignoring %s: %s", path, e)
            return None
        return name if isinstance(name, str) and name else None

    def _persist(self) -> None:
        try:
            self.store.root.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.store.root / STATE_FILE, {"name": self.name, "revision": self.revision})
        except OSError as e:  # the swap itself happened; only its memory across restarts is lost
            log.warning("could not record the default adapter in %s: %s", self.store.root / STATE_FILE, e)

    def _notify(self, loaded: LoadedAdapter | None, what: str, code: str) -> None:
        for callback in list(self.callbacks):
            try:
                callback(loaded)
            except KilnError:
                raise
            except Exception as e:
                raise KilnError(500, code, f"{what} failed: {type(e).__name__}: {e}",
                                param="name") from e


def replace_adapter(store: AdapterStore, active: ActiveAdapter, fileobj: BinaryIO, name: str,
                    model_spec: dict[str, Any] | None) -> tuple[AdapterInfo, bool]:
    """Upload with `replace`: the new revision is stored under `name` in one swap, only once it has been
    extracted, validated and (with a model) checked against the served model; until then, and on any
    failure, requests naming `name` get the revision stored before. The default adapter's record follows
    the swap when `name` is the default. Returns (info, whether an adapter was stored under `name` before)."""

    def fits(loaded: LoadedAdapter) -> None:
        if model_spec is not None:
            check_compatibility(loaded, model_spec).raise_if_incompatible()

    existed = store.exists(name)
    info = store.extract_adapter_archive(fileobj, name, replace=True, check=fits)
    with active.lock:
        if active.name == name:
            active.load(name, model_spec)
    return info, existed
