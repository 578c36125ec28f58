"""What an MP4's or MOV's timecode track (tmcd) counts at: FFmpeg reads it into the timecode's text, PyAV shows only
the text.

A timecode names a frame, HH:MM:SS:FF, counted at its track's own number of frames a second (drop-frame flagged).
FFmpeg's MP4 muxer writes the output's again from the text, counted at the output video's rate: where that counts
otherwise (a variable-rate clip's average rate, not the camera's 30), the text names another time, or with frames
past that count another text altogether (01:00:00:25 at 30 came out 01:00:01:05 at 20). `recount` gives the text
that names the source's time at the output's count; drop-frame at another count is left out
(worker.media.passthrough).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from worker.media.mp4_boxes import children, movie, track_id

_DROP_FRAME = 0x1  # the tmcd sample description's flags


@dataclass(frozen=True)
class Count:
    frames: int  # a second's frames it counts: 30 for 29.97 video
    drop_frame: bool


def output_count(fps: Fraction) -> int:
    """The frames a second FFmpeg's muxer counts an output's timecode at: the video's rate rounded, half up."""
    return (fps.numerator + fps.denominator // 2) // fps.denominator


def recount(text: str, count: Count, fps: Fraction) -> str | None:
    """`text`, a timecode counted `count`, as the text that names the same time (to the nearest frame) counted at
    the output's rate: itself where the counts agree (or it is no timecode's text: the muxer's to refuse), None for
    drop-frame at another count (its frames skip labels by rules of their own)."""
    counted = output_count(fps)
    match = re.fullmatch(r"(\d+):(\d+):(\d+)[:;.](\d+)", text)
    if counted == count.frames or match is None or counted <= 0:
        return text
    if count.drop_frame:
        return None
    hours, minutes, seconds, frames = map(int, match.groups())
    total = ((hours * 60 + minutes) * 60 + seconds) * counted + round(frames * counted / count.frames)
    seconds, frames = divmod(total, counted)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    digits = 2 if counted <= 100 else len(str(counted - 1))  # as FFmpeg writes the frames
    return f"{hours % 24:02d}:{minutes:02d}:{seconds:02d}:{frames:0{digits}d}"


def timecode_counts(path: str | Path) -> dict[int, Count]:
    """Track ID -> its count, for each timecode track of the file; {} where it has none, or no moov box to read."""
    try:
        return _counts(movie(path))
    except struct.error:  # a box cut short: no counts, so the timecode is written as its text, as before
        return {}


def _counts(data: bytes) -> dict[int, Count]:
    counts = {}
    for _, trak, trak_end in children(data, 8, len(data), b"trak"):
        track = track_id(data, trak, trak_end)
        stsd = next(children(data, trak, trak_end, b"stsd"), None)
        if track is None or stsd is None or stsd[2] - stsd[1] < 24:
            continue
        entry = stsd[1] + 8  # after the version, flags and entry count
        size, kind = struct.unpack_from(">I4s", data, entry)
        if kind != b"tmcd" or size < 34 or entry + 34 > stsd[2]:
            continue
        # the entry's 8-byte header, 6 reserved bytes and its data reference, 4 reserved bytes; then these
        flags, timescale, duration, frames = struct.unpack_from(">IIIB", data, entry + 20)
        if not frames and duration:
            frames = output_count(Fraction(timescale, duration))
        if frames:
            counts[track] = Count(frames, bool(flags & _DROP_FRAME))
    return counts
