"""Whether a file says it is encrypted (DRM), read off its headers. The probe's own check (`encryption_info` on any
packet) runs while it reads packets; a file FFmpeg cannot open or decode at all never gets there, and Matroska's
demuxer marks no packet. Common Encryption's MP4s say it in their sample descriptions (`encv`, `enca`: the codec's
entry wrapped) and carry `pssh` boxes for the key systems; a WebM's encryption is a track's ContentEncryption."""

from __future__ import annotations

from pathlib import Path

from worker.media.mp4_boxes import children, movie

PROTECTED_ENTRIES = {b"encv", b"enca", b"enct", b"encs"}  # ISO/IEC 23001-7's sample entries
EBML = b"\x1a\x45\xdf\xa3"  # a Matroska or WebM file's first bytes
CONTENT_ENCRYPTION, CONTENT_ENC_ALGO = b"\x50\x35", b"\x47\xe1"  # its element, and the first in it (0: none)
HEADERS = 1 << 20  # a Matroska file's tracks come before its clusters: the bytes where they are looked for


def protection(path: str | Path) -> str | None:
    """How `path` says it is encrypted ("Common Encryption", "WebM encryption"), or None where it does not."""
    with open(path, "rb") as handle:
        head = handle.read(HEADERS)
    if head.startswith(EBML):
        return "WebM encryption" if _content_encrypted(head) else None
    data = movie(path)
    entries = {data[payload + 12 : payload + 16] for _, payload, _ in children(data, 8, len(data), b"stsd")}
    if entries & PROTECTED_ENTRIES or next(children(data, 8, len(data), b"pssh"), None) is not None:
        return "Common Encryption"
    return None


def _content_encrypted(head: bytes) -> bool:
    """Whether a ContentEncryption element with an algorithm other than 0 (none) is among these bytes."""
    at = head.find(CONTENT_ENCRYPTION)
    while 0 <= at < len(head) - 8:
        body = at + 2 + _vint_length(head[at + 2])  # past the element's ID and its size
        if head[body : body + 2] == CONTENT_ENC_ALGO:
            value = body + 2 + _vint_length(head[body + 2])
            if head[value : value + 1] not in (b"", b"\0"):
                return True
        at = head.find(CONTENT_ENCRYPTION, at + 1)
    return False


def _vint_length(first: int) -> int:
    """The length in bytes of an EBML variable-size integer, from its first byte (its leading zeros, plus one)."""
    return 9 - first.bit_length() if first else 9
