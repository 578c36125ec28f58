"""infra/nginx.conf, the proxy compose.yaml puts in front of the API, run with Debian's nginx in front of the API
under test: its own refusals (a body over its limit, a client over its connections, the API not answering) come in
the API's shape, problem+json with a stable `code` and OpenAI's `error`, where they were nginx's HTML pages."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from api.errors import Problem
from infra.stack import free_ports

from .conftest import ROOT, auth

CONF = ROOT / "infra" / "nginx.conf"


@pytest.fixture(scope="module")
def nginx(tmp_path_factory) -> str:
    """The machine's nginx, else Debian's package unpacked (`apt-get download`, as `make corpus` fetches media)."""
    if found := shutil.which("nginx"):
        return found
    cache = Path.home() / ".cache" / "vsrq" / "nginx"
    binary = cache / "usr" / "sbin" / "nginx"
    if not binary.exists():
        work = tmp_path_factory.mktemp("nginx-deb")
        subprocess.run(["apt-get", "download", "nginx"], cwd=work, check=True, capture_output=True)
        (deb,) = work.glob("nginx_*.deb")
        subprocess.run(["dpkg-deb", "-x", str(deb), str(cache)], check=True)
    return str(binary)


def render(upstream: str, port: int, prefix: Path, limits: dict[str, str]) -> Path:
    """The shipped configuration with the test's addresses, and its files under `prefix` (Debian's build writes
    under /var): nothing else changed, but `limits` (directive -> value) where a test needs a small one."""
    text = CONF.read_text()
    for old, new in (("server api:8000;", f"server {upstream};"), ("listen 8080;", f"listen 127.0.0.1:{port};")):
        assert old in text
        text = text.replace(old, new)
    for directive, value in limits.items():
        text, count = re.subn(rf"\b{directive} [^;]+;", f"{directive} {value};", text)
        assert count == 1, directive
    temporary = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    paths = "".join(f"    {name}_temp_path {prefix / name};\n" for name in temporary)
    text = text.replace("http {\n", f"http {{\n    access_log off;\n{paths}", 1)
    path = prefix / "nginx.conf"
    path.write_text(text)
    return path


def serve(nginx: str, conf: Path, port: int) -> subprocess.Popen:
    prefix = conf.parent
    process = subprocess.Popen(
        [nginx, "-p", str(prefix), "-c", str(conf), "-g", f"daemon off; pid {prefix / 'nginx.pid'}; "
         f"error_log {prefix / 'error.log'};"],  # fmt: skip
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            assert process.poll() is None, (prefix / "error.log").read_text()
            assert time.monotonic() < deadline, "nginx did not listen"
            time.sleep(0.05)


@pytest.fixture
def proxy(nginx, api, tmp_path) -> Iterator[callable]:
    """Starts nginx with the shipped configuration in front of `upstream` (the API under test unless named)."""
    started: list[subprocess.Popen] = []

    def start(upstream: str = api.removeprefix("http://"), **limits: str) -> str:
        port = free_ports(1)[0]
        prefix = tmp_path / f"nginx-{port}"
        prefix.mkdir()
        started.append(serve(nginx, render(upstream, port, prefix, limits), port))
        return f"http://127.0.0.1:{port}"

    yield start
    for process in started:
        process.terminate()
        process.wait(10)


def assert_problem(response: requests.Response, status: int, code: str) -> Problem:
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"] == "application/problem+json", response.headers
    problem = Problem.model_validate_json(response.content)
    assert (problem.status, problem.code, problem.error.code) == (status, code, code), problem
    return problem


def test_the_api_answers_through_the_proxy(proxy):
    base = proxy()
    response = requests.get(f"{base}/v1/models", headers=auth("alice"), timeout=10)
    assert response.status_code == 200 and response.json()["object"] == "list"
    missing = requests.get(f"{base}/v1/videos/video_000000000000000000000000", headers=auth("alice"), timeout=10)
    assert missing.json()["code"] == "job_not_found"  # the API's own errors pass through


def test_a_body_over_the_proxys_limit_is_the_apis_413(proxy, clip):
    base = proxy(client_max_body_size="1k")
    files = {"video_reference": ("clip.mp4", clip, "video/mp4")}
    response = requests.post(f"{base}/v1/videos%22x", files=files, headers=auth("alice"), timeout=30)
    problem = assert_problem(response, 413, "upload_too_large")
    assert problem.instance == "/v1/videos%22x"  # as sent: a quote in the path does not break the JSON


def test_a_raw_quote_in_the_path_does_not_break_the_problems_json(proxy):
    """nginx takes a `"` unescaped in a request line; copied into the body whole, it made the JSON unreadable."""
    base = proxy(upstream=f"127.0.0.1:{free_ports(1)[0]}")  # nothing listens there: nginx answers itself
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(b'GET /v1/a"b\\c?x="1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n')
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"application/problem+json" in head, head
    problem = Problem.model_validate_json(body)
    assert (problem.code, problem.instance) == ("service_unavailable", "/v1/a")


def test_the_api_not_answering_is_a_503_with_retry_after(proxy):
    closed = free_ports(1)[0]  # nothing listens there
    response = requests.get(f"{proxy(upstream=f'127.0.0.1:{closed}')}/v1/models", headers=auth("alice"), timeout=30)
    assert_problem(response, 503, "service_unavailable")
    assert response.headers["Retry-After"] == "5"


def test_a_client_over_its_connections_is_a_429(proxy):
    base = proxy(limit_conn="per_client 1")
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as held:  # a body that never comes: held open
        held.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        deadline = time.monotonic() + 15
        # until nginx has read the held request's headers (it counts a connection from then on)
        while (response := requests.get(f"{base}/v1/models", headers=auth("alice"), timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "the held connection was never counted"
            time.sleep(0.1)
    assert_problem(response, 429, "too_many_connections")
    assert response.headers["Retry-After"] == "1"
