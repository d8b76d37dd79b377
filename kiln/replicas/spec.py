"""One replica's definition, validated: name, url, kind, api_key_env, max_concurrency, and for a vLLM
replica the shared folder adapters are written into (`lora_dir`, and `lora_dir_remote`: the same folder
as the replica's process sees it)."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from kiln.errors import KilnError
from kiln.store.names import name_problem

KINDS = ("kiln", "vllm", "openai")
CODE = "replica_invalid"
FIELDS = ("name", "url", "kind", "api_key_env", "max_concurrency", "base_model", "lora_dir", "lora_dir_remote")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_CONCURRENCY = 4096


@dataclass(frozen=True)
class ReplicaSpec:
    name: str
    url: str                       # the server's root, without /v1
    kind: str = "kiln"
    api_key_env: str | None = None  # the environment variable holding its API key (never the key itself)
    max_concurrency: int = 8       # requests Kiln keeps in flight to it at once (eval fan-out)
    # The name the replica serves our base model under; None: our own served model id.
    base_model: str | None = None
    lora_dir: str | None = None
    lora_dir_remote: str | None = None

    @property
    def api_root(self) -> str:
        return self.url + "/v1"

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def headers(self) -> dict[str, str]:
        key = self.api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def invalid(message: str, param: str | None, hint: str | None = None) -> KilnError:
    return KilnError(400, CODE, f"Invalid replica: {message}", param=param,
                     hint=hint or "A replica is {name, url, kind: kiln|vllm|openai, api_key_env?, "
                     "max_concurrency?}.")


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise invalid(f"{key} must be a non-empty string", key)
    return value.strip()


def normalize_url(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise invalid("url must be an http(s) URL", "url")
    url = value.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise invalid(f"url must be an http(s) URL with a host, got {value!r}", "url")
    if parts.query or parts.fragment:
        raise invalid("url must not carry a query or fragment", "url")
    if url.endswith("/v1"):  # the server's root is what is stored; /v1 is added per route
        url = url[:-3]
    return url


def parse_replica(body: Any) -> ReplicaSpec:
    """A ReplicaSpec from a JSON object or TOML table; a 400 KilnError naming the bad field."""
    if not isinstance(body, dict):
        raise invalid("must be an object", None)
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise invalid(f"{unknown[0]}: unknown field (known: {', '.join(FIELDS)})", unknown[0])
    name = body.get("name")
    problem = name_problem(name)
    if problem is not None:
        raise invalid(f"name {problem}", "name")
    kind = body.get("kind", "kiln")
    if kind not in KINDS:
        raise invalid(f"kind must be one of {', '.join(KINDS)}, got {kind!r}", "kind")
    env = _optional_str(body, "api_key_env")
    if env is not None and not _ENV_NAME.match(env):
        raise invalid("api_key_env must name an environment variable (letters, digits, _)", "api_key_env",
                      hint="Put the key in an environment variable and name the variable here; the key itself "
                      "is never stored.")
    cap = body.get("max_concurrency", 8)
    if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_CONCURRENCY:
        raise invalid(f"max_concurrency must be a whole number from 1 to {MAX_CONCURRENCY}", "max_concurrency")
    lora_dir, lora_remote = _optional_str(body, "lora_dir"), _optional_str(body, "lora_dir_remote")
    if lora_remote is not None and lora_dir is None:
        raise invalid("lora_dir_remote needs lora_dir (the same folder as this server writes it)", "lora_dir")
    return ReplicaSpec(name=name, url=normalize_url(body.get("url")), kind=kind, api_key_env=env,
                       max_concurrency=cap, base_model=_optional_str(body, "base_model"), lora_dir=lora_dir,
                       lora_dir_remote=lora_remote)
