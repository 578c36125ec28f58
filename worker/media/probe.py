"""Probe a media file before any work is spent on it: its streams, their timing, and whether we can and may take it.

One demux pass over the whole file (packets only; just the first video frame is decoded) gives the exact frame
count, every frame's timestamp (constant or variable rate), each audio stream's extent, and catches truncated
files. Limits are checked as early as the file can tell them: size before opening, an animated picture's canvas and
frames before it is opened, declared dimensions and duration before reading a packet, the frame count while counting.
"""

from __future__ import annotations

import heapq
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from pathlib import Path

import av

from worker.media import alpha_track, animation, webp
from worker.media.errors import (
    InputCorrupt,
    InputEmpty,
    InputEncrypted,
    InputNoVideo,
    InputNotFound,
    InputTooLarge,
    InputTooShort,
    InputUnreadable,
    InputUnsupportedCodec,
    stop_if_asked,
)
from worker.media.field_pictures import second_fields
from worker.media.limits import Limits
from worker.media.matroska import codec_ids, header_only
from worker.media.mp4_boxes import chapter_tracks, children, movie, presented
from worker.media.protection import protection
from worker.media.side_data import SideData, side_data
from worker.media.source import alpha_beside, demux, fragmented, iso_bmff, open_input, unpacker
from worker.media.timecode import Count, timecode_counts

# A span of timestamps no recording has (30 days): a damaged file's (an FLV joined to itself: 9.2e15 s, int64 wrapped)
_NO_RECORDING_S = 30 * 86400
AVError = (av.error.FFmpegError, OSError)  # PyAV raises both, depending on the errno FFmpeg returns

# FFmpeg's AVColorSpace / AVColorRange values, named for people.
MATRICES = {0: "rgb", 1: "bt709", 2: "unspecified", 4: "fcc", 5: "bt470bg", 6: "smpte170m", 7: "smpte240m", 9: "bt2020nc", 10: "bt2020c"}
RANGES = {0: "unspecified", 1: "limited", 2: "full"}
# Frames a decoder may hold back to put them in presentation order (H.264's and HEVC's largest picture buffer).
REORDER = 16
# Frames decoded after one and shown before it. No buffer bounds them, but a GOP does: an open GOP's leading pictures
# (VVenC's: 23 at 24 fps) come after their keyframe.
SHOWN_AFTER = 64


@dataclass(frozen=True)
class VideoInfo:
    index: int
    codec: str
    width: int  # the picture the stream declares (decoder padding cropped off), after rotation
    height: int
    rotation: int  # degrees counter-clockwise the stored frames are turned for display: 0, 90, 180 or 270
    pix_fmt: str
    bit_depth: int
    color_matrix: int  # FFmpeg's AVCOL_* values, as the stream tags them (2 = unspecified)
    color_range: int
    color_primaries: int
    color_trc: int
    frames: int
    fps: Fraction  # the constant rate, or the average of a variable one
    cfr: bool
    start: float  # seconds: presentation time of the first frame
    duration: float  # seconds: from the first frame to the end of the last
    time_base: Fraction
    language: str | None
    # Width : height of one pixel as displayed (after rotation): 1 for square pixels, 16/15 for PAL DVD 4:3.
    sar: Fraction = Fraction(1)
    interlaced: bool = False  # the first frame is coded as two fields (the reader counts them all: reader.Reading)
    turns_interlaced: bool = False  # the first frame is progressive, a later keyframe the probe decoded interlaced
    # Film carried by 3:2 pulldown flags (soft telecine): its frames timed three fields and two in turn, read at `fps`,
    # the film's own rate (`_pulled_down`)
    pulldown: bool = False
    mirrored: bool = False  # after the turn by `rotation`, flipped left to right for display
    # Variable rate only: every frame's presentation time in `time_base`, counted from the first frame.
    timestamps: tuple[int, ...] = field(default=(), repr=False)
    # Every frame's presentation time in `time_base`, in order, where each frame has one of its own and none was
    # retimed (else empty): where the reader places each frame it decodes (`reader._Timeline`).
    presented: tuple[int, ...] = field(default=(), repr=False)
    # Variable rate only: how long the last frame lasts in `time_base`, as its packet says (0: it does not say).
    last_duration: int = 0
    # A stream that changes size mid-way: each size its keyframes were seen at, (width, height) as stored, in order
    # of appearance. `width` and `height` are then the largest part's (most pixels), and `canvas_shape` its shape as
    # stored (width x the decoder's pixel aspect / height), which the reader fits every other part into.
    sizes: tuple[tuple[int, int], ...] = ()
    canvas_shape: Fraction | None = None
    timecode: str | None = None  # the first frame's SMPTE timecode, as ffprobe reads it (an MOV's tmcd track)
    retimed: int = 0  # frames whose timestamp ran back alone, put between their neighbours' (probe._check_order)
    # frames at the head no decoder shows, left out: they refer to pictures before the file (`_leading`)
    undecodable: int = 0
    # HDR10's static metadata, as the first frame carries it (`_hdr10`)
    mastering: str | None = None  # the mastering display: "G(x,y)B(x,y)R(x,y)WP(x,y)L(max,min)", HEVC SEI's units
    light_level: tuple[int, int] | None = None  # MaxCLL, MaxFALL (cd/m²)
    alpha_index: int | None = None  # the stream of an animated AVIF's alpha track (worker.media.alpha_track)
    alpha_beside: bool = False  # a WebM sticker's alpha, beside each picture (read with libvpx: source.decoder)
    stereo: bool = False  # two views, one per eye (MV-HEVC: `_stereo`), of which the decoder gives the first

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def display_aspect(self) -> Fraction:
        return self.width * self.sar / self.height


@dataclass(frozen=True)
class AudioInfo:
    index: int
    codec: str  # "unknown" when FFmpeg has no decoder for it
    sample_rate: int
    channels: int
    layout: str
    start: float  # seconds, first to last sample the stream presents
    duration: float
    packet_seconds: float  # the longest packet: how finely a copy can be cut
    language: str | None
    title: str | None


@dataclass(frozen=True)
class SubtitleInfo:
    index: int
    codec: str
    language: str | None
    title: str | None


@dataclass(frozen=True)
class Chapter:
    start: float  # seconds, in the source's clock
    end: float
    title: str | None


def output_chapters(chapters: Sequence[Chapter], clock: float) -> list[tuple[float, float, str | None]]:
    """(start, end, title) in the output's seconds, whose clock starts at `clock` in the source's: a chapter over
    before the first frame has nothing to mark, one under way then starts at 0."""
    return [(max(0.0, c.start - clock), c.end - clock, c.title) for c in chapters if c.end > clock]


