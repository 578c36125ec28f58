"""Encode frames into an MP4 as they arrive, on a thread of its own, so encoding overlaps the engine's work."""

from __future__ import annotations

import functools
import os
import queue
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from time import perf_counter
from types import TracebackType

import av
import numpy as np
import torch
from av.video.reformatter import ColorRange, Colorspace, VideoReformatter

from worker.errors import InvalidRequest
from worker.frames import quantise
from worker.media import edit_list
from worker.media.passthrough import Passthrough

_DONE = None
BT709 = 1  # AVCOL_SPC_BT709 / AVCOL_PRI_BT709 / AVCOL_TRC_BT709
_PROGRESSIVE = 1  # AV_FIELD_PROGRESSIVE
BT2020 = 9  # AVCOL_PRI_BT2020 / AVCOL_SPC_BT2020_NCL
# The codecs whose output may be 10-bit (yuv420p10le): what a deeper source is written in. H.264's High 10 is left
# out though x264 has it: hardware decoders (every Apple device, most phones and TVs) do not play it (`output_depth`).
DEEP_CODECS = frozenset({"hevc", "av1"})
# Our codec names -> FFmpeg encoders, best first.
ENCODERS = {"h264": ("libx264",), "hevc": ("libx265",), "av1": ("libsvtav1",)}
# SVT-AV1 takes numbered presets; x264's names map onto its speed scale.
# Frames arrive in bursts of one decode segment (16); a longer lookahead (x264 `medium`: 40) only delays the end
# of the file: W1's MP4 tail went from 1.73 to 1.06 s (bench/RESULTS.md). Presets that look less far ahead keep theirs.
LOOKAHEAD = 16
# How the encoder spreads over cores: frame threads, as the ffmpeg CLI runs x264. PyAV's default, SLICE, turns on
# x264's `sliced-threads`, which splits every frame instead (bench/RESULTS.md has both measured).
THREAD_TYPE = "FRAME"
# The presets' own `rc-lookahead` (x264's and x265's documentation), which LOOKAHEAD only ever lowers.
_PRESET_LOOKAHEAD = {
    "libx264": {"ultrafast": 0, "superfast": 0, "veryfast": 10, "faster": 20, "fast": 30, "medium": 40, "slow": 50},
    "libx265": {"ultrafast": 5, "superfast": 10, "veryfast": 15, "faster": 15, "fast": 15, "medium": 20, "slow": 25},
}
# The CPU flags with which x264 (and so `_x264_asm`) takes its AVX-512 kernels.
_AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
_SVT_PRESETS = {"ultrafast": 12, "superfast": 11, "veryfast": 10, "faster": 9, "fast": 8, "medium": 7, "slow": 5, "slower": 4, "veryslow": 2}


def output_depth(bit_depth: int, codec: str) -> int:
    """The output's bits per sample for a source of `bit_depth` written in `codec`: 10 where the source has more
    than 8 and the codec is one of DEEP_CODECS (8 bits band an HDR sky or gradient visibly), else 8."""
    return 10 if bit_depth > 8 and codec in DEEP_CODECS else 8


def yuv_frame(
    pixel: np.ndarray, reformatter: VideoReformatter | None = None, matrix: int = BT709
) -> av.VideoFrame:
    """One (H, W, 3) RGB frame as the encoder takes it: limited range, 4:2:0, with the BT.709 matrix (or BT.2020's,
    `matrix`); uint8 makes yuv420p, uint16 (full 16-bit scale) yuv420p10le. A `reformatter` kept for a stream's
    frames keeps one swscale context, and its threads (one per core), for all of them."""
    deep = pixel.dtype == np.uint16
    frame = av.VideoFrame.from_ndarray(pixel, format="rgb48le" if deep else "rgb24")
    space = Colorspace.BT2020 if matrix == BT2020 else Colorspace.ITU709
    options = {"format": "yuv420p10le" if deep else "yuv420p", "dst_colorspace": space, "dst_color_range": ColorRange.MPEG}
    return reformatter.reformat(frame, **options) if reformatter is not None else frame.reformat(**options)


