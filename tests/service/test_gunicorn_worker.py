"""Requests gunicorn refuses before Flask sees them get problem+json with a stable code and a request id, from the real
gunicorn the API runs under (api/gunicorn_worker.py), sent over a raw socket since HTTP clients refuse to send such
bytes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import requests
from gunicorn.config import Config

from api.gunicorn_worker import PacedConn
from infra.stack import free_ports

from .conftest import KEYS, ROOT, UPLOAD_LIMIT, auth, log_lines


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
        (  # a header line longer than gunicorn's limit
            b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Note: " + b"a" * 9000 + b"\r\n\r\n",
            431,
            "request_header_fields_too_large",
        ),
    ],
)
def test_gunicorns_own_errors_are_problems(api, api_log, request_bytes, status, code):
    answered, headers, body = raw_request(api, request_bytes)
    assert (answered, headers["content-type"]) == (status, "application/problem+json"), body
    assert int(headers["content-length"]) == len(body)
    problem = json.loads(body)
    assert (problem["status"], problem["code"], problem["type"]) == (status, code, f"urn:vsrq:problem:{code}")
    assert problem["detail"].startswith("The request is malformed: ")
    # a request id to quote, as the app's answers have: in the header, the body and gunicorn's line about it
    request_id = headers["x-request-id"]
    assert request_id.startswith("req_") and problem["request_id"] == request_id
    logged = log_lines(api_log, request_id)
    assert any(line["message"].startswith("Invalid request from ip=") for line in logged), logged


def test_a_good_request_on_the_same_server_still_reaches_flask(api):
    answered, headers, _ = raw_request(api, b"GET /nowhere HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert (answered, headers["content-type"]) == (404, "application/problem+json")
    assert "keep-alive" not in headers  # the connection closes: no timeout to announce


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


def test_a_client_still_sending_a_refused_upload_reads_the_answer(api):
    """A 401 given before the body was read, to a client that sends its whole body before it reads (Node's fetch, so
    the OpenAI Node SDK, does): the rest is read and dropped, so the client reads the answer instead of a reset. It got
    EPIPE past 64 KiB, and the Node SDK said "Connection error." and sent the file again."""
    parts = urlsplit(api)
    size = 32 * 1024 * 1024  # past what the kernel's buffers hold
    head = (
        f"POST /v1/uploads HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer sk-not-a-key\r\n"
        f"Content-Type: multipart/form-data; boundary=b0undary\r\nContent-Length: {size}\r\n\r\n"
    ).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as conn:
        conn.sendall(head)
        chunk = b"\0" * 65536
        for _ in range(size // len(chunk)):
            conn.sendall(chunk)  # BrokenPipeError or ConnectionResetError once the server has closed with it unread
        received = b""
        while data := conn.recv(65536):
            received += data
    assert received.startswith(b"HTTP/1.1 401 ") and b'"code":"unauthorized"' in received, received[:300]


def test_an_answer_given_before_the_body_was_read_says_whether_the_connection_stays(api):
    """A part refused before its body is read (its upload unknown): past what the drain reads, the answer says the
    connection closes, so the client's next request on its pool opens another; it said keep-alive and closed, and the
    next request failed with `RemoteDisconnected` 3 times in 4. A small body is drained: the connection stays."""
    with requests.Session() as session:
        for size, kept in ((1024 * 1024, False), (1024, True)):
            files = {"data": ("blob", b"\0" * size, "application/octet-stream")}
            refused = session.post(f"{api}/v1/uploads/upload_{'0' * 24}/parts", files=files,
                                   headers=auth("alice"), timeout=30)  # fmt: skip
            assert refused.status_code == 404, refused.text
            assert (refused.headers["Connection"] == "keep-alive") is kept, refused.headers
            for _ in range(3):  # on the same pool: a connection the server closed unsaid fails the next request
                assert session.get(f"{api}/v1/models", headers=auth("alice"), timeout=10).status_code == 200


GUNICORN = [sys.executable, "-m", "gunicorn", "--config", "infra/gunicorn.conf.py", "api.app:create_app()"]


def test_a_second_api_on_a_served_address_is_refused(service_env, api):
    """With a socket of its own per worker (SO_REUSEPORT), a second API started on the address another serves (a
    second deployment with the same VSRQ_BIND) started unsaid, the kernel splitting connections between the two: it
    fails to bind now, and the first keeps every connection."""
    env = {**os.environ, **service_env, "VSRQ_BIND": api.removeprefix("http://"), "VSRQ_WEB_WORKERS": "1"}
    second = subprocess.run(GUNICORN, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and "Connection in use" in second.stderr, second.stderr
    assert requests.get(f"{api}/healthz", timeout=10).status_code in (200, 503)


def test_reloads_and_an_upgrade_under_load_drop_no_request(service_env, tmp_path):
    """gunicorn's own ways to change code without a stop, under requests on new connections: three HUPs (new workers,
    the old ones finishing), then USR2 (a new master beside the old one) and TERM to the old one. With a socket per
    worker, a HUP reset the connections queued on a stopping worker's (5 in 25 HUPs), and the USR2 master failed to
    start (it had no socket to take over), so the TERM left no API at all. And no control socket: its one path per
    user was taken by every API on the machine in turn, and deleted by the first to exit."""
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}/healthz"
    runtime = tmp_path / "runtime"  # where gunicorn's control socket would go: one path per user, which every API on
    runtime.mkdir()  # the machine took in turn, and the first to exit deleted
    env = {**os.environ, **service_env, "VSRQ_BIND": f"127.0.0.1:{port}", "VSRQ_WEB_WORKERS": "2",
           "HOME": str(runtime), "XDG_RUNTIME_DIR": str(runtime)}  # fmt: skip
    # as the Procfile starts it: re-executed, `python -m gunicorn` runs gunicorn/__main__.py as a script, its
    # directory first on the path, and gunicorn's `http` package hides the standard library's
    command = [str(Path(sys.executable).with_name("gunicorn")), *GUNICORN[3:]]
    with open(tmp_path / "api.log", "wb") as log:
        master = psutil.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    failures: list[str] = []
    answered = 0
    stop = threading.Event()

    def load() -> None:
        nonlocal answered
        while not stop.is_set():
            try:  # a new connection each time: what a stopping worker's queue would hold
                status = requests.get(url, timeout=30, headers={"Connection": "close"}).status_code
                answered += status in (200, 503)
            except requests.RequestException as error:
                failures.append(repr(error))

    threads = [threading.Thread(target=load) for _ in range(3)]
    new_master = None
    try:
        _wait_serving(url, master)
        assert list(runtime.rglob("*.ctl")) == []  # no control socket
        for thread in threads:
            thread.start()
        for _ in range(3):
            master.send_signal(signal.SIGHUP)
            time.sleep(1.5)
        master.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 60
        while (new_master := _upgraded(master)) is None:
            assert time.monotonic() < deadline and master.is_running(), (tmp_path / "api.log").read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2)  # its workers booted
        master.terminate()
        master.wait(60)
        time.sleep(2)
        assert new_master.is_running(), (tmp_path / "api.log").read_text()[-3000:]
    finally:
        stop.set()
        for thread in threads:
            if thread.ident is not None:  # started: a failure before the load leaves none to join
                thread.join(30)
        for process in [master, *master.children(recursive=True)] if master.is_running() else []:
            process.kill()
        if new_master is not None:
            new_master.terminate()
            new_master.wait(60)
    assert failures == [] and answered > 100, (failures[:5], answered)


def _upgraded(master: psutil.Process) -> psutil.Process | None:
    """The master USR2 started, once it runs workers: the one child of the old master with children of its own."""
    for child in master.children():
        try:
            if child.children():
                return child
        except psutil.Error:  # a worker gone since
            continue
    return None


def _wait_serving(url: str, server: psutil.Popen) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert server.poll() is None and time.monotonic() < deadline, "gunicorn exited or did not answer"
        try:
            requests.get(url, timeout=5)
            return
        except requests.RequestException:
            time.sleep(0.2)


@contextmanager
def paused_calls() -> Iterator[None]:
    """Every Python call in this thread waits 3 ms first: a request thread on a busy machine, which the OS or the GIL
    pauses at any point for longer than a 2 ms drain (a real pause, not a fake clock)."""

    def pause(frame, event, arg):
        if event == "call":
            time.sleep(0.003)

    sys.setprofile(pause)
    try:
        yield
    finally:
        sys.setprofile(None)


def kept_alive_conn(sent: bytes) -> tuple[PacedConn, socket.socket]:
    """The API worker's connection as a request thread holds it, over loopback TCP, after the client sent `sent`
    and its first request was read; and the client's socket."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        accepted, address = listener.accept()
        conn = PacedConn(Config(), accepted, address, listener.getsockname(), (30, 30, 8 * 1024), lambda close: close())
    client.sendall(sent)
    conn.init()
    assert next(conn.parser).method in ("GET", "POST")
    return conn, client


