"""The kernels' instruction set is visible: `engine.cpu_isa` picks it, /health and /v1/config show it,
and an ISA the CPU lacks stops the server from starting with an error that says so."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import kiln.api.app as app_module
from kiln.config import DataSettings, EngineSettings, ModelSettings, Settings
from kiln.model import kernels
from kiln.server import build_state

ROUTERS = ["kiln.api.routers.system", "kiln.api.routers.chat"]


def _settings(root, model, cpu_isa: str) -> Settings:
    return Settings(model=ModelSettings(path=str(model), served_model_id="tiny"),
                    data=DataSettings(data_dir=str(root / "data")),
                    engine=EngineSettings(kv_cache_memory_mb=8, max_model_len=128, cpu_isa=cpu_isa))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kiln.testing.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("cpu-isa")
    return root, make_tiny_model(root / "tiny", arch="llama", init_std=0.3)


@pytest.mark.parametrize("isa", kernels.cpu_isas()[-2:])
def test_health_and_config_show_the_isa_the_setting_chose(tiny_model, isa):
    from kiln.engine.build import build_engine

    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    root, model = tiny_model
    settings = _settings(root, model, isa)
    state = build_state(settings)
    with kernels.using_isa("auto"):   # restore this process's ISA afterwards
        state.engine = build_engine(settings)
        try:
            client = TestClient(app_module.create_app(settings, state, routers=ROUTERS))
            assert client.get("/health").json()["cpu_isa"] == isa
            config = client.get("/v1/config").json()
            assert config["settings"]["engine"]["cpu_isa"] == isa
            assert config["model"]["cpu_isa"] == isa
            assert config["model"]["cpu_kernels"]["cpu_isas"] == kernels.cpu_isas()
            # dtype "auto" is bfloat16 wherever the kernels run AVX2 or AVX-512 (the dense kernel)
            assert config["model"]["dtype"] == ("bfloat16" if isa != "scalar" else config["model"]["dtype"])
            reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 3, "temperature": 0})
            assert reply.status_code == 200
        finally:
            state.engine.shutdown()


def test_an_isa_the_cpu_lacks_stops_the_server_with_a_clear_error(tiny_model, monkeypatch):
    from kiln.engine.build import build_engine

    root, model = tiny_model
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse2", "avx2", "fma", "f16c"}))
    with kernels.using_isa("auto"), pytest.raises(ValueError, match="this CPU runs only scalar, avx2"):
        build_engine(_settings(root, model, "avx512"))
