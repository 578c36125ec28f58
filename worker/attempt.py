"""How an attempt ends: what stopped it (`classify`: cancelled, failed for good, or retried) and what that does to
its job and its files (`end`)."""

from __future__ import annotations

import logging
from typing import Literal

import botocore.exceptions
import redis.exceptions
import torch
from celery.worker import state as worker_state

from storage.blobs import PREVIEWS, UNREACHABLE, BlobNotFound, preview_key, refusal, storage_unavailable, work_prefix
from storage.jobs import JobRecord, Lease, StaleAttempt, Status
from storage.lifecycle import promoted
from storage.overview import storage_problem
from storage.queue import send_upscale
from storage.webhooks import relay_now
from worker import service
from worker.backoff import backoff_s
from worker.celery_app import app
from worker.errors import Cancelled, CodedError, PermanentError, TailStuck, WorkerOutdated
from worker.fetch import NO_ROOM, FetchUnavailable, WorkerDiskFull

log = logging.getLogger("vsrq.worker")

Outcome = Literal["cancelled", "failed", "retry"]


def classify(error: BaseException) -> tuple[Outcome, str, str]:
    """(outcome, code, message a user can act on) for an error that stopped an attempt."""
    if isinstance(error, Cancelled):
        return "cancelled", error.code, error.message
    if isinstance(error, PermanentError):  # raised on purpose, with a stable code: another attempt would raise it again
        return "failed", error.code, error.message
    if isinstance(error, TailStuck):  # this worker is at fault, not the job: it exits, another worker runs the job
        return "retry", error.code, error.message
    if isinstance(error, WorkerOutdated):  # nor here: a newer worker runs the job
        return "retry", error.code, error.message
    if isinstance(error, BlobNotFound):  # another file of the job (a kept window) vanished under it: start again
        # (its own code: `Heartbeat.storage` waits out only outages, and a missing file is not one)
        return "retry", "job_file_missing", "A file of the job went missing from blob storage."
    # the input's origin is down or slow, or this worker's disk is full: the next attempt (or worker) may succeed
    if isinstance(error, (FetchUnavailable, WorkerDiskFull)):
        return "retry", error.code, error.message
    if isinstance(error, OSError) and error.errno in NO_ROOM:  # the scratch disk filled anywhere else in the attempt
        message = f"The worker ran out of disk space ({error.strerror}); another attempt will try again."
        return "retry", WorkerDiskFull.code, message
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "retry", "gpu_oom", "The GPU ran out of memory."
    if isinstance(error, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return "retry", "redis_unavailable", "The job store could not be reached."
    if isinstance(error, UNREACHABLE):
        return "retry", "storage_unavailable", "Blob storage could not be reached."
    if storage_unavailable(error):
        return "retry", "storage_unavailable", "Blob storage is unavailable."
    if isinstance(error, botocore.exceptions.ClientError) and refusal(error) and storage_refuses_worker():
        return "retry", STORAGE_REFUSED, "Blob storage refused the worker that took the job; another one will run it."
    return "failed", "internal_error", "The worker failed unexpectedly; the error is in its log."


# The code of a job given back because storage refuses its worker (worker.tasks stops that worker), and its exit status
STORAGE_REFUSED = "storage_refused_worker"
EX_CONFIG = 78  # sysexits.h: a configuration error; a supervisor restarts it, and its start says what is wrong
UNCOUNTED = (TailStuck.code, STORAGE_REFUSED, WorkerOutdated.code)  # retries the job's max attempts do not count
# How long a job that asks for what its worker does not know waits out of line: a rolling deploy's new workers start;
# and how many times it is given back so before it fails (an hour: a fleet left on an older image, a rollback)
OUTDATED_WAIT_S = 30.0
OUTDATED_TRIES = 120


def storage_refuses_worker() -> str | None:
    """What storage refuses this worker itself (its key, a rotation half done; its bucket; its writes), whatever the
    job, as an operator reads it; None where it takes the worker's reads and writes. A job's own object may be refused
    alone (its ACL; a missing key to a caller without ListBucket), which is the job's to fail."""
    try:
        service.blobs().check(write=True)
    except botocore.exceptions.ClientError as error:
        return storage_problem(error) if refusal(error) is not None else None
    except Exception:  # out of reach now: an outage, which the job's next attempt waits out
        return None
    return None


def relay_webhook(job: JobRecord, ended: Status) -> None:
    """The webhook of a job that ended here (as `ended`) goes to a delivery worker now, not at the reaper's pass."""
    if job.webhook_url:
        relay_now(service.outbox(), app, service.settings().webhook_claim_s, job.id, ended)


def retry_wait_s(error: BaseException, lease: Lease) -> float:
    """Seconds a retried job waits before its next attempt: an origin that is down or asked for time gets it (a backoff
    over the job's attempts, never sooner than its Retry-After); any other retry starts at once (another worker, the
    GPU freed)."""
    if isinstance(error, FetchUnavailable):
        settings = service.settings()
        return backoff_s(lease.attempt, settings.fetch_retry_base_s, settings.fetch_retry_max_s, error.retry_after)
    if isinstance(error, WorkerOutdated):  # taken at once, it would come back to the same workers
        return OUTDATED_WAIT_S
    return 0.0


def end(job: JobRecord, lease: Lease, output_key: str, error: Exception, windows: bool = True) -> None:
    """Ends the attempt that `error` stopped: the job failed, cancelled or requeued, and what it leaves deleted (its
    output; its kept windows once the job has ended, where `windows` says the prefix may hold any)."""
    outcome, code, message = classify(error)
    if code == STORAGE_REFUSED:  # every job it took would go the same way: others take them
        log.error("blob storage refuses this worker (%s): %s goes back to the queue, and this worker takes no more "
                  "jobs and exits (status %d)", error, job.id, EX_CONFIG)  # fmt: skip
        worker_state.should_stop = EX_CONFIG  # Celery's warm shutdown, once this task has returned
    elif code == "internal_error":
        log.exception("%s attempt %d failed", job.id, lease.attempt)
    else:  # a foreign error's traceback diagnoses a retry that keeps coming back; our own errors' messages say it all
        cause = None if isinstance(error, CodedError) else error
        log.info("%s attempt %d: %s (%s): %s", job.id, lease.attempt, outcome, code, message, exc_info=cause)
    kept = False  # a `complete` whose reply was lost did promote the output: it is the job's now
    wait = retry_wait_s(error, lease) if outcome == "retry" else 0.0
    try:
        if outcome == "cancelled":
            lease.cancelled()
            ended = Status.CANCELLED
        elif outcome == "failed":
            lease.fail(code, message)
            ended = Status.FAILED
        # behind another job's stuck tail, or on a worker storage refuses, the job was not at fault: that attempt is
        # not one of its max attempts
        elif (ended := lease.retry(code, message, counts=code not in UNCOUNTED, wait_s=wait)) == Status.QUEUED:
            if wait:  # the reaper sends its message once the wait is over (JobStore.unsent)
                log.info("%s: its next attempt waits %.1f s (%s)", job.id, wait, code)
            else:
                send_upscale(app, service.jobs(), job, first=True)
            return  # the next attempt replays the kept windows (the last one only if its tail could wait)
        relay_webhook(job, ended)
        if windows:
            forget_windows(job.id)  # the job has ended
    except StaleAttempt as stale:
        log.warning("%s attempt %d lost the job before it could end it: %s", job.id, lease.attempt, stale.message)
        kept = kept_output(job.id, output_key)
    except redis.exceptions.RedisError as unreachable:  # the reaper requeues or ends the job, or sends its message
        log.warning("%s attempt %d could not end the job: %s", job.id, lease.attempt, unreachable)
        kept = True  # it may be the job's output: the storage sweep (storage.lifecycle) deletes it if it is not
    finally:
        # An output that will not be promoted (e.g. cancelled during the upload), deleted once the lease has ended:
        # storage may be what failed, and a lease left to expire meanwhile would turn the ending into a requeue.
        if not kept:
            discard_attempt(output_key)


def kept_output(job_id: str, output_key: str) -> bool:
    """Whether an attempt that lost its job must keep its output: the job's own (its `complete` went through, the
    reply was lost), or maybe so (Redis cannot say)."""
    try:
        return promoted(service.jobs().get(job_id), output_key)
    except redis.exceptions.RedisError:
        return True


def forget_windows(job_id: str) -> None:
    try:
        service.blobs().delete_prefix(work_prefix(job_id))
    except Exception:  # storage down: the reaper's sweep deletes the work prefixes of ended jobs
        log.warning("could not delete the kept windows of %s", job_id, exc_info=True)


def discard_attempt(output_key: str) -> None:
    """An attempt's output that will not be promoted: the video and the previews made of it. Storage that fails one
    delete is not asked for the next: each would wait out botocore's tries (3 x `s3_timeout_s`) after the job ended,
    holding the tail behind it; the storage sweep deletes what is left."""
    for key in (output_key, *(preview_key(output_key, variant) for variant in PREVIEWS)):
        if not discard(key):
            return


def discard(key: str) -> bool:
    """Whether `key` is gone (storage down: the reaper's storage sweep, storage.lifecycle, deletes what is left)."""
    try:
        service.blobs().delete(key)
    except Exception:
        log.warning("could not delete %s", key, exc_info=True)
        return False
    return True
