"""How an adapter reaches one replica, in the replica's own way, and how it is taken back.

Kiln: the adapter's archive through POST /v1/adapters/upload (with `replace=true` over a different
revision under the name, which the replica swaps in only once the new one is stored and checked), then
read back from GET /v1/adapters: the push counts only when the replica reports the same content digest.
vLLM: the PEFT folder written into the shared `lora_dir` (one folder per revision, renamed into place
whole), then POST /v1/load_lora_adapter {lora_name, lora_path} (a new revision of a served name is
proven under a staging name first, and the old one is loaded back should the swap fail) and the name
seen in /v1/models. Neither way leaves a replica without the adapter because a new revision failed. Each call retries 429, 5xx and connection errors with backoff (`with_retries`).
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from kiln.adapters.export import export_peft
from kiln.replicas.spec import ReplicaSpec

T = TypeVar("T")
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class PushError(Exception):
    """A push that cannot succeed (or did not, after its retries)."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass
class Attempts:
    count: int = 0
    errors: list[str] | None = None


def check(resp: httpx.Response, what: str) -> httpx.Response:
    if resp.status_code >= 400:
        try:
            err = resp.json().get("error")
            detail = err.get("message") if isinstance(err, dict) else (err or resp.text[:200])
        except ValueError:
            detail = resp.text[:200]
        raise PushError(f"{what}: HTTP {resp.status_code}: {detail}", retryable=resp.status_code in RETRY_STATUSES)
    return resp


