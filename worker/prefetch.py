"""The next job's input, downloaded while this job's engine runs, so that the GPU does not wait for it between jobs.

Once a job's own input is in place, `ahead` reads the messages this worker takes next from the broker (without taking
any: storage.queue.next_job_ids); the first whose job is queued is the guess, and its input (a blob: a URL input is
fetched once leased, behind the SSRF checks) is downloaded on a thread of its own into a cache of one entry, a
directory of this process. When a job starts, `take` moves the cached file into its scratch directory if the key is
the job's and storage still holds the same blob (a HEAD: its ETag and size); anything else (no entry, another key, a
blob written again or deleted, storage out of reach) leaves the job to download its input as before.

Nothing here touches a lease, a message or a job's state: a guess that does not come true (another worker took the
message, the job was cancelled or deleted, a requeued job went to the front) costs one download, never a run. Disk is
bounded: one input at a time, none over `prefetch_max_bytes` or half the disk's free room, the file removed when used,
replaced or stale and the directory at shutdown (a killed worker's is removed by the next one to start).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from storage.jobs import JobRecord, Status
from storage.queue import next_job_ids
from worker import metrics, service

log = logging.getLogger("vsrq.worker")

_DIRECTORY_PREFIX = "vsrq-prefetch-"


@dataclass(frozen=True)
class _Entry:
    job_id: str  # the job it was downloaded for (the key is what matches: jobs may share an upload)
    key: str
    etag: str | None
    size: int
    path: Path


class _Aborted(Exception):
    """The job that started needs another input: this download is dropped."""


class Prefetcher:
    def __init__(self, queues: Callable[[], list[str]]) -> None:
        self._queues = queues  # the queues this worker consumes, the order it takes them in
        self._lock = threading.Lock()
        self._entry: _Entry | None = None
        self._thread: threading.Thread | None = None
        self._in_flight: str | None = None  # the key being downloaded
        self._abort = threading.Event()
        self._directory: Path | None = None

    def ahead(self, current: JobRecord) -> None:
        """Starts the next job's download in the background, while `current` (whose input is here) runs. Returns at
        once; a download still on its way (a large input) is left to finish instead."""
        if not service.worker_settings().prefetch_input:
            return
        with self._lock:
            previous = self._thread
            if previous is not None and previous.is_alive() and not self._abort.is_set():
                return
            self._abort = abort = threading.Event()
            self._thread = threading.Thread(
                target=self._prefetch, args=(current.id, previous, abort), name="vsrq-prefetch", daemon=True
            )
            self._thread.start()

    def take(self, key: str, path: Path, waiting: Callable[[], None]) -> bool:
        """Puts the prefetched copy of blob `key` at `path` if there is one and storage still holds that blob: whether
        it did. A download of `key` still on its way is waited for, `waiting` called between looks (the lease's beat:
        it raises on a cancel); one of another key is dropped."""
        if not service.worker_settings().prefetch_input:
            return False
        with self._lock:
            thread, in_flight = self._thread, self._in_flight
            if thread is not None and in_flight is not None and in_flight != key:
                self._abort.set()
        if thread is not None and in_flight == key:
            while thread.is_alive():
                thread.join(service.worker_settings().heartbeat_s)
                waiting()
        with self._lock:
            entry = self._entry
            if entry is None or entry.key != key:  # kept: a guess can come true a job later (a requeued job first)
                metrics.INPUT_PREFETCH.labels("miss").inc()
                return False
            self._entry = None
        try:
            now = service.blobs().head(key)
        except Exception as error:  # the job's own download waits out an outage
            log.info("the prefetched input %s was not checked (%s): downloaded again", key, error)
            entry.path.unlink(missing_ok=True)
            metrics.INPUT_PREFETCH.labels("miss").inc()
            return False
        if now is None or (now.etag, now.size) != (entry.etag, entry.size):
            entry.path.unlink(missing_ok=True)
            metrics.INPUT_PREFETCH.labels("stale").inc()
            log.info("the prefetched input %s changed or is gone: not used", key)
            return False
        try:
            shutil.move(entry.path, path)  # a rename: the scratch directory is on the same disk
        except OSError as error:  # removed under us (a temp cleaner): the job downloads its input itself
            log.warning("the prefetched input %s could not be used: %s", key, error)
            metrics.INPUT_PREFETCH.labels("miss").inc()
            return False
        metrics.INPUT_PREFETCH.labels("hit").inc()
        return True

    def close(self) -> None:
        """At shutdown: stops a download on its way and removes the cache."""
        with self._lock:
            self._abort.set()
            thread, self._entry = self._thread, None
        if thread is not None:
            thread.join(10)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)

    # -- the prefetch thread ---------------------------------------------------------------------------------------

    def _prefetch(self, current: str, previous: threading.Thread | None, abort: threading.Event) -> None:
        if previous is not None:  # an aborted download, ending at its next chunk: one file at a time
            previous.join()
        partial: Path | None = None
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
            directory = self._cache()
            room = shutil.disk_usage(directory).free // 2  # the rest for the running job's scratch and output
            if info is None or info.etag is None:  # gone, or a store that cannot tell a blob written again
                return
            if info.size > min(service.worker_settings().prefetch_max_bytes, room):
                return
            with self._lock:
                if abort.is_set():
                    return
                self._in_flight = key
            partial = directory / "input.partial"

            def progress(_: int) -> None:
                if abort.is_set():
                    raise _Aborted

            blobs.download(key, partial, progress)
            after = blobs.head(key)
            if after is None or (after.etag, after.size) != (info.etag, info.size):  # written again meanwhile
                return
            path = directory / "input"
            os.replace(partial, path)
            with self._lock:
                if not abort.is_set():
                    self._entry = _Entry(job.id, key, info.etag, info.size, path)
                    log.info("prefetched the input of %s, next in the queue (%d bytes)", job.id, info.size)
                    return
            path.unlink(missing_ok=True)
        except Exception as error:  # a prefetch is only ever a guess: the job downloads its input itself
            if not abort.is_set():
                log.warning("prefetching the next input failed: %s", error, exc_info=not isinstance(error, OSError))
        finally:
            with self._lock:
                self._in_flight = None
            if partial is not None:
                partial.unlink(missing_ok=True)

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
        """This process's directory, made on first use; those of processes that are gone (killed) are removed."""
        if self._directory is None:
            root = Path(tempfile.gettempdir())
            for stale in root.glob(f"{_DIRECTORY_PREFIX}*"):
                pid = stale.name.removeprefix(_DIRECTORY_PREFIX)
                if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
                    shutil.rmtree(stale, ignore_errors=True)
            directory = root / f"{_DIRECTORY_PREFIX}{os.getpid()}"
            directory.mkdir(mode=0o700)
            self._directory = directory
        return self._directory


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
