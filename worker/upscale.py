"""One video file in, one verified MP4 out: what the `vsrq upscale` command and the job service both run."""

from __future__ import annotations

import logging
import os
import re
import tempfile

import av
import torch
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from time import monotonic, perf_counter
from typing import TypeVar

from worker.errors import InvalidRequest
from worker.media.errors import OutputUnwritable
from worker.media.limits import Limits
from worker.media.passthrough import Carried, Passthrough, output_clock, output_metadata, output_timecode, plan_streams
from worker.media.previews import PreviewFrames
from worker.media.probe import MediaInfo, VideoInfo, output_chapters, probe
from worker.media.reader import CADENCES, Reading, at_cadence, prefetch, read_frames, telecined
from worker.media.resize import Target
from worker.media.verify import Promise, verify
from worker.media.writer import (
    BT709,
    DEEP_CODECS,
    Mp4Writer,
    check_crf,
    check_preset,
    check_size,
    encoder_for,
    output_depth,
)
from worker.resized import Resized
from worker.sr import tiling
from worker.sr.request import RunInfo, SRRequest
from worker.sr.windows import (
    DEFAULT_WINDOW,
    KeptWindowsDisagree,
    WindowProgress,
    WindowsRun,
    WindowStore,
    plan_windows,
    upscale_windows,
)

log = logging.getLogger("vsrq.worker")

T = TypeVar("T")
DEFAULT_BACKGROUND = "#000000"  # what transparent pixels are shown over unless a job names another colour
ENGINE_STAGES = ("encode", "denoise_decode")  # `RunInfo.stage_seconds` that span the engine's call between them


@dataclass(frozen=True)
class UpscaleOptions:
    request: SRRequest = SRRequest()  # scale, steps, seed, tiling; the window index is added to its noise key
    target: Target | None = None  # downscale the result to a target resolution
    window: int = DEFAULT_WINDOW  # frames per temporal window (1 + 4k)
    window_overlap: int | None = None  # None: DEFAULT_OVERLAP, at most half the window
    codec: str = "h264"
    crf: int = 18
    preset: str = "medium"
    deinterlace: str = "frame"  # `reader.CADENCES`: an interlaced source's output at its frame, field or film rate
    background: str = DEFAULT_BACKGROUND  # #rrggbb behind a source's transparent pixels (MP4 has no alpha)
    # Limits only refuse work, they never change a pixel: not part of the repr, so a deploy that raises them keeps
    # a requeued job's kept windows
    limits: Limits = field(default=Limits(), repr=False)
    # Called with the job's output megapixel-frames once the limits passed, before any work (a budget to charge);
    # not part of the options' repr, which names what kept windows were computed from (worker/kept_windows.py)
    admit: Callable[[float], None] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Result:
    output: Path
    source: MediaInfo
    written: MediaInfo  # the output as read back and verified
    windows: int
    restored: int  # windows replayed from the store instead of computed
    tiles: int  # per window, as the upscaler tiled it
    devices: tuple[str, ...]
    carried: tuple[Carried, ...]
    notes: tuple[str, ...]  # what a user should know about how the job ran
    seconds: float
    # The upscaler's own calls (encode, denoise and decode, the caller's blending and sink inside them), summed over
    # computed windows: what is not probe, decode-ahead start, MP4 tail or verify. The service bench's overhead is
    # a job's wall time less this.
    engine_seconds: float = 0.0
    # `time.monotonic()` when the engine's windows started (the first window's decode included) and ended: a worker
    # that overlaps one job's tail with the next job's engine reports the gap between them
    engine_span: tuple[float, float] = (0.0, 0.0)
    quality: str = "lossless"  # the tier that ran (`high` asked of an upscaler without one runs `lossless`)
    levers: dict[str, str] = field(default_factory=dict)  # `high`'s levers and how each ran
    # `time.monotonic()` when each step before the engine's first call ended: a worker reports where a head waited
    head: dict[str, float] = field(default_factory=dict)
    # seconds inside the engine's span that are not its work: the windows' input frames made tensors, their commits
    # to the kept-windows store (`WindowsRun.host_s`)
    windows_s: dict[str, float] = field(default_factory=dict)
    # with a store, the seconds its uploads took on the uploader's thread, beside the engine (known once
    # `Encoding.check` joined them)
    kept_upload_s: float = 0.0
    # `time.monotonic()` at the start and end of each step of `Encoding.flush` and `check` (or `finish`): the
    # encoder's flush, the read-back check, the wait for the store's last uploads (`kept_join`); a caller that ran
    # something beside them (the worker's output upload beside the check) reports how they overlapped
    tail_spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    # the previews' frames, taken as they were encoded: the output is not decoded again for them
    previews: PreviewFrames | None = field(default=None, repr=False, compare=False)

    @property
    def tail(self) -> dict[str, float]:
        """Seconds of each step of the tail (`tail_spans`)."""
        return {step: end - start for step, (start, end) in self.tail_spans.items()}


