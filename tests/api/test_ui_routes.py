"""The dashboard's routes without a model: `/` redirects, the bundled files are served with their
types, nothing outside the bundle is reachable, and every module the page imports ships."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kiln.api.routers.ui import UI_DIR
from kiln.config import Settings
from kiln.server import build_server


@pytest.fixture
def client(tmp_path) -> TestClient:
    s = Settings()
    s.data.data_dir = str(tmp_path / "data")
    return TestClient(build_server(s).app)


def test_root_redirects_to_the_dashboard(client):
    for path in ("/", "/ui"):
        r = client.get(path, follow_redirects=False)
        assert r.status_code == 307 and r.headers["location"] == "/ui/"


def test_dashboard_index_is_html_that_loads_the_app_module(client):
    r = client.get("/ui/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/ui/app.js">' in r.text
    assert client.get("/ui/index.html").text == r.text


def test_assets_are_served_with_their_types_and_revalidated(client):
    assert client.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/ui/app.css").headers["content-type"].startswith("text/css")
    assert client.get("/ui/favicon.svg").headers["content-type"].startswith("image/svg+xml")
    assert client.get("/ui/app.js").headers["cache-control"] == "no-cache"


@pytest.mark.parametrize("path", ["/ui/../pyproject.toml", "/ui/%2e%2e/api/app.py", "/ui/..%2f..%2fpyproject.toml",
                                  "/ui/nope.js", "/ui/api.py", "/ui//etc/passwd"])
def test_nothing_outside_the_bundle_is_served(client, path):
    r = client.get(path)
    assert r.status_code == 404, (path, r.text[:200])
    assert r.json()["error"]["code"] in ("not_found",)


def test_every_imported_module_and_referenced_asset_ships_in_the_bundle():
    # no CDN, no build step: each import and each /ui/ reference resolves to a file beside it
    for js in UI_DIR.glob("*.js"):
        text = js.read_text()
        for name in re.findall(r'from "\./([\w.-]+)"', text):
            assert (UI_DIR / name).is_file(), f"{js.name} imports missing {name}"
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text, js.name
    index = (UI_DIR / "index.html").read_text()
    for ref in re.findall(r'"/ui/([\w.-]+)"', index):
        assert (UI_DIR / ref).is_file(), ref


def test_bundle_is_package_data():
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    patterns = re.search(r"\[tool\.setuptools\.package-data\]\s*kiln = \[(.*?)\]", pyproject, re.S).group(1)
    suffixes = {p.strip().strip('"').rsplit(".", 1)[-1] for p in patterns.split(",") if p.strip().startswith('"ui/')}
    assert {f.suffix.lstrip(".") for f in UI_DIR.iterdir() if f.is_file()} <= suffixes


def test_info_reports_no_isa_without_a_model(client):
    body = client.get("/ui/api/info").json()
    assert body["device"] is None and "cpu_isa" in body and "kernels" in body


def test_eval_report_of_an_unknown_job_is_a_404_envelope(client):
    r = client.get("/ui/api/eval-report/nope")
    assert r.status_code == 404 and r.json()["error"]["message"]