def with_retries(fn: Callable[[], T], attempts: Attempts, *, tries: int = 3, backoff: float = 0.5,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """`fn()`, again after backoff, 2 x backoff, ... while it fails in a way worth retrying."""
    attempts.errors = attempts.errors or []
    for i in range(tries):
        attempts.count += 1
        try:
            return fn()
        except httpx.TransportError as e:
            error = PushError(f"{type(e).__name__}: {e}", retryable=True)
        except PushError as e:
            error = e
        attempts.errors.append(str(error))
        if not error.retryable or i == tries - 1:
            raise error
        sleep(backoff * 2**i)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Adapter:
    name: str
    folder: Path              # the stored adapter's folder
    revision: str             # its content digest (sha256:...)
    archive: Callable[[], bytes]
    base_model: str | None    # base_model_name_or_path for PEFT consumers


def _remote_adapters(client: httpx.Client, spec: ReplicaSpec) -> dict[str, dict[str, Any]]:
    body = check(client.get(spec.api_root + "/adapters", headers=spec.headers()), "GET /v1/adapters").json()
    return {a["name"]: a for a in body.get("available", []) if isinstance(a, dict) and "name" in a}


def push_kiln(client: httpx.Client, spec: ReplicaSpec, adapter: Adapter, *, activate: bool = False) -> str:
    """Upload and verify; returns "unchanged", "uploaded" (the name was new there) or "replaced".

    Another revision under the name is never deleted first: the upload carries `replace=true`, which the
    replica applies in one swap only after the new revision is stored and checked, so a push that fails
    at any point leaves the replica serving the revision it served before.
    """
    remote = _remote_adapters(client, spec).get(adapter.name)
    action = "unchanged"
    if remote is None or remote.get("content_sha256") != adapter.revision:
        data = {"name": adapter.name} if remote is None else {"name": adapter.name, "replace": "true"}
        resp = client.post(spec.api_root + "/adapters/upload", headers=spec.headers(), data=data,
                           files={"archive": (f"{adapter.name}.tar.gz", adapter.archive(), "application/gzip")})
        if remote is not None and resp.status_code == 409:
            # a replica that predates in-place replacement: leave its revision alone rather than delete it
            raise PushError(f"replica {spec.name!r} keeps {adapter.name!r} at {remote.get('content_sha256')}: it "
                            "cannot replace an adapter in place (upgrade it, or unpublish and publish again)")
        check(resp, "POST /v1/adapters/upload")
        action = "uploaded" if remote is None else "replaced"
        seen = _remote_adapters(client, spec).get(adapter.name)
        if seen is None or seen.get("content_sha256") != adapter.revision:
            if remote is None:  # what arrived is not what was sent: take it away rather than serve it
                client.delete(f"{spec.api_root}/adapters/{quote(adapter.name, safe='')}", headers=spec.headers())
            raise PushError(f"the replica stored {adapter.name!r} with digest "
                            f"{(seen or {}).get('content_sha256')}, not {adapter.revision}", retryable=True)
    if activate:
        check(client.post(spec.api_root + "/adapters/load", headers=spec.headers(), json={"name": adapter.name}),
              "POST /v1/adapters/load")
    return action


def serving_kiln(client: httpx.Client, spec: ReplicaSpec, name: str) -> str | None:
    """The revision of `name` a Kiln replica holds now (None: it holds none)."""
    return (_remote_adapters(client, spec).get(name) or {}).get("content_sha256")


def unpush_kiln(client: httpx.Client, spec: ReplicaSpec, name: str) -> None:
    remote = _remote_adapters(client, spec)
    if name not in remote:
        return
    active = check(client.get(spec.api_root + "/adapters", headers=spec.headers()), "GET /v1/adapters").json()
    if active.get("active") == name:
        check(client.post(spec.api_root + "/adapters/unload", headers=spec.headers()), "POST /v1/adapters/unload")
    check(client.delete(f"{spec.api_root}/adapters/{quote(name, safe='')}", headers=spec.headers()),
          "DELETE /v1/adapters/{name}")


def vllm_leaf(name: str, revision: str) -> str:
    return f"{name}-{revision.removeprefix('sha256:')[:16]}"


def vllm_folder(spec: ReplicaSpec, adapter: Adapter) -> tuple[Path, str]:
    """(the folder written here, the same folder as the replica reads it)."""
    if spec.lora_dir is None:
        raise PushError(f"replica {spec.name!r} (vllm) has no lora_dir: a folder this server writes and it reads")
    leaf = vllm_leaf(adapter.name, adapter.revision)
    return Path(spec.lora_dir) / leaf, str(Path(spec.lora_dir_remote or spec.lora_dir) / leaf)


def _vllm_load(client: httpx.Client, spec: ReplicaSpec, name: str, path: str) -> None:
    check(client.post(spec.api_root + "/load_lora_adapter", headers=spec.headers(),
                      json={"lora_name": name, "lora_path": path}), "POST /v1/load_lora_adapter")


def _vllm_unload(client: httpx.Client, spec: ReplicaSpec, name: str) -> None:
    check(client.post(spec.api_root + "/unload_lora_adapter", headers=spec.headers(), json={"lora_name": name}),
          "POST /v1/unload_lora_adapter")


def push_vllm(client: httpx.Client, spec: ReplicaSpec, adapter: Adapter, *, previous: str | None = None) -> str:
    """Write the PEFT folder, load it, check /v1/models lists it; returns "loaded" or "replaced".

    vLLM refuses to load a name it serves and cannot rename, so a new revision of a served name goes in
    three steps: it is loaded under a staging name first (vLLM reads and checks it there, while the old
    revision still serves) and unloaded again; then the old revision is unloaded and the new one loaded
    under the name. Should that last load still fail, the `previous` revision's folder is loaded back:
    the name is missing only between the unload and the load, never left without an adapter.
    """
    local, remote_path = vllm_folder(spec, adapter)
    if not local.is_dir():
        tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex}.tmp")
        try:
            export_peft(adapter.folder, tmp, base_model=adapter.base_model)
            tmp.rename(local)  # the replica never sees a half-written folder
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _, served = _served(client, spec)
    action = "loaded"
    if adapter.name in served:
        staging = f"{adapter.name}--staging-{adapter.revision.removeprefix('sha256:')[:12]}"
        if staging in served:  # left by an earlier try
            _vllm_unload(client, spec, staging)
        _vllm_load(client, spec, staging, remote_path)
        _vllm_unload(client, spec, staging)
        _vllm_unload(client, spec, adapter.name)
        try:
            _vllm_load(client, spec, adapter.name, remote_path)
        except PushError as e:
            leaf = vllm_leaf(adapter.name, previous) if previous else None
            if leaf is None or not (Path(str(spec.lora_dir)) / leaf).is_dir():
                raise
            try:
                _vllm_load(client, spec, adapter.name, str(Path(spec.lora_dir_remote or str(spec.lora_dir)) / leaf))
            except (PushError, httpx.TransportError) as again:
                raise PushError(f"{e}; loading the previous revision back failed too: {again}",
                                retryable=e.retryable) from e
            raise PushError(f"{e} (the previous revision {previous} was loaded back)", retryable=e.retryable) from e
        action = "replaced"
    else:
        _vllm_load(client, spec, adapter.name, remote_path)
    if adapter.name not in _served(client, spec)[1]:
        raise PushError(f"the replica does not list {adapter.name!r} after loading it", retryable=True)
    return action


def serving_vllm(client: httpx.Client, spec: ReplicaSpec, name: str) -> bool:
    """Whether a vLLM replica lists `name` now (it does not say which revision)."""
    return name in _served(client, spec)[1]


def unpush_vllm(client: httpx.Client, spec: ReplicaSpec, name: str) -> None:
    if name in _served(client, spec)[1]:
        check(client.post(spec.api_root + "/unload_lora_adapter", headers=spec.headers(), json={"lora_name": name}),
              "POST /v1/unload_lora_adapter")


def _served(client: httpx.Client, spec: ReplicaSpec) -> tuple[dict[str, Any], set[str]]:
    body = check(client.get(spec.api_root + "/models", headers=spec.headers()), "GET /v1/models").json()
    return body, {m.get("id") for m in body.get("data", []) if isinstance(m, dict)}
