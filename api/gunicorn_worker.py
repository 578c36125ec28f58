"""The gunicorn worker the API runs under (`worker_class` in infra/gunicorn.conf.py): gunicorn's threaded worker, whose
own error answers are problem+json with a stable `code`, like every other error of the API, and whose reads from a
client are paced, so a slow or stalled client cannot hold a request thread for long.

Pacing: every read of a request (headers and body) waits at most `body_idle_timeout_s` for bytes, and once
`body_grace_s` has passed the request must have arrived at `body_min_bytes_per_s` on average; otherwise the read raises
`TimeoutError` (api/body.py answers 408 when that happens in the body). It must sit at the socket: gunicorn's body
reader loops on recv() until it has the size asked for, so a check between the application's reads would never run
while a client trickles a byte at a time. A connection that ends unread is closed after a short drain, its lingering
close (the rest of the body read and dropped, `linger_close`) off the event loop.

gunicorn answers some requests before Flask ever sees them (a control byte in a header, a malformed request line,
headers too large) with an HTML page. It has no hook for those pages: `Worker.handle_error` picks the status, logs
and writes the access log, then writes the page through `gunicorn.util.write_error`. That one function is replaced
in the worker process, so gunicorn keeps choosing the status and only the body changes. Each such answer carries a
request id, as the app's do (api/request_id.py): in its `X-Request-Id` header, in its problem body, and on the lines
gunicorn logs about it, its access line included (`handle_error` runs under it as the log context), so a user who
quotes it is found. Always a new one, never the client's: the request's headers are what could not be read.
gunicorn's HTTP/1 head gets a `Keep-Alive: timeout=N` the same way (`advertising_keepalive`).
"""

from __future__ import annotations

import errno
import selectors
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from gunicorn import util
from gunicorn.http import wsgi
from gunicorn.http.body import LengthReader
from gunicorn.workers.gthread import TConn, ThreadWorker

from api.errors import Problem
from api.request_id import HEADER as REQUEST_ID_HEADER
from api.request_id import new_id
from storage.config import Settings
from storage.logs import current_request

# How long the rest of a body that was answered unread (401, 413, 429, 408) is read for, to keep the connection alive:
# only what has arrived already. A request thread waiting for more (it was 0.1 s) was thread-pool exhaustion: 16
# stalled uploads refused at once held every thread and a /healthz behind them waited 100-230 ms. A connection whose
# rest has not arrived is closed (gracefully, off the request threads) and the client connects again.
_DRAIN_S = 0.002
_DRAIN_MAX_BYTES = 64 * 1024  # and at most this much of it, as gunicorn's own drain
# Such a connection is then closed as nginx's lingering close does: the rest of the request read and dropped while it
# keeps coming. Closed with bytes unread, the socket sends a reset, and a client still writing its body (Node's fetch,
# so the OpenAI Node SDK) reports the reset, never the answer: a refused upload over 64 KiB was "Connection error.".
_LINGER_S = 30.0  # at most this long in all (nginx's lingering_time)
_LINGER_IDLE_S = 2.0  # or until nothing comes for this long (gunicorn's own linger)


