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

import contextvars
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from time import monotonic
from typing import Any, BinaryIO

import redis.exceptions
from celery.concurrency import get_implementation
from celery.exceptions import Reject
from celery.signals import worker_init, worker_shutdown
from celery.worker import state as worker_state

from storage.blobs import BlobInfo, BlobNotFound, attempt_output_key, output_prefix, preview_key
from storage.config import say_unknown_variables
from storage.jobs import (
    FileDigest,
    InvalidTransition,
    JobNotFound,
    JobRecord,
    Lease,
    MediaInfo,
    OutputInfo,
    PreviewInfo,
    StaleAttempt,
    Status,
    new_lease_token,
)
from storage.queue import UPSCALE_TASK, send_upscale
from storage.workers import this_process
from worker import heap, metrics, service, signals, started  # signals: importing it connects the process's handlers
from worker.attempt import (
    EX_CONFIG,
    OUTDATED_TRIES,
    OUTDATED_WAIT_S,
    discard,
    discard_attempt,
    end,
    forget_windows,
    relay_webhook,
    storage_refuses_worker,
)
from worker.celery_app import app
from worker.costs import charge, job_limits
from worker.errors import NoWorkerKnows, TailStuck, WorkerOutdated
from worker.fetch import fetch
from worker.finisher import Finisher, Turn
from worker.heartbeat import UPLOADING, Heartbeat
from worker.kept_windows import WINDOWS_HELD, BlobWindowStore, KeptPrefix, windows_key
from worker.media.errors import InputNotFound
from worker.media.previews import make_previews
from worker.media.probe import MediaInfo as ProbedMedia
from worker.media.resize import Target
from worker.prefetch import Prefetcher
from worker.scratch import has_room, job_scratch, scratch_bytes
from worker.sr.request import LOSSLESS, SRRequest
from worker.upscale import Encoding, UpscaleOptions, begin_upscale
from worker.upscale import Result as UpscaleResult

log = logging.getLogger("vsrq.worker")

LEASE_RETRY_S = 2  # a message whose job could not be leased (Redis out of reach) comes back after this
# The header of a message sent again that carries its earlier tries' lease tokens: a header, not an argument, so that
# a worker of an older version (a rolling deploy) runs the message instead of failing it and losing the job.
LOST_LEASES_HEADER = "vsrq_lost_leases"


@worker_init.connect
def _load_model(sender: Any, **_: Any) -> None:
    """Loads the upscaler before the worker takes its first message: a bad checkpoint stops the worker at once."""
    signals.configure_logging()  # Celery sets logging up only after `worker_init`: the load and warmup would be lost
    _check_pool(sender)
    heap.fix_mmap_threshold()  # before any job: its frames must not stay resident in glibc's arenas once freed
    config = service.worker_settings()
    worker_names = {f"VSRQ_WORKER_{name.upper()}" for name in type(config).model_fields}
    say_unknown_variables(log, worker_names, other_prefix="")
    _check_job_store()
    _check_storage()
    _finisher.held = config.tails_held
    # The seconds so far are the interpreter's start and the imports of Celery and the worker's modules
    devices = ",".join(config.device_list)
    log.info("loading %s on %s, %.1f s after the process started", config.model, devices, started.seconds())
    if config.served not in (served := service.settings().models):  # jobs would report a name nobody asks for
        log.warning("this worker's model is reported as %r, which VSRQ_MODELS does not serve (%s): set "
                    "VSRQ_WORKER_SERVED_AS to its name there", config.served, ", ".join(served))  # fmt: skip
    began = started.seconds()
    service.upscaler()
    log.info("model ready in %.1f s, %.1f s after the process started", started.seconds() - began, started.seconds())


def _check_pool(worker: Any) -> None:
    """One job at a time, in the process that holds the model: the solo pool. Celery's default, prefork, forks that
    process once per CPU core (CUDA cannot be used again in a fork) and runs a job in each, beside the others."""
    pool = get_implementation(worker.pool_cls)
    if pool.__module__ != "celery.concurrency.solo":
        _exit_refused(f"this worker runs its jobs one at a time on its model, with `--pool solo`; it was started with "
                      f"the {pool.__module__.rsplit('.', 1)[-1]} pool: start it as the Procfile does "
                      "(`celery -A worker.tasks worker --pool solo --concurrency 1 ...`)")  # fmt: skip


def _check_job_store() -> None:
    """A worker whose Redis refuses its password, its user or that user's commands (VSRQ_REDIS_URL: a rotation half
    done, an ACL) could lease no job: each message it took went back to the broker, its job waiting behind it. Redis
    out of reach is an outage: waited out."""
    try:
        service.jobs().check_access()
    except redis.exceptions.AuthenticationError:
        _exit_refused("the job store's Redis refuses this worker's password or user: check VSRQ_REDIS_URL")
    except redis.exceptions.NoPermissionError as error:  # an ACL user whose PING passed leased nothing
        _exit_refused(f"the job store's Redis refuses this worker's user the scripts or keys it needs ({error}): "
                      "check its ACL (VSRQ_REDIS_URL's user)")  # fmt: skip
    except redis.exceptions.RedisError:
        pass


