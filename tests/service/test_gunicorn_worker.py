"""Requests gunicorn refuses before Flask sees them get problem+json with a stable code, from the real gunicorn the
API runs under (api/gunicorn_worker.py), sent over a raw socket since HTTP clients refuse to send such bytes."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from .conftest import KEYS, UPLOAD_LIMIT


def raw_request(api: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Sends `request` as it is; (status, headers in lower case, body) of the answer, read until gunicorn closes."""
    parts = urlsplit(api)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as conn:
        conn.sendall(request)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize(
    "request_bytes, status, code",
    [
        (b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Note: a\x01b\r\n\r\n", 400, "bad_request"),  # control byte
        (b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX\x7fNote: ab\r\n\r\n", 400, "bad_request"),  # in a name
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: localhost\r\n\r\n", 414, "uri_too_long"),
    ],
)
def test_gunicorns_own_errors_are_problems(api, request_bytes, status, code):
    answered, headers, body = raw_request(api, request_bytes)
    assert (answered, headers["content-type"]) == (status, "application/problem+json"), body
    assert int(headers["content-length"]) == len(body)
    problem = json.loads(body)
    assert (problem["status"], problem["code"], problem["type"]) == (status, code, f"urn:vsrq:problem:{code}")
    assert problem["detail"].startswith("The request is malformed: ")


def test_a_good_request_on_the_same_server_still_reaches_flask(api):
    answered, headers, _ = raw_request(api, b"GET /nowhere HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert (answered, headers["content-type"]) == (404, "application/problem+json")


def test_a_request_refused_before_its_body_came_is_not_waited_for(api):
    """An upload refused on its declared size (413) whose client sends a few bytes and stalls: the connection is
    closed right after the answer instead of a request thread waiting for the rest (it waited 0.1 s, and 16 stalled
    uploads refused at once held every thread: a /healthz behind them took up to 230 ms, tests/reliability/
    test_hostile.py). The least of 3 tries, so that a busy machine's pause is not taken for the wait."""
    parts = urlsplit(api)
    head = (
        f"POST /v1/uploads HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEYS['alice']}\r\n"
        f"Content-Type: multipart/form-data; boundary=b0undary\r\nContent-Length: {UPLOAD_LIMIT * 2}\r\n\r\n--b0u"
    ).encode()
    waits = []
    for _ in range(3):
        with socket.create_connection((parts.hostname, parts.port), timeout=30) as conn:
            conn.sendall(head)
            received = b""
            while b'"code":' not in received:
                received += conn.recv(65536)
            answered = time.monotonic()
            while conn.recv(65536):  # the rest of the answer, then the server's close
                pass
            waits.append(time.monotonic() - answered)
        assert received.startswith(b"HTTP/1.1 413 ") and b"upload_too_large" in received, received
    assert min(waits) < 0.05, waits