@dataclass(frozen=True)
class OtherVideo:
    index: int
    codec: str


@dataclass(frozen=True)
class DataInfo:
    index: int
    timecode: str | None  # a timecode track's (tmcd) first timecode
    handler: str | None  # what its maker calls it: "TimeCodeHandler", "GoPro MET" (telemetry), …
    count: Count | None = None  # what the timecode counts at (its frames a second, drop-frame), where it was read
    reel: str | None = None  # a timecode track's reel name (a camera's card or tape: "A001")


@dataclass(frozen=True)
class MediaInfo:
    path: Path
    format: str
    size_bytes: int
    video: VideoInfo
    audio: tuple[AudioInfo, ...]
    subtitles: tuple[SubtitleInfo, ...]
    metadata: dict[str, str]
    other_video: tuple[OtherVideo, ...] = ()  # video streams besides the one upscaled (cover art aside)
    chapters: tuple[Chapter, ...] = ()
    covers: tuple[OtherVideo, ...] = ()  # cover art: one picture each (an MP4's covr, a Matroska attachment's)
    data: tuple[DataInfo, ...] = ()  # tracks of neither sound, picture nor text: timecode, telemetry
    cut_short: bool = False  # the file ends inside a packet (`cut_off`): a recording that stopped mid-write

    def to_dict(self) -> dict:
        """JSON-ready (the frames' timestamps left out)."""
        info = asdict(self)
        info["path"] = str(self.path)
        del info["video"]["timestamps"], info["video"]["presented"]
        info["video"].update(fps=str(self.video.fps), time_base=str(self.video.time_base), sar=str(self.video.sar))
        return info

    def describe(self) -> list[str]:
        video = self.video
        rate = f"{float(video.fps):.3f}".rstrip("0").rstrip(".")
        lines = [
            f"{self.path.name}: {self.format}, {self.size_bytes / 1e6:.2f} MB"
            + (", cut short" if self.cut_short else ""),
            f"video #{video.index}: {video.codec} {video.width}x{video.height} {video.pix_fmt} {video.bit_depth}-bit "
            f"({MATRICES.get(video.color_matrix, video.color_matrix)}, {RANGES.get(video.color_range, video.color_range)}), "
            f"{video.frames} frames at {rate} fps ({'constant' if video.cfr else 'variable'}), {video.duration:.3f} s"
            # where the audio's start is said, the video's too: "audio from +112.713 s" read alone looked like a lag
            + (f" from {video.start:+.3f} s" if self.audio and (video.start or any(a.start for a in self.audio))
               else "")
            + (", film with 3:2 pulldown flags" if video.pulldown else "")
            + (", interlaced" if video.interlaced else "")
            + (", interlaced from a later keyframe" if video.turns_interlaced else "")
            + (f", pixels {video.sar.numerator}:{video.sar.denominator} (display {float(video.display_aspect):.4f})" if video.sar != 1 else "")
            + (f", rotated {video.rotation} degrees for display" if video.rotation else "")
            + (", mirrored for display" if video.mirrored else "")
            + (f", changes size ({', '.join(f'{w}x{h}' for w, h in video.sizes)})" if video.sizes else "")
            + (f", its alpha in video #{video.alpha_index}" if video.alpha_index is not None else "")
            + (", its alpha beside each picture" if video.alpha_beside else "")
            + (", stereo (MV-HEVC: its first view is read)" if video.stereo else ""),
        ]
        lines += [
            f"audio #{a.index}: {a.codec} {a.sample_rate} Hz {a.layout} ({a.channels} ch), {a.duration:.3f} s from "
            f"{a.start:+.3f} s" + (f", {a.language}" if a.language else "")
            for a in self.audio
        ]
        lines += [f"subtitle #{s.index}: {s.codec}" + (f", {s.language}" if s.language else "") for s in self.subtitles]
        return lines


def existing(path: str | Path) -> Path:
    """`path`, a file that is there, or `InputNotFound`."""
    path = Path(path)
    if not path.is_file():
        raise InputNotFound(f"{path} does not exist or is not a file")
    return path


def probe(
    path: str | Path,
    limits: Limits = Limits(),
    alive: Callable[[], bool] | None = None,
    output_size: Callable[[int, int], tuple[int, int]] | None = None,
) -> MediaInfo:
    """Everything the job needs to know about `path`, or the typed error that says why it cannot be taken. `alive`
    is called as it reads (a job's heartbeat: a probe of a long file outlasted the lease), and stops it with
    `Cancelled` when it returns True. `output_size(height, width)` is the (height, width) the job makes of a frame:
    where the file declares its frames, the output limits are checked on them too, before any is decoded."""
    path = existing(path)
    size = path.stat().st_size
    if size == 0:
        raise InputEmpty(f"{path.name} is empty (0 bytes)")
    if limits.max_bytes is not None and size > limits.max_bytes:
        raise InputTooLarge(f"{path.name} is {size / 2**30:.1f} GiB; the limit is {limits.max_bytes / 2**30:.1f} GiB")
    if (declared := animation.declared(path, alive)) is not None:
        _check_animation(declared, path, limits, output_size)
    if webp.animated(path):
        return _animated_webp(path, size, limits, alive)
    try:
        return _probe(path, size, limits, alive)
    except (InputUnreadable, InputCorrupt):
        if header_only(path):
            raise InputEmpty(
                f"{path.name} holds a Matroska (WebM) header and nothing after it: a recording stopped before its "
                "first frame"
            ) from None
        # no packet said so (the probe reads them for it): FFmpeg could not open or decode the file first
        if (scheme := protection(path)) is not None:
            raise InputEncrypted(
                f"{path.name} is encrypted (DRM: {scheme}); without its key it cannot be read: send a copy that is "
                "not encrypted"
            ) from None
        raise


