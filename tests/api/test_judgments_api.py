from __future__ import annotations

import argparse
import json
from pathlib import Path
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

import kiln.commands.client as client_module
from kiln.api.app import create_app
from kiln.commands import judgments as judgments_cli
from kiln.config import Settings
from kiln.testing.schemas import validate

EVALS = "kiln-evals-v1.schema.json"
HOSTILE = ["../x", "a/b", "..", "", " ", "x ", ".hidden"]


def body(i: int = 0, winner: str = "a", **extra) -> dict:
    return {"prompt": [{"role": "user", "content": f"Explain {i}."}], "response_a": f"A long answer {i}",
            "response_b": f"A concise answer {i}", "winner": winner, **extra}


@pytest.fixture
def settings(tmp_path) -> Settings:
    s = Settings()
    s.data.data_dir = str(tmp_path / "data")
    return s


@pytest.fixture
def client(settings) -> TestClient:
    return TestClient(create_app(settings))


@pytest.fixture
def prefs(client) -> str:
    assert client.post("/v1/judgments", json={"name": "prefs", "description": "Concise"}).status_code == 200
    return "prefs"


def error(resp, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "hint"} and err["code"] == code
    return err


def test_create_returns_a_manifest_and_conflicts_on_repeat(client):
    resp = client.post("/v1/judgments", json={"name": "prefs", "description": "Concise", "extra": 1})
    validate(EVALS, "JudgmentManifest", resp.json())
    assert resp.json()["description"] == "Concise" and resp.json()["num_rows"] == 0
    error(client.post("/v1/judgments", json={"name": "prefs"}), 409, "dataset_exists")


def test_create_without_a_name_names_the_field(client):
    err = error(client.post("/v1/judgments", json={"description": "x"}), 400, "judgment_invalid")
    assert err["param"] == "name" and err["message"].startswith("Invalid judgment: ")


def test_list_is_schema_valid(client, prefs):
    resp = client.get("/v1/judgments")
    validate(EVALS, "JudgmentListResponse", resp.json())
    assert [j["name"] for j in resp.json()["judgments"]] == ["prefs"]


def test_append_assigns_an_id_and_ignores_unknown_fields(client, prefs):
    resp = client.post("/v1/judgments/prefs/rows", json=body(adapter_b="concise-v1", tags=["style"], junk=1))
    assert resp.status_code == 200
    validate(EVALS, "AppendJudgmentResponse", resp.json())
    assert resp.json()["num_rows"] == 1 and resp.json()["winner_histogram"] == {"a": 1}
    again = client.post("/v1/judgments/prefs/rows", json=body(1, "b", id="mine")).json()
    assert again["judgment_id"] == "mine" and again["num_rows"] == 2


@pytest.mark.parametrize(("override", "param"), [({"winner": "left"}, "winner"), ({"response_a": 3}, "response_a"),
                                                 ({"prompt": [{"content": "x"}]}, "prompt.0.role")])
def test_bad_append_bodies_are_400_naming_the_field(client, prefs, override, param):
    err = error(client.post("/v1/judgments/prefs/rows", json={**body(), **override}), 400, "judgment_invalid")
    assert err["param"] == param.replace(".0.", "[0].")


def test_append_to_a_missing_set_is_404(client):
    error(client.post("/v1/judgments/nope/rows", json=body()), 404, "judgment_not_found")


def test_delete_row_returns_the_manifest(client, prefs):
    row_id = client.post("/v1/judgments/prefs/rows", json=body()).json()["judgment_id"]
    resp = client.delete(f"/v1/judgments/prefs/rows/{row_id}")
    validate(EVALS, "JudgmentManifest", resp.json())
    assert resp.json()["num_rows"] == 0
    error(client.delete(f"/v1/judgments/prefs/rows/{row_id}"), 404, "judgment_not_found")


def test_delete_set(client, prefs):
    resp = client.delete("/v1/judgments/prefs")
    validate(EVALS, "DeleteJudgmentResponse", resp.json())
    assert resp.json() == {"status": "deleted", "name": "prefs"}
    error(client.delete("/v1/judgments/prefs"), 404, "judgment_not_found")


def test_render_prompt_returns_the_exact_judge_prompt(client):
    resp = client.post("/v1/judgments/render_prompt", json=body(7, "skip"))
    validate(EVALS, "RenderJudgmentPromptResponse", resp.json())
    assert resp.json()["prompt"] == (
        "Compare the following two assistant replies to this conversation:\n\n# Conversation\n"
        "[user] Explain 7.\n\n# Reply A\nA long answer 7\n\n# Reply B\nA concise answer 7\n\n"
        "Which reply is better? Answer with `Winner: A`, `Winner: B`, or `Winner: Tie`."
    )
    error(client.post("/v1/judgments/render_prompt", json={"prompt": []}), 400, "judgment_invalid")


def test_compile_writes_a_swap_augmented_sft_dataset(client, prefs):
    for i in range(10):
        client.post("/v1/judgments/prefs/rows", json=body(i, ["a", "b", "tie", "skip"][i % 4]))
    resp = client.post("/v1/judgments/prefs/compile", json={"output_dataset": "prefs-sft"})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    validate(EVALS, "CompileJudgmentResponse", out)
    # 10 rows: holdout min(20, 10 // 5) = 2; 8 training rows of which 2 are skips -> 6 x 2 orientations.
    assert (out["holdout_n"], out["train_validation_split"], out["rows"]) == (2, 8, 12)
    assert out["warnings"] == []
    assert client.get("/v1/eval/datasets/prefs-sft").json()["num_rows"] == 12
    manifest = client.get("/v1/judgments").json()["judgments"][0]
    assert manifest["last_compiled_split"] == 8


