"""Errors as RFC 9457 problem+json, each with a stable `code` a client can switch on and a `detail` a person can read.

4xx is the caller's mistake and says what to fix; 5xx says only that it is ours (the traceback goes to the log,
never to the caller). The same body also carries OpenAI's `error {message, type, code, param}`, so that OpenAI's SDK
(and clients written for it) show our message instead of the whole body; a 409 that retrying cannot fix says
`x-should-retry: false`, which the SDK obeys instead of retrying every 409 twice.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import botocore.exceptions
import redis.exceptions
from boto3.exceptions import RetriesExceededError, S3UploadFailedError
from flask import Flask, Response, g, request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from werkzeug.exceptions import HTTPException

from storage.blobs import refusal, storage_unavailable
from storage.overview import storage_problem

log = logging.getLogger("vsrq.api")
UNAVAILABLE_RETRY_AFTER_S = 5  # about a Redis restart with its AOF, or an S3 gateway's
REFUSED_RETRY_AFTER_S = 60  # storage refusing the service's key: mended by a person

_TITLES = {
    400: "Bad request",
    401: "Unauthorized",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    413: "Content too large",
    415: "Unsupported media type",
    422: "Unprocessable content",
    429: "Too many requests",
    500: "Internal server error",
    503: "Service unavailable",
}


class FieldError(BaseModel):
    model_config = ConfigDict(extra="allow")

    field: str | None = Field(description="the field as the caller named it; null for the request as a whole")
    code: str
    message: str


# OpenAI's error `type` for each status (its SDK maps statuses to exception classes; the type is for people and logs)
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    416: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
# the 409s that a later try can succeed
RETRY_FIXES = frozenset({"idempotency_in_flight", "idempotency_taken_over", "upload_completing"})
# OpenAI's video operations that generate from a prompt: its SDKs call them by method, so Werkzeug's "check the URL
# you entered" told their users nothing
_GENERATION_ONLY = (
    (re.compile(r"/v1/videos/[^/]+/remix/?"), "videos.remix"),
    (re.compile(r"/v1/videos/extensions/?"), "videos.extend"),
    (re.compile(r"/v1/videos/characters(/[^/]*)?/?"), "videos.create_character / get_character"),
)


class OpenAIError(BaseModel):
    message: str
    type: str
    code: str
    param: str | None = Field(None, description="the first field at fault, when there is one")


class Problem(BaseModel):
    """An RFC 9457 problem: the body of every error (the OpenAPI document is generated from this model)."""

    type: str = Field(description="urn:vsrq:problem:{code}")
    title: str
    status: int
    code: str = Field(description="stable: what a client switches on")
    detail: str = Field(description="for a person: what went wrong and what to do")
    instance: str = Field(description="the request path")
    errors: list[FieldError] | None = Field(None, description="per-field problems, when there are some")
    error: OpenAIError | None = Field(None, description="the same, as OpenAI's SDK reads an error")
    request_id: str | None = Field(
        None, description="the answer's `x-request-id`, which the API's log lines for this request carry"
    )

    @model_validator(mode="after")
    def _openai_error(self) -> Problem:
        if self.error is None:
            # OpenAI's SDK keeps only `error` (as `e.body`, its message as `e.message`): the field errors go in it, or
            # a detail that says "see `errors`" would point its user at nothing
            fields = "; ".join(
                f"{item.field}: {item.message}" if item.field else item.message
                for item in self.errors or []
                if not self.detail.rstrip(".").endswith(item.message.rstrip("."))  # a detail ending with it: said once
            )
            self.error = OpenAIError(
                message=f"{self.detail} {fields}" if fields else self.detail,
                type=_OPENAI_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error"),
                code=self.code,
                param=self.errors[0].field if self.errors else None,
            )
        return self


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
    body = Problem(
        type=f"urn:vsrq:problem:{code}",
        title=_TITLES.get(status, "Error"),
        status=status,
        code=code,
        detail=detail,
        instance=request.path,
        errors=errors or None,
        request_id=g.get("request_id"),
    )
    response = Response(
        body.model_dump_json(exclude={name for name in ("errors", "request_id") if getattr(body, name) is None}),
        status=status,
        mimetype="application/problem+json",
    )
    if status == 409 and code not in RETRY_FIXES:
        response.headers["x-should-retry"] = "false"
    response.headers.update(headers or {})
    return response


def field_errors(error: ValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors as {field, code, message}, without echoing the input back (nor the "Value error, " pydantic
    puts before a validator's own message)."""
    return [
        {
            "field": ".".join(str(part) for part in item["loc"]) or None,
            "code": item["type"],
            "message": item["msg"].removeprefix("Value error, "),
        }
        for item in error.errors(include_url=False, include_input=False, include_context=False)
    ]