def _probe(path: Path, size: int, limits: Limits, alive: Callable[[], bool] | None) -> MediaInfo:
    try:
        container = open_input(path, metadata_errors="replace")
    except AVError as error:
        raise InputUnreadable(f"{path.name} is not a video file FFmpeg can read ({reason(error)})") from None
    with container:
        stream = _video_stream(container, path)
        _check_declared(container, stream, path, limits)
        scan = _scan(container, stream, path, limits, alive)
        video = _video_info(stream, scan, path, limits)
        alpha = alpha_track.alpha_stream(container, path, stream)
        video = replace(video, alpha_index=alpha.index) if alpha is not None else video
        audio = tuple(_audio_info(s, scan.extents.get(s.index)) for s in container.streams.audio)
        unmapped = any(_codec(s) == "unknown" for s in container.streams.subtitles)
        tracks_codecs = codec_ids(path) if unmapped and "matroska" in container.format.name else []
        subtitles = tuple(
            SubtitleInfo(s.index, _subtitle_codec(s, tracks_codecs), s.language, s.metadata.get("title"))
            for s in container.streams.subtitles
        )
        other_video = tuple(
            OtherVideo(s.index, _codec(s))
            for s in container.streams.video
            if s.index not in (stream.index, video.alpha_index)
            and not s.disposition & av.stream.Disposition.attached_pic
        )
        chapters = tuple(
            Chapter(float(c["start"] * c["time_base"]), float(c["end"] * c["time_base"]), c["metadata"].get("title"))
            for c in container.chapters()
        )
        covers = tuple(
            OtherVideo(s.index, _codec(s)) for s in container.streams.video if s.disposition & av.stream.Disposition.attached_pic
        )
        # Tracks of MP4/MOV only: the data streams FFmpeg shows in MPEG-PS (a DVD's navigation packets) and FLV (its
        # script data) are the container's own workings, not content a user put there
        tracks = container.streams.data if "mov" in container.format.name else ()
        if tracks:  # a chapter track is read as the file's chapters (kept as the output's), not as a track of data
            chaptered = chapter_tracks(movie(path))
            tracks = [s for s in tracks if s.id not in chaptered]
        counts = timecode_counts(path) if any(s.metadata.get("timecode") for s in tracks) else {}
        data = tuple(
            DataInfo(s.index, s.metadata.get("timecode"), s.metadata.get("handler_name"), counts.get(s.id),
                     s.metadata.get("reel_name") or None)  # fmt: skip
            for s in tracks
        )
        metadata = dict(container.metadata)
        return MediaInfo(
            path, container.format.name, size, video, audio, subtitles, metadata, other_video, chapters, covers, data,
            scan.cut_short,
        )  # fmt: skip


def _animated_webp(path: Path, size: int, limits: Limits, alive: Callable[[], bool] | None) -> MediaInfo:
    """An animated WebP, as libwebp reads it (`webp`): RGBA frames, each at its own time, no sound."""
    (width, height), starts, last = webp.frame_times(path, limits, alive)
    clock = _frame_clock([], [*starts], webp.TIME_BASE, lambda first: last, path, limits)
    video = VideoInfo(
        index=0, codec="webp", width=width, height=height, rotation=0, pix_fmt="rgba", bit_depth=8,
        color_matrix=0, color_range=0, color_primaries=2, color_trc=2,  # RGB (AVCOL_SPC_RGB), untagged
        frames=len(starts), **clock, time_base=webp.TIME_BASE, language=None,
    )  # fmt: skip
    return MediaInfo(path, "webp", size, video, (), (), {})


def _codec(stream: av.stream.Stream) -> str:
    """The codec's own name ("mp3", "av1"), not its decoder's ("mp3float", "libdav1d")."""
    return stream.codec_context.codec.canonical_name if stream.codec_context else "unknown"


# Matroska CodecIDs of text subtitles this FFmpeg reads as no codec, and the text format whose cues they hold
UNMAPPED_SUBTITLES = {"S_TEXT/WEBVTT": "webvtt"}  # what mkvmerge writes; FFmpeg maps only `D_WEBVTT/*`


def _subtitle_codec(stream: av.stream.Stream, tracks_codecs: list[str]) -> str:
    """`_codec`, or for a Matroska track FFmpeg has no codec for, the text format its CodecID names (`tracks_codecs`:
    each track's, in the streams' order)."""
    codec = _codec(stream)
    if codec == "unknown" and stream.index < len(tracks_codecs):
        return UNMAPPED_SUBTITLES.get(tracks_codecs[stream.index], codec)
    return codec


def reason(error: BaseException) -> str:
    """What FFmpeg said of `error`, for a user: its words, not its errno or the function that failed."""
    said = getattr(error, "strerror", None) or str(error)
    # FFmpeg's decoders answer bad data with POSIX codes too (its GIF decoder EPERM for an LZW code past its table):
    # "Operation not permitted" alone sent users to check the file's permissions
    if isinstance(error, OSError) and "avcodec_" in str(error):
        return f"its data does not decode: {said}"
    return said


def _video_stream(container: av.container.InputContainer, path: Path) -> av.VideoStream:
    name = container.format.name
    if name.startswith("image2") or name.endswith("_pipe"):
        raise InputNoVideo(f"{path.name} is a still image ({name}), not a video")
    # Cover art in music files is a video stream of one picture: not a video.
    streams = [s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic]
    if not streams:
        kinds = sorted({"cover art" if s.type == "video" else s.type for s in container.streams}) or ["no streams"]
        raise InputNoVideo(f"{path.name} has no video stream ({', '.join(kinds)})")
    # Of several, the one FFmpeg picks (av_find_best_stream: the default, else the one with the most data), as
    # ffmpeg and players do: a cut ASF declares three, two of them empty.
    best = container.streams.best("video")
    stream = best if best in streams else next((s for s in streams if s.disposition & av.stream.Disposition.default), streams[0])
    if stream.codec_context is None:
        # FFmpeg names no codec alike for a sample entry it does not know and for one damaged past reading
        raise InputUnsupportedCodec(
            f"{path.name}: FFmpeg does not know its video codec (or the file's header naming it is damaged)"
        )
    return stream


def _check_declared(container: av.container.InputContainer, stream: av.VideoStream, path: Path, limits: Limits) -> None:
    """What the header claims, before a single packet is read (a header may claim absurd sizes)."""
    _check_pixels(stream.codec_context.width, stream.codec_context.height, path, limits)
    # A fragmented MP4's duration is not its length (a DASH `mehd` of 3,900 s for a file of 8 s): its frames are
    # counted instead, under `max_frames`, and their times checked against `max_seconds` (`_frame_clock`).
    declared = None if fragmented(container, stream) or container.duration is None else container.duration / 1e6
    if declared is not None and limits.max_seconds is not None and declared > limits.max_seconds:
        raise InputTooLarge(f"{path.name} lasts {declared:.0f} s; the limit is {limits.max_seconds:.0f} s")


def _check_animation(
    declared: animation.Declared,
    path: Path,
    limits: Limits,
    output_size: Callable[[int, int], tuple[int, int]] | None,
) -> None:
    """What an animated picture declares, before its decoder sees it: FFmpeg refused a 65535x65535 GIF as bad data
    (input_corrupt), and a 4K WebP of thousands of 1x1 frames took minutes to decode before its output was refused."""
    _check_pixels(declared.width, declared.height, path, limits)
    if limits.max_frames is not None and declared.frames > limits.max_frames:
        raise InputTooLarge(f"{path.name} has more than {limits.max_frames} frames, the limit")
    # a still picture is refused as one (input_too_short), not for the output it would make
    if output_size is not None and declared.frames >= limits.min_frames:
        limits.check_output(*output_size(declared.height, declared.width), declared.frames)