def eight_bit(pixel: np.ndarray) -> np.ndarray:
    """(H, W, 3) RGB as uint8, rounded from uint16's full scale (x / 257): what previews take."""
    if pixel.dtype == np.uint8:
        return pixel
    return ((pixel.astype(np.uint32) + 128) // 257).astype(np.uint8)


def _durations(timestamps: Sequence[int], start: int, last: int | None = None) -> dict[int, int]:
    """Each frame's presentation time (with `start`) -> how long it lasts; the last lasts `last`, or as long as an
    average one."""
    ordered = sorted(timestamps)
    if len(ordered) < 2:
        return {}
    last = last or max(1, round((ordered[-1] - ordered[0]) / (len(ordered) - 1)))
    return {start + t: (following - t) for t, following in zip(ordered, ordered[1:])} | {start + ordered[-1]: last}


# The smallest side written per codec. x265 as PyAV bundles it corrupts the heap, and the process aborts, on frames
# smaller than its 64-pixel coding tree units in some shapes (8 pixels high or wide; 40 to 48 wide up to 32 high,
# deterministically): a worker would die on every attempt of such a job, so HEVC below 64x64 is refused instead.
MIN_SIDE = {"hevc": 64}


# The CRF scale of each codec's encoder (x264's and x265's 0-51, SVT-AV1's 0-63); x264 caps a higher one silently.
CRF_MAX = {"h264": 51, "hevc": 51, "av1": 63}


def check_crf(codec: str, crf: int) -> None:
    """Refuse (InvalidRequest) a CRF outside `codec`'s scale (CRF_MAX) rather than write another one."""
    most = CRF_MAX[codec]  # a codec `encoder_for` takes
    if not 0 <= crf <= most:
        raise InvalidRequest(f"crf must be 0 to {most} for {codec} (lower is better), got {crf}")


# x264's and x265's speed presets; SVT-AV1 takes all but `placebo` (_SVT_PRESETS)
PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow", "placebo")


def check_preset(codec: str, preset: str) -> None:
    """Refuse (InvalidRequest) a preset `codec`'s encoder does not take, before it fails to open."""
    names = [name for name in PRESETS if codec != "av1" or name in _SVT_PRESETS]
    if preset not in names:
        raise InvalidRequest(f"preset must be one of {', '.join(names)} for {codec}, got {preset!r}")


def check_size(codec: str, size: tuple[int, int]) -> None:
    """Refuse (InvalidRequest) an output of `size` (height, width) smaller than `codec` is written at (MIN_SIDE)."""
    least = MIN_SIDE.get(codec, 0)
    if min(size) < least:
        raise InvalidRequest(
            f"{codec} is written at {least}x{least} or more here, and the output would be {size[1]}x{size[0]}: "
            "use h264 or av1, or a larger scale or target"
        )


def encoder_for(codec: str) -> str:
    """The FFmpeg encoder this PyAV build has for `codec` ("h264", "hevc", "av1")."""
    if codec not in ENCODERS:
        raise InvalidRequest(f"video codec must be one of {tuple(ENCODERS)}, got {codec!r}")
    for name in ENCODERS[codec]:
        try:
            av.codec.Codec(name, "w")
            return name
        except av.codec.codec.UnknownCodecError:
            continue
    raise InvalidRequest(f"this PyAV build has no {codec} encoder (tried {', '.join(ENCODERS[codec])})")


@functools.cache
def _x264_asm() -> str | None:
    """The kernels x264 may use here: up to AVX2 on a CPU that has AVX-512, else (None) all it detects.

    With its AVX-512 kernels the x264 PyAV bundles (core 165) does not write the same stream twice for the same
    frames, at some widths (96, 224, 720 px: 1 run in 5 to every run; `mbtree=0` also ends it: bench/RESULTS.md).
    Up to AVX2 it writes the bits of its plain C code, every time."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: x264 detects the CPU itself
        return None
    flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
    return "AVX2" if _AVX512 <= flags else None  # every AVX-512 CPU has what x264's AVX2 needs (FMA3, BMI2)


def _hdr10_params(encoder: str, mastering: str | None, light_level: tuple[int, int] | None) -> dict[str, str]:
    """HDR10's static metadata as each encoder's own parameters write it (SEI in H.264 and HEVC, metadata OBUs in AV1).
    PyAV cannot hand an encoder the side data FFmpeg's CLI passes it: without these, a PQ source's output told
    players nothing of the display it was graded on, and they tone-mapped it by guess."""
    params = {}
    if encoder == "libsvtav1":  # the same fields in plain units: chromaticities, cd/m²
        if mastering:
            numbers = [int(n) for n in re.findall(r"\d+", mastering)]
            chroma, (high, low) = [f"{n / 50000:.4f}" for n in numbers[:8]], (numbers[8] / 10000, numbers[9] / 10000)
            params["mastering-display"] = "G({},{})B({},{})R({},{})WP({},{})".format(*chroma) + f"L({high:.4f},{low:.4f})"
        if light_level:
            params["content-light"] = "{},{}".format(*light_level)
        return params
    if mastering:
        params["master-display" if encoder == "libx265" else "mastering-display"] = mastering
    if light_level:
        params["max-cll" if encoder == "libx265" else "cll"] = "{},{}".format(*light_level)
    if params and encoder == "libx265":
        params["hdr10"] = "1"
    return params


def _encoder_options(
    encoder: str, crf: int, preset: str, lookahead: int | None, hdr10: Mapping[str, str] | None = None
) -> dict[str, str]:
    if encoder == "libsvtav1":
        os.environ.setdefault("SVT_LOG", "1")  # errors only (it prints its whole configuration otherwise)
        options = {"crf": str(crf), "preset": str(_SVT_PRESETS.get(preset, preset))}
        if hdr10:
            options["svtav1-params"] = ":".join(f"{key}={value}" for key, value in hdr10.items())
        return options
    options = {"crf": str(crf), "preset": preset}
    params = {"log-level": "error"} if encoder == "libx265" else {}
    params |= dict(hdr10 or {})
    if encoder == "libx264" and (asm := _x264_asm()):
        params["asm"] = asm  # same frames, same bytes (`_x264_asm`)
    own = _PRESET_LOOKAHEAD[encoder].get(preset, 60)  # slower presets: x264 60, x265 40 to 60
    if lookahead is not None and lookahead < own:
        params["rc-lookahead"] = str(lookahead)
    if params:
        options[f"{encoder[3:]}-params"] = ":".join(f"{key}={value}" for key, value in params.items())
    return options


class Mp4Writer:
    """MP4 writer (H.264 by default, or HEVC / AV1; yuv420p BT.709; +faststart); `write` takes (n, 3, H, W) float
    frames in [0, 1] on any device. `depth` 10 (HEVC and AV1 only) writes yuv420p10le from frames quantised to 16
    bits, with the BT.2020 matrix where the primaries are BT.2020 (HDR10's and HLG's: what their players expect).

    `lookahead` (x264/x265 `rc-lookahead`, frames; None: the preset's, 40 for `medium`) bounds how many frames the
    encoder holds back, i.e. how much encoding is left after the last frame arrives; it never raises a preset's.

    Frames are timed at `fps` or, for variable-rate video, at `timestamps` (in `time_base`, from 0), the first one
    `start` ticks of `time_base` into the file (the source's audio started earlier). Every packet carries its frame's
    duration (the last frame: `last_duration` ticks, else an average one), so the MP4's track duration and average rate are the source's. A
    `passthrough` muxes the source's audio and subtitles alongside, as the video advances; `chapters` are kept. `sample_aspect_ratio` is
    the source's pixel shape, kept so that the picture is displayed as wide as the source's; `timecode` (SMPTE,
    "01:00:00:00") is its first frame's; `mastering` and `light_level` are
    its HDR10 metadata (probe.VideoInfo's).

    `on_frame(index, pixels)` sees each frame, (H, W, 3) uint8 RGB (rounded from 16 bits at depth 10), on the encoder's thread just before it is
    encoded (the previews take theirs there: worker.media.previews.PreviewFrames).

    `write` only quantises and queues; a background thread encodes and muxes. A failure there surfaces at the next
    `write` or at `close`. Leaving the `with` block through an exception deletes the partial file.
    """

    def __init__(
        self,
        path: str | Path,
        fps: Fraction,
        size: tuple[int, int],
        crf: int = 18,
        preset: str = "medium",
        queue_size: int = 4,
        *,
        lookahead: int | None = LOOKAHEAD,
        thread_type: str = THREAD_TYPE,
        codec: str = "h264",
        timestamps: Sequence[int] | None = None,
        time_base: Fraction | None = None,
        passthrough: Passthrough | None = None,
        metadata: Mapping[str, str] | None = None,
        language: str | None = None,
        colour: tuple[int, int] = (BT709, BT709),
        start: int = 0,
        last_duration: int | None = None,
        sample_aspect_ratio: Fraction = Fraction(1),
        chapters: Sequence[tuple[float, float, str | None]] = (),
        on_frame: Callable[[int, np.ndarray], None] | None = None,
        timecode: str | None = None,
        mastering: str | None = None,
        light_level: tuple[int, int] | None = None,
        depth: int = 8,
    ) -> None:
        height, width = size
        encoder = encoder_for(codec)
        if depth not in (8, 10) or (depth == 10 and codec not in DEEP_CODECS):
            raise ValueError(f"{codec} is written at 8 bits here, not {depth}")
        self.path = Path(path)
        if start and timestamps is None:
            raise ValueError("a delayed start needs timestamps (a time base finer than the frame rate)")
        self.timestamps, self.passthrough, self.start = timestamps, passthrough, start
        self._on_frame = on_frame
        self.alive: Callable[[], object] | None = None  # told the carried streams' tail goes on (Passthrough.mux_until)
        self._durations = _durations(timestamps, start, last_duration) if timestamps is not None else {}
        self._held: list[av.Packet] | None = []  # packets whose decode time precedes the first frame (B-frames)
        self._tail: av.Packet | None = None  # the latest packet in decode order: the last one ends the track
        self._decode_start: int | None = None
        # An Apple device's keys (com.apple.quicktime.creationdate, .location.ISO6709, .make...) have no iTunes atom:
        # FFmpeg drops them unless every key is written as the device wrote them, in QuickTime's `mdta` keys (where a
        # title, say, is then no `©nam`: so only for such files, which carry none)
        metadata = metadata or {}
        keys = "+use_metadata_tags" if any(key.startswith("com.apple.quicktime.") for key in metadata) else ""
        self.container = av.open(str(self.path), mode="w", format="mp4", options={"movflags": f"+faststart{keys}"})
        self.container.metadata.update(metadata)
        if chapters:  # (start, end, title) in output seconds; FFmpeg writes them as a QuickTime chapter track
            self.container.set_chapters([
                {"id": number, "start": round(start * 1000), "end": round(end * 1000), "time_base": Fraction(1, 1000),
                 "metadata": {"title": title} if title else {}}
                for number, (start, end, title) in enumerate(chapters, 1)
            ])  # fmt: skip
        hdr10 = _hdr10_params(encoder, mastering, light_level)
        self.stream = self.container.add_stream(encoder, rate=fps, options=_encoder_options(encoder, crf, preset, lookahead, hdr10))
        self.stream.width, self.stream.height = width, height
        self.stream.pix_fmt = "yuv420p10le" if depth == 10 else "yuv420p"
        self._dtype = torch.uint16 if depth == 10 else torch.uint8
        self.stream.codec_context.thread_type = thread_type
        # every frame written is whole (interlaced sources are deinterlaced as read): x264 says so itself, x265 and
        # SVT-AV1 leave the MP4's field order unknown, which players and ffprobe report as such
        self.stream.codec_context.field_order = _PROGRESSIVE
        if sample_aspect_ratio != 1:
            self.stream.codec_context.sample_aspect_ratio = sample_aspect_ratio
        if codec == "hevc":
            self.stream.codec_tag = "hvc1"  # what Apple's players require of HEVC in MP4
        # Constant rate: frame i at i / fps. Variable: at its own timestamp.
        self.time_base = 1 / Fraction(fps) if timestamps is None else time_base
        self.stream.codec_context.time_base = self.time_base
        # Frames are converted with the BT.709 matrix (10-bit BT.2020 ones with BT.2020's) to limited range and tagged
        # so; primaries and transfer are the source's (the RGB values were never converted between them).
        self._matrix = BT2020 if depth == 10 and colour[0] == BT2020 else BT709
        context = self.stream.codec_context
        context.colorspace, context.color_range = self._matrix, ColorRange.MPEG
        context.color_primaries, context.color_trc = colour
        if language:
            self.stream.metadata["language"] = language
        if timecode:  # the MP4 muxer writes it as a timecode track (tmcd) for this stream, counted at its rate
            self.stream.metadata["timecode"] = timecode
        if passthrough is not None:
            passthrough.add_streams(self.container)
        self.frames = 0
        self.encode_seconds = 0.0
        self._queue: queue.Queue[np.ndarray | None] = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        # `frame.reformat` makes a swscale context per frame and starts and joins its threads (16 on a 16-core
        # host) every time: on the encoder's thread, ahead of x264 (bench/RESULTS.md)
        self._reformatter = VideoReformatter()
        self._thread = threading.Thread(target=self._encode_loop, name="vsrq-encoder", daemon=True)
        self._thread.start()

    def write(self, frames: torch.Tensor) -> None:
        self._raise_if_failed()
        pixels = quantise(frames, self._dtype).cpu().numpy()
        self._queue.put(pixels)
        self.frames += len(pixels)

    def close(self) -> None:
        self._queue.put(_DONE)
        self._thread.join()
        self._raise_if_failed()
        self.container.close()
        if self.passthrough is not None:
            edit_list.skip(self.path, self.passthrough.edits())
        self._close_passthrough()

    def _encode_loop(self) -> None:
        drained = False  # the producer's _DONE was taken: nothing more will come to unblock
        try:
            index = 0
            while (pixels := self._queue.get()) is not _DONE:
                started = perf_counter()
                for pixel in pixels:
                    if self._on_frame is not None:
                        self._on_frame(index, eight_bit(pixel))
                    frame = yuv_frame(pixel, self._reformatter, self._matrix)
                    frame.pts = index if self.timestamps is None else self.start + self.timestamps[index]
                    index += 1
                    self._mux_video(self.stream.encode(frame))
                    if self.passthrough is not None:
                        self.passthrough.mux_until(float(frame.pts * self.time_base))
                self.encode_seconds += perf_counter() - started
            drained = True
            self._mux_video(self.stream.encode())
            self._release_held()
            self._mux_tail()
            if self.passthrough is not None:
                self.passthrough.mux_until(None, self.alive)
        except BaseException as error:  # handed to the producer thread
            self._error = error
            while not drained and self._queue.get() is not _DONE:  # unblock a producer waiting on a full queue
                pass
        finally:  # its swscale threads (one per core) idle on while a held tail keeps the writer
            self._reformatter = None

    def _mux_video(self, packets: list[av.Packet]) -> None:
        for packet in packets:
            if self._durations:
                packet.duration = self._durations.get(packet.pts, packet.duration)
            if self._held is not None and self.timestamps is not None:
                if packet.dts is not None and packet.dts < self.start + self.timestamps[0]:
                    self._held.append(packet)
                    continue
                self._release_held()
            self._mux_timed(packet)

    def _release_held(self) -> None:
        """Mux the packets an encoder decodes before the first frame's time, with decode times that keep the sum
        of frame durations right. x264 spaces them by the first frames' gaps and every later one by the frames'
        own, which makes a variable-rate MP4's sample table (and so its average rate, as FFmpeg reads it) longer
        by the difference: a 1.6 s phone clip whose first frame lasts 0.18 s read back at 24.5 fps instead of 27.
        Starting them as far before the first frame as the last `held` frames span ends the table at the right time."""
        held, self._held = self._held or [], None
        times = self.timestamps or ()
        if held and len(times) > len(held):
            span = times[-1] - times[-1 - len(held)]
            first = self.start + times[0] - span
            for number, packet in enumerate(held):
                packet.dts = first + round(number * span / len(held))
        for packet in held:
            self._mux_timed(packet)

    def _mux_timed(self, packet: av.Packet) -> None:
        """Mux `packet`, one behind: the last in decode order is given the duration that ends the track where the
        last frame ends (`_mux_tail`)."""
        if not self._durations or packet.dts is None:
            self.container.mux(packet)
            return
        if self._decode_start is None:
            self._decode_start = packet.dts
        if self._tail is not None:
            self.container.mux(self._tail)
        self._tail = packet

    def _mux_tail(self) -> None:
        """An MP4's track lasts its sample durations, each the gap to the next decode time and the last one's own:
        with B-frames the packet decoded last is not the frame shown last, so its duration is what makes the
        track end as the last frame does (as probe reads it back, from the first frame's time)."""
        packet, self._tail = self._tail, None
        if packet is None or self._decode_start is None:
            return
        first, end = min(self._durations), max(t + d for t, d in self._durations.items())
        packet.duration = max(1, end - first + self._decode_start - packet.dts)
        self.container.mux(packet)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _close_passthrough(self) -> None:
        if self.passthrough is not None:
            self.passthrough.close()

    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            try:
                self.close()
                return
            except BaseException:
                self.discard()
                raise
        self.discard()

    def discard(self) -> None:
        """Stops encoding and deletes the file: never leave a partial output behind."""
        if self._thread.is_alive():
            self._queue.put(_DONE)
            self._thread.join()
        try:
            self.container.close()
        except av.error.FFmpegError:
            pass  # the trailer of a file that is deleted next
        finally:
            self._close_passthrough()
            self.path.unlink(missing_ok=True)
