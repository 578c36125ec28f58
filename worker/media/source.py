"""Opening a source file for reading, with the demuxer options its shape needs, and its video packets made what the
decoder reads: one place, so that the probe, the reader and the carried streams all read the same packets."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import av

# The top-level boxes of the MP4s we take; a file that starts with anything else is not walked.
_MP4_BOXES = frozenset({b"ftyp", b"styp", b"moov", b"moof", b"mdat", b"free", b"skip", b"wide", b"sidx", b"mfra", b"uuid", b"pdin", b"meta", b"emsg", b"prft"})


def open_input(path: str | Path, **kwargs) -> av.container.InputContainer:
    """`av.open` for reading `path`. A fragmented MP4 whose end cuts through a `moof` (a phone app or OBS writing
    fragments, crashing while it wrote the next one's header) is read fragment by fragment as it is demuxed (FFmpeg's
    `ignidx`) instead of all of them at open: its header read failed on the cut one (input_unreadable), though the
    fragments before it are whole. Read lazily, the demuxer ends at the cut one, as at the end of a file."""
    if cut_in_moof(path):
        options = dict(kwargs.pop("options", None) or {})
        options["fflags"] = options.get("fflags", "") + "+ignidx"
        kwargs["options"] = options
    return av.open(str(path), **kwargs)


def demux(container: av.container.InputContainer, *streams: av.stream.Stream) -> Iterator[av.Packet]:
    """`container.demux(*streams)`, ended where a stream appeared after the header. MPEG-TS, MPEG-PS and FLV add a
    stream as they first meet its packets (a PMT update, a bit flipped in a PID); PyAV 18 skips those packets, then its
    closing flush walks every stream FFmpeg knows and may raise IndexError on one it never wrapped (it reads a table
    sized for the streams at the start past its end), after every packet has been read and the flush's empty packets
    begun: the end of the file, not a failure (a worker failed such a job as `internal_error`)."""
    last = None
    try:
        for last in container.demux(*streams):
            yield last
    except IndexError:
        if last is None or last.size:  # not at the flush (its packets are empty): not this
            raise


def iso_bmff(container: av.container.InputContainer) -> bool:
    """Whether FFmpeg reads `container` as MP4, MOV or 3GP (ISO BMFF: samples timed by decode-time gaps)."""
    return "mp4" in container.format.name.split(",")


def fragmented(container: av.container.InputContainer, stream: av.VideoStream) -> bool:
    """Whether `stream` is a fragmented MP4's (DASH, HLS in fMP4, a recording written as it went): its header counts no
    frames, and the duration FFmpeg gives is where its presentation ends, counted from 0 (a live stream's whole length
    in `mehd`, or its last fragment's wall-clock time), not what the file holds."""
    return iso_bmff(container) and not stream.frames


def cut_in_moof(path: str | Path) -> bool:
    """Whether `path` is an MP4 whose last top-level box is a `moof` that runs past the end of the file."""
    try:
        with open(path, "rb") as file:
            end = file.seek(0, 2)
            position = 0
            while position + 8 <= end:
                file.seek(position)
                size, kind = struct.unpack(">I4s", file.read(8))
                if kind not in _MP4_BOXES:
                    return False
                if size == 1:  # a 64-bit size follows
                    if position + 16 > end:
                        return False
                    (size,) = struct.unpack(">Q", file.read(8))
                elif size == 0:  # to the end of the file
                    return False
                if size < 8:
                    return False
                if position + size > end:
                    return kind == b"moof"
                position += size
    except OSError:
        return False
    return False


def unpacker(stream: av.VideoStream) -> Callable[[av.Packet | None], list[av.Packet]]:
    """What to send the decoder for each of `stream`'s packets (None: the end). MPEG-4 Part 2 from DivX 5 and old
    XviD stores B-frames "packed" in AVI: a P-frame and the B-frame shown before it in one chunk, an empty N-VOP
    chunk after. FFmpeg's decoder reorders them only where the DivX user data says so ("DivX503b1393p"); without the
    flag (a file remuxed or re-tagged) it dropped every packed B-frame: 13 of 24 frames decoded, refused as
    input_corrupt once the upscaling was done. The mpeg4_unpack_bframes filter (what FFmpeg's own message names) puts
    each B-frame in the N-VOP's place, flag or none, one packet out for one in; other streams pass as they are."""
    if stream.codec_context.name != "mpeg4":
        return lambda packet: [] if packet is None else [packet]
    unpack = av.BitStreamFilterContext("mpeg4_unpack_bframes", stream)
    return unpack.filter


# WebM carries a VP8 or VP9 picture's alpha beside it (Matroska BlockAdditional; the track says `alpha_mode` 1):
# FFmpeg's own decoders drop it, libvpx's composes it into the frame.
_ALPHA_DECODERS = {"vp8": "libvpx", "vp9": "libvpx-vp9"}


def alpha_beside(stream: av.VideoStream) -> bool:
    """Whether `stream` keeps an alpha channel beside each picture: a WebM sticker's VP8 or VP9."""
    return stream.codec_context.name in _ALPHA_DECODERS and stream.metadata.get("alpha_mode") == "1"


def decoder(stream: av.VideoStream) -> av.CodecContext:
    """What decodes `stream`'s packets: its own context, or for a WebM sticker with an alpha channel (made with
    `-pix_fmt yuva420p`, as Telegram's and the web's transparent videos are) libvpx's, so the alpha is not lost. An
    FFmpeg built without libvpx reads the picture without it, as before."""
    if not alpha_beside(stream):
        return stream.codec_context
    try:
        context = av.CodecContext.create(_ALPHA_DECODERS[stream.codec_context.name], "r")
    except av.error.FFmpegError:  # pragma: no cover - PyAV's wheels ship libvpx
        return stream.codec_context
    context.thread_type = "AUTO"
    return context
