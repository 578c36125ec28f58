"""One job's tail (the encoder's flush, the check, previews, uploads, the fenced `complete`) on a thread of its own,
while the task returns and the worker starts the next job's head and engine: the GPU does not wait for the MP4.

At most one tail is in flight: a task hands its tail over only once the previous one has finished, so disk, host
memory and the storage connection are bounded as with one job at a time. A tail keeps its attempt's lease (its own
heartbeats) and ends its job as the task would have; what it raises is handled inside it. Its message is
acknowledged when the task returns, before the job completes: a worker killed during a tail leaves the job
`in_progress` with a lease that runs out, and the reaper requeues it and sends it a new message, as for a worker
killed mid-engine (the kept windows replay, so the GPU work is not paid again).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger("vsrq.worker")


class Finisher:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vsrq-tail")
        self._pending: Future[None] | None = None

    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Waits for the tail in flight, if any, up to `timeout_s`: whether none is left."""
        pending = self._pending
        if pending is None:
            return True
        try:
            pending.result(timeout_s)
        except TimeoutError:
            return False
        except Exception:  # a tail handles its own errors: one that escapes is a bug, logged by `_run`
            pass
        return True

    def hand(self, tail: Callable[[], None]) -> None:
        """Runs `tail` on the finisher's thread, in the caller's context (its log lines keep the job id). The caller
        has waited for the previous tail (`wait`): one at a time."""
        if self.busy():
            raise RuntimeError("a tail is still in flight")
        self._pending = self._executor.submit(contextvars.copy_context().run, _run, tail)


def _run(tail: Callable[[], None]) -> None:
    try:
        tail()
    except BaseException:
        log.exception("a job's tail failed outside its attempt's error handling")
        raise