def _check_pixels(width: int, height: int, path: Path, limits: Limits) -> None:
    if limits.max_pixels is not None and width * height > limits.max_pixels:
        raise InputTooLarge(f"{path.name} is {width}x{height}; the limit is {limits.max_pixels / 1e6:.1f} Mpx per frame")


@dataclass(frozen=True)
class _Timed:
    """A packet's timing, kept after the packet itself is gone."""

    pts: int
    dts: int | None
    duration: int


@dataclass
class _Scan:
    first_frame: av.VideoFrame | None = None
    video_packets: int = 0  # every packet, including those an edit list discards
    timestamps: list[int | None] = field(default_factory=list)  # presented frames, decode order
    decode_timed: bool = False  # the container times samples by decode-time gaps (ISO BMFF: MP4, MOV, 3GP)
    track_duration: int | None = None  # the stream's own (an MP4's: its samples' durations summed)
    presented: int | None = None  # an MP4 track's edit list: how long it is shown, in the stream's time base
    latest: int | None = None  # the latest presentation time so far (B-frames come back earlier)
    latest_duration: int = 0  # that frame's packet duration
    decode_start: int | None = None  # the presented frames' earliest decode time
    decode_end: int | None = None  # and the latest decode time plus that packet's duration
    extents: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # audio -> (start, end, longest packet)
    audio_latest: dict[int, float] = field(default_factory=dict)  # audio -> its latest packet's start, seconds
    end: float = 0.0  # latest packet end over all streams, seconds
    first: float = 0.0  # earliest packet start over all streams, seconds, where before 0 (an encoder's priming)
    # the span of the video and audio packets, seconds (a live stream's times are wall-clock ones)
    earliest: float = math.inf
    latest_end: float = -math.inf
    keyframe_seen: bool = False
    cut_short: bool = False  # a packet the file's end cuts through was left out
    key_pts: int | None = None  # the first keyframe's presentation time
    # Frames before the first keyframe, decode order: counted where the decoder is seen to show them (`_leading`)
    before_key: list[_Timed] = field(default_factory=list)
    # stored (width, height) -> the shape it is shown at (width x the decoder's pixel aspect / height), in order seen
    sizes: dict[tuple[int, int], Fraction] = field(default_factory=dict)
    sampled: float | None = None  # seconds: the last keyframe decoded for its size
    interlaced_seen: bool = False  # a keyframe decoded for its size is interlaced
    undecodable: int = 0  # frames at the head the decoder does not show (`_leading`)

    def track(self, packet: av.Packet | _Timed) -> None:
        """Follow where a presented frame's `packet` puts the track's last frame and its end."""
        if self.latest is None or packet.pts > self.latest:
            self.latest, self.latest_duration = packet.pts, packet.duration or 0
        decoded = packet.pts if packet.dts is None else packet.dts
        self.decode_start = decoded if self.decode_start is None else min(self.decode_start, decoded)
        end = decoded + (packet.duration or 0)
        self.decode_end = end if self.decode_end is None else max(self.decode_end, end)

    def last_duration(self, first: int) -> int:
        """How long the frame presented last lasts, given the first one's time (0: the file does not say). An MP4's
        sample durations (`stts`) are gaps between decode times, not how long a frame is shown once B-frames
        reorder them: its last frame lasts until the track's decode span, counted from `first`, ends. Other
        containers (Matroska's block durations) give how long each frame is shown."""
        if self.latest is None or self.decode_start is None or self.decode_end is None:
            return 0
        if not self.decode_timed:
            return self.latest_duration
        # what the edit list shows, where it says: with B-frames at a variable rate the decode span is no measure
        # (a phone clip's last frame came back 0.188 s long, its edit list showing it 0.037 s)
        if self.presented is not None and self.presented > self.latest - first:
            return self.presented - (self.latest - first)
        end = self.decode_end
        # FFmpeg hands VP9 in MP4 (Chrome's MediaRecorder `video/mp4`) packets of 0 or 1 tick, not its samples'
        # durations: its last frame lasted a tick, and the MP4's edit list, in milliseconds, then cut it off
        if self.latest_duration <= 1 and self.track_duration:
            end = max(end, self.decode_start + self.track_duration)
        return max(0, first + end - self.decode_start - self.latest)


def _presented(path: Path, stream: av.VideoStream) -> int | None:
    """How long an MP4's edit list shows the video track, in the stream's time base (None: not an MP4, no edit list,
    or one PyAV's stream does not name: a track ID is MOV's `stream.id`)."""
    data = movie(path) if stream.time_base else b""
    try:
        shown = presented(data, stream.id) if data else None
    except struct.error:  # a box cut short: the decode span measures it, as before
        return None
    return None if shown is None else round(shown / stream.time_base)


def cut_off(packet: av.Packet, size: int) -> bool:
    """Whether `packet` is the one the end of a `size`-byte file cuts through (a recording that stopped mid-write: a
    phone or OBS crashing, a fragmented MP4 copied while it grew). The demuxer hands over the bytes there are and
    flags the packet corrupt. It holds no whole frame: counted, the video came up frames short only once decoded
    (frame threads drop the frames decoded beside it), after the upscaling; copied, its sound does not decode."""
    return packet.is_corrupt and packet.pos is not None and packet.pos >= 0 and packet.pos + packet.size >= size


