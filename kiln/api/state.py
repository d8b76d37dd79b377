"""What the routers reach through `request.app.state.kiln`: settings, the engine and the typed services."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import Request

from kiln.adapters.active import model_spec_for
from kiln.api.access_log import note_request
from kiln.api.services import Services
from kiln.api.shutdown import Lifecycle
from kiln.config import Settings
from kiln.engine.served_records import record_from_finished
from kiln.errors import model_loading

if TYPE_CHECKING:
    from kiln.engine.chat_response import FinishedCompletion
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
        self._engine = engine
        if engine is not None and self not in engine.observers:
            engine.observers.append(self)

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

    # -- kiln.engine.serving.CompletionObserver: fan out to the services that observe completions ---
    def completion_started(self) -> None:
        self.services.metrics.completion_started()

    def completion_finished(self, done: FinishedCompletion) -> None:
        self.services.metrics.completion_finished(done)
        rec = record_from_finished(done)
        if rec is not None:
            self.services.recorder.finished(rec)
        # the request's access line (kiln.api.access_log): what was generated, for whom, how fast
        ttft = done.timeline.ttft_ms() if done.timeline is not None else None
        note_request(model=done.model, adapter=done.adapter, prompt_tokens=done.prompt_tokens,
                     completion_tokens=sum(len(o.token_ids) for o in done.outputs),
                     ttft_ms=round(ttft, 1) if ttft is not None else None,
                     finish_reason=",".join(sorted(set(done.finish_reasons))) or done.status)


def get_state(request: Request) -> ServerState:
    return request.app.state.kiln
