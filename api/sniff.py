"""What an upload's first bytes say it is, where that is certainly no video: a song, a document, a photo or text sent by
mistake is refused as it arrives, not failed by a worker after the queue's wait; and, once stored, an MP4, WebM,
Matroska or MPEG-TS file whose tracks are all sound (`without_video`: a song or a voice memo saved as .mp4, a DASH or
HLS audio rendition, a browser's audio-only recording, a downloader's audio track, a Blu-ray's sound kept alone).
The worker's probe, which reads the whole file, decides everything else (a still GIF, a damaged video).

Exact signatures of a few formats rather than a general sniffer: one that guesses refuses the videos it misnames
(an M2TS packet's timestamp can begin like an MP3 frame)."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterator
from typing import TypeVar

# enough for a PNG's chunks before its image data (where an animated one says so) behind a colour profile
PEEK_BYTES = 64 * 1024

_OGG_AUDIO = {b"\x01vorbis": "Vorbis", b"OpusHead": "Opus", b"\x7fFLAC": "FLAC", b"Speex   ": "Speex"}
_AUDIO_BRANDS = {b"M4A ", b"M4B ", b"M4P "}  # iTunes' audio, audiobook and protected-audio MP4s


def not_a_video(head: bytes) -> str | None:
    """What `head` (a file's first bytes) is, as a person would name it, when it is certainly not a video; else None."""
    if head.startswith(b"ID3"):  # an ID3 tag, then the sound: MP3 frames, or ADTS's AAC (an HLS audio segment)
        return "AAC audio" if _adts(head[(end := _id3_end(head)) : end + 2]) else "MP3 audio"
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
    return _text(head)


# Text a person may pick for the video it goes with; an HLS playlist or a DASH manifest only names a video's segments
_TEXTS = ((b"#EXTM3U", "an HLS playlist (it only names the video's segments)"), (b"WEBVTT", "WebVTT subtitles"))
_SRT_CUE = re.compile(rb"\A\d+\r?\n\d\d:\d\d:\d\d,\d{3} --> ")
_CONTROLS = re.compile(rb"[\x00-\x08\x0b\x0e-\x1f\x7f]")  # all but tab, line feed, form feed, carriage return


# UTF-16 and UTF-32 by their byte order marks (UTF-32's first: its little-endian mark begins as UTF-16's)
_WIDE_TEXT = ((b"\xff\xfe\x00\x00", "utf-32-le"), (b"\x00\x00\xfe\xff", "utf-32-be"), (b"\xff\xfe", "utf-16-le"),
              (b"\xfe\xff", "utf-16-be"))  # fmt: skip


def _text(head: bytes) -> str | None:
    """How to name `head` where it is text (no control characters but tabs, line and form feeds, carriage returns:
    UTF-8, a one-byte code page such as Latin-1, or UTF-16/32 after their byte order mark), which no video is: every
    container's header has such bytes, and a YUV4MPEG2 stream's, which has none, is known by its signature."""
    body = head.removeprefix(b"\xef\xbb\xbf")  # UTF-8's byte order mark
    if (wide := next(((mark, code) for mark, code in _WIDE_TEXT if body.startswith(mark)), None)) is not None:
        mark, code = wide
        width = 4 if "32" in code else 2
        text = body[len(mark) :]  # whole characters only: the peek may end inside one
        body = text[: len(text) // width * width].decode(code, errors="replace").encode()
    if not body or body.startswith(b"YUV4MPEG2 ") or _CONTROLS.search(body):
        return None
    if body.lstrip().startswith(b"<") and b"<MPD" in body[:4096]:
        return "a DASH manifest (it only names the video's segments)"
    if _SRT_CUE.match(body.lstrip()):
        return "SRT subtitles"
    return next((name for magic, name in _TEXTS if body.startswith(magic)), "a text file")


def _id3_end(head: bytes) -> int:
    """Where an ID3v2 tag at the start of `head` ends: its 10-byte header, its size (7 bits a byte), a footer."""
    size = sum((byte & 0x7F) << (7 * (3 - at)) for at, byte in enumerate(head[6:10]))
    return 10 + size + (10 if len(head) > 5 and head[5] & 0x10 else 0)


def _adts(frame: bytes) -> bool:
    """Whether `frame` starts with an ADTS header's sync word and its layer bits (00), as AAC's frames do."""
    return len(frame) == 2 and frame[0] == 0xFF and frame[1] & 0xF6 == 0xF0


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


# -- MP4 (and QuickTime): the handler of each track, read box by box --------------------------------------------------

# A read of `length` bytes at `offset` of the stored file (fewer at its end)
ReadAt = Callable[[int, int], bytes]
Kind = TypeVar("Kind", bytes, int)  # a box's type, an element's id
_TOP_LEVEL = {b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"uuid", b"pdin", b"styp", b"sidx", b"moof"}
# What a track holds, by its handler: any other (video, picture sequences, auxiliary video, hints) may hold pictures
_HANDLER_KINDS = {b"soun": "sound", b"text": "text", b"sbtl": "text", b"subt": "text", b"clcp": "text"}
_MOST_BOXES = 4096  # a file of more boxes than this at the levels walked is not judged here


class _Unreadable(Exception):
    pass


def without_video(read_at: ReadAt, size: int) -> str | None:
    """How to name an MP4, QuickTime, WebM, Matroska or MPEG-TS file of `size` bytes whose every track is known and
    none is video ("an MP4 with sound only"); None for any other file, or one whose structure does not say (cut
    short, malformed, no track)."""
    try:
        if read_at(4, 4) in _TOP_LEVEL:
            kinds, name = {_HANDLER_KINDS.get(handler) for handler in _track_handlers(read_at, size)}, "an MP4"
        elif read_at(0, 4) == _EBML:
            kinds, name = _matroska_track_kinds(read_at, size)
        elif (packet := _packet_layout(read_at)) is not None:
            kinds, name = _transport_stream_kinds(read_at, size, *packet), "an MPEG transport stream"
        else:
            return None
    except (_Unreadable, IndexError, struct.error):  # a hostile file's structure must not be a 500: the probe decides
        return None
    if not kinds or not kinds <= {"sound", "text", "data"}:  # None: a kind not known to hold no picture
        return None
    return f"{name} with sound only" if kinds - {"data"} == {"sound"} else f"{name} without a video track"


def _track_handlers(read_at: ReadAt, size: int) -> Iterator[bytes]:
    """Each track's handler type (moov/trak/mdia/hdlr), where the movie box may lie after gigabytes of media data."""
    budget = [_MOST_BOXES]
    moov = _first(_boxes(read_at, 0, size, budget), b"moov")
    if moov is None:
        raise _Unreadable
    for kind, start, end in _boxes(read_at, moov[1], moov[2], budget):
        if kind != b"trak":
            continue
        mdia = _first(_boxes(read_at, start, end, budget), b"mdia")
        hdlr = mdia and _first(_boxes(read_at, mdia[1], mdia[2], budget), b"hdlr")
        if hdlr is None or hdlr[2] - hdlr[1] < 12:
            raise _Unreadable
        # version and flags, then ISO's pre_defined or QuickTime's component type, then the handler (its subtype)
        yield read_at(hdlr[1] + 8, 4)


def _first(children: Iterator[tuple[Kind, int, int]], kind: Kind) -> tuple[Kind, int, int] | None:
    """The first of `children` (boxes, or elements: (kind, where its data starts, where it ends)) of `kind`."""
    return next((child for child in children if child[0] == kind), None)


def _boxes(read_at: ReadAt, start: int, end: int, budget: list[int]) -> Iterator[tuple[bytes, int, int]]:
    """The boxes from `start` to `end`: (type, where its payload starts, where it ends)."""
    at = start
    while at + 8 <= end:
        budget[0] -= 1
        if budget[0] < 0:
            raise _Unreadable
        header = read_at(at, 16)
        if len(header) < 8:
            raise _Unreadable
        length, kind = struct.unpack(">I4s", header[:8])
        payload = at + 8
        if length == 1 and len(header) == 16:  # a 64-bit size follows
            length, payload = struct.unpack(">Q", header[8:16])[0], at + 16
        elif length == 0:  # to the end of its parent
            length = end - at
        if length < payload - at or at + length > end:
            raise _Unreadable
        yield kind, payload, at + length
        at += length


# -- WebM and Matroska: each track's type, read element by element ----------------------------------------------------

_EBML = b"\x1a\x45\xdf\xa3"
_SEGMENT, _TRACKS, _TRACK_ENTRY, _TRACK_TYPE, _CLUSTER, _DOC_TYPE = (
    0x18538067, 0x1654AE6B, 0xAE, 0x83, 0x1F43B675, 0x4282
)  # fmt: skip
_TRACK_KINDS = {2: "sound", 0x11: "text"}  # Matroska's TrackType: 1 is video, 3 complex, 0x10 a logo …


def _matroska_track_kinds(read_at: ReadAt, size: int) -> tuple[set[str | None], str]:
    """The kinds of the tracks a Matroska file declares before its first cluster, and how to name the file."""
    budget = [_MOST_BOXES]
    header = next(_elements(read_at, 0, size, budget))
    doc_type = _first(_elements(read_at, header[1], header[2], budget), _DOC_TYPE)
    webm = doc_type is not None and read_at(doc_type[1], min(doc_type[2] - doc_type[1], 16)).rstrip(b"\0") == b"webm"
    name = "a WebM" if webm else "a Matroska file"
    segment = _first(_elements(read_at, header[2], size, budget), _SEGMENT)
    if segment is None:
        raise _Unreadable
    for id_, start, end in _elements(read_at, segment[1], segment[2], budget):
        if id_ == _CLUSTER:  # media before any track was declared
            raise _Unreadable
        if id_ == _TRACKS:
            kinds = set()
            for entry in (e for e in _elements(read_at, start, end, budget) if e[0] == _TRACK_ENTRY):
                kind = _first(_elements(read_at, entry[1], entry[2], budget), _TRACK_TYPE)
                if kind is None or not 1 <= kind[2] - kind[1] <= 8:
                    raise _Unreadable
                kinds.add(_TRACK_KINDS.get(int.from_bytes(read_at(kind[1], kind[2] - kind[1]), "big")))
            return kinds, name
    raise _Unreadable


def _elements(read_at: ReadAt, start: int, end: int, budget: list[int]) -> Iterator[tuple[int, int, int]]:
    """The EBML elements from `start` to `end`: (id, where its data starts, where it ends); one of unknown size (a
    live recording's segment) runs to `end`."""
    at = start
    while at < end:
        budget[0] -= 1
        if budget[0] < 0:
            raise _Unreadable
        head = read_at(at, 12)
        id_length = _vint_length(head, 0, 4)
        size_length = _vint_length(head, id_length, 8)
        element_id = int.from_bytes(head[:id_length], "big")
        raw = head[id_length : id_length + size_length]
        length = int.from_bytes(raw, "big") & ((1 << (7 * size_length)) - 1)
        data = at + id_length + size_length
        stop = end if length == (1 << (7 * size_length)) - 1 else data + length  # all ones: unknown
        if stop > end:
            raise _Unreadable
        yield element_id, data, stop
        at = stop


def _vint_length(data: bytes, at: int, most: int) -> int:
    """An EBML variable-length integer's length, from the leading zeros of its first byte."""
    if at >= len(data) or data[at] == 0:
        raise _Unreadable
    length = 8 - data[at].bit_length() + 1
    if length > most or at + length > len(data):
        raise _Unreadable
    return length


# -- MPEG-TS (and M2TS): each elementary stream's type, from the program tables ---------------------------------------

_SYNC = 0x47
_TS_SCAN_BYTES = 1 << 20  # tables repeat every ~0.1 s: a 1 MiB stretch of even a song's stream holds them
# ISO 13818-1's and ATSC's stream types that are sound everywhere: MPEG audio, AAC (ADTS, LATM, raw), AC-3, E-AC-3.
# Blu-ray's other sound types are not here: 0x80 and 0x82-0x86 are video or cue data in other systems
_STREAM_KINDS = {0x03: "sound", 0x04: "sound", 0x0F: "sound", 0x11: "sound", 0x1C: "sound", 0x81: "sound",
                 0x87: "sound", 0x15: "data"}  # fmt: skip  # 0x15: timed metadata (HLS's ID3 tags)
# ... but in a programme registered as Blu-ray's ("HDMV", AVCHD's too): LPCM, AC-3, DTS, TrueHD, E-AC-3, DTS-HD and
# the secondary sound; its graphics (PGS) and text subtitles
_BLU_RAY_KINDS = _STREAM_KINDS | dict.fromkeys((0x80, 0x82, 0x83, 0x84, 0x85, 0x86, 0xA1, 0xA2), "sound") | {
    0x90: "text", 0x92: "text"}  # fmt: skip
# A private stream (0x06) says what it is in its descriptors: DVB's AC-3, E-AC-3, DTS and AAC, its subtitles and
# teletext; a registration's format identifier (Opus, SMPTE 302M's PCM)
_DESCRIPTOR_KINDS = {0x6A: "sound", 0x7A: "sound", 0x7B: "sound", 0x7C: "sound", 0x59: "text", 0x56: "text"}
_REGISTERED_KINDS = {b"Opus": "sound", b"AC-3": "sound", b"EAC3": "sound", b"BSSD": "sound"}


def _packet_layout(read_at: ReadAt) -> tuple[int, int] | None:
    """(packet size, offset of the first sync byte) where the file starts as a transport stream: 188-byte packets,
    or M2TS's 192 (a 4-byte timestamp before each); None for anything else."""
    head = read_at(0, 4 + 3 * 192)
    for size, first in ((188, 0), (192, 4)):
        if len(head) >= first + 2 * size + 1 and all(head[first + n * size] == _SYNC for n in range(3)):
            return size, first
    return None


def _transport_stream_kinds(read_at: ReadAt, size: int, packet: int, first: int) -> set[str | None]:
    """The kinds of every elementary stream of every program the stream's first tables list (PAT, then each PMT),
    read from its first `_TS_SCAN_BYTES`; each table in one packet, as muxers write them."""
    # (PMT PID, program number) -> the program's streams' kinds, once read: programs may share a PMT PID
    programs: dict[tuple[int, int], set[str | None] | None] | None = None
    end = min(size, _TS_SCAN_BYTES)
    for at in range(first, end - packet + first + 1, packet):
        header = read_at(at, 4)
        if len(header) < 4 or header[0] != _SYNC:
            raise _Unreadable
        if not header[1] & 0x40:  # no table starts in this packet
            continue
        pid = (header[1] & 0x1F) << 8 | header[2]
        if not (pid == 0 if programs is None else any(p == pid and k is None for (p, _), k in programs.items())):
            continue  # the PAT, then the PMTs it names
        payload = read_at(at + 4, packet - first - 4)
        if header[3] & 0x20:  # an adaptation field comes first
            payload = payload[1 + payload[0] :] if payload else b""
        table = _section(payload, 0x00 if pid == 0 else 0x02)
        if table is None:
            continue
        if programs is None:
            programs = dict.fromkeys(_pat_programs(table))
            if not programs:
                raise _Unreadable
        elif (pid, program := int.from_bytes(table[3:5], "big")) in programs:
            programs[pid, program] = _pmt_kinds(table)
        if all(kinds is not None for kinds in programs.values()):
            return set().union(*programs.values())
    raise _Unreadable


def _section(payload: bytes, table_id: int) -> bytes | None:
    """The table section of `table_id` starting in a packet's payload (its pointer field first), without its CRC;
    None for another table, one not yet current, or one of several sections; `_Unreadable` for a section that runs
    into the next packet or fails its CRC."""
    if not payload or 1 + payload[0] + 3 > len(payload):
        raise _Unreadable
    section = payload[1 + payload[0] :]
    if section[0] != table_id:
        return None
    length = 3 + ((section[1] & 0x0F) << 8 | section[2])
    if length > len(section) or length < 12 or _crc32_mpeg2(section[:length]):
        raise _Unreadable
    if not section[5] & 0x01 or section[6] or section[7]:  # not current; section 0 of 0 only
        return None
    return section[: length - 4]


def _pat_programs(section: bytes) -> set[tuple[int, int]]:
    """The (PMT PID, program number) of each program a PAT names (program 0 names the network table, no program)."""
    entries = section[8:]
    return {
        ((entries[n + 2] & 0x1F) << 8 | entries[n + 3], int.from_bytes(entries[n : n + 2], "big"))
        for n in range(0, len(entries) - 3, 4)
        if entries[n : n + 2] != b"\0\0"
    }


def _pmt_kinds(section: bytes) -> set[str | None]:
    """The kinds of a PMT's elementary streams (None: a type that may hold pictures, or one not known)."""
    kinds: set[str | None] = set()
    if len(section) < 12 or (at := 12 + ((section[10] & 0x0F) << 8 | section[11])) > len(section):
        raise _Unreadable  # a section too short for its own header
    types = _BLU_RAY_KINDS if b"HDMV" in _registrations(section[12:at]) else _STREAM_KINDS
    while at + 5 <= len(section):
        stream_type, info = section[at], (section[at + 3] & 0x0F) << 8 | section[at + 4]
        descriptors = section[at + 5 : at + 5 + info]
        kinds.add(types.get(stream_type) if stream_type != 0x06 else _private_kind(descriptors))
        at += 5 + info
    return kinds


def _private_kind(descriptors: bytes) -> str | None:
    """What a private stream's descriptors say it holds."""
    for tag, body in _descriptors(descriptors):
        kind = _REGISTERED_KINDS.get(body[:4]) if tag == 0x05 else _DESCRIPTOR_KINDS.get(tag)
        if kind is not None:
            return kind
    return None


def _registrations(descriptors: bytes) -> set[bytes]:
    """The format identifiers of a descriptor loop's registration descriptors."""
    return {body[:4] for tag, body in _descriptors(descriptors) if tag == 0x05}


def _descriptors(loop: bytes) -> Iterator[tuple[int, bytes]]:
    """A descriptor loop's (tag, body) pairs."""
    at = 0
    while at + 2 <= len(loop):
        yield loop[at], loop[at + 2 : at + 2 + loop[at + 1]]
        at += 2 + loop[at + 1]


def _crc_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7 if crc & 0x80000000 else crc << 1) & 0xFFFFFFFF
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _crc_table()


def _crc32_mpeg2(data: bytes) -> int:
    """MPEG-2's CRC-32 (not zlib's: unreflected, no final XOR): 0 over a whole section whose CRC is right. A few lines
    rather than a dependency of the API's image; a table is at most a packet long."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ _CRC_TABLE[(crc >> 24) ^ byte]
    return crc
