"""`kiln corrections` and `kiln requests export` against a real `kiln serve` on a tiny model."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from kiln.cli import main

from .conftest import start_server, stop_server

pytestmark = pytest.mark.e2e
MSG = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # Its own server: training switches the active adapter, which other e2e modules must not see.
    srv = start_server(str(tiny_model_dir), tmp_path_factory.mktemp("corr-cli"), "--served-model-id", "tiny",
                       env={"KILN_REQUEST_LOG_ENABLED": "1"})
    yield srv
    stop_server(srv)


def kiln(capsys, server, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--url", server.url])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_add_list_export_delete_and_train_from_the_command_line(server, capsys, tmp_path):
    served = httpx.post(server.base_url + "/chat/completions", timeout=60,
                        json={"messages": MSG, "max_tokens": 4, "temperature": 0}).json()
    code, out, _ = kiln(capsys, server, "corrections", "add", served["id"], "-c", "Blue.", "--note", "cli")
    assert code == 0 and out.startswith("corr-") and served["id"] in out
    cid = out.split(":")[0]
    code, out, _ = kiln(capsys, server, "corrections", "add", "--prompt", "Name a fruit.", "-c", "Apple.")
    assert code == 0
    other = out.split(":")[0]

    code, out, _ = kiln(capsys, server, "corrections", "list")
    assert code == 0 and cid in out and "2 pending, 0 trained" in out
    code, _, _ = kiln(capsys, server, "corrections", "delete", other)
    assert code == 0
    path = tmp_path / "c.jsonl"
    code, _, _ = kiln(capsys, server, "corrections", "export", "-o", str(path))
    assert code == 0
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"messages": [*MSG, {"role": "assistant", "content": "Blue."}]}]

    code, out, err = kiln(capsys, server, "corrections", "train", "-o", "cli-fixes", "--config",
                          '{"epochs": 1, "lora_rank": 2, "lora_alpha": 4}')
    assert code == 0, err
    assert "completed - adapter cli-fixes" in out and "1 correction" in err
    deadline = time.monotonic() + 30
    while True:
        code, out, _ = kiln(capsys, server, "corrections", "list", "--state", "trained", "--json")
        trained = json.loads(out)["data"]
        if trained or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [c["id"] for c in trained] == [cid] and trained[0]["trained_into"] == "cli-fixes"


def test_a_bad_correction_prints_the_servers_error_and_exits_1(server, capsys):
    code, _, err = kiln(capsys, server, "corrections", "add", "chatcmpl-unknown", "-c", "x")
    assert code == 1 and "request_not_found" in err and "hint:" in err


def test_requests_export_reads_the_servers_log_while_it_runs(server, capsys, tmp_path):
    httpx.post(server.base_url + "/chat/completions", timeout=60,
               json={"messages": MSG, "max_tokens": 3, "temperature": 0})
    out = tmp_path / "rows.jsonl"
    data_dir = server.log_path.parent / "data"
    deadline = time.monotonic() + 30
    while True:   # the writer thread appends a moment after the response
        code = main(["requests", "export", "--data-dir", str(data_dir), "--finish-reason", "any", "--kind", "chat",
                     "-o", str(out)])
        err = capsys.readouterr().err
        rows = [json.loads(line) for line in out.read_text().splitlines()] if code == 0 else []
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert code == 0, err
    assert rows and rows[-1]["messages"][:-1] == MSG and rows[-1]["messages"][-1]["role"] == "assistant"
    code = main(["requests", "export", "--dir", str(tmp_path / "nowhere"), "-o", str(out)])
    assert code == 1 and "no request log" in capsys.readouterr().err
