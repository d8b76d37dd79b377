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
from kiln.config import DataSettings, EngineSettings, ModelSettings, Settings
from kiln.server import build_server, build_state
from kiln.testing.schemas import validate
from tests.evals.test_jobs_api import wait_done as wait_job

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
    return TestClient(build_server(settings).app)


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
              ("POST", f"/v1/judgments/{seg}/compile", {"output_dataset": "o"}),
              ("POST", f"/v1/judgments/{seg}/validate", {"adapter": ""})]
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
                       ("POST", "render_prompt"): "AppendJudgmentBody", ("POST", "compile"): "CompileJudgmentBody",
                       ("POST", "validate"): "PromoteJudgmentBody"}


def in_process_cli(client, monkeypatch):
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


@pytest.fixture
def cli(client, monkeypatch):
    return in_process_cli(client, monkeypatch)


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


# ---- validate (semantics.md §11.4) on a real tiny engine ------------------------------------------

TERMINAL = ("completed", "failed", "cancelled")


def wait_done(client, job_id: str) -> dict:
    return wait_job(client, job_id, timeout=120.0)   # generation on the tiny model takes a while here


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The whole app over a tiny llama with one saved LoRA adapter, `judge`; one event loop throughout."""
    from kiln.engine.build import build_engine
    from kiln.testing.tiny import make_tiny_model
    from tests.adapters.helpers import TINY, save_random

    root = tmp_path_factory.mktemp("judge-validate")
    # The adapter helpers' model shape, so their random factors fit.
    model = make_tiny_model(root / "tiny", arch="llama", hidden_size=TINY.hidden_size, num_heads=TINY.num_attention_heads,
                            num_kv_heads=TINY.num_key_value_heads, intermediate_size=TINY.intermediate_size,
                            init_std=0.3)
    settings = Settings(model=ModelSettings(path=str(model), dtype="float32", served_model_id="tiny"),
                        data=DataSettings(data_dir=str(root / "data")),
                        engine=EngineSettings(kv_cache_memory_mb=16, max_model_len=1024))
    state = build_state(settings)
    app = create_app(settings, state)
    services = state.services
    save_random(services.adapter_store, "judge", r=4, alpha=8, seed=3)
    engine = build_engine(settings)
    engine.attach_adapters(services.adapter_store, services.adapter_compose_cache,
                           services.adapters_active)
    state.engine = engine
    try:
        with TestClient(app) as client:
            yield client
    finally:
        engine.shutdown()


def judgment_set(client, name: str, winners: list[str], **first_extra) -> str:
    assert client.post("/v1/judgments", json={"name": name}).status_code == 200
    for i, winner in enumerate(winners):
        extra = {"id": f"j{i}", **(first_extra if i == len(winners) - 1 else {})}
        assert client.post(f"/v1/judgments/{name}/rows", json=body(i, winner, **extra)).status_code == 200
    return name


def test_validate_queues_the_held_out_suite_against_the_judge_adapter(served):
    name = judgment_set(served, "style", ["a", "b", "tie", "skip", "a", "b"], tags=["style"])
    suites_before = served.get("/v1/eval/suites").json()
    resp = served.post(f"/v1/judgments/{name}/validate", json={"adapter": "judge", "holdout_n": 3, "junk": 1})
    assert resp.status_code == 200, resp.text
    receipt = resp.json()
    validate(EVALS, "ValidateJudgmentResponse", receipt)
    assert receipt["status"] == "queued" and receipt["validation_suite"] == "judge-validate-style"
    never_compiled, skipped = receipt["warnings"]
    assert "never compiled" in never_compiled and "1 skip judgment(s)" in skipped
    result = wait_done(served, receipt["eval_job_id"])
    validate(EVALS, "EvalResult", result)
    assert result["state"] == "completed", result.get("error")
    assert result["effective_seed"] == receipt["effective_seed"]
    (run,) = result["runs"]
    assert run["suite_name"] == "judge-validate-style" and run["adapter"] == "judge"
    # The last 3 rows are skip, a, b: the skip is left out; ids are the judgment ids.
    assert [o["example_id"] for o in run["aggregated_outcomes"]] == ["j4", "j5"]
    assert run["metrics"]["num_examples"] == 2
    # Real greedy generations, capped at the suite's 64 tokens, scored by the verdict regex.
    assert all(o["kind"] in ("pass", "fail") and o["completion_tokens"] <= 64 for o in run["outcomes"])
    assert run["metrics"]["pass_rate_by_tag"].keys() == {"style"}
    # Inline: the validation suite is not registered.
    assert served.get("/v1/eval/suites").json() == suites_before


def test_validate_on_the_base_model_warns_about_overlap_with_the_last_compile(served):
    name = judgment_set(served, "overlap", ["a", "b", "tie", "a", "b"])
    assert served.post(f"/v1/judgments/{name}/compile", json={"output_dataset": "overlap-sft",
                                                               "holdout_n": 1}).status_code == 200
    receipt = served.post(f"/v1/judgments/{name}/validate", json={"adapter": "", "holdout_n": 2}).json()
    validate(EVALS, "ValidateJudgmentResponse", receipt)
    (warning,) = receipt["warnings"]
    assert "overlap" in warning
    result = wait_done(served, receipt["eval_job_id"])
    assert result["state"] == "completed" and result["runs"][0].get("adapter") is None
    assert [o["example_id"] for o in result["runs"][0]["aggregated_outcomes"]] == ["j3", "j4"]
    # Validating only what compile held out is clean.
    again = served.post(f"/v1/judgments/{name}/validate", json={"adapter": "", "holdout_n": 1}).json()
    assert again["warnings"] == []
    wait_done(served, again["eval_job_id"])


def test_validate_errors(served):
    name = judgment_set(served, "errs", ["a"])
    error(served.post("/v1/judgments/ghost/validate", json={"adapter": ""}), 404, "judgment_not_found")
    err = error(served.post(f"/v1/judgments/{name}/validate", json={"adapter": ""}), 400, "judgment_invalid")
    assert "at least 2" in err["message"]
    served.post(f"/v1/judgments/{name}/rows", json=body(9, "skip"))
    err = error(served.post(f"/v1/judgments/{name}/validate", json={"adapter": "", "holdout_n": 1}), 400,
                "judgment_invalid")
    assert err["param"] == "holdout_n" and "skips" in err["message"]
    err = error(served.post(f"/v1/judgments/{name}/validate", json={"adapter": "ghost"}), 404, "adapter_not_found")
    assert err["param"] == "adapter"
    for bad, param in [({}, "adapter"), ({"adapter": None}, "adapter"), ({"adapter": 3}, "adapter"),
                       ({"adapter": "", "holdout_n": -1}, "holdout_n"), ({"adapter": "", "holdout_n": "2"}, "holdout_n"),
                       ({"adapter": "", "holdout_n": True}, "holdout_n")]:
        err = error(served.post(f"/v1/judgments/{name}/validate", json=bad), 400, "judgment_invalid")
        assert err["param"] == param, (bad, err)
    error(served.post(f"/v1/judgments/{name}/validate", content=b"[1]"), 400, "judgment_invalid")
    assert all(j["state"] in TERMINAL for j in served.get("/v1/eval/jobs").json()["jobs"])


def test_cli_validate(served, monkeypatch, capsys):
    name = judgment_set(served, "cli-judge", ["a", "b", "tie"])
    run = in_process_cli(served, monkeypatch)
    assert run("validate", name, "--adapter", "judge", "--holdout-n", "2") == 0
    out = capsys.readouterr().out
    assert "scoring judge on suite judge-validate-cli-judge" in out and "warning: " in out
    job_id = out.split("queued eval job ", 1)[1].split()[0]
    assert wait_done(served, job_id)["state"] == "completed"
