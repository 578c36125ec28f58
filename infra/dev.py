"""The embedded local stack: Redis and SeaweedFS (infra.stack), then the Procfile's processes — the API under
gunicorn, one CPU worker, the reaper, the webhook worker — on loopback, each logging into one directory (appended
across restarts), kept running by infra.supervisor (restarted with backoff when one dies, Redis and SeaweedFS
too), stopped by PID; each also ends when this process does, however it ends (infra/children.py).

`vsrq dev` keeps it up until Ctrl-C; `vsrq demo` runs the main job through it, as a user would over HTTP.

The stack serves its worker's model under the name jobs then report (`lanczos`, or the checkpoint's name), and
serves anonymous requests as its one local owner (`VSRQ_AUTH=none`, loopback only): SGLang's request works without a
header, and the key it prints (for `vsrq bulk`, OpenAI's SDK) sees the same jobs. It writes its address and key to
a state file (client.devstate) that `vsrq status` and `vsrq bulk` read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

import requests

from client import devstate
from infra.children import ending_with_this_process
from infra.stack import Stack, free_ports, stop_processes
from infra.supervisor import Supervisor
from storage.config import served_name
from storage.signatures import new_secret

ROOT = Path(__file__).resolve().parents[1]
QUEUE = "vsrq.k6"


class StackUnavailable(Exception):
    """The stack cannot start for a reason its user acts on (another port, another directory), not ours."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class PortUnavailable(StackUnavailable):
    """The API's port cannot be had."""


def claim(directory: Path) -> TextIO:
    """Holds `directory` for this process until the handle closes or the process ends, however it ends (an flock):
    two `make demo` in one clone started a second Redis on the first one's files and broke SeaweedFS's."""
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / "in-use.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise StackUnavailable(
            "directory_in_use",
            f"{directory} is in use by another `vsrq dev` or `vsrq demo` (pid {holder}): stop it, or give this one "
            "another --dir",
        ) from None
    handle.truncate(0)
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _say(what: str) -> None:
    with contextlib.suppress(OSError):  # a stop goes on whatever became of its terminal
        print(f"vsrq dev: {what}", flush=True)


