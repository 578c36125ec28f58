"""The `vsrq.upscale` task: one job, from its queued record to a promoted MP4 (or a typed failure).

Run a GPU worker with the solo pool (CUDA cannot be re-initialised in forked children), one job at a time:

    VSRQ_WORKER_MODEL=<checkpoint dir | hub id | lanczos> VSRQ_WORKER_DEVICES=cuda:0,cuda:1 \
        celery -A worker.tasks worker --pool solo --concurrency 1 -Q vsrq.k6

Celery only says "run job X": the job's state is its record (storage.jobs), and every write this task makes is fenced
by its lease (attempt and lease token). A message for a job that is not queued (a duplicate delivery, a cancelled or
deleted job) is dropped, unless it is the one a worker sent again after a lease whose reply was lost: that one takes
the lease over.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import cache
from math import inf
from pathlib import Path
from tempfile import TemporaryDirectory
from time import monotonic
from typing import Any, Literal, TypeVar

import botocore.exceptions
import redis.exceptions
import torch
from boto3.exceptions import RetriesExceededError, S3UploadFailedError
from celery.signals import worker_init
from tenacity import (
    Retrying,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
    wait_fixed,
)

from storage.blobs import BlobInfo, BlobNotFound, attempt_output_key, output_prefix, work_prefix
from storage.lifecycle import promoted
from storage.jobs import (
    FileDigest,
    InvalidTransition,
    JobNotFound,
    JobRecord,
    Lease,
    MediaInfo,
    OutputInfo,
    Stage,
    StaleAttempt,
    Status,
    new_lease_token,
)
from worker import metrics, service, signals  # signals: importing it connects the process's handlers
from storage.queue import UPSCALE_TASK, send_upscale
from worker.celery_app import app
from worker.fetch import FetchUnavailable, WorkerDiskFull, fetch
from worker.kept_windows import BlobWindowStore, windows_key
from worker.media.probe import MediaInfo as ProbedMedia
from worker.media.resize import Target
from worker.sr.engine import SRRequest
from worker.sr.errors import Cancelled, SRError
from worker.sr.windows import WindowProgress
from worker.upscale import UpscaleOptions, upscale_file

log = logging.getLogger("vsrq.worker")

# Progress the job shows: the windows run from 1 to UPSCALED, then the encoder's flush and the check, then the upload;
# the fenced `complete` sets 100.
UPSCALED = 90
UPLOADING = 95
LEASE_RETRY_S = 2  # a message whose job could not be leased (Redis out of reach) comes back after this
# The header of a message sent again that carries its earlier tries' lease tokens: a header, not an argument, so that
# a worker of an older version (a rolling deploy) runs the message instead of failing it and losing the job.
LOST_LEASES_HEADER = "vsrq_lost_leases"
T = TypeVar("T")


@worker_init.connect
def _load_model(**_: Any) -> None:
    """Loads the upscaler before the worker takes its first message: a bad checkpoint stops the worker at once."""
    signals.configure_logging()  # Celery sets logging up only after `worker_init`: the load and warmup would be lost
    config = service.worker_settings()
    log.info("loading %s on %s", config.model, ",".join(config.device_list))
    service.upscaler()


@app.task(name=UPSCALE_TASK, bind=True, max_retries=None)  # retried only while its job cannot be leased
def upscale(self, job_id: str) -> None:
    # 1. Lease the job: only one delivery of its message gets a queued job
    worker = f"{self.request.hostname or socket.gethostname()}/{os.getpid()}"
    token, lost = new_lease_token(), (self.request.headers or {}).get(LOST_LEASES_HEADER) or []
    try:
        lease = service.jobs().lease(job_id, worker, service.settings().lease_s, token=token, lost=lost)
    except (InvalidTransition, JobNotFound) as error:
        log.info("dropped a message for %s: %s", job_id, error.message)
        return
    except redis.exceptions.RedisError as error:  # the job store is out of reach, the broker is not (VSRQ_BROKER_URL):
        # acknowledged, this message would be the queued job's last. Sent again instead, for this worker or another,
        # with this try's token: a try whose reply was lost did lease the job, and the next delivery takes it over.
        log.warning("%s not leased (%s): its message is sent again in %g s", job_id, error, LEASE_RETRY_S)
        # Tries are LEASE_RETRY_S apart at least: one older than the lease's length no longer holds it
        lost = [*lost, token][-(service.settings().lease_s // LEASE_RETRY_S + 1) :]
        raise self.retry(exc=error, countdown=LEASE_RETRY_S, headers={LOST_LEASES_HEADER: lost}) from error
    if lost:
        log.info("%s attempt %d leased after %d tries that got no reply", job_id, lease.attempt, len(lost))
    job = lease.job()
    output_key = attempt_output_key(job.id, lease.attempt, lease.token)
    try:
        _run(job, lease, output_key)
    except StaleAttempt as error:  # reaped or ended elsewhere: another attempt owns the job now
        log.warning("%s attempt %d lost the job: %s", job.id, lease.attempt, error.message)
        _discard(output_key)  # uploaded before it found out: never promoted, so never kept
    except Exception as error:
        _end(job, lease, output_key, error)


def _run(job: JobRecord, lease: Lease, output_key: str) -> None:
    config = service.worker_settings()
    options = replace(job_options(job.params), **config.window_options)
    beat = Heartbeat(lease, config.heartbeat_s)
    with TemporaryDirectory(prefix="vsrq-") as scratch:
        source, output = Path(scratch, "input"), Path(scratch, "output.mp4")

        # 2. Fetch the input
        beat.send(progress=0, stage="probing", force=True)
        if job.input.url is not None:  # named by URL: fetched here, with the SSRF checks (worker/fetch.py)
            fetched = fetch(job.input.url, source, service.settings(), beat.cancelled, job.input.max_bytes)
            digest = FileDigest(bytes=fetched.bytes, sha256=fetched.sha256)
        else:
            try:
                beat.storage(lambda: service.blobs().download(job.input.key, source, beat.transfer))
            except BlobNotFound:  # deleted (or expired) while the job waited: no attempt will find it
                raise InputNotFound("The input video is no longer in storage.") from None
            # A referenced upload or key reached the API as a name only; parts download out of order, so the file
            # is hashed once it is whole.
            digest = None if job.input.sha256 else FileDigest.of(source)
        if digest is not None:
            log.info("%s read its input: %d bytes, sha256 %s", job.id, digest.bytes, digest.sha256)
            beat.stop_if_cancelled(input_file=digest, force=True)

        # 3. Probe, upscale window by window, encode, verify: heartbeats carry progress and bring back the cancel flag.
        #    Finished windows are kept under the job's work prefix: an earlier attempt's are replayed, not computed.
        windows = windows_key(job, config.model, options)
        kept = beat.storage(
            lambda: BlobWindowStore(
                service.blobs(), job.id, Path(scratch, "windows"), windows, beat.transfer, beat.kept_alive
            )
        )
        result = upscale_file(source, output, service.upscaler(), options, beat.window, beat.cancelled, kept)
        metrics.record_upscale(result)

        # 4. Upload to this attempt's key: a stale attempt may upload, but only the fenced `complete` promotes
        beat.stop_if_cancelled(progress=UPLOADING, stage="uploading", input_media=media_info(result.source), force=True)
        stored = beat.storage(lambda: _upload(output, output_key, beat.transfer))
        beat.settle()  # asked while it uploaded: the output is discarded, not promoted

    # 5. Promote, then drop what earlier attempts left (one killed after its upload, before its `complete`)
    lease.complete(
        OutputInfo(key=output_key, bytes=stored.size, sha256=stored.sha256, media=media_info(result.written))
    )
    log.info(
        "%s completed by attempt %d: %s (%d bytes), %d of %d windows restored from earlier attempts",
        job.id, lease.attempt, output_key, stored.size, result.restored, result.windows,
    )  # fmt: skip
    try:  # housekeeping: an error here must not reach `_end`, which would discard the promoted output
        for key in service.blobs().keys(output_prefix(job.id)):
            if key != output_key:
                _discard(key)
        _forget_windows(job.id)
        _report_memory_once()
    except Exception:  # storage.lifecycle's sweep deletes the leftovers of ended jobs
        log.warning("%s: cleaning up after completion failed", job.id, exc_info=True)


def _upload(path: Path, key: str, progress: Callable[[int], None]) -> BlobInfo:
    with open(path, "rb") as file:
        return service.blobs().put(key, file, content_type="video/mp4", progress=progress)


def job_options(params: dict[str, Any]) -> UpscaleOptions:
    """The job's SGLang-named parameters (as the API validated them) as the engine's options."""
    target = params.get("sr_target_resolution")
    return UpscaleOptions(
        request=SRRequest(
            scale=params["sr_resolution_scale"],
            num_inference_steps=params.get("num_inference_steps") or SRRequest.num_inference_steps,
            seed=params["seed"],
            min_overlap=params["sr_tile_min_overlap"],
            tiles_batch_size=params["sr_tiles_batch_size"],
        ),
        target=Target.parse(target, params.get("sr_target_resize_mode", "fit")) if target else None,
        codec=params.get("output_codec", "h264"),
        crf=params.get("output_crf", 18),
    )


def media_info(probed: ProbedMedia) -> MediaInfo:
    video = probed.video
    return MediaInfo(
        width=video.width,
        height=video.height,
        frames=video.frames,
        fps=float(video.fps),
        duration=video.duration,
        audio=bool(probed.audio),
    )


class Heartbeat:
    """The lease's heartbeats, at most one per `every_s` unless forced, and the last cancel flag they brought back.

    The engine asks `cancelled()` between tiles, so that must stay cheap: it never waits for Redis. A beat it makes
    due is sent from a thread of its own, and what that beat raised (the job is lost, or the lease ran out) comes
    back at the next `send`. A beat that cannot reach Redis (a restart, a blip, a partition) is not the end of the
    attempt while the lease it last extended still holds: the attempt goes on, and what the beat carried goes with
    the next one (a beat that is not forced and meets one on its way is dropped instead: later ones supersede it).
    Forced beats (stages, a window's end) are sent from the caller's thread, after any beat on its way."""

    def __init__(self, lease: Lease, every_s: float) -> None:
        self.lease, self.every_s = lease, every_s
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
            fields = {"progress": progress, "stage": stage, "input_media": input_media, "input_file": input_file}
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
            stage="encoding" if last else "upscaling",  # after the last window: the encoder's flush and the check
            force=finished,
        )

    def cancelled(self) -> bool:
        return self.send()

    def stop_if_cancelled(self, **beat: Any) -> None:
        """`send(**beat)`, raising `Cancelled` when the owner asked to cancel."""
        if self.send(**beat):
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
            retry=retry_if_exception(lambda error: classify(error)[1] == "storage_unavailable"),
            wait=wait_exponential(multiplier=0.25, max=1),
            stop=stop_after_delay(service.worker_settings().storage_retry_s),
            before_sleep=lambda _: self.stop_if_cancelled(force=True),
            reraise=True,
        )
        with self.kept_alive():
            return retrying(transfer)

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


# -- Endings -------------------------------------------------------------------------------------------------------

Outcome = Literal["cancelled", "failed", "retry"]


class InputNotFound(SRError):
    code = "input_not_found"


def classify(error: BaseException) -> tuple[Outcome, str, str]:
    """(outcome, code, message a user can act on) for an error that stopped an attempt."""
    if isinstance(error, Cancelled):
        return "cancelled", error.code, error.message
    if isinstance(error, SRError):  # raised on purpose, with a stable code: another attempt would raise it again
        return "failed", error.code, error.message
    if isinstance(error, BlobNotFound):  # another file of the job (a kept window) vanished under it: start again
        # (its own code: `Heartbeat.storage` waits out only outages, and a missing file is not one)
        return "retry", "job_file_missing", "A file of the job went missing from blob storage."
    # the input's origin is down or slow, or this worker's disk is full: the next attempt (or worker) may succeed
    if isinstance(error, (FetchUnavailable, WorkerDiskFull)):
        return "retry", error.code, error.message
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "retry", "gpu_oom", "The GPU ran out of memory."
    if isinstance(error, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return "retry", "redis_unavailable", "The job store could not be reached."
    unreachable = (  # S3UploadFailedError, RetriesExceededError: boto3's transfer manager gave up on the parts
        botocore.exceptions.ConnectionError,
        botocore.exceptions.HTTPClientError,
        S3UploadFailedError,
        RetriesExceededError,
    )
    if isinstance(error, unreachable):
        return "retry", "storage_unavailable", "Blob storage could not be reached."
    if isinstance(error, botocore.exceptions.ClientError) and _server_side(error):
        return "retry", "storage_unavailable", "Blob storage is unavailable."
    return "failed", "internal_error", "The worker failed unexpectedly; the error is in its log."


def _server_side(error: botocore.exceptions.ClientError) -> bool:
    return error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500


def _end(job: JobRecord, lease: Lease, output_key: str, error: Exception) -> None:
    outcome, code, message = classify(error)
    if code == "internal_error":
        log.exception("%s attempt %d failed", job.id, lease.attempt)
    else:
        log.info("%s attempt %d: %s (%s)", job.id, lease.attempt, outcome, code)
    kept = False  # a `complete` whose reply was lost did promote the output: it is the job's now
    try:
        if outcome == "cancelled":
            lease.cancelled()
        elif outcome == "failed":
            lease.fail(code, message)
        elif lease.retry(code, message) == Status.QUEUED:
            send_upscale(app, service.jobs(), job)
            return  # the next attempt replays the kept windows
        _forget_windows(job.id)  # the job has ended
    except StaleAttempt as stale:
        log.warning("%s attempt %d lost the job before it could end it: %s", job.id, lease.attempt, stale.message)
        kept = _kept(job.id, output_key)
    except redis.exceptions.RedisError as unreachable:  # the reaper requeues or ends the job, or sends its message
        log.warning("%s attempt %d could not end the job: %s", job.id, lease.attempt, unreachable)
        kept = True  # it may be the job's output: the storage sweep (storage.lifecycle) deletes it if it is not
    finally:
        # An output that will not be promoted (e.g. cancelled during the upload), deleted once the lease has ended:
        # storage may be what failed, and a lease left to expire meanwhile would turn the ending into a requeue.
        if not kept:
            _discard(output_key)


def _kept(job_id: str, output_key: str) -> bool:
    """Whether an attempt that lost its job must keep its output: the job's own (its `complete` went through, the
    reply was lost), or maybe so (Redis cannot say)."""
    try:
        return promoted(service.jobs().get(job_id), output_key)
    except redis.exceptions.RedisError:
        return True


def _forget_windows(job_id: str) -> None:
    try:
        service.blobs().delete_prefix(work_prefix(job_id))
    except Exception:  # storage down: the reaper's sweep deletes the work prefixes of ended jobs
        log.warning("could not delete the kept windows of %s", job_id, exc_info=True)


def _discard(key: str) -> None:
    try:
        service.blobs().delete(key)
    except Exception:  # storage down: the reaper's storage sweep (storage.lifecycle) deletes what is left
        log.warning("could not delete %s", key, exc_info=True)


@cache
def _report_memory_once() -> None:
    """After the first job: how much of each GPU its peak used, so an operator can pick the performance mode."""
    for line in getattr(service.upscaler(), "memory_report", list)():
        log.info("memory after the first job: %s", line)