def test_compile_with_zero_holdout_warns(client, prefs):
    client.post("/v1/judgments/prefs/rows", json=body())
    out = client.post("/v1/judgments/prefs/compile", json={"output_dataset": "o", "holdout_n": 0}).json()
    assert out["rows"] == 2 and any("holdout_n is 0" in w for w in out["warnings"])


def test_compile_errors(client, prefs):
    error(client.post("/v1/judgments/prefs/compile", json={"output_dataset": "o"}), 400, "judgment_invalid")
    client.post("/v1/judgments/prefs/rows", json=body())
    error(client.post("/v1/judgments/prefs/compile", json={"output_dataset": "o", "holdout_n": -1}), 400,
          "judgment_invalid")
    error(client.post("/v1/judgments/prefs/compile", json={"output_dataset": "../o", "holdout_n": 0}), 400,
          "dataset_invalid")
    error(client.post("/v1/judgments/nope/compile", json={"output_dataset": "o"}), 404, "judgment_not_found")
    assert client.post("/v1/judgments/prefs/compile", json={"output_dataset": "o", "holdout_n": 0}).status_code == 200
    error(client.post("/v1/judgments/prefs/compile", json={"output_dataset": "o", "holdout_n": 0}), 409,
          "dataset_exists")


def segment(name: str) -> str:
    return quote(name, safe="").replace(".", "%2E")


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_names_are_rejected_on_every_route(client, settings, name):
    err = error(client.post("/v1/judgments", json={"name": name}), 400, "dataset_invalid")
    assert err["param"] == "name"
    seg = segment(name)
    routes = [("POST", f"/v1/judgments/{seg}/rows", body()), ("DELETE", f"/v1/judgments/{seg}/rows/r1", None),
              ("DELETE", f"/v1/judgments/{seg}", None), ("GET", f"/v1/judgments/{seg}", None),
              ("POST", f"/v1/judgments/{seg}/compile", {"output_dataset": "o"})]
    for method, path, payload in routes:
        resp = client.request(method, path, json=payload, follow_redirects=False)
        if "/" in name or not name:
            assert resp.status_code in (307, 404, 405), (method, path, resp.status_code)
        else:
            error(resp, 400, "judgment_invalid")
    assert client.get("/v1/judgments").json() == {"judgments": []}
    assert not (Path(settings.data.data_dir) / "x").exists()


# ---- CLI -------------------------------------------------------------------------------------

REQUEST_ENTRYPOINTS = {("POST", "/v1/judgments"): "CreateJudgmentBody", ("POST", "rows"): "AppendJudgmentBody",
                       ("POST", "render_prompt"): "AppendJudgmentBody", ("POST", "compile"): "CompileJudgmentBody"}


@pytest.fixture
def cli(client, monkeypatch):
    class InProcess(client_module.ServerClient):
        """Talks to the in-process app and checks every JSON body the CLI sends against the contract."""

        def __init__(self, url: str, timeout: float = 600.0):
            self.url, self.http = url, client

        def request(self, method, path, **kw):
            if "json" in kw:
                key = (method, path) if path == "/v1/judgments" else (method, path.rsplit("/", 1)[-1])
                validate(EVALS, REQUEST_ENTRYPOINTS[key], kw["json"])
            return super().request(method, path, **kw)

    monkeypatch.setattr(client_module, "ServerClient", InProcess)

    def run(*argv: str) -> int:
        parser = argparse.ArgumentParser()
        judgments_cli.register(parser.add_subparsers())
        args = parser.parse_args(["judgments", *argv])
        return args.func(args)

    return run


def test_cli_create_append_list_render_compile_delete(cli, tmp_path, capsys):
    assert cli("create", "prefs", "--description", "Concise") == 0
    assert "created prefs" in capsys.readouterr().out
    assert cli("append", "prefs", "--prompt", "Explain.", "--response-a", "long", "--response-b", "short",
               "--winner", "b", "--id", "j1", "--tag", "style") == 0
    assert "appended j1 (1 rows)" in capsys.readouterr().out
    batch = tmp_path / "more.jsonl"
    batch.write_text("\n".join(json.dumps(body(i, "a")) for i in range(4)) + "\n")
    assert cli("append", "prefs", "--file", str(batch)) == 0
    assert capsys.readouterr().out.count("appended") == 4
    assert cli("list") == 0 and "prefs" in capsys.readouterr().out
    assert cli("render-prompt", "--prompt", "Explain.", "--response-a", "long", "--response-b", "short") == 0
    assert capsys.readouterr().out.startswith("Compare the following two assistant replies")
    assert cli("compile", "prefs", "--output", "prefs-sft", "--holdout-n", "0") == 0
    out = capsys.readouterr().out
    assert "compiled 10 rows into prefs-sft" in out and "warning: holdout_n is 0" in out
    assert cli("delete", "prefs", "--row", "j1") == 0 and "4 rows left" in capsys.readouterr().out
    assert cli("delete", "prefs") == 0 and "deleted prefs" in capsys.readouterr().out


def test_cli_append_without_a_verdict_explains_what_is_missing(cli):
    with pytest.raises(SystemExit) as e:
        cli("append", "prefs", "--prompt", "q", "--response-a", "a", "--response-b", "b")
    assert "--winner" in str(e.value)
