"""Reading outputs back independently of `worker.media.probe`: every frame and every audio sample decoded."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np


@dataclass(frozen=True)
class Track:
    codec: str
    sample_rate: int
    channels: int
    seconds: float  # the track's duration as the MP4 declares it (decoders also emit the last packet's padding)
    decoded: float  # seconds of samples the decoder emits
    language: str | None


@dataclass(frozen=True)
class ReadBack:
    frames: int
    width: int
    height: int
    fps: Fraction
    rotation: int
    first: np.ndarray  # first frame, RGB
    audio: tuple[Track, ...]
    subtitles: tuple[tuple[str, str | None, tuple[bytes, ...]], ...]  # codec, language, texts
    metadata: dict[str, str]
    codec: str

    @property
    def seconds(self) -> float:
        return self.frames / float(self.fps)


def read_back(path: str | Path) -> ReadBack:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [frame for frame in container.decode(stream)]
        video = (len(frames), frames[0].width, frames[0].height, stream.average_rate, frames[0].rotation, frames[0].to_ndarray(format="rgb24"))
        codec = stream.codec_context.codec.canonical_name
    audio, subtitles = [], []
    with av.open(str(path)) as container:
        metadata = dict(container.metadata)
        for stream in container.streams.audio:
            samples = sum(frame.samples for frame in container.decode(stream))
            context = stream.codec_context
            declared = float(stream.duration * stream.time_base)
            audio.append(Track(context.codec.canonical_name, context.sample_rate, context.channels, declared, samples / context.sample_rate, stream.language))
    with av.open(str(path)) as container:
        for stream in container.streams.subtitles:
            texts = tuple(
                line.ass for packet in container.demux(stream) if packet.size for line in (stream.codec_context.decode2(packet) or [])
            )
            subtitles.append((stream.codec_context.name, stream.language, texts))
    return ReadBack(*video, tuple(audio), tuple(subtitles), metadata, codec)
