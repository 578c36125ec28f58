"""What an upload's first bytes say it is, where that is certainly no video: a song, a document or a photo sent by
mistake is refused as it arrives, not failed by a worker after the queue's wait. The worker's probe, which reads the
whole file, decides everything else (an audio-only MP4 or WebM, a still GIF, a damaged video).

Exact signatures of a few formats rather than a general sniffer: one that guesses refuses the videos it misnames
(an M2TS packet's timestamp can begin like an MP3 frame)."""

from __future__ import annotations

import struct

# enough for a PNG's chunks before its image data (where an animated one says so) behind a colour profile
PEEK_BYTES = 64 * 1024

_OGG_AUDIO = {b"\x01vorbis": "Vorbis", b"OpusHead": "Opus", b"\x7fFLAC": "FLAC", b"Speex   ": "Speex"}
_AUDIO_BRANDS = {b"M4A ", b"M4B ", b"M4P "}  # iTunes' audio, audiobook and protected-audio MP4s


def not_a_video(head: bytes) -> str | None:
    """What `head` (a file's first bytes) is, as a person would name it, when it is certainly not a video; else None."""
    if head.startswith(b"ID3"):
        return "MP3 audio"
    if head.startswith(b"fLaC"):
        return "FLAC audio"
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "WAV audio"
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return "AIFF audio"
    codecs = _ogg_streams(head) if head.startswith(b"OggS") else []
    if codecs and all(codec in _OGG_AUDIO.values() for codec in codecs):
        return f"Ogg {' and '.join(sorted(set(codecs)))} audio"
    if head[4:8] == b"ftyp" and head[8:12] in _AUDIO_BRANDS:
        return "M4A audio"
    if head.startswith(b"%PDF-"):
        return "a PDF document"
    if head.startswith(b"PK\x03\x04"):
        return "a ZIP archive (or an Office document)"
    if head.startswith(b"\xff\xd8\xff") and head[6:10] in (b"JFIF", b"Exif"):
        return "a JPEG photo"
    if head.startswith(b"\x89PNG\r\n\x1a\n") and _still_png(head):
        return "a still PNG picture"
    return None


def _ogg_streams(head: bytes) -> list[str | None]:
    """Each stream's codec (None: not audio) from an Ogg file's first pages, one per stream that begins there (BOS):
    a Theora video's may come after its Vorbis sound's. Empty where `head` ends among them."""
    codecs, at = [], 0
    while head[at : at + 4] == b"OggS" and at + 27 <= len(head) and head[at + 5] & 0x02:  # a beginning of stream
        segments = head[at + 26]
        payload = at + 27 + segments
        if payload > len(head):
            return []
        packet = head[payload:]
        codecs.append(next((name for magic, name in _OGG_AUDIO.items() if packet.startswith(magic)), None))
        at = payload + sum(head[at + 27 : payload])
    return codecs if at <= len(head) else []


def _still_png(head: bytes) -> bool:
    """Whether a PNG reaches its image data without an animation control chunk (`acTL`: APNG); False where `head`
    ends first."""
    at = 8
    while at + 8 <= len(head):
        length, kind = struct.unpack(">I4s", head[at : at + 8])
        if kind == b"acTL":
            return False
        if kind == b"IDAT":
            return True
        at += 12 + length  # length, type, data, CRC
    return False
