"""A poster frame and a sprite sheet of a finished MP4, as JPEGs: what `GET /v1/videos/{id}/content?variant=thumbnail`
and `?variant=spritesheet` serve (OpenAI's download variants).

The output is decoded front to back once, converting only the frames kept: exact frames for any frame rate (variable
ones included), at a cost that is small beside the upscaling that made the file. Seeking would decode as much or more
for the short GOP-long clips most jobs are, and lands on keyframes, not the frames asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import av
from PIL import Image

POSTER_MAX_SIDE = 1280  # a poster for a page or a list, not a second copy of a 4K frame
SPRITE_FRAMES = 25  # at most; a shorter video shows each of its frames once
SPRITE_COLUMNS = 5
SPRITE_CELL_WIDTH = 256  # at most: a small video's cells keep its own width
JPEG_QUALITY = 85


@dataclass(frozen=True)
class Previews:
    thumbnail: Path
    spritesheet: Path
    sprite_frames: int


def make_previews(video: Path, frames: int, directory: Path) -> Previews:
    """Writes `thumbnail.jpg` (the middle frame: past a fade-in, before a fade-out) and `spritesheet.jpg` (up to
    SPRITE_FRAMES frames evenly spread over the video, SPRITE_COLUMNS to a row, in order) into `directory`."""
    if frames < 1:
        raise ValueError("a video without frames has no previews")
    count = min(SPRITE_FRAMES, frames)
    sprite_indices = sorted({round(i * (frames - 1) / max(count - 1, 1)) for i in range(count)})
    poster_index = (frames - 1) // 2
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

    thumbnail = directory / "thumbnail.jpg"
    _shrunk(poster, POSTER_MAX_SIDE / max(poster.size)).save(thumbnail, "JPEG", quality=JPEG_QUALITY)

    first = kept[sprite_indices[0]]
    cell_width = min(SPRITE_CELL_WIDTH, first.width)
    cell_height = max(1, round(first.height * cell_width / first.width))
    columns = min(SPRITE_COLUMNS, len(sprite_indices))
    rows = math.ceil(len(sprite_indices) / columns)
    sheet = Image.new("RGB", (columns * cell_width, rows * cell_height))
    for n, index in enumerate(sprite_indices):
        cell = kept[index].resize((cell_width, cell_height), Image.LANCZOS)
        sheet.paste(cell, ((n % columns) * cell_width, (n // columns) * cell_height))
    spritesheet = directory / "spritesheet.jpg"
    sheet.save(spritesheet, "JPEG", quality=JPEG_QUALITY)
    return Previews(thumbnail, spritesheet, len(sprite_indices))


def _shrunk(image: Image.Image, factor: float) -> Image.Image:
    if factor >= 1:
        return image
    return image.resize((max(1, round(image.width * factor)), max(1, round(image.height * factor))), Image.LANCZOS)