def _check_storage() -> None:
    """A worker that storage refuses (its key, its secret, its bucket: a rotation half done) failed every job it took,
    within milliseconds each, so it drained the queue before any healthy worker: it does not start. Storage out of
    reach is no reason: each job waits an outage out."""
    if refused := storage_refuses_worker():
        settings = service.settings()
        _exit_refused(f"blob storage refuses this worker ({refused}; its bucket {settings.s3_bucket!r} at "
                      f"{settings.s3_endpoint_url}): check VSRQ_S3_ACCESS_KEY, VSRQ_S3_SECRET_KEY, VSRQ_S3_BUCKET "
                      "and the key's permissions")  # fmt: skip


def _exit_refused(why: str) -> None:
    """Stops a worker at its start that a store it needs refuses: a supervisor restarts it, and this line says why."""
    log.error("%s; exiting (status %d)", why, EX_CONFIG)
    logging.shutdown()
    os._exit(EX_CONFIG)


@app.task(name=UPSCALE_TASK, bind=True, max_retries=None)  # retried only while its job cannot be leased
def upscale(self, job_id: str) -> None:
    # this worker said it stops (storage refused it, a tail stuck): the job it gave back came straight to it
    if worker_state.should_stop:
        raise Reject("this worker is stopping", requeue=True)
    if _refuse_behind_a_stuck_tail(job_id, self.request.headers or {}):
        return
    # 1. Lease the job: only one delivery of its message gets a queued job
    worker = this_process(self.request.hostname or socket.gethostname())
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
    tail: _Tail | None = None
    prefix = KeptPrefix(lease.attempt)  # the job's first attempt: no window kept before it
    with _attempt(job, lease, output_key, prefix):
        tail = _head(job, lease, output_key, prefix)
    if tail is None:  # the attempt ended before its engine was done
        return

    # 4-5. The tail (`_complete`): inline, or on a finisher's thread where it waits for the tails before it, the task
    #    returning at once so that the worker takes its next message and starts its engine (worker.finisher)
    if not service.worker_settings().overlap_tail:
        _finish(tail)
        return
    with _attempt(job, lease, output_key, prefix):
        try:
            _wait_for_room(tail)
            observe = signals.observe_later(self.request.id, job.id)
            _finisher.hand(lambda turn: _finish(tail, observe, overlapped=True, turn=turn), tail.silent_s)
        except BaseException:  # its thread never started: the encoder and the scratch directory are released here
            tail.drop()
            raise


@worker_shutdown.connect
def _finish_tails(**_: Any) -> None:
    """A warm shutdown (a deploy, a scale-in) lets the tail in flight end its job; left to the reaper, the job would be
    done again by another worker. Not a stuck one: its job is left to the reaper, and the process exits at once, Celery
    having shut down by now (its consumer closed, its messages acknowledged or given back): the stuck call's threads
    (boto3's transfer threads among them) would hold a normal exit."""
    _prefetcher.close()  # first: a guess no job will use stops downloading, and its files go (os._exit below skips
    # every later handler)
    if not _finisher.busy():
        return
    log.info("waiting for the last job's tail before shutting down")
    heartbeat_s = service.worker_settings().heartbeat_s
    while not _finisher.wait(heartbeat_s):
        if (silent_s := _finisher.silent_s()) >= _tail_stall_s():
            # the tails waiting their turn behind it see it stuck within a beat and send their jobs back once their
            # kept windows have landed (`_land_kept_windows`): not left to their leases and the reaper
            _finisher.wait_behind(2 * heartbeat_s + _tail_stall_s())
            log.error(
                "the last job's tail is stuck (no heartbeat for %.0f s): exiting without it (status %d), its job is "
                "requeued once the reaper finds this worker gone", silent_s, EX_SOFTWARE, extra={"reason": TAIL_STUCK},
            )  # fmt: skip
            logging.shutdown()  # flushes the log
            os._exit(EX_SOFTWARE)


_finisher = Finisher()  # its `held` set from the worker's settings when it starts (`_load_model`)
TAIL_STUCK = "tail_stuck"  # the stable reason a worker logs when it stops because of a stuck tail
EX_SOFTWARE = 70  # its exit status (sysexits.h: an internal software error): a supervisor restarts it
# the queues this worker consumes (`-Q`), whose next message's input is downloaded while a job runs
_prefetcher = Prefetcher(lambda: list(app.amqp.queues.consume_from))


