"""Requests gunicorn refuses before Flask sees them get problem+json with a stable code, from the real gunicorn the
API runs under (api/gunicorn_worker.py), sent over a raw socket since HTTP clients refuse to send such bytes."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import pytest


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
