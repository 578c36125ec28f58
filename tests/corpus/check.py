"""One corpus file through the CLI's upscale path (lanczos, x2), checked against what PyAV (FFmpeg's libraries, as
ffprobe reads them) says the input declares. Shared by tests/test_corpus.py and tests/corpus/results.py."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import av
from PIL import Image, UnidentifiedImageError

from tests.corpus.fetch import cache_dir, load_manifest, missing
from worker.errors import CodedError
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.request import SRRequest
from worker.upscale import UpscaleOptions, upscale_file

SCALE = 2
# x264 `superfast` still writes B-frames (what made the phone clip's average rate wrong: `ultrafast` writes none) at
# a fraction of `medium`'s time; every check here is of media handling, none of picture quality.
PRESET = "superfast"
OPTIONS = UpscaleOptions(request=SRRequest(scale=SCALE), preset=PRESET)
TEXT_SUBTITLES = {"subrip", "srt", "ass", "ssa", "webvtt", "mov_text", "text"}


def corpus() -> tuple[Path, list[dict]]:
    """The cache and the manifest's files; an AssertionError that says what to run where the cache is incomplete."""
    manifest, cache = load_manifest(), cache_dir()
    absent = missing(manifest, cache)
    assert not absent, (
        f"the media corpus is not in {cache} ({len(absent)} of {len(manifest['file'])} files missing or altered, "
        f"e.g. {absent[0]['name']}): run `make corpus` (tests/corpus/fetch.py) first"
    )
    return cache, manifest["file"]


@dataclass
class Track:
    channels: int
    rate: int
    language: str | None
    start: float  # first decoded sample, seconds
    seconds: float  # decoded samples / rate
    frame: float  # one audio frame (the first decoded one), seconds


@dataclass
class Declared:
    """A file as PyAV reads it: the default video stream (cover art aside) and every audio stream, decoded."""

    width: int
    height: int
    sar: Fraction
    rotation: int
    times: list[float]
    average_rate: Fraction | None  # as the demuxer declares it; for GIF and APNG, the whole file's (`declared`)
    audio: list[Track] = field(default_factory=list)
    subtitles: int = 0
    title: str | None = None
    chapters: list[tuple[float, str | None]] = field(default_factory=list)  # (start, title)

    @property
    def display_aspect(self) -> Fraction:
        return self.width * self.sar / self.height

    @property
    def frame(self) -> float:
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return statistics.median(gaps) if gaps else 0.0


