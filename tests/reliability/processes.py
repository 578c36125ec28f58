"""The service's processes as a fault test drives them: each started on loopback against one stack, logging to its own
file, and stopped, killed (SIGKILL), paused (SIGSTOP) or resumed at the test's will. Around them: a supervisor that
starts a new worker when one dies (as systemd or Kubernetes would), and a memory limit enforced the way a cgroup's
OOM killer enforces it (SIGKILL past the limit), without touching the host's cgroups.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import requests

from tests.service.conftest import WORKER_THREADS

ROOT = Path(__file__).resolve().parents[2]


class Process:
    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.command, self.env, self.log = name, command, {**os.environ, **env}, log
        self._process: subprocess.Popen | None = None

    def start(self) -> Process:
        with open(self.log, "ab") as out:
            self._process = subprocess.Popen(
                self.command, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def exit_status(self) -> int | None:
        """None while it runs."""
        return None if self._process is None else self._process.poll()

    def kill(self) -> None:
        """SIGKILL to the process and its children (its session): no handler runs, nothing is acknowledged or cleaned
        up, as when a host or the OOM killer takes it."""
        if self.alive:
            os.killpg(self.pid, signal.SIGKILL)
        self._process.wait()

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def stop(self, timeout_s: float = 30) -> None:
        stop_all([self], timeout_s)

    def _terminate(self) -> None:
        if self.alive:
            os.kill(self.pid, signal.SIGCONT)  # a paused process cannot handle SIGTERM
            self._process.terminate()

    def _reap(self, deadline: float) -> None:
        if self._process is None:
            return
        try:
            self._process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, ready: Callable[[], bool], what: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not self.alive:
                raise RuntimeError(f"{self.name} exited before {what}:\n{self.text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no {what} after {timeout_s} s:\n{self.text()[-4000:]}")
            time.sleep(0.1)


def stop_all(processes: list[Process], timeout_s: float = 30) -> None:
    """SIGTERM to every process at once, then waits for each (SIGKILL past `timeout_s`): a worker's warm shutdown takes
    seconds, and one after another they added up."""
    for process in processes:
        process._terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process._reap(deadline)


def worker(env: dict[str, str], queue: str, logs: Path, model: str = "lanczos") -> Process:
    """A solo Celery worker, as the Procfile runs one; `started()` waits until it consumes."""
    settings = {**env, **WORKER_THREADS, "VSRQ_WORKER_MODEL": model, "VSRQ_WORKER_DEVICES": "cpu"}
    return _celery("faults", "worker.tasks", "solo", 1, queue, settings, logs)


def webhooks(env: dict[str, str], queue: str, logs: Path) -> Process:
    """The Procfile's webhook worker (threads), on `queue`."""
    return _celery("hooks", "worker.webhooks", "threads", 2, queue, env, logs)


def _celery(kind: str, app: str, pool: str, concurrency: int, queue: str, env: dict[str, str], logs: Path) -> Process:
    name = f"{kind}-{secrets.token_hex(3)}"
    command = [
        sys.executable, "-m", "celery", "-A", app, "worker", "--pool", pool, "--concurrency", str(concurrency),
        "-Q", queue, "-n", f"{name}@localhost", "--without-gossip", "--without-mingle", "--without-heartbeat",
        "--loglevel", "info",
    ]  # fmt: skip
    return Process(name, command, env, logs / f"{name}.log")


def started(process: Process, timeout_s: float = 180) -> Process:
    """Waits until a worker started with `worker()` says it is ready for messages."""
    process.wait_for(lambda: " ready." in process.text(), "ready worker", timeout_s)
    return process


def reaper(env: dict[str, str], logs: Path) -> Process:
    return Process("reaper", [sys.executable, "-m", "worker.reaper"], env, logs / "reaper.log")