def _wait_for_room(tail: _Tail) -> None:
    """Waits until the finisher has room for this attempt's tail (worker.finisher) and, while tails are held, the disk
    room for the next job's scratch (as much as this job's: the next one's input is not here yet), its lease kept and
    its cancel seen meanwhile: the held tails' files must not leave the next job without room."""
    stall_s, need = _tail_stall_s(), tail.scratch_need or 0  # not estimated: tails held by count only
    _stop_if_stuck(tail, stall_s)  # with room too: a tail behind a stuck one would be left to its lease at the exit
    while not _finisher.room(tail.beat.every_s, lambda: has_room(tail.scratch, need)):
        tail.beat.stop_if_cancelled()
        _stop_if_stuck(tail, stall_s)


def _stop_if_stuck(tail: _Tail, stall_s: float) -> None:
    """A tail ahead that stays silent past `tail_stall_s` while this attempt's beats get through is stuck in a call
    that never returns: this job goes back to the queue (`TailStuck`), and the worker takes no more messages and exits,
    since every job it leased would wait behind that tail with its lease renewed."""
    if (silent_s := _finisher.silent_s()) >= stall_s and tail.beat.silent_s() < stall_s:
        log.error(
            "the previous job's tail is stuck (no heartbeat for %.0f s): %s goes back to the queue, and this "
            "worker takes no more jobs and exits (status %d)", silent_s, tail.job.id, EX_SOFTWARE,
            extra={"reason": TAIL_STUCK},
        )  # fmt: skip
        worker_state.should_stop = EX_SOFTWARE  # Celery's warm shutdown, once its task (if any) has returned
        _land_kept_windows(tail, stall_s)
        raise TailStuck(f"The worker could not finish its previous job (no heartbeat for {silent_s:.0f} s).")


def _land_kept_windows(tail: _Tail, limit_s: float) -> None:
    """A job sent back because of a stuck tail ahead keeps what its engine made: the windows handed to its uploader
    (its last among them, kept because its tail was to wait) land before it is requeued, for up to `limit_s`, so that
    its next attempt replays them. The attempt's end alone gives them `CLOSE_WAIT_S` (about one window's upload to a
    store nearby) and then deletes the local files the upload in flight still needs (the window's JSON goes last)."""
    store = tail.prefix.store
    if store is not None and not store.wait(limit_s):
        log.warning("%s: its kept windows' uploads outlived %.0f s: left to end on their own", tail.job.id, limit_s)


def _refuse_behind_a_stuck_tail(job_id: str, headers: dict[str, Any]) -> bool:
    """A tail that stays silent past `tail_stall_s` is stuck: this worker, whose task returned while that tail's
    successors waited their turn, takes no more jobs (the stuck job's own, requeued once its lease ran out, among them).
    The message is acknowledged and the job's sent again at the front of its queue, unleased, for another worker, and
    this one exits. Whether it was refused. Not after a pause (SIGSTOP, a slow host) nor while Redis is out of reach:
    the tail may only have been unable to beat, and gets a couple of beats to show it is alive."""
    stall_s, heartbeat_s = _tail_stall_s(), service.worker_settings().heartbeat_s
    if _finisher.silent_s() < stall_s:
        return False
    deadline = monotonic() + 2 * heartbeat_s
    while monotonic() < deadline:
        if _finisher.wait(heartbeat_s / 4) or _finisher.silent_s() < stall_s:
            return False
    try:
        service.jobs().redis.ping()
    except redis.exceptions.RedisError:  # the tail cannot beat either: the lease's own path waits the outage out
        return False
    silent_s = _finisher.silent_s()
    log.error(
        "a job's tail is stuck (no heartbeat for %.0f s): the message for %s goes back to the queue, and this worker "
        "takes no more jobs and exits (status %d)", silent_s, job_id, EX_SOFTWARE, extra={"reason": TAIL_STUCK},
    )  # fmt: skip
    worker_state.should_stop = EX_SOFTWARE
    if headers.get(LOST_LEASES_HEADER):  # its earlier tries' tokens travel with the message: sent back as it is
        raise Reject(f"a tail is stuck (no heartbeat for {silent_s:.0f} s)", requeue=True)
    try:
        job = service.jobs().require(job_id)
    except JobNotFound:
        return True
    except redis.exceptions.RedisError as error:  # gone since the ping: this one goes back as it is
        raise Reject(f"a tail is stuck; the job store is out of reach: {error}", requeue=True) from error
    if job.status == Status.QUEUED:  # any other, and the message would be dropped by the next worker's lease
        try:  # at the front, as every requeued job's (a Reject's goes to the back)
            send_upscale(app, service.jobs(), job, first=True)
        except Exception as error:  # not sent: this one goes back, at the back, rather than be lost
            raise Reject(f"a tail is stuck; the job could not be sent again: {error}", requeue=True) from error
    return True


