"""Decode a video as a stream of RGB frames, as they are meant to be seen: interlaced frames deinterlaced, rotation
and mirror applied, colour converted with the stream's own matrix and range, transparency shown over the job's
background (animated WebP, which FFmpeg cannot decode, through libwebp). Memory stays at one frame (plus whatever a
consumer buffers, and the one frame the deinterlacer looks ahead)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, replace
from fractions import Fraction
from itertools import islice
from pathlib import Path
from typing import TypeVar

import av
import numpy as np
from av.video.reformatter import ColorRange, Colorspace, Interpolation, VideoReformatter

from worker.media import alpha_track, webp
from worker.media.errors import InputCorrupt, InputTooLarge
from worker.media.probe import AVError, VideoInfo, cut_off, decode_declared_picture, reason
from worker.media.side_data import SideData, side_data
from worker.media.source import decoder, demux, open_input, unpacker

T = TypeVar("T")
_UNSPECIFIED = 2  # AVCOL_SPC_UNSPECIFIED
# FFmpeg's AVFieldOrder, by the field shown first: TT and BT show the top one first, BB and TB the bottom one.
PARITY = {2: "tff", 5: "tff", 3: "bff", 4: "bff"}
# How frames are read, for what is keyed on the frames read (kept windows): windows computed from interlaced frames
# read otherwise (as stored, before deinterlacing), from a stream that changes size read at its first part's size, or
# from packed B-frames read packed (every B-frame dropped), or from a source deeper than 8 bits kept at 8 bits (before
# 10-bit outputs), or with their alpha dropped (before it was shown over black), or 8-bit pictures converted by
# swscale's fast path, are never replayed beside these.
READING = ("interlaced frames deinterlaced: bwdif send_frame; sized for the largest part; packed B-frames unpacked; "
           "deeper sources kept at 16 bits; alpha shown over black; 8-bit YUV to RGB exact")
BLACK = (0, 0, 0)  # what transparent pixels are shown over unless a job names another `background`
# swscale's fast 8-bit YUV -> RGB path rounds early, every colour a few levels off; its exact one costs a few ms more
# a frame (bench/RESULTS.md, "Reading 8-bit pictures in their colours")
EXACT_8_BIT = Interpolation.BILINEAR | Interpolation.ACCURATE_RND | Interpolation.FULL_CHR_H_INT


@dataclass
class Reading:
    """What `read_frames` met, counted as it reads: the frames flagged interlaced (each one deinterlaced) and the
    field order they were read in ("auto": each frame's own flag); the frames with a transparent pixel (composited
    over the background: `_over`); the frames carrying closed captions in the video stream (CEA-608/708, A/53), which
    the output cannot carry (PyAV gives no way to attach them to a frame it encodes); the frames of a damaged file it
    could not decode, and those it concealed damage in."""

    interlaced: int = 0
    parity: str | None = None
    transparent: int = 0
    captions: int = 0
    # the frames the decoder could not give (damage in the file: it skipped them, or failed on their data), each
    # shown as the frame before it (`_Timeline`); and those it gave flagged corrupt (its concealment of damage)
    repeated: int = 0
    damaged: int = 0


# How an interlaced source becomes progressive frames: one for each source frame (its rate), one for each field (twice
# it), or telecined film's own frames back (inverse telecine: four of every five, 29.97 -> 23.976)
CADENCES = ("frame", "field", "film")
TELECINE_RATES = (Fraction(30000, 1001), Fraction(30))  # NTSC's (some files round it: 2997/100), its integer twin


def at_cadence(video: VideoInfo, cadence: str) -> VideoInfo | None:
    """`video` as `read_frames(..., cadence=cadence)` reads it, where it changes the frames: at `field`, twice the
    frames at twice the rate; at `film`, four of every five (decimate keeps a last short cycle whole) at 4/5 the rate;
    the same span of time (at `film`, to within a source frame where the count is not a multiple of five). None
    where the cadence is not offered, so the frames are read at the frame rate: a frame per field needs an interlaced
    source (its first frame, or a later keyframe the probe decoded: the frames before it are shown twice); either
    needs a constant rate (no instants to put the frames at); film needs NTSC's rate, the only one 3:2 pulldown
    makes."""
    if cadence == "field" and (video.interlaced or video.turns_interlaced) and video.cfr:
        return replace(video, frames=2 * video.frames, fps=2 * video.fps)
    if cadence == "film" and video.cfr and any(abs(video.fps - rate) < Fraction(1, 100) for rate in TELECINE_RATES):
        return replace(video, frames=video.frames - video.frames // 5, fps=video.fps * Fraction(4, 5))
    return None


def telecined(path: str | Path, video: VideoInfo, frames: int = 60) -> bool:
    """Whether an interlaced NTSC-rate source looks like telecined film: in its first `frames` frames, libavfilter's
    idet finds a field repeated from the frame before in at least a quarter of them (3:2 pulldown repeats one in two
    of every five; genuinely interlaced video, none). A separate pass: idet rewrites the interlaced flags that bwdif
    reads, so it never runs on the frames that are upscaled."""
    if not video.interlaced or at_cadence(video, "film") is None:
        return False
    repeated = analysed = 0
    try:
        with open_input(path) as container:
            stream = container.streams[video.index]
            decode_declared_picture(stream)
            graph = None
            for frame in islice(_decode(container, stream, Path(path).stat().st_size), frames):
                graph = graph or _chain(frame, [("idet", "")])
                graph.push(frame)
                for out in _ready(graph):
                    analysed += 1
                    repeated += out.metadata.get("lavfi.idet.repeated.current_frame", "neither") != "neither"
    except (AVError, ValueError):  # a frame of another size or format mid-way: too odd a source to guess at
        return False
    return analysed >= 10 and repeated * 4 >= analysed


def read_frames(
    path: str | Path,
    video: VideoInfo,
    reading: Reading | None = None,
    cadence: str = "frame",
    background: tuple[int, int, int] = BLACK,
    max_pixels: int | None = None,
) -> Iterator[np.ndarray]:
    """Every frame of the probed `video` stream in presentation order, (H, W, 3) RGB: uint8, or uint16 (full 16-bit
    scale) for sources deeper than 8 bits. Frames flagged interlaced are deinterlaced (`reading` counts them); at the
    `field` cadence two frames come out of every source frame, one at each field's instant, at `film` four of every
    five, telecine undone (`video` then counts them: `at_cadence`). Frames with an alpha channel are composited over
    `background` (8-bit RGB; `reading` counts those it made a difference to). Raises `InputCorrupt` if decoding fails
    or yields another frame count (a tenth of them missing: `_Timeline`), `InputTooLarge` for a frame over
    `max_pixels` the probe did not see (it decodes an intra-only codec's keyframes once a second: MJPEG's others of
    12000x12000 took a worker to 4.5 GB)."""
    reading = reading or Reading()
    if video.codec == "webp":  # animated WebP: FFmpeg cannot decode it (`webp`)
        pictures = (_over(rgba, background, reading, video.codec) for rgba in webp.read(Path(path)))
    else:
        pictures = _pictures(path, video, reading, cadence, background, max_pixels)
    count = 0
    try:
        for pixels in pictures:
            count += 1
            if count > video.frames:
                break
            yield pixels
    except AVError as error:
        name = Path(path).name
        raise InputCorrupt(f"{name}: its video does not decode past frame {count} ({reason(error)})") from None
    finally:
        pictures.close()
    if count != video.frames:
        raise InputCorrupt(f"{Path(path).name}: decoded {count} frames, the container holds {video.frames}")


def _pictures(
    path: str | Path,
    video: VideoInfo,
    reading: Reading,
    cadence: str,
    background: tuple[int, int, int],
    max_pixels: int | None = None,
) -> Iterator[np.ndarray]:
    """The frames FFmpeg decodes, as `read_frames` hands them on (it counts them)."""
    pixel_format, with_alpha = ("rgb24", "rgba") if video.bit_depth <= 8 else ("rgb48le", "rgba64le")
    interpolation = EXACT_8_BIT if video.bit_depth <= 8 else None
    turns = video.rotation // 90
    # Stored frames are the displayed ones before rotation; a stream that changes size mid-way is scaled to the size
    # of its largest part (probe: `VideoInfo.sizes`), its parts of another shape kept in shape (`_inside`).
    width, height = (video.height, video.width) if turns % 2 else (video.width, video.height)
    first = video.canvas_shape  # the shape of the part the picture is sized for (as shown: width x pixel aspect /
    # height), else the first frame's
    # One swscale context for the stream: `frame.to_ndarray(format=...)` makes one per frame, and with it swscale's
    # slice threads (one per core), started and joined for every frame. The conversion is the same either way.
    reformatter = VideoReformatter()
    # an animated AVIF's alpha comes from a track of its own, a frame for each of the colour track's
    alphas = alpha_track.frames(path, video.alpha_index)
    shown: np.ndarray | None = None
    with open_input(path) as container, closing(alphas):
        # AVI's timestamps are its packets' order, which packed B-frames shuffle (FFmpeg's decoded pts 1, 3, 2, 5, 4);
        # an animated AVIF's alpha frames come one for each colour frame decoded, which a filled place would skew
        placed = cadence == "frame" and container.format.name != "avi" and video.alpha_index is None
        timeline = _Timeline(video, reading, Path(path).name) if placed else None
        stream = container.streams[video.index]
        stream.thread_type = "AUTO"
        decode_declared_picture(stream)
        frames = _decode(container, stream, Path(path).stat().st_size, passing=bool(timeline and timeline.places))
        for frame in _deinterlaced(_damage_counted(frames, reading), stream, reading, cadence):
            missing = timeline.missing_before(_in_stream_time(frame, stream)) if timeline else 0
            if missing == LATE:
                continue
            if max_pixels is not None and frame.width * frame.height > max_pixels:
                raise InputTooLarge(
                    f"{Path(path).name} has a frame of {frame.width}x{frame.height} at {float(frame.time or 0):.3f} s; "
                    f"the limit is {max_pixels / 1e6:.1f} Mpx per frame"
                )
            colour = _source_colour(frame)
            shape = _shape(frame, stream)
            first = shape if first is None else first
            resized = (frame.width, frame.height) != (width, height)
            inner = _inside(width, height, shape / first) if resized else None
            alpha = any(component.is_alpha for component in frame.format.components)
            pixels = reformatter.reformat(
                frame, *(inner or (width, height)), with_alpha if alpha else pixel_format, **colour,
                interpolation=interpolation,
            ).to_ndarray()
            pixels = _over(pixels, background, reading, video.codec) if alpha else pixels
            if (alpha_frame := next(alphas, None)) is not None:
                values = alpha_track.values(alpha_frame, pixels.dtype, pixels.shape[1], pixels.shape[0])
                pixels = _over(np.dstack([pixels, values]), background, reading, "avif")
            pixels = pixels if inner is None else _boxed(pixels, width, height)
            upright = np.rot90(pixels, turns) if turns else pixels
            upright = np.fliplr(upright) if video.mirrored else upright
            for _ in range(missing):  # the first frame stands in for any missing before it
                yield (upright if shown is None else shown).copy()
            shown = np.ascontiguousarray(upright)  # `pixels` itself where nothing turned or flipped it
            yield shown
    for _ in range(timeline.missing_after() if timeline and shown is not None else 0):
        yield shown.copy()


def _damage_counted(frames: Iterator[av.VideoFrame], reading: Reading) -> Iterator[av.VideoFrame]:
    """`frames` as decoded, those the decoder flagged corrupt (damage it concealed) counted, one each."""
    for frame in frames:
        reading.damaged += frame.is_corrupt
        yield frame


def _in_stream_time(frame: av.VideoFrame, stream: av.VideoStream) -> int | None:
    """The frame's timestamp in its stream's time base: bwdif's frames are in another (1/180000 for 1/90000)."""
    if frame.pts is None or frame.time_base in (None, stream.time_base):
        return frame.pts
    exact = frame.pts * frame.time_base / stream.time_base
    return exact.numerator if exact.denominator == 1 else None


