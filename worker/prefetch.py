"""The next job's input, downloaded while this job's engine runs, so that the GPU does not wait for it between jobs.

Once a job's own input is in place, `ahead` reads the messages this worker takes next from the broker (without taking
any: storage.queue.next_job_ids); the first whose job is queued is the guess, and its input (a blob: a URL input is
fetched once leased, behind the SSRF checks) is downloaded on a thread of its own into a cache of one entry, a
directory of this process. When a job starts, `take` moves the cached file into its scratch directory if the key is
the job's and storage still holds the same blob (a HEAD: its ETag and size); anything else (no entry, another key, a
blob written again or deleted, storage out of reach, a download of the key that moves no bytes) leaves the job to
download its input as before.

Nothing here touches a lease, a message or a job's state: a guess that does not come true (another worker took the
message, the job was cancelled or deleted, a requeued job went to the front) costs one download, never a run. Each
download goes to a file of its own, named in the entry, so a job is only ever handed the bytes downloaded for its key.
Disk is bounded: one input at a time, none over `prefetch_max_bytes` nor over what the disk has left once the running
job has written its frames and its MP4; the file is removed when used, replaced or stale and the directory at shutdown
(a killed worker's, whose lock file no process holds, by the next one to start).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import botocore.exceptions
import redis.exceptions

from storage.blobs import BlobNotFound
from storage.held_dirs import held_directory, release
from storage.jobs import FileDigest, JobRecord, Status
from storage.queue import next_job_ids
from worker import metrics, service

log = logging.getLogger("vsrq.worker")

_DIRECTORY_PREFIX = "vsrq-prefetch-"
# A download of the job's own key that moves no bytes for this many heartbeats is a dead connection: the job stops
# waiting for it and downloads its input itself (a call that hangs must not hold a job under a renewed lease)
_STALLED_BEATS = 10
_CHUNK = 1 << 20
# Expected failures (an outage of storage or of Redis): one line each, no traceback
_EXPECTED = (
    OSError,
    BlobNotFound,
    redis.exceptions.RedisError,
    botocore.exceptions.BotoCoreError,
    botocore.exceptions.ClientError,
)


@dataclass(frozen=True)
class _Entry:
    job_id: str  # the job it was downloaded for (the key is what matches: jobs may share an upload)
    key: str
    etag: str | None
    size: int
    sha256: str
    path: Path  # this download's own file


@dataclass
class _Flight:
    """A download on its way: the thread downloading it, its key, and when its last bytes arrived."""

    thread: threading.Thread
    key: str
    abort: threading.Event
    moved: float = field(default_factory=time.monotonic)


class _Aborted(Exception):
    """The job that started needs another input: this download is dropped."""


class Prefetcher:
    def __init__(self, queues: Callable[[], list[str]]) -> None:
        self._queues = queues  # the queues this worker consumes, the order it takes them in
        self._lock = threading.Lock()
        self._entry: _Entry | None = None
        self._thread: threading.Thread | None = None  # the newest prefetch thread
        self._flight: _Flight | None = None  # the download on its way, by whichever thread
        self._abort = threading.Event()
        self._directory: Path | None = None
        self._held: int | None = None  # the directory's lock file, flock'ed
        self._closed = False

    def ahead(self, current: JobRecord, keep_free: int | None) -> None:
        """Starts the next job's download in the background, while `current`, which writes `keep_free` bytes to the
        disk at most (worker.scratch; None: not known, so nothing is prefetched beside it), runs. Returns at once; a
        download still on its way (a large input) is left to finish instead."""
        if not service.worker_settings().prefetch_input or keep_free is None:
            return
        with self._lock:
            previous = self._thread
            if self._closed or (previous is not None and previous.is_alive() and not self._abort.is_set()):
                return
            self._abort = abort = threading.Event()
            self._thread = threading.Thread(
                target=self._prefetch,
                args=(current.id, keep_free, previous, abort),
                name="vsrq-prefetch",
                daemon=True,
            )
            self._thread.start()

    def take(self, key: str, path: Path, waiting: Callable[[], None], sha256: str | None = None) -> FileDigest | None:
        """Puts the prefetched copy of blob `key` at `path` if there is one and storage still holds that blob (and its
        SHA-256 is `sha256`, when known): the digest of the bytes now at `path` (hashed as they downloaded into that
        very file, so the job need not read them again), or None if it did not. A download of `key` still on its way
        is waited for while it moves bytes, `waiting` called between looks (the lease's beat: it raises on a cancel);
        one of another key is dropped."""
        if not service.worker_settings().prefetch_input:
            return None
        with self._lock:
            flight = self._flight
            if flight is not None and flight.key != key:
                flight.abort.set()
        if flight is not None and flight.key == key and not self._waited(flight, waiting):
            metrics.INPUT_PREFETCH.labels("miss").inc()
            return None
        with self._lock:
            entry = self._entry
            if entry is None or entry.key != key:  # kept: a guess can come true a job later (a requeued job first)
                metrics.INPUT_PREFETCH.labels("miss").inc()
                return None
            self._entry = None  # the entry's file is now this call's alone: no other thread writes its name
        try:
            now = service.blobs().head(key)
        except Exception as error:  # the job's own download waits out an outage
            log.info("the prefetched input %s was not checked (%s): downloaded again", key, error)
            entry.path.unlink(missing_ok=True)
            metrics.INPUT_PREFETCH.labels("miss").inc()
            return None
        if (
            now is None
            or (now.etag, now.size) != (entry.etag, entry.size)
            or (sha256 is not None and sha256 != entry.sha256)
        ):
            entry.path.unlink(missing_ok=True)
            metrics.INPUT_PREFETCH.labels("stale").inc()
            log.info("the prefetched input %s changed or is gone: not used", key)
            return None
        try:
            shutil.move(entry.path, path)  # a rename: the scratch directory is on the same disk
            moved = path.stat().st_size
        except OSError as error:  # removed under us (a temp cleaner): the job downloads its input itself
            log.warning("the prefetched input %s could not be used: %s", key, error)
            metrics.INPUT_PREFETCH.labels("miss").inc()
            return None
        if moved != entry.size:  # never expected: the job downloads the bytes it names itself
            log.warning("the prefetched input %s has %d bytes, not %d: not used", key, moved, entry.size)
            path.unlink(missing_ok=True)
            metrics.INPUT_PREFETCH.labels("stale").inc()
            return None
        metrics.INPUT_PREFETCH.labels("hit").inc()
        return FileDigest(bytes=moved, sha256=entry.sha256)

    def close(self) -> None:
        """At shutdown: stops a download on its way and removes the cache. No download starts after it."""
        with self._lock:
            self._closed = True
            self._abort.set()
            if self._flight is not None:
                self._flight.abort.set()
            thread, self._entry = self._thread, None
        if thread is not None:  # a thread stuck in a dead connection is left to die with the process (a daemon)
            thread.join(1)
        if self._directory is not None and self._held is not None:
            release(self._directory, self._held)
            self._directory, self._held = None, None

    def _waited(self, flight: _Flight, waiting: Callable[[], None]) -> bool:
        """Waits for the download of the job's own key while bytes arrive: whether it ended (False: it stalled, and is
        dropped)."""
        every_s = service.worker_settings().heartbeat_s
        while flight.thread.is_alive():
            flight.thread.join(every_s)
            waiting()
            if flight.thread.is_alive() and (silent_s := time.monotonic() - flight.moved) >= _STALLED_BEATS * every_s:
                flight.abort.set()  # it ends at its next bytes, or its call's timeout
                log.warning(
                    "the prefetch of %s moved no bytes for %.1f s: dropped, the job downloads its input", flight.key,
                    silent_s,
                )  # fmt: skip
                return False
        return True

    # -- the prefetch thread ---------------------------------------------------------------------------------------

    def _prefetch(
        self, current: str, keep_free: int, previous: threading.Thread | None, abort: threading.Event
    ) -> None:
        if previous is not None:  # an aborted download, ending at its next chunk: one file at a time
            previous.join()
        flight: _Flight | None = None
        file: Path | None = None
        try:
            job = self._guess(current)
            key = job.input.key if job is not None else None
            with self._lock:
                entry = self._entry
            if entry is not None and entry.key == key:  # here already (take checks it is still the blob)
                return
            self._drop()  # a guess that did not come true (nor will: it is not next any more)
            if job is None or key is None:
                return
            blobs = service.blobs()
            info = blobs.head(key)
            if info is None or info.etag is None:  # gone, or a store that cannot tell a blob written again
                return
            directory = self._cache()
            # the running job's frames and MP4 come first: a prefetch must never leave it without room
            room = shutil.disk_usage(directory).free - keep_free
            if info.size > min(service.worker_settings().prefetch_max_bytes, room):
                log.info("the input of %s is not prefetched: %d bytes, %d free beside this job's", job.id, info.size,
                         room)  # fmt: skip
                return
            with self._lock:
                if abort.is_set():
                    return
                self._flight = flight = _Flight(threading.current_thread(), key, abort)
            handle, name = tempfile.mkstemp(prefix="input-", dir=directory)  # this download's own file
            os.close(handle)
            file = Path(name)

            size, sha256 = _download(blobs.open(key), file, flight)
            after = blobs.head(key)
            if after is None or (after.etag, after.size) != (info.etag, info.size):  # written again meanwhile
                return
            known = job.input.sha256 if job.input.owned_by_job else None  # a referenced key's may be an old read's
            if size != info.size or (known is not None and known != sha256):
                log.warning("the prefetched input of %s is not the blob its job names: dropped", job.id)
                return
            with self._lock:
                if not abort.is_set():
                    self._entry = _Entry(job.id, key, info.etag, info.size, sha256, file)
                    file = None  # the entry's now
                    log.info("prefetched the input of %s, next in the queue (%d bytes)", job.id, info.size)
        except Exception as error:  # a prefetch is only ever a guess: the job downloads its input itself
            if not abort.is_set():
                log.warning("prefetching the next input failed: %s", error, exc_info=not isinstance(error, _EXPECTED))
        finally:
            with self._lock:
                if self._flight is not None and self._flight is flight:
                    self._flight = None
            if file is not None:
                file.unlink(missing_ok=True)

    def _guess(self, current: str) -> JobRecord | None:
        """The job this worker most likely runs next: the first message it would take whose job is queued (others are
        dropped at their lease)."""
        from worker.celery_app import app

        for job_id in next_job_ids(app, self._queues()):
            if job_id == current:
                continue
            job = service.jobs().get(job_id)
            if job is not None and job.status == Status.QUEUED:
                return job
        return None

    def _drop(self) -> None:
        with self._lock:
            entry, self._entry = self._entry, None
        if entry is not None:
            entry.path.unlink(missing_ok=True)

    def _cache(self) -> Path:
        """This process's directory, made on first use beside the jobs' scratch directories (a move into one is a
        rename), under a name no other user can take in advance; those of processes that are gone are removed."""
        if self._closed:  # shutting down: no directory made after close removed this one's
            raise _Aborted
        if self._directory is None:
            self._directory, self._held = held_directory(_DIRECTORY_PREFIX, service.worker_settings().prefetch_dir)
            log.info("prefetching inputs into %s", self._directory)
        return self._directory


def _download(body: BinaryIO, file: Path, flight: _Flight) -> tuple[int, str]:
    """The blob's bytes into `file`, on this (daemon) thread: a read stuck on a dead connection holds no exit, as
    boto3's transfer threads would. Hashed on the way. Returns (bytes, SHA-256)."""
    digest, size = hashlib.sha256(), 0
    with body, file.open("wb") as sink:
        while chunk := body.read(_CHUNK):
            if flight.abort.is_set():
                raise _Aborted
            flight.moved = time.monotonic()
            digest.update(chunk)
            sink.write(chunk)
            size += len(chunk)
    return size, digest.hexdigest()
