"""Before an output is called done it is read back and compared with what the job promised."""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

from worker.errors import PermanentError
from worker.media.errors import OutputMismatch
from worker.media.limits import Limits
from worker.media.passthrough import Carried, audio_output, output_timecode
from worker.media.probe import MediaInfo, output_chapters, probe


@dataclass(frozen=True)
class AudioPromise:
    codec: str
    sample_rate: int
    channels: int
    start: float  # seconds of output time its first sample is presented at
    duration: float  # seconds the stream covers: all of the source's
    slack: float  # beyond one frame: a copied stream ends on a packet boundary, up to half a packet off
    index: int = -1  # the source stream


@dataclass(frozen=True)
class Promise:
    frames: int
    width: int
    height: int
    fps: Fraction
    cfr: bool
    duration: float
    audio: tuple[AudioPromise, ...]
    subtitles: int
    sar: Fraction = Fraction(1)
    video_start: float = 0.0  # seconds of output time of the first frame
    chapters: int = 0
    covers: int = 0
    timecode: str | None = None
    bit_depth: int = 8  # the video's bits per sample (writer.output_depth)

    @classmethod
    def of(cls, source: MediaInfo, size: tuple[int, int], carried: tuple[Carried, ...], clock: float = 0.0,
           sar: Fraction | None = None) -> Promise:  # fmt: skip
        """What upscaling `source` to `size` (height, width) with `carried` streams must produce on an output clock
        that starts `clock` seconds into the source: every frame, the source's timing and pixel shape (or `sar`), each
        carried audio stream whole, at its own offset from the video."""
        video = source.video
        audio = []
        for stream in source.audio:
            action = next(c.action for c in carried if c.index == stream.index)
            if action != "drop":
                start, end = stream.start - clock, stream.start + stream.duration - clock
                first = max(start, 0.0)  # copied or re-encoded, a stream starts where it did against the video
                slack = stream.packet_seconds / 2 if action == "copy" else 0.0
                audio.append(AudioPromise(*audio_output(stream, action), first, max(0.0, end - first), slack, stream.index))
        subtitles = sum(c.kind == "subtitle" and c.action != "drop" for c in carried)
        sar = video.sar if sar is None else sar
        covers = sum(c.kind == "cover art" and c.action != "drop" for c in carried)
        timecode = output_timecode(source, carried)
        return cls(video.frames, size[1], size[0], video.fps, video.cfr, video.duration, tuple(audio), subtitles, sar,
                   video.start - clock, len(output_chapters(source.chapters, clock)), covers, timecode)  # fmt: skip


    def decoded(self, placed: dict[int, tuple[float, float]]) -> Promise:
        """The promise with re-encoded audio held to what its decoder gave (source stream -> (start, seconds) of
        output time): packet times only estimate it where packets carry no durations or overlap (ASF, Ogg)."""
        audio = tuple(replace(a, start=placed[a.index][0], duration=placed[a.index][1]) if a.index in placed else a for a in self.audio)
        return replace(self, audio=audio)


def verify(path: str | Path, promise: Promise) -> MediaInfo:
    """The probed output, or `OutputMismatch` listing every way it differs from `promise`. Durations may differ by
    one frame (copied audio by half a packet more); a constant frame rate must match exactly, a variable one on
    average to 1 %."""
    try:
        written = probe(path, Limits.none())
    except PermanentError as error:
        raise OutputMismatch(f"the output cannot be read back: {error.message}") from None
    video, frame = written.video, 1.0 / float(promise.fps)
    problems = []

    def check(what: str, got: object, expected: object, ok: bool) -> None:
        if not ok:
            problems.append(f"{what} is {got}, expected {expected}")

    check("frame count", video.frames, promise.frames, video.frames == promise.frames)
    check("size", f"{video.width}x{video.height}", f"{promise.width}x{promise.height}", (video.width, video.height) == (promise.width, promise.height))
    check("constant frame rate", video.cfr, promise.cfr, video.cfr == promise.cfr)
    fps_ok = video.fps == promise.fps if promise.cfr else abs(video.fps / promise.fps - 1) <= 0.01
    check("frame rate", video.fps, promise.fps, fps_ok)
    check("pixel aspect", video.sar, promise.sar, video.sar == promise.sar)
    check("bit depth", video.bit_depth, promise.bit_depth, video.bit_depth == promise.bit_depth)
    check("video start", f"{video.start:.3f} s", f"{promise.video_start:.3f} s", abs(video.start - promise.video_start) <= frame / 2)
    check("duration", f"{video.duration:.3f} s", f"{promise.duration:.3f} s", abs(video.duration - promise.duration) <= frame)
    check("audio stream count", len(written.audio), len(promise.audio), len(written.audio) == len(promise.audio))
    for number, (got, expected) in enumerate(zip(written.audio, promise.audio)):
        check(f"audio {number} codec", got.codec, expected.codec, got.codec == expected.codec)
        check(f"audio {number} sample rate", got.sample_rate, expected.sample_rate, got.sample_rate == expected.sample_rate)
        check(f"audio {number} channels", got.channels, expected.channels, got.channels == expected.channels)
        # Packets a codec needs before the first sample (AAC priming, Opus pre-skip) may start before 0.
        covered = got.start + got.duration - max(got.start, 0.0)
        ok = abs(covered - expected.duration) <= frame + expected.slack
        check(f"audio {number} duration", f"{covered:.3f} s", f"{expected.duration:.3f} s", ok)
        ok = abs(max(got.start, 0.0) - expected.start) <= frame + expected.slack
        check(f"audio {number} start", f"{max(got.start, 0.0):.3f} s", f"{expected.start:.3f} s", ok)
    check("subtitle stream count", len(written.subtitles), promise.subtitles, len(written.subtitles) == promise.subtitles)
    check("chapter count", len(written.chapters), promise.chapters, len(written.chapters) == promise.chapters)
    check("cover art count", len(written.covers), promise.covers, len(written.covers) == promise.covers)
    if problems:
        raise OutputMismatch(f"{Path(path).name} is not what was promised: " + "; ".join(problems))
    return written
