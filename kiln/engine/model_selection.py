"""What a request's `model` field selects, as in vLLM: the served model, or a stored adapter by name.

`/v1/models` lists the stored adapters as models (with `parent`), so a client that picks one with
`model="my-adapter"` gets that adapter exactly as `adapter: "my-adapter"` would give it. The served
model id, null or a missing `model` select nothing (the server's default applies); any other value is
a 404 `model_not_found`. An explicit `adapter`/`adapters` wins over `model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError


@dataclass(frozen=True)
class ModelSelection:
    adapter: str | None    # the adapter `model` named (None: the served model / the server's default)
    model_id: str          # what the response's `model` says


def select_model(model: str | None, *, served_model_id: str, adapter_store: Any,
                 explicit_adapter: bool = False) -> ModelSelection:
    if model is None or model == served_model_id:
        return ModelSelection(None, served_model_id)
    if _is_stored_adapter(adapter_store, model):
        if explicit_adapter:
            return ModelSelection(None, served_model_id)
        return ModelSelection(model, model)
    raise KilnError(404, "model_not_found", f"The model {model!r} does not exist.", param="model",
                    hint=f"GET /v1/models lists what this server serves: {served_model_id!r} and its stored "
                    "adapters.")


def _is_stored_adapter(store: Any, name: str) -> bool:
    if store is None:
        return False
    try:
        return bool(store.exists(name))
    except KilnError:  # not a valid adapter name (e.g. an HF id with a '/'): not an adapter
        return False
