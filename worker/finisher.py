"""One job's tail (the encoder's flush, the check, previews, uploads, the fenced `complete`) on a thread of its own,
while the task returns and the worker starts the next job's head and engine: the GPU does not wait for the MP4.

At most one tail is in flight: a task hands its tail over only once the previous one has finished, so disk, host
memory and the storage connection are bounded as with one job at a time. A tail keeps its attempt's lease (its own
heartbeats) and ends its job as the task would have; what it raises is handled inside it. Its message is
acknowledged when the task returns, before the job completes: a worker killed during a tail leaves the job
`in_progress` with a lease that runs out, and the reaper requeues it and sends it a new message, as for a worker
killed mid-engine (the kept windows replay, so the GPU work is not paid again). A tail stuck in a call that never
returns, silent past `tail_stall_s`, is not waited for: the next job goes back to the queue and the worker exits for
its supervisor to restart it (worker.tasks).
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("vsrq.worker")


class Finisher:
    def __init__(self) -> None:
        self._pending: threading.Thread | None = None
        self._silent_s: Callable[[], float] = lambda: 0.0

    def busy(self) -> bool:
        return self._pending is not None and self._pending.is_alive()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Waits for the tail in flight, if any, up to `timeout_s`: whether none is left."""
        pending = self._pending
        if pending is None:
            return True
        pending.join(timeout_s)
        return not pending.is_alive()

    def silent_s(self) -> float:
        """How long the tail in flight has shown no sign of life (no heartbeat of its lease delivered); 0 if none."""
        return self._silent_s() if self.busy() else 0.0

    def hand(self, tail: Callable[[], None], silent_s: Callable[[], float]) -> None:
        """Runs `tail` on a thread of its own, in the caller's context (its log lines keep the job id); `silent_s` says
        how long it has shown no sign of life. The caller has waited for the previous tail (`wait`): one at a time.
        A daemon thread: a tail stuck in a call that never returns must not keep its process from exiting."""
        if self.busy():
            raise RuntimeError("a tail is still in flight")
        context = contextvars.copy_context()
        self._pending = threading.Thread(target=context.run, args=(_run, tail), name="vsrq-tail", daemon=True)
        self._silent_s = silent_s
        self._pending.start()


def _run(tail: Callable[[], None]) -> None:
    try:
        tail()
    except BaseException:  # a tail handles its own errors: one that escapes is a bug
        log.exception("a job's tail failed outside its attempt's error handling")
