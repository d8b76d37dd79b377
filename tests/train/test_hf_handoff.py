"""Training handed to TRL and brought back: the SFT bundle's train.py runs as written on the tiny model,
and the PEFT folder it saves imports through the upload's checks and serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.tiny_server import tiny_server

ROUTERS = ["kiln.api.routers.chat", "kiln.api.routers.adapters", "kiln.api.routers.datasets", "kiln.api.routers.judgments",
           "kiln.api.routers.hf_interop"]
ROWS = [{"messages": [{"role": "user", "content": f"What is the code word #{i}?"},
                      {"role": "assistant", "content": "The code word is quillton."}]} for i in range(6)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("hf"), ROUTERS, attach_adapters=True) as srv:
        yield srv


def test_the_bundle_holds_rows_template_lora_config_script_pins_and_readme(server):
    r = server.client.post("/v1/train/hf/sft/exports", json={"name": "look", "examples": ROWS,
                                                             "config": {"lora_rank": 4, "target_modules": ["q_proj"]}})
    assert r.status_code == 200, r.text
    body = r.json()
    folder = Path(body["path"])
    assert body["files"] == ["README.md", "chat_template.jinja", "kiln_sft.json", "requirements.txt", "train.jsonl",
                             "train.py"]
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    assert rows == ROWS
    assert (folder / "chat_template.jinja").read_text() == server.state.engine.tokenizer.chat_template
    cfg = json.loads((folder / "kiln_sft.json").read_text())
    assert cfg["lora"]["r"] == 4 and cfg["lora"]["target_modules"] == ["q_proj"]
    assert cfg["base_model"] == str(server.model.resolve())
    pins = (folder / "requirements.txt").read_text().splitlines()
    assert {p.split("==")[0] for p in pins} == {"torch", "transformers", "peft", "trl", "accelerate", "datasets"}
    assert "accelerate launch train.py" in (folder / "README.md").read_text()
    assert server.client.post("/v1/train/hf/sft/exports", json={"name": "look", "examples": ROWS}).status_code == 409
    bad = server.client.post("/v1/train/hf/sft/exports", json={"name": "x", "examples": [{"messages": []}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "examples[0]"


def test_train_py_runs_with_trl_and_its_adapter_imports_and_serves(server, tmp_path):
    pytest.importorskip("trl")
    r = server.client.post("/v1/train/hf/sft/exports", json={
        "name": "handoff", "examples": ROWS,
        "config": {"lora_rank": 4, "lora_alpha": 8, "learning_rate": 0.05, "target_modules": ["q_proj", "v_proj"]}})
    assert r.status_code == 200, r.text
    folder = r.json()["path"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf-home"), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "train.py", "--max-steps", "2"], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    adapter = os.path.join(folder, "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    r = server.client.post("/v1/train/hf/peft/imports/handoff", json={"path": adapter})
    assert r.status_code == 200 and r.json()["status"] == "imported", r.text
    chat = {"messages": [{"role": "user", "content": "What is the code word #1?"}], "max_tokens": 8,
            "temperature": 0}
    tuned = server.client.post("/v1/chat/completions", json={**chat, "model": "handoff",
                                                             "include_performance": True})
    assert tuned.status_code == 200, tuned.text
    assert tuned.json()["metadata"]["performance"]["adapter_used"] == "handoff"
    # outside the exports folder the operator's switch decides, as for /v1/load_lora_adapter
    r = server.client.post("/v1/train/hf/peft/imports/other", json={"path": str(tmp_path)})
    assert r.status_code == 403 and r.json()["error"]["code"] == "lora_path_not_allowed"


def test_a_dpo_bundle_from_a_judgment_set_trains_with_trl_and_imports(server, tmp_path):
    pytest.importorskip("trl")
    client = server.client
    assert client.post("/v1/judgments", json={"name": "prefs"}).status_code == 200
    for i, winner in enumerate(["a", "b", "tie", "a"]):
        r = client.post("/v1/judgments/prefs/rows", json={
            "prompt": [{"role": "user", "content": f"Greet me #{i}"}], "response_a": "Hello there, friend!",
            "response_b": "go away", "winner": winner})
        assert r.status_code == 200, r.text
    r = client.post("/v1/train/hf/dpo/exports", json={"name": "dpo-handoff", "judgments": "prefs",
                                                     "config": {"lora_rank": 4, "target_modules": ["q_proj"]}})
    assert r.status_code == 200, r.text
    folder = r.json()["path"]
    rows = [json.loads(line) for line in Path(folder, "train.jsonl").read_text().splitlines()]
    assert len(rows) == 3  # the tie is left out
    assert rows[1]["chosen"] == [{"role": "assistant", "content": "go away"}]
    assert json.loads(Path(folder, "kiln_dpo.json").read_text())["training"]["beta"] == 0.1
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf-home"), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "train.py", "--max-steps", "2"], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = client.post("/v1/train/hf/peft/imports/dpo-handoff", json={"path": os.path.join(folder, "adapter")})
    assert r.status_code == 200 and r.json()["status"] == "imported", r.text
