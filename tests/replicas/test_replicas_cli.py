"""`kiln replicas list` shows, per replica, which revision of each adapter it serves and any failed push."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from kiln.commands import replicas as cmd
from kiln.commands.client import ServerClient
from kiln.config import DataSettings, Settings
from kiln.server import build_server


@pytest.fixture
def records(tmp_path, monkeypatch):
    settings = Settings(data=DataSettings(data_dir=str(tmp_path / "data")),
                        replicas=[{"name": "gpu-a", "url": "http://127.0.0.1:9", "kind": "vllm"}])
    server = build_server(settings, routers=["kiln.api.routers.replicas"])

    def fake_init(self, url, timeout=600.0):
        self.url = url
        self.http = TestClient(server.app, base_url=url)

    monkeypatch.setattr(ServerClient, "__init__", fake_init)
    return server.state.services.replicas.records


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kiln")
    cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_list_shows_the_served_revision_and_the_failed_push_beside_it(records, capsys):
    records.set("gpu-a", "tone", "sha256:" + "a1" * 32)
    records.fail("gpu-a", "tone", "sha256:" + "b2" * 32, "POST /v1/load_lora_adapter: HTTP 400: bad", 1)
    assert run("replicas", "list") == 0
    out = capsys.readouterr().out
    assert "tone@" + "a1" * 6 in out and "tone@" + "b2" * 6 + ": POST /v1/load_lora_adapter" in out
