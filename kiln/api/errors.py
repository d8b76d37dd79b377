"""Every failure leaves the server as `{"error": {"message", "type", "param", "code", "hint"}}`.

Validation failures are 400 (never FastAPI's 422 `{"detail": ...}`); unexpected exceptions are 500
`internal_error` with the traceback in the log, not in the body.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.api.access_log import note_request
from kiln.errors import KilnError
from kiln.store.strict_json import loads_strict

log = logging.getLogger("kiln.api")

M = TypeVar("M", bound=BaseModel)


def error_response(err: KilnError) -> JSONResponse:
    note_request(error=err.code)   # the access line says which error, not only the status
    return JSONResponse(err.to_body(), status_code=err.status, headers=err.headers)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [p for p in loc if p not in ("body", "query", "path")]
    if not parts:
        return None
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out


def validation_error_to_kiln(exc: ValidationError | RequestValidationError, code: str, prefix: str) -> KilnError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    where = f"{param}: " if param else ""
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return KilnError(400, code, f"{prefix}{where}{msg}{more}", param=param)


def parse_model(model: type[M], data: Any, *, code: str = "invalid_request", prefix: str = "") -> M:
    """Validate a decoded JSON body into `model`, raising a 400 KilnError that names the field."""
    if not isinstance(data, dict):   # pydantic would say "Input should be a valid dictionary or instance of X"
        raise KilnError(400, code, f"{prefix}the request body must be a JSON object, not {_json_kind(data)}",
                        hint="Send the fields as one JSON object, e.g. {\"messages\": [...]}.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error_to_kiln(exc, code, prefix) from None


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else type(value).__name__


async def read_json_body(request: Request, *, code: str = "invalid_request", prefix: str = "",
                         max_bytes: int | None = None, what: str = "request body", hint: str | None = None,
                         optional: bool = False) -> Any:
    """The body as strict JSON (400 naming the problem); with `max_bytes`, a larger body is a 413 (the
    declared length is checked before anything is read); `optional`: an empty body is None."""
    if max_bytes is not None:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise _too_large(code, prefix, what, max_bytes, hint)
    raw = await request.body()
    if max_bytes is not None and len(raw) > max_bytes:
        raise _too_large(code, prefix, what, max_bytes, hint)
    if optional and not raw.strip():
        return None
    if not raw.strip():
        raise KilnError(400, code, f"{prefix}request body is empty; expected a JSON object")
    try:
        body = loads_strict(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise KilnError(400, code, f"{prefix}request body is not valid JSON: {e}",
                        hint="Send a JSON object with Content-Type: application/json.") from None
    reject_non_finite(body, code=code, prefix=prefix)
    return body


async def parse_body(request: Request, model: type[M], *, code: str, prefix: str = "") -> M:
    """`read_json_body` then `parse_model`: the request body as `model`, or a 400 naming the field."""
    return parse_model(model, await read_json_body(request, code=code, prefix=prefix), code=code, prefix=prefix)


def _too_large(code: str, prefix: str, what: str, max_bytes: int, hint: str | None) -> KilnError:
    return KilnError(413, code, f"{prefix}{what} is larger than {max_bytes >> 20} MiB", hint=hint)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KilnError)
    async def _kiln(_: Request, exc: KilnError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error_to_kiln(exc, "invalid_request", ""))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        hint = "See GET /openapi.json for the routes this server has." if exc.status_code in (404, 405) else None
        return error_response(KilnError(exc.status_code, code, str(exc.detail), hint=hint))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(KilnError(500, "internal_error", f"internal error: {type(exc).__name__}: {exc}"))


def reject_non_finite(value: Any, *, code: str, prefix: str, path: str = "") -> None:
    """A JSON number too large for a double (1e999) parses as infinity; no field may carry one."""
    if isinstance(value, float) and not math.isfinite(value):
        raise KilnError(400, code, f"{prefix}{path or 'body'}: numbers must be finite", param=path or None,
                        hint="Send finite JSON numbers.")
    if isinstance(value, dict):
        for k, v in value.items():
            reject_non_finite(v, code=code, prefix=prefix, path=f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            reject_non_finite(v, code=code, prefix=prefix, path=f"{path}[{i}]")