def declared(path: Path) -> Declared:
    if _animated_webp(path):
        return _webp_declared(path)
    with av.open(str(path), metadata_errors="replace") as container:
        videos = [s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic]
        best = container.streams.best("video")  # what ffmpeg and players pick
        video = best if best in videos else next((s for s in videos if s.disposition & av.stream.Disposition.default), videos[0])
        context = video.codec_context
        width, height = context.width, context.height  # ffprobe's width/height: the declared picture
        sar = video.sample_aspect_ratio or context.sample_aspect_ratio
        sar = Fraction(sar) if sar and sar > 0 else Fraction(1)
        title = container.metadata.get("title")
        chapters = [(float(c["start"] * c["time_base"]), c["metadata"].get("title")) for c in container.chapters()]
        subtitles = sum(s.codec_context is not None and s.codec_context.name in TEXT_SUBTITLES for s in container.streams.subtitles)
        rate = video.average_rate if video.average_rate and video.average_rate > 0 else None
        timed_each = container.format.name in ("gif", "apng")
        times, rotation, last = [], 0, 0.0
        for frame in _frames(container, video):
            if not times:
                rotation = round(frame.rotation / 90) * 90 % 360
            last = float(frame.duration * video.time_base) if frame.duration else 0.0
            # Frames the decoder hands over when flushed carry no time base of their own (`time` is NaN): the stream's
            times.append(float(frame.pts * video.time_base) if frame.pts is not None else len(times) / float(video.guessed_rate))
    tracks = []
    with av.open(str(path), metadata_errors="replace") as container:
        indices = [s.index for s in container.streams.audio if s.codec_context is not None and s.codec_context.channels]
    for index in indices:
        with av.open(str(path), metadata_errors="replace") as container:  # one pass per stream: no seeking back
            stream = container.streams[index]
            samples, start, frame = 0, None, 0.0
            declared_start = float(stream.start_time * stream.time_base) if stream.start_time is not None else None
            try:
                for decoded in _frames(container, stream):
                    if not samples:  # the first sound: its time, or where ffprobe says the stream starts if it has none
                        start = float(decoded.pts * stream.time_base) if decoded.pts is not None else declared_start
                    frame = max(frame, decoded.samples / decoded.sample_rate)  # Vorbis frames vary: the longest
                    samples += decoded.samples
            except av.error.FFmpegError:
                pass  # a cut file: what decodes is what there is
            if declared_start is not None and start is not None:
                # ffprobe's start_time where decoded times claim earlier (Ogg counts back from its pages' end)
                start = max(start, declared_start)
            if samples:
                tracks.append(Track(stream.codec_context.channels, stream.codec_context.sample_rate, stream.language,
                                    start or 0.0, samples / stream.codec_context.sample_rate, frame))  # fmt: skip
    if rotation in (90, 270):
        width, height, sar = height, width, 1 / sar
    if timed_each and len(times) > 1:
        # Each frame timed by its own delay: the demuxers' average is an estimate from the first frames
        # (find_stream_info's), not the file's frames over the time they are shown
        span = max(times) - min(times) + (last or statistics.median(b - a for a, b in zip(times, times[1:])))
        rate = Fraction(len(times) / span).limit_denominator(1001)
    return Declared(width, height, sar, rotation, sorted(times), rate, tracks, subtitles, title, chapters)


def _animated_webp(path: Path) -> bool:
    try:
        with Image.open(path) as image:
            return image.format == "WEBP" and getattr(image, "n_frames", 1) > 1
    except (OSError, UnidentifiedImageError):
        return False


def _webp_declared(path: Path) -> Declared:
    """An animated WebP, which FFmpeg cannot decode, as libwebp (through Pillow) reads it: each frame shown for its
    duration, or for 100 ms where that is 10 ms or less, as browsers show it (and FFmpeg's GIF demuxer times GIFs)."""
    times, shown = [], 0.0
    with Image.open(path) as image:
        for index in range(image.n_frames):
            image.seek(index)
            image.load()
            times.append(shown)
            duration = image.info.get("duration", 0)
            shown += (duration if duration > 10 else 100) / 1000
        width, height = image.size
    rate = Fraction(len(times) / shown).limit_denominator(1001)
    return Declared(width, height, Fraction(1), 0, times, rate)


def _frames(container: av.container.InputContainer, stream: av.stream.Stream):
    """As ffprobe -count_frames decodes: empty packets (Ogg's repeated Theora frames) are skipped, not sent."""
    for packet in container.demux(stream):
        if packet.size:
            yield from packet.decode()
    yield from stream.decode(None)


@dataclass
class Outcome:
    name: str
    status: str  # "pass", "refused" (the code the manifest expects), "FAIL"
    detail: str
    seconds: float
    source: Declared | None = None


def run(entry: dict, cache: Path, out_dir: Path, upscale=None) -> Outcome:
    """Upscale one manifest entry into `out_dir` (by `upscale(source, output)`, default: in-process, as the CLI
    calls it) and check it; the outcome says every way it falls short."""
    source, output = cache / entry["name"], out_dir / f"{entry['name']}.mp4"
    started = time.monotonic()
    expected = entry.get("refuse")
    try:
        (upscale or _in_process)(source, output)
    except CodedError as error:
        seconds = time.monotonic() - started
        left = sorted(p.name for p in out_dir.iterdir())
        if left:
            return Outcome(entry["name"], "FAIL", f"{error.code}, and left {left} behind", seconds)
        if error.code == expected:
            return Outcome(entry["name"], "refused", f"{error.code}: {error.message}", seconds)
        return Outcome(entry["name"], "FAIL", f"{error.code}: {error.message}", seconds)
    seconds = time.monotonic() - started
    if expected:
        return Outcome(entry["name"], "FAIL", f"expected {expected}, but it was upscaled", seconds)
    before, after = declared(source), declared(output)
    problems = compare(before, after)
    return Outcome(entry["name"], "FAIL" if problems else "pass", "; ".join(problems), seconds, before)