def _tail_stall_s() -> float:
    return service.worker_settings().tail_stall_s or service.settings().lease_s


@contextmanager
def _attempt(job: JobRecord, lease: Lease, output_key: str, prefix: KeptPrefix) -> Iterator[None]:
    """What ends an attempt that raised, in the task or in its tail (the job's kept windows deleted where its `prefix`
    may hold any)."""
    try:
        yield
    except StaleAttempt as error:  # reaped or ended elsewhere: another attempt owns the job now
        log.warning("%s attempt %d lost the job: %s", job.id, lease.attempt, error.message)
        discard_attempt(output_key)  # uploaded before it found out: never promoted, so never kept
    except JobNotFound:  # its record gone under it (a Redis evicting keys, or flushed): nothing to end nor tell
        log.error("%s attempt %d: the job's record is gone from Redis (evicted? see /healthz): attempt dropped",
                  job.id, lease.attempt)  # fmt: skip
        discard_attempt(output_key)
    except Exception as error:
        end(job, lease, output_key, error, windows=prefix.may_hold())


@dataclass
class _Tail:
    """An attempt whose engine is done: what its tail needs (`_finish`)."""

    job: JobRecord
    lease: Lease
    output_key: str
    beat: Heartbeat
    options: UpscaleOptions
    encoding: Encoding
    graphs: int  # graphs the engine built for this job
    input_from: str  # "prefetch" (downloaded while the previous job ran: worker.prefetch), "storage" or "url"
    input_s: float  # the input's seconds on the task's path: the download, or the prefetched copy's check and move
    scratch: Path
    scratch_need: int | None  # what the job writes to `scratch` at most (`_scratch_need`)
    prefix: KeptPrefix  # whether its kept windows may be in storage, for the job's end
    cleanup: ExitStack  # the scratch directory
    head: dict[str, float]  # `monotonic()` when each step of the head ended (`_note_run`)
    turn_waited_s: float = 0.0  # overlapped, how long it waited for the tails before it
    # its `complete` went through, or an error ended its attempt: what remains is housekeeping (the job's end, the
    # deletion of its files), which sends no heartbeats
    ended: bool = False
    # each step of the tail up to `complete`: `monotonic()` at its start and end (the upload and the check overlap)
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)

    def silent_s(self) -> float:
        """How long it has shown no sign of life, as the finisher reads it (worker.finisher): never once its attempt
        has ended (completed, failed, cancelled or requeued), since its cleanup and metrics send no heartbeats (a
        storage outage may hold them a while) and a tail behind it must not take that for a stuck call and throw its
        finished encoding away."""
        return 0.0 if self.ended else self.beat.silent_s()

    def drop(self) -> None:
        """The tail will not run (the attempt ended while it waited its turn)."""
        try:
            self.encoding.discard()
        finally:
            self.cleanup.close()


