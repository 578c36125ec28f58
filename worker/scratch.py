"""The worker's scratch disk: its directories, what a job writes to it at most, and whether the disk has that much
left.

Each directory a worker makes there (a job's scratch, its prefetch cache) is held for its life by a lock file its
process flock's: one nobody holds is a dead process's (`kill -9`, the OOM killer), and the next directory made with its
prefix removes it. A killed worker's job scratch held its input and raw frames, gigabytes at real sizes, until the
disk filled. flock, not a PID: it works across PID namespaces sharing the volume, where a PID says nothing.

A job's scratch directory holds its input, its kept windows while its engine runs, and its MP4 until its tail ends; a
prefetched input (worker.prefetch) and the held tails' files (worker.finisher) share the disk with it.

Its peak is as the engine commits the last window: every window's frames as raw RGB are on disk then, also where the
last is not kept (worker.kept_windows: its frames are written as they come and go only at its commit), with the float
overlap tail of every window but the last (`tail.npy`, 4 bytes a sample: a window's 16 overlap frames weigh 64 raw
frames) and the MP4 encoded so far.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import av

from worker.media import webp
from worker.media.source import fragmented, open_input
from worker.sr.windows import DEFAULT_WINDOW, overlap_for, window_count

JOB_PREFIX = "vsrq-job-"  # a job's scratch directory
_LOCK = "lock"  # flock'ed by the directory's process for its life
_GRACE_S = 60  # a hidden directory younger than this may be being made


def held_directory(prefix: str, root: Path | None = None) -> tuple[Path, int]:
    """A new directory named `prefix`… under `root` (the temporary directory), and the descriptor of its lock file,
    flock'ed: the directory is this process's while the descriptor stays open. Dead processes' directories of the
    same prefix are removed first. It is made under a hidden name and shown once locked, so that a sweep never sees
    a live one unlocked (its lock file made, not yet locked: a sweep in between deleted a live job's scratch)."""
    root = root or Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{prefix}*"):
        if _abandoned(stale):
            shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f".{prefix}*"):  # its process killed before it showed it
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > _GRACE_S:
                shutil.rmtree(stale, ignore_errors=True)
    hidden = Path(tempfile.mkdtemp(prefix=f".{prefix}", dir=root))
    held = os.open(hidden / _LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    directory = hidden.with_name(hidden.name[1:])
    hidden.rename(directory)
    return directory, held


def release(directory: Path, held: int) -> None:
    """Removes a `held_directory` and lets go of it."""
    shutil.rmtree(directory, ignore_errors=True)
    os.close(held)


@contextmanager
def job_scratch(root: Path | None = None) -> Iterator[Path]:
    """A job's scratch directory, removed when it ends, or by the next job's where its worker was killed."""
    directory, held = held_directory(JOB_PREFIX, root)
    try:
        yield directory
    finally:
        release(directory, held)


def _abandoned(directory: Path) -> bool:
    """Whether a held directory is a dead process's: this user's, and its lock file held by no process."""
    try:
        if directory.stat().st_uid != os.geteuid():
            return False
        handle = os.open(directory / _LOCK, os.O_RDWR)
    except FileNotFoundError:  # none: made before lock files were (or gone already)
        return directory.exists()
    except OSError:
        return False
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # its process is alive
        return False
    finally:
        os.close(handle)
    return True


def scratch_bytes(
    source: Path,
    scale: float,
    window: int = DEFAULT_WINDOW,
    overlap: int | None = None,
    max_frames: int | None = None,
    windows_held: int | None = None,
) -> int:
    """What the running job (its input `source`, upscaled `scale` times in temporal windows of `window` frames that
    overlap by `overlap`) will write to its scratch disk at most: its upscaled frames as raw RGB (kept windows, the
    encoder's input) and its windows' float overlap tails, of `windows_held` windows at once (None: every window, as
    `vsrq upscale --keep-windows` keeps them, and two tails), and an MP4 of its input's bits per pixel. Read from
    the header alone, before the probe: at most `max_frames` (the probe refuses more)."""
    if webp.animated(source):  # FFmpeg reads its first frame only
        (width, height), frames = webp.extent(source)
    else:
        with open_input(source) as container:
            stream = container.streams.video[0]
            frames = stream.frames or _frames_from_duration(container, stream)
            width, height = stream.codec_context.width, stream.codec_context.height
    frames = min(frames, max_frames) if max_frames else frames
    pixels = scale * scale
    overlap = overlap_for(window, overlap)
    count = window_count(frames, window, overlap)
    held = count if windows_held is None else min(count, windows_held)
    # a store's windows held include one's FFV1 copy as it is packed, beside every window of a short job
    raw = frames if windows_held is None else min(frames + window, windows_held * window)
    # float32, 4 bytes a sample; a folder of every window drops a window's tail as the next is kept (as it commits, two)
    tails = min(count - 1, held if windows_held is not None else 2) * overlap * 4
    return round((raw + tails) * width * height * pixels * 3 + source.stat().st_size * pixels)


def _frames_from_duration(container: av.container.InputContainer, stream: av.VideoStream) -> int:
    """Frames a header without a count (a fragmented MP4, Matroska, MPEG-TS) implies by its duration. A fragmented
    MP4's is counted from 0, not from its first frame (`source.fragmented`): a live stream's segments start at
    wall-clock times (1,685,548,363 s), which read as a duration were 5e10 frames."""
    if stream.duration:
        seconds = float(stream.duration * stream.time_base)
        if fragmented(container, stream) and stream.start_time:
            seconds -= float(stream.start_time * stream.time_base)
    else:
        seconds = (container.duration or 0) / 1e6
    return max(1, round(seconds * float(stream.average_rate or stream.guessed_rate or 30)))


def has_room(directory: Path, need: int) -> bool:
    """Whether the disk of `directory` has `need` bytes free."""
    return shutil.disk_usage(directory).free >= need