def upscale_file(
    source: str | Path,
    output: str | Path,
    upscaler,
    options: UpscaleOptions = UpscaleOptions(),
    progress: Callable[[WindowProgress], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    store: WindowStore | None = None,
) -> Result:
    """Upscale `source` into the MP4 `output` with `upscaler` (an `SREngine`, `LanczosUpscaler`, ...).

    Nothing exists at `output` until the finished file has been verified; on any error nothing is left behind.
    """
    return begin_upscale(source, output, upscaler, options, progress, cancelled, store).finish()


def begin_upscale(
    source: str | Path,
    output: str | Path,
    upscaler,
    options: UpscaleOptions = UpscaleOptions(),
    progress: Callable[[WindowProgress], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    store: WindowStore | None = None,
    probed: Callable[[MediaInfo, tuple[int, int] | None], None] | None = None,
) -> Encoding:
    """`upscale_file` up to the engine's last window: every frame is upscaled and handed to the encoder. What is left
    (the encoder's flush, the read-back check) needs no upscaler: `Encoding.finish()` does it, on any thread, so a
    worker can start its next job's engine meanwhile. On an error here nothing is left behind. `probed` is told what
    the input is once probed (the output's size None), and again with the output's (width, height) once planned."""
    started = perf_counter()
    source, output = Path(source), Path(output)

    # 1. Arguments that need no decoding: where the output goes, the encoder
    check_output(source, output)
    encoder_for(options.codec)
    check_crf(options.codec, options.crf)
    check_preset(options.codec, options.preset)
    if options.deinterlace not in CADENCES:
        raise ValueError(f"deinterlace must be one of {CADENCES}, got {options.deinterlace!r}")
    behind = _rgb(options.background)

    # 2. Probe the input and check the limits: a file we refuse costs no GPU time (nor, where it declares its frames,
    #    the CPU to decode them before the output's are checked). At the field or film cadence,
    #    what follows plans, writes and checks the frames the reader makes: twice the source's, or four in five
    scale = options.request.scale
    source_info = info = probe(source, options.limits, cancelled, lambda h, w: upscaler.output_size(h, w, scale))
    recounted = at_cadence(info.video, options.deinterlace)
    if recounted is not None:
        info = replace(info, video=recounted)
    video, cadence = info.video, options.deinterlace if recounted is not None else "frame"
    # a film on an NTSC disc, read frame for frame, keeps two blended frames in every five: the notes say so
    looks_telecined = cadence != "film" and telecined(source, source_info.video)
    head = {"probed": monotonic()}
    if probed is not None:  # said before anything below refuses the job: its owner sees what was read
        probed(source_info, None)

    # 3. Plan: output size, temporal windows, the streams carried over, and what the output must be
    snap = getattr(upscaler, "snap", 1)  # the model's alignment, to tell tile padding from alignment padding
    # what the model computes, before any downscale to a target: checked before a frame is upscaled
    cost = options.limits.check_output(*upscaler.output_size(video.height, video.width, options.request.scale), video.frames)
    sar = video.sar  # the output's pixel shape
    if options.target is not None:
        upscaler = Resized(upscaler, options.target, video.sar)
        sar = options.target.pixel_aspect(video.sar)
    size = upscaler.output_size(video.height, video.width, options.request.scale)
    check_size(options.codec, size)
    if probed is not None:
        probed(source_info, size[::-1])
    if options.admit is not None:  # charged once nothing refuses the job
        options.admit(cost)
    plan = plan_windows(video.frames, options.window, options.window_overlap)
    carried = plan_streams(info)
    clock = output_clock(info, carried)
    timing = _video_timing(video, video.start - clock)
    depth = output_depth(video.bit_depth, options.codec)
    promise = replace(Promise.of(info, size, carried, clock, sar), bit_depth=depth)

    # 4. Decode ahead (one window), upscale window by window, encode as frames arrive, mux the carried streams;
    #    all into a hidden file next to the output. The writer stays open for `finish`.
    partial = output.with_name(f".{output.name}.partial")

    def write_windows() -> tuple[Mp4Writer, WindowsRun, PreviewFrames, Reading]:
        previews, reading = PreviewFrames(video.frames), Reading()
        with ExitStack() as on_error:
            on_error.callback(partial.unlink, missing_ok=True)
            writer = on_error.enter_context(
                Mp4Writer(
                    partial,
                    video.fps,
                    size,
                    options.crf,
                    options.preset,
                    codec=options.codec,
                    **timing,
                    passthrough=Passthrough(info, carried, offset=clock),
                    metadata=output_metadata(info),
                    language=video.language,
                    colour=_colour_tags(video),
                    sample_aspect_ratio=sar,
                    chapters=output_chapters(info.chapters, clock),
                    on_frame=previews.take,
                    timecode=output_timecode(info, carried),
                    mastering=video.mastering,
                    light_level=video.light_level,
                    depth=depth,
                )
            )
            head["writer_open"] = monotonic()
            reader = read_frames(source, video, reading, cadence, behind, options.limits.max_pixels)
            with closing(prefetch(reader, plan.length)) as frames:
                frames = _marking(frames, plan.windows[0].stop if plan.windows else 0, head)
                run = upscale_windows(
                    upscaler, frames, plan, options.request, writer.write, progress, cancelled, store,
                    torch.uint16 if depth > 8 else torch.uint8,
                )  # fmt: skip
            on_error.pop_all()  # the writer stays open: `Encoding` closes or discards it
        return writer, run, previews, reading

    engine_started = monotonic()
    try:
        writer, run, previews, reading = write_windows()
    except KeptWindowsDisagree as error:  # the output would mix windows made in two ways: it starts over without
        # the kept ones (never replayed again), in this attempt rather than the job's next
        log.warning("kept windows dropped, every window computed again: %s", error)
        store.drop()
        writer, run, previews, reading = write_windows()
    # What made the pixels: the windows' own runs, also those replayed from an earlier attempt's
    first = run.made[0] if run.made else None
    result = Result(
        output=output,
        source=source_info,
        written=info,  # until `finish` has read the output back
        windows=run.windows,
        restored=run.restored,
        tiles=first.tiles if first else 0,
        devices=tuple(first.devices) if first else (),
        carried=carried,
        notes=_notes(
            info, source_info.video, carried, first, options.request, snap, reading, options.codec,
            options.deinterlace, cadence, looks_telecined, options.background, clock,
        ),
        seconds=0.0,
        engine_seconds=sum(run.stage_seconds.get(stage, 0.0) for run in run.runs for stage in ENGINE_STAGES),
        engine_span=(engine_started, monotonic()),
        windows_s=dict(run.host_s),
        quality=first.quality if first else options.request.quality,
        levers=_levers(run.made),
        head=head,
        previews=previews,
    )
    return Encoding(result, writer, promise, started, store)


def _marking(frames: Iterator[T], first_window: int, head: dict[str, float]) -> Iterator[T]:
    """`frames`, noting in `head` when the first window's last frame was decoded: the engine's first call follows."""
    for index, frame in enumerate(frames, 1):
        if index == first_window:
            head["first_window_decoded"] = monotonic()
        yield frame


class Encoding:
    """An output whose frames are all with the encoder: `finish` flushes it, verifies the file against what it must be
    and puts it in place (`flush` then `check`, for a caller that reads the flushed file meanwhile); `discard` drops
    it. `finish` (or `flush` then `check`) or `discard`, once, from any thread."""

    def __init__(
        self, result: Result, writer: Mp4Writer, promise: Promise, started: float, store: WindowStore | None = None
    ) -> None:
        self.result, self._writer, self._promise, self._started = result, writer, promise, started
        self._store = store
        self._spans: dict[str, tuple[float, float]] = {}

    def finish(self) -> Result:
        self.flush()
        return self.check()

    def flush(self, alive: Callable[[], object] | None = None) -> Path:
        """5. Flushes the encoder: the finished file, under its hidden name beside the output until `check` puts it in
        place or deletes it (a file opened before `check` stays readable either way). `alive` is called as the sound
        after the last frame is muxed (an hour of it to re-encode takes minutes)."""
        began = monotonic()
        self._writer.alive = alive
        try:
            with self._writer:  # leaving it closes the writer (the flush); one that fails deletes the file
                pass
        except BaseException:
            self._writer.path.unlink(missing_ok=True)
            raise
        self._spans["flush"] = (began, monotonic())
        return self._writer.path

    def check(self) -> Result:
        """6. Once flushed: reads the file back and checks it against the promise, then puts it in place atomically;
        then waits for the store's uploads."""
        partial = self._writer.path
        began = monotonic()
        try:
            # re-encoded audio is held to what its decoder gave, which the passthrough knows once it is flushed
            passthrough = self._writer.passthrough
            promise = self._promise.decoded(passthrough.placed()) if passthrough is not None else self._promise
            written = replace(verify(partial, promise), path=self.result.output)
            os.replace(partial, self.result.output)
        finally:
            partial.unlink(missing_ok=True)
        self._spans["verify"] = (began, monotonic())
        kept_upload_s = 0.0
        if self._store is not None:  # the last kept window's upload ran beside the flush and the check: waited for
            # here, before the caller ends the job (its end deletes the kept windows)
            joined = monotonic()
            kept_upload_s = self._store.join()
            self._spans["kept_join"] = (joined, monotonic())
        notes = self.result.notes
        if self._promise.timecode and written.video.timecode != self._promise.timecode:
            # FFmpeg's muxer skips a timecode it cannot count at the output's rate (drop-frame at a rate not 29.97's
            # multiple): said, not refused after all the work
            notes += (f"the source's timecode ({self._promise.timecode}) could not be written at the output's rate: left out",)
        return replace(
            self.result,
            notes=notes,
            written=written,
            seconds=perf_counter() - self._started,
            tail_spans=dict(self._spans),
            kept_upload_s=kept_upload_s,
        )

    def discard(self) -> None:
        if "flush" in self._spans:  # the writer is closed: only its file is left
            self._writer.path.unlink(missing_ok=True)
        else:
            self._writer.discard()


def check_output(source: Path, output: Path) -> None:
    """Refuse (before any work) an output path that is the input, a directory, or in a folder we cannot write."""
    if output.exists() and source.exists() and output.samefile(source):
        raise InvalidRequest(f"the output {output} is the input: pick another name")
    if output.is_dir():
        raise OutputUnwritable(f"the output {output} is a directory")
    if not output.parent.is_dir():
        raise OutputUnwritable(f"cannot write into {output.parent}: no such directory")
    try:  # a file made there and dropped: os.access says yes to root where none can be made (/proc, read-only mounts)
        with tempfile.TemporaryFile(dir=output.parent):
            pass
    except OSError as error:
        raise OutputUnwritable(f"cannot write into {output.parent} ({error.strerror})") from None


def _rgb(colour: str) -> tuple[int, int, int]:
    """`background`, #rrggbb as the API and the CLI take it (lower-cased), as the reader's 8-bit RGB."""
    if not re.fullmatch(r"#[0-9a-f]{6}", colour):
        raise ValueError(f"background must be #rrggbb, got {colour!r}")
    return tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))


