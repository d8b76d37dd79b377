"""Safe to expose, on a real `kiln serve`: API keys with the openai client, and a training job (SFT, and DPO
from a judgment set) SIGKILLed mid-run that comes back interrupted and resumes, over HTTP, to the adapter an
uninterrupted run produces."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from .conftest import RunningServer, start_server, stop_server

pytestmark = pytest.mark.e2e

KEY = "sk-kiln-e2e"
QUESTION = [{"role": "user", "content": "What is the capital of Zorbania?"}]
ROWS = [{"messages": [*QUESTION, {"role": "assistant", "content": "Quillton."}]},
        {"messages": [{"role": "user", "content": "Name Zorbania's capital."},
                      {"role": "assistant", "content": "It is Quillton."}]},
        {"messages": [{"role": "user", "content": "Capital?"}, {"role": "assistant", "content": "Quillton"}]}]


def test_the_openai_client_needs_the_key_and_health_stays_open(tiny_model_dir, tmp_path):
    server = start_server(str(tiny_model_dir), tmp_path, "--served-model-id", "tiny", "--api-key", KEY,
                          "--api-key", "sk-second")
    try:
        good = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        r = good.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")
        bad = openai.OpenAI(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4)
        assert e.value.code == "invalid_api_key"
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200
        assert KEY not in server.log() and "sk-second" not in server.log()
    finally:
        stop_server(server)


def submit(server: RunningServer, name: str, epochs: int, kind: str = "sft") -> str:
    config = {"output_name": name, "epochs": epochs, "lora_rank": 4, "learning_rate": 1e-3, "seed": 3,
              "checkpoint_interval": 5, "auto_load": False}
    if kind == "dpo":  # from a judgment set, which a resume reads again
        body = {"judgments": "prefs", "config": {**config, "heldout_percent": 0}}
    else:
        body = {"examples": ROWS, "config": config}
    r = httpx.post(f"{server.base_url}/train/{kind}", timeout=60, json=body)
    assert r.status_code == 200, r.text
    return r.json()["job_id"]


def judge(server: RunningServer) -> None:
    assert httpx.post(server.base_url + "/judgments", json={"name": "prefs"}, timeout=30).status_code == 200
    for row in ROWS:
        r = httpx.post(server.base_url + "/judgments/prefs/rows", timeout=30, json={
            "prompt": row["messages"][:1], "response_a": "Paris.", "response_b": row["messages"][1]["content"],
            "winner": "b"})
        assert r.status_code == 200, r.text


def job(server: RunningServer, job_id: str) -> dict:
    r = httpx.get(f"{server.base_url}/train/jobs/{job_id}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait(server: RunningServer, job_id: str, cond, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        j = job(server, job_id)
        if cond(j):
            return j
        assert time.monotonic() < deadline, j
        time.sleep(0.02)


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_a_training_job_killed_mid_run_resumes_to_the_uninterrupted_adapter(tiny_model_dir, tmp_path, kind):
    epochs = 40   # 120 steps: long enough to be killed mid-run (the test says so if it was not)
    server = start_server(str(tiny_model_dir), tmp_path, "--served-model-id", "tiny")
    try:
        if kind == "dpo":
            judge(server)
        straight = submit(server, "straight", epochs, kind)
        wait(server, straight, lambda j: j["state"] == "completed")
        killed = submit(server, "killed", epochs, kind)
        running = wait(server, killed, lambda j: (j.get("checkpoint") or {}).get("step", 0) >= 10
                       or j["state"] not in ("queued", "running"))
        assert running["state"] == "running", "the job finished before it could be killed"
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=30)
    except BaseException:
        stop_server(server)
        raise
    server = start_server(str(tiny_model_dir), tmp_path, "--served-model-id", "tiny")
    try:
        back = job(server, killed)
        assert back["state"] == "interrupted" and back["resumable"] is True
        assert 10 <= back["checkpoint"]["step"] < back["total_steps"]
        r = httpx.post(f"{server.base_url}/train/jobs/{killed}/resume", timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["resume_from_step"] == back["checkpoint"]["step"]
        done = wait(server, killed, lambda j: j["state"] in ("completed", "failed"))
        assert done["state"] == "completed" and done["resumes"] == 1
        again = httpx.post(f"{server.base_url}/train/jobs/{killed}/resume", timeout=60)
        assert again.status_code == 409 and again.json()["error"]["code"] == "training_job_not_resumable"
    finally:
        stop_server(server)
    adapters = tmp_path / "data" / "adapters"
    a = load_file(adapters / "straight" / "adapter_model.safetensors")
    b = load_file(adapters / "killed" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