def _no_route(error: HTTPException) -> Response:
    """A path or method no route serves, said in the API's terms (a route's own 404s are ApiErrors)."""
    for pattern, operation in _GENERATION_ONLY:
        if pattern.fullmatch(request.path):
            detail = (
                f"`{operation}` generates video from a prompt, which vsrq does not offer: it upscales videos. To "
                "upscale a completed job's output again, use `videos.edit` (POST /v1/videos/edits)."
            )
            return problem(404, "not_offered", detail)
    if error.code == 404:
        return problem(404, "not_found", f"No endpoint at {request.path}; /openapi.json lists the API's endpoints.")
    allow = getattr(error, "valid_methods", None) or []
    takes = f"; it takes {', '.join(allow)}" if allow else ""
    detail = f"{request.method} is not offered on {request.path}{takes}."
    return problem(405, "method_not_allowed", detail, headers={"Allow": ", ".join(allow)} if allow else None)


def register(app: Flask) -> None:
    # An error answered before the body was read whole (401, 413...) needs no draining here: gunicorn closes
    # gracefully (FIN, then reads what is left) so the client gets the answer, not a connection reset.
    @app.errorhandler(ApiError)
    def _api_error(error: ApiError) -> Response:
        return problem(error.status, error.code, error.detail, errors=error.errors, headers=error.headers)

    @app.errorhandler(HTTPException)
    def _http(error: HTTPException) -> Response:
        if error.code in (404, 405):
            return _no_route(error)
        code = (error.name or "error").lower().replace(" ", "_")
        return problem(error.code or 500, code, error.description or error.name)

    # Redis restarting (or loading its AOF, or full: storage.primary), blob storage unreachable: the request was fine,
    # it can be sent again shortly. Never a 500, so clients and load balancers retry instead of reporting a bug.
    @app.errorhandler(redis.exceptions.ConnectionError)
    @app.errorhandler(redis.exceptions.TimeoutError)
    @app.errorhandler(botocore.exceptions.ConnectionError)
    def _unavailable(error: Exception) -> Response:
        log.warning("dependency unavailable on %s %s: %s: %s", request.method, request.path, type(error).__name__,
                    error)  # fmt: skip
        return problem(
            503,
            "service_unavailable",
            "A backing service is briefly unavailable; retry after the delay in Retry-After.",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
        )

    # Storage refusing this service (its key, its writes, its bucket) is the operator's to mend, not the caller's:
    # 503, the refusal in the log; an answer S3 says may change (a full disk's 500) is an outage as above
    @app.errorhandler(botocore.exceptions.ClientError)
    @app.errorhandler(S3UploadFailedError)
    @app.errorhandler(RetriesExceededError)
    def _storage(error: Exception) -> Response:
        if storage_unavailable(error):
            return _unavailable(error)
        if not isinstance(error, botocore.exceptions.ClientError) or refusal(error) is None:
            return _internal(error)
        log.error("storage refuses this service on %s %s: %s", request.method, request.path, storage_problem(error))
        return problem(
            503,
            "storage_refused",
            "Storage refuses this service now; its operator has been told. Retry after the delay in Retry-After.",
            headers={"Retry-After": str(REFUSED_RETRY_AFTER_S)},
        )

    @app.errorhandler(Exception)  # a bug, or a broken dependency: an invalid record from Redis is not the caller's
    def _internal(error: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.path)
        return problem(500, "internal_error", "Something went wrong on our side; the error has been logged.")
