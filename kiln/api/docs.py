"""`GET /docs`: Swagger UI over `/openapi.json`, served from the installed `swagger-ui-py` package.

FastAPI's own /docs page loads Swagger UI from a CDN, which a server with no network (the rule here)
shows as a blank page. The same Swagger UI 5 files ship inside the `swagger-ui-py` wheel; Kiln serves
them under /docs/static without importing that package (its __init__ pulls in framework adapters).
Without it installed, /docs falls back to FastAPI's CDN page.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_PREFIX = "/docs/static"


def swagger_static_dir() -> Path | None:
    """The Swagger UI files inside the installed swagger-ui-py (`swagger_ui/static`), or None."""
    spec = importlib.util.find_spec("swagger_ui")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        static = Path(root) / "static"
        if (static / "swagger-ui-bundle.js").is_file() and (static / "swagger-ui.css").is_file():
            return static
    return None


def install_docs(app: FastAPI, static: Path) -> None:
    """/docs loading Swagger UI from `static` (create the app with docs_url=None)."""
    app.mount(STATIC_PREFIX, StaticFiles(directory=static), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API",
                                   swagger_js_url=f"{STATIC_PREFIX}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{STATIC_PREFIX}/swagger-ui.css",
                                   swagger_favicon_url="/ui/favicon.svg")