def _scan(
    container: av.container.InputContainer,
    stream: av.VideoStream,
    path: Path,
    limits: Limits,
    alive: Callable[[], bool] | None = None,
) -> _Scan:
    mp4 = iso_bmff(container)
    scan = _Scan(decode_timed=mp4, track_duration=stream.duration, presented=_presented(path, stream) if mp4 else None)
    stream.thread_type = "AUTO"
    decode_declared_picture(stream)
    unpack = unpacker(stream)
    second_field = second_fields(stream)
    size = path.stat().st_size
    try:
        for packet in demux(container):
            stop_if_asked(alive)
            if packet.size == 0:
                continue
            if cut_off(packet, size):
                scan.cut_short = True
                continue
            owner = packet.stream
            # every packet: a packager may leave the first seconds clear (Shaka Packager: 5 s) and encrypt the rest
            if packet.has_sidedata("encryption_info"):
                what = "picture" if owner.type == "video" else "sound" if owner.type == "audio" else owner.type
                raise InputEncrypted(
                    f"{path.name}: its {owner.type} is encrypted (DRM: Common Encryption); without its key it decodes "
                    f"to noise, not its {what}: send a copy that is not encrypted"
                )
            if packet.pts is not None and packet.time_base is not None:
                start = float(packet.pts * packet.time_base)
                end = start + float((packet.duration or 0) * packet.time_base)
                if owner.type == "audio" and not packet.duration and owner.index in scan.extents:
                    end = start + start - scan.audio_latest[owner.index]  # as a copy times it (passthrough._Copy)
                scan.end, scan.first = max(scan.end, end), min(scan.first, start)
                if owner.type in ("video", "audio"):  # not a data track's clock (teletext, SCTE-35), nor subtitles
                    scan.earliest, scan.latest_end = min(scan.earliest, start), max(scan.latest_end, end)
                # the sound's too: a second of video with ten hours of it came back ten hours long
                span = scan.latest_end - scan.earliest
                if span > _NO_RECORDING_S and (limits.max_seconds is None or span > limits.max_seconds):
                    raise InputCorrupt(
                        f"{path.name}: its {owner.type}'s timestamps jump {span:.3g} s ahead, longer than any "
                        "recording: they are damaged"
                    )
                if limits.max_seconds is not None and span > limits.max_seconds:
                    raise InputTooLarge(
                        f"{path.name} lasts over {limits.max_seconds:g} s (its {owner.type} spans {span:.0f} s); "
                        f"the limit is {limits.max_seconds:g} s"
                    )
                if owner.type == "audio" and not packet.is_discard:
                    scan.audio_latest[owner.index] = start
                    first, last, longest = scan.extents.get(owner.index, (start, end, 0.0))
                    scan.extents[owner.index] = (min(first, start), max(last, end), max(longest, end - start))
            if owner.index != stream.index:
                continue
            scan.video_packets += 1
            if not scan.keyframe_seen and packet.is_keyframe:
                scan.keyframe_seen, scan.key_pts = True, packet.pts
            shown = not packet.is_discard and not second_field(packet)  # a frame's second field shows no frame
            if scan.keyframe_seen and shown:
                if packet.pts is not None:
                    scan.track(packet)
                scan.timestamps.append(packet.pts)
            elif shown and packet.pts is not None:
                scan.before_key.append(_Timed(packet.pts, packet.dts, packet.duration or 0))
            if limits.max_frames is not None and len(scan.timestamps) + len(scan.before_key) > limits.max_frames:
                raise InputTooLarge(f"{path.name} has more than {limits.max_frames} frames, the limit")
            # Decoded last: `unpack` takes the packet's contents
            if scan.first_frame is None:
                scan.first_frame = next((frame for sent in unpack(packet) for frame in stream.decode(sent)), None)
                _seen(scan, stream, [scan.first_frame] if scan.first_frame else [])
            elif packet.is_keyframe and _sampled(scan, stream, packet):
                _seen(scan, stream, _decoded_key(stream, packet))
        if scan.first_frame is None:  # a decoder with a delay may hold short streams until it is flushed
            scan.first_frame = next((frame for sent in [*unpack(None), None] for frame in stream.decode(sent)), None)
            _seen(scan, stream, [scan.first_frame] if scan.first_frame else [])
        else:
            _seen(scan, stream, _decoded_key(stream, None))
    except AVError as error:
        raise InputCorrupt(f"{path.name} cannot be read to the end ({reason(error)})") from None
    if scan.first_frame is None:
        raise InputCorrupt(f"{path.name} holds no decodable video frame")
    _leading(scan, path, stream.index)
    # MP4/MOV index every sample, so fewer packets than indexed means a cut file (AVI headers count empty chunks).
    declared = stream.frames if "mp4" in container.format.name else 0
    if declared and scan.video_packets < declared:
        held = _packets_held(path, stream.index)
        if held < declared:
            raise InputCorrupt(f"{path.name} is truncated: its index lists {declared} frames, the file holds {held}")
    # Matroska declares its duration in the header: a file that ends well before it was cut short. The duration counts
    # from the earliest packet, which a codec's priming puts before 0 (MP3 at 8 kHz: 138 ms).
    held = scan.end - scan.first
    if "matroska" in container.format.name and container.duration and held < container.duration / 1e6 - 0.1:
        raise InputCorrupt(
            f"{path.name} is truncated: it declares {container.duration / 1e6:.2f} s, the file holds {held:.2f} s"
        )
    return scan


def _sampled(scan: _Scan, stream: av.VideoStream, packet: av.Packet) -> bool:
    """Whether to decode this keyframe for its size. A stream changes size only at a keyframe (H.264's and HEVC's
    new SPS comes with an IDR: a screen recorder following a window, a live stream switching quality), and decoded
    alone a keyframe costs one frame a GOP. Codecs whose every frame is a keyframe (MJPEG, ProRes, DV) would be
    decoded whole: one a second of them."""
    if not stream.codec_context.codec.intra_only:
        return True
    if packet.pts is None or packet.time_base is None:
        return False
    seconds = float(packet.pts * packet.time_base)
    if scan.sampled is not None and abs(seconds - scan.sampled) < 1:
        return False
    scan.sampled = seconds
    return True


def _decoded_key(stream: av.VideoStream, packet: av.Packet | None) -> list[av.VideoFrame]:
    """The frames the decoder hands over for the keyframe `packet` (None: those it still holds), sent without the
    frames between it and the last one sent. Only their sizes are wanted: a keyframe that does not decode alone (an
    open GOP's, concealed) is no reason to refuse a file the reader decodes in order."""
    try:
        return stream.decode(packet)
    except AVError:
        return []


def _seen(scan: _Scan, stream: av.VideoStream, frames: list[av.VideoFrame]) -> None:
    """What the decoded keyframes show: each size (and its shape), and whether any is interlaced."""
    for frame in frames:
        scan.interlaced_seen |= bool(frame.interlaced_frame)
        if (frame.width, frame.height) not in scan.sizes:
            sar = stream.codec_context.sample_aspect_ratio  # the decoder's, as of this frame (the reader's `_shape`)
            shape = frame.width * (Fraction(sar) if sar and sar > 0 else 1) / Fraction(frame.height)
            scan.sizes[frame.width, frame.height] = shape