def _head(job: JobRecord, lease: Lease, output_key: str, prefix: KeptPrefix) -> _Tail:
    if unknown := sorted(set(job.asks) - JOB_PARAMS):
        _outdated(job, unknown)
    config = service.worker_settings()
    default_steps = service.upscaler().default_steps
    options = replace(
        job_options(job.params, default_steps), limits=job_limits(job), admit=charge(job), **config.window_options
    )
    beat = Heartbeat(lease, config.heartbeat_s)
    with ExitStack() as cleanup:
        scratch = cleanup.enter_context(job_scratch())
        source, output = scratch / "input", scratch / "output.mp4"

        # 2. Fetch the input
        beat.send(progress=0, stage="probing", force=True)
        input_from, input_started, prefetched = "url", monotonic(), None
        if job.input.url is not None:  # named by URL: fetched here, with the SSRF checks (worker/fetch.py)
            fetched = fetch(job.input.url, source, service.settings(), beat.cancelled, job.input.max_bytes)
            digest = FileDigest(bytes=fetched.bytes, sha256=fetched.sha256)
        else:
            try:
                input_from = "prefetch"  # downloaded while the previous job ran, if storage still holds that blob
                known = job.input.sha256 if job.input.owned_by_job else None  # the bytes the API hashed
                with beat.kept_alive():  # its check that storage still holds the blob (a HEAD) may wait out
                    # botocore's timeouts and tries, longer than the lease
                    prefetched = _prefetcher.take(job.input.key, source, beat.stop_if_cancelled, known)
                if prefetched is None:
                    input_from = "storage"
                    beat.storage(lambda: service.blobs().download(job.input.key, source, beat.transfer))
            except BlobNotFound:  # deleted (or expired) while the job waited: no attempt will find it
                raise InputNotFound("The input video is no longer in storage.") from None
            # A referenced upload or key reached the API as a name only, and may be written again between attempts
            # (an earlier attempt's recorded digest proves nothing): hashed each attempt, once the file is whole
            # (parts download out of order), or as the prefetch downloaded this very file. The job's own upload is
            # the bytes the API hashed.
            digest = None if job.input.owned_by_job and job.input.sha256 else prefetched or FileDigest.of(source)
        input_s = monotonic() - input_started
        if digest is not None:
            hashed = "as it was prefetched" if digest is prefetched else "here"
            log.info("%s read its input: %d bytes, sha256 %s (hashed %s)", job.id, digest.bytes, digest.sha256, hashed)
            beat.stop_if_cancelled(input_file=digest, force=True)
        head = {"fetched": monotonic()}
        scratch_need = _scratch_need(job, source, options)
        _prefetcher.ahead(job, scratch_need)  # the next job's input downloads while this one's engine runs

        # 3. Probe, upscale window by window into the encoder: heartbeats carry progress and bring back the cancel flag.
        #    Finished windows are kept under the job's work prefix: an earlier attempt's are replayed, not computed.
        #    Not the last where the tail follows it at once: keeping it would cost every job's tail its upload; kept
        #    where other jobs' tails are still held as it is committed (this one's may wait behind them, and be sent
        #    back or lost meanwhile): worker.kept_windows. A job of one window with no tail held then keeps nothing.
        #    The key names the bytes this attempt read (a URL may serve others each time) and what gives other bits on
        #    another worker (`auto` may pick another decode segment there, a split, or FP8 attention on cuDNN):
        #    windows kept under another key are never replayed.
        input_sha256 = digest.sha256 if digest is not None else job.input.sha256
        windows = windows_key(job, input_sha256, config.model, options, service.upscaler())
        kept = beat.storage(
            lambda: BlobWindowStore(
                service.blobs(), job.id, Path(scratch, "windows"), windows, beat.transfer, beat.kept_alive,
                keep_last=_finisher.busy, earlier=prefix.earlier,
            )
        )
        prefix.store = kept
        # whatever ends the attempt: after the tail's join nothing is left; otherwise the uploads not begun are skipped
        # (storage that hangs must not hold the worker for each one), and the local copies go
        cleanup.callback(kept.close)
        head["windows_kept"] = monotonic()
        graphs = _graphs_built()
        encoding = begin_upscale(
            source, output, service.upscaler(), options, beat.window, beat.cancelled, kept,
            probed=lambda media, size: beat.send(input_media=media_info(media), output_size=size, force=True),
        )  # fmt: skip
        graphs = _graphs_built() - graphs
        # the raw windows are encoded: once uploaded they go (a held tail must not hold them), the engine not waiting
        # for the last kept window's upload, which the tail joins after the encoder's flush and check
        kept.release_local()
        _report_memory_once()  # here, on the task's thread: the next job resets the peaks while this one's tail runs
        head |= encoding.result.head
        return _Tail(
            job,
            lease,
            output_key,
            beat,
            options,
            encoding,
            graphs,
            input_from,
            input_s,
            scratch,
            scratch_need,
            prefix,
            cleanup.pop_all(),
            head,
        )


def _scratch_need(job: JobRecord, source: Path, options: UpscaleOptions) -> int | None:
    """What this job writes to its scratch disk at most (worker.scratch), estimated once: the room a prefetch must
    leave it, and the room held tails must leave the next job. None where the input does not say (a bound only: never
    the job's end)."""
    try:
        return scratch_bytes(
            source, options.request.scale, options.window, options.window_overlap, options.limits.max_frames,
            windows_held=WINDOWS_HELD,
        )  # fmt: skip
    except Exception as error:
        log.warning("%s: its scratch not estimated (%s)", job.id, error)
        return None


def _finish(
    tail: _Tail, observe: Callable[[], None] = lambda: None, overlapped: bool = False, turn: Turn | None = None
) -> None:
    """The attempt's tail, in the task or on a finisher's thread once `turn` says the tails before it have ended: it
    ends the attempt whatever happens."""
    try:
        with _attempt(tail.job, tail.lease, tail.output_key, tail.prefix), tail.cleanup:
            try:
                if turn is not None:
                    _wait_turn(tail, turn)
                _complete(tail, overlapped)
            except BaseException:
                tail.ended = True  # `_attempt` ends it, then its output's deletes may wait out a storage outage
                raise
    finally:
        observe()


def _wait_turn(tail: _Tail, turn: Turn) -> None:
    """Waits for the tails handed before this one, this attempt's lease kept and its cancel seen meanwhile; behind a
    stuck one, it goes back to the queue."""
    waited, stall_s = monotonic(), _tail_stall_s()
    try:
        while not turn(tail.beat.every_s):
            tail.beat.stop_if_cancelled()
            _stop_if_stuck(tail, stall_s)
    except BaseException:
        tail.encoding.discard()
        raise
    tail.turn_waited_s = monotonic() - waited


