"""The worker's scratch disk: what a job writes to it at most, and whether the disk has that much left.

A job's scratch directory holds its input, its kept windows as raw RGB while its engine runs, and its MP4 until its
tail ends; a prefetched input (worker.prefetch) and the held tails' files (worker.finisher) share the disk with it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import av


def scratch_bytes(source: Path, scale: float) -> int:
    """What the running job (its input `source`, upscaled `scale` times) will write to its scratch disk at most: its
    upscaled frames as raw RGB (kept windows, the encoder's input) and an MP4 of its input's bits per pixel."""
    with av.open(str(source)) as container:
        stream = container.streams.video[0]
        frames = stream.frames
        if not frames:  # not in the header (a fragmented MP4, a Matroska file): from its duration
            seconds = float(stream.duration * stream.time_base) if stream.duration else container.duration / 1e6
            frames = round(seconds * float(stream.average_rate or stream.guessed_rate or 30))
        width, height = stream.codec_context.width, stream.codec_context.height
    pixels = scale * scale
    return round(frames * width * height * pixels * 3 + source.stat().st_size * pixels)


def has_room(directory: Path, need: int) -> bool:
    """Whether the disk of `directory` has `need` bytes free."""
    return shutil.disk_usage(directory).free >= need