@pytest.mark.parametrize(
    "first",
    [
        b"GET /v1/videos/vid_1 HTTP/1.1\r\nHost: localhost\r\n\r\n",  # a poll: no body
        b"POST /v1/videos/vid_1/cancel HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n\r\nhello",  # left unread
    ],
    ids=["get", "unread-body"],
)
def test_a_connection_answered_kept_alive_stays_open_when_its_thread_is_paused(first):
    """A poll answered with keep-alive must not be closed after its answer: the client sends its next request on the
    connection at once and would meet the close (1 or 2 polls in 2,000 got a ConnectionError under load,
    tests/reliability/test_load.py). The drain's time was counted before the thread's pause, and an empty body was
    refused once it had passed. The next request on the connection is read whole."""
    conn, client = kept_alive_conn(first + b"GET /v1/videos/vid_2 HTTP/1.1\r\nHost: localhost\r\n\r\n")
    with client:
        with paused_calls():
            kept = conn.drain()
        assert kept
        assert next(conn.parser).path == "/v1/videos/vid_2"
        conn.close()


def test_a_stalled_body_still_closes_its_connection_at_once():
    """The other side of the drain: a body whose rest does not come is not waited for, the connection closes."""
    conn, client = kept_alive_conn(b"POST /v1/uploads HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n\r\n--b0u")
    with client:
        started = time.monotonic()
        with paused_calls():
            kept = conn.drain()
        assert not kept and time.monotonic() - started < 0.5
        conn.close()


def test_a_connection_idle_past_gunicorns_keepalive_still_answers(api):
    """A client that polls every 2-3 s reuses its connection: with gunicorn's 2 s keep-alive the server closed it as
    the next poll went out (a plain requests loop with `sleep(2)`: 8 ConnectionErrors in 240 polls). It stays open
    (VSRQ_WEB_KEEPALIVE_S, 75 s), and the poll after the pause is answered on it. 3.2 s: past gunicorn's close
    (2 s, checked once a second). Each answer says how long, for clients that stop reusing a connection in time."""
    parts = urlsplit(api)
    poll = b"GET /nowhere HTTP/1.1\r\nHost: localhost\r\n\r\n"
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as conn:
        for pause in (0, 3.2):
            time.sleep(pause)
            conn.sendall(poll)
            received = b""
            while not received.endswith(b"}"):  # the problem+json body ends the answer
                chunk = conn.recv(65536)
                assert chunk, f"the server closed the connection after {pause} s idle"
                received += chunk
            assert received.startswith(b"HTTP/1.1 404 ") and b"connection: close" not in received.lower()
            assert b"\r\nKeep-Alive: timeout=75\r\n" in received