def _complete(tail: _Tail, overlapped: bool) -> None:
    job, lease, output_key, beat, scratch = tail.job, tail.lease, tail.output_key, tail.beat, tail.scratch
    config = service.worker_settings()
    default_steps = service.upscaler().default_steps

    # 4. The encoder's flush, then the uploads to this attempt's keys: a stale attempt may upload, but only the fenced
    #    `complete` promotes. The output's upload runs beside its read-back check, so it need not wait for it: a
    #    check that fails (or anything else that leaves the block) stops the upload and fails the attempt at once, not
    #    once the upload's thread has ended (botocore's tries of a request that gets no answer can outlast the lease);
    #    `end` deletes what landed, and the stopped upload what lands after it. The poster frame and sprite sheet are
    #    made meanwhile, then uploaded.
    spans: dict[str, tuple[float, float]] = {}  # each step's start and end, for the `run` event (`_note_run`)
    flushed = tail.encoding.flush(alive=beat.send)  # its lease, and the watch for a stuck tail, see it go on
    at = monotonic()
    beat.stop_if_cancelled(progress=UPLOADING, stage="uploading", force=True)  # its media said once probed
    spans["uploading_beat"] = (at, monotonic())
    stop = threading.Event()  # set: the upload stops at its next progress and is not tried again
    # opened before the check, which renames the file (or deletes it) as the upload reads it; closed by the upload
    file = open(flushed, "rb")
    beside = ThreadPoolExecutor(1, thread_name_prefix="vsrq-output-upload")
    upload = beside.submit(contextvars.copy_context().run, _upload_output, file, output_key, beat, stop)
    try:
        result = tail.encoding.check()
        spans |= result.tail_spans
        if upload.done() and upload.exception() is not None:  # failed already: not worth the previews
            upload.result()
        at = monotonic()
        with beat.kept_alive():  # decoding a long 4K output (the fallback) takes a while
            made = _previews(job.id, result, scratch)
        spans["previews"] = (at, monotonic())
        # a cancel or a lost lease is seen here, beat by beat (the upload's keep-alive brings it back): the upload sees
        # it only at its next progress, which a request storage does not answer holds for botocore's tries
        while not wait([upload], beat.every_s).done:
            beat.stop_if_known_cancelled()
        stored, spans["upload"] = upload.result()
    except BaseException as error:
        # the upload stops at its next progress (boto3 reports every 256 KB), or once botocore's tries of a request
        # that gets no answer time out (3 x s3_timeout_s), never tried again through an outage: not waited for here
        stop.set()
        beside.shutdown(wait=False)
        _report_upload_lost(job.id, upload, error)
        raise
    beside.shutdown()
    metrics.record_upscale(result)  # its gauges (threads alive) once the upload's threads have ended
    at = monotonic()
    previews = {
        variant: beat.storage(lambda: _upload(path, preview_key(output_key, variant), beat.transfer, "image/jpeg"))
        for variant, path in made.items()
    }
    spans["upload_previews"] = (at, monotonic())
    at = monotonic()
    beat.settle()  # asked while it uploaded: the output is discarded, not promoted
    spans["settle"] = (at, monotonic())
    tail.spans = spans

    # 5. Promote, then drop what earlier attempts left (one killed after its upload, before its `complete`)
    _note_run(lease, result, tail, overlapped)
    promoted_output = OutputInfo(
        key=output_key,
        bytes=stored.size,
        sha256=stored.sha256,
        media=media_info(result.written),
        previews={v: PreviewInfo(key=blob.key, bytes=blob.size, sha256=blob.sha256) for v, blob in previews.items()},
        model=config.served,
        num_inference_steps=None if default_steps is None else tail.options.request.num_inference_steps,
        quality=result.quality,
        quality_levers=result.levers,
        notes=list(result.notes),
    )
    lease.complete(promoted_output)
    tail.ended = True
    relay_webhook(job, Status.COMPLETED)
    log.info(
        "%s completed by attempt %d: %s (%d bytes), %d of %d windows restored from earlier attempts",
        job.id, lease.attempt, output_key, stored.size, result.restored, result.windows,
    )  # fmt: skip
    try:  # housekeeping: an error here must not reach `end`, which would discard the promoted output
        for key in service.blobs().keys(output_prefix(job.id)):
            if key not in promoted_output.keys():
                discard(key)
        if tail.prefix.may_hold():  # a first attempt that kept no window: nothing to list
            forget_windows(job.id)
    except Exception:  # storage.lifecycle's sweep deletes the leftovers of ended jobs
        log.warning("%s: cleaning up after completion failed", job.id, exc_info=True)


