"""Keeps the embedded stack's processes running (`vsrq dev`: the Procfile's, Redis, SeaweedFS): one that exits is
started again after a backoff (0.5 s, doubling to 8 s; back to 0.5 s once it has run for a minute), and after
`max_restarts` within `window_s` it is given up, loudly: a line on stderr (each restart has one too), and `gave_up`
names it.

Our own, in a page: supervisord and circus are daemons with their own configuration and control sockets, and honcho
restarts nothing; here the processes are the dev stack's children, started by its own spawn function.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
STEADY_S = 60.0  # a process that ran this long starts its backoff over


@dataclass
class Supervised:
    name: str
    start: Callable[[], subprocess.Popen]
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    failures: int = 0  # consecutive: what the backoff steps by
    restarts: list[float] = field(default_factory=list)  # when, for the give-up window
    due_at: float | None = None  # a restart scheduled for then


class Supervisor:
    def __init__(
        self,
        max_restarts: int = 5,
        window_s: float = 60.0,
        every_s: float = 0.2,
        backoff_s: tuple[float, ...] = BACKOFF_S,
    ) -> None:
        self.max_restarts, self.window_s, self.every_s, self.backoff_s = max_restarts, window_s, every_s, backoff_s
        self.gave_up: list[str] = []
        self._children: dict[str, Supervised] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._thread.start()

    def add(
        self, name: str, start: Callable[[], subprocess.Popen], process: subprocess.Popen | None = None
    ) -> subprocess.Popen:
        """Starts `name` with `start` (unless `process` is it, already running) and keeps it running from now on."""
        child = Supervised(name, start)
        if process is None:
            self._launch(child)
        else:
            child.process, child.started_at = process, time.monotonic()
        with self._lock:
            self._children[name] = child
        return child.process

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        """The current process of each, for stopping them."""
        with self._lock:
            return {name: child.process for name, child in self._children.items() if child.process is not None}

    def stop(self) -> dict[str, subprocess.Popen]:
        """Restarts nothing from now on; returns the processes, for the caller to stop before `close`."""
        self._stop.set()
        return self.processes

    def close(self) -> None:
        """Ends the watch thread, once its children are stopped: a child started with a parent-death signal
        (infra.children) gets it when the *thread* that forked it ends, and restarts fork from this one."""
        self._stop.set()
        self._closed.set()
        self._thread.join()

    def _launch(self, child: Supervised) -> None:
        child.process, child.started_at, child.due_at = child.start(), time.monotonic(), None

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            with self._lock:
                children = list(self._children.values())
            for child in children:
                if self._stop.is_set():
                    break
                self._check(child)
        self._closed.wait()  # alive until `close`: the children it restarted die with it

    def _check(self, child: Supervised) -> None:
        now = time.monotonic()
        if child.due_at is not None:
            if now >= child.due_at:
                try:
                    self._launch(child)
                except OSError as error:  # no file descriptor, no memory, a log not writable: counts as an exit
                    child.due_at = None
                    self._exited(child, f"could not start ({error})", str(error), now)
            return
        if child.process is None or child.process.poll() is None:
            return
        code = child.process.returncode
        self._exited(child, f"exited ({code})", str(code), now)

    def _exited(self, child: Supervised, what: str, last: str, now: float) -> None:
        """Backoff, or give up after `max_restarts` within `window_s`. `what` happened; `last`: its exit code or
        error."""
        child.failures = 1 if now - child.started_at >= STEADY_S else child.failures + 1
        child.restarts = [at for at in child.restarts if now - at < self.window_s] + [now]
        if len(child.restarts) > self.max_restarts:
            child.process = None
            self.gave_up.append(child.name)
            print(
                f"vsrq dev: {child.name} exited {self.max_restarts + 1} times within {self.window_s:.0f} s "
                f"(last exit {last}): gave up on it; see its log",
                file=sys.stderr,
                flush=True,
            )
            return
        delay = self.backoff_s[min(child.failures, len(self.backoff_s)) - 1]
        print(f"vsrq dev: {child.name} {what}; restarting in {delay:g} s", file=sys.stderr, flush=True)
        child.due_at = now + delay
