"""Jobs' tails (the encoder's flush, the check, previews, uploads, the fenced `complete`) on threads of their own,
while the task returns and the worker starts the next job's head and engine: the GPU does not wait for the MP4.

Tails run one at a time, in the order they were handed: each waits its turn (the previous tail's end) on its own
thread, its lease kept. Up to `HELD` are held at once, one running and the rest waiting; a task whose tail finds no
room waits for the oldest to end. Holding more than one lets the small jobs behind a big one run their engines while
the big job's tail (a 4K flush and check: seconds) runs, instead of the first of them blocking its worker until that
tail is done (bench/RESULTS.md). The bound (VSRQ_WORKER_TAILS_HELD) bounds what they hold: each held tail keeps its
encoder open in host memory and its job's input and MP4 on disk; another is handed only while the disk has room for
the next job beside them (`room`'s `fits`). A tail keeps its attempt's lease (its own heartbeats) and ends its job as
the task would have; what it raises is handled inside it. Its message is acknowledged when the task returns, before
the job completes: a worker killed during a tail leaves the job `in_progress` with a lease that runs out, and the
reaper requeues it and sends it a new message, as for a worker killed mid-engine: the kept windows replay. A job whose
engine ended while tails were held keeps its last window too (worker.kept_windows), so its GPU work is not paid again;
one whose tail ran at once keeps all but its last, which is computed again. A tail stuck in a call that never returns,
silent past `tail_stall_s`, is not waited for: the jobs behind it go back to the queue and the worker exits for its
supervisor to restart it (worker.tasks).
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable
from time import monotonic

log = logging.getLogger("vsrq.worker")

HELD = 3  # tails held at once by default (VSRQ_WORKER_TAILS_HELD): one running, two waiting their turn
Turn = Callable[[float | None], bool]  # waits up to that long for the tails handed before: whether they have ended


class Finisher:
    def __init__(self, held: int = HELD) -> None:
        self.held = held
        # in the order handed: each tail's thread, and how long it has shown no sign of life
        self._pending: list[_Held] = []

    def busy(self) -> bool:
        return any(held.thread.is_alive() for held in self._pending)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Waits for every tail in flight, up to `timeout_s`: whether none is left."""
        return _ended([held.thread for held in self._pending], timeout_s)

    def room(self, timeout_s: float | None = None, fits: Callable[[], bool] = lambda: True) -> bool:
        """Waits up to `timeout_s` until another tail can be handed: fewer than `held` in flight and, while any is,
        `fits()` (the disk has room for the next job beside the held tails' files; with none held, waiting frees
        nothing). Whether one can."""
        if self._fits(fits):
            return True
        _ended([self._pending[0].thread], timeout_s)
        return self._fits(fits)

    def _fits(self, fits: Callable[[], bool]) -> bool:
        self._pending = [held for held in self._pending if held.thread.is_alive()]
        return not self._pending or (len(self._pending) < self.held and fits())

    def wait_behind(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the tails behind the oldest in flight (those waiting their turn): whether they
        have ended."""
        alive = [held.thread for held in self._pending if held.thread.is_alive()]
        return _ended(alive[1:], timeout_s)

    def silent_s(self) -> float:
        """How long the oldest tail in flight (the one running) has shown no sign of life (no heartbeat of its lease
        delivered); 0 if none."""
        return next((held.silent_s() for held in self._pending if held.thread.is_alive()), 0.0)

    def hand(self, tail: Callable[[Turn], None], silent_s: Callable[[], float]) -> None:
        """Runs `tail(turn)` on a thread of its own, in the caller's context (its log lines keep the job id): the tail
        calls `turn` until the tails handed before it have ended; `silent_s` says how long it has shown no sign of
        life. The caller has waited for `room`. A daemon thread: a tail stuck in a call that never returns must not
        keep its process from exiting."""
        if not self.room(0):
            raise RuntimeError(f"{self.held} tails are still in flight")
        # all of them: one that ended early (cancelled while it waited) lets no other through
        before = [held.thread for held in self._pending]

        def turn(timeout_s: float | None) -> bool:
            return _ended(before, timeout_s)

        held = _Held(silent_s)
        # the tail in a list its thread empties: the thread's own arguments keep no reference to it once it has run
        held.thread = threading.Thread(
            target=contextvars.copy_context().run, args=(_run, [tail], turn, held), name="vsrq-tail", daemon=True
        )
        self._pending.append(held)
        held.thread.start()


class _Held:
    """A tail handed: its thread, and its `silent_s` until it ends. `silent_s` is the tail's bound method, so it holds
    the job's whole tail (its encoder, the writer's streams and their FFmpeg threads, the job's record): dropped when
    the tail ends, not when the next job's tail is handed, which may be hours later on an idle worker (after a job of 64
    sound tracks: ~60 MiB of heap and 256 FFmpeg threads kept)."""

    __slots__ = ("silent_s", "thread")

    def __init__(self, silent_s: Callable[[], float]) -> None:
        self.silent_s = silent_s
        self.thread: threading.Thread

    def ended(self) -> None:
        self.silent_s = _no_sign_needed


def _no_sign_needed() -> float:
    return 0.0


def _ended(threads: list[threading.Thread], timeout_s: float | None) -> bool:
    deadline = None if timeout_s is None else monotonic() + timeout_s
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - monotonic()))
    return not any(thread.is_alive() for thread in threads)


def _run(tails: list[Callable[[Turn], None]], turn: Turn, held: _Held) -> None:
    tail = tails.pop()  # the job's tail is dropped when this returns: nothing else refers to it
    try:
        tail(turn)
    except BaseException:  # a tail handles its own errors: one that escapes is a bug
        log.exception("a job's tail failed outside its attempt's error handling")
    finally:
        held.ended()
