"""The teacher registry: models a student can learn from by distillation, verified when registered.

A teacher is `local` (this server's base model, optionally wearing a stored adapter) or `remote` (an
OpenAI-compatible server that scores prompts: another Kiln, or vLLM). Registration checks what can be
checked now and records the teacher's identity:
- local: the adapter exists; identity = the base weights' hash and the adapter's content hash;
- remote: the URL answers GET /v1/models (and lists `model_id` when given), its /tokenizer_info (when it
  has one) reports this server's vocabulary size, and its /tokenize turns each probe string into the token
  ids this server's tokenizer gives (else 409 teacher_tokenizer_mismatch: distillation compares per-token
  distributions, so the vocabularies must agree). A URL outside
  loopback needs `api_key_env`, the name of an environment variable holding its key; the key itself is
  never stored.

Aliases are immutable: registering one again is a 409 (delete it first). The registry is one JSON file,
`<data_dir>/teachers/teachers.json`, rewritten atomically under a lock.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict

from kiln.errors import KilnError
from kiln.store.atomic import atomic_write_json
from kiln.store.clock import utc_now_rfc3339
from kiln.store.hashing import sha256_json
from kiln.store.names import name_problem

if TYPE_CHECKING:
    from kiln.engine.view import EngineView

FILE = "teachers.json"
CODE = "teacher_invalid"
PROBES = ("Hello, world!", "The capital of France is Paris.", "def f(x):\n    return x * 2  # twice",
          "naïve café, 東京, ½ + ¼ = ¾", "  leading spaces\ttabs\n\nand newlines  ", "1234567890 3.14159 -42")
TIMEOUT_SECS = 10.0
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TeacherRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    alias: str
    kind: Literal["local", "remote"]
    adapter: str | None = None          # local: a stored adapter the base wears (None: the bare base)
    url: str | None = None              # remote: the server's base URL (with or without /v1)
    model_id: str | None = None         # remote: which of its models (default: the first it lists)
    api_key_env: str | None = None      # remote: environment variable holding its API key


def invalid(message: str, *, param: str | None = None, hint: str | None = None) -> KilnError:
    return KilnError(400, CODE, f"Invalid teacher: {message}", param=param, hint=hint)


def not_found(alias: str) -> KilnError:
    return KilnError(404, "teacher_not_found", f"Teacher {alias!r} not found.", param="alias",
                     hint="GET /v1/teachers lists the registered teachers.")


class TeacherStore:
    def __init__(self, root: str | Path) -> None:
        self.path = Path(root) / FILE
        self._lock = threading.Lock()

    def _read(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text("utf-8"))
        except FileNotFoundError:
            return []
        return list(data.get("teachers", []))

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return self._read()

    def get(self, alias: str) -> dict[str, Any]:
        found = [t for t in self.list() if t["alias"] == alias]
        if not found:
            raise not_found(alias)
        return found[0]

    def add(self, record: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            teachers = self._read()
            if any(t["alias"] == record["alias"] for t in teachers):
                raise KilnError(409, "teacher_exists", f"Teacher {record['alias']!r} is already registered.",
                                param="alias", hint="Aliases are immutable: pick another, or DELETE it first.")
            atomic_write_json(self.path, {"teachers": [*teachers, record]})
        return record

    def delete(self, alias: str) -> None:
        with self._lock:
            teachers = self._read()
            kept = [t for t in teachers if t["alias"] != alias]
            if len(kept) == len(teachers):
                raise not_found(alias)
            atomic_write_json(self.path, {"teachers": kept})


def register(req: TeacherRequest, engine: EngineView, adapters: Any, store: TeacherStore, *,
             transport: httpx.BaseTransport | None = None) -> dict[str, Any]:
    """Verify `req` and add it to the registry; blocking (a remote teacher is called)."""
    problem = name_problem(req.alias)
    if problem:
        raise invalid(f"alias {req.alias!r} {problem}", param="alias", hint="Use one path segment, e.g. big-model.")
    if any(t["alias"] == req.alias for t in store.list()):  # before calling anyone; add() checks again
        raise KilnError(409, "teacher_exists", f"Teacher {req.alias!r} is already registered.", param="alias",
                        hint="Aliases are immutable: pick another, or DELETE it first.")
    identity = _local(req, engine, adapters) if req.kind == "local" else _remote(req, engine, transport)
    record = {**req.model_dump(), "identity": identity, "registered_at": utc_now_rfc3339()}
    if req.kind == "remote":
        record["url"] = identity["url"]
    return store.add(record)


def _probe_ids(engine: EngineView) -> list[list[int]]:
    return [list(engine.tokenizer.encode(p)) for p in PROBES]


def _local(req: TeacherRequest, engine: EngineView, adapters: Any) -> dict[str, Any]:
    for key in ("url", "model_id", "api_key_env"):
        if getattr(req, key) is not None:
            raise invalid(f"a local teacher takes no {key}", param=key, hint="Only remote teachers have a URL.")
    identity: dict[str, Any] = {
        "base_model_sha256": engine.identity.base_model_sha256 if engine.identity is not None else None,
        "tokenizer_probe_sha256": "sha256:" + sha256_json(_probe_ids(engine))}
    if req.adapter is not None:
        try:
            adapters.require(req.adapter, param="adapter")
        except KilnError as e:
            raise invalid(e.message, param="adapter", hint=e.hint) from None
        identity["adapter_content_sha256"] = adapters.load_adapter(req.adapter).content_sha256
    return identity


def _base_url(raw: str | None) -> str:
    if not raw:
        raise invalid("a remote teacher needs url", param="url", hint="e.g. http://127.0.0.1:8000")
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise invalid(f"url {raw!r} is not an http:// or https:// URL", param="url")
    base = raw.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _api_key(req: TeacherRequest, url: str) -> str | None:
    if req.api_key_env is None:
        if not _loopback(url):
            raise invalid(f"url {url!r} is outside loopback, so api_key_env is required", param="api_key_env",
                          hint="Name an environment variable of this server that holds the teacher's API key.")
        return None
    if not ENV_NAME.match(req.api_key_env):
        raise invalid(f"api_key_env {req.api_key_env!r} is not an environment variable name", param="api_key_env")
    key = os.environ.get(req.api_key_env)
    if not key:
        raise invalid(f"environment variable {req.api_key_env} is not set on this server", param="api_key_env",
                      hint="Set it where the server starts, then register the teacher again.")
    return key


def _remote(req: TeacherRequest, engine: EngineView, transport: httpx.BaseTransport | None) -> dict[str, Any]:
    if req.adapter is not None:
        raise invalid("a remote teacher takes no adapter", param="adapter",
                      hint="Name the remote server's model (or its adapter) in model_id.")
    url = _base_url(req.url)
    key = _api_key(req, url)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=TIMEOUT_SECS, transport=transport,
                      follow_redirects=False) as client:
        models = [m.get("id") for m in _call(client, "GET", "/v1/models").get("data", []) if isinstance(m, dict)]
        if req.model_id is not None and req.model_id not in models:
            raise invalid(f"the teacher at {url} serves no model {req.model_id!r} (it lists {models})", param="model_id")
        model_id = req.model_id or (models[0] if models else None)
        if model_id is None:
            raise invalid(f"the teacher at {url} lists no model", param="url")
        mine = _probe_ids(engine)
        info = client.get("/tokenizer_info")   # optional (Kiln serves it; vLLM behind a flag)
        theirs_size = info.json().get("vocab_size") if info.status_code == 200 else None
        if theirs_size is not None and theirs_size != engine.tokenizer.vocab_size:
            raise KilnError(409, "teacher_tokenizer_mismatch",
                            f"the teacher's vocabulary has {theirs_size} tokens and this server's "
                            f"{engine.tokenizer.vocab_size}", param="url",
                            hint="Distillation compares per-token distributions; the teacher must share the "
                                 "student's tokenizer.")
        for probe, want in zip(PROBES, mine, strict=True):
            theirs = _call(client, "POST", "/tokenize", json={"model": model_id, "prompt": probe,
                                                               "add_special_tokens": False}).get("tokens")
            if theirs != want:
                raise KilnError(409, "teacher_tokenizer_mismatch",
                                f"the teacher's tokenizer differs from this server's: {probe!r} is {theirs} there "
                                f"and {want} here", param="url",
                                hint="Distillation compares per-token distributions; the teacher must share the "
                                     "student's tokenizer.")
    return {"url": url, "model_id": model_id, "tokenizer_probe_sha256": "sha256:" + sha256_json(mine)}


def _call(client: httpx.Client, method: str, path: str, **kw: Any) -> dict[str, Any]:
    try:
        resp = client.request(method, path, **kw)
    except httpx.HTTPError as e:
        raise invalid(f"the teacher at {client.base_url} did not answer {method} {path}: {type(e).__name__}: {e}",
                      param="url", hint="Check the URL and that the teacher server is running.") from None
    if resp.status_code != 200:
        raise invalid(f"the teacher at {client.base_url} answered {method} {path} with {resp.status_code}",
                      param="url", hint="The teacher must be a Kiln or vLLM server (GET /v1/models, POST /tokenize)"
                                        " that accepts this server's key.")
    try:
        return resp.json()
    except ValueError:
        raise invalid(f"the teacher at {client.base_url} answered {method} {path} with no JSON", param="url") from None
