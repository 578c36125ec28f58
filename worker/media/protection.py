"""Whether a file says it is encrypted (DRM), read off its headers. The probe's own check (`encryption_info` on any
packet) runs while it reads packets; a file FFmpeg cannot open or decode at all never gets there, and Matroska's
demuxer marks no packet. Common Encryption's MP4s say it in their sample descriptions (`encv`, `enca`: the codec's
entry wrapped) and carry `pssh` boxes for the key systems; a WebM's encryption is a track's ContentEncryption."""

from __future__ import annotations

from pathlib import Path

from worker.media.matroska import tracks
from worker.media.mp4_boxes import children, movie

PROTECTED_ENTRIES = {b"encv", b"enca", b"enct", b"encs"}  # ISO/IEC 23001-7's sample entries
# The first box of an MP4, MOV or 3GP: another file is not walked (a crafted one of tiny boxes would take minutes)
FIRST_BOXES = {b"ftyp", b"moov", b"styp", b"free", b"skip", b"wide", b"mdat", b"pdin"}


def protection(path: str | Path) -> str | None:
    """How `path` says it is encrypted ("Common Encryption", "WebM encryption"), or None where it does not."""
    if any(track.encrypted for track in tracks(path)):
        return "WebM encryption"
    with open(path, "rb") as handle:
        first = handle.read(8)[4:]
    if first not in FIRST_BOXES:
        return None
    data = movie(path)
    entries = {data[payload + 12 : payload + 16] for _, payload, _ in children(data, 8, len(data), b"stsd")}
    if entries & PROTECTED_ENTRIES or next(children(data, 8, len(data), b"pssh"), None) is not None:
        return "Common Encryption"
    return None
