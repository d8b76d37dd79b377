"""API keys: Bearer keys on every call but /health (and /metrics unless protected)."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from kiln.api.auth import ApiKeyMiddleware, is_loopback, load_api_keys
from kiln.config import ConfigError, Settings, load_settings
from kiln.server import build_server

KEY, OTHER = "sk-kiln-test-1", "sk-kiln-test-2"


def make_client(tmp_path, **server) -> TestClient:
    s = Settings()
    s.data.data_dir = str(tmp_path / "data")
    for k, v in server.items():
        setattr(s.server, k, v)
    return TestClient(build_server(s).app)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_without_keys_the_server_stays_open(tmp_path):
    assert make_client(tmp_path).get("/v1/eval/datasets").status_code == 200


@pytest.mark.parametrize("path", ["/v1/eval/datasets", "/v1/judgments", "/v1/adapters", "/v1/train/status",
                                  "/v1/config", "/v1/models", "/compat/anything", "/ui/api/requests"])
def test_every_api_call_without_a_key_is_401_invalid_api_key_in_the_envelope(tmp_path, path):
    r = make_client(tmp_path, api_keys=KEY).get(path)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "hint"}
    assert (err["code"], err["type"]) == ("invalid_api_key", "authentication_error")


def test_a_wrong_key_or_scheme_is_refused_and_never_echoed(tmp_path):
    c = make_client(tmp_path, api_keys=KEY)
    for headers in (bearer("sk-wrong"), {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer "},
                    {"Authorization": KEY}):
        r = c.get("/v1/eval/datasets", headers=headers)
        assert r.status_code == 401 and "sk-wrong" not in r.text and KEY not in r.text


def test_any_configured_key_is_accepted_and_posts_go_through(tmp_path):
    c = make_client(tmp_path, api_keys=f"{KEY}, {OTHER}")
    assert c.get("/v1/eval/datasets", headers=bearer(KEY)).status_code == 200
    assert c.get("/v1/eval/datasets", headers=bearer(OTHER)).status_code == 200
    r = c.post("/v1/judgments", headers=bearer(OTHER), json={"name": "prefs"})
    assert r.status_code in (200, 201), r.text


def test_health_stays_open_and_metrics_only_when_not_protected(tmp_path):
    open_metrics = make_client(tmp_path, api_keys=KEY)
    assert open_metrics.get("/health").status_code in (200, 503)   # no model here: 503, but not 401
    assert open_metrics.get("/metrics").status_code == 200
    protected = make_client(tmp_path, api_keys=KEY, protect_metrics=True)
    assert protected.get("/metrics").status_code == 401
    assert protected.get("/metrics", headers=bearer(KEY)).status_code == 200


def test_the_dashboards_static_files_stay_open_so_the_page_can_ask_for_a_key():
    mw = ApiKeyMiddleware(None, [KEY])
    assert not mw.needs_key("/ui") and not mw.needs_key("/ui/index.html") and not mw.needs_key("/ui/app.js")
    assert mw.needs_key("/ui/api") and mw.needs_key("/ui/api/x") and mw.needs_key("/uix")
    assert mw.needs_key("/v1/chat/completions") and mw.needs_key("/compat/ollama/api/chat")


def test_the_api_docs_and_their_swagger_files_stay_open():
    mw = ApiKeyMiddleware(None, ["k"])
    assert not mw.needs_key("/docs") and not mw.needs_key("/docs/static/swagger-ui-bundle.js")
    assert mw.needs_key("/docs/staticx") and mw.needs_key("/docsx")


def test_the_dashboard_page_loads_without_a_key_but_its_api_calls_need_one(tmp_path):
    c = make_client(tmp_path, api_keys=KEY)
    assert c.get("/", follow_redirects=False).status_code in (302, 307)
    assert c.get("/ui/index.html").status_code == 200 and c.get("/ui/api.js").status_code == 200
    assert c.get("/ui/api/info").status_code == 401
    assert c.get("/ui/api/info", headers=bearer(KEY)).status_code == 200


def test_the_effective_config_shows_how_many_keys_not_the_keys(tmp_path):
    c = make_client(tmp_path, api_keys=f"{KEY},{OTHER}")
    r = c.get("/v1/config", headers=bearer(KEY))
    assert r.status_code == 200 and KEY not in r.text and OTHER not in r.text
    assert r.json()["settings"]["server"]["api_keys"] == "<2 key(s), redacted>"


def test_keys_come_from_the_environment_the_flag_and_a_file(tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"# team keys\n{OTHER}\n\n  sk-three  \n")
    s = load_settings(None, {"server": {"api_key_file": str(keyfile)}}, env={"KILN_SERVER_API_KEYS": f"{KEY},x2"})
    assert load_api_keys(s) == [KEY, "x2", OTHER, "sk-three"]
    missing = load_settings(None, {"server": {"api_key_file": str(tmp_path / "nope")}}, env={})
    with pytest.raises(ConfigError):
        load_api_keys(missing)


def test_serve_flags_set_the_keys_and_warn_when_exposed_without_one(caplog):
    import argparse

    from kiln.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--api-key", KEY, "--api-key", OTHER, "--protect-metrics"])
    assert serve._overrides(args)["server"] == {"api_keys": f"{KEY},{OTHER}", "protect_metrics": True}
    s = Settings()
    s.server.host = "0.0.0.0"
    with caplog.at_level(logging.WARNING, logger="kiln"):
        serve._warn_if_exposed(s)
    assert "without an API key" in caplog.text
    caplog.clear()
    s.server.api_keys = KEY
    with caplog.at_level(logging.INFO, logger="kiln"):
        serve._warn_if_exposed(s)
    assert "without an API key" not in caplog.text and KEY not in caplog.text
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