def _leading(scan: _Scan, path: Path, index: int) -> None:
    """Count the frames at the stream's head that exist: those the decoder shows. Two kinds may not:
    - frames decoded before the first keyframe: a recording cut mid-GOP starts with frames that refer back to
      pictures not there, which decoders drop; but an animated PNG's demuxer flags a frame key only where it
      replaces the whole canvas, and its first frames, drawn on an empty one, are all shown (counted from the first
      key, one with none had no frames at all: input_too_short);
    - frames shown before the first keyframe but decoded after it: a file that starts at an open GOP's keyframe
      (x265's CRA by default, x264's `open-gop`: a Matroska file split or a recording started mid-stream) holds
      leading frames that refer back to the GOP before it; the decoder drops those (HEVC's RASL), shows the rest.
    Counted otherwise, the frames came up short or long only once decoded, after the upscaling (input_corrupt)."""
    key = scan.key_pts
    leading = {t for t in scan.timestamps if t is not None and key is not None and t < key}
    early = {timed.pts for timed in scan.before_key}
    if not leading and not early:
        return
    shown = _decoded_times(path, index, leading | early)
    scan.timestamps = [t for t in scan.timestamps if t not in leading - shown]
    kept = [timed for timed in scan.before_key if timed.pts in shown]
    scan.undecodable = len(leading - shown) + len(scan.before_key) - len(kept)
    for timed in kept:
        scan.track(timed)
    scan.timestamps[:0] = [timed.pts for timed in kept]


def _decoded_times(path: Path, index: int, leading: set[int]) -> set[int]:
    """The presentation times the decoder outputs from the start of a stream, decoded as the reader decodes, up to
    a reorder buffer past the last of the `leading` frames (`_leading`)."""
    size = path.stat().st_size
    shown: set[int] = set()
    try:
        with open_input(path) as container:
            stream = container.streams[index]
            stream.thread_type = "AUTO"
            decode_declared_picture(stream)
            unpack = unpacker(stream)
            left, after = len(leading), 0
            for packet in demux(container, stream):
                if not packet.size or cut_off(packet, size):
                    continue
                left -= packet.pts in leading
                shown.update(frame.pts for sent in unpack(packet) for frame in stream.decode(sent))  # takes the packet
                after += left <= 0
                if after > REORDER:
                    break
            shown.update(frame.pts for frame in stream.decode(None))
    except AVError as error:
        raise InputCorrupt(f"{path.name}: its first frames cannot be decoded ({reason(error)})") from None
    return shown


def _packets_held(path: Path, index: int) -> int:
    """The stream's packets in the file, its edit list ignored. An edit that starts the media a GOP or more in (a trim
    kept without re-encoding: `ffmpeg -ss … -c copy`, QuickTime's) makes the demuxer skip those samples unread, so
    fewer packets than the index lists is no sign of a cut file until they are counted without it."""
    try:
        with open_input(path, options={"ignore_editlist": "1"}) as container:
            return sum(1 for packet in demux(container, container.streams[index]) if packet.size)
    except AVError as error:
        raise InputCorrupt(f"{path.name} cannot be read to the end ({reason(error)})") from None


def decode_declared_picture(stream: av.VideoStream) -> None:
    """Make the decoder hand over exactly the picture the stream declares. Codecs that crop their coded frame
    (Theora's picture offset, H.264's left crop) otherwise crop the left edge only to a 32-byte boundary: a 214 px
    Theora picture comes out 218 px wide, its left columns black."""
    stream.codec_context.flags |= av.codec.context.Flags.unaligned


def _sample_aspect(stream: av.VideoStream, rotation: int) -> Fraction:
    """The pixel aspect ratio as ffprobe reads it (the container's, else the codec's), turned with the picture."""
    sar = stream.sample_aspect_ratio or stream.codec_context.sample_aspect_ratio
    sar = Fraction(sar) if sar and sar > 0 else Fraction(1)
    return 1 / sar if rotation in (90, 270) else sar


def _orientation(frame: av.VideoFrame) -> tuple[int, bool]:
    """(degrees counter-clockwise, mirrored): how the frame's display matrix turns it, then flips it left to right,
    as ffmpeg and players apply it. A matrix that mirrors has a negative determinant; `frame.rotation` reads such
    a matrix as a turn (a mirror as 180 degrees, an upside-down mirror as none), so the turn is read from the
    matrix with its mirror undone.

    Read off a 2x2 copy (which keeps the side data): PyAV's side data and the frame it is read from hold each other,
    so that frame, and the decoder's buffer pool its pixels come from, would wait for the cyclic collector: the
    worker's resident memory grew job after job (tests/service/test_worker_memory.py)."""
    try:
        copy = frame.reformat(width=2, height=2)
    except (*AVError, ValueError):  # a format swscale cannot shrink: the turn PyAV reads, no mirror
        return round(frame.rotation / 90) * 90 % 360, False
    entries = side_data(copy)
    if entries is None:  # with a type PyAV cannot name (MV-HEVC's view id): the turn PyAV reads itself, no mirror
        return round(frame.rotation / 90) * 90 % 360, False
    data = entries.get(SideData.DISPLAYMATRIX)
    if data is None:
        return 0, False
    a, b, _, c, d, *_ = struct.unpack("=9i", bytes(data))
    mirrored = a * d - b * c < 0
    if mirrored:  # av_display_matrix_flip negates the first column: negated again, a rotation is left
        a, c = -a, -c
    degrees = -math.degrees(math.atan2(b, a))  # av_display_rotation_get
    return round(degrees / 90) * 90 % 360, mirrored


def _hdr10(frame: av.VideoFrame) -> tuple[str | None, tuple[int, int] | None]:
    """(mastering display, (MaxCLL, MaxFALL)) of an HDR10 frame: what players tone-map PQ by. The mastering display
    is written as x265's `master-display` takes it: chromaticities in 0.00002, luminance in 0.0001 cd/m², green, blue,
    red (HEVC's SEI order; FFmpeg keeps red, green, blue). Read off a 2x2 copy, as `_orientation` reads its matrix."""
    try:
        copy = frame.reformat(width=2, height=2)
    except (*AVError, ValueError):
        return None, None
    mastering = light = None
    entries = side_data(copy) or {}
    data = entries.get(SideData.MASTERING_DISPLAY_METADATA)
    if data is not None:
        fields = struct.unpack("=22i", bytes(data)[:88])
        value = [Fraction(fields[i], fields[i + 1]) if fields[i + 1] else Fraction(0) for i in range(0, 20, 2)]
        if fields[20] and fields[21]:  # it has both primaries and luminance
            (rx, ry, gx, gy, bx, by, wx, wy), (low, high) = (round(v * 50000) for v in value[:8]), (round(v * 10000) for v in value[8:])
            mastering = f"G({gx},{gy})B({bx},{by})R({rx},{ry})WP({wx},{wy})L({high},{low})"
    data = entries.get(SideData.CONTENT_LIGHT_LEVEL)
    if data is not None:
        light = struct.unpack("=2I", bytes(data)[:8])
    return mastering, light


