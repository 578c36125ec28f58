"""An animated AVIF's transparency: a track of its own beside the colour track, as libavif and GPAC write it (HEIF's
auxiliary track: an `auxl` reference to the colour track, `auxi` naming it alpha). FFmpeg reads it as one more video
stream and joins nothing, so a transparent pixel showed the colour stored under it. The reader takes each colour
frame's alpha from the frame of this track at the same place, as libavif does."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np

from worker.media.mp4_boxes import children, movie, track_id
from worker.media.source import open_input

# What an auxiliary track's `auxi` box calls alpha: MPEG's CICP name (AVIF), and HEVC's auxiliary picture type.
_ALPHA = (b"urn:mpeg:mpegB:cicp:systems:auxiliary:alpha", b"urn:mpeg:hevc:2015:auxid:1")


def alpha_stream(container: av.container.InputContainer, path: Path, colour: av.VideoStream) -> av.VideoStream | None:
    """The stream holding `colour`'s alpha, or None. PyAV numbers a track's stream by its track ID, and an AVIF's
    still items (its poster picture and that picture's alpha) by item IDs that may be the same numbers: of the streams
    with the alpha track's ID, it is the one with as many frames as the colour track."""
    if "mov" not in container.format.name or len(container.streams.video) < 2:  # no other video stream to be it
        return None
    alpha_id = alpha_tracks(path).get(colour.id)
    streams = [s for s in container.streams.video if s.id == alpha_id and s.index != colour.index]
    return next((s for s in streams if s.frames == colour.frames), streams[-1] if streams else None)


def alpha_tracks(path: str | Path) -> dict[int, int]:
    """Colour track ID -> the ID of the track holding its alpha, for each such track of an MP4-family file."""
    data, pairs = movie(path), {}
    try:
        for _, trak, trak_end in children(data, 8, len(data), b"trak"):
            track = track_id(data, trak, trak_end)
            tref = next(children(data, trak, trak_end, b"tref"), None)
            stsd = next(children(data, trak, trak_end, b"stsd"), None)
            alpha = stsd is not None and any(urn in data[stsd[1] : stsd[2]] for urn in _ALPHA)
            if track is None or tref is None or not alpha:
                continue
            for _, auxl, auxl_end in children(data, tref[1], tref[2], b"auxl"):
                for colour in struct.unpack_from(f">{(auxl_end - auxl) // 4}I", data, auxl):
                    pairs[colour] = track
    except struct.error:  # a box cut short: no alpha read, the colour shown as it is
        return {}
    return pairs


def frames(path: str | Path, index: int | None) -> Iterator[av.VideoFrame]:
    """The pictures of the alpha track `index` in presentation order (none for None)."""
    if index is None:
        return
    with open_input(path) as container:  # opened as the reader opens the colour track
        stream = container.streams[index]
        stream.thread_type = "AUTO"
        yield from container.decode(stream)


def values(frame: av.VideoFrame, dtype: np.dtype, width: int, height: int) -> np.ndarray:
    """(height, width) alpha of an alpha-track picture at `dtype`'s full scale: its luma plane, from its depth's full
    scale or, where the track says limited range, stretched from 16-235 first (libavif corrects such alpha so)."""
    depth = max(component.bits for component in frame.format.components)
    luma = frame.reformat(format="gray" if depth <= 8 else "gray16le").to_ndarray().astype(np.int64)
    luma = luma >> (16 - depth) if depth > 8 else luma  # swscale's gray16 holds a 10-bit sample shifted up
    top = np.iinfo(dtype).max
    if frame.color_range == 1:  # MPEG (limited)
        low, span = 16 << (depth - 8), 219 << (depth - 8)
    else:
        low, span = 0, (1 << depth) - 1
    alpha = np.clip(((luma - low) * top + span // 2) // span, 0, top).astype(dtype)
    if alpha.shape != (height, width):  # a picture the reader scales: its alpha scaled alike
        layout = "gray" if dtype == np.uint8 else "gray16le"
        alpha = av.VideoFrame.from_ndarray(alpha, format=layout).reformat(width, height).to_ndarray()
    return alpha