class ProblemWorker(ThreadWorker):
    def init_process(self) -> None:
        util.write_error = write_problem
        if self.cfg.keepalive:
            wsgi.Response.default_headers = advertising_keepalive(wsgi.Response.default_headers, self.cfg.keepalive)
        settings = Settings()
        self.pacing = (settings.body_idle_timeout_s, settings.body_grace_s, settings.body_min_bytes_per_s)
        super().init_process()  # runs the worker loop: never returns

    def handle_error(self, req: Any, client: socket.socket, addr: Any, exc: BaseException) -> None:
        """gunicorn's, under a new request id: its log lines, its access line and `write_problem`'s answer carry it."""
        token = current_request.set(new_id())
        try:
            super().handle_error(req, client, addr, exc)
        finally:
            current_request.reset(token)

    def accept(self, listener: socket.socket) -> None:
        """gthread's accept, with a paced connection that waits for its first bytes on the event loop, as a kept-alive
        one does, not in a request thread: there gthread waits up to 5 s, and 20 connections that send nothing held
        every thread (a /healthz behind them took 5 s). One silent for the idle timeout is closed."""
        try:
            client, address = listener.accept()
            self.nr_conns += 1
            client.setblocking(False)
            conn = PacedConn(self.cfg, client, address, listener.getsockname(), self.pacing, self.linger)
            conn.timeout = time.monotonic() + self.pacing[0]
            self.pending_conns.append(conn)
            self.poller.register(client, selectors.EVENT_READ, partial(self.on_pending_socket_readable, conn))
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise

    def linger(self, close: Callable[[], None]) -> None:
        """A lingering close (`linger_close`, seconds) off the event loop, its socket counted in `nr_conns` till
        it is closed: gthread frees the slot first, and connections answered then closed faster than they linger
        would open files past `worker_connections` (one accept() failing with EMFILE kills the worker). Called on the
        event loop (gthread's `finish_request`), as is the count's update when the close is done."""
        self.nr_conns += 1

        def run() -> None:
            try:
                close()
            finally:
                self.method_queue.defer(self._lingered)

        threading.Thread(target=run, daemon=True).start()

    def _lingered(self) -> None:
        self.nr_conns -= 1

    def _keepalive_after(self, conn: TConn, keepalive: bool) -> bool:
        # gthread drains an unread body for up to 5 s in a request thread: a stalled client would hold it that long
        return keepalive and conn.drain()


class PacedConn(TConn):
    def __init__(
        self,
        cfg: Any,
        sock: socket.socket,
        client: Any,
        server: Any,
        pacing: tuple[float, float, int],
        linger: Callable[[Callable[[], None]], None],
    ):
        super().__init__(cfg, sock, client, server)
        self.pacing, self.linger = pacing, linger

    def init(self) -> None:
        """Called by the request thread before each request on the connection: its pace is counted from here."""
        super().init()
        unreader = getattr(self.parser, "unreader", None)  # HTTP/1 (HTTP/2 reads through its own connection)
        if unreader is not None:
            if not isinstance(unreader.sock, PacedSocket):
                unreader.sock = PacedSocket(unreader.sock, *self.pacing)
            unreader.sock.restart()

    def drain(self) -> bool:
        """Whether the connection can serve another request: the unread rest of the request's body, only as much of
        it as arrives within the drain, is read and dropped. Bounded at the socket, not by gunicorn's `deadline`: that
        is checked before the first read, so a request thread paused for 2 ms (the OS or the GIL on a busy machine)
        refused even a GET's empty body and closed a connection its answer had just announced kept alive; a client's
        next request on it then failed (1 or 2 polls in 2,000 under load, tests/reliability/test_load.py)."""
        sock = self.parser.unreader.sock
        sock.drain_until(time.monotonic() + _DRAIN_S)
        try:
            return bool(self.parser.finish_body(max_bytes=_DRAIN_MAX_BYTES))
        finally:
            sock.drain_until(None)

    def close(self, graceful: bool = False) -> None:
        if graceful:  # gunicorn lingers up to 2 s for the client's FIN, on the worker's event loop: not there
            self.linger(partial(linger_close, self.sock))
        else:
            super().close()


def linger_close(sock: socket.socket, total_s: float = _LINGER_S, idle_s: float = _LINGER_IDLE_S) -> None:
    """RFC 9112 section 9.6: the write side shut (the answer ends there for the client), the rest of the request read
    and dropped until the client closes, sends nothing for `idle_s`, or `total_s` has passed; then closed."""
    try:
        sock.setblocking(True)
        sock.shutdown(socket.SHUT_WR)
        end = time.monotonic() + total_s
        while (left := end - time.monotonic()) > 0:
            sock.settimeout(min(idle_s, left))
            if not sock.recv(65536):
                break
    except OSError:  # a reset, a timeout: nothing more will come
        pass
    finally:
        sock.close()