LATE = -1  # `_Timeline.missing_before`: a frame whose place was filled before it came


class _Timeline:
    """Where each frame the decoder gives belongs among the frames the probe counted, by its timestamp (`presented`):
    so that a frame it did not give is found where it was missing. A damaged file's decoder skips the frames whose data
    it cannot use (an MPEG-TS with a chunk lost: 120 of 133), and players show the frame before instead; counted only
    at the end, the job failed after all its windows had run. A tenth of the frames missing is a file too damaged to
    upscale, refused as soon as it is met."""

    def __init__(self, video: VideoInfo, reading: Reading, name: str) -> None:
        placed = len(video.presented) == video.frames  # else: frames it reads otherwise, or timestamps it lacks
        self.places = {pts: index for index, pts in enumerate(video.presented)} if placed else {}
        self.frames, self.reading, self.name = video.frames, reading, name
        self.next = 0
        self.filled: set[int] = set()

    def missing_before(self, pts: int | None) -> int:
        """How many frames were missing before the frame decoded at `pts`; LATE where it is one of them, given after
        the frames that follow it (a damaged stream's decoder can): its place holds the frame before it already."""
        place = self.places.get(pts) if pts is not None else None
        if place is not None and place < self.next:
            if place in self.filled:
                self.filled.discard(place)
                return LATE
            self.places = {}  # timestamps out of order: nothing more is placed by them
        if place is None or not self.places:  # not placed: it is the next frame
            self.next += 1
            return 0
        missing, self.next = place - self.next, place + 1
        self.filled.update(range(place - missing, place))
        return self._count(missing)

    def missing_after(self) -> int:
        """How many frames are missing after the last one decoded."""
        return self._count(max(0, self.frames - self.next)) if self.places else 0

    def _count(self, missing: int) -> int:
        self.reading.repeated += missing
        if self.reading.repeated > max(1, self.frames // 10):
            raise InputCorrupt(
                f"{self.name}: over a tenth of its {self.frames} frames do not decode ({self.reading.repeated} missing "
                f"by frame {self.next}): the file is too damaged to upscale"
            )
        return missing


# Codecs whose alpha is always meant (animations for the web): a frame of theirs transparent everywhere is a blank
# frame of the animation (a sticker fading in starts with one), not an alpha channel left unused.
_WEB_ALPHA = frozenset({"gif", "apng", "webp", "vp8", "vp9", "avif"})
# VP8/VP9's lossy alpha rounds an opaque picture's to 246-254 (Chrome's MediaRecorder, whose canvas capture keeps an
# alpha channel, in its first keyframes): shown over the background as it is, but no transparency to tell a user about
NEARLY_OPAQUE = 240 / 255


def _over(rgba: np.ndarray, background: tuple[int, int, int], reading: Reading, codec: str) -> np.ndarray:
    """RGB of an RGBA frame (straight alpha, as FFmpeg and libwebp give it) shown over `background` (8-bit RGB: black
    unless the job names another; dark line art over black all but vanished). MP4 has no alpha:
    dropped, a transparent pixel showed whatever colour its file left under it (a GIF's transparent palette entry:
    white, magenta, ...) and soft edges lost their fade. A frame transparent everywhere, in a `codec` not made for
    the web, has an alpha channel it does not use (uncompressed 32-bit AVI, as VirtualDub and Windows capture tools
    write it: FFmpeg reads it as BGRA with alpha 0): it is shown as it is, as browsers show such a BMP; unless an
    earlier frame of the stream was partly transparent (a ProRes 4444 title fading out), which says the alpha is used.
    """
    rgb, alpha = rgba[..., :3], rgba[..., 3:]
    top = np.iinfo(rgba.dtype).max
    if alpha.min() == top or (alpha.max() == 0 and codec not in _WEB_ALPHA and not reading.transparent):
        return np.ascontiguousarray(rgb)
    reading.transparent += bool(alpha.min() < (top * NEARLY_OPAQUE if codec in ("vp8", "vp9") else top))
    wide = np.uint64 if rgba.dtype == np.uint16 else np.uint32
    under = np.array(background, dtype=wide) * (top // 255)  # 8-bit to the frame's scale (x257 at 16 bits)
    return ((rgb.astype(wide) * alpha + under * (top - alpha) + top // 2) // top).astype(rgba.dtype)


def _shape(frame: av.VideoFrame, stream: av.VideoStream) -> Fraction:
    """The frame's shape as shown: width x pixel aspect (the decoder's, as of this frame) / height."""
    sar = stream.codec_context.sample_aspect_ratio
    return frame.width * (Fraction(sar) if sar and sar > 0 else 1) / Fraction(frame.height)


def _inside(width: int, height: int, relative: Fraction) -> tuple[int, int] | None:
    """Where a frame of another size goes in the `width` x `height` picture: None (all of it) where its shape is the
    picture's (a stream that switches between 1080p and 720p, or a 16:9 DVD's 720x576 and HD), else the largest
    (width, height) inside it that keeps its shape (`relative`: its shape over the picture's), bars round it.
    Stretched to the whole picture, a recording that turns from landscape to portrait came back squashed."""
    if abs(relative - 1) <= Fraction(1, 100):
        return None
    if relative > 1:  # wider: bars above and below
        return width, max(1, round(height / relative))
    return max(1, round(width * relative)), height


def _boxed(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    """`pixels` in the middle of a black `width` x `height` picture."""
    boxed = np.zeros((height, width, pixels.shape[2]), pixels.dtype)
    top, left = (height - pixels.shape[0]) // 2, (width - pixels.shape[1]) // 2
    boxed[top : top + pixels.shape[0], left : left + pixels.shape[1]] = pixels
    return boxed


def _decode(
    container: av.container.InputContainer, stream: av.VideoStream, size: int, passing: bool = False
) -> Iterator[av.VideoFrame]:
    """Every frame of `stream` (a file of `size` bytes). Empty packets are skipped, not sent: Ogg stores a Theora
    frame that repeats the one before as a 0-byte packet, which the decoder takes for the end of the stream (every
    later packet: EINVAL). So is the packet a cut file ends in (`cut_off`). The probe counts frames the same way.
    Packed B-frames are unpacked first (`unpacker`); a WebM with alpha is decoded by libvpx (`decoder`). Where
    `passing`, a packet whose data the decoder refuses is passed over, as players do (`_pictures` then finds its frame
    missing); else it ends the read."""
    unpack, context = unpacker(stream), decoder(stream)

    def decoded(sent: av.Packet | None) -> Iterator[av.VideoFrame]:
        try:
            yield from context.decode(sent)
        except av.error.InvalidDataError:
            if not passing:
                raise

    for packet in demux(container, stream):
        if packet.size and not cut_off(packet, size):
            for sent in unpack(packet):
                yield from decoded(sent)
    for sent in unpack(None):
        yield from decoded(sent)
    yield from decoded(None)  # frame threads answer for their last packets here


def _deinterlaced(
    frames: Iterator[av.VideoFrame], stream: av.VideoStream, reading: Reading, cadence: str = "frame"
) -> Iterator[av.VideoFrame]:
    """`frames`, those flagged interlaced deinterlaced by libavfilter's bwdif: upscaled as stored, two fields woven
    from two instants, every moving edge would be magnified into combs. One frame out for each frame in (`send_frame`:
    the first field's instant, the other field's lines interpolated in space and time), so the count, and with it
    every window, the sound's sync and the output's timing, stay the source's. Only interlaced frames are touched
    (`deint=interlaced`); frames before the first one pass as decoded, so progressive sources meet no filter.

    bwdif also reads the frames before and after: each comes out once the next one went in, the last one at the
    flush. Jobs always decode from the first frame (kept windows are skipped, not sought to), so a window's frames
    are the same in every attempt. Parity is the field order the stream declares (its parser reads it from the
    bitstream): FFmpeg's H.264 decoder leaves frames of x264's top-first MBAFF streams unmarked, which bwdif's own
    `auto` reads as bottom first. Where the stream declares none (DV; a stream that starts progressive), `auto`
    takes each frame's own flag, which DV's and MPEG-2's decoders set from each picture's header.

    At `field` (`send_field`), a frame for each field, each at its own instant: 50i broadcast motion as 50
    frames a second. The count must then be twice the source's whatever the frames say: frames before the first
    interlaced one are shown twice, and once the filter runs it treats every frame as two fields (`deint=all`).

    At `film`, every frame from the first goes through inverse telecine, whatever its flag (hard-telecined film is
    often coded progressive): fieldmatch pairs each frame's fields with their film frame's, bwdif deinterlaces what it
    could not match (video, a cut in the cadence), and decimate drops the one repeat in every five."""
    graph: av.filter.Graph | None = None
    configured = None  # the (width, height, pixel format) the graph was made for
    for frame in frames:
        if graph is not None and (frame.width, frame.height, frame.format.name) != configured:
            yield from _drained(graph)  # the filter cannot change size: a new one takes the new size
            graph = None
        reading.interlaced += frame.interlaced_frame
        reading.captions += SideData.A53_CC in (side_data(frame) or ())
        if graph is None and not frame.interlaced_frame and cadence != "film":
            yield from (frame,) * (1 + (cadence == "field"))
            continue
        if graph is None:
            reading.parity = PARITY.get(stream.codec_context.field_order, "auto")
            # decimate needs the frame rate it divides (the other filters read none)
            rate = (stream.guessed_rate or stream.average_rate) if cadence == "film" else None
            graph = _chain(frame, _deinterlacing(reading.parity, cadence), rate)
            configured = (frame.width, frame.height, frame.format.name)
        graph.push(frame)
        yield from _ready(graph)
    if graph is not None:
        yield from _drained(graph)


def _deinterlacing(parity: str, cadence: str) -> list[tuple[str, str]]:
    """The filters, with their arguments, that make `cadence`'s progressive frames of the stream's interlaced ones."""
    how = "mode=send_field:deint=all" if cadence == "field" else "mode=send_frame:deint=interlaced"
    bwdif = ("bwdif", f"{how}:parity={parity}")
    if cadence == "film":
        # The chain FFmpeg's fieldmatch documents: the frames it could not match (combmatch=full) marked for bwdif
        return [("fieldmatch", f"order={parity}:combmatch=full"), bwdif, ("decimate", "")]
    return [bwdif]


def _chain(frame: av.VideoFrame, filters: list[tuple[str, str]], rate: Fraction | None = None) -> av.filter.Graph:
    """A configured graph that takes frames like `frame` through `filters` in turn (`rate`: the buffer's frame
    rate, for a filter that reads it)."""
    graph = av.filter.Graph()
    extra = {"frame_rate": str(rate)} if rate else {}
    source = graph.add(
        "buffer",
        video_size=f"{frame.width}x{frame.height}",
        pix_fmt=frame.format.name,
        time_base=str(frame.time_base or "1/90000"),  # raw streams have none: the reader uses no timestamps
        # The frames' own colour tags, so that the buffer does not see each frame as a change of format
        colorspace=str(frame.colorspace),
        range=str(frame.color_range),
        **extra,
    )
    chain = [graph.add(name, arguments or None) for name, arguments in filters]
    for upstream, downstream in zip([source, *chain], [*chain, graph.add("buffersink")]):
        upstream.link_to(downstream)
    graph.configure()
    return graph


def _ready(graph: av.filter.Graph) -> Iterator[av.VideoFrame]:
    while True:
        try:
            yield graph.vpull()
        except (BlockingIOError, EOFError):  # it waits for the next frame, or it is done
            return


def _drained(graph: av.filter.Graph) -> Iterator[av.VideoFrame]:
    graph.push(None)
    yield from _ready(graph)


def _source_colour(frame: av.VideoFrame) -> dict:
    """How to read YUV as RGB. The stream's tags when it has them; untagged streams get what players assume:
    BT.709 for HD sizes, BT.601 below, and limited range (full range arrives tagged, or as a yuvj format)."""
    if frame.format.is_rgb:
        return {}
    hd = frame.width >= 1280 or frame.height > 576
    colour = {}
    if frame.colorspace == _UNSPECIFIED:
        colour["src_colorspace"] = Colorspace.ITU709 if hd else Colorspace.ITU601
    if frame.color_range == ColorRange.UNSPECIFIED:
        colour["src_color_range"] = ColorRange.MPEG
    return colour


_END = object()


def prefetch(items: Iterable[T], depth: int) -> Iterator[T]:
    """Iterate `items` on a thread of its own, at most `depth` items ahead, so decoding overlaps the consumer's work.
    Errors surface where the consumer would have met them; closing the iterator stops the thread."""
    buffer: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def put(entry: tuple) -> bool:
        while not stop.is_set():
            try:
                buffer.put(entry, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce() -> None:
        iterator = iter(items)
        try:
            for item in iterator:
                if not put((item, None)):
                    return
            put((_END, None))
        except BaseException as error:  # handed to the consumer
            put((_END, error))
        finally:
            getattr(iterator, "close", lambda: None)()

    thread = threading.Thread(target=produce, name="vsrq-decoder", daemon=True)
    thread.start()
    try:
        while True:
            item, error = buffer.get()
            if item is _END:
                if error is not None:
                    try:
                        raise error
                    finally:  # its traceback holds this frame: a cycle that kept the error, with every frame of the
                        # decoder's stack and their locals (the container, its decoder and the decoder's threads, the
                        # refused frame) until Python's cyclic collector ran, jobs later
                        del error
                return
            yield item
    finally:
        stop.set()
        thread.join()
