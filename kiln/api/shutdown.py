"""Graceful shutdown: stop admitting, let running requests finish, checkpoint, flush, exit 0.

`Lifecycle` lives on `ServerState.lifecycle`. Its ASGI middleware (`DrainMiddleware`) counts the API
requests in flight (a stream counts until its last byte) and, once draining, answers every new one
503 `server_shutting_down` with Retry-After, `/health` included so a load balancer stops sending.

`kiln serve` on SIGTERM (or Ctrl-C): `drain(deadline)` waits until no request is in flight or
`[server] shutdown_timeout_secs` passed, then runs the shutdown hooks in registration order, then
tells uvicorn to exit. A hook is `(name, fn(seconds_left) -> None)`; the training manager registers
one that checkpoints a running job (it becomes `interrupted`), the request log registers its flush:

    state.lifecycle.add_shutdown_hook("request_log", lambda seconds_left: request_log.flush())

A hook that raises is logged and the next one still runs. A second signal exits at once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kiln.errors import KilnError

log = logging.getLogger("kiln")

ShutdownHook = Callable[[float], None]
RETRY_AFTER_SECS = 10
# Not counted and never refused while draining would leave them open: probes keep answering (503).
UNCOUNTED = ("/health", "/metrics")


class Lifecycle:
    def __init__(self, timeout: float = 30.0) -> None:
        self.timeout = timeout          # [server] shutdown_timeout_secs: how long a drain waits
        self._cond = threading.Condition()
        self._in_flight = 0
        self.draining = False
        self.hooks: list[tuple[str, ShutdownHook]] = []
        # Called (quick, no waiting) the moment draining starts: e.g. ask training to stop at a boundary.
        self.on_drain: list[Callable[[], None]] = []

    # -- registration ------------------------------------------------------------------------------
    def add_shutdown_hook(self, name: str, fn: ShutdownHook) -> None:
        self.hooks.append((name, fn))

    # -- request accounting ----------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return self._in_flight

    def enter(self) -> None:
        with self._cond:
            self._in_flight += 1

    def leave(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def refusal(self) -> KilnError:
        return KilnError(503, "server_shutting_down", "the server is shutting down and takes no new requests",
                         hint=f"Retry against another replica, or after {RETRY_AFTER_SECS} s (the Retry-After "
                              "header) once the server restarts.",
                         headers={"Retry-After": str(RETRY_AFTER_SECS)})

    # -- the drain -------------------------------------------------------------------------------
    def drain(self, timeout: float | None = None) -> bool:
        """Stop admitting; wait up to `timeout` s (default `self.timeout`) for in-flight requests; run the
        hooks with the time left. Returns whether every request finished in time."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            self.draining = True
        for fn in self.on_drain:
            try:
                fn()
            except Exception:  # noqa: BLE001
                log.exception("drain callback failed")
        with self._cond:
            if self._in_flight:
                log.info("shutting down: %d request(s) in flight, waiting up to %.0fs", self._in_flight, timeout)
            while self._in_flight > 0 and time.monotonic() < deadline:
                self._cond.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            finished = self._in_flight == 0
            if not finished:
                log.warning("shutting down: %d request(s) still running after %.0fs; they will be cut off",
                            self._in_flight, timeout)
        for name, hook in self.hooks:
            left = max(0.0, deadline - time.monotonic())
            try:
                hook(left)
                log.info("shutdown hook %s done", name)
            except Exception:  # noqa: BLE001 - one failing hook must not keep the others from running
                log.exception("shutdown hook %s failed", name)
        return finished


class DrainMiddleware:
    """Counts API requests in flight; while draining, refuses new ones with 503 + Retry-After."""

    def __init__(self, app: Any, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if self.lifecycle.draining and path != "/metrics":
            err = self.lifecycle.refusal()
            body = json.dumps(err.to_body()).encode("utf-8")
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(RETRY_AFTER_SECS).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        if path in UNCOUNTED:
            await self.app(scope, receive, send)
            return
        self.lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.leave()