def _graphs_built() -> int:
    """Graphs Dynamo has built in this process: one built by a job means it met a shape the warmup did not compile.
    None built without Dynamo loaded: reading torch._dynamo would import it, seconds of a lanczos worker's first job."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return dynamo.counters["stats"]["unique_graphs"] if dynamo is not None else 0


def _note_run(lease: Lease, result: UpscaleResult, tail: _Tail, overlapped: bool) -> None:
    """A `run` event with the attempt's engine seconds beside its wall time, before `complete` so a completed job
    has it: what the service costs on top of the model (bench/service.py reads it). Informational: never the
    attempt's end."""
    spans = dict(tail.spans)
    if "verify" in spans and "upload" in spans:
        pair = (spans["verify"], spans["upload"])
        spans["verify_upload"] = (min(start for start, _ in pair), max(end for _, end in pair))
    detail = {
        "engine_s": round(result.engine_seconds, 3),
        "upscale_s": round(result.seconds, 3),  # probe to verified file
        # the engine's windows, from and to, in seconds after the lease was asked for (the `leased` event's time, on
        # Redis's clock, give or take its round trip): the gap to the next job's is the GPU's wait between jobs
        "engine_span_s": [round(at - lease.asked_at, 3) for at in result.engine_span],
        "tail": "overlapped" if overlapped else "inline",  # on the finisher's thread (worker.finisher), or the task's
        "input": tail.input_from,  # where the input came from: "prefetch" means it was not on the GPU's path
        "input_s": round(tail.input_s, 3),
        # when each step of the head ended, as `engine_span_s`: the input fetched, the kept windows listed, probed,
        # the encoder opened, the first window's frames decoded (the engine's first call follows)
        "head_s": {step: round(at - lease.asked_at, 3) for step, at in tail.head.items()},
        # inside the engine's span, not its work: the windows' input frames made tensors, the windows' commits to the
        # kept-windows store as the engine waited for them (`kept`: ~0 for a job of one window that kept not its last:
        # its local copy dropped)
        "windows_s": {step: round(seconds, 3) for step, seconds in result.windows_s.items()},
        # beside the engine and the tail, off their path: the seconds the store's uploader spent uploading the windows
        # (the last only where other jobs' tails were still held as it was committed: 0 for a job of one window
        # otherwise)
        "kept_upload_s": round(result.kept_upload_s, 3),
        # the tail's steps, in seconds: the encoder's flush, the `uploading` beat, then the output's upload beside
        # `verify`, the wait for the kept windows' last uploads (`kept_join`) and the previews (which follow `verify`
        # on the tail's thread); `verify_upload` spans `verify` and the upload alone (the earlier start to the later
        # end: `kept_join` and the previews are not in it, though they may end after the upload); then the previews'
        # uploads, `settle` (`complete` follows this event)
        "tail_s": {step: round(end - start, 3) for step, (start, end) in spans.items()},
        # when each step started and ended, as `head_s`
        "tail_at_s": {step: [round(at - lease.asked_at, 3) for at in span] for step, span in spans.items()},
        # overlapped, how long it waited for the tails before it: part of `upscale_s`, none of its own work
        "turn_waited_s": round(tail.turn_waited_s, 3),
        "windows": result.windows,
        "restored": result.restored,
        "tiles": result.tiles,
        "devices": list(result.devices),
        "graphs_built": tail.graphs,
    }
    try:
        lease.store.note(lease.job_id, "run", detail)
    except (JobNotFound, redis.exceptions.RedisError) as error:  # `complete` finds out what this means
        log.warning("%s: could not record the run's timings: %s", lease.job_id, error)


class _UploadStopped(Exception):
    """The output's upload was told to stop: its attempt fails beside it (`_complete`)."""


def _upload_output(
    file: BinaryIO, key: str, beat: Heartbeat, stop: threading.Event
) -> tuple[BlobInfo, tuple[float, float]]:
    """The output's upload from its open file (closed once it ends), waiting out a storage outage until `stop` is set:
    what was stored, and when it started and ended. Stopped, its attempt may have ended (and deleted its output)
    before its request did: what it may have landed is deleted here once the request has ended."""
    began = monotonic()

    def stop_if_told(cause: BaseException | None = None) -> None:
        if stop.is_set():
            raise _UploadStopped("the output's upload was stopped") from cause

    def progress(sent: int) -> None:
        stop_if_told()  # raised in boto3's transfer: the request is dropped
        beat.transfer(sent)

    def put() -> BlobInfo:
        stop_if_told()
        file.seek(0)  # a try again starts over
        try:
            return service.blobs().put(key, file, content_type="video/mp4", progress=progress)
        except Exception as error:
            stop_if_told(error)  # botocore wraps what the callback raised mid-request: not an outage to wait out
            raise

    try:
        with file:
            stored = beat.storage(put)
    finally:
        if stop.is_set():  # a request that was sent whole may land though it raised (boto3 reports its progress
            discard(key)  # once the bytes are sent)
    stop_if_told()
    return stored, (began, monotonic())