def api(env: dict[str, str], port: int, logs: Path) -> Process:
    """The API under gunicorn, as the Procfile runs it; `serving()` waits until /healthz answers."""
    command = [sys.executable, "-m", "gunicorn", "--config", "infra/gunicorn.conf.py", "api.app:create_app()"]
    return Process("api", command, {**env, "VSRQ_BIND": f"127.0.0.1:{port}"}, logs / f"api-{port}.log")


def serving(process: Process, url: str, timeout_s: float = 120) -> Process:
    def answers() -> bool:
        try:
            return requests.get(f"{url}/healthz", timeout=10).status_code in (200, 503)
        except requests.RequestException:  # not listening yet, or still booting
            return False

    process.wait_for(answers, "answer on /healthz", timeout_s)
    return process


class Supervisor:
    """Keeps one worker running: a new one is started whenever the current one has died (what a process manager
    does). `history` holds every worker it started, oldest first."""

    def __init__(self, make: Callable[[], Process], on_start: Callable[[Process], None] = lambda _: None) -> None:
        self._make, self._on_start = make, on_start
        self.history: list[Process] = []
        self._start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    @property
    def current(self) -> Process:
        return self.history[-1]

    def _start(self) -> None:
        self.history.append(self._make().start())
        self._on_start(self.current)

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            if not self.current.alive:
                self._start()

    def stop_watching(self) -> None:
        """No more new workers; the one running goes on."""
        self._stop.set()
        self._thread.join()

    def stop(self) -> None:
        self.stop_watching()
        stop_all(self.history)


