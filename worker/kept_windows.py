"""A job's finished windows, kept in blob storage so that the job's next attempt (retried, or requeued after its worker
died) replays them and computes only the missing ones.

A `DirectoryWindowStore` in the attempt's scratch directory, mirrored to work/{job_id}/windows/: the attempt first
downloads the windows kept so far, then uploads each window as it is committed; once the engine is done the local
copies go (`release_local`), the attempt's tail needing only the input and the MP4. The key is the job's, not the
attempt's; the job's end deletes the prefix (the reaper's sweep deletes what a crash left).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import redis.exceptions
import torch

from storage.blobs import BlobStore, Progress, work_prefix
from storage.jobs import JobRecord, StaleAttempt
from worker.errors import Cancelled
from worker.sr.request import RunInfo
from worker.sr.windows import DirectoryWindowStore, StoredWindow, WindowRecorder
from worker.upscale import UpscaleOptions

if TYPE_CHECKING:
    from worker.sr.backends import Upscaler

log = logging.getLogger("vsrq.worker")

MARKER = "job.json"  # DirectoryWindowStore's: the key the windows were computed for
# A window's files in upload order: its JSON says it is complete, so it goes last (and is what `_complete` looks for).
SUFFIXES = ("u8", "tail.npy", "json")


def windows_key(job: JobRecord, input_sha256: str, model: str, options: UpscaleOptions, upscaler: Upscaler) -> str:
    """What the kept windows were computed from: a window kept for other input bytes (a URL that served others this
    attempt, a referenced key written again), under another model, other options or an upscaler that gives other bits
    (`signature`: e.g. another decode segment, split or FP8 attention backend) never replays.
    What gives the same bits (where the weights live, the decode order) is not in it: a requeued job keeps its
    windows on a worker that offloads."""
    signature = upscaler.signature(options.request)
    return hashlib.sha256(f"{job.id}\n{input_sha256}\n{model}\n{options!r}\n{signature}".encode()).hexdigest()


class BlobWindowStore:
    def __init__(
        self,
        blobs: BlobStore,
        job_id: str,
        directory: Path,
        key: str,
        progress: Progress | None = None,
        kept_alive: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        """`progress` is called as bytes move; `kept_alive` wraps each window's uploads (the attempt's lease must
        outlive an unanswered request)."""
        self.blobs, self.prefix, self.progress = blobs, f"{work_prefix(job_id)}windows/", progress
        self.kept_alive, self.directory = kept_alive, directory
        self.local = DirectoryWindowStore(directory, key)
        names = {blob.removeprefix(self.prefix) for blob in blobs.keys(self.prefix)}
        if MARKER in names and self._read(MARKER) == (directory / MARKER).read_bytes():
            for name in sorted(names - {MARKER}):
                if f"{name.split('.', 1)[0]}.json" in names:  # files of windows whose upload was cut short stay out
                    blobs.download(self.prefix + name, directory / name, progress)
        else:  # nothing kept, or kept for another key: start the prefix over
            blobs.delete_prefix(self.prefix)
            self._upload(directory / MARKER)

    def load(self, index: int) -> StoredWindow | None:
        return self.local.load(index)

    def record(self, index: int) -> WindowRecorder:
        return _UploadingRecorder(self, index)

    def drop(self) -> None:
        self.local.drop()
        try:
            with self.kept_alive():
                self.blobs.delete_prefix(self.prefix)
                self._upload(self.directory / MARKER)
        except (Cancelled, StaleAttempt, redis.exceptions.RedisError):
            raise
        except Exception:  # storage down: safe all the same, a later attempt replays no window made otherwise than
            # the ones before it (`upscale_windows`), and this attempt's windows replace them as they are kept
            log.warning("kept windows not dropped: blob storage unavailable", exc_info=True)

    def release_local(self) -> None:
        """Once the engine is done: every window is in the encoder and, where storage answered, in blob storage (each
        uploaded as it was committed), so the local raw copies (as big as the raw output) go now rather than when the
        tail ends; a held tail would keep them on the worker's disk. A later attempt reads blob storage, not these."""
        self.local.clear()

    def _read(self, name: str) -> bytes:
        with self.blobs.open(self.prefix + name) as stream:
            return stream.read()

    def _upload(self, path: Path) -> None:
        with path.open("rb") as file:
            self.blobs.put(self.prefix + path.name, file, progress=self.progress)


class _UploadingRecorder:
    def __init__(self, store: BlobWindowStore, index: int) -> None:
        self.store, self.index = store, index
        self.local = store.local.record(index)

    def add(self, pixels: np.ndarray) -> None:
        self.local.add(pixels)

    def commit(self, tail: torch.Tensor | None, made: RunInfo) -> None:
        self.local.commit(tail, made)
        try:
            with self.store.kept_alive():
                for suffix in SUFFIXES:
                    path = self.store.local._path(self.index, suffix)
                    if path.exists():  # the last window has no tail
                        self.store._upload(path)
        # Raised by the transfer's heartbeat (Redis's error once the lease has run out): the attempt must stop
        except (Cancelled, StaleAttempt, redis.exceptions.RedisError):
            raise
        except Exception:  # storage down: the attempt goes on (its output upload waits it out); only a later attempt
            # would recompute this window
            log.warning("window %d not kept: blob storage unavailable", self.index, exc_info=True)
