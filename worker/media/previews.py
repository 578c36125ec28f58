"""A poster frame and a sprite sheet of a finished MP4, as JPEGs: what `GET /v1/videos/{id}/content?variant=thumbnail`
and `?variant=spritesheet` serve (OpenAI's download variants).

The frames are taken as the encoder gets them (`PreviewFrames`), shrunk at once: the tail only writes two JPEGs. An
output whose frames were not all taken is decoded front to back once, converting only the frames kept: exact frames
for any frame rate (variable ones included). Seeking would decode as much or more for the short GOP-long clips most
jobs are, and lands on keyframes, not the frames asked for.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
from PIL import Image

POSTER_MAX_SIDE = 1280  # a poster for a page or a list, not a second copy of a 4K frame
SPRITE_FRAMES = 25  # at most; a shorter video shows each of its frames once
SPRITE_COLUMNS = 5
SPRITE_CELL_WIDTH = 256  # at most: a small video's cells keep its own width
JPEG_QUALITY = 85
# Frames taken as they are encoded are first reduced by whole factors (a box filter) to within this of their size,
# then resampled: 2.0 is what Pillow calls indistinguishable from a full Lanczos, in a fraction of its time.
REDUCING_GAP = 2.0


@dataclass(frozen=True)
class Previews:
    thumbnail: Path
    spritesheet: Path
    sprite_frames: int


def make_previews(video: Path, frames: int, directory: Path) -> Previews:
    """Writes `thumbnail.jpg` (the middle frame: past a fade-in, before a fade-out) and `spritesheet.jpg` (up to
    SPRITE_FRAMES frames evenly spread over the video, SPRITE_COLUMNS to a row, in order) into `directory`, decoding
    `video`: for an output whose frames were not taken as they were encoded (`PreviewFrames`)."""
    sprite_indices, poster_index = _picks(frames)
    wanted = set(sprite_indices) | {poster_index}
    kept: dict[int, Image.Image] = {}
    with av.open(str(video)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for index, frame in enumerate(container.decode(stream)):
            if index in wanted:
                kept[index] = frame.to_image()  # RGB, the display size
            if index >= max(wanted):
                break
    sprite_indices = [index for index in sprite_indices if index in kept]  # a file shorter than its count
    if not sprite_indices:
        raise ValueError(f"{video} decoded no frames")
    poster = kept.get(poster_index) or kept[sprite_indices[len(sprite_indices) // 2]]
    cell = _cell_size(*kept[sprite_indices[0]].size)
    cells = [kept[index].resize(cell, Image.LANCZOS) for index in sprite_indices]
    return _write(_shrunk(poster, POSTER_MAX_SIDE / max(poster.size)), cells, directory)


class PreviewFrames:
    """The previews' frames taken as the encoder gets them (`take`, from the writer's thread) and shrunk on a thread
    of their own, beside x264: the tail then writes two JPEGs instead of decoding the whole output again (W1: 121
    frames at 1536x1024). Pixels are the RGB frames the encoder was given, not the decoded MP4's. A frame it could
    not take leaves it incomplete, and the tail decodes the output as before (`make_previews`)."""

    def __init__(self, frames: int) -> None:
        self.frames = frames
        self._sprite, self._poster_index = _picks(frames) if frames >= 1 else ([], -1)
        self._wanted = set(self._sprite) | {self._poster_index}
        self._cells: dict[int, Image.Image] = {}
        self._poster: Image.Image | None = None
        self._pending: list[Future] = []
        self.error: BaseException | None = None  # the first frame it failed to take

    def take(self, index: int, pixels: np.ndarray) -> None:
        """Frame `index` of the output, (H, W, 3) uint8 RGB, never written to afterwards (the encoder's batch). Never
        raises: a preview must not fail the encoding."""
        if index in self._wanted and self.error is None:
            try:
                self._pending.append(_SHRINKER.submit(self._shrink, index, pixels))
            except Exception as error:  # an interpreter shutting down
                self.error = error

    def _shrink(self, index: int, pixels: np.ndarray) -> None:
        try:
            image = Image.fromarray(pixels)
            if index == self._poster_index:
                self._poster = _shrunk(image, POSTER_MAX_SIDE / max(image.size), REDUCING_GAP)
            if index in self._sprite:
                self._cells[index] = image.resize(_cell_size(*image.size), Image.LANCZOS, reducing_gap=REDUCING_GAP)
        except Exception as error:
            self.error = self.error or error

    def complete(self) -> bool:
        """Whether every frame was taken, once those still shrinking are done."""
        wait(self._pending)
        return self.error is None and self._poster is not None and len(self._cells) == len(self._sprite) > 0

    def write(self, directory: Path) -> Previews:
        if not self.complete():
            raise ValueError(f"the previews' frames were not all taken ({self.error or 'frames missing'})")
        return _write(self._poster, [self._cells[index] for index in self._sprite], directory)


# One thread for the process, shared by every job's frames (a held tail's and the next job's alike): Pillow's
# resampling releases the GIL, so it runs beside x264 instead of delaying it.
_SHRINKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vsrq-previews")


def _picks(frames: int) -> tuple[list[int], int]:
    """The sprite sheet's frame indices, in order, and the poster's."""
    if frames < 1:
        raise ValueError("a video without frames has no previews")
    count = min(SPRITE_FRAMES, frames)
    sprite_indices = sorted({round(i * (frames - 1) / max(count - 1, 1)) for i in range(count)})
    return sprite_indices, (frames - 1) // 2


def _cell_size(width: int, height: int) -> tuple[int, int]:
    cell_width = min(SPRITE_CELL_WIDTH, width)
    return cell_width, max(1, round(height * cell_width / width))


def _write(poster: Image.Image, cells: list[Image.Image], directory: Path) -> Previews:
    """The poster (already shrunk) and the sheet of `cells` (each one cell), as JPEGs in `directory`."""
    thumbnail = directory / "thumbnail.jpg"
    poster.save(thumbnail, "JPEG", quality=JPEG_QUALITY)
    cell_width, cell_height = cells[0].size
    columns = min(SPRITE_COLUMNS, len(cells))
    rows = math.ceil(len(cells) / columns)
    sheet = Image.new("RGB", (columns * cell_width, rows * cell_height))
    for n, cell in enumerate(cells):
        sheet.paste(cell, ((n % columns) * cell_width, (n // columns) * cell_height))
    spritesheet = directory / "spritesheet.jpg"
    sheet.save(spritesheet, "JPEG", quality=JPEG_QUALITY)
    return Previews(thumbnail, spritesheet, len(cells))


def _shrunk(image: Image.Image, factor: float, reducing_gap: float | None = None) -> Image.Image:
    if factor >= 1:
        return image.copy()  # not a view of the encoder's batch, which it would keep alive
    size = (max(1, round(image.width * factor)), max(1, round(image.height * factor)))
    return image.resize(size, Image.LANCZOS, reducing_gap=reducing_gap)
