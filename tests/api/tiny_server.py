"""An in-process app over a tiny generated model with a chosen set of routers, for the API tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from fastapi.testclient import TestClient

from kiln.api.app import create_app
from kiln.config import DataSettings, EngineSettings, ModelSettings, Settings
from kiln.server import build_state


@contextmanager
def tiny_server(root: Path, routers: Sequence[str], *, attach_adapters: bool = False) -> Iterator[SimpleNamespace]:
    """`client`, `state`, `settings` and `model` (the tiny model's folder) of a float32 tiny llama."""
    from kiln.engine.build import build_engine
    from kiln.testing.tiny import make_tiny_model

    model = make_tiny_model(root / "tiny", arch="llama", init_std=0.3)
    settings = Settings(model=ModelSettings(path=str(model), dtype="float32", served_model_id="tiny"),
                        data=DataSettings(data_dir=str(root / "data")),
                        engine=EngineSettings(kv_cache_memory_mb=8, max_model_len=320))
    state = build_state(settings)
    state.engine = build_engine(settings)
    try:
        app = create_app(settings, state, routers=routers)
        if attach_adapters:
            state.attach_adapters()
        yield SimpleNamespace(client=TestClient(app), state=state, settings=settings, model=model)
    finally:
        state.engine.shutdown()
