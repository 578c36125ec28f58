"""Errors as RFC 9457 problem+json, each with a stable `code` a client can switch on and a `detail` a person can read.

4xx is the caller's mistake and says what to fix; 5xx says only that it is ours (the traceback goes to the log,
never to the caller).
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask, Response, json, request
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

log = logging.getLogger("vsrq.api")

_TITLES = {
    400: "Bad request",
    401: "Unauthorized",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    413: "Content too large",
    415: "Unsupported media type",
    422: "Unprocessable content",
    500: "Internal server error",
    503: "Service unavailable",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        *,
        errors: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.errors, self.headers = status, code, detail, errors, headers or {}


def problem(
    status: int,
    code: str,
    detail: str,
    *,
    errors: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body: dict[str, Any] = {
        "type": f"urn:vsrq:problem:{code}",
        "title": _TITLES.get(status, "Error"),
        "status": status,
        "code": code,
        "detail": detail,
        "instance": request.path,
    }
    if errors:
        body["errors"] = errors
    response = Response(json.dumps(body), status=status, mimetype="application/problem+json")
    response.headers.update(headers or {})
    return response


def field_errors(error: ValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors as {field, code, message}, without echoing the input back."""
    return [
        {"field": ".".join(str(part) for part in item["loc"]) or None, "code": item["type"], "message": item["msg"]}
        for item in error.errors(include_url=False, include_input=False, include_context=False)
    ]


def register(app: Flask) -> None:
    # An error answered before the body was read whole (401, 413...) needs no draining here: gunicorn closes
    # gracefully (FIN, then reads what is left) so the client gets the answer, not a connection reset.
    @app.errorhandler(ApiError)
    def _api_error(error: ApiError) -> Response:
        return problem(error.status, error.code, error.detail, errors=error.errors, headers=error.headers)

    @app.errorhandler(HTTPException)
    def _http(error: HTTPException) -> Response:
        code = (error.name or "error").lower().replace(" ", "_")
        allow = getattr(error, "valid_methods", None)  # 405 says what is allowed
        return problem(
            error.code or 500,
            code,
            error.description or error.name,
            headers={"Allow": ", ".join(allow)} if allow else None,
        )

    @app.errorhandler(Exception)  # a bug, or a broken dependency: an invalid record from Redis is not the caller's
    def _internal(error: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.path)
        return problem(500, "internal_error", "Something went wrong on our side; the error has been logged.")