class PacedSocket:
    """The client socket as gunicorn's request parser reads it: each recv() bounded by the idle timeout and the
    minimum average rate (see the module's docstring). Everything else goes to the socket itself."""

    def __init__(self, sock: socket.socket, idle_s: float, grace_s: float, min_bytes_per_s: int) -> None:
        self._sock, self._idle_s, self._grace_s, self._min_rate = sock, idle_s, grace_s, min_bytes_per_s
        self._bound: float | None = None  # a timeout gunicorn sets itself, through settimeout
        self._drain_end: float | None = None  # while a body is drained: when reads stop waiting for more
        self.restart()

    def restart(self) -> None:
        self._started, self._received = time.monotonic(), 0

    @property
    def raw(self) -> socket.socket:
        """The socket itself, for a look that must not be paced (api.prefer's: whether the client hung up)."""
        return self._sock

    def settimeout(self, timeout: float | None) -> None:
        self._bound = timeout

    def gettimeout(self) -> float | None:
        return self._bound

    def drain_until(self, end: float | None) -> None:
        self._drain_end = end

    def recv(self, size: int) -> bytes:
        elapsed = time.monotonic() - self._started
        wait = self._idle_s if self._bound is None else min(self._idle_s, self._bound)
        if self._drain_end is not None:
            wait = min(wait, self._drain_end - time.monotonic())
        if self._min_rate:  # no longer than until the average would fall below the minimum
            wait = min(wait, max(self._grace_s, (self._received + 1) / self._min_rate) - elapsed)
        # past that point, only what has arrived already (the application may have been busy, not the client)
        self._sock.settimeout(max(wait, 0.001))
        try:
            data = self._sock.recv(size)
        except TimeoutError:
            # ECONNRESET: gunicorn drops such a connection quietly when it happens in the headers (a traceback per
            # slow client otherwise); in the body, api/body.py answers 408
            reason = "the client sends too slowly" if wait < self._idle_s else "the client stopped sending"
            raise TimeoutError(errno.ECONNRESET, reason) from None
        finally:
            self._sock.settimeout(None)  # writes are not paced: a response may take a slow reader long
        self._received += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def advertising_keepalive(default_headers: Any, timeout_s: int) -> Any:
    """gunicorn's HTTP/1 status line and connection headers, plus `Keep-Alive: timeout=N` on an answer that keeps the
    connection: clients that read it (browsers, Node's undici) stop reusing an idle connection before the server closes
    it, instead of sending a request into that close. An application cannot set it: gunicorn drops hop-by-hop headers.
    An answer given before more of the body than the drain reads (a refused upload or part) says `Connection: close`:
    it said keep-alive, then closed, and a client's next request on it failed (`RemoteDisconnected`). HTTP/2 answers
    build their headers elsewhere."""

    def headers(response: wsgi.Response) -> list[str]:
        reader = getattr(getattr(response.req, "body", None), "reader", None)
        if isinstance(reader, LengthReader) and reader.length > _DRAIN_MAX_BYTES:
            response.force_close()  # the rest of its body is not drained (`PacedConn.drain`): say the close
        lines = default_headers(response)
        if not response.upgrade and not response.should_close():
            lines.append(f"Keep-Alive: timeout={timeout_s}\r\n")
        return lines

    return headers


def write_problem(sock: socket.socket, status: int, reason: str, message: str) -> None:
    """`gunicorn.util.write_error`'s signature: `reason` is the status's phrase, `message` gunicorn's detail (empty
    for its 500)."""
    code = "internal_error" if status >= 500 else reason.lower().replace(" ", "_")  # bad_request, uri_too_long...
    request_id = current_request.get() or new_id()  # set by ProblemWorker.handle_error, gunicorn's only caller
    body = Problem(
        type=f"urn:vsrq:problem:{code}",
        title=reason,
        status=status,
        code=code,
        detail=f"The request is malformed: {message}." if message and status < 500 else reason,
        instance="",  # the request line may be what could not be read
        request_id=request_id,
    ).model_dump_json(exclude={"errors"}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/problem+json\r\n"
        f"Content-Length: {len(body)}\r\n{REQUEST_ID_HEADER}: {request_id}\r\n\r\n"
    )
    util.write_nonblock(sock, head.encode("latin-1") + body)
