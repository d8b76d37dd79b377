"""Request ids and one access line per request, as vLLM and most proxies expect them.

`RequestIdMiddleware` (pure ASGI, so a streamed body is timed to its last byte) takes the client's
`x-request-id` or makes one, echoes it on the response, and holds it in a context variable: every log
line written while the request is handled carries it (`RequestIdFilter`). When the response is done it
writes one `kiln.access` line: method, path, status, duration, and what the handler noted about the
generation (`note_request(prompt_tokens=..., completion_tokens=..., ttft_ms=..., adapter=...,
finish_reason=...)`). `configure_logging` installs the text or JSON format on the root logger.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
_VALID_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
ACCESS_LOGGER = "kiln.access"
# Fields an access line may carry, in the order the text format prints them.
NOTE_FIELDS = ("model", "adapter", "prompt_tokens", "completion_tokens", "ttft_ms", "finish_reason", "error")


@dataclass
class RequestRecord:
    request_id: str
    notes: dict[str, Any] = field(default_factory=dict)


_current: ContextVar[RequestRecord | None] = ContextVar("kiln_request", default=None)


def current_request_id() -> str | None:
    record = _current.get()
    return record.request_id if record is not None else None


def note_request(**fields: Any) -> None:
    """Add generation facts to the current request's access line (a no-op outside a request)."""
    record = _current.get()
    if record is not None:
        record.notes.update({k: v for k, v in fields.items() if v is not None})


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp, *, access_log: bool = True) -> None:
        self.app = app
        self.access_log = access_log
        self.log = logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, HEADER)
        rid = given if given is not None and _VALID_ID.fullmatch(given) else new_request_id()
        record = RequestRecord(rid)
        token = _current.set(record)
        started = time.perf_counter()
        status = 500
        logged = False

        def access() -> None:
            nonlocal logged
            if logged or not self.access_log:
                return
            logged = True
            ms = round((time.perf_counter() - started) * 1000.0, 1)
            extra = {"http_method": scope.get("method"), "http_path": scope.get("path"), "http_status": status,
                     "duration_ms": ms, **record.notes}
            details = " ".join(f"{k}={record.notes[k]}" for k in NOTE_FIELDS if k in record.notes)
            self.log.info("%s %s %d %.1fms%s", scope.get("method"), scope.get("path"), status, ms,
                          f" {details}" if details else "", extra={"access": extra})

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER.encode()]
                headers.append((HEADER.encode(), rid.encode()))
                message = {**message, "headers": headers}
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                access()

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            access()  # a client that went away mid-stream still gets its line
            _current.reset(token)


def _header(scope: Scope, name: str) -> str | None:
    key = name.encode()
    for k, v in scope.get("headers", []):
        if k.lower() == key:
            return v.decode("latin-1").strip()
    return None


class RequestIdFilter(logging.Filter):
    """Gives every record a `request_id` ('-' outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id() or "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, request_id, message, and an access line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(), "logger": record.name,
            "request_id": getattr(record, "request_id", None) or current_request_id(),
            "message": record.getMessage(),
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            out.update(access)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def formatter_for(fmt: str) -> logging.Formatter:
    """server.log_format: "json" (one object per line) or "text"."""
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)


def configure_logging(level: str, fmt: str = "text") -> None:
    """Root handler on stderr in the chosen format; uvicorn's loggers propagate to it."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(formatter_for(fmt))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    # Kiln writes its own access line (with the request id and the generation's numbers).
    logging.getLogger("uvicorn.access").disabled = True
    # gguf's writer narrates every export at INFO ("This GGUF file is for Little Endian only", the
    # temporary .part path); the export's own response says what was written.
    logging.getLogger("gguf").setLevel(logging.NOTSET if root.level <= logging.DEBUG else logging.WARNING)
