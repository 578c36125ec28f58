"""A webhook receiver for tests: an HTTPS server on 127.0.0.1 that scripts its answers and keeps every request."""

from __future__ import annotations

import contextlib
import secrets
import ssl
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import trustme


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


class Receiver:
    """An HTTPS server on 127.0.0.1: answers each path with the statuses scripted for it, then 200; keeps every
    request. A scripted `HANG` answers nothing until `release()`: an attempt in flight; `TRICKLE` sends an answer
    that never ends."""

    HANG = 0
    TRICKLE = 1  # 200's status line at once, then a header line a second until `release()`: never a whole answer

    def __init__(self, cert: trustme.LeafCert) -> None:
        self.requests: list[Received] = []
        self._scripts: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._released: dict[str, threading.Event] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver._lock:
                    receiver.requests.append(Received(self.path, dict(self.headers), body, time.monotonic()))
                    script = receiver._scripts.get(self.path, [])
                    status = script.pop(0) if script else 200
                if status == Receiver.HANG:
                    receiver._released.setdefault(self.path, threading.Event()).wait(60)
                    return  # the connection closes without an answer
                if status == Receiver.TRICKLE:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                    released = receiver._released.setdefault(self.path, threading.Event())
                    with contextlib.suppress(OSError):  # the caller may cut the connection
                        while not released.wait(1):
                            self.wfile.write(b"X-Trickle: 1\r\n")
                            self.wfile.flush()
                    return
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", f"{self.path}/moved")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(context)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]

    def path(self, *statuses: int) -> str:
        """A new path that answers `statuses` first."""
        path = f"/hooks/{secrets.token_hex(4)}"
        self._scripts[path] = list(statuses)
        return path

    def release(self, path: str) -> None:
        """Ends the path's hung requests (closed without an answer); a later `HANG` of the path closes at once."""
        self._released.setdefault(path, threading.Event()).set()

    def url(self, path: str) -> str:
        return f"https://localhost:{self.port}{path}"  # a name: TLS checks it while the socket uses the address

    def received(self, path: str) -> list[Received]:
        with self._lock:
            return [request for request in self.requests if request.path.startswith(path)]

    def wait(self, path: str, count: int, limit_s: float = 30) -> list[Received]:
        deadline = time.monotonic() + limit_s
        while len(found := self.received(path)) < count:
            assert time.monotonic() < deadline, f"{path} got {len(found)} of {count} deliveries"
            time.sleep(0.05)
        return found
