"""The gunicorn worker the API runs under (`worker_class` in infra/gunicorn.conf.py): gunicorn's threaded worker, whose
own error answers are problem+json with a stable `code`, like every other error of the API.

gunicorn answers some requests before Flask ever sees them (a control byte in a header, a malformed request line,
headers too large) with an HTML page. It has no hook for those pages: `Worker.handle_error` picks the status, logs
and writes the access log, then writes the page through `gunicorn.util.write_error`. That one function is replaced
in the worker process, so gunicorn keeps choosing the status and only the body changes.
"""

from __future__ import annotations

import socket

from gunicorn import util
from gunicorn.workers.gthread import ThreadWorker

from api.errors import Problem


class ProblemWorker(ThreadWorker):
    def init_process(self) -> None:
        util.write_error = write_problem
        super().init_process()  # runs the worker loop: never returns


def write_problem(sock: socket.socket, status: int, reason: str, message: str) -> None:
    """`gunicorn.util.write_error`'s signature: `reason` is the status's phrase, `message` gunicorn's detail (empty
    for its 500)."""
    code = "internal_error" if status >= 500 else reason.lower().replace(" ", "_")  # bad_request, uri_too_long...
    body = Problem(
        type=f"urn:vsrq:problem:{code}",
        title=reason,
        status=status,
        code=code,
        detail=f"The request is malformed: {message}." if message and status < 500 else reason,
        instance="",  # the request line may be what could not be read
    ).model_dump_json(exclude={"errors"}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/problem+json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    util.write_nonblock(sock, head.encode("latin-1") + body)
