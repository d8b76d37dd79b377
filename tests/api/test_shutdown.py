"""Graceful shutdown's pieces: the drain waits for requests in flight, refuses new ones with
503 + Retry-After, and runs every shutdown hook in order even when one fails."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from kiln.api.shutdown import Lifecycle
from kiln.config import Settings
from kiln.server import build_server


def test_drain_waits_for_requests_in_flight_then_runs_the_hooks_in_order():
    life = Lifecycle()
    ran: list[str] = []
    life.on_drain.append(lambda: ran.append("drain-started"))
    life.add_shutdown_hook("first", lambda left: ran.append("first"))
    life.add_shutdown_hook("broken", lambda left: 1 / 0)
    life.add_shutdown_hook("request_log", lambda left: ran.append(f"flush {left > 0}"))
    life.enter()
    finished = []
    t = threading.Thread(target=lambda: finished.append(life.drain(30)))
    t.start()
    while not life.draining:
        time.sleep(0.001)
    assert ran == ["drain-started"] and t.is_alive()   # still waiting for the request
    life.leave()
    t.join(timeout=10)
    assert finished == [True] and ran == ["drain-started", "first", "flush True"]


def test_a_drain_past_its_deadline_still_runs_the_hooks():
    life = Lifecycle()
    ran = []
    life.add_shutdown_hook("request_log", ran.append)
    life.enter()
    assert life.drain(0.05) is False and ran == [0.0]


def test_while_draining_every_request_is_503_server_shutting_down_with_retry_after(tmp_path):
    s = Settings()
    s.data.data_dir = str(tmp_path / "data")
    app = build_server(s).app
    client = TestClient(app)
    assert client.get("/v1/eval/datasets").status_code == 200
    app.state.kiln.lifecycle.draining = True
    for path in ("/v1/eval/datasets", "/v1/chat/completions", "/health"):
        r = client.get(path)
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
        assert r.json()["error"]["code"] == "server_shutting_down"
        assert f"{r.headers['retry-after']} s" in r.json()["error"]["hint"]
    assert app.state.kiln.lifecycle.in_flight == 0


def test_the_training_manager_registers_its_checkpoint_hook(tmp_path):
    s = Settings()
    s.data.data_dir = str(tmp_path / "data")
    app = build_server(s).app
    assert "training" in [name for name, _ in app.state.kiln.lifecycle.hooks]
