"""What the routers reach through `request.app.state.kiln`: settings, the engine and the typed services."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import Request

from kiln.adapters.active import model_spec_for
from kiln.api.services import Services
from kiln.api.shutdown import Lifecycle
from kiln.config import Settings
from kiln.errors import model_loading

if TYPE_CHECKING:
    from kiln.engine.view import EngineView


class ServerState:
    """Built by kiln.server.build_state: `build_services(state)` makes every service once (some, like
    the metrics, read the state back), before any router runs."""

    def __init__(self, settings: Settings, lifecycle: Lifecycle,
                 build_services: Callable[[ServerState], Services]) -> None:
        self.settings = settings
        self.started_at = time.time()
        self.load_error: str | None = None
        # Requests in flight, draining, and the shutdown hooks (kiln/api/shutdown.py).
        self.lifecycle = lifecycle
        self._engine: EngineView | None = None
        self.services: Services = build_services(self)

    @property
    def engine(self) -> EngineView | None:
        """The engine once the model has loaded; None while loading (health answers 503)."""
        return self._engine

    @engine.setter
    def engine(self, engine: EngineView | None) -> None:
        """Publish `engine`; the server's one traffic observer (kiln.api.observer) joins its observers."""
        self._engine = engine
        traffic = self.services.traffic
        if engine is not None and traffic not in engine.observers:
            engine.observers.append(traffic)

    def require_engine(self) -> EngineView:
        if self._engine is None:
            raise model_loading()
        return self._engine

    def attach_adapters(self, engine: EngineView | None = None) -> None:
        """Let the engine (`engine`, else the published one) serve the stored adapters, and serve again
        the default adapter the last process chose."""
        s = self.services
        engine = engine if engine is not None else self._engine
        if engine is not None:
            engine.attach_adapters(s.adapter_store, s.adapter_compose_cache, s.adapters_active)
            s.adapters_active.restore(model_spec_for(engine))


def get_state(request: Request) -> ServerState:
    return request.app.state.kiln