def _in_process(source: Path, output: Path) -> None:
    upscale_file(source, output, LanczosUpscaler(), OPTIONS)


def compare(before: Declared, after: Declared) -> list[str]:
    """Every way the output differs from what the issue promises of it."""
    problems = []
    if len(after.times) != len(before.times):
        problems.append(f"{len(after.times)} frames, the input has {len(before.times)}")
    else:
        half = before.frame / 2 if before.frame else 0.001
        shifted = [t - before.times[0] for t in before.times]
        got = [t - after.times[0] for t in after.times]
        off = max((abs(a - b) for a, b in zip(got, shifted)), default=0.0)
        if off > half + 1e-6:
            problems.append(f"a frame is {off * 1000:.1f} ms off its input time (half a frame: {half * 1000:.1f} ms)")
    if (after.width, after.height) != (before.width * SCALE, before.height * SCALE):
        problems.append(f"{after.width}x{after.height}, expected {before.width * SCALE}x{before.height * SCALE}")
    if abs(after.display_aspect / before.display_aspect - 1) > 0.005:
        problems.append(f"display aspect {float(after.display_aspect):.4f}, the input's {float(before.display_aspect):.4f}")
    if after.rotation:
        problems.append(f"rotation {after.rotation} left for players to apply")
    if before.average_rate and after.average_rate and abs(after.average_rate / before.average_rate - 1) > 0.02:
        problems.append(f"average rate {float(after.average_rate):.3f}, the input's {float(before.average_rate):.3f}")
    if len(after.audio) != len(before.audio):
        problems.append(f"{len(after.audio)} audio streams, the input has {len(before.audio)}")
    for number, (got, was) in enumerate(zip(after.audio, before.audio)):
        tolerance = max(was.frame, got.frame) + 1e-3  # one audio frame
        if (got.channels, got.rate) != (was.channels, was.rate):
            problems.append(f"audio {number}: {got.channels} ch {got.rate} Hz, the input's {was.channels} ch {was.rate} Hz")
        if (got.language or None) != (was.language or None) and was.language not in (None, "und"):
            problems.append(f"audio {number}: language {got.language}, the input's {was.language}")
        if abs(got.seconds - was.seconds) > tolerance:
            problems.append(f"audio {number}: {got.seconds:.3f} s of sound, the input has {was.seconds:.3f} s")
        offset_before, offset_after = was.start - before.times[0], got.start - after.times[0]
        if abs(offset_after - offset_before) > tolerance:
            problems.append(f"audio {number} starts {offset_after:+.3f} s from the video, {offset_before:+.3f} s in the input")
    if after.subtitles != before.subtitles:
        problems.append(f"{after.subtitles} text subtitle streams, the input has {before.subtitles}")
    if len(after.chapters) != len(before.chapters):
        problems.append(f"{len(after.chapters)} chapters, the input has {len(before.chapters)}")
    for (got, got_title), (was, was_title) in zip(after.chapters, before.chapters):
        if got_title != was_title or abs((got - after.times[0]) - (was - before.times[0])) > 0.002:  # kept to the ms
            problems.append(f"chapter {was_title!r} at {was:.3f} s came back as {got_title!r} at {got:.3f} s")
    if before.title and after.title != before.title:
        problems.append(f"title {after.title!r}, the input's {before.title!r}")
    return problems
