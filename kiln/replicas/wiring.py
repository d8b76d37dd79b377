"""What connects the replicas to the rest of a server: the local model they are compared with, a stored
adapter as a push takes it, and publishing a training job's adapter when its gate passes. Built into
the server by kiln.server; the routes call `stored_adapter` too.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from kiln.adapters.export import base_model_reference
from kiln.adapters.store import AdapterStore
from kiln.config import Settings
from kiln.errors import KilnError
from kiln.model.loader import default_model_path
from kiln.replicas.compat import LocalModel
from kiln.replicas.publish import Publisher
from kiln.replicas.push import Adapter
from kiln.replicas.service import ReplicaService

if TYPE_CHECKING:
    from kiln.engine.view import EngineView

log = logging.getLogger("kiln.replicas")


def local_model(engine: EngineView | None) -> LocalModel:
    """This server's base model as replicas must match it: its served name and weights' digest (none
    while the model loads)."""
    if engine is None:
        return LocalModel(None, None)
    identity = engine.identity
    return LocalModel(engine.info.served_model_id, identity.base_model_sha256 if identity is not None else None)


def stored_adapter(store: AdapterStore, settings: Settings, name: str) -> Adapter:
    """A stored adapter as a push sends it (400/404 for a bad or unknown name)."""
    folder = store.require(name)
    model_path = settings.model.path
    ref = base_model_reference(model_path or str(default_model_path()), embedded=model_path is None)
    return Adapter(name=name, folder=folder, revision=store.content_hash(name),
                   archive=lambda: b"".join(store.adapter_archive_bytes(name)), base_model=ref.hf)


def publish_on_pass(service: ReplicaService, store: AdapterStore, settings: Settings, job: Any) -> None:
    """A training job's terminal-state listener: a passed gate with post_eval.publish_on_pass publishes the
    adapter (on a thread: pushes take network time); the outcome is logged and kept in the records."""
    replicas = (job.post_eval or {}).get("publish_on_pass")
    if replicas is None or job.gate_outcome not in ("promoted", "kept"):
        return

    def run() -> None:
        try:
            result = Publisher(service).publish(stored_adapter(store, settings, job.adapter_name), replicas)
            log.info("training job %s: published %s to %s: %s", job.job_id, job.adapter_name,
                     ", ".join(result["replicas"]), result["status"])
        except KilnError as e:
            log.warning("training job %s: publishing %s on pass failed: %s", job.job_id, job.adapter_name, e.message)
        except Exception:  # noqa: BLE001 - a thread's failure is logged, never lost
            log.exception("training job %s: publishing on pass failed", job.job_id)

    threading.Thread(target=run, name="kiln-publish-on-pass", daemon=True).start()