class DevStack:
    def __init__(self, root: str | Path, model: str, devices: str = "cpu", port: int | None = None) -> None:
        self.root = Path(root).resolve()
        # the worker runs from the repository root: a checkpoint directory named relative to here is made absolute
        self.model = str(Path(model).resolve()) if Path(model).is_dir() else model
        self.devices = devices
        self.url = f"http://127.0.0.1:{port or free_ports(1)[0]}"
        # its only API key, and the secret its webhooks are signed with: `start` reads them from its directory
        self.token = self.secret = ""
        self.served = served_name(self.model)  # what jobs ask for and report: what the worker runs
        self.stack = Stack(self.root / "stack")
        # Redis and SeaweedFS have their own, stopped after the Procfile's processes, whose shutdown still uses Redis
        self.services = Supervisor()
        self.supervisor = Supervisor()
        self._state_files: list[Path] = []
        self._claimed: TextIO | None = None

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            **self.stack.env(),
            "VSRQ_API_KEYS": json.dumps([{"id": "dev", "token": self.token, "webhook_secret": self.secret}]),
            "VSRQ_MODELS": json.dumps({self.served: QUEUE}),
            "VSRQ_AUTH": "none",  # loopback only (storage/config.py refuses it elsewhere): anonymous is the dev key
            "VSRQ_BIND": self.url.removeprefix("http://"),
            "VSRQ_WORKER_MODEL": self.model,
            "VSRQ_WORKER_DEVICES": self.devices,
            "VSRQ_WORKER_QUEUE": QUEUE,
            "VSRQ_LOG_FORMAT": os.environ.get("VSRQ_LOG_FORMAT", "text"),  # read by people here
            # a developer's webhook receiver and input server run on this machine too; the stack itself listens on
            # loopback only, so no one else can point it there (an explicit setting wins)
            "VSRQ_WEBHOOK_ALLOW_LOOPBACK": os.environ.get("VSRQ_WEBHOOK_ALLOW_LOOPBACK", "true"),
            "VSRQ_FETCH_ALLOW_LOOPBACK": os.environ.get("VSRQ_FETCH_ALLOW_LOOPBACK", "true"),
        }

    def start(self, timeout_s: float = 120) -> DevStack:
        made = not self.root.exists()
        self._claimed = claim(self.root)  # first: a second stack on this directory is told so, not about its port
        try:
            self._claim_port()
            self.token, self.secret = self._credentials()
        except BaseException:  # the directory is this process's no more
            if made:  # a start refused leaves nothing behind: its lock file, gone while still held, was all it wrote
                with contextlib.suppress(OSError):
                    (self.root / "in-use.lock").unlink()
                    self.root.rmdir()
            self.stop()
            raise
        try:
            self.stack.start()
            for name, process in self.stack.processes.items():  # same ports and data directory when restarted
                self.services.add(name, lambda name=name: self.stack.restart(name), process)
            python = [sys.executable, "-m"]
            # The workers' names are the same at every start (this stack's Redis is its own): a worker started under
            # its predecessor's name requeues the jobs that one held at once (worker/signals.py), not after the lease
            self._spawn("web", [*python, "gunicorn", "--config", "infra/gunicorn.conf.py", "api.app:create_app()"])
            self._spawn("worker", [*python, "celery", "-A", "worker.tasks", "worker", "--pool", "solo",
                                   "--concurrency", "1", "--without-gossip", "--without-mingle", "-Q", QUEUE,
                                   "-n", "dev@localhost", "--loglevel", "INFO"])  # fmt: skip
            self._spawn("reaper", [*python, "worker.reaper"])
            self._wait_for_worker(time.monotonic() + timeout_s)
            # after the wait, which counts workers: the one it waits for is the model's
            self._spawn("webhooks", [*python, "celery", "-A", "worker.webhooks", "worker", "--pool", "threads",
                                     "--concurrency", "4", "--without-gossip", "--without-mingle",
                                     "-Q", "vsrq.webhooks", "-n", "hooks@localhost"])  # fmt: skip
            self._state_files = devstate.write(self.root, self.state())
        except BaseException:
            self.stop()
            raise
        return self

    def _credentials(self) -> tuple[str, str]:
        """The API key and webhook secret of the stack in this directory, made at its first start: its jobs, outbox
        and Redis outlive a restart, and a webhook of a job sent before one must verify with the secret printed then."""
        path = self.root / "credentials.json"
        try:
            saved = json.loads(path.read_text())
            return str(saved["token"]), str(saved["webhook_secret"])
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError):  # emptied or edited by hand: new ones, said (the old are gone)
            print(f"vsrq dev: {path} is damaged: a new key and webhook secret are made", file=sys.stderr, flush=True)
        token, secret = f"sk-dev-{secrets.token_hex(16)}", new_secret()
        partial = path.with_suffix(".partial")  # whole or absent: a start killed while writing it leaves no half
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as file:  # its owner's
            json.dump({"token": token, "webhook_secret": secret}, file)
        os.replace(partial, path)
        return token, secret

    def _claim_port(self) -> None:
        """That the API's port is free, before anything starts: gunicorn would say so too, after Redis, SeaweedFS and
        its own retries."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no owner
            try:
                probe.bind((host, int(port)))
            except OSError as error:
                other = "choose another with --port N or VSRQ_DEV_PORT=N"
                if error.errno == errno.EADDRINUSE:
                    raise PortUnavailable("port_in_use", f"port {port} on {host} is in use (another `vsrq dev`, or "
                                          f"another server): {other}") from None  # fmt: skip
                if error.errno == errno.EACCES:
                    raise PortUnavailable("port_not_permitted", f"port {port} on {host} needs privileges to bind: "
                                          f"{other} (above 1023)") from None  # fmt: skip
                raise PortUnavailable("port_unavailable", f"port {port} on {host}: {error.strerror}; {other}") from None

    def _spawn(self, name: str, command: list[str]) -> None:
        self.supervisor.add(name, lambda: self._popen(name, command))

    def _popen(self, name: str, command: list[str]) -> subprocess.Popen:
        # If this process dies without stop(): gunicorn's master stops its workers on SIGTERM; the Celery workers and
        # the reaper keep nothing that is not in Redis (a job in hand is requeued when its lease runs out), and a
        # warm shutdown would wait for that job, so they are killed.
        death = signal.SIGTERM if name == "web" else signal.SIGKILL
        with open(self.root / f"{name}.log", "ab") as log:  # appended: a restart keeps what came before
            return subprocess.Popen(
                command, cwd=ROOT, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                # restarts fork from the supervisor's thread, which lives as long as the stack
                preexec_fn=ending_with_this_process(death),
            )  # fmt: skip

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        return self.supervisor.processes

    def _wait_for_worker(self, deadline: float) -> None:
        """Until /healthz answers and counts a worker (which loads its model first)."""
        while True:
            for supervisor, logs in ((self.supervisor, self.root), (self.services, self.stack.root)):
                if supervisor.gave_up:
                    raise RuntimeError(f"{supervisor.gave_up[0]} keeps exiting; see {logs / supervisor.gave_up[0]}.log")
            try:
                if requests.get(f"{self.url}/healthz", timeout=5).json()["checks"]["workers"]["queues"][QUEUE]:
                    return
            except (requests.ConnectionError, requests.Timeout, ValueError, KeyError):  # not up yet, or a busy machine
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack did not come up in time; logs in {self.root}")
            time.sleep(0.5)

    def state(self) -> dict:
        """What the client side needs to reach this stack (client.devstate): the API, its key, the secret its webhooks
        are signed with, the Redis and storage `vsrq status` reads."""
        exports = {
            "VSRQ_API_URL": self.url,
            "VSRQ_TOKEN": self.token,
            "OPENAI_BASE_URL": f"{self.url}/v1",
            "OPENAI_API_KEY": self.token,
            "OPENAI_WEBHOOK_SECRET": self.secret,  # what OpenAI(webhook_secret=...) takes when not given one
            **{name: value for name, value in self.stack.env().items() if name.startswith("VSRQ_")},
            "VSRQ_MODELS": json.dumps({self.served: QUEUE}),
        }
        return {"pid": os.getpid(), "url": self.url, "token": self.token, "model": self.served, "dir": str(self.root),
                "env": exports}  # fmt: skip

    def stop(self, timeout_s: float = 30) -> None:
        devstate.remove(self._state_files, os.getpid())
        killed = stop_processes(self.supervisor.stop(), timeout_s,
                                lambda said: _say(f"{said} (a worker ends its job)" if "worker" in said else said))
        if killed:
            resumes = " (its job resumes at the next start)" if "worker" in killed else ""
            _say(f"{', '.join(killed)} did not stop within {timeout_s:g} s: killed{resumes}")
        self.supervisor.close()  # after the stop: its thread's end is what restarted children die with
        self.services.stop()
        self.stack.stop()  # the services' current processes, restarted ones included
        self.services.close()
        if self._claimed is not None:
            self._claimed.close()
            self._claimed = None

    def __enter__(self) -> DevStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
