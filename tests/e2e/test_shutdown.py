"""Graceful shutdown on a real `kiln serve`: SIGTERM stops admitting (503 + Retry-After),
a running stream finishes whole, a running training job is checkpointed and left interrupted, the
shutdown hooks run (the request log flushed: the drained stream's row is on disk, whole), and the
process exits 0; restarted with auto_resume, the job continues from its
checkpoint by itself."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from kiln.traffic.request_log import read_rows

from .conftest import start_server

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "Tell me a long story."}]
ROWS = [{"messages": [*QUESTION, {"role": "assistant", "content": "Once upon a time."}]}]


def stream_all(url: str, out: dict) -> None:
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
                out["started"] = True
    out["chunks"] = chunks


def test_sigterm_drains_streams_checkpoints_training_and_exits_zero(tiny_model_dir, tmp_path):
    server = start_server(str(tiny_model_dir), tmp_path, "--served-model-id", "tiny",
                          env={"KILN_SERVER_SHUTDOWN_TIMEOUT_SECS": "60", "KILN_REQUEST_LOG_ENABLED": "true"})
    try:
        r = httpx.post(server.base_url + "/train/sft", timeout=60, json={
            "examples": ROWS, "config": {"output_name": "story", "epochs": 2000, "lora_rank": 2,
                                         "checkpoint_interval": 0, "auto_load": False}})
        assert r.status_code == 200, r.text
        job_id = r.json()["job_id"]
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.base_url}/train/jobs/{job_id}").json()["step"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        training = httpx.get(server.url + "/health", timeout=10).json()["training"]
        assert training["active_job"]["job_id"] == job_id and training["queued"] == 0, training
        out: dict = {}
        reader = threading.Thread(target=stream_all, args=(server.url, out))
        reader.start()
        while not out.get("started"):
            assert reader.is_alive() and time.monotonic() < deadline, out
            time.sleep(0.01)

        server.proc.send_signal(signal.SIGTERM)
        refused = None
        # Probe until the process is gone, not only while the stream runs: on a fast machine the
        # tiny model's stream can end before the first probe, and the server still drains after it.
        while server.proc.poll() is None and refused is None:
            try:
                probe = httpx.get(server.base_url + "/models", timeout=5)
            except httpx.HTTPError:
                break
            if probe.status_code == 503:
                refused = probe
            time.sleep(0.02)
        reader.join(timeout=120)
        assert server.proc.wait(timeout=120) == 0, server.log()[-3000:]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()

    assert refused is not None, f"no request was refused while draining\n{server.log()[-3000:]}"
    assert refused.headers["retry-after"] and refused.json()["error"]["code"] == "server_shutting_down"
    assert out.get("status") == 200 and out.get("chunks", [""])[-1] == "[DONE]", (out, server.log()[-3000:])
    finals = [json.loads(c) for c in out["chunks"][:-1] if json.loads(c).get("choices")]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"
    log = server.log()
    assert "shutdown hook training done" in log and "shutdown hook request_log done" in log
    assert "Traceback" not in log, log[-3000:]  # a clean stop logs no error
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in finals)
    rows = [r for r in read_rows(tmp_path / "data" / "requests") if r["id"] == finals[0]["id"]]
    assert len(rows) == 1 and rows[0]["streamed"] is True, rows
    assert rows[0]["choices"][0]["message"]["content"] == streamed

    # Restarted with [training] auto_resume, the job continues from its checkpoint by itself.
    again = start_server(str(tiny_model_dir), tmp_path, "--served-model-id", "tiny",
                         env={"KILN_TRAINING_AUTO_RESUME": "true"})
    try:
        deadline = time.monotonic() + 60
        while (job := httpx.get(f"{again.base_url}/train/jobs/{job_id}").json()).get("resumes", 0) == 0:
            assert time.monotonic() < deadline, job
            time.sleep(0.05)
        assert job["state"] in ("queued", "running"), (job, again.log()[-3000:])
        while job.get("resumed_from_step") is None:
            assert time.monotonic() < deadline, job
            time.sleep(0.05)
            job = httpx.get(f"{again.base_url}/train/jobs/{job_id}").json()
        assert job["resumed_from_step"] == job["checkpoint"]["step"] >= 3, (job, again.log()[-3000:])
        httpx.delete(f"{again.base_url}/train/jobs/{job_id}", timeout=30)
    finally:
        again.proc.kill()
        again.proc.wait(timeout=30)
