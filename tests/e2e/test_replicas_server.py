"""Replicas with real processes: a coordinating `kiln serve` and Kiln replicas on loopback ports.

Publishing an adapter reaches every replica (which then answers exactly as the coordinator does), a
replica serving other base weights under the same name is refused, and an eval fanned out over the
replicas scores exactly as a single-engine run does, even when a replica dies mid-run.
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from kiln.testing.schemas import validate
from tests.replicas.http_stand_ins import FaultProxy

from .conftest import start_server, stop_server
from .test_adapters_server import _peft_archive

pytestmark = pytest.mark.e2e
MSG = [{"role": "user", "content": "Tell me about the mountains."}]
ADAPTER = "fleet-x"


def start_many(model: str, dirs) -> list:
    """Servers started side by side (each start mostly waits on imports and the model load)."""
    from concurrent.futures import ThreadPoolExecutor

    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(len(dirs)) as pool:
        futures = [pool.submit(start_server, model, d, "--served-model-id", "tiny") for d in dirs]
    servers, errors = [], []
    for f in futures:
        try:
            servers.append(f.result())
        except Exception as e:  # noqa: BLE001 - stop the ones that started, then fail
            errors.append(e)
    if errors:
        for s in servers:
            stop_server(s)
        raise errors[0]
    return servers


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    """The coordinator (holding ADAPTER) and three replicas of the same tiny model."""
    tmp = tmp_path_factory.mktemp("fleet")
    servers = start_many(str(tiny_model_dir), [tmp / f"s{i}" for i in range(4)])
    try:
        coordinator, replicas = servers[0], servers[1:]
        data = _peft_archive(tiny_model_dir, tmp, ADAPTER, ["q_proj", "v_proj", "down_proj"], 1)
        r = httpx.post(coordinator.url + "/v1/adapters/upload", data={"name": ADAPTER},
                       files={"archive": (f"{ADAPTER}.tar.gz", data, "application/gzip")}, timeout=60)
        assert r.status_code == 200, r.text
        for i, rep in enumerate(replicas):
            r = httpx.post(coordinator.url + "/v1/replicas", timeout=30,
                           json={"name": f"r{i}", "url": rep.url, "kind": "kiln", "max_concurrency": 4})
            assert r.status_code == 200, r.text
            assert r.json()["status"]["compatible"] is True, r.json()
        yield coordinator, replicas
    finally:
        for s in servers:
            stop_server(s)


def suite(name: str, n: int, max_tokens: int = 24) -> dict:
    prompts = ["Tell me a story.", "What is 2 + 2?", "Name a colour.", "Hello!", "Where is Paris?"]
    return {"name": name, "schema_version": 2,
            "default_scorer": {"kind": "regex", "pattern": "[Tt]he|[aeiou]{2}"},
            "generation": {"max_tokens": max_tokens, "temperature": 0.8},
            "examples": [{"id": f"ex{i}", "messages": [{"role": "user", "content": f"{prompts[i % 5]} #{i}"}]}
                         for i in range(n)]}


def run_eval(url: str, body: dict, *, on_running=None, timeout: float = 300.0) -> tuple[dict, float]:
    """(the finished job's result, seconds from submission to its end)."""
    started = time.monotonic()
    r = httpx.post(url + "/v1/eval/run", json=body, timeout=60)
    assert r.status_code == 200, r.text
    job_id = r.json()["job_id"]
    while time.monotonic() - started < timeout:
        result = httpx.get(f"{url}/v1/eval/jobs/{job_id}", timeout=30).json()
        if result["state"] in ("completed", "failed", "cancelled"):
            elapsed = time.monotonic() - started
            validate("kiln-evals-v1.schema.json", "EvalResult", result)  # the contract's object, unchanged
            return result, elapsed
        if on_running is not None and result["state"] == "running":
            on_running(job_id)
        time.sleep(0.05)
    raise AssertionError(f"eval job {job_id} did not finish in {timeout}s")


def outcomes(result: dict) -> dict[str, tuple[str, str]]:
    return {o["example_id"]: (o["raw_completion_text"], o["kind"], o["score"]) for o in result["runs"][0]["outcomes"]}


def scores(result: dict) -> dict:
    """The run's metrics less how long things took (which placement changes, as it should)."""
    return {k: v for k, v in result["runs"][0]["metrics"].items()
            if k not in ("latency", "elapsed_secs") and "per_sec" not in k}


def _chat(url: str, model: str) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"model": model, "messages": MSG, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_an_adapter_published_to_all_answers_identically_on_each(fleet):
    coordinator, replicas = fleet
    r = httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/publish", json={"replicas": "all"}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "published" and set(body["replicas"]) == {"r0", "r1", "r2"}
    revision = body["revision"]
    assert all(e["revision"] == revision and e["action"] == "uploaded" for e in body["replicas"].values())
    here = _chat(coordinator.url, ADAPTER)
    assert here != _chat(coordinator.url, "tiny")  # the adapter changes the answer
    assert [_chat(rep.url, ADAPTER) for rep in replicas] == [here] * 3
    # the record says which revision each serves; publishing again changes nothing
    listed = {x["name"]: x for x in httpx.get(coordinator.url + "/v1/replicas").json()["data"]}
    assert all(listed[n]["published"][ADAPTER]["revision"] == revision for n in ("r0", "r1", "r2"))
    again = httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/publish", json={"replicas": ["r1"]}, timeout=120)
    assert again.json()["replicas"]["r1"]["action"] == "unchanged"


def test_unpublish_takes_the_adapter_back(fleet):
    coordinator, replicas = fleet
    r = httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/publish", json={"replicas": ["r2"]}, timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/unpublish", json={"replicas": ["r2"]}, timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "unpublished", r.text
    names = [a["name"] for a in httpx.get(replicas[2].url + "/v1/adapters").json()["available"]]
    assert ADAPTER not in names
    pubs = httpx.get(f"{coordinator.url}/v1/adapters/{ADAPTER}/publications").json()["replicas"]
    assert "r2" not in pubs
    # an eval on the adapter may not use a replica that does not serve it
    r = httpx.post(coordinator.url + "/v1/eval/run", timeout=60,
                   json={"inline_suite": suite("no-adapter", 2), "adapter": ADAPTER, "replicas": ["r2"]})
    assert r.status_code == 409 and r.json()["error"]["code"] == "replica_not_ready", r.text
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "adapters", "publish", ADAPTER, "--replicas", "r2",
                           "--url", coordinator.url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "r2: uploaded" in done.stdout, done.stdout + done.stderr
    listing = subprocess.run([sys.executable, "-m", "kiln.cli", "replicas", "list", "--url", coordinator.url],
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0 and "r2" in listing.stdout and ADAPTER in listing.stdout, listing.stderr


def test_a_failed_re_publish_leaves_the_replica_serving_its_previous_revision(fleet, tiny_model_dir, tmp_path):
    """A real Kiln replica behind a proxy that refuses the new revision's upload (503, each retry): the
    replica keeps answering with the revision it had, and the records say so and that the push failed."""
    coordinator, replicas = fleet
    name = "fleet-z"

    def store_here(seed: int) -> None:
        data = _peft_archive(tiny_model_dir, tmp_path, f"{name}-{seed}", ["q_proj", "v_proj", "down_proj"], seed)
        r = httpx.post(coordinator.url + "/v1/adapters/upload", data={"name": name}, timeout=60,
                       files={"archive": (f"{name}.tar.gz", data, "application/gzip")})
        assert r.status_code == 200, r.text

    proxy = FaultProxy(replicas[0].url)
    try:
        store_here(3)
        r = httpx.post(coordinator.url + "/v1/replicas", json={"name": "flaky", "url": proxy.url}, timeout=30)
        assert r.status_code == 200 and r.json()["status"]["compatible"] is True, r.text
        r = httpx.post(f"{coordinator.url}/v1/adapters/{name}/publish", json={"replicas": ["flaky"]}, timeout=120)
        assert r.status_code == 200, r.text
        first = r.json()["revision"]
        old_answer = _chat(replicas[0].url, name)
        assert old_answer == _chat(coordinator.url, name)

        assert httpx.delete(f"{coordinator.url}/v1/adapters/{name}").status_code == 200
        store_here(4)  # a new revision under the same name
        new_answer = _chat(coordinator.url, name)
        assert new_answer != old_answer
        proxy.fail = lambda method, path: 503 if (method, path) == ("POST", "/v1/adapters/upload") else None
        r = httpx.post(f"{coordinator.url}/v1/adapters/{name}/publish", json={"replicas": ["flaky"]}, timeout=120)
        assert r.status_code == 502, r.text
        second, entry = r.json()["revision"], r.json()["replicas"]["flaky"]
        assert second != first and entry["status"] == "failed" and entry["attempts"] == 3
        assert len(proxy.refused) == 3 and "503" in entry["error"]
        assert entry["previous"]["revision"] == first and entry["serving"] == first
        assert _chat(replicas[0].url, name) == old_answer  # the old revision still answers
        pubs = httpx.get(f"{coordinator.url}/v1/adapters/{name}/publications").json()
        assert pubs["replicas"]["flaky"]["revision"] == first
        assert pubs["failed_pushes"]["flaky"]["revision"] == second

        proxy.fail = lambda method, path: None
        r = httpx.post(f"{coordinator.url}/v1/adapters/{name}/publish", json={"replicas": ["flaky"]}, timeout=120)
        assert r.status_code == 200 and r.json()["replicas"]["flaky"]["action"] == "replaced", r.text
        assert _chat(replicas[0].url, name) == new_answer
        pubs = httpx.get(f"{coordinator.url}/v1/adapters/{name}/publications").json()
        assert pubs["replicas"]["flaky"]["revision"] == second and pubs["failed_pushes"] == {}
    finally:
        httpx.post(f"{coordinator.url}/v1/adapters/{name}/unpublish", json={"replicas": ["flaky"]}, timeout=120)
        httpx.delete(coordinator.url + "/v1/replicas/flaky")
        proxy.close()


def test_a_replica_serving_other_base_weights_is_refused(fleet, tmp_path):
    from kiln.testing.tiny import make_tiny_model

    coordinator, _ = fleet
    other_model = make_tiny_model(tmp_path / "other", arch="llama", init_std=0.3, seed=7)
    other = start_server(str(other_model), tmp_path, "--served-model-id", "tiny")
    try:
        r = httpx.post(coordinator.url + "/v1/replicas", json={"name": "other", "url": other.url}, timeout=30)
        status = r.json()["status"]
        assert status["state"] == "ok" and status["compatible"] is False
        assert "digest" in status["compatibility_problem"]
        r = httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/publish", json={"replicas": ["r0", "other"]},
                       timeout=120)
        assert r.status_code == 409 and r.json()["error"]["code"] == "replica_not_ready"
        assert "other" in r.json()["error"]["message"]
        names = [a["name"] for a in httpx.get(other.url + "/v1/adapters").json()["available"]]
        assert ADAPTER not in names
    finally:
        httpx.delete(coordinator.url + "/v1/replicas/other")
        stop_server(other)


def test_a_vllm_replica_gets_a_peft_folder_in_the_shared_dir_and_load_lora_adapter(fleet, tiny_model_dir, tmp_path):
    """vLLM's protocol, spoken to a Kiln server that allows runtime LoRA paths as vLLM does with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING (no vLLM on this CPU machine)."""
    coordinator, _ = fleet
    shared = tmp_path / "shared-loras"
    shared.mkdir()
    other = start_server(str(tiny_model_dir), tmp_path, "--served-model-id", "tiny",
                         env={"KILN_SERVER_ALLOW_EXTERNAL_LORA_PATHS": "1"})
    try:
        r = httpx.post(coordinator.url + "/v1/replicas", timeout=30,
                       json={"name": "v", "url": other.url + "/v1", "kind": "vllm", "lora_dir": str(shared)})
        assert r.status_code == 200 and r.json()["status"]["compatible"] is True, r.text
        r = httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/publish", json={"replicas": ["v"]}, timeout=120)
        assert r.status_code == 200 and r.json()["replicas"]["v"]["action"] == "loaded", r.text
        (folder,) = shared.iterdir()
        assert folder.name.startswith(ADAPTER + "-")
        config = __import__("json").loads((folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
        assert _chat(other.url, ADAPTER) == _chat(coordinator.url, ADAPTER)
        r = httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/unpublish", json={"replicas": ["v"]}, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        httpx.delete(coordinator.url + "/v1/replicas/v")
        stop_server(other)


def test_export_for_vllm_prints_the_serve_command(fleet, tmp_path):
    coordinator, _ = fleet
    out = tmp_path / "vllm-out"
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "adapters", "export", ADAPTER, str(out), "--format",
                           "vllm", "--url", coordinator.url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert f"--enable-lora --max-lora-rank 8 --lora-modules {ADAPTER}={out.resolve()}" in done.stdout
    assert "/v1/load_lora_adapter" in done.stdout


def test_a_training_job_whose_gate_passes_publishes_its_adapter(fleet):
    coordinator, replicas = fleet
    # the gate needs 20 pairs; every answer passes on both sides, so no pair can regress (a 1-epoch SFT
    # job's answers differ run to run, and a sampled suite once read as a significant regression) and
    # the thresholds alone decide: kept
    held = {**suite("held", 20, 4), "default_scorer": {"kind": "regex", "pattern": "^"}}
    assert httpx.post(coordinator.url + "/v1/eval/suites", json=held, timeout=30).status_code == 200
    rows = [{"messages": [{"role": "user", "content": f"Say the word #{i}"},
                          {"role": "assistant", "content": "quillton"}]} for i in range(4)]
    r = httpx.post(coordinator.url + "/v1/train/sft", timeout=60, json={
        "examples": rows, "config": {"output_name": "gated", "epochs": 1, "lora_rank": 4, "auto_load": False},
        # min_accuracy and relative_recovery 0 are always met: the gate passes ("kept": auto_load is off)
        "post_eval": {"suite": "held", "min_accuracy": 0.0, "relative_recovery": 0.0, "publish_on_pass": ["r0"]}})
    assert r.status_code == 200, r.text
    job_id = r.json()["job_id"]
    deadline = time.monotonic() + 240
    pubs: dict = {}
    while time.monotonic() < deadline and "r0" not in pubs:
        status = httpx.get(f"{coordinator.url}/v1/train/status/{job_id}", timeout=10).json()
        assert status["state"] not in ("failed", "cancelled"), status
        assert status.get("gate_outcome") in (None, "pending", "kept"), status
        pubs = httpx.get(f"{coordinator.url}/v1/adapters/gated/publications", timeout=10).json()["replicas"]
        time.sleep(0.3)
    assert status["gate_outcome"] == "kept", status
    assert set(pubs) == {"r0"}
    assert _chat(replicas[0].url, "gated") == _chat(coordinator.url, "gated")


def test_a_fanned_out_eval_scores_as_a_local_run_and_its_placement_is_recorded(fleet):
    coordinator, _ = fleet
    r = httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/publish", json={"replicas": "all"}, timeout=120)
    assert r.status_code == 200, r.text
    times, results = {}, {}
    for label, replicas in (("local", None), ("1 replica", ["r0"]), ("3 replicas", "all")):
        body = {"inline_suite": suite("fan", 24), "adapter": ADAPTER, "seed": 11}
        if replicas is not None:
            body["replicas"] = replicas
        results[label], times[label] = run_eval(coordinator.url, body)
        assert results[label]["state"] == "completed", results[label]
    assert outcomes(results["3 replicas"]) == outcomes(results["local"]) == outcomes(results["1 replica"])
    assert scores(results["3 replicas"]) == scores(results["local"]) == scores(results["1 replica"])
    placement = httpx.get(f"{coordinator.url}/v1/eval/jobs/{results['3 replicas']['job_id']}/placement").json()
    assert placement["replicas"] == ["r0", "r1", "r2"] and len(placement["examples"]) == 24
    assert placement["replica_list"] == [{"name": f"r{i}", "url": rep.url, "kind": "kiln", "max_concurrency": 4}
                                         for i, rep in enumerate(fleet[1])]
    used = {e["target"] for e in placement["examples"]}
    assert used == {"local", "r0", "r1", "r2"}, placement
    print("eval wall time, 24 examples x 24 tokens:", {k: round(v, 2) for k, v in times.items()})


def test_a_replica_killed_mid_eval_has_its_examples_reassigned(fleet):
    coordinator, replicas = fleet
    reference, _ = run_eval(coordinator.url, {"inline_suite": suite("kill", 60, 64), "adapter": "", "seed": 5})
    killed = []

    def kill_r1_once_running(job_id: str) -> None:
        if killed:
            return
        replicas[1].proc.kill()  # SIGKILL while the job runs: whatever r1 holds in flight is lost there
        placement = httpx.get(f"{coordinator.url}/v1/eval/jobs/{job_id}/placement", timeout=30).json()
        killed.append(sum(1 for e in placement["examples"] if e["target"] is not None))

    result, _ = run_eval(coordinator.url, {"inline_suite": suite("kill", 60, 64), "adapter": "", "seed": 5,
                                           "replicas": "all"}, on_running=kill_r1_once_running)
    assert killed, "the job ended before r1 could be killed"
    assert result["state"] == "completed"
    assert outcomes(result) == outcomes(reference)
    assert scores(result) == scores(reference)
    placement = httpx.get(f"{coordinator.url}/v1/eval/jobs/{result['job_id']}/placement").json()
    r1 = next(t for t in placement["targets"] if t["name"] == "r1")
    assert all(e["target"] is not None for e in placement["examples"])
    assert r1["down"] is True and placement["reassigned"] >= 1, placement
    print(f"kill test: r1 killed after {killed[0]} of 60 examples were answered; retries {placement['retries']}, "
          f"reassigned {placement['reassigned']}; answered per target",
          {t["name"]: t["answered"] for t in placement["targets"]})
