"""Animated WebP, the web's GIF (Giphy's and Tenor's downloads, chat apps' stickers). FFmpeg's WebP decoder reads
still pictures only: an animated one was refused as "a still image". libwebp's animation decoder, which Pillow
wraps (already the worker's, for previews), composites each frame on its canvas as browsers show it; the probe and
the reader take its frames from here, the rest of the job is as for any other source."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from worker.media.errors import InputCorrupt, InputTooLarge, InputTooShort, stop_if_asked
from worker.media.limits import Limits

TIME_BASE = Fraction(1, 1000)  # WebP times frames in milliseconds
# Browsers show a frame timed 10 ms or less for 100 ms (Chromium's and Firefox's rule for every animated image
# format, and FFmpeg's for GIF): animators write 0 for "as fast as possible"
SHORTEST_MS, SHOWN_MS = 10, 100


def animated(path: str | Path) -> bool:
    """Whether `path` is an animated WebP: a RIFF WEBP file whose extended header (VP8X) sets the animation flag."""
    try:
        with open(path, "rb") as file:
            head = file.read(21)
    except OSError:
        return False
    return len(head) == 21 and head[:4] == b"RIFF" and head[8:16] == b"WEBPVP8X" and bool(head[20] & 0x02)


def extent(path: Path) -> tuple[tuple[int, int], int]:
    """((width, height), frames), read from the file's chunks: no frame is decoded beyond the one Pillow decodes at
    open."""
    with Image.open(path) as image:
        return image.size, image.n_frames


def frame_times(
    path: Path, limits: Limits, alive: Callable[[], bool] | None = None
) -> tuple[tuple[int, int], list[int], int]:
    """((width, height), each frame's start in milliseconds, how long the last one is shown), limits checked before
    a frame is decoded beyond the one Pillow decodes at open (the canvas the file declares, before Pillow opens it:
    the probe's, `animation.declared`)."""
    try:
        with Image.open(path) as image:
            size, count = image.size, image.n_frames
            (width, height), least = size, limits.min_frames
            _check_pixels(path, width, height, limits)
            if limits.max_frames is not None and count > limits.max_frames:
                raise InputTooLarge(f"{path.name} has more than {limits.max_frames} frames, the limit")
            if count < least:
                raise InputTooShort(f"{path.name} has {count} frame(s): a still image, not a video (at least {least})")
            starts, shown = [], 0
            for index in range(count):
                stop_if_asked(alive)  # every frame is decoded on its canvas: minutes for thousands on a 4K one
                image.seek(index)
                image.load()  # its timing comes with its pixels: Pillow's WebP reader gives no other way
                starts.append(shown)
                shown += _shown(image.info.get("duration", 0))
    except Image.DecompressionBombError as error:  # a canvas under the limits never meets it
        raise InputTooLarge(f"{path.name}: its canvas is too large to decode ({error})") from None
    except (OSError, UnidentifiedImageError, EOFError, ValueError) as error:
        raise InputCorrupt(f"{path.name}: its animation cannot be read ({error})") from None
    return size, starts, shown - starts[-1]


def _check_pixels(path: Path, width: int, height: int, limits: Limits) -> None:
    if limits.max_pixels is not None and width * height > limits.max_pixels:
        limit = limits.max_pixels / 1e6
        raise InputTooLarge(f"{path.name} is {width}x{height}; the limit is {limit:.1f} Mpx per frame")


def read(path: Path) -> Iterator[np.ndarray]:
    """Every frame, (H, W, 4) uint8 RGBA, composited on the animation's canvas."""
    try:
        with Image.open(path) as image:
            for index in range(image.n_frames):
                image.seek(index)
                yield np.asarray(image.convert("RGBA"))
    except (OSError, EOFError, ValueError) as error:
        raise InputCorrupt(f"{path.name}: decoding its animation failed ({error})") from None


def _shown(milliseconds: int) -> int:
    return SHOWN_MS if milliseconds <= SHORTEST_MS else milliseconds
