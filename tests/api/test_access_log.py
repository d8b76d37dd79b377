"""Request ids (echoed, or generated), one access line per request, and the JSON log format."""

from __future__ import annotations

import io
import json
import logging

import pytest
from fastapi.testclient import TestClient

import kiln.api.app as app_module
from kiln.api.access_log import (
    ACCESS_LOGGER,
    HEADER,
    JsonFormatter,
    RequestIdFilter,
    configure_logging,
    note_request,
)
from kiln.config import DataSettings, ServerSettings, Settings
from kiln.server import build_state


@pytest.fixture
def app(tmp_path, monkeypatch):
    settings = Settings(data=DataSettings(data_dir=str(tmp_path)))
    app = app_module.create_app(settings, build_state(settings), routers=["kiln.api.routers.system"])

    @app.get("/_noted")
    def noted():
        logging.getLogger("kiln.test").info("inside the handler")
        note_request(prompt_tokens=3, completion_tokens=5, ttft_ms=12.5, adapter="base", finish_reason="stop")
        return {"ok": True}

    return app


@pytest.fixture
def lines():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield lambda: [json.loads(x) for x in stream.getvalue().splitlines()]
    root.removeHandler(handler)
    root.setLevel(old_level)


def test_a_given_request_id_is_echoed(app):
    r = TestClient(app).get("/v1/models", headers={HEADER: "abc-123"})
    assert r.headers[HEADER] == "abc-123"


def test_a_missing_request_id_is_generated(app):
    a = TestClient(app).get("/v1/models").headers[HEADER]
    b = TestClient(app).get("/v1/models").headers[HEADER]
    assert len(a) == 32 and a != b


def test_an_unsafe_request_id_is_replaced(app):
    r = TestClient(app).get("/v1/models", headers={HEADER: "x" * 300})
    assert r.headers[HEADER] != "x" * 300


def test_every_log_line_of_a_request_carries_its_id(app, lines):
    TestClient(app).get("/_noted", headers={HEADER: "rid-7"})
    mine = [x for x in lines() if x["request_id"] == "rid-7"]
    assert {x["logger"] for x in mine} >= {"kiln.test", ACCESS_LOGGER}


def test_one_access_line_per_request_with_the_generation_facts(app, lines):
    client = TestClient(app)
    client.get("/_noted", headers={HEADER: "r1"})
    client.get("/v1/models", headers={HEADER: "r2"})
    access = [x for x in lines() if x["logger"] == ACCESS_LOGGER]
    assert [x["request_id"] for x in access] == ["r1", "r2"]
    first = access[0]
    assert (first["http_method"], first["http_path"], first["http_status"]) == ("GET", "/_noted", 200)
    assert (first["prompt_tokens"], first["completion_tokens"], first["ttft_ms"]) == (3, 5, 12.5)
    assert first["adapter"] == "base" and first["finish_reason"] == "stop" and first["duration_ms"] >= 0
    assert "completion_tokens=5" in first["message"]


def test_errors_get_an_access_line_with_their_status(app, lines):
    TestClient(app).get("/nope", headers={HEADER: "r404"})
    access = [x for x in lines() if x["logger"] == ACCESS_LOGGER]
    assert access[-1]["http_status"] == 404 and access[-1]["request_id"] == "r404"


def test_an_error_access_line_names_the_error_code(app, lines):
    TestClient(app).get("/nope", headers={HEADER: "r404"})
    TestClient(app).post("/v1/models", headers={HEADER: "r405"})
    access = {x["request_id"]: x for x in lines() if x["logger"] == ACCESS_LOGGER}
    assert access["r404"]["error"] == "not_found" and access["r404"]["message"].endswith(" error=not_found")
    assert access["r405"]["error"] == "method_not_allowed"


def test_access_log_can_be_turned_off(tmp_path, monkeypatch, lines):
    settings = Settings(data=DataSettings(data_dir=str(tmp_path)), server=ServerSettings(access_log=False))
    app = app_module.create_app(settings, build_state(settings), routers=["kiln.api.routers.system"])
    TestClient(app).get("/v1/models")
    assert not [x for x in lines() if x["logger"] == ACCESS_LOGGER]


def test_configure_logging_json_writes_one_object_per_line(capsys):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging("info", "json")
        logging.getLogger("kiln.x").info("hello %s", "there")
        err = capsys.readouterr().err.strip().splitlines()
        record = json.loads(err[-1])
        assert record["message"] == "hello there" and record["request_id"] == "-"
        assert record["level"] == "info" and record["logger"] == "kiln.x"
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_the_gguf_writers_narration_stays_out_of_the_info_log():
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    try:
        configure_logging("info")
        assert not logging.getLogger("gguf.gguf_writer").isEnabledFor(logging.INFO)
        assert logging.getLogger("gguf.gguf_writer").isEnabledFor(logging.WARNING)
        assert logging.getLogger("kiln.train").isEnabledFor(logging.INFO)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.getLogger("gguf").setLevel(logging.NOTSET)
