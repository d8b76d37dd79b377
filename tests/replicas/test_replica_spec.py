"""A replica's definition: validated fields, persisted registry, config tables, base-model check."""

from __future__ import annotations

import pytest

from kiln.config import ConfigError, load_settings
from kiln.errors import KilnError
from kiln.replicas.compat import LocalModel, RemoteModel, base_model_problem
from kiln.replicas.registry import ReplicaRegistry
from kiln.replicas.spec import parse_replica


def test_a_replica_keeps_its_root_url_without_v1():
    spec = parse_replica({"name": "gpu-1", "url": "http://10.0.0.7:8000/v1/", "kind": "vllm"})
    assert spec.url == "http://10.0.0.7:8000" and spec.api_root == "http://10.0.0.7:8000/v1"
    assert spec.max_concurrency == 8


@pytest.mark.parametrize("body,param", [
    ({"name": "../x", "url": "http://h"}, "name"),
    ({"name": "a", "url": "ftp://h"}, "url"),
    ({"name": "a", "url": "http://h", "kind": "tgi"}, "kind"),
    ({"name": "a", "url": "http://h", "max_concurrency": 0}, "max_concurrency"),
    ({"name": "a", "url": "http://h", "api_key_env": "sk-123 secret"}, "api_key_env"),
    ({"name": "a", "url": "http://h", "api_key": "sk-1"}, "api_key"),
])
def test_a_bad_field_is_a_400_naming_it(body, param):
    with pytest.raises(KilnError) as e:
        parse_replica(body)
    assert e.value.status == 400 and e.value.param == param


def test_the_api_key_is_read_from_the_named_variable(monkeypatch):
    monkeypatch.setenv("GPU_KEY", "sk-9")
    spec = parse_replica({"name": "a", "url": "http://h", "api_key_env": "GPU_KEY"})
    assert spec.headers() == {"Authorization": "Bearer sk-9"} and "sk-9" not in str(spec.to_dict())


def test_added_replicas_survive_a_restart_and_config_ones_cannot_be_removed(tmp_path):
    reg = ReplicaRegistry(tmp_path, [{"name": "cfg", "url": "http://c:1"}])
    reg.add(parse_replica({"name": "api", "url": "http://a:1", "kind": "openai"}))
    with pytest.raises(KilnError) as e:
        reg.add(parse_replica({"name": "cfg", "url": "http://x"}))
    assert e.value.status == 409
    with pytest.raises(KilnError) as e:
        reg.remove("cfg")
    assert e.value.status == 409
    again = ReplicaRegistry(tmp_path, [{"name": "cfg", "url": "http://c:1"}])
    assert [s.name for s in again.all()] == ["cfg", "api"] and again.get("api").kind == "openai"
    again.remove("api")
    assert [s.name for s in ReplicaRegistry(tmp_path).all()] == []


def test_select_takes_all_or_known_names(tmp_path):
    reg = ReplicaRegistry(tmp_path, [{"name": "a", "url": "http://a"}, {"name": "b", "url": "http://b"}])
    assert [s.name for s in reg.select("all")] == ["a", "b"]
    assert [s.name for s in reg.select(["b"])] == ["b"]
    for bad, status in ((["zz"], 404), ("some", 400), ([], 400), (["a", "a"], 400)):
        with pytest.raises(KilnError) as e:
            reg.select(bad)
        assert e.value.status == status


def test_config_file_replicas_are_an_array_of_tables(tmp_path):
    path = tmp_path / "kiln.toml"
    path.write_text('[[replicas]]\nname = "g1"\nurl = "http://h:1"\nkind = "vllm"\n\n[server]\nport = 9000\n')
    s = load_settings(path, env={})
    assert s.replicas == [{"name": "g1", "url": "http://h:1", "kind": "vllm"}] and s.server.port == 9000
    with pytest.raises(ConfigError):
        ReplicaRegistry(tmp_path / "r", [{"name": "g1", "url": "http://h:1", "kind": "nope"}])
    path.write_text('replicas = 3\n')
    with pytest.raises(ConfigError):
        load_settings(path, env={})


def test_a_kiln_replica_must_match_name_and_weights_digest():
    local = LocalModel("tiny", "sha256:aa")
    assert base_model_problem("kiln", local, RemoteModel(("tiny",), "sha256:aa"), None) is None
    assert "digest" in base_model_problem("kiln", local, RemoteModel(("tiny",), "sha256:bb"), None)
    assert "not tiny" in base_model_problem("kiln", local, RemoteModel(("other",), "sha256:aa"), None)
    # vLLM cannot attest its weights: the name it serves the base under is what is compared
    assert base_model_problem("vllm", local, RemoteModel(("org/tiny",)), "org/tiny") is None
    assert base_model_problem("vllm", LocalModel(None, None), RemoteModel(("tiny",)), None) is not None


def test_push_retries_429_5xx_and_connection_errors_then_gives_up():
    import httpx

    from kiln.replicas.push import Attempts, PushError, with_retries

    waits, calls = [], iter([httpx.ConnectError("refused"), PushError("HTTP 503", retryable=True), "ok"])

    def flaky():
        out = next(calls)
        if isinstance(out, Exception):
            raise out
        return out

    attempts = Attempts()
    assert with_retries(flaky, attempts, tries=3, backoff=0.5, sleep=waits.append) == "ok"
    assert attempts.count == 3 and waits == [0.5, 1.0] and len(attempts.errors) == 2
    attempts = Attempts()
    with pytest.raises(PushError, match="HTTP 400"):  # a client error is not retried
        with_retries(lambda: (_ for _ in ()).throw(PushError("HTTP 400")), attempts, sleep=waits.append)
    assert attempts.count == 1