class MemoryLimit:
    """SIGKILLs a watched process once its resident memory passes `limit_bytes`: a container memory limit, enforced
    as the kernel's OOM killer would (which lets no handler run)."""

    def __init__(self, limit_bytes: int | None = None, every_s: float = 0.02) -> None:
        self.limit_bytes, self.every_s = limit_bytes, every_s  # None: not enforced yet
        self.kills: list[int] = []  # pids
        self._watched: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def watch(self, process: Process) -> None:
        self._watched.append(process.pid)

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            for pid in list(self._watched):
                try:
                    if self.limit_bytes is not None and psutil.Process(pid).memory_info().rss > self.limit_bytes:
                        os.kill(pid, signal.SIGKILL)
                        self.kills.append(pid)
                        self._watched.remove(pid)
                except (psutil.NoSuchProcess, ProcessLookupError):
                    self._watched.remove(pid)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Partition:
    """A TCP forwarder on loopback in front of `target`: after `cut()`, bytes either way are dropped (requests go
    unanswered, connections stay open), as a network partition drops packets; after `cut_replies_after(marker)`,
    what `target` sends back is dropped from the first request that holds `marker` on: that request takes effect,
    and its sender never learns it; after `swallow_head(marker)`, the bytes of the next request that hold `marker`
    (its head) are dropped and the rest flows: a cut that healed mid-request, its body reaching `target` alone; after
    `hang(marker)`, the connection of the next request that holds `marker` is cut for good, the others flow: a call
    that gets no answer before its timeout, however long; after `hold(marker)`, every request that holds `marker`
    waits, its connection stalled, until `release(marker)`: a slow call, held exactly as long as a test needs; after
    `refuse(marker)`, every request that holds `marker` has its connection closed as it arrives, unanswered: a storage
    server that went down under that call, at once."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._requests, self._replies = threading.Event(), threading.Event()  # set: flowing
        self._marker: bytes | None = None
        self._head: bytes | None = None
        self.swallowed = 0  # heads dropped by `swallow_head`
        self._hang: bytes | None = None
        self.hung = 0  # connections cut by `hang`
        self._holds: dict[bytes, threading.Event] = {}  # marker: set once released
        self.held = 0  # requests held by `hold`
        self._refuse: bytes | None = None
        self.refused = 0  # requests whose connection `refuse` closed
        self.heal()
        self.dropped = 0  # bytes, either way, while cut
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self._requests.clear()
        self._replies.clear()

    def cut_replies_after(self, marker: bytes) -> None:
        self._marker = marker

    def swallow_head(self, marker: bytes) -> None:
        self._head = marker

    def hang(self, marker: bytes) -> None:
        self._hang = marker

    def hold(self, marker: bytes) -> None:
        self._holds[marker] = threading.Event()

    def release(self, marker: bytes) -> None:
        self._holds.pop(marker).set()

    def refuse(self, marker: bytes) -> None:
        self._refuse = marker

    def heal(self) -> None:
        """Bytes flow again; what was dropped stays lost (a request sent during the cut waits for its timeout)."""
        self._marker = self._refuse = None
        self._requests.set()
        self._replies.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self.target)
            ended: list[socket.socket] = []  # the connection's directions that have ended: the second closes it
            hung = threading.Event()  # set: this connection is cut for good (`hang`)
            for source, sink, flowing in ((client, upstream, self._requests), (upstream, client, self._replies)):
                threading.Thread(target=self._pump, args=(source, sink, flowing, ended, hung), daemon=True).start()

    def _pump(
        self,
        source: socket.socket,
        sink: socket.socket,
        flowing: threading.Event,
        ended: list[socket.socket],
        hung: threading.Event,
    ) -> None:
        try:
            while data := source.recv(65536):
                if flowing is self._requests and self._hang and self._hang in data:
                    self._hang, self.hung = None, self.hung + 1
                    hung.set()
                if hung.is_set():
                    self.dropped += len(data)
                    continue
                if flowing is self._requests and self._refuse and self._refuse in data:
                    for end in (source, sink):
                        with contextlib.suppress(OSError):
                            end.shutdown(socket.SHUT_RDWR)
                    self.refused += 1  # counted once its caller can see it
                    return
                if flowing is self._requests:
                    for marker, released in list(self._holds.items()):
                        if marker in data:
                            self.held += 1
                            released.wait(300)  # the rest of this connection waits behind it
                if flowing is self._requests and self._marker and self._marker in data:
                    self._replies.clear()
                if flowing is self._requests and self._head and self._head in data:
                    self._head, self.swallowed = None, self.swallowed + 1
                    continue
                if flowing.is_set():
                    sink.sendall(data)
                else:
                    self.dropped += len(data)
            if flowing.is_set() and not hung.is_set():  # the end of the stream goes through (a FIN), as on a real path: a reply read to
                sink.shutdown(socket.SHUT_WR)  # the server's close (no Content-Length) ends; closing `sink` would
                # not send it while the other direction's thread waits in `recv` on it
        except OSError:  # reset: both directions end
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
        finally:
            ended.append(source)
            if len(ended) == 2:
                for end in (source, sink):
                    end.close()

    def close(self) -> None:
        for released in self._holds.values():
            released.set()
        self._server.close()


class TlsFront:
    """A TLS endpoint on loopback in front of a plain TCP server at `target`, as a managed Redis's TLS port (or
    stunnel) is: clients speak real TLS to `port`, with the certificate `cert` (trustme) gives; the bytes inside go to
    `target` as they are. An event loop of its own, on a thread."""

    def __init__(self, target: tuple[str, int], cert: Any) -> None:
        self.target, self.connections = target, 0
        self._writers: set[asyncio.StreamWriter] = set()
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(context)
        self._loop = asyncio.new_event_loop()
        ready: concurrent.futures.Future[int] = concurrent.futures.Future()
        threading.Thread(target=self._run, args=(context, ready), daemon=True).start()
        self.port = ready.result(10)

    def _run(self, context: ssl.SSLContext, ready: concurrent.futures.Future[int]) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=context))
        ready.set_result(server.sockets[0].getsockname()[1])
        self._loop.run_forever()
        server.close()  # stopped by `close`: its port and its connections go with it
        for writer in self._writers:
            writer.close()

    async def _serve(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        self.connections += 1
        upstream_in, upstream_out = await asyncio.open_connection(*self.target)
        self._writers |= {client_out, upstream_out}

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pump(client_in, upstream_out), pump(upstream_in, client_out), return_exceptions=True)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
