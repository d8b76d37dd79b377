"""The dashboard (kiln/ui): `GET /` redirects to `/ui/`, which serves the bundled static page.

The page is plain files (HTML, CSS, ES modules) shipped as package data; nothing is fetched from
elsewhere and nothing is built. It talks to the public API only, plus two small read-only helpers
under `/ui/api/` for what the public API does not carry: the CPU code path the kernels run
(`info`) and the HTML report of an eval job (`eval-report/{job_id}`, the same file
`kiln eval report` writes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse
from starlette.concurrency import run_in_threadpool

from kiln import __version__
from kiln.api.state import get_state
from kiln.errors import KilnError

router = APIRouter(tags=["ui"], include_in_schema=False)

UI_DIR = Path(__file__).resolve().parents[2] / "ui"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png",
          ".ico": "image/x-icon", ".json": "application/json"}
# Revalidate on every load: the files change with the package, and they are tiny.
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui")
async def ui_bare() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui/api/info")
async def ui_info(request: Request) -> JSONResponse:
    """What the overview shows that no public route carries: the kernels' CPU code path."""
    from kiln.model import kernels

    engine = get_state(request).engine
    device = engine.info.device if engine is not None else None
    isa = None
    # ready() never blocks on a build; without an engine nothing here starts one
    if kernels.enabled() and device is not None and device.startswith("cpu") and kernels.ready() is not None:
        isa = kernels.best_isa()
    if not kernels.enabled():
        status = "disabled"
    elif isa is not None:
        status = "ready"
    elif kernels.load_error() is not None:
        status = "unavailable"
    else:
        status = "building" if device is not None and device.startswith("cpu") else None
    body: dict[str, Any] = {"version": __version__, "device": device, "cpu_isa": isa, "kernels": status}
    return JSONResponse(body)


@router.get("/ui/api/eval-report/{job_id}")
async def ui_eval_report(request: Request, job_id: str) -> HTMLResponse:
    from kiln.evals.report import ReportDependencyError, render_report

    jobs = get_state(request).services.eval_jobs
    if jobs is None:
        raise KilnError(503, "eval_registry_unavailable", "this server has no eval job manager")
    result = jobs.get(job_id).result()  # 404 in the envelope for an unknown job
    try:
        html = await run_in_threadpool(render_report, result)
    except ReportDependencyError as e:
        raise KilnError(503, "report_unavailable", str(e), hint="pip install 'kiln[reports]' on the server, "
                        "or use `kiln eval report JOB` where matplotlib is installed.") from None
    return HTMLResponse(html, headers={"Cache-Control": "no-store"})


@router.get("/ui/{path:path}")
async def ui_file(path: str) -> FileResponse:
    if path in ("", "index.html"):
        path = "index.html"
    target = (UI_DIR / path).resolve()
    # Only regular files inside the bundle, by a plain relative path.
    if (".." in Path(path).parts or path.startswith("/") or not target.is_relative_to(UI_DIR)
            or not target.is_file() or target.suffix not in _TYPES):
        raise KilnError(404, "not_found", f"/ui/{path} is not part of the dashboard", param="path",
                        hint="Open /ui/ for the dashboard.")
    return FileResponse(target, media_type=_TYPES[target.suffix], headers=_HEADERS)
