"""A Matroska (or WebM) file's track entries, walked for what PyAV does not say: the CodecID of a track FFmpeg has no
codec for (mkvmerge's `S_TEXT/WEBVTT`, which this FFmpeg maps only as `D_WEBVTT/*`). EBML is walked by hand as the
MP4 boxes are (mp4_boxes): no Python Matroska library is kept up, and the walk to the tracks is a few lines."""

from __future__ import annotations

from pathlib import Path

EBML, SEGMENT, TRACKS, TRACK_ENTRY, CODEC_ID, CLUSTER = 0x1A45DFA3, 0x18538067, 0x1654AE6B, 0xAE, 0x86, 0x1F43B675
HEADERS = 1 << 20  # the tracks come before the clusters: the bytes they are looked for in


def codec_ids(path: str | Path) -> list[str]:
    """Each track entry's CodecID, in the file's order (FFmpeg's streams' order), or [] where none is found."""
    with open(path, "rb") as handle:
        data = handle.read(HEADERS)
    ids: list[str] = []
    try:
        for element, start, end in _elements(data, 0, len(data)):
            if element == SEGMENT:
                for child, body, stop in _elements(data, start, end):
                    if child == CLUSTER:
                        break
                    if child == TRACKS:
                        for entry, entry_start, entry_end in _elements(data, body, stop):
                            if entry == TRACK_ENTRY:
                                fields = _elements(data, entry_start, entry_end)
                                found = next((data[s:e] for kind, s, e in fields if kind == CODEC_ID), b"")
                                ids.append(found.rstrip(b"\0").decode("ascii", "replace"))
                        return ids
    except IndexError:  # cut short
        pass
    return ids


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
