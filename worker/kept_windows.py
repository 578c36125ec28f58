"""A job's finished windows, kept in blob storage so that the job's next attempt (retried, or requeued after its worker
died) replays them and computes only the missing ones.

A `DirectoryWindowStore` in the attempt's scratch directory, mirrored to work/{job_id}/windows/{key digest}/: the
attempt downloads each window kept so far as its turn comes, replays it and deletes its local copy, and uploads each
window once it is committed, on a thread of its own (`_Uploader`) so that the engine goes on with the next window
meanwhile, deleting its local copy once it is up. Its frames go as FFV1 (`worker.media.lossless`: the same bytes back,
several times smaller for real video) where that is smaller than raw, and its float overlap tail goes from storage once
the next window is kept (`DirectoryWindowStore.superseded_tail`). A window committed while `UPLOADS_BEHIND` are still
waiting (storage slower than the engine) is not kept. So the scratch disk holds a few windows whatever the clip's
length: holding every window until the engine was done (as big as the raw output: 16.7 GB for 10 minutes of 320x180 at
x2, 448 GB for 1080p), a long job filled the worker's disk and failed three attempts as `worker_disk_full`. Once the
engine is done what is left goes (`release_local`, after the uploads), the attempt's tail needing only the input and the
MP4. The tail waits for the uploads (`join`) after the encoder's flush and check, before anything that must not race
them (the job's end deletes the prefix). An attempt that ends otherwise (failed, cancelled, its lease lost) does not
wait for them (`close`): a window not kept is only computed again by the next attempt. The key is the job's, not the
attempt's; each key has a prefix of its own, as an upload `close` left in flight may land after the next attempt has
begun: under its own key, which an attempt with another key never reads (it deletes the older keys' windows as it
begins; the job's end, or the reaper's sweep, deletes the job's work prefix).

The job's last window is kept only where the job's tail may wait (`keep_last`, asked at the window's commit, as the
engine hands the job's tail over: the worker's finisher still holds other jobs' tails, worker.finisher). Where the
tail follows at once, its frames go straight into the encoder, so keeping it (its raw frames, 571 MB for W1's one
window, uploaded beside the tail's flush and check, which contend with it, and joined before the job completes:
seconds over a network, on every job) would only save that one window's recomputation after a kill during the tail:
its local copy, written as every window's during the engine, goes and nothing is uploaded. A job of one window, most
of them, then keeps nothing and its tail joins nothing; a longer one killed mid-way still resumes from the windows
before its last. Where tails are held, its tail may wait its turn behind them for long, and be sent back (a stuck tail
ahead) or lost with its worker meanwhile, its engine done: the window is kept and the next attempt replays it, not
the whole GPU work of a job of one window. Decided at the commit, not as the job's head starts: a tail held then
(about a second's) has mostly ended by the time the engine is done.

The job's first attempt knows the prefix empty (`KeptPrefix`): it neither lists it nor starts it over, its marker goes
with its first window kept, and the job's end deletes the prefix only where a window was handed to the uploader. A job
of one window on an idle worker then sends no request for its windows at all; a retried attempt lists the prefix, so
a last window that an earlier attempt kept (its tail held) is replayed.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING

import numpy as np
import redis.exceptions
import torch

from storage.blobs import BlobStore, Progress, storage_unavailable, work_prefix
from storage.jobs import JobRecord, StaleAttempt
from worker.errors import Cancelled
from worker.media import lossless
from worker.media.reader import READING
from worker.sr.request import RunInfo
from worker.sr.windows import DirectoryWindowStore, StoredWindow, WindowRecorder
from worker.upscale import UpscaleOptions

if TYPE_CHECKING:
    from worker.sr.backends import Upscaler

log = logging.getLogger("vsrq.worker")

MARKER = DirectoryWindowStore.MARKER  # the key the windows were computed for
# A window's files in upload order: its frames (FFV1 in Matroska where that is smaller than the raw frames, `_pack`),
# its tail, then its JSON, which says it is complete, so it goes last (and is what `load` looks for).
PIXELS = ("mkv", "u8")
SUFFIXES = (*PIXELS, "tail.npy", "json")
# Raised by a transfer's heartbeat (Redis's error once the lease has run out): the attempt must stop
FATAL = (Cancelled, StaleAttempt, redis.exceptions.RedisError)
# What an attempt's end (`close`) gives the upload in flight: a store that answers lands a window in about that (see
# bench/RESULTS.md), so it is kept for a retry and lands before the job's end deletes the prefix; one that hangs holds
# the worker no longer than that, not each file's timeouts and retries
CLOSE_WAIT_S = 1.0
# Windows waiting for their upload (the one in flight included) past which a newly committed window is not kept: its
# local copy would add to the scratch disk's while the engine outruns storage
UPLOADS_BEHIND = 2
# How windows are kept, in their key: a worker from before tails were dropped once superseded would replay a window
# without its tail into a seam, so windows kept one way are never replayed by a worker keeping them another
LAYOUT = "tails dropped once superseded; frames as FFV1 where smaller"
# Windows an attempt's scratch holds at most: those waiting for their upload, the one being written, and one's FFV1
# copy as it is packed (`worker.scratch`)
WINDOWS_HELD = UPLOADS_BEHIND + 2


def windows_key(job: JobRecord, input_sha256: str, model: str, options: UpscaleOptions, upscaler: Upscaler) -> str:
    """What the kept windows were computed from: a window kept for other input bytes (a URL that served others this
    attempt, a referenced key written again), under another model, other options or an upscaler that gives other bits
    (`signature`: e.g. another decode segment, split or FP8 attention backend), frames read another way (`READING`:
    a worker from before interlaced frames were deinterlaced) or windows kept another way (`LAYOUT`) never replays.
    What gives the same bits (where the weights live, the decode order) is not in it: a requeued job keeps its
    windows on a worker that offloads."""
    signature = upscaler.signature(options.request)
    named = f"{job.id}\n{input_sha256}\n{model}\n{options!r}\n{signature}\n{READING}\n{LAYOUT}"
    return hashlib.sha256(named.encode()).hexdigest()


class KeptPrefix:
    """Whether the job's kept-windows prefix may hold anything, as one attempt knows it: what an earlier attempt kept
    (any attempt but the job's first), or what this attempt's store has handed to its uploader (`BlobWindowStore`,
    set as `store` once made). Where Redis lost acknowledged writes an attempt number repeats: a second first attempt
    neither replays nor deletes what the first kept, which the storage sweep deletes once the job has ended."""

    def __init__(self, attempt: int) -> None:
        self.earlier = attempt > 1
        self.store: BlobWindowStore | None = None

    def may_hold(self) -> bool:
        return self.earlier if self.store is None else self.store.may_hold()


class BlobWindowStore:
    def __init__(
        self,
        blobs: BlobStore,
        job_id: str,
        directory: Path,
        key: str,
        progress: Progress | None = None,
        kept_alive: Callable[[], AbstractContextManager[None]] = nullcontext,
        keep_last: Callable[[], bool] = lambda: False,
        earlier: bool = True,
        uploads_behind: int = UPLOADS_BEHIND,
    ) -> None:
        """`progress` is called as bytes move; `kept_alive` wraps each window's uploads (the attempt's lease must
        outlive an unanswered request); `keep_last`, asked as the job's last window is committed: whether it is kept
        too (see the module's docstring); `earlier`: whether an earlier attempt may have kept windows (`KeptPrefix`):
        where none can have, the prefix is not listed and its marker goes with the first window kept."""
        self.keep_last, self.earlier, self.uploads_behind = keep_last, earlier, uploads_behind
        windows = f"{work_prefix(job_id)}windows/"
        named = hashlib.sha256(key.encode()).hexdigest()[:16]  # any key, a safe blob name (`windows_key`'s: hex)
        self.blobs, self.prefix, self.progress = blobs, f"{windows}{named}/", progress
        self.kept_alive, self.directory = kept_alive, directory
        # its local copies go once uploaded: the tail a window supersedes goes from blob storage (`_keep`)
        self.local = DirectoryWindowStore(directory, key, drop_superseded_tails=False)
        self.uploads = _Uploader()
        self.uploading = False  # a file handed to the uploader: the prefix may hold it (`KeptPrefix`)
        self._marked = earlier  # the marker is in storage; uploaded with the first window where not
        self.listed: set[str] = set()  # the kept windows' files an earlier attempt left under this key
        self.stored: set[str] = set()  # the files this attempt uploaded
        if earlier:
            self._resume(windows)

    def _resume(self, windows: str) -> None:
        """Lists what an earlier attempt kept under this key (`load` downloads each); deletes other keys' windows."""
        names, older = set(), set()
        for blob in self.blobs.keys(windows):
            if blob.startswith(self.prefix):
                names.add(blob.removeprefix(self.prefix))
            else:  # another key's prefix ("{digits}/"), or a file of the layout before them
                name = blob.removeprefix(windows)
                older.add(name[: name.find("/") + 1] or name)
        for name in older:
            self.blobs.delete_prefix(windows + name)
        if MARKER in names and self._read(MARKER) == (self.directory / MARKER).read_bytes():
            self.listed = names  # downloaded as each window's turn comes (`load`)
        else:  # nothing kept under this key (or its marker says another key of the same digest): start it over
            self.blobs.delete_prefix(self.prefix)
            self._upload(self.directory / MARKER)

    def may_hold(self) -> bool:
        """Whether the prefix may hold windows: an earlier attempt's, or one this store handed to its uploader."""
        return self.earlier or self.uploading

    def load(self, index: int) -> StoredWindow | None:
        """The window an earlier attempt kept, downloaded now (files of one whose upload was cut short stay out); its
        local files go at once, the replay reading the pages it has open. A replay saves work, no more: a window that
        storage does not give (an outage, a file gone) is computed again."""
        path = partial(self.local._path, index)
        packed, raw, tail, meta = (path(suffix).name for suffix in SUFFIXES)
        pixels = next((name for name in (packed, raw) if name in self.listed), None)
        if pixels is None or meta not in self.listed:
            return None
        try:
            with self.kept_alive():  # the lease outlives a request that hangs
                for name in (pixels, tail, meta):
                    if name in self.listed:
                        self.blobs.download(self.prefix + name, self.directory / name, self.progress)
                if pixels == packed:
                    if (layout := self.local.frame_layout(index)) is None:  # not this store's writing: computed again
                        return None
                    lossless.expand(path("mkv"), *layout, path("u8"))
            return self.local.load(index)
        except FATAL:
            raise
        except Exception as error:
            if isinstance(wrapped := getattr(error, "kwargs", {}).get("error"), FATAL):  # the heartbeat's, in botocore
                raise wrapped from error
            log.warning("kept window %d not replayed: blob storage did not give it (%s)", index, error)
            return None
        finally:
            self.local.forget(index)

    def record(self, index: int, last: bool = False) -> WindowRecorder:
        return _UploadingRecorder(self, index, last)

    def drop(self) -> None:
        self.join()  # an upload in flight would land a window after the delete
        self.local.drop()
        self.listed = set()
        if not self.may_hold():  # nothing kept in storage
            return
        try:
            with self.kept_alive():
                self.blobs.delete_prefix(self.prefix)
                self._upload(self.directory / MARKER)
        except FATAL:
            raise
        except Exception as error:  # storage down: safe all the same, a later attempt replays no window made
            # otherwise than the ones before it (`upscale_windows`), and this attempt's windows replace them as kept
            _not_done("kept windows not dropped", error)

    def release_local(self) -> None:
        """Once the engine is done: every window is in the encoder, so what is left of the local raw copies (each goes
        once it is up) goes once the uploads queued before are done (not under one in flight), rather than when the
        tail ends; a held tail would keep them on the worker's disk. A later attempt reads blob storage, not these."""
        self.uploads.submit(self.local.clear, upload=False)

    def join(self) -> float:
        """Waits for the uploads committed so far; raises what stopped them (the attempt must stop), else returns
        their seconds on the uploader's thread."""
        self.uploads.wait()
        self.uploads.raise_if_failed()
        return self.uploads.upload_s

    def wait(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the uploads committed so far, raising nothing: whether they have ended."""
        return self.uploads.wait(timeout_s)

    def close(self) -> None:
        """The attempt's end, whatever ended it, raising nothing; after `join` (the success path) nothing is left. The
        uploads not begun are skipped, the one in flight gets `CLOSE_WAIT_S` and is then left to end with its request
        (an open file stays readable once deleted; a window whose JSON never lands never replays), and the local files
        go: the worker moves on to its next job even where storage no longer answers."""
        self.uploads.stop()
        if not self.uploads.wait(CLOSE_WAIT_S):  # storage that hangs: the request times out on the uploader's thread
            log.warning("a kept window's upload outlived its attempt by %g s: left to end on its own", CLOSE_WAIT_S)
        self.local.clear()

    def _keep(self, index: int, supersedes: bool) -> None:
        """Uploads a committed window's files, its JSON last: one cut short never replays. Once its JSON is up, the
        previous window's tail goes where `supersedes` says this window's replay makes it useless."""
        try:
            if self.uploads.stopped:  # the attempt has ended: `close` deletes the local files
                return
            self._pack(index)  # CPU work, before the keep-alive: its budget is for requests that hang
            with self.kept_alive():
                if not self._marked:  # the first window this job keeps (no earlier attempt): its key first
                    self._upload(self.directory / MARKER)
                    self._marked = True
                for suffix in SUFFIXES:
                    path = self.local._path(index, suffix)
                    if self.progress is not None:  # a cancel or a lost lease, seen before a request that may hang
                        self.progress(0)
                    if path.exists():  # no `tail.npy` for the job's last window (kept or not), nor any with no overlap
                        self._upload(path)
                        self.stored.add(path.name)
                # not where `close` deleted the JSON before its upload: the window is not kept, the tail still needed
                superseded, meta = self.local.superseded_tail(index), self.local._path(index, "json").name
                if supersedes and meta in self.stored and superseded in self.stored | self.listed:
                    self._delete(superseded)
        except FATAL:
            raise
        except Exception as error:
            # botocore wraps what the progress callback (the heartbeat) raised mid-request: still the attempt's end
            if isinstance(wrapped := getattr(error, "kwargs", {}).get("error"), FATAL):
                raise wrapped from error
            if isinstance(error, FileNotFoundError) and self.uploads.stopped:  # `close` deleted the local files
                log.info("window %d not kept: its attempt ended before its upload", index)
                return
            # storage down: the attempt goes on (its output upload waits it out); only a later attempt would recompute
            # this window
            _not_done(f"window {index} not kept", error)
        finally:
            self.local.forget(index)  # up or not, this attempt never reads it again: a later one reads blob storage

    def _pack(self, index: int) -> None:
        """The window's raw frames as FFV1 (`worker.media.lossless`), in their place where that is smaller: noise (a
        random checkpoint's output) is not. Raw where FFV1 fails: kept all the same."""
        raw, packed = self.local._path(index, "u8"), self.local._path(index, "mkv")
        try:
            if (layout := self.local.frame_layout(index)) is None:
                raise ValueError("its JSON does not say the frames' shape")
            lossless.compress(raw, *layout, packed)
        except Exception as error:
            if self.uploads.stopped or not raw.exists():  # the attempt has ended, `close` deleting its files (as
                # `_keep` looks for)
                raise FileNotFoundError(f"window {index}'s frames are gone") from error
            log.warning("window %d kept raw: its frames were not compressed", index, exc_info=True)
            packed.unlink(missing_ok=True)
            return
        (raw if packed.stat().st_size < raw.stat().st_size else packed).unlink()

    def _delete(self, name: str) -> None:
        """Deletes a file of the store's that no window needs any longer, if it is there; storage that fails leaves it
        for the job's end (it saves space, no more)."""
        try:
            self.blobs.delete(self.prefix + name)
            self.stored.discard(name)
            self.listed.discard(name)
        except Exception as error:
            log.info("%s left for the job's end: blob storage did not delete it (%s)", name, error)

    def _read(self, name: str) -> bytes:
        with self.blobs.open(self.prefix + name) as stream:
            return stream.read()

    def _upload(self, path: Path) -> None:
        with path.open("rb") as file:
            self.blobs.put(self.prefix + path.name, file, progress=self.progress)


def _not_done(what: str, error: Exception) -> None:
    """Logs what storage kept from happening: an outage in one line, as the reaper logs one (a dependency, not a bug:
    every window of a long outage meets it), any other error with its traceback."""
    if storage_unavailable(error):
        log.warning("%s: blob storage unavailable (%s: %s)", what, type(error).__name__, error)
    else:
        log.warning("%s: %s", what, error, exc_info=error)


class _UploadingRecorder:
    def __init__(self, store: BlobWindowStore, index: int, last: bool) -> None:
        self.store, self.index, self.last = store, index, last
        self.local = store.local.record(index)

    def add(self, pixels: np.ndarray) -> None:
        self.local.add(pixels)

    def commit(self, tail: torch.Tensor | None, made: RunInfo, supersedes: bool = True) -> None:
        self.store.uploads.raise_if_failed()  # an earlier window's upload found the attempt over
        if self.last and not self.store.keep_last():  # decided now, as the job's tail is handed over
            self.local.discard()
            return
        if (behind := self.store.uploads.behind()) >= self.store.uploads_behind:
            log.info("window %d not kept: %d windows still wait for their upload", self.index, behind)
            self.local.discard()
            return
        self.local.commit(tail, made, supersedes)
        self.store.uploading = True
        self.store.uploads.submit(partial(self.store._keep, self.index, supersedes))


class _Uploader:
    """Runs what it is handed in order, on one thread at a time that ends once nothing is left. What a task raised is
    kept for the attempt's thread (`raise_if_failed`), and the uploads after it are skipped, as are those not begun
    once `stop`ped (the attempt's end); other tasks (the local files' deletion) still run. No thread outlives the
    attempt's work but one whose request `close` stopped waiting for: it ends with that request, skipping the rest."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._pending: deque[tuple[Callable[[], None], bool]] = deque()
        self._running = False
        self._uploading = False  # the task in flight is an upload
        self._failed: BaseException | None = None
        self._stopped = False  # the attempt has ended: uploads not begun are skipped
        self.upload_s = 0.0  # the uploads' seconds, on the uploader's thread

    def behind(self) -> int:
        """Uploads handed over and not ended: waiting, and the one in flight."""
        with self._changed:
            return sum(upload for _, upload in self._pending) + self._uploading

    def submit(self, task: Callable[[], None], upload: bool = True) -> None:
        with self._changed:
            self._pending.append((task, upload))
            if not self._running:
                self._running = True
                # in the caller's context: its log lines keep the job id
                context = contextvars.copy_context()
                threading.Thread(target=context.run, args=(self._run,), name="vsrq-kept-upload", daemon=True).start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether the thread has ended (within `timeout_s`)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._running, timeout_s)

    def stop(self) -> None:
        with self._changed:
            self._stopped = True

    @property
    def stopped(self) -> bool:
        return self._stopped

    def raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _run(self) -> None:
        while True:
            with self._changed:
                if not self._pending:
                    self._running = False
                    self._changed.notify_all()
                    return
                task, upload = self._pending.popleft()
                skipped = upload and (self._failed is not None or self._stopped)
                self._uploading = upload and not skipped
            if skipped:
                continue
            started = perf_counter()
            try:
                task()
            except BaseException as error:  # the attempt's thread raises it
                self._failed = self._failed or error
            finally:
                self._uploading = False
                if upload:
                    self.upload_s += perf_counter() - started
