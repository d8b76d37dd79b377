from __future__ import annotations

import argparse
import json
from pathlib import Path
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

import kiln.commands.client as client_module
from kiln.commands import datasets as datasets_cli
from kiln.config import Settings
from kiln.server import build_server
from kiln.testing.schemas import validate

EVALS = "kiln-evals-v1.schema.json"
HOSTILE = ["../x", "a/b", "..", "", " ", "x ", " x", ".hidden"]


def sft(i: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i}"},
                         {"role": "assistant", "content": f"answer {i}"}], **extra}


def jsonl(rows: list) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


ROWS = [sft(i) for i in range(25)]


@pytest.fixture
def settings(tmp_path) -> Settings:
    s = Settings()
    s.data.data_dir = str(tmp_path / "data")
    return s


@pytest.fixture
def client(settings) -> TestClient:
    return TestClient(build_server(settings).app)


def upload(client, name="math", body: bytes = jsonl(ROWS), **fields):
    return client.post("/v1/eval/datasets/upload", data={"name": name, **fields},
                       files={"file": ("data.jsonl", body, "application/jsonl")})


def error(resp, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "hint"} and err["code"] == code
    return err


def test_upload_returns_a_schema_valid_manifest(client):
    resp = upload(client, format="sft", description="Arithmetic")
    assert resp.status_code == 200
    validate(EVALS, "DatasetManifest", resp.json())
    assert resp.json()["format"] == "sft_chat" and resp.json()["description"] == "Arithmetic"


def test_upload_accepts_a_json_array_and_the_grpo_alias(client):
    group = {"messages": [{"role": "user", "content": "q"}], "completions": [{"text": "a", "reward": 1}]}
    resp = upload(client, "groups", json.dumps([group, group]).encode(), format="grpo")
    assert resp.status_code == 200 and resp.json()["format"] == "grpo_groups" and resp.json()["num_rows"] == 2


def test_upload_writes_under_the_configured_data_dir(client, settings):
    upload(client)
    assert Path(settings.data.data_dir, "datasets", "math", "manifest.json").exists()


@pytest.mark.parametrize(("fields", "files", "param", "text"), [
    ({}, {"file": ("d.jsonl", b"{}")}, "name", "missing `name` field"),
    ({"name": "x"}, {}, "file", "missing `file` field"),
    ({"name": "x", "format": "csv"}, {"file": ("d.jsonl", jsonl(ROWS))}, "format", "unknown format `csv`"),
    ({"name": "x"}, {"file": ("d.jsonl", jsonl(ROWS[:2]) + b'{"messages": 3}\n')}, "file", "line 3 is not"),
])
def test_bad_uploads_are_dataset_invalid_and_leave_nothing(client, settings, fields, files, param, text):
    resp = client.post("/v1/eval/datasets/upload", data=fields, files=files or None)
    err = error(resp, 400, "dataset_invalid")
    assert err["param"] == param and text in err["message"]
    assert err["message"].startswith("Invalid eval dataset: ")
    assert client.get("/v1/eval/datasets").json() == {"datasets": []}


def test_upload_of_an_existing_name_is_409(client):
    upload(client)
    error(upload(client), 409, "dataset_exists")


def test_list_is_schema_valid_and_newest_first(client):
    upload(client, "first")
    upload(client, "second")
    body = client.get("/v1/eval/datasets").json()
    validate(EVALS, "DatasetListResponse", body)
    assert [d["name"] for d in body["datasets"]] == ["second", "first"]


def test_get_unknown_dataset_is_404(client):
    error(client.get("/v1/eval/datasets/nope"), 404, "dataset_not_found")


def test_rows_default_limit_clamping_and_split(client):
    upload(client, body=jsonl([sft(i) for i in range(150)]))
    assert len(client.get("/v1/eval/datasets/math/rows").json()["rows"]) == 100
    assert len(client.get("/v1/eval/datasets/math/rows?limit=0").json()["rows"]) == 1
    assert len(client.get("/v1/eval/datasets/math/rows?limit=99999").json()["rows"]) == 150
    counts = client.get("/v1/eval/datasets/math").json()["split_counts"]
    body = client.get("/v1/eval/datasets/math/rows?split=holdout&limit=5000").json()
    assert body["split"] == "holdout" and len(body["rows"]) == counts["holdout"]
    error(client.get("/v1/eval/datasets/math/rows?split=test"), 400, "dataset_invalid")
    error(client.get("/v1/eval/datasets/math/rows?limit=ten"), 400, "dataset_invalid")


def test_get_and_put_split(client):
    upload(client)
    split = client.get("/v1/eval/datasets/math/split").json()
    validate(EVALS, "DatasetSplitManifest", split)
    resp = client.put("/v1/eval/datasets/math/split",
                      json={"seed": "18446744073709551615", "train_percent": 60, "validation_percent": 20})
    assert resp.status_code == 200
    validate(EVALS, "DatasetSplitManifest", resp.json())
    manifest = client.get("/v1/eval/datasets/math").json()
    assert manifest["split_config"] == {"seed": "18446744073709551615", "train_percent": 60,
                                        "validation_percent": 20}
    assert manifest["split_counts"] == resp.json()["counts"]


