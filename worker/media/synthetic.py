"""Generated clips: moving shapes over a gradient (motion and detail are visible after upscaling), optionally with
a stereo tone, subtitles, rotation or irregular timestamps. The demo and the tests make every input with this."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch


def pattern(num_frames: int, height: int, width: int) -> torch.Tensor:
    """(F, 3, H, W) float frames in [0, 1]."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    frames = []
    for t in range(num_frames):
        cx, cy = width * (0.2 + 0.6 * t / max(1, num_frames - 1)), height / 2
        disc = ((x - cx) ** 2 + (y - cy) ** 2 < (min(height, width) / 5) ** 2).astype(np.float32)
        stripes = 0.5 + 0.5 * np.sin((x + 2 * t) / 3.0)
        frames.append(np.stack([x / width, y / height, 0.3 * stripes]) * (1 - disc) + disc * np.array([0.9, 0.8, 0.2])[:, None, None])
    return torch.from_numpy(np.stack(frames).astype(np.float32))


def tone(seconds: float, sample_rate: int = 48000, channels: int = 2) -> np.ndarray:
    """(channels, samples) float32: 440 Hz, a fifth higher on each further channel."""
    t = np.arange(round(seconds * sample_rate)) / sample_rate
    return np.stack([0.3 * np.sin(2 * np.pi * 440 * 1.5**c * t) for c in range(channels)]).astype(np.float32)


def write_clip(
    path: str | Path,
    num_frames: int = 17,
    size: tuple[int, int] = (64, 96),
    fps: Fraction = Fraction(24),
    *,
    video_codec: str = "libx264",
    pix_fmt: str = "yuv420p",
    crf: int = 12,
    audio_codec: str | None = None,
    sample_rate: int = 48000,
    layout: str = "stereo",
    rotation: int = 0,
    timestamps: Sequence[int] | None = None,
    time_base: Fraction | None = None,
    subtitles: str | None = None,
    language: str | None = None,
    metadata: Mapping[str, str] | None = None,
    video_options: Mapping[str, str] | None = None,
    sample_aspect_ratio: Fraction | None = None,
    audio_seconds: float | None = None,
    chapters: Sequence[tuple[float, float, str]] = (),
    container_options: Mapping[str, str] | None = None,
) -> Path:
    """Write a clip of the pattern, stored `size` = (height, width) before any display `rotation` (degrees
    counter-clockwise). `timestamps` (in `time_base`) make it variable-rate; `subtitles` is SRT text; the tone
    lasts as long as the video unless `audio_seconds` says otherwise; `video_options` go to the encoder,
    `container_options` to the muxer; `chapters` are (start, end, title) in seconds."""
    path = Path(path)
    height, width = size
    options = {"x265-params": "log-level=error"} if video_codec == "libx265" else {}
    with av.open(str(path), "w", options=container_options) as container, tempfile.TemporaryDirectory() as scratch:
        container.metadata.update(metadata or {})
        if chapters:
            container.set_chapters([
                {"id": number, "start": round(start * 1000), "end": round(end * 1000), "time_base": Fraction(1, 1000), "metadata": {"title": title}}
                for number, (start, end, title) in enumerate(chapters, 1)
            ])  # fmt: skip
        video = container.add_stream(video_codec, rate=fps, options={"crf": str(crf), **options, **(video_options or {})})
        video.width, video.height, video.pix_fmt = width, height, pix_fmt
        if sample_aspect_ratio is not None:
            video.codec_context.sample_aspect_ratio = sample_aspect_ratio
        if timestamps is not None:
            video.codec_context.time_base = time_base
        if rotation:
            video.set_display_rotation(rotation)
        audio = None
        if audio_codec is not None:
            audio = container.add_stream(audio_codec, rate=sample_rate, layout=layout)
            if language:
                audio.metadata["language"] = language
        subtitle_source = _subtitle_source(subtitles, Path(scratch)) if subtitles else None
        subtitle = container.add_stream_from_template(subtitle_source.streams.subtitles[0]) if subtitle_source else None
        if subtitle is not None and language:
            subtitle.metadata["language"] = language

        deep = max(component.bits for component in av.VideoFormat(pix_fmt).components) > 8
        for index, frame in enumerate(pattern(num_frames, height, width)):
            pixels = frame.permute(1, 2, 0).numpy()
            image = (
                av.VideoFrame.from_ndarray((pixels * 65535).round().astype(np.uint16), format="rgb48le")
                if deep
                else av.VideoFrame.from_ndarray((pixels * 255).round().astype(np.uint8), format="rgb24")
            )
            image.pts = index if timestamps is None else timestamps[index]
            container.mux(video.encode(image))
        container.mux(video.encode())

        if audio is not None:
            seconds = num_frames / fps if timestamps is None else float(timestamps[-1] * time_base) + 1 / float(fps)
            seconds = seconds if audio_seconds is None else audio_seconds
            _write_audio(container, audio, tone(float(seconds), sample_rate, audio.codec_context.channels), layout)
        if subtitle_source is not None:
            for packet in subtitle_source.demux(subtitle_source.streams.subtitles[0]):
                if packet.dts is not None:
                    packet.stream = subtitle
                    container.mux(packet)
            subtitle_source.close()
    return path


# x265's tags of the two HDR transfers: HLG (an iPhone's HDR video) and PQ (HDR10), both BT.2020
HDR_TAGS = {
    "hlg": "colorprim=bt2020:transfer=arib-std-b67:colormatrix=bt2020nc",
    "pq": "colorprim=bt2020:transfer=smpte2084:colormatrix=bt2020nc",
}


def gradient_clip(path: str | Path, num_frames: int = 9, size: tuple[int, int] = (32, 512), transfer: str = "hlg") -> Path:
    """A grey ramp over the whole range, left to right, in 10-bit HEVC tagged BT.2020 with the `transfer` ("hlg",
    "pq"): one code per pixel at 512 px, where 8 bits hold 219; what banding is measured on."""
    height, width = size
    ramp = np.linspace(0, 65535, width).round().astype(np.uint16)
    pixels = np.ascontiguousarray(np.broadcast_to(ramp[None, :, None], (height, width, 3)))
    with av.open(str(path), "w") as container:
        params = f"log-level=error:{HDR_TAGS[transfer]}"
        stream = container.add_stream("libx265", rate=Fraction(24), options={"crf": "4", "x265-params": params})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p10le"
        for index in range(num_frames):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb48le")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return Path(path)


def _write_audio(container: av.container.OutputContainer, stream: av.AudioStream, samples: np.ndarray, layout: str) -> None:
    context = stream.codec_context
    resampler = av.AudioResampler(format=context.format, layout=layout, rate=context.sample_rate, frame_size=context.frame_size or 1024)
    # interleaved: PyAV cannot make a planar frame of 8 channels (worker.media.passthrough._ToAac says why)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples.T).reshape(1, -1), format="flt", layout=layout)
    frame.sample_rate, frame.pts, frame.time_base = context.sample_rate, 0, Fraction(1, context.sample_rate)
    for chunk in [*resampler.resample(frame), *resampler.resample(None)]:
        container.mux(stream.encode(chunk))
    container.mux(stream.encode())


def _subtitle_source(srt: str, scratch: Path) -> av.container.InputContainer:
    (scratch / "subtitles.srt").write_text(srt)
    return av.open(str(scratch / "subtitles.srt"))
