"""The one error type every layer raises for a client-visible failure.

The API layer turns it into the wire envelope `{"error": {"message", "type", "param", "code", "hint"}}`
(semantics.md §0, §13.4). Pure layers raise it too, so a validation rule lives in one place and the
HTTP status travels with it instead of being re-decided by each router.
"""

from __future__ import annotations

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    507: "insufficient_storage_error",
}


class KilnError(Exception):
    """A failure with an HTTP status, a stable `code`, the offending `param` and a `hint`."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        hint: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.hint = hint
        self.headers = headers or {}

    @property
    def type(self) -> str:
        if self.status >= 500 and self.status not in _TYPES:
            return "server_error"
        return _TYPES.get(self.status, "invalid_request_error")

    def to_body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
                "hint": self.hint or _default_hint(self.status),
            }
        }


def _default_hint(status: int) -> str:
    if status == 404:
        return "Check the name; list what exists with the matching GET route."
    if status == 409:
        return "The resource is in a conflicting state; see the message."
    if status == 503:
        return "The server is busy or not ready; retry after the Retry-After interval."
    if status >= 500:
        return "This is a server-side failure; the server log has details."
    return "Fix the request as the message says and send it again."


def not_found(code: str, message: str, *, param: str | None = None, hint: str | None = None) -> KilnError:
    return KilnError(404, code, message, param=param, hint=hint)


def conflict(code: str, message: str, *, param: str | None = None, hint: str | None = None) -> KilnError:
    return KilnError(409, code, message, param=param, hint=hint)


def model_loading() -> KilnError:
    """503 while the weights load (every route that needs the model answers this one error)."""
    return KilnError(503, "model_loading", "the model is still loading", hint="Retry after 5 s (the Retry-After header), when GET /health answers 200.",
                     headers={"Retry-After": "5"})
