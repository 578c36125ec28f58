"""The worker's scratch disk: its directories, what a job writes to it at most, and whether the disk has that much
left.

Each directory a worker makes there (a job's scratch, its prefetch cache) is held for its life (`storage.held_dirs`): a
dead worker's is removed by the next one made with its prefix.

A job's scratch directory holds its input, its kept windows while its engine runs, and its MP4 until its tail ends; a
prefetched input (worker.prefetch) and the held tails' files (worker.finisher) share the disk with it.

Its peak is as the engine commits the last window: every window's frames as raw RGB are on disk then, also where the
last is not kept (worker.kept_windows: its frames are written as they come and go only at its commit), with the float
overlap tail of every window but the last (`tail.npy`, 4 bytes a sample: a window's 16 overlap frames weigh 64 raw
frames) and the MP4 encoded so far.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import av

from storage.held_dirs import held_directory, release
from worker.media import webp
from worker.media.source import fragmented, open_input
from worker.sr.windows import DEFAULT_WINDOW, overlap_for, window_count

JOB_PREFIX = "vsrq-job-"  # a job's scratch directory


@contextmanager
def job_scratch(root: Path | None = None) -> Iterator[Path]:
    """A job's scratch directory, removed when it ends, or by the next job's where its worker was killed."""
    directory, held = held_directory(JOB_PREFIX, root)
    try:
        yield directory
    finally:
        release(directory, held)


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
