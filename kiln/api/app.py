"""The FastAPI application over a built server state (kiln.server.build_server): routers, error
envelope, auth, middleware. No logic lives here, and nothing is built here but the app."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from fastapi import FastAPI

from kiln import __version__
from kiln.api.access_log import RequestIdMiddleware
from kiln.api.auth import install_auth
from kiln.api.docs import install_docs, swagger_static_dir
from kiln.api.errors import install_error_handlers
from kiln.api.openapi import install_openapi
from kiln.api.shutdown import DrainMiddleware
from kiln.api.state import ServerState
from kiln.config import Settings

# Each module exposes `router` (an APIRouter) whose routes read `request.app.state.kiln`.
ROUTER_MODULES = [
    "kiln.api.routers.system",
    "kiln.api.routers.chat",
    "kiln.api.routers.completions",
    "kiln.api.routers.batch",
    "kiln.api.routers.metrics",
    "kiln.api.routers.datasets",
    "kiln.api.routers.judgments",
    "kiln.api.routers.adapters",
    "kiln.api.routers.adapter_export",
    "kiln.api.routers.eval_suites",
    "kiln.api.routers.synthesis",
    "kiln.api.routers.eval_jobs",
    "kiln.api.routers.replicas",  # after adapters and eval jobs: publishing and eval fan-out use both
    "kiln.api.routers.train",
    "kiln.api.routers.hf_interop",  # TRL handoff: SFT bundles out, PEFT folders back in
    "kiln.api.routers.teachers",
    "kiln.api.routers.stats",
    "kiln.api.routers.corrections",
    "kiln.api.routers.compat",
    "kiln.api.routers.ui",  # last: it owns `/` and everything under /ui
]


def create_app(settings: Settings, state: ServerState, routers: Sequence[str] | None = None) -> FastAPI:
    """The server's app; `routers` (module names, default ROUTER_MODULES) mounts a subset, as tests do."""
    swagger = swagger_static_dir()
    # /docs from this server's own Swagger UI files when they are installed (FastAPI's loads a CDN);
    # no /redoc, which has no offline copy.
    app = FastAPI(title="Kiln", version=__version__, description="Serve a model; make it better while it serves.",
                  docs_url=None if swagger is not None else "/docs", redoc_url=None)
    if swagger is not None:
        install_docs(app, swagger)
    app.state.kiln = state
    install_error_handlers(app)
    install_auth(app, settings)
    for name in ROUTER_MODULES if routers is None else routers:
        app.include_router(importlib.import_module(name).router)
    install_openapi(app)
    app.add_middleware(RequestIdMiddleware, access_log=settings.server.access_log)
    # Outermost: while draining, even a request without a key gets the 503 (and the counts stay exact).
    app.add_middleware(DrainMiddleware, lifecycle=app.state.kiln.lifecycle)
    return app
