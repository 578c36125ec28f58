"""The lease's heartbeats while an attempt runs: progress and stages out, the owner's cancel back, from threads of
their own so that the engine never waits for Redis, and blob transfers that wait out a storage outage with the
lease kept alive."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from math import inf
from time import monotonic
from typing import Any, TypeVar

import redis.exceptions
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
    wait_fixed,
)

from storage.blobs import storage_unavailable
from storage.jobs import FileDigest, Lease, MediaInfo, Stage, StaleAttempt
from worker import service
from worker.errors import Cancelled
from worker.sr.windows import WindowProgress

log = logging.getLogger("vsrq.worker")

# Progress the job shows: the windows run from 1 to UPSCALED, then the encoder's flush, then the upload (beside the
# output's check); the fenced `complete` sets 100.
UPSCALED = 90
UPLOADING = 95
T = TypeVar("T")


class Heartbeat:
    """The lease's heartbeats, at most one per `every_s` unless forced, and the last cancel flag they brought back.

    The engine asks `cancelled()` between tiles, so that must stay cheap: it never waits for Redis. A beat it makes
    due is sent from a thread of its own, and what that beat raised (the job is lost, or the lease ran out) comes
    back at the next `send`. A beat that cannot reach Redis (a restart, a blip, a partition) is not the end of the
    attempt while the lease it last extended still holds: the attempt goes on, and what the beat carried goes with
    the next one (a beat that is not forced and meets one on its way is dropped instead: later ones supersede it).
    Forced beats (stages, a window's end) are sent from the caller's thread, after any beat on its way."""

    def __init__(self, lease: Lease, every_s: float, pace: Pace | None = None) -> None:
        self.lease, self.every_s, self.pace = lease, every_s, pace or Pace()
        self.cancel_requested = False
        self._last = -inf
        self._extended = lease.asked_at  # the lease holds until lease_s after this, the last delivered beat's start
        self._undelivered: dict[str, Any] = {}  # fields not yet delivered (a beat not due, or one that failed)
        self._sending = threading.Lock()  # held for a beat on its way, by whichever thread sends it
        self._failing = False  # the latest beat did not reach Redis: logged once per outage
        self._lost: BaseException | None = None  # what a beat sent in the background raised: raised from now on

    def send(
        self,
        *,
        progress: int | None = None,
        stage: Stage | None = None,
        input_media: MediaInfo | None = None,
        input_file: FileDigest | None = None,
        seconds_left: float | None = None,
        output_size: tuple[int, int] | None = None,
        force: bool = False,
    ) -> bool:
        """Returns whether the owner asked to cancel; raises `StaleAttempt` when this attempt lost the job, and Redis's
        error when it stays out of reach until the lease has run out."""
        # One beat at a time, so that a late one never lands older fields over a newer one's.
        if not self._sending.acquire(blocking=force):
            return self._known()
        background = False
        try:
            self._raise_if_lost()  # (a forced beat may have waited for one that found the attempt over)
            fields = {"progress": progress, "stage": stage, "input_media": input_media, "input_file": input_file,
                      "seconds_left": seconds_left, "output_size": output_size}  # fmt: skip
            self._undelivered |= {name: value for name, value in fields.items() if value is not None}
            if force:
                self._beat()
            elif monotonic() - self._last >= self.every_s:
                self._last, background = monotonic(), True  # the thread releases `_sending`
                threading.Thread(target=self._beat_in_background, name="vsrq-heartbeat", daemon=True).start()
            return self._known()
        finally:
            if not background:
                self._sending.release()

    def _known(self) -> bool:
        """The cancel flag the last beat brought back, unless a beat in the background found the attempt over, or
        is stuck (in a partition) past the lease: the job may be another attempt's by now."""
        if self._lost is None and self._lease_ran_out():
            self._lost = redis.exceptions.TimeoutError(f"no heartbeat reached Redis in {self.lease.lease_s} s")
        self._raise_if_lost()
        return self.cancel_requested

    def _raise_if_lost(self) -> None:
        if self._lost is not None:
            raise self._lost

    def _beat_in_background(self) -> None:
        try:
            self._beat()
        except Exception as error:  # the job is lost, the lease ran out, or a bug: the attempt ends at the next send
            self._lost = error
        finally:
            self._sending.release()

    def _beat(self) -> None:
        """One beat, tolerating Redis errors while the lease holds (the caller holds `_sending`)."""
        try:
            self._deliver()
        except redis.exceptions.RedisError as error:
            if self._lease_ran_out():
                raise
            if not self._failing:
                log.warning("%s: heartbeats fail (%s); the attempt goes on", self.lease.job_id, error)
            # the next try comes every_s after this one ended: a partition's timeouts must not take all the time
            self._failing, self._last = True, monotonic()
            return
        if self._failing:
            log.info("%s: heartbeats reach Redis again", self.lease.job_id)
        self._failing = False

    def silent_s(self) -> float:
        """Seconds since the start of the last beat that reached Redis (or since the lease was asked for)."""
        return monotonic() - self._extended

    def _lease_ran_out(self) -> bool:
        """Whether the lease may have expired (lease_s after the last delivered beat's start): the job may be another
        attempt's."""
        return monotonic() - self._extended >= self.lease.lease_s

    def _deliver(self) -> None:
        """One beat with every undelivered field (the caller holds `_sending`)."""
        self._last = now = monotonic()
        self.cancel_requested = self.lease.heartbeat(**self._undelivered)
        self._extended, self._undelivered = now, {}

    def window(self, event: WindowProgress) -> None:
        finished = event.done >= event.total  # the end of a window is always reported
        last = finished and event.window == event.windows - 1
        self.send(
            progress=1 + int((UPSCALED - 1) * event.fraction),
            stage="encoding" if last else "upscaling",  # after the last window: the encoder's flush
            seconds_left=self.pace.seconds_left(event),
            force=finished,
        )

    def cancelled(self) -> bool:
        return self.send()

    def stop_if_cancelled(self, **beat: Any) -> None:
        """`send(**beat)`, raising `Cancelled` when the owner asked to cancel."""
        if self.send(**beat):
            raise Cancelled("the job was cancelled")

    def stop_if_known_cancelled(self) -> None:
        """Raises `Cancelled` when a beat already delivered brought the owner's cancel back, and what a beat found
        (the attempt lost, Redis out of reach past the lease), sending none: a caller waiting on a transfer beside it
        (whose `kept_alive` beats) must not keep the lease past what that keep-alive gives, nor end a call that never
        returns without showing it stuck (silent, `silent_s`) once the keep-alive has stopped."""
        self._raise_if_lost()
        if self.cancel_requested:
            raise Cancelled("the job was cancelled")

    def settle(self) -> None:
        """Before the attempt completes: delivers what is still undelivered, retrying while the lease holds, and raises
        `Cancelled` when the owner asked to cancel. Unlike `send`, it never goes on without a delivered beat: a cancel
        asked meanwhile must not be missed."""
        retrying = Retrying(
            retry=retry_if_exception_type(redis.exceptions.RedisError),
            wait=wait_fixed(self.every_s),
            stop=lambda _: self._lease_ran_out(),
            reraise=True,
        )
        with self._sending:
            self._raise_if_lost()
            retrying(self._deliver)
        if self.cancel_requested:
            raise Cancelled("the job was cancelled")

    def transfer(self, _: int) -> None:
        """A blob transfer's progress callback (called from boto3's threads): a multi-GB transfer keeps the lease, and
        a cancel stops it."""
        self.stop_if_cancelled()

    def storage(self, transfer: Callable[[], T]) -> T:
        """Runs a blob transfer, waiting out a storage outage (a restart, a network blip) inside the attempt for up to
        `storage_retry_s`, its lease kept alive. A cancel stops it between tries, and mid-transfer while bytes move (a
        blocked request ends first). Past that, the error ends the attempt as a `retry` (see `classify`)."""
        retrying = Retrying(
            retry=retry_if_exception(storage_unavailable),
            wait=wait_exponential(multiplier=0.25, max=1),
            stop=stop_after_delay(service.worker_settings().storage_retry_s),
            before_sleep=self._storage_failed,
            reraise=True,
        )
        with self.kept_alive():
            return retrying(transfer)

    def _storage_failed(self, state: RetryCallState) -> None:
        """Between a blob transfer's tries: the first failure is logged (an operator sees what was waited out)."""
        if state.attempt_number == 1:
            log.warning(
                "%s: a blob transfer failed (%s), tried again for up to %g s",
                self.lease.job_id, state.outcome.exception(), service.worker_settings().storage_retry_s,
            )  # fmt: skip
        self.stop_if_cancelled(force=True)

    @contextmanager
    def kept_alive(self) -> Iterator[None]:
        """Beats from a thread while the block runs, for up to `storage_retry_s`: a storage request that gets no answer
        (a partition, a server shutting down) blocks its caller for `s3_timeout_s` per try, and the lease must not
        expire meanwhile. Past that the beats stop, so a call that hangs for good loses the job to another worker
        rather than holding it. Only blob transfers get this: a stuck engine must still lose its lease."""
        done, deadline = threading.Event(), monotonic() + service.worker_settings().storage_retry_s

        def beat() -> None:
            while not done.wait(self.every_s) and monotonic() < deadline:
                try:
                    self.send()
                except (StaleAttempt, redis.exceptions.RedisError):  # the job is lost, or the lease ran out while
                    return  # Redis was out of reach: the caller finds out at its next beat

        thread = threading.Thread(target=beat, name="vsrq-keepalive", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


class Pace:
    """The engine's seconds left at the pace of the windows this attempt computes: windows an earlier attempt kept come
    back in moments and say nothing of it, nor does the first unit's time (a new shape's graphs). None until it has
    computed for `after_s` and 1 % of the job."""

    def __init__(self, after_s: float = 10.0) -> None:
        self.after_s = after_s
        self._since: tuple[float, float] | None = None  # (when, fraction) at the first computed unit

    def seconds_left(self, event: WindowProgress) -> float | None:
        if event.stage == "restored":
            return None
        now = monotonic()
        if self._since is None:
            self._since = (now, event.fraction)
            return None
        elapsed, done = now - self._since[0], event.fraction - self._since[1]
        if elapsed < self.after_s or done < 0.01:
            return None
        return (1 - event.fraction) * elapsed / done
