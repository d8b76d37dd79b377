"""`kiln adapters ...` against the real routes (in-process), printing server errors with hint."""

from __future__ import annotations

import argparse
import io
import tarfile

import pytest
from fastapi.testclient import TestClient

import kiln.api.app as app_module
import kiln.cli
from kiln.adapters.store import AdapterStore
from kiln.commands import adapters as cmd
from kiln.commands.client import ServerClient
from kiln.config import DataSettings, Settings
from kiln.server import build_state
from kiln.store.folder_archive import pack_folder
from tests.adapters.helpers import save_random


@pytest.fixture
def store(tmp_path, monkeypatch):
    settings = Settings(data=DataSettings(data_dir=str(tmp_path / "data")))
    s = AdapterStore(settings.adapter_dir)
    state = build_state(settings, adapter_store=s)
    save_random(s, "a", r=2, alpha=4, modules=["q_proj"], seed=1)
    save_random(s, "b", r=2, alpha=4, modules=["q_proj"], seed=2)
    app = app_module.create_app(settings, state, routers=["kiln.api.routers.adapters"])

    def fake_init(self, url, timeout=600.0):
        self.url = url
        self.http = TestClient(app, base_url=url)

    monkeypatch.setattr(ServerClient, "__init__", fake_init)
    return s


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kiln")
    cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_command_is_registered():
    assert "kiln.commands.adapters" in kiln.cli.COMMAND_MODULES


def test_list_prints_active_and_adapters(store, capsys):
    assert run("adapters", "load", "a") == 0
    assert run("adapters", "list") == 0
    out = capsys.readouterr().out
    assert "active: a" in out and "* a" in out and "  b" in out


def test_unload_reverts_to_base(store, capsys):
    run("adapters", "load", "a")
    assert run("adapters", "unload") == 0
    run("adapters", "list")
    assert "active: base" in capsys.readouterr().out


def test_upload_a_folder_and_download_it(store, tmp_path):
    assert run("adapters", "upload", "copy", str(store.root / "a")) == 0
    assert store.content_hash("copy") == store.content_hash("a")
    out = tmp_path / "copy.tgz"
    assert run("adapters", "download", "copy", "-o", str(out)) == 0
    with tarfile.open(out, "r:gz") as tar:
        assert "copy/adapter_model.safetensors" in tar.getnames()


def test_merge_with_weights(store, capsys):
    assert run("adapters", "merge", "m", "a:0.25", "b", "--mode", "ties", "--density", "0.5") == 0
    assert "merged 2 adapter(s) into m (mode ties" in capsys.readouterr().out
    assert "m" in store.names()


def test_delete(store):
    assert run("adapters", "delete", "b") == 0
    assert store.names() == ["a"]


def test_server_errors_print_message_and_hint(store, capsys):
    assert run("adapters", "delete", "nope") == 1
    err = capsys.readouterr().err
    assert "error 404 [adapter_not_found]" in err and "hint:" in err


def test_download_errors_print_the_envelope(store, capsys, tmp_path):
    assert run("adapters", "download", "nope", "-o", str(tmp_path / "x.tgz")) == 1
    assert "adapter_not_found" in capsys.readouterr().err
    assert not (tmp_path / "x.tgz").exists()


def test_parse_source_weights():
    assert cmd.parse_source("a:0.5") == {"name": "a", "weight": 0.5}
    assert cmd.parse_source("a") == {"name": "a", "weight": 1.0}


def test_pack_folder_is_flat_and_regular_files_only(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "adapter_config.json")
    with tarfile.open(fileobj=io.BytesIO(pack_folder(tmp_path)), mode="r:gz") as tar:
        assert tar.getnames() == ["adapter_config.json"]