def _stereo(stream: av.VideoStream, path: Path) -> bool:
    """Whether an MP4's HEVC track holds a second view, one per eye (MV-HEVC: an iPhone's or a Vision Pro's spatial
    video): its sample description configures the extra layer (`lhvC`). FFmpeg decodes the first view alone."""
    if _codec(stream) != "hevc" or not iso_bmff(stream.container):
        return False
    data = movie(path)
    return any(b"lhvC" in data[start:end] for start, _, end in children(data, 8, len(data), b"stsd"))


def _video_info(stream: av.VideoStream, scan: _Scan, path: Path, limits: Limits) -> VideoInfo:
    frame = scan.first_frame
    rotation, mirrored = _orientation(frame)
    mastering, light_level = _hdr10(frame)
    # Sized for the part with the most pixels: sized from the first part, a recording that turned from 320x240 to
    # 640x480 lost half its later part's resolution before the upscaling. Smaller parts are scaled up to it, as a
    # player shows them full screen (reader.read_frames), in their own shape.
    stored = max(scan.sizes, key=lambda size: size[0] * size[1], default=(frame.width, frame.height))
    canvas_shape = scan.sizes[stored] if stored != (frame.width, frame.height) else None
    width, height = (stored[1], stored[0]) if rotation in (90, 270) else stored
    _check_pixels(width, height, path, limits)
    frames = len(scan.timestamps)
    if frames < limits.min_frames:
        raise InputTooShort(f"{path.name} has {frames} frame(s): a still image, not a video (at least {limits.min_frames})")
    time_base = stream.time_base or Fraction(1, 90000)
    retimed = _check_order(scan.timestamps, time_base, path)
    declared = [stream.average_rate, stream.base_rate, stream.guessed_rate]
    clock = _frame_clock(declared, scan.timestamps, time_base, scan.last_duration, path, limits)
    return VideoInfo(
        index=stream.index,
        codec=_codec(stream),
        width=width,
        height=height,
        rotation=rotation,
        pix_fmt=frame.format.name,
        bit_depth=max(component.bits for component in frame.format.components),
        color_matrix=frame.colorspace,
        color_range=frame.color_range,
        color_primaries=frame.color_primaries,
        color_trc=frame.color_trc,
        frames=frames,
        **clock,
        time_base=time_base,
        language=stream.language,
        sar=_sample_aspect(stream, rotation),
        interlaced=bool(frame.interlaced_frame),
        turns_interlaced=scan.interlaced_seen and not frame.interlaced_frame,
        mirrored=mirrored,
        sizes=tuple(scan.sizes) if len(scan.sizes) > 1 else (),
        canvas_shape=canvas_shape,
        timecode=stream.metadata.get("timecode"),
        alpha_beside=alpha_beside(stream),
        stereo=_stereo(stream, path),
        retimed=retimed,
        presented=_presented_times(scan.timestamps, bool(stream.codec_context.has_b_frames)) if not retimed else (),
        undecodable=scan.undecodable,
        mastering=mastering,
        light_level=light_level,
    )


def _presented_times(pts: list[int | None], reordered: bool) -> tuple[int, ...]:
    """`pts` (decode order) in presentation order, where every frame has a timestamp (else empty: nothing to place
    frames by; `_check_order` refused repeated ones). Empty too where the decoder reorders frames (`reordered`:
    B-frames) but the timestamps rise in decode order: decode times stored as presentation times (`ffmpeg -c copy`
    from an AVI, an MP4 without `ctts`), which the decoder's frames carry shuffled (0, 80, 120, 40...), as if frames
    were missing."""
    if None in pts:
        return ()
    if reordered and all(earlier < later for earlier, later in zip(pts, pts[1:])):
        return ()
    return tuple(sorted(pts))


def _frame_clock(
    declared: Sequence[Fraction | None],
    pts: list[int | None],
    time_base: Fraction,
    last_duration: Callable[[int], int],
    path: Path,
    limits: Limits,
) -> dict:
    """`VideoInfo`'s timing fields for frames presented at `pts` (decode order, in `time_base`; None: a raw stream
    timed by the `declared` rates, tried first): fps, cfr, pulldown, start, duration, timestamps, last_duration.
    `last_duration(first)` says how long the last frame lasts (0: the file does not say)."""
    fps, cfr, timestamps = _timing(declared, pts, time_base)
    film = None if cfr else _pulled_down(timestamps, time_base)
    fps, cfr = (film, True) if film else (fps, cfr)
    if limits.max_fps is not None and fps > limits.max_fps:
        raise InputTooLarge(f"{path.name} runs at {float(fps):g} fps; the limit is {limits.max_fps:g} fps")
    first, frames = (timestamps[0] if timestamps else 0), len(pts)
    # The last frame of a variable rate lasts as the file says (a screen recording's last frame after a pause is not
    # as long as an average one), else as long as an average one.
    last = 0 if cfr else last_duration(first)
    if cfr:
        duration = frames / fps
    elif last:
        duration = float((timestamps[-1] - first + last) * time_base)
    else:
        duration = float((timestamps[-1] - first) * time_base) * frames / (frames - 1)
    if limits.max_seconds is not None and duration > limits.max_seconds:
        raise InputTooLarge(f"{path.name} lasts {duration:.0f} s; the limit is {limits.max_seconds:.0f} s")
    return {
        "fps": fps,
        "cfr": cfr,
        "pulldown": film is not None,
        "start": float(first * time_base),
        "duration": float(duration),
        "timestamps": () if cfr else tuple(t - first for t in timestamps),
        "last_duration": last,
    }


