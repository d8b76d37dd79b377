"""API keys: with keys configured, every call needs `Authorization: Bearer KEY`.

Keys come from `[server] api_keys` (comma-separated; `--api-key`, repeatable, or `KILN_SERVER_API_KEYS`)
and `[server] api_key_file` (one key per line; blank lines and `#` comments skipped). Without keys
the server is open, as before.

Default deny: every path needs a key except `/health` (probes), `/metrics` (unless
`[server] protect_metrics`), `/` (a redirect) and the dashboard's static files under `/ui` (the page
must load to ask for a key; its API calls under `/ui/api/` and every `/v1/*` and `/compat/*` call
still need one) and the OpenAPI description. A refusal is 401 in the error envelope with code `invalid_api_key` and
`WWW-Authenticate: Bearer`. Keys are compared in constant time (over their SHA-256, so not even the
length leaks) against every configured key, and never logged or echoed; `/v1/config` shows only
how many there are.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from pathlib import Path
from typing import Any

from kiln.config import ConfigError, Settings
from kiln.errors import KilnError

DOCS_STATIC = "/docs/static"
OPEN_PATHS = frozenset({"/", "/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/favicon.ico"})
UI_PREFIX, UI_API_PREFIX = "/ui", "/ui/api"


def load_api_keys(settings: Settings) -> list[str]:
    keys = [k.strip() for k in (settings.server.api_keys or "").split(",") if k.strip()]
    if settings.server.api_key_file:
        path = Path(settings.server.api_key_file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"server.api_key_file: cannot read {path}: {e.strerror or e}") from None
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    bad = [k for k in keys if any(c.isspace() for c in k)]
    if bad:
        raise ConfigError(f"server.api_keys: {len(bad)} key(s) contain whitespace")
    return list(dict.fromkeys(keys))


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeyMiddleware:
    """A plain ASGI middleware (streams pass through untouched)."""

    def __init__(self, app: Any, keys: list[str], *, protect_metrics: bool = False) -> None:
        self.app = app
        self._digests = [_digest(k) for k in keys]
        self.protect_metrics = protect_metrics

    def needs_key(self, path: str) -> bool:
        if path in OPEN_PATHS or (path == "/metrics" and not self.protect_metrics):
            return False
        if path.startswith(DOCS_STATIC + "/"):   # Swagger UI's own files (kiln.api.docs), like /docs itself
            return False
        in_ui = path == UI_PREFIX or path.startswith(UI_PREFIX + "/")
        in_ui_api = path == UI_API_PREFIX or path.startswith(UI_API_PREFIX + "/")
        return not (in_ui and not in_ui_api)

    def accepts(self, header: str | None) -> bool:
        if not header:
            return False
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        given = _digest(token.strip())
        ok = False
        for digest in self._digests:  # every key, no early exit
            ok |= hmac.compare_digest(given, digest)
        return ok

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or not self.needs_key(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        if self.accepts(header):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await _refuse(send, missing=header is None)


async def _refuse(send: Any, *, missing: bool) -> None:
    if missing:
        message = "This server requires an API key: send it as 'Authorization: Bearer KEY'."
    else:
        message = "Incorrect API key provided."
    err = KilnError(401, "invalid_api_key", message,
                    hint="Pass the key the server was started with (--api-key / KILN_SERVER_API_KEYS); the openai "
                         "client sends api_key= as a Bearer token.")
    body = json.dumps(err.to_body()).encode("utf-8")
    await send({"type": "http.response.start", "status": 401, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b'Bearer realm="kiln"')]})
    await send({"type": "http.response.body", "body": body})


def install_auth(app: Any, settings: Settings) -> list[str]:
    """Add the key check when keys are configured; returns the keys (empty: the server stays open)."""
    keys = load_api_keys(settings)
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys, protect_metrics=settings.server.protect_metrics)
    return keys


def redacted_settings(settings: Settings) -> dict[str, Any]:
    """`Settings.to_dict()` without secrets: the keys become how many there are."""
    out = settings.to_dict()
    server = out.get("server", {})
    if server.get("api_keys"):
        server["api_keys"] = f"<{len([k for k in server['api_keys'].split(',') if k.strip()])} key(s), redacted>"
    return out