def _report_upload_lost(job_id: str, upload: Future[Any], error: BaseException) -> None:
    """The attempt ends with `error`, raised beside the output's upload: what the upload raised, if anything else
    (a cancel, a lost lease, storage down), goes to the log rather than nowhere, also once it ends after the
    attempt."""

    def report(ended: Future[Any]) -> None:
        lost = None if ended.cancelled() else ended.exception()
        if lost is not None and lost is not error and not isinstance(lost, _UploadStopped):
            log.warning("%s: the output's upload failed too: %s", job_id, lost, exc_info=lost)

    upload.add_done_callback(report)


def _upload(path: Path, key: str, progress: Callable[[int], None], content_type: str = "video/mp4") -> BlobInfo:
    with open(path, "rb") as file:
        return service.blobs().put(key, file, content_type=content_type, progress=progress)


def _previews(job_id: str, result: UpscaleResult, directory: Path) -> dict[str, Path]:
    """The output's thumbnail and sprite sheet (worker.media.previews), from the frames taken as they were encoded,
    else decoded from the output; none if they cannot be made: a job is not failed for its pictures (GET
    .../content?variant= then answers 404)."""
    try:
        taken = result.previews
        if taken is not None and taken.frames == result.written.video.frames and taken.complete():
            made = taken.write(directory)
        else:
            if taken is not None and taken.error is not None:
                log.warning("%s: previews decoded from the output: a frame was not taken (%s)", job_id, taken.error)
            elif taken is not None:
                log.info("%s: previews decoded from the output: %d frames taken of %d written", job_id, taken.frames,
                         result.written.video.frames)  # fmt: skip
            made = make_previews(result.output, result.written.video.frames, directory)
    except Exception:
        log.warning("%s: no thumbnail or sprite sheet", job_id, exc_info=True)
        return {}
    return {"thumbnail": made.thumbnail, "spritesheet": made.spritesheet}


def _outdated(job: JobRecord, unknown: list[str]) -> None:
    """Gives back a job that asks for params this worker does not know (WorkerOutdated), or fails it once it has been
    given back so for an hour."""
    names = ", ".join(f"`{name}`" for name in unknown)
    reasons = [event.detail.get("reason") or {} for event in service.jobs().events(job.id) if event.type == "requeued"]
    if sum(reason.get("code") == WorkerOutdated.code for reason in reasons) >= OUTDATED_TRIES:
        hours = OUTDATED_TRIES * OUTDATED_WAIT_S / 3600
        raise NoWorkerKnows(f"No worker that took the job in {hours:g} h knows {names}: the workers are older than the "
                            "API; deploy workers that do, and send the job again.")  # fmt: skip
    log.warning("%s asks for %s, which this worker does not know: the API that took it is newer than this worker "
                "(deploy workers before the API); the job goes back to the queue", job.id, ", ".join(unknown))  # fmt: skip
    raise WorkerOutdated(f"The worker that took the job is older than the API and does not know {names}; a newer "
                         "worker will run it.")  # fmt: skip


# The params `job_options` reads: a job that asks for another (JobRecord.asks) came from a newer API
JOB_PARAMS = frozenset({
    "sr_resolution_scale", "num_inference_steps", "seed", "sr_tile_min_overlap", "sr_tiles_batch_size", "quality",
    "sr_target_resolution", "sr_target_resize_mode", "output_codec", "output_crf", "deinterlace", "background",
})  # fmt: skip


def job_options(params: dict[str, Any], default_steps: int | None = SRRequest.num_inference_steps) -> UpscaleOptions:
    """The job's SGLang-named parameters (as the API validated them) as the engine's options; `default_steps`: the
    upscaler's own when the job names none."""
    target = params.get("sr_target_resolution")
    return UpscaleOptions(
        request=SRRequest(
            scale=params["sr_resolution_scale"],
            num_inference_steps=params.get("num_inference_steps") or default_steps or SRRequest.num_inference_steps,
            seed=params["seed"],
            min_overlap=params["sr_tile_min_overlap"],
            tiles_batch_size=params["sr_tiles_batch_size"],
            quality=params.get("quality", LOSSLESS),  # jobs queued before the tiers existed ran lossless
        ),
        target=Target.parse(target, params.get("sr_target_resize_mode", "fit")) if target else None,
        codec=params.get("output_codec", "h264"),
        crf=params.get("output_crf", 18),
        deinterlace=params.get("deinterlace", "frame"),  # jobs queued before field rate existed ran at the frame rate
        background=params.get("background", UpscaleOptions.background),
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


@cache
def _report_memory_once() -> None:
    """After the first job's engine: how much of each GPU its peak used, so an operator can pick the performance
    mode. Best effort: a report that fails costs the job nothing."""
    try:
        for line in getattr(service.upscaler(), "memory_report", list)():
            log.info("memory after the first job: %s", line)
    except Exception:
        log.warning("the memory report failed", exc_info=True)
