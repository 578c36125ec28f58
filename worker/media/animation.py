"""What an animated picture (GIF, animated PNG, animated WebP) declares before a frame of it is decoded: its canvas,
and its frames, counted by walking its blocks. A file of a few KB may declare a 65535x65535 canvas, which FFmpeg's
decoders refuse as bad data, or thousands of frames, each decoded on a 4K canvas: minutes of CPU before a limit
refused it. The probe checks the limits on this first (`probe._check_animation`)."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from worker.media.errors import stop_if_asked

PNG = b"\x89PNG\r\n\x1a\n"


class Declared(NamedTuple):
    width: int
    height: int
    frames: int  # those the file holds whole: a lower bound on what a decoder reads


def declared(path: Path, alive: Callable[[], bool] | None = None) -> Declared | None:
    """The animation `path` declares, or None for any other file (a still GIF is counted: one frame). The walk is
    Python's, slow over gigabytes of tiny blocks: `alive` (a job's heartbeat) is called every `BEAT_BYTES` of it."""
    with open(path, "rb") as file:
        head = file.read(32)
        if not (head[:6] in (b"GIF87a", b"GIF89a") or head[:8] == PNG or head[:4] + head[8:12] == b"RIFFWEBP"):
            return None
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            beat = _Beat(alive)
            try:
                walk = _gif if head[:3] == b"GIF" else _png if head[:8] == PNG else _webp
                return walk(data, beat)
            except (IndexError, struct.error):  # a header cut short: FFmpeg's or libwebp's own reading says so
                return None


BEAT_BYTES = 8 << 20


class _Beat:
    """Calls `alive` each time a walk passes another `BEAT_BYTES` of the file."""

    def __init__(self, alive: Callable[[], bool] | None) -> None:
        self.alive, self.next = alive, BEAT_BYTES

    def __call__(self, at: int) -> None:
        if at >= self.next:
            stop_if_asked(self.alive)
            self.next = at + BEAT_BYTES


def _gif(data: mmap.mmap, beat: _Beat) -> Declared:
    """The logical screen, which FFmpeg decodes every frame onto, and the image descriptors."""
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    at, frames = 13 + _colour_table(flags), 0
    while at < len(data):
        if data[at] == 0x2C:  # an image: its descriptor, its own colour table, the LZW code size, then its data
            at = _sub_blocks(data, at + 11 + _colour_table(data[at + 9]), beat)
            frames += at <= len(data)
        elif data[at] == 0x21:  # an extension: its label, then its data
            at = _sub_blocks(data, at + 2, beat)
        else:  # the trailer, or what no decoder reads on from
            break
    return Declared(width, height, frames)


def _colour_table(flags: int) -> int:
    """The bytes of the colour table a GIF's screen or image `flags` say follows."""
    return 3 * 2 ** ((flags & 7) + 1) if flags & 0x80 else 0


def _sub_blocks(data: mmap.mmap, at: int, beat: _Beat) -> int:
    """Where the GIF data sub-blocks starting at `at` end (past the end of `data` where it cuts them)."""
    while at < len(data) and data[at]:
        at += 1 + data[at]
        beat(at)
    return at + 1


def _png(data: mmap.mmap, beat: _Beat) -> Declared | None:
    """An animated PNG's IHDR size, and its frames: each frame control (fcTL) whose data follows whole. None for a
    still PNG (no acTL)."""
    at, size, animated, frames, framed = 8, (0, 0), False, 0, False
    while at + 12 <= len(data):
        beat(at)
        length, kind = struct.unpack_from(">I4s", data, at)
        if at + 12 + length > len(data):
            break
        if kind == b"IHDR":
            size = struct.unpack_from(">II", data, at + 8)
        elif kind == b"acTL":
            animated = True
        elif kind == b"fcTL":
            framed = True
        elif kind in (b"IDAT", b"fdAT"):  # a default image without an fcTL before it is no frame of the animation
            frames, framed = frames + framed, False
        elif kind == b"IEND":
            break
        at += 12 + length
    return Declared(*size, frames) if animated else None


def _webp(data: mmap.mmap, beat: _Beat) -> Declared | None:
    """An animated WebP's canvas (its VP8X header) and its frames (ANMF chunks). None for a still WebP."""
    if data[12:16] != b"VP8X" or not data[20] & 0x02:
        return None
    width, height = (1 + int.from_bytes(data[start : start + 3], "little") for start in (24, 27))
    at, frames = 12, 0
    while at + 8 <= len(data):
        beat(at)
        kind, length = struct.unpack_from("<4sI", data, at)
        if at + 8 + length > len(data):
            break
        frames += kind == b"ANMF"
        at += 8 + length + length % 2  # chunks are padded to an even size
    return Declared(width, height, frames)
