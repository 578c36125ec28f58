"""A Matroska (or WebM) file's track entries, walked for what PyAV does not say: the CodecID of a track FFmpeg has no
codec for (mkvmerge's `S_TEXT/WEBVTT`, which this FFmpeg maps only as `D_WEBVTT/*`), and a track's encryption. EBML
is walked by hand as the MP4 boxes are (mp4_boxes): no Python Matroska library is kept up, and the walk to the tracks
is a few lines."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

EBML, SEGMENT, TRACKS, TRACK_ENTRY, CODEC_ID, CLUSTER = 0x1A45DFA3, 0x18538067, 0x1654AE6B, 0xAE, 0x86, 0x1F43B675
CONTENT_ENCODINGS, CONTENT_ENCODING, CONTENT_ENCRYPTION, CONTENT_ENC_ALGO = 0x6D80, 0x6240, 0x5035, 0x47E1
HEADERS = 1 << 20  # the tracks come before the clusters: the bytes they are looked for in


@dataclass(frozen=True)
class Track:
    codec_id: str  # "V_VP9", "S_TEXT/WEBVTT"...
    encrypted: bool  # a ContentEncryption with an algorithm (not 0: none), as a WebM with DRM has


def tracks(path: str | Path) -> list[Track]:
    """Each track entry, in the file's order (FFmpeg's streams' order), or [] where none is found."""
    with open(path, "rb") as handle:
        data = handle.read(HEADERS)
    if not data.startswith(EBML.to_bytes(4, "big")):
        return []
    try:
        for element, start, end in _elements(data, 0, len(data)):
            if element != SEGMENT:
                continue
            for child, body, stop in _elements(data, start, end):
                if child == CLUSTER:
                    break
                if child == TRACKS:
                    return [_track(data, s, e) for kind, s, e in _elements(data, body, stop) if kind == TRACK_ENTRY]
    except IndexError:  # cut short
        pass
    return []


def header_only(path: str | Path) -> bool:
    """Whether the file is a Matroska/WebM header and nothing after it but zeros: what a browser's MediaRecorder
    stopped before its first frame writes (Chromium: the EBML header, then zero bytes)."""
    with open(path, "rb") as handle:
        data = handle.read(HEADERS + 1)
    if len(data) > HEADERS or not data.startswith(EBML.to_bytes(4, "big")):
        return False
    try:
        element, _, end = next(_elements(data, 0, len(data)))
    except (StopIteration, IndexError):
        return False
    return element == EBML and not data[end:].strip(b"\0")


def codec_ids(path: str | Path) -> list[str]:
    """Each track entry's CodecID, in the streams' order."""
    return [track.codec_id for track in tracks(path)]


def _track(data: bytes, start: int, end: int) -> Track:
    codec_id, encrypted = b"", False
    for kind, body, stop in _elements(data, start, end):
        if kind == CODEC_ID:
            codec_id = data[body:stop]
        elif kind == CONTENT_ENCODINGS:
            for encoding, encoding_body, encoding_end in _elements(data, body, stop):
                if encoding != CONTENT_ENCODING:
                    continue
                for part, part_body, part_end in _elements(data, encoding_body, encoding_end):
                    if part == CONTENT_ENCRYPTION:
                        algorithm = next((data[s:e] for k, s, e in _elements(data, part_body, part_end)
                                          if k == CONTENT_ENC_ALGO), b"")  # fmt: skip
                        encrypted |= any(algorithm)
    return Track(codec_id.rstrip(b"\0").decode("ascii", "replace"), encrypted)


def _elements(data: bytes, start: int, end: int):
    """(ID, body start, body end) of each element between two offsets; an unknown size runs to `end`."""
    position = start
    while position < end:
        element, position = _vint(data, position, keep_marker=True)
        size_at = position
        size, position = _vint(data, position, keep_marker=False)
        if size == (1 << (7 * (position - size_at))) - 1:  # all ones: unknown (a live recording's segment)
            size = end - position
        yield element, position, min(position + size, end)
        position += size


def _vint(data: bytes, position: int, keep_marker: bool) -> tuple[int, int]:
    """An EBML variable-size integer at `position` (an element ID keeps its length marker), and where it ends."""
    first = data[position]
    length = 9 - first.bit_length() if first else 8
    value = first if keep_marker else first & ((1 << (8 - length)) - 1)
    for byte in data[position + 1 : position + length]:
        value = value << 8 | byte
    return value, position + length
