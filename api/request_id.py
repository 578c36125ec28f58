"""A request id on every answer (`x-request-id`, the header OpenAI's SDK reads into `e.request_id` and
`response.request_id`), on every log line written while the request is in hand, on gunicorn's access line for it and
in every problem body: a user quotes it, an operator greps the logs for it.

A client's own `X-Request-Id` (a proxy's, a tracing library's) is kept when it is sane: short, and only characters that
cannot break a log line or a header. Otherwise one is made in OpenAI's shape, `req_` and 32 hex digits.
"""

from __future__ import annotations

import re
import secrets
import traceback

from flask import Flask, Response, g, request
from gunicorn.glogging import Logger

from storage.logs import current_request

HEADER = "X-Request-Id"
SANE = r"[A-Za-z0-9][A-Za-z0-9._:/+=@-]{0,127}"  # a client's id kept as it is (api/openapi.py documents it)
_SANE = re.compile(SANE)


def new_id() -> str:
    return f"req_{secrets.token_hex(16)}"


def from_client(value: str | None) -> str | None:
    """The client's id when it is sane, else None (a new one is made)."""
    return value if value is not None and _SANE.fullmatch(value) else None


def register(app: Flask) -> None:
    """Registered first, so that every answer has it, errors raised by later hooks included."""

    @app.before_request
    def _assign() -> None:
        g.request_id = from_client(request.headers.get(HEADER)) or new_id()
        g.request_log_token = current_request.set(g.request_id)

    @app.after_request
    def _answer(response: Response) -> Response:
        if "request_id" in g:
            response.headers[HEADER] = g.request_id
        return response

    @app.teardown_request
    def _forget(_: BaseException | None) -> None:
        if (token := g.pop("request_log_token", None)) is not None:
            current_request.reset(token)


class AccessLog(Logger):
    """gunicorn's logger (`logger_class` in infra/gunicorn.conf.py), whose access line carries the answer's request id
    as a field: gunicorn writes it after the application returned, when the request's log context is gone."""

    def access(self, resp, req, environ, request_time) -> None:
        if not self.access_log_enabled:
            return
        request_id = next((value for name, value in resp.headers if name.lower() == "x-request-id"), None)
        try:
            atoms = self.atoms_wrapper_class(self.atoms(resp, req, environ, request_time))
            self.access_log.info(self.cfg.access_log_format, atoms, extra={"request_id": request_id})
        except Exception:
            self.error(traceback.format_exc())