def _check_order(pts: list[int | None], time_base: Fraction, path: Path) -> int:
    """Each frame's presentation time (decode order) is its own, and is later than all but at most REORDER of the
    frames decoded before it (what a decoder's reorder buffer bounds; how long before their turn those were decoded
    is not bounded: VVenC's keyframes come 23 frames early, and were taken for a restart). Recordings joined end to
    end (`cat a.ts b.ts`) start their clock over: frames then repeat times or run back behind the whole first
    recording, which no MP4 can hold (its muxer refused them after all the upscaling was done).

    A lone frame whose time runs back while the frames after it go on (a muxer's slip: one bad timestamp) is no
    restart: it was refused as one. Its time is put between the frames decoded beside it, in place (frames come out
    of the decoder in their own order; only which times they get changes); returns how many were."""
    if None in pts:  # raw streams: timed by their declared rate
        return 0
    retimed = 0
    latest = None  # the latest time of the frames decoded more than REORDER before this one
    later: list[int] = []  # the REORDER + 1 latest times of the frames decoded before this one (a min-heap)
    for index, time in enumerate(pts):
        if index > REORDER:
            earlier = pts[index - REORDER - 1]
            latest = earlier if latest is None else max(latest, earlier)
        if len(later) > REORDER and time <= later[0]:  # shown before more frames decoded earlier than a buffer holds
            if index + 1 < len(pts) and pts[index + 1] > max(latest, pts[index - 1]):
                before, after = max(pts[index - REORDER - 1 : index]), pts[index + 1]
                between = (before + after) // 2 if after - before > 1 else None
                if between is not None and between not in pts:
                    pts[index] = time = between
                    retimed += 1
            if time <= later[0]:
                ended = max(pts[:index])  # where the first recording ends
                raise InputCorrupt(
                    f"{path.name}: frame {index + 1}'s timestamp ({float(time * time_base):.3f} s) comes before "
                    f"frames decoded earlier (up to {float(ended * time_base):.3f} s): its clock starts over, as in "
                    "recordings joined end to end; join them with a tool that re-times them, or send them one by one"
                )
        (heapq.heappushpop if len(later) > REORDER else heapq.heappush)(later, time)
    retimed += _check_ahead(pts, time_base, path)
    if len(set(pts)) < len(pts):
        raise InputCorrupt(f"{path.name}: {len(pts) - len(set(pts))} frame(s) repeat another frame's timestamp")
    return retimed


def _check_ahead(pts: list[int], time_base: Fraction, path: Path) -> int:
    """No frame is shown after more than SHOWN_AFTER of the frames decoded after it: no decoder reorders that far,
    and one frame a muxer timed an hour late held the output's last frame for an hour. A lone one, whose neighbours
    go on, is put between them, as a lone frame timed early is; any other is refused. Returns how many were retimed."""
    retimed = 0
    earliest: list[int] = []  # the SHOWN_AFTER + 1 earliest times of the frames decoded after this one (negated)
    ahead = set()
    for index in range(len(pts) - 1, -1, -1):
        if len(earliest) > SHOWN_AFTER and pts[index] > -earliest[0]:
            ahead.add(index)
        (heapq.heappushpop if len(earliest) > SHOWN_AFTER else heapq.heappush)(earliest, -pts[index])
    for index in sorted(ahead):  # in decode order
        lone = 0 < index < len(pts) - 1 and not {index - 1, index + 1} & ahead
        if lone and pts[index + 1] - pts[index - 1] > 1:
            between = (pts[index - 1] + pts[index + 1]) // 2
            if between not in pts:
                pts[index] = between
                retimed += 1
                continue
        raise InputCorrupt(
            f"{path.name}: frame {index + 1}'s timestamp ({float(pts[index] * time_base):.3f} s) is later than more "
            f"than {SHOWN_AFTER} frames decoded after it: the file's timestamps are broken; remux it with a tool "
            "that re-times its frames"
        )
    return retimed


def _timing(
    declared_rates: Sequence[Fraction | None], pts: list[int | None], time_base: Fraction
) -> tuple[Fraction, bool, list[int]]:
    """(frame rate, constant?, sorted timestamps). Constant when every frame sits on one rate's grid, to within the
    time base's rounding or 5 % of a frame; the stream's declared rates are tried first, then the measured one."""
    declared = [rate for rate in declared_rates if rate and 0 < rate <= 1000]
    if None in pts or len(pts) < 2:  # raw streams carry no timestamps: trust the declared rate
        return (declared[0] if declared else Fraction(24)), True, []
    timestamps = sorted(pts)
    span = (timestamps[-1] - timestamps[0]) * time_base
    if span <= 0:
        raise InputCorrupt(f"{len(pts)} frames share one timestamp")
    measured = (Fraction(len(timestamps) - 1) / span).limit_denominator(1001)
    seconds = [float((t - timestamps[0]) * time_base) for t in timestamps]
    for rate in [*declared, measured]:
        step = 1 / float(rate)
        tolerance = max(0.6 * float(time_base), step / 20)  # rounding to the time base, or a little jitter
        if all(math.fabs(t - i * step) <= tolerance for i, t in enumerate(seconds)):
            return Fraction(rate), True, timestamps
    return measured, False, timestamps


# The film rates 3:2 pulldown carries at NTSC's 59.94 fields a second, or at 60
FILM_RATES = (Fraction(24000, 1001), Fraction(24))


def _pulled_down(timestamps: list[int], time_base: Fraction) -> Fraction | None:
    """The film rate of soft-telecined film, else None. A DVD's or an ATSC broadcast's film is coded as the film's
    own progressive frames, flagged to be shown for three fields and two in turn (MPEG-2's repeat_first_field,
    H.264's pic_struct): the decoder gives the film's frames, but the container times each one as long as its
    fields, 2.5 of them on average. Read at those times, the output keeps the 3:2 judder and a variable rate; at the
    film's rate every frame is within half a field of its time (8.3 ms), the sound's sync with it."""
    if len(timestamps) < 3:
        return None
    seconds = [float((t - timestamps[0]) * time_base) for t in timestamps]
    for film in FILM_RATES:
        field = 1 / (2.5 * float(film))
        slack = max(0.6 * float(time_base), field / 20)  # rounding to the time base, or a little jitter
        steps = [(later - earlier) / field for earlier, later in zip(seconds, seconds[1:])]
        if not all(abs(step - round(step)) * field <= slack and round(step) in (2, 3) for step in steps):
            continue
        # and three and two in turn: a run of one length drifts off the film's grid
        if all(abs(t - i / float(film)) <= field / 2 + slack for i, t in enumerate(seconds)):
            return film
    return None


def _audio_info(stream: av.AudioStream, extent: tuple[float, float, float] | None) -> AudioInfo:
    context = stream.codec_context
    start, end, longest = extent or (0.0, 0.0, 0.0)
    if stream.start_time is not None and stream.time_base is not None:
        # Where the demuxer says the stream starts (ffprobe's start_time), where packets claim earlier: Ogg works
        # packet times back from its pages' end, and can put a stream's first packets seconds before 0.
        start = min(max(start, float(stream.start_time * stream.time_base)), end)
    return AudioInfo(
        index=stream.index,
        codec=_codec(stream),
        sample_rate=context.sample_rate if context else 0,
        channels=context.channels if context else 0,
        layout=context.layout.name if context else "unknown",
        start=start,
        duration=end - start,
        packet_seconds=longest,
        language=stream.language,
        title=stream.metadata.get("title"),
    )