@pytest.mark.parametrize("body", [
    {"train_percent": 95, "validation_percent": 5}, {"seed": -1}, {"extra": 1}, [1], "x",
])
def test_put_split_rejects_bad_configs(client, body):
    upload(client)
    before = client.get("/v1/eval/datasets/math/split").json()
    error(client.put("/v1/eval/datasets/math/split", json=body), 400, "dataset_invalid")
    assert client.get("/v1/eval/datasets/math/split").json() == before


def test_put_split_rejects_a_non_json_body(client):
    upload(client)
    err = error(client.put("/v1/eval/datasets/math/split", content=b"{nope"), 400, "dataset_invalid")
    assert err["message"].startswith("Invalid eval dataset: ")


def test_delete_dataset(client):
    upload(client)
    resp = client.delete("/v1/eval/datasets/math")
    validate(EVALS, "DeleteDatasetResponse", resp.json())
    assert resp.json() == {"status": "deleted", "name": "math"}
    error(client.delete("/v1/eval/datasets/math"), 404, "dataset_not_found")


def segment(name: str) -> str:
    # Dots too, or the HTTP client would resolve ".." before sending.
    return quote(name, safe="").replace(".", "%2E")


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_names_are_rejected_on_every_route(client, settings, name):
    if name.strip() == name:  # upload trims the multipart name (semantics.md §9.1)
        err = error(upload(client, name), 400, "dataset_invalid")
        assert err["param"] == "name"
    seg = segment(name)
    routes = [("GET", f"/v1/eval/datasets/{seg}"), ("DELETE", f"/v1/eval/datasets/{seg}"),
              ("GET", f"/v1/eval/datasets/{seg}/rows"), ("GET", f"/v1/eval/datasets/{seg}/split"),
              ("PUT", f"/v1/eval/datasets/{seg}/split")]
    for method, path in routes:
        resp = client.request(method, path, json={} if method == "PUT" else None, follow_redirects=False)
        if "/" in name or not name:
            # Never reaches a handler: no route has an empty or multi-segment name.
            assert resp.status_code in (307, 404, 405), (method, path, resp.status_code)
        else:
            error(resp, 400, "dataset_invalid")
    root = Path(settings.data.data_dir)
    assert not (root / "x").exists() and not (root / "datasets" / "x").exists()
    assert client.get("/v1/eval/datasets").json() == {"datasets": []}


def test_upload_trims_the_name(client):
    assert upload(client, "  padded ").json()["name"] == "padded"


# ---- CLI -------------------------------------------------------------------------------------

@pytest.fixture
def cli(client, monkeypatch):
    """Run `kiln datasets ...` against the in-process app."""
    class InProcess(client_module.ServerClient):
        def __init__(self, url: str, timeout: float = 600.0):
            self.url, self.http = url, client

        def request(self, method, path, **kw):
            if method == "PUT":  # the only JSON body: a re-split
                validate(EVALS, "DatasetSplitConfig", kw["json"])
            elif method == "POST":
                validate(EVALS, "DatasetUploadMultipart", {**kw["data"], "file": "<bytes>"})
            return super().request(method, path, **kw)

    monkeypatch.setattr(client_module, "ServerClient", InProcess)

    def run(*argv: str) -> int:
        parser = argparse.ArgumentParser()
        datasets_cli.register(parser.add_subparsers())
        args = parser.parse_args(["datasets", *argv])
        return args.func(args)

    return run


def test_cli_upload_list_show_split_delete(cli, tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(jsonl(ROWS))
    assert cli("upload", "math", str(path), "--description", "Arithmetic") == 0
    assert "uploaded math: 25 rows (sft_chat)" in capsys.readouterr().out
    assert cli("list") == 0 and "math" in capsys.readouterr().out
    assert cli("show", "math", "--rows", "2") == 0
    out = capsys.readouterr().out
    assert '"corpus_sha256"' in out and out.count('{"messages"') == 2
    assert cli("split", "math", "--seed", "9", "--train", "70") == 0
    assert "seed 9, 70% train / 10% validation" in capsys.readouterr().out
    assert cli("delete", "math") == 0 and "deleted math" in capsys.readouterr().out


def test_cli_reports_server_errors_with_the_hint(cli, capsys):
    assert cli("show", "nope") == 1
    err = capsys.readouterr().err
    assert "error 404 [dataset_not_found]" in err and "hint:" in err


def test_cli_upload_of_a_large_file_reports_progress_over_the_bytes(cli, tmp_path, monkeypatch):
    path = tmp_path / "big.jsonl"
    path.write_bytes(jsonl([sft(i, pad="x" * 2000) for i in range(800)]))
    positions: list[int] = []
    original = datasets_cli.ProgressReader.__init__

    def spy(self, f, on_position):
        original(self, f, lambda pos: (positions.append(pos), on_position(pos)))

    monkeypatch.setattr(datasets_cli.ProgressReader, "__init__", spy)
    assert cli("upload", "big", str(path)) == 0
    size = path.stat().st_size
    assert size > datasets_cli.PROGRESS_MIN_BYTES
    assert positions[-1] == size and len(set(positions)) > 1
