"""An MP4's (ISO BMFF) boxes, walked for the few fields PyAV does not expose: the edit lists vsrq patches
(worker.media.edit_list), the timecode tracks' counts it reads (worker.media.timecode), the chapter tracks, the
sample descriptions' extra layers and protection. No Python MP4 library both reads FFmpeg's 64-bit boxes and edits
a box in place, and the walk is twenty lines."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import BinaryIO

# Boxes on the way from a movie to the ones read: its tracks, their edit lists, media, and sample descriptions
CONTAINERS = {b"moov", b"trak", b"edts", b"mdia", b"minf", b"stbl"}


def top_level(handle: BinaryIO, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(type, start, end) of the boxes between two file offsets, one after another."""
    position = start
    while position + 8 <= end:
        handle.seek(position)
        size, kind = struct.unpack(">I4s", handle.read(8))
        if size == 1:
            size = struct.unpack(">Q", handle.read(8))[0]
        elif size == 0:
            size = end - position
        if size < 8:
            return
        yield kind, position, position + size
        position += size


def movie(path: str | Path) -> bytes:
    """The file's moov box whole (its header too: its boxes start at 8), or b"" where it has none or it is cut."""
    with open(path, "rb") as handle:
        try:
            moov = next((box for box in top_level(handle, 0, handle.seek(0, 2)) if box[0] == b"moov"), None)
        except struct.error:  # a box header cut short
            return b""
        if moov is None:
            return b""
        _, start, end = moov
        handle.seek(start)
        data = handle.read(end - start)
    return data if len(data) == end - start else b""


def children(data: bytes | bytearray, start: int, end: int, kind: bytes) -> Iterator[tuple[int, int, int]]:
    """(start, payload start, end) of every `kind` box inside [start, end), descending into the containers."""
    position = start
    while position + 8 <= end:
        size, box = struct.unpack_from(">I4s", data, position)
        header = 8
        if size == 1:
            if position + 16 > end:  # its 64-bit size cut short: nothing more to read here (FFmpeg reads on)
                return
            size, header = struct.unpack_from(">Q", data, position + 8)[0], 16
        elif size == 0:
            size = end - position
        if size < header or position + size > end:
            return
        if box == kind:
            yield position, position + header, position + size
        elif box in CONTAINERS:
            yield from children(data, position + header, position + size, kind)
        position += size


def track_id(data: bytes | bytearray, trak: int, end: int) -> int | None:
    """The ID of the track whose trak box spans [trak, end) of `data` (its tkhd's), or None without a tkhd."""
    tkhd = next(children(data, trak, end, b"tkhd"), None)
    if tkhd is None:
        return None
    return struct.unpack_from(">I", data, tkhd[1] + (20 if data[tkhd[1]] == 1 else 12))[0]  # after version 1's times


def chapter_tracks(data: bytes | bytearray) -> set[int]:
    """The IDs of the tracks a movie's tracks name as their chapters (`tref`'s `chap`: QuickTime's chapter track,
    a text track whose samples are the chapters' titles, which FFmpeg reads as the file's chapters)."""
    found: set[int] = set()
    for _, payload, end in children(data, 8, len(data), b"tref"):
        position = payload
        while position + 8 <= end:
            size, kind = struct.unpack_from(">I4s", data, position)
            if size < 8 or position + size > end:
                break
            if kind == b"chap":
                found.update(struct.unpack_from(f">{(size - 8) // 4}I", data, position + 8))
            position += size
    return found


def presented(data: bytes | bytearray, track: int) -> Fraction | None:
    """Seconds of the track's media its edit list shows (its edits that are not empty, summed), or None where it has
    none, or an edit plays at another rate: how long a player shows the track, its last frame included."""
    timescale = movie_timescale(data)
    for trak, _, end in children(data, 8, len(data), b"trak"):
        if track_id(data, trak, end) != track:
            continue
        elst = next(children(data, trak, end, b"elst"), None)
        if elst is None or not timescale:
            return None
        version, (count,) = data[elst[1]], struct.unpack_from(">I", data, elst[1] + 4)
        entry, layout = (20, ">QqhH") if version == 1 else (12, ">IihH")
        count = min(count, (elst[2] - elst[1] - 8) // entry)  # a damaged count reads no box beyond its own
        shown = 0
        for index in range(count):
            duration, media_time, rate, _ = struct.unpack_from(layout, data, elst[1] + 8 + index * entry)
            if media_time == -1:  # an empty edit: the track starts later
                continue
            if rate != 1:
                return None
            shown += duration
        return Fraction(shown, timescale)
    return None


def movie_timescale(data: bytes | bytearray) -> int:
    """The movie header's (mvhd) units a second, in which edit lists count; 0 without one."""
    mvhd = next(children(data, 8, len(data), b"mvhd"), None)
    if mvhd is None:
        return 0
    return struct.unpack_from(">I", data, mvhd[1] + (20 if data[mvhd[1]] == 1 else 12))[0]
