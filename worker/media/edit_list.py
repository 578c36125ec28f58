"""MP4 edit lists FFmpeg's muxer cannot write: a track that starts late (an empty edit) and skips its encoder's
priming too. Apple's own AAC files carry the same two entries; FFmpeg's demuxer, browsers and QuickTime read them.

The written file's `elst` boxes are rewritten in place (same sizes), after the muxer has closed it (the boxes are
walked by worker.media.mp4_boxes): the change is two fields.
"""

from __future__ import annotations

import struct
from pathlib import Path

from worker.media.mp4_boxes import children, movie_timescale, top_level


def skip(path: str | Path, edits: list[tuple[int, int]]) -> None:
    """For each (track ID, samples): make the track's media edit start `samples` (in its media's time scale: the
    sample rate) later and last as much less. The muxer wrote the packets that much later, so an empty edit still
    ends where the first real sample is due."""
    if not edits:
        return
    wanted = dict(edits)
    with open(path, "r+b") as handle:
        moov = next((box for box in top_level(handle, 0, handle.seek(0, 2)) if box[0] == b"moov"), None)
        if moov is None:
            raise ValueError(f"{Path(path).name} has no moov box")
        _, start, end = moov
        handle.seek(start)
        data = bytearray(handle.read(end - start))
        movie_scale = movie_timescale(data)
        for trak in children(data, 0, len(data), b"trak"):
            track = _track_id(data, trak)
            if track in wanted:
                _shift(data, trak, wanted.pop(track), movie_scale)
        if wanted:
            raise ValueError(f"{Path(path).name} has no edit list for track(s) {sorted(wanted)}")
        handle.seek(start)
        handle.write(data)


def _track_id(data: bytearray, trak: tuple[int, int, int]) -> int:
    _, payload, _ = next(children(data, trak[1], trak[2], b"tkhd"))
    version = data[payload]
    return struct.unpack_from(">I", data, payload + (20 if version == 1 else 12))[0]


def _shift(data: bytearray, trak: tuple[int, int, int], samples: int, movie_scale: int) -> None:
    _, mdhd, _ = next(children(data, trak[1], trak[2], b"mdhd"))
    media_scale = struct.unpack_from(">I", data, mdhd + (20 if data[mdhd] == 1 else 12))[0]
    elst = next(children(data, trak[1], trak[2], b"elst"), None)
    if elst is None:
        raise ValueError("the track has no edit list")
    _, payload, _ = elst
    version = data[payload]
    entry, fields = (20, ">Qq") if version == 1 else (12, ">Ii")
    count = struct.unpack_from(">I", data, payload + 4)[0]
    for number in range(count):
        offset = payload + 8 + number * entry
        duration, media_time = struct.unpack_from(fields, data, offset)
        if media_time == -1:
            continue  # the empty edit: the delay before the track starts
        shorter = round(samples * movie_scale / media_scale)
        struct.pack_into(fields, data, offset, max(0, duration - shorter), media_time + samples)
        return
    raise ValueError("the track's edit list has no media edit")