HDR_TRANSFERS = {16: "PQ (SMPTE 2084)", 18: "HLG (ARIB STD-B67)"}  # AVCOL_TRC_*


def _video_timing(video: VideoInfo, delay: float) -> dict:
    """The writer's timing: frame i at i / fps from 0 (constant rate), or at the source's own timestamps; where
    the source's audio starts `delay` seconds before the first frame, the frames start that late, on a time base
    fine enough to place them to the 90 kHz tick and to keep a constant rate exact."""
    if not video.cfr:
        start = round(delay / video.time_base)
        return {"timestamps": video.timestamps, "time_base": video.time_base, "start": start, "last_duration": video.last_duration}
    if delay <= 0:
        return {"timestamps": None, "time_base": None}
    fps = Fraction(video.fps)
    ticks = max(1, -(-90000 // fps.numerator))  # per 1 / fps.numerator s
    time_base = Fraction(1, fps.numerator * ticks)
    step = fps.denominator * ticks  # one frame
    return {"timestamps": [i * step for i in range(video.frames)], "time_base": time_base, "start": round(delay / time_base)}


def _levers(runs: tuple[RunInfo, ...]) -> dict[str, str]:
    """Each lever and how it ran over all the windows: ways that differed (cuDNN failing part-way) joined by `+`."""
    ways: dict[str, set[str]] = {}
    for run in runs:
        for lever, how in run.levers.items():
            ways.setdefault(lever, set()).update(how.split("+"))
    return {lever: "+".join(sorted(how)) for lever, how in ways.items()}


# What each colour sampling finer than 4:2:0 loses in it, by the chroma planes' share of a 16x16 picture's width and
# height (4:2:0's is 8x8; DV's 4:1:1, 4x16, is no finer: nothing said)
_FINER = {(8, 16): ("4:2:2", "down the picture"), (16, 8): ("4:4:0", "across"), (16, 16): ("4:4:4", "across and down")}


def _finer_colour(pix_fmt: str) -> tuple[str, str] | None:
    """How a source samples its colour, and what 4:2:0 halves of it, where that is finer than 4:2:0 (RGB, 4:4:4,
    4:2:2, as ProRes, DNxHR, XDCAM and camera masters are); None for 4:2:0, a coarser one, grey or a palette."""
    try:
        layout = av.VideoFormat(pix_fmt, 16, 16)
    except ValueError:  # a format this FFmpeg does not name
        return None
    if layout.is_rgb:
        return "RGB", "across and down"
    colour = [c for c in layout.components if not c.is_luma and not c.is_alpha]
    return _FINER.get((colour[0].width, colour[0].height)) if len(colour) == 2 else None


SMPTE170M, BT470BG = 6, 5  # AVCOL_PRI_SMPTE170M (525-line SD; as a transfer, BT.601's) / AVCOL_PRI_BT470BG (625-line)


def _colour_tags(video: VideoInfo) -> tuple[int, int]:
    """The output's primaries and transfer: the source's. Where it names none (or a reserved value), what players
    assumed of it, by its stored size as mpv guesses: an untagged 720x576 DV tape is PAL's BT.470 BG, a 720x480 one
    SMPTE 170M, anything else BT.709. Its RGB values are never converted between primaries, and the output, HD-sized,
    would otherwise be taken for BT.709's."""
    sd = video.width < 1280 and video.height <= 576
    guess = {576: BT470BG, 480: SMPTE170M, 486: SMPTE170M}.get(video.height, BT709) if sd else BT709
    primaries = video.color_primaries if video.color_primaries not in (0, 2) else guess
    transfer = video.color_trc if video.color_trc not in (0, 2) else (BT709 if guess == BT709 else SMPTE170M)
    return primaries, transfer


def _notes(
    info: MediaInfo,
    source: VideoInfo,
    carried: tuple[Carried, ...],
    run: RunInfo | None,
    request: SRRequest,
    snap: int,
    reading: Reading,
    codec: str = "h264",
    deinterlace: str = "frame",
    cadence: str = "frame",
    looks_telecined: bool = False,
    background: str = DEFAULT_BACKGROUND,
    clock: float = 0.0,
) -> tuple[str, ...]:
    """What a user should know of how the job ran. `info` is what was written, `source` the video as probed;
    `deinterlace` is the cadence asked for, `cadence` the one the frames were read at; `clock`, the source's time
    at the output's start."""
    video: VideoInfo = info.video
    scale = request.scale
    notes = []
    if run is not None and run.quality != request.quality:
        notes.append(f"quality={request.quality} has no faster path on this model: it ran {run.quality}, the exact engine")
    if run is not None:
        # Padding beyond the model's alignment means the input was smaller than one tile.
        height, width = tiling.pre_upscaled_size(video.height, video.width, scale) if scale in tiling.SCALES else (video.height, video.width)
        _, padded_height, padded_width = run.padded_input
        if padded_height > -(-height // snap) * snap or padded_width > -(-width // snap) * snap:
            notes.append(
                f"the input ({video.width}x{video.height}) is smaller than one model tile: it ran padded to "
                f"{padded_width}x{padded_height} (mirrored edges) and was cropped back"
            )
    if video.rotation or video.mirrored:
        how = " and ".join([f"rotated {video.rotation} degrees"] * bool(video.rotation) + ["mirrored"] * video.mirrored)
        notes.append(f"the source is displayed {how}: frames were turned upright, the flag cleared")
    if video.sizes:
        notes.append(f"the source changes size mid-way ({', '.join(f'{w}x{h}' for w, h in video.sizes)}): the output "
                     f"is sized for its largest part, the others scaled to fill it as players show them (in their "
                     f"own shape, bars round a part of another)")
    if video.stereo:
        notes.append("the source is stereoscopic (MV-HEVC, a spatial video's view for each eye): its first view was "
                     "upscaled, as 2-D video; the second is not in the output")
    others = [s.index for s in info.other_video]
    if others:
        notes.append(f"the source has {len(others) + 1} video streams: #{video.index} was upscaled (the one players pick), "
                     f"{', '.join(f'#{i}' for i in others)} left out")
    # Counted by the reader, not taken from the probe (which decodes the first frame only): a broadcast or a DVD may
    # start progressive and turn interlaced, or mix the two
    rates = f"{float(source.fps):.5g} frames/s in, {float(video.fps):.5g} out"
    order = {"tff": "top field first", "bff": "bottom field first"}.get(reading.parity, "each frame's field order")
    if cadence == "film":
        notes.append(f"deinterlace=film: telecine undone ({order}), fieldmatch putting each film frame's fields back "
                     f"together, bwdif deinterlacing any it could not match, decimate dropping the one repeat in "
                     f"five: {source.frames} frames in, {video.frames} out ({rates})")
    elif reading.interlaced:
        share = f" ({reading.interlaced} of its {source.frames} frames)" if reading.interlaced < source.frames else ""
        if cadence == "field":
            notes.append(f"the source is interlaced{share}: deinterlaced with bwdif ({order}), one frame for each "
                         f"field at its instant, so the output is progressive at twice the source's frame rate "
                         f"({rates})")
        else:
            notes.append(f"the source is interlaced{share}: deinterlaced with bwdif ({order}), one frame for each "
                         "source frame at its time, so the output is progressive")
    film = f"{float(source.fps):.5g}"
    if source.pulldown:
        notes.append(f"the source is film at {film} frames/s carried with 3:2 pulldown flags (soft telecine: shown as "
                     f"{float(source.fps * 5 / 4):.5g} frames/s, each frame for three fields and two in turn): each "
                     f"frame was read once, at the film's own rate, so the output is {film} frames/s progressive")
    if deinterlace != cadence:
        if deinterlace == "film" and source.pulldown:
            why = f"the source is film already, its own frames read at {film} frames/s (3:2 pulldown flags)"
        elif deinterlace == "film":
            why = ("its frame rate varies" if not video.cfr else f"its rate is {float(video.fps):.5g} frames/s, and "
                   "telecine (3:2 pulldown) makes 29.97 or 30")
        else:
            why = ("its frame rate varies" if video.interlaced else "its first frame is progressive (it turns "
                   "interlaced later)" if reading.interlaced else "the source is progressive")
        notes.append(f"deinterlace={deinterlace} was asked, but {why}: the output keeps the source's frame rate")
    if looks_telecined:
        notes.append("the source looks like telecined film (3:2 pulldown repeats a field in two of every five "
                     "frames): deinterlace=film would give the film's own frames back at 23.976, without the frames "
                     "that mix two film frames")
    if reading.transparent:
        share = f"{reading.transparent} of its {video.frames} frames"
        share = share if reading.transparent < video.frames else "every frame"
        over = "black (background=#RRGGBB names another colour)" if background == DEFAULT_BACKGROUND else background
        notes.append(f"the source has transparent pixels ({share}): MP4 has no alpha, so they were shown over {over}")
    if reading.captions:
        notes.append(f"the source's video carries closed captions (CEA-608/708, in {reading.captions} of its "
                     f"{source.frames} frames): the output has none; they are left out")
    deep = output_depth(video.bit_depth, codec) > 8
    if video.color_trc in HDR_TRANSFERS:
        kept = " and its mastering display and light levels" if video.mastering or video.light_level else ""
        how = "10-bit" if deep else "8-bit BT.709-matrix"
        notes.append(f"the source is HDR ({HDR_TRANSFERS[video.color_trc]} transfer): it was upscaled in {how} "
                     f"video with its transfer tag{kept} kept, not tone-mapped")
    if video.bit_depth > 8 and not deep:
        codecs = " or ".join(sorted(DEEP_CODECS))
        notes.append(f"the source is {video.bit_depth}-bit but {codec} was asked for: it was written at 8 bits, which "
                     f"may band smooth gradients (H.264's 10-bit profile, High 10, plays on few devices: none of "
                     f"Apple's, few hardware decoders); ask for {codecs} to keep 10 bits")
    elif deep:
        notes.append(f"the source is {video.bit_depth}-bit: it was upscaled and written at 10 bits (yuv420p10le)")
    # an animated WebP is read through Pillow as RGBA whatever its frames hold (lossy ones are 4:2:0): nothing said
    if video.codec != "webp" and (sampling := _finer_colour(video.pix_fmt)) is not None:
        finer, halved = sampling
        notes.append(f"the source's colour is {finer}: the output's is 4:2:0, as every output here is written for "
                     f"players to take it (half the colour resolution {halved})")
    if source.undecodable:  # the sound is kept from its start: the picture may begin after it
        delay = video.start - clock
        later = f"; the first frame shown is at {delay:.3f} s of the output" if delay >= 0.0005 else ""
        notes.append(f"the source's first {source.undecodable} frame(s) cannot be decoded (they refer to pictures "
                     f"before the file's start, as in a recording cut mid-stream): left out{later}")
    if video.retimed:
        notes.append(f"{video.retimed} frame(s) carried a timestamp earlier than the frames before them while the "
                     "frames after went on (a muxer's error): each was timed between its neighbours")
    if not video.cfr:
        notes.append(f"variable frame rate (average {float(video.fps):.3f} fps): every frame keeps its timestamp")
    if reading.repeated:
        notes.append(f"{reading.repeated} of the source's {source.frames} frames do not decode (the file is damaged "
                     "there): each was shown as the frame before it, as players do, so the output keeps its timing")
    if reading.damaged:
        notes.append(f"the decoder found damage in {reading.damaged} of the source's frames and covered it as players "
                     "do: those frames and the ones after them, up to the next keyframe, may show smears or blocks")
    if info.cut_short:
        notes.append("the source file ends partway through a frame or a sound packet (a recording that stopped while "
                     "it was written, or a partial copy): what comes before the cut was upscaled")  # fmt: skip
    # a re-encode is lossy (a recording's PCM, a film's DTS): said as a dropped stream is
    notes += [c.describe() for c in carried if c.action in ("drop", "aac")]
    return tuple(notes)
