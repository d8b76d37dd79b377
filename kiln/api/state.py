"""What the routers reach through `request.app.state.kiln`: settings, the engine and the typed services."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fastapi import Request

from kiln.api.access_log import note_request
from kiln.api.services import Services
from kiln.api.shutdown import Lifecycle
from kiln.config import Settings
from kiln.errors import model_loading

if TYPE_CHECKING:
    from kiln.engine.chat_response import FinishedCompletion
    from kiln.engine.serving import Engine


class ServerState:
    def __init__(self, settings: Settings, engine: Engine | None = None) -> None:
        self.settings = settings
        self.started_at = time.time()
        self.load_error: str | None = None
        # Stores and job managers (kiln.api.services), built by the routers' `init` in dependency order.
        self.services = Services()
        # Requests in flight, draining, and the shutdown hooks (kiln/api/shutdown.py).
        self.lifecycle = Lifecycle(settings.server.shutdown_timeout_secs)
        self._engine: Engine | None = None
        self.engine = engine

    @property
    def engine(self) -> Engine | None:
        """The engine once the model has loaded; None while loading (health answers 503)."""
        return self._engine

    @engine.setter
    def engine(self, engine: Engine | None) -> None:
        self._engine = engine
        observers = getattr(engine, "observers", None)  # a test's stand-in engine may have none
        if observers is not None and self not in observers:
            observers.append(self)

    def require_engine(self) -> Engine:
        if self._engine is None:
            raise model_loading()
        return self._engine

    def attach_adapters(self, engine: Engine | None = None) -> None:
        """Let the engine (`engine`, else the published one) serve the stored adapters, once both exist,
        and serve again the default adapter the last process chose."""
        s = self.services
        engine = engine if engine is not None else self._engine
        if engine is not None and s.adapter_store is not None:
            engine.attach_adapters(s.adapter_store, s.adapter_compose_cache, s.adapters_active)
            if s.adapters_active is not None:
                from kiln.adapters.active import model_spec_for

                s.adapters_active.restore(model_spec_for(engine))

    # -- kiln.engine.serving.CompletionObserver: fan out to the services that observe completions ---
    def completion_started(self) -> None:
        if self.services.metrics is not None:
            self.services.metrics.completion_started()

    def completion_finished(self, done: FinishedCompletion) -> None:
        if self.services.metrics is not None:
            self.services.metrics.completion_finished(done)
        if self.services.recorder is not None:
            from kiln.engine.records import record_from_finished

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
