"""Does a replica serve the same base model as this server? Pure: the caller fetched what it serves.

The name must match (the replica's `base_model`, else our served model id); for a Kiln replica the
weights' digest (`base_model_sha256` of /v1/config) must match too, so two files that share a name but
not their weights are told apart. An adapter trained here is only sent where this holds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LocalModel:
    name: str | None           # our served model id (None while the model loads)
    sha256: str | None         # our base weights' digest


@dataclass(frozen=True)
class RemoteModel:
    base_models: tuple[str, ...]   # the models it serves that are not adapters
    sha256: str | None = None      # Kiln replicas only


def base_model_problem(kind: str, local: LocalModel, remote: RemoteModel, expected_name: str | None) -> str | None:
    """Why the replica does not serve our base model, or None when it does."""
    if local.name is None:
        return "this server's model has not loaded yet"
    name = expected_name or local.name
    if name not in remote.base_models:
        served = ", ".join(remote.base_models) or "nothing"
        return f"it serves {served}, not {name}"
    if kind == "kiln":
        if remote.sha256 is None or local.sha256 is None:
            return "the base weights' digest is unknown on one side, so they cannot be compared"
        if remote.sha256 != local.sha256:
            return f"its base weights' digest {remote.sha256[:19]} differs from ours {local.sha256[:19]}"
    return None
