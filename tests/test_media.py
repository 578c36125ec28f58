"""Real files in, real MP4s out (lanczos where the model adds nothing): every frame, exact sizes, native timing,
the audio in sync, subtitles and metadata, and a typed error with nothing left behind for every bad input."""

from __future__ import annotations

import gc
import hashlib
import os
import re
import resource
import struct
import subprocess
import sys
import weakref
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from tests.mediatools import read_back
from worker.errors import PermanentError
from worker.media.errors import InputCorrupt
from worker.media.limits import Limits
from worker.media.passthrough import Passthrough, aac_format, plan_streams
from worker.media.probe import probe
from worker.media.reader import EXACT_8_BIT, _source_colour, prefetch, read_frames
from worker.media.resize import Target
from worker.media.synthetic import _write_audio, gradient_clip, pattern, tone, write_clip
from worker.media.writer import Mp4Writer
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.request import SRRequest
from worker.upscale import UpscaleOptions, upscale_file

SIZE = (190, 250)  # stored height, width
FRAMES = 25
FAST = UpscaleOptions(request=SRRequest(scale=2), preset="ultrafast")
VFR = [0, 20, 53, 120, 140, 190, 260, 280, 300, 333] + [333 + 33 * i for i in range(1, FRAMES - 9)]  # ms

# name: (file suffix, write_clip arguments, expected output audio (codec, rate, channels) or None)
CASES = {
    "mp4-aac-30fps": ("mp4", dict(fps=Fraction(30), audio_codec="aac"), ("aac", 48000, 2)),
    "mp4-aac-25fps": ("mp4", dict(fps=Fraction(25), audio_codec="aac"), ("aac", 48000, 2)),
    "mp4-aac-29.97fps": ("mp4", dict(fps=Fraction(30000, 1001), audio_codec="aac"), ("aac", 48000, 2)),
    "mp4-aac-60fps": ("mp4", dict(fps=Fraction(60), audio_codec="aac"), ("aac", 48000, 2)),  # a frame < an AAC packet
    "vfr": ("mp4", dict(fps=Fraction(30), audio_codec="aac", timestamps=VFR, time_base=Fraction(1, 1000)), ("aac", 48000, 2)),
    "rotated": ("mp4", dict(fps=Fraction(30), audio_codec="aac", rotation=90), ("aac", 48000, 2)),
    "silent": ("mp4", dict(fps=Fraction(30)), None),
    "mkv-opus": ("mkv", dict(fps=Fraction(30), audio_codec="libopus"), ("opus", 48000, 2)),
    "webm-vp9-opus": ("webm", dict(fps=Fraction(30), video_codec="libvpx-vp9", audio_codec="libopus"), ("opus", 48000, 2)),
    "10bit-hevc-flac": ("mkv", dict(fps=Fraction(30), video_codec="libx265", pix_fmt="yuv420p10le", audio_codec="flac"), ("flac", 48000, 2)),
    "mov-pcm-5.1-44.1k": ("mov", dict(fps=Fraction(24), audio_codec="pcm_s16le", layout="5.1", sample_rate=44100), ("aac", 44100, 6)),
    "ts-aac": ("ts", dict(fps=Fraction(30), audio_codec="aac"), ("aac", 48000, 2)),
    "avi-mjpeg-full-range-mp3": ("avi", dict(fps=Fraction(30), video_codec="mjpeg", pix_fmt="yuvj420p", audio_codec="libmp3lame"), ("mp3", 48000, 2)),
}


def frame_times(path: Path) -> list[float]:
    with av.open(str(path)) as container:
        return sorted(float(frame.time) for frame in container.decode(video=0))


@pytest.mark.parametrize("case", list(CASES))
def test_every_frame_the_exact_size_the_timing_and_the_audio_come_back(tmp_path, case):
    suffix, arguments, audio = CASES[case]
    source = write_clip(tmp_path / f"in.{suffix}", FRAMES, SIZE, **arguments)
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)

    back = read_back(output)
    rotated = arguments.get("rotation")
    assert (back.frames, back.width, back.height) == (FRAMES, *((380, 500) if rotated else (500, 380)))
    assert back.rotation == 0  # frames are upright; no display matrix is left to apply twice
    source_times, times = frame_times(source), frame_times(output)
    assert np.allclose(times, np.array(source_times) - source_times[0], atol=1e-3)  # every frame at its own time
    # (AVI from PyAV leaves the second frame's slot empty: the decoded timeline has a gap, which is kept.)
    assert result.written.video.cfr == result.source.video.cfr == ("timestamps" not in arguments and suffix != "avi")
    if result.source.video.cfr:
        assert back.fps == arguments["fps"]
    seconds = times[-1] + (times[-1] - times[0]) / (FRAMES - 1)  # end of the last frame
    if audio is None:
        assert back.audio == ()
    else:
        [track] = back.audio
        assert (track.codec, track.sample_rate, track.channels) == audio
        assert abs(track.seconds - seconds) <= seconds / FRAMES  # within one frame of the video
        assert track.decoded >= track.seconds - 0.001  # and the samples are really there
    if rotated:  # turned counter-clockwise for display: the stored right edge (red) is now the top
        red, green = back.first[..., 0].astype(float), back.first[..., 1].astype(float)
        assert red[:40].mean() > red[-40:].mean() + 100 and green[:, -40:].mean() > green[:, :40].mean() + 100


@pytest.mark.parametrize(("suffix", "codec"), [("mp4", "aac"), ("mov", "pcm_s16le")])  # copied / re-encoded
def test_sound_before_the_first_frame_is_kept_in_sync_and_the_video_starts_as_late(tmp_path, suffix, codec):
    """Video from 0.333 s, audio from 0: nothing of the sound is lost, so the output's clock starts with the audio
    and its first frame comes at 0.333 s. The 440 Hz tone tells where the audio starts to a fraction of a sample,
    modulo its period: unshifted (cutting the sound at the first frame, as before, shifted it by 56.7 samples)."""
    late = [333 + round(i * 1000 / 30) for i in range(FRAMES)]
    source = write_clip(tmp_path / f"in.{suffix}", FRAMES, SIZE, Fraction(30), audio_codec=codec, timestamps=late, time_base=Fraction(1, 1000))
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    with av.open(str(output)) as container:
        left = np.concatenate([frame.to_ndarray()[0] for frame in container.decode(audio=0)])  # AAC decodes planar
    t = np.arange(4800, 9600) / 48000  # 0.1 s to 0.2 s: clear of the codec's start-up
    period = 48000 / 440
    shift = min(np.arange(0, period, 0.25), key=lambda s: np.abs(left[4800:9600] - 0.3 * np.sin(2 * np.pi * 440 * (t + s / 48000))).mean())
    assert min(shift, period - shift) <= 3
    assert abs(frame_times(output)[0] - 0.333) <= 0.5 / 30  # the video starts where it did against the sound
    assert abs(read_back(output).audio[0].seconds - (0.333 + FRAMES / 30)) <= 1024 / 48000  # all of the sound


def test_re_encoded_sound_that_starts_after_the_first_frame_starts_as_late_with_no_priming_before_it(tmp_path):
    """PCM (re-encoded to AAC) from 0.1 s, video from 0: the AAC track starts at 0.1 s with the tone's first sample
    and holds the source's samples, not the encoder's 1024 samples of priming ahead of them (which an empty edit
    alone, as FFmpeg's muxer writes it, would play)."""
    source, rate, delay, count = tmp_path / "in.mov", 48000, 4800, 24000
    with av.open(str(source), "w") as container:
        video = container.add_stream("mpeg4", rate=30)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = container.add_stream("pcm_s16le", rate=rate, layout="mono")
        samples = (0.3 * 32767 * np.sin(2 * np.pi * 440 * np.arange(count) / rate)).astype(np.int16)
        for start in range(0, count, 1200):
            frame = av.AudioFrame.from_ndarray(samples[None, start : start + 1200], format="s16", layout="mono")
            frame.sample_rate, frame.pts = rate, delay + start
            container.mux(audio.encode(frame))
        for index in range(20):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), index * 10, np.uint8), format="rgb24")
            frame.pts = index
            container.mux(video.encode(frame))
        container.mux(video.encode())
        container.mux(audio.encode())
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    with av.open(str(output)) as container:
        decoded = list(container.decode(audio=0))
    got = np.concatenate([frame.to_ndarray()[0] for frame in decoded])
    assert abs(float(decoded[0].pts * decoded[0].time_base) - delay / rate) <= 0.001  # from 0.1 s, as the source
    assert count <= len(got) < count + 1024  # the source's samples, padded to the last AAC frame at most
    expected = 0.3 * np.sin(2 * np.pi * 440 * np.arange(2048, 4096) / rate)
    assert np.abs(got[2048:4096] - expected).mean() < 0.02  # the tone where it is due, not shifted by priming


def test_ten_bit_input_is_read_with_its_precision(tmp_path):
    source = write_clip(tmp_path / "in.mkv", 3, SIZE, video_codec="libx265", pix_fmt="yuv420p10le")
    info = probe(source).video
    assert (info.bit_depth, info.pix_fmt) == (10, "yuv420p10le")
    frame = next(read_frames(source, info))
    assert frame.dtype == np.uint16 and frame.shape == (*SIZE, 3)
    assert np.mean(frame % 257 != 0) > 0.5  # not 8-bit values scaled up


@pytest.mark.parametrize(("matrix", "colour_range"), [("ITU709", "MPEG"), ("ITU601", "JPEG")])
def test_colour_is_read_with_the_streams_own_matrix_and_range(tmp_path, matrix, colour_range):
    colour = np.array([200, 50, 100], np.uint8)
    path = tmp_path / "solid.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=10, options={"crf": "0"})
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        tags = {"ITU709": 1, "ITU601": 6}[matrix], {"MPEG": 1, "JPEG": 2}[colour_range]
        stream.codec_context.colorspace, stream.codec_context.color_range = tags
        for index in range(2):
            frame = av.VideoFrame.from_ndarray(np.broadcast_to(colour, (48, 64, 3)).copy(), format="rgb24")
            frame = frame.reformat(format="yuv420p", dst_colorspace=matrix, dst_color_range=colour_range)
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    frame = next(read_frames(path, probe(path).video))
    assert np.abs(frame[24, 32].astype(int) - colour).max() <= 3  # a wrong matrix or range is off by 10-30


def test_subtitles_languages_metadata_and_chapters_follow_into_the_mp4(tmp_path):
    # cues and chapters inside the clip's FRAMES / 30 s
    srt = "1\n00:00:00,100 --> 00:00:00,400\nBonjour\n\n2\n00:00:00,450 --> 00:00:00,750\nAu revoir\n"
    chapters = [(0.0, 0.4, "Début"), (0.4, FRAMES / 30, "Fin")]
    source = write_clip(
        tmp_path / "in.mkv", FRAMES, SIZE, Fraction(30), audio_codec="libopus", subtitles=srt, language="fra", metadata={"title": "Essai"},
        chapters=chapters,
    )  # fmt: skip
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    back = read_back(output)
    [(codec, language, texts)] = back.subtitles
    assert (codec, language) == ("mov_text", "fra")
    assert [text.split(b",")[-1] for text in texts] == [b"Bonjour", b"Au revoir"]
    assert back.audio[0].language == "fra" and back.metadata.get("title") == "Essai"
    with av.open(str(output)) as container:
        kept = [(float(c["start"] * c["time_base"]), c["metadata"].get("title")) for c in container.chapters()]
    assert kept == [(start, title) for start, _, title in chapters]


def test_chapters_in_a_chapter_track_are_not_said_to_be_left_out(tmp_path):
    """An MP4's chapters are a QuickTime chapter track (a text track its video names in `tref/chap`), as vsrq writes
    them and as androidx/media's sample_with_chapters.mp4 holds them. Upscaled, the chapters were kept, and the job
    said "data #2 (SubtitleHandler, a data track only its maker's software reads): left out"."""
    chapters = [(0.0, 0.4, "Début"), (0.4, FRAMES / 30, "Fin")]
    source = write_clip(tmp_path / "in.mkv", FRAMES, SIZE, Fraction(30), audio_codec="aac", chapters=chapters)
    once, twice = tmp_path / "once.mp4", tmp_path / "twice.mp4"
    upscale_file(source, once, LanczosUpscaler(), FAST)
    result = upscale_file(once, twice, LanczosUpscaler(), FAST)
    assert [c for c in result.carried if c.kind == "data"] == [] and not any("data #" in n for n in result.notes)
    with av.open(str(twice)) as container:
        kept = [(float(c["start"] * c["time_base"]), c["metadata"].get("title")) for c in container.chapters()]
    assert kept == [(start, title) for start, _, title in chapters]


def test_overlapping_cues_show_together_at_their_own_times(tmp_path):
    """Two speakers' SRT cues overlap. An MP4 text track shows one sample at a time: the muxer moved the second cue to
    after the first ended (0.1 s late, and to 1.0 s instead of 0.9); now the overlap shows both, one line each."""
    srt = "1\n00:00:00,100 --> 00:00:00,600\nBonjour\n\n2\n00:00:00,500 --> 00:00:00,900\nAu revoir\n"
    source = write_clip(tmp_path / "in.mkv", 30, SIZE, Fraction(30), subtitles=srt)
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    with av.open(str(output)) as container:
        stream = container.streams.subtitles[0]
        samples = [packet for packet in container.demux(stream) if packet.size > 2]  # not the muxer's empty ones
        shown = [(float(p.pts * p.time_base), float(p.duration * p.time_base), bytes(p)[2:].decode()) for p in samples]
    assert shown == [(0.1, 0.4, "Bonjour"), (0.5, 0.1, "Bonjour\nAu revoir"), (0.6, 0.3, "Au revoir")]


@pytest.mark.parametrize(
    ("target", "mode", "size"),
    [("320x240", "fit", (316, 240)), ("320x240", "exact", (320, 240)), ("hd", "fit", (500, 380)), ("240x320", "fit", (240, 182))],
)
def test_target_resolution_downscales_after_sr(tmp_path, target, mode, size):
    source = write_clip(tmp_path / "in.mp4", 5, SIZE)
    output = tmp_path / "out.mp4"
    options = UpscaleOptions(request=SRRequest(scale=2), target=Target.parse(target, mode), preset="ultrafast")
    upscale_file(source, output, LanczosUpscaler(), options)
    back = read_back(output)
    assert (back.width, back.height, back.frames) == (*size, 5)


@pytest.mark.parametrize(("sar", "target", "size"), [(Fraction(64, 45), "256x192", (180, 120)), (Fraction(8, 9), "256x256", (288, 192))])
def test_a_fit_target_boxes_non_square_pixels_as_they_are_displayed(tmp_path, sar, target, size):
    """The box was laid over stored pixels. A 16:9 PAL DVD's shape (64:45 pixels; x2: 288x192, shown 410 wide) fit
    into 256x192 came back 256x170, shown 364 wide: wider than the box. A 4:3 NTSC DVD's (8:9; x2: 288x192, shown
    256 wide) was shrunk to 256x170 in a 256x256 box it already fitted. The box now holds the picture as shown."""
    source = write_clip(tmp_path / "in.mp4", 5, (96, 144), sample_aspect_ratio=sar)
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), replace(FAST, target=Target.parse(target, "fit")))
    written = probe(output).video
    box = tuple(map(int, target.split("x")))
    assert ((written.width, written.height), written.sar) == (size, sar)
    assert written.width * sar <= box[0] and written.height <= box[1]  # displayed within the box
    assert written.display_aspect == probe(source).video.display_aspect


@pytest.mark.parametrize(
    ("rotation", "sar", "target", "mode", "size"),
    [
        (90, Fraction(1), "299x399", "fit", (298, 392)),  # upright x2: 380x500, the width bound
        (90, Fraction(1), "379x499", "fit", (378, 498)),  # both sides bound
        (270, Fraction(1), "299x399", "exact", (298, 398)),
        (0, Fraction(64, 45), "212x144", "fit", (148, 98)),  # x2: 288x192 shown 410 wide
    ],
)
def test_a_target_box_is_never_overshot_by_rounding_to_even(tmp_path, rotation, sar, target, mode, size):
    """Sizes are rounded to even (4:2:0) to the nearest: a phone's clip (stored landscape, turned upright) in a
    299x399 box came back 300 wide, and 300x400 exact; a DVD's 64:45 pixels 150 wide in a 212-wide box were shown
    213 wide. The picture is now fit into the largest even box inside the box, then rounded."""
    stored = SIZE if sar == 1 else (96, 144)
    source = write_clip(tmp_path / "in.mp4", 5, stored, rotation=rotation, sample_aspect_ratio=sar)
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), replace(FAST, target=Target.parse(target, mode)))
    written = probe(output).video
    box_width, box_height = map(int, target.split("x"))
    assert (written.width, written.height, written.rotation) == (*size, 0)
    assert written.width * written.sar <= box_width and written.height <= box_height
    if mode == "fit":  # the picture's shape kept, to a pixel shown
        assert abs((written.display_aspect - probe(source).video.display_aspect) * written.height) < 2


def test_an_exact_target_is_the_size_shown_in_square_pixels(tmp_path):
    """An exact 256x144 of a 16:9 PAL DVD's shape kept its 64:45 pixels: the 256x144 picture was shown 364 wide."""
    source = write_clip(tmp_path / "in.mp4", 5, (96, 144), sample_aspect_ratio=Fraction(64, 45))
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), replace(FAST, target=Target.parse("256x144", "exact")))
    written = probe(output).video
    assert (written.width, written.height, written.sar) == (256, 144, 1)


def test_target_resolution_never_upscales(tmp_path):
    source = write_clip(tmp_path / "in.mp4", 5, SIZE)
    options = UpscaleOptions(request=SRRequest(scale=2), target=Target.parse("fullhd", "exact"))
    with pytest.raises(PermanentError) as error:
        upscale_file(source, tmp_path / "out.mp4", LanczosUpscaler(), options)
    assert error.value.code == "invalid_request" and not (tmp_path / "out.mp4").exists()


def _flat_clip(path: Path, frames: int, options: dict[str, str], metadata: dict[str, str] | None = None) -> Path:
    """`frames` flat 64x48 frames of H.264 at 24 fps, a shade lighter each, muxed with `options` under `metadata`."""
    with av.open(str(path), "w", options=options) as container:
        container.metadata.update(metadata or {})
        video = container.add_stream("libx264", rate=24)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        for index in range(frames):
            image = av.VideoFrame.from_ndarray(np.full((48, 64, 3), index * 20, np.uint8), format="rgb24")
            image.pts = index
            container.mux(video.encode(image))
        container.mux(video.encode())
    return path


def test_an_encrypted_video_is_refused_not_upscaled_as_noise(tmp_path):
    """Common Encryption (a purchase's or a stream's DRM) decodes without error, to noise: a `cbcs` trailer came back
    `completed`, flat grey where its clear copy says "An Apple Original". FFmpeg's muxer encrypts as CENC does."""
    keys = {"encryption_key": "00112233445566778899aabbccddeeff", "encryption_kid": "a0a1a2a3a4a5a6a7a8a9aaabacadaeaf"}
    source = _flat_clip(tmp_path / "in.mp4", 10, {"encryption_scheme": "cenc-aes-ctr", **keys})
    with pytest.raises(PermanentError) as error:
        upscale_file(source, tmp_path / "out.mp4", LanczosUpscaler(), FAST)
    assert error.value.code == "input_encrypted" and "video is encrypted (DRM: Common Encryption)" in str(error.value)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.mp4"]


@pytest.mark.parametrize(("codec", "name"), [("hevc", "hevc"), ("av1", "av1")])
def test_hevc_and_av1_outputs(tmp_path, codec, name):
    source = write_clip(tmp_path / "in.mp4", 5, (64, 96), audio_codec="aac")
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), UpscaleOptions(request=SRRequest(scale=2), codec=codec, crf=30, preset="ultrafast"))
    back = read_back(output)
    assert (back.codec, back.frames, back.width, back.height, len(back.audio)) == (name, 5, 192, 128, 1)
    with av.open(str(output)) as container:  # progressive, as an H.264 output says (x265 left it unknown: 0)
        assert container.streams.video[0].codec_context.field_order == 1


def test_an_input_smaller_than_one_tile_is_padded_and_said_so(tmp_path, engine):
    source = write_clip(tmp_path / "in.mp4", 9, (12, 20))  # the tiny model's x2 input tile here is 16x32
    result = upscale_file(source, tmp_path / "out.mp4", engine, FAST)
    back = read_back(tmp_path / "out.mp4")
    assert (back.frames, back.width, back.height) == (9, 40, 24)
    assert any("smaller than one model tile" in note for note in result.notes)


# --- bad input ------------------------------------------------------------------------------------------------


def _truncated(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _corrupted(path: Path) -> None:
    data = bytearray(path.read_bytes())
    start = data.find(b"mdat") + (data.find(b"moov") - data.find(b"mdat")) // 3
    data[start : start + 4000] = np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


def _faststart(path: Path) -> Path:
    with Mp4Writer(path, Fraction(30), SIZE) as writer:
        writer.write(pattern(30, *SIZE))
    return path


def _audio_only(path: Path) -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=48000, layout="stereo")
        frame = av.AudioFrame.from_ndarray(tone(1.0), format="fltp", layout="stereo")
        frame.sample_rate, frame.pts = 48000, 0
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def _unknown_codec(path: Path) -> Path:
    write_clip(path, 10, SIZE)
    path.write_bytes(path.read_bytes().replace(b"V_MPEG4/ISO/AVC", b"V_MPEG4/ISO/XYZ"))
    return path


def _intra_sizes(path: Path) -> Path:
    """MJPEG whose frames the probe decodes for their size (an intra-only codec's keyframes: one a second) are 48x32,
    the others 96x64: past a limit of 48x32x2 pixels, as a 45 MB file's 12000x12000 frames were past 4K and took its
    worker to 4.5 GB, decoded whole."""
    small = {0, 1, 9, 17}  # what the probe samples at 8 frames a second
    with av.open(str(path), "w", format="mov") as container:
        stream = container.add_stream("mjpeg", rate=8)
        stream.width, stream.height, stream.pix_fmt = 48, 32, "yuvj420p"
        for index in range(24):
            width, height = (48, 32) if index in small else (96, 64)
            encoder = av.CodecContext.create("mjpeg", "w")
            encoder.width, encoder.height, encoder.pix_fmt = width, height, "yuvj420p"
            encoder.time_base = Fraction(1, 8)
            pixels = np.full((height, width, 3), 40 * (index % 6), np.uint8)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24").reformat(format="yuvj420p")
            frame.pts = index
            for packet in [*encoder.encode(frame), *encoder.encode(None)]:
                packet.stream, packet.pts, packet.dts, packet.duration = stream, index, index, 1
                packet.time_base = Fraction(1, 8)
                container.mux(packet)
    return path


def _long_sound(path: Path) -> Path:
    """A second of video and ten of sound, written as a live Matroska stream is: no duration declared. It passed the
    length limit and came back as long as its sound."""
    return write_clip(path, 24, SIZE, audio_codec="aac", audio_seconds=10, container_options={"live": "1"})


def _joined(path: Path, later_first: bool) -> Path:
    """Two recordings joined end to end (`cat a.ts b.ts`), each with its own clock: the second's timestamps start
    over (the same times again), or start before the first's (it ran back)."""
    first = write_clip(path.with_name("a.ts"), FRAMES, SIZE, Fraction(25), audio_codec="aac",
                       timestamps=[250 * later_first + i for i in range(FRAMES)], time_base=Fraction(1, 25))  # fmt: skip
    second = write_clip(path.with_name("b.ts"), FRAMES, SIZE, Fraction(25), audio_codec="aac")
    path.write_bytes(first.read_bytes() + second.read_bytes())
    return path


def test_recordings_joined_end_to_end_are_refused_where_the_first_one_ends(tmp_path):
    """The refusal named the latest time of the frames 17 and more before the restart (1.600 s of a 2.240 s first
    recording, in a real file), not where the first recording ends."""
    with pytest.raises(InputCorrupt) as refused:
        probe(_joined(tmp_path / "clip.ts", later_first=False))
    said = refused.value.message
    # both recordings start at the muxer's same offset: the first ends FRAMES - 1 frames after the restart's time
    restart, ended = (float(t) for t in re.search(r"timestamp \(([\d.]+) s\).*up to ([\d.]+) s", said).groups())
    assert f"frame {FRAMES + 1}'s" in said and abs(ended - restart - (FRAMES - 1) / 25) < 0.001, said


def test_a_picture_whose_data_does_not_decode_says_so_not_a_permission(tmp_path):
    """gdk-pixbuf's test suite's overflow-codes.gif (35 bytes: an LZW code past its table). FFmpeg's decoder answers
    EPERM, and the refusal read "(Operation not permitted)": users checked the file's permissions."""
    path = tmp_path / "overflow-codes.gif"
    path.write_bytes(bytes.fromhex("47494638396102000200f00000000000ffffff2c0000000002000200000c021001003b"))
    with pytest.raises(InputCorrupt) as refused:
        probe(path)
    assert "overflow-codes.gif cannot be read to the end (its data does not decode: " in refused.value.message


BAD = {
    "not a video": ("clip.mp4", lambda p: p.write_text("hello, this is not a video\n" * 40), "input_unreadable", Limits()),
    "zero bytes": ("clip.mp4", lambda p: p.write_bytes(b""), "input_empty", Limits()),
    "missing": ("clip.mp4", lambda p: None, "input_not_found", Limits()),
    "truncated index": ("clip.mp4", lambda p: _truncated(write_clip(p, FRAMES, SIZE, audio_codec="aac"), 0.5), "input_unreadable", Limits()),
    "truncated mp4": ("clip.mp4", lambda p: _truncated(_faststart(p), 0.6), "input_corrupt", Limits()),
    "truncated mkv": ("clip.mkv", lambda p: _truncated(write_clip(p, FRAMES, SIZE, audio_codec="libopus"), 0.6), "input_corrupt", Limits()),
    "corrupt packets": ("clip.mp4", lambda p: _corrupted(write_clip(p, FRAMES, SIZE)), "input_corrupt", Limits()),
    "audio only": ("clip.m4a", _audio_only, "input_no_video", Limits()),
    "still image": ("clip.png", lambda p: Image.new("RGB", (64, 48), "red").save(p), "input_no_video", Limits()),
    "single frame": ("clip.mp4", lambda p: write_clip(p, 1, SIZE), "input_too_short", Limits()),
    "absurd dimensions": ("clip.y4m", lambda p: p.write_bytes(b"YUV4MPEG2 W16000 H16000 F30:1 C420jpeg\nFRAME\n" + bytes(4096)), "input_too_large", Limits()),
    "unsupported codec": ("clip.mkv", _unknown_codec, "input_unsupported_codec", Limits()),
    "too many frames": ("clip.mp4", lambda p: write_clip(p, FRAMES, SIZE), "input_too_large", Limits(max_frames=20)),
    "too long": ("clip.mp4", lambda p: write_clip(p, FRAMES, SIZE), "input_too_large", Limits(max_seconds=0.5)),
    "sound too long": ("clip.mkv", _long_sound, "input_too_large", Limits(max_seconds=5)),
    "frames the probe skips too large": ("clip.mov", _intra_sizes, "input_too_large", Limits(max_pixels=48 * 32 * 2)),
    "too big a file": ("clip.mp4", lambda p: write_clip(p, FRAMES, SIZE), "input_too_large", Limits(max_bytes=1000)),
    # failed only when muxing the output (after all the work), as an internal error
    "joined, times repeat": ("clip.ts", lambda p: _joined(p, False), "input_corrupt", Limits()),
    "joined, times run back": ("clip.ts", lambda p: _joined(p, True), "input_corrupt", Limits()),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_its_code_and_leaves_no_output(tmp_path, case):
    name, make, code, limits = BAD[case]
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    source = tmp_path / "in" / name
    make(source)
    with pytest.raises(PermanentError) as error:
        upscale_file(source, tmp_path / "out" / "out.mp4", LanczosUpscaler(), UpscaleOptions(limits=limits, preset="ultrafast"))
    assert error.value.code == code, error.value.message
    assert error.value.message and str(source.name) in error.value.message
    assert list((tmp_path / "out").iterdir()) == []  # no output, no partial file


@pytest.mark.parametrize(("codec", "option", "preset_default"), [("h264", b"rc_lookahead=%d", 40), ("hevc", b"rc-lookahead=%d", 20)])
def test_the_encoder_holds_back_one_decode_segment_not_its_default_lookahead(tmp_path, codec, option, preset_default):
    """Frames arrive a segment (16) at a time: a longer lookahead only delays the end of the file. The encoders
    write their settings into the stream, so read them back from it."""
    from worker.media.writer import LOOKAHEAD

    written = {}
    for lookahead in (LOOKAHEAD, None):
        path = tmp_path / f"{lookahead}.mp4"
        with Mp4Writer(path, Fraction(24), (64, 96), codec=codec, **({} if lookahead else {"lookahead": None})) as writer:
            writer.write(pattern(24, 64, 96))
        written[lookahead] = path.read_bytes()
    assert option % LOOKAHEAD in written[LOOKAHEAD]
    assert option % LOOKAHEAD not in written[None] and option % preset_default in written[None]  # medium's own


def test_the_rgb_to_yuv_conversions_threads_start_once_per_stream_not_once_per_frame(tmp_path):
    """swscale starts a thread per core for a conversion context; one context per frame started and joined them for
    every frame, on the encoder's thread ahead of x264 (16 a frame on the GPU host). Every process id the system
    hands out while the writer runs is counted (threads included); the fewest of three runs, as other processes
    may start meanwhile."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("swscale starts no threads on one core")
    frames, counts = 64, []
    pixels = pattern(frames, 256, 384)
    for run in range(3):
        before = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
        with Mp4Writer(tmp_path / f"{run}.mp4", Fraction(24), (256, 384), preset="ultrafast") as writer:
            writer.write(pixels)
        counts.append(int(Path("/proc/sys/kernel/ns_last_pid").read_text()) - before)
    assert min(counts) < frames, f"{counts} ids handed out while writing {frames} frames on {cores} cores"


def test_a_preset_that_looks_less_far_ahead_keeps_its_lookahead(tmp_path):
    with Mp4Writer(tmp_path / "fast.mp4", Fraction(24), (64, 96), preset="veryfast") as writer:
        writer.write(pattern(24, 64, 96))
    assert b"rc_lookahead=10" in (tmp_path / "fast.mp4").read_bytes()


def test_x264_threads_over_frames_as_the_ffmpeg_cli_runs_it(tmp_path):
    """PyAV's own default turns on x264's sliced threads: on 16 cores they left W1's noise-like output 3.3 s of
    encoding after the last frame instead of 1.3 s (bench/RESULTS.md). x264 writes its settings into the stream."""
    settings = {}
    for name, options in (("default", {}), ("sliced", {"thread_type": "SLICE"})):
        path = tmp_path / f"{name}.mp4"
        with Mp4Writer(path, Fraction(24), (256, 384), **options) as writer:  # x264 slices nothing smaller
            writer.write(pattern(24, 256, 384))
        data = path.read_bytes()
        settings[name] = data[data.index(b"sliced_threads=") :].split(b" ", 1)[0]
    assert settings == {"default": b"sliced_threads=0", "sliced": b"sliced_threads=1"}


def test_the_same_frames_make_the_same_file_every_time(tmp_path):
    """A retried job, a replay of kept windows and dedup rely on it. x264's AVX-512 kernels broke it at some widths,
    this one among them: on an AVX-512 CPU 6 to 8 of 12 runs came out different, pictures and all (bench/RESULTS.md).
    Written as the worker writes: 16 frames at a time, frame threads."""
    frames = pattern(24, 64, 96)
    pictures, files = set(), set()
    for run in range(12):
        path = tmp_path / f"{run}.mp4"
        with Mp4Writer(path, Fraction(24), (64, 96)) as writer:
            writer.write(frames[:16])
            writer.write(frames[16:])
        with av.open(str(path)) as container:
            decoded = b"".join(frame.to_ndarray().tobytes() for frame in container.decode(video=0))
        pictures.add(hashlib.sha256(decoded).digest())
        files.add(hashlib.sha256(path.read_bytes()).digest())
    assert len(pictures) == 1, f"{len(pictures)} different decoded pictures in 12 runs"
    assert len(files) == 1, f"{len(files)} different files in 12 runs"


# --- what real files do (tests/test_corpus.py runs the real ones) -----------------------------------------------


def test_the_picture_the_stream_declares_is_decoded_not_the_aligned_crop(tmp_path):
    """H.264 that crops 6 columns off the left of its coded 224 px (as Theora's picture offset does): decoders crop
    the left edge only to a 32-byte boundary unless asked, which gave 224 px, 6 of them outside the picture."""
    source = write_clip(tmp_path / "in.mp4", 5, (160, 224), video_options={"x264-params": "crop-rect=6,0,0,0"})
    with av.open(str(source)) as container:
        assert container.streams.video[0].codec_context.width == 218  # what the stream declares (ffprobe's width)
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)
    back = read_back(output)
    assert (result.source.video.width, back.width, back.height) == (218, 436, 320)
    # The pattern's red channel rises from 0 at the coded left edge: the first kept column is the 7th coded one.
    assert back.first[160, :4, 0].mean() > 3


@pytest.mark.parametrize("sar", [Fraction(16, 15), Fraction(32, 27)])  # PAL DVD 4:3, NTSC DVD 16:9
def test_non_square_pixels_keep_their_shape_so_the_picture_keeps_its_width(tmp_path, sar):
    source = write_clip(tmp_path / "in.mp4", 5, (96, 144), sample_aspect_ratio=sar)
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    written = probe(output).video
    assert (written.width, written.height, written.sar) == (288, 192, sar)
    assert written.display_aspect == probe(source).video.display_aspect == Fraction(144, 96) * sar


def test_a_variable_rate_phone_clip_keeps_its_average_rate_and_all_of_its_sound(tmp_path):
    """Like a phone's: the first frame lasts 0.18 s, then 30 fps, and the sound runs 0.1 s past the last frame.
    The output's average rate as FFmpeg reads it (the MP4's sample table) was 24.5 instead of 27 with B-frames, and
    the sound was cut at the last frame."""
    stamps = [0, 16610] + [16610 + 2999 * i for i in range(1, 40)]  # 90 kHz
    seconds = (stamps[-1] + 2999) / 90000 + 0.1
    source = write_clip(
        tmp_path / "in.mp4", len(stamps), (72, 128), Fraction(30), timestamps=stamps, time_base=Fraction(1, 90000),
        audio_codec="aac", audio_seconds=seconds, video_options={"x264-params": "bframes=0"},  # as phones write
    )
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), UpscaleOptions(request=SRRequest(scale=2)))  # medium: B-frames
    with av.open(str(source)) as before, av.open(str(output)) as after:
        assert abs(after.streams.video[0].average_rate / before.streams.video[0].average_rate - 1) <= 0.02
    assert np.allclose(frame_times(output), np.array(stamps) / 90000, atol=1e-3)
    [track] = read_back(output).audio
    assert abs(track.seconds - seconds) <= 1024 / 48000  # within one AAC frame of all of it


def test_a_chapter_over_before_the_first_frame_is_not_promised_nor_written():
    """Video that starts 2 s into the source's clock (audio first, or an edit): a chapter ending by then marks nothing
    in the output; one under way starts at the output's 0. The promise counts what the writer writes."""
    from worker.media.probe import Chapter, output_chapters

    chapters = [Chapter(0.0, 1.5, "Intro"), Chapter(1.5, 4.0, "Main"), Chapter(4.0, 6.0, "End")]
    assert output_chapters(chapters, 2.0) == [(0.0, 2.0, "Main"), (2.0, 4.0, "End")]
    assert output_chapters(chapters, 0.0) == [(0.0, 1.5, "Intro"), (1.5, 4.0, "Main"), (4.0, 6.0, "End")]


U, W = 1 << 16, 1 << 30  # 1.0 in a display matrix's 16.16 and 2.30 fixed-point entries
# name: display matrix (FFmpeg's layout, as av_display_matrix_flip writes a mirror), the turns and mirror to upright
MIRRORS = {
    "mirrored": ([-U, 0, 0, 0, U, 0, 0, 0, W], 0, True),  # a front camera's, or `ffmpeg -display_hflip`
    "upside down": ([U, 0, 0, 0, -U, 0, 0, 0, W], 2, True),  # `-display_vflip`: a mirror of the picture turned 180
    "turned 90 and mirrored": ([0, -U, 0, -U, 0, 0, 0, 0, W], 1, True),
}


@pytest.mark.parametrize("case", list(MIRRORS))
def test_a_display_matrix_that_mirrors_is_applied_as_players_apply_it(tmp_path, case):
    """A display matrix may flip as well as turn (its determinant is negative). PyAV's `frame.rotation` reads a
    mirror as a turn: a mirrored clip came back upside down and mirrored, an upside-down one not turned at all."""
    matrix, turns, mirrored = MIRRORS[case]
    source = tmp_path / "in.mp4"
    stored = (pattern(5, 48, 80).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    with av.open(str(source), "w") as container:
        stream = container.add_stream("libx264", rate=24, options={"crf": "12"})
        stream.width, stream.height, stream.pix_fmt = 80, 48, "yuv420p"
        stream.set_display_matrix(matrix)
        for index, pixels in enumerate(stored):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    upright = np.rot90(stored[0], turns)
    upright = np.fliplr(upright) if mirrored else upright
    back = read_back(output)
    assert (back.height, back.width, back.rotation) == (upright.shape[0] * 2, upright.shape[1] * 2, 0)
    halved = back.first.reshape(upright.shape[0], 2, upright.shape[1], 2, 3).mean(axis=(1, 3))
    assert np.abs(halved - upright).mean() < 8  # the wrong turn or mirror is off by ~60 on this gradient


def test_a_variable_rate_clips_last_frame_lasts_as_the_source_says_not_an_average_frame(tmp_path):
    """A screen recording: frames only when something moves, a 5 s pause, the last frame 40 ms. It lasted an
    average frame (0.59 s), which lengthened the video and lowered its average rate by 10 %."""
    stamps = [0, 40, 80, 120, 5120, 5160, 5200, 5240, 5280, 5320]  # ms
    source = write_clip(tmp_path / "in.mp4", len(stamps), (48, 80), Fraction(25), timestamps=stamps, time_base=Fraction(1, 1000))
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)
    with av.open(str(source)) as before, av.open(str(output)) as after:
        assert abs(after.streams.video[0].average_rate / before.streams.video[0].average_rate - 1) <= 0.01
    assert np.allclose(frame_times(output), np.array(stamps) / 1000, atol=1e-3)
    assert abs(result.written.video.duration - 5.36) <= 0.001


@pytest.mark.parametrize("suffix", ["mp4", "mkv"])
def test_a_variable_rate_clip_with_b_frames_ends_where_ffmpeg_says_the_source_ends(tmp_path, suffix):
    """With B-frames the frame shown last is not the one decoded last, and an MP4's sample durations are gaps between
    decode times: read as the last frame's length, a clip from the bad-input corpus came back 0.1 s short of what was
    promised and failed as output_mismatch where x264 chose such frame types. The source's B-frames come in a fixed
    pattern, with a pause before a reference frame; one whose track ends on its last frame (MP4 as PyAV writes it)
    gets an average frame more."""
    stamps = [0, 40, 80, 120, 160, 200, 1200, 1240, 1280, 1320]  # ms: a pause where x264 puts a reference frame
    source = write_clip(tmp_path / f"in.{suffix}", len(stamps), (48, 80), Fraction(25), timestamps=stamps,
                        time_base=Fraction(1, 1000), video_options={"x264-params": "bframes=2:b-adapt=0"})  # fmt: skip
    with av.open(str(source)) as given:
        declared = given.duration / 1e6  # what ffprobe reads: the format's duration
    expected = declared if declared > 1.320 + 1e-3 else 1.320 * len(stamps) / (len(stamps) - 1)
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), UpscaleOptions(request=SRRequest(scale=2)))  # B-frames
    with av.open(str(output)) as written:
        assert abs(written.duration / 1e6 - expected) <= 1e-3, (written.duration, expected)
    assert np.allclose(frame_times(output), np.array(stamps) / 1000, atol=1e-3)
    assert abs(result.written.video.duration - expected) <= 1e-3


def test_alac_in_matroska_is_copied_whole_though_its_packets_carry_no_durations(tmp_path):
    """Matroska gives ALAC's packets no durations. The copy dropped the first one (it ended where it started, as if
    before the video), and the MP4's last sample lasted nothing: output_mismatch, or a sound cut short by a packet."""
    source = write_clip(tmp_path / "in.mkv", 24, (48, 64), Fraction(24), audio_codec="alac", sample_rate=44100)
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)

    def sound(path: Path) -> tuple[str, np.ndarray, float]:
        with av.open(str(path)) as container:
            stream = container.streams.audio[0]
            samples = np.concatenate([frame.to_ndarray() for frame in container.decode(stream)], axis=1)
            return stream.codec_context.name, samples, float((stream.duration or 0) * stream.time_base)

    (_, given, _), (codec, written, declared) = sound(source), sound(output)
    assert codec == "alac" and result.written.audio[0].start == 0.0
    assert np.array_equal(written, given)  # lossless, copied: every sample, from the first
    assert declared >= given.shape[1] / 44100  # the track lasts as long as its sound


def test_mp3_below_16_khz_is_re_encoded_as_mp4_cannot_hold_it(tmp_path):
    """MPEG-2.5 MP3 (8, 11.025, 12 kHz: voice recorders, old phones) is no MP4 codec: FFmpeg's muxer refuses it. It
    was copied, and the job failed at the output's first audio packet (av.error.ArgumentError), as an internal error."""
    source = write_clip(tmp_path / "in.avi", 12, SIZE, video_codec="mpeg4", audio_codec="libmp3lame", sample_rate=8000, layout="mono")
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    back = read_back(output)
    [track] = back.audio
    assert (back.frames, track.codec, track.sample_rate, track.channels) == (12, "aac", 8000, 1)
    with av.open(str(source)) as container:  # what its decoder gives (in AVI, the encoder's priming too)
        seconds = sum(frame.samples for frame in container.decode(audio=0)) / 8000
    assert abs(track.seconds - seconds) <= 1024 / 8000  # all of the sound, to one AAC frame


def test_matroska_whose_sound_starts_before_zero_is_not_taken_for_a_cut_file(tmp_path):
    """MP3 at 8 kHz (a voice recorder's) starts its first packet 138 ms before 0 (the encoder's priming); Matroska's
    declared duration counts from there. Its end, 0.51 s, looked 0.13 s short of 0.64 s: refused as truncated."""
    source = write_clip(tmp_path / "in.mkv", 12, SIZE, audio_codec="libmp3lame", sample_rate=8000, layout="mono")
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    back = read_back(output)
    [track] = back.audio
    assert (back.frames, track.sample_rate, track.channels) == (12, 8000, 1)
    assert abs(track.seconds - 0.5) <= 1024 / 8000  # all of the sound, to one AAC frame


def test_an_mp4_whose_edit_list_skips_whole_gops_is_not_taken_for_a_cut_file(tmp_path):
    """A trim kept without re-encoding (`ffmpeg -ss 1.2 -c copy`, QuickTime's): the first GOP's 30 frames stay in
    the file, the edit list starts the media after them, and the demuxer skips them unread. 30 of the 60 frames the
    index lists looked like a file cut short: refused as input_corrupt."""
    stamps = [i - 30 for i in range(60)]  # FFmpeg's muxer writes frames before 0 as an edit that skips them
    source = write_clip(tmp_path / "in.mp4", 60, (48, 80), Fraction(25), timestamps=stamps, time_base=Fraction(1, 25),
                        audio_codec="aac", video_options={"x264-params": "keyint=30"})  # fmt: skip
    with av.open(str(source)) as container:
        assert container.streams.video[0].frames == 60
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    assert np.allclose(frame_times(output), frame_times(source), atol=1e-3) and len(frame_times(source)) == 30
    assert read_back(output).audio  # the sound is carried


def _cut(path: Path, cuts: list[tuple[float, float]]) -> Path:
    """Give every track of an MP4 (moov last, one media edit) the edits `cuts`, (start, end) seconds of its media: a
    clip cut in QuickTime without re-encoding plays those parts one after another."""
    from worker.media import mp4_boxes

    data = bytearray(path.read_bytes())
    with open(path, "rb") as handle:
        _, start, end = next(box for box in mp4_boxes.top_level(handle, 0, len(data)) if box[0] == b"moov")
    assert end == len(data)
    moov = data[start:]
    movie_scale = mp4_boxes.movie_timescale(moov)
    for trak in reversed(list(mp4_boxes.children(moov, 8, len(moov), b"trak"))):
        _, mdhd, _ = next(mp4_boxes.children(moov, trak[1], trak[2], b"mdhd"))
        media_scale = struct.unpack_from(">I", moov, mdhd + 12)[0]
        edts = next(mp4_boxes.children(moov, trak[1], trak[2], b"edts"))
        elst, payload, elst_end = next(mp4_boxes.children(moov, trak[1], trak[2], b"elst"))
        first = struct.unpack_from(">i", moov, payload + 12)[0]  # the one edit's media start (B-frames' delay)
        entries = b"".join(struct.pack(">IiHH", round((b - a) * movie_scale), first + round(a * media_scale), 1, 0) for a, b in cuts)
        box = struct.pack(">I4sII", 16 + len(entries), b"elst", 0, len(cuts)) + entries
        grown = len(box) - (elst_end - elst)
        moov[elst:elst_end] = box
        for parent in (edts[0], trak[0], 0):  # edts, trak, moov
            struct.pack_into(">I", moov, parent, struct.unpack_from(">I", moov, parent)[0] + grown)
    path.write_bytes(data[:start] + moov)
    return path


def test_copied_sound_of_an_mp4_cut_by_several_edits_skips_each_later_edits_lead_in(tmp_path):
    """FFmpeg reads a later edit's lead-in (packets the decoder needs, marked to discard) timed before sound already
    read: copied, the muxer refused its times running back (EINVAL), an internal error for the user's file."""
    source = write_clip(tmp_path / "in.mp4", 60, (48, 80), Fraction(25), audio_codec="aac")
    _cut(source, [(0.0, 0.8), (1.6, 2.4)])
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)
    assert [c.action for c in result.carried] == ["copy"]
    assert np.allclose(frame_times(output), frame_times(source), atol=1e-3) and len(frame_times(source)) == 40
    [track] = read_back(output).audio
    assert abs(track.seconds - 1.6) <= 1024 / 48000  # both parts' sound, once each


@pytest.mark.parametrize(("defaults", "expected"), [((False, True), [False, True]), ((True, True), [True, False])])
def test_the_audio_track_players_pick_is_the_sources_default_one(tmp_path, defaults, expected):
    """A dub first, the original language marked default: players of the MP4 played the dub, the first track, as
    the default was not carried. Matroska marks every track default unless told: still one track plays."""
    source = tmp_path / "in.mkv"
    with av.open(str(source), "w") as container:
        video = container.add_stream("libx264", rate=25)
        video.width, video.height, video.pix_fmt = 80, 48, "yuv420p"
        tracks = []
        for (language, codec), default in zip([("eng", "aac"), ("jpn", "pcm_s16le")], defaults):  # copied, re-encoded
            tracks.append(container.add_stream(codec, rate=48000, layout="stereo"))
            tracks[-1].metadata["language"] = language
            tracks[-1].disposition = av.stream.Disposition.default if default else av.stream.Disposition(0)
        for index, pixels in enumerate(pattern(10, 48, 80)):
            frame = av.VideoFrame.from_ndarray((pixels.permute(1, 2, 0).numpy() * 255).astype(np.uint8), format="rgb24")
            frame.pts = index
            container.mux(video.encode(frame))
        container.mux(video.encode())
        for track in tracks:
            _write_audio(container, track, tone(0.4), "stereo")
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    with av.open(str(output)) as container:
        picked = [(s.language, bool(s.disposition & av.stream.Disposition.default)) for s in container.streams.audio]
    assert picked == list(zip(["eng", "jpn"], expected))


def _fragmented(source: Path) -> Path:
    """40 frames and their sound in a fragmented MP4 as a phone app or OBS writes it: a fragment every 10 frames."""
    with av.open(str(source), "w", options={"movflags": "frag_keyframe+empty_moov+default_base_moof"}) as container:
        video = container.add_stream("libx264", rate=30, options={"g": "10"})
        video.width, video.height, video.pix_fmt = 80, 48, "yuv420p"
        audio = container.add_stream("aac", rate=48000, layout="stereo")
        for index, frame in enumerate(pattern(40, 48, 80)):
            pixels = (frame.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
            image = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            image.pts = index
            container.mux(video.encode(image))
        container.mux(video.encode())
        _write_audio(container, audio, tone(40 / 30), "stereo")
    return source


def _live(source: Path, start_s: int) -> Path:
    """`source`, a fragmented MP4, as saved from a live stream (DASH, HLS in fMP4): each fragment's decode time
    (`tfdt`) from the wall clock, `start_s` seconds after 1970, in every track."""
    with av.open(str(source)) as container:
        scales = {stream.id: stream.time_base.denominator for stream in container.streams}
    data, track, position = bytearray(source.read_bytes()), None, 0
    while (position := data.find(b"tf", position + 1)) != -1:
        if data[position : position + 4] == b"tfhd":
            (track,) = struct.unpack_from(">I", data, position + 8)
        elif data[position : position + 4] == b"tfdt" and data[position + 4] == 1:  # version 1: 64-bit times
            (time,) = struct.unpack_from(">Q", data, position + 8)
            struct.pack_into(">Q", data, position + 8, time + start_s * scales[track])
    live = source.with_name(f"live-{source.name}")
    live.write_bytes(data)
    return live


def test_a_saved_live_streams_wall_clock_times_are_not_taken_for_its_length(tmp_path):
    """A live stream's fragments saved to a file start 53 years in (DASH's wall-clock times). Its header's duration,
    read as its length, refused it ("lasts 1685548364 s"); before that, the worker's scratch estimate took it for 5e10
    frames and built their windows, its memory growing by 80 MB/s, a cancel unseen, until the kernel killed it."""
    source = _live(_fragmented(tmp_path / "in.mp4"), 1_685_548_363)
    with av.open(str(source)) as container:  # FFmpeg reads it 1,685,548,363 s in, its "duration" where it ends
        assert 0 <= container.duration - container.start_time < 2 * 10**6 and container.start_time > 1.6e15
    estimate = subprocess.run(  # a process of its own, under a memory limit: it grew without bound
        [sys.executable, "-c", f"from pathlib import Path; from worker.scratch import scratch_bytes; "
         f"print(scratch_bytes(Path({str(source)!r}), 2))"],
        capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30)),
    )  # fmt: skip
    assert estimate.returncode == 0, estimate.stderr[-2000:]
    assert int(estimate.stdout) < 41 * 160 * 96 * 3 + 4 * source.stat().st_size  # its 40 frames, not 5e10
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    back = read_back(output)
    assert back.frames == 40 and abs(back.audio[0].decoded - 40 / 30) < 0.05, back.audio


@pytest.mark.parametrize("through", ["video", "audio"])
def test_a_fragmented_mp4_cut_through_a_packet_keeps_every_whole_frame_and_its_sound(tmp_path, through):
    """A recording that stopped mid-write (a phone app or OBS writing fragmented MP4, crashing): the file ends inside
    a packet, which the demuxer hands over cut short. Counted as a frame, it never decoded, and frame threads dropped
    the frames beside it: input_corrupt once the upscaling was done. Copied, its sound did not decode."""
    source = _fragmented(tmp_path / "in.mp4")
    with av.open(str(source)) as container:  # fragments of 10 frames, each its video's samples, then its audio's
        packets = [(packet.stream.type, packet.pos, packet.size) for packet in container.demux() if packet.size]
    videos = [packet for packet in packets if packet[0] == "video"]
    if through == "video":
        _, position, size = videos[25]  # the third fragment's sixth frame
    else:
        _, position, size = [packet for packet in packets if packet[0] == "audio" and packet[1] < videos[20][1]][-1]
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(source.read_bytes()[: position + size // 2])
    output = tmp_path / "out.mp4"
    result = upscale_file(cut, output, LanczosUpscaler(), FAST)
    assert read_back(output).frames == (25 if through == "video" else 20)
    assert any(note.startswith("the source file ends partway through") for note in result.notes), result.notes
    with av.open(str(output)) as container:
        assert sum(frame.samples for frame in container.decode(audio=0)) > 0  # every packet decodes


def _aac_7_1_spectrum(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """An output whose sound must be AAC 7.1: the magnitude spectrum of half a second of it (bins, channels), and
    each channel's loudest frequency in Hz. The sound is resampled to packed floats before it is read, as PyAV counts
    9 planes in an 8-channel planar frame."""
    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        assert (stream.codec_context.name, stream.codec_context.layout.name) == ("aac", "7.1")
        packed = av.AudioResampler(format="flt", layout="7.1", rate=48000)
        frames = [f for frame in container.decode(stream) for f in packed.resample(frame)]
        samples = np.concatenate([frame.to_ndarray().reshape(-1, 8) for frame in frames])  # (samples, channels)
    spectrum = np.abs(np.fft.rfft(samples[2048 : 2048 + 24000], axis=0))  # 0.5 s, clear of the onset
    return spectrum, np.fft.rfftfreq(24000, 1 / 48000)[spectrum.argmax(axis=0)]


def test_sound_re_encoded_is_said_in_the_jobs_notes(tmp_path):
    """A lossy re-encode of a recording's PCM (Chromium's `codecs=pcm`, a camera's) was said by `vsrq probe` only; the
    job's notes said nothing, as they say a stream left out."""
    source = write_clip(tmp_path / "in.mov", 6, SIZE, Fraction(24), audio_codec="pcm_s16le")
    result = upscale_file(source, tmp_path / "out.mp4", LanczosUpscaler(), FAST)
    assert "audio #1 (pcm_s16le): re-encoded to AAC" in result.notes, result.notes


def test_eight_channel_sound_re_encoded_keeps_every_channel(tmp_path):
    """7.1 sound that MP4 cannot hold as it is (a Blu-ray rip's TrueHD or DTS, a camera's PCM) is re-encoded to AAC.
    PyAV counts 9 planes in an 8-channel planar frame: reading the decoded sound crashed the worker (SIGSEGV), so the
    job runs in a process of its own here. Each channel's tone must come back on its own channel."""
    source = write_clip(tmp_path / "in.mov", 24, SIZE, Fraction(24), audio_codec="pcm_s16le", layout="7.1")
    output = tmp_path / "out.mp4"
    command = [sys.executable, "-m", "client.cli", "upscale", str(source), "-o", str(output), "--model", "lanczos",
               "--scale", "2", "--preset", "ultrafast"]  # fmt: skip
    result = subprocess.run(command, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    _, peaks = _aac_7_1_spectrum(output)
    wanted = 440 * 1.5 ** np.arange(8)  # `tone`: a fifth higher on each further channel
    lfe = 3  # AAC keeps only the lowest frequencies of the LFE channel
    assert np.allclose(np.delete(peaks, lfe), np.delete(wanted, lfe), rtol=0.01), peaks


def test_a_matroska_file_that_starts_at_an_open_gops_keyframe_keeps_the_frames_it_shows(tmp_path):
    """x265 closes no GOP by default: its keyframes (CRA) are followed by frames shown before them that refer back to
    the GOP before. A file that starts at one (split at a keyframe, a recording started mid-stream) holds 3 such
    frames the decoder drops; counted, the job failed as input_corrupt once every frame had been upscaled."""
    whole = write_clip(tmp_path / "whole.mkv", 120, (64, 96), Fraction(30), video_codec="libx265",
                       video_options={"x265-params": "log-level=error:keyint=30:scenecut=0"})  # fmt: skip
    source = tmp_path / "in.mkv"
    with av.open(str(whole)) as original, av.open(str(source), "w") as split:
        stream = split.add_stream_from_template(original.streams.video[0])
        keyframes = 0
        for packet in original.demux(video=0):
            keyframes += packet.is_keyframe
            if keyframes >= 2 and packet.size:  # from the second keyframe on
                packet.stream = stream
                split.mux(packet)
    with av.open(str(source)) as container:  # the oracle: what FFmpeg shows, and what the file holds
        shown = frame_times(source)
        held = sum(1 for packet in container.demux(video=0) if packet.size)
    assert (len(shown), held) == (90, 93)
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)
    assert np.allclose(frame_times(output), np.array(shown) - shown[0], atol=1e-3)
    # and says so (a stream cut 63 frames before its first keyframe began 2.1 s after its sound, unsaid)
    said = "the source's first 3 frame(s) cannot be decoded (they refer to pictures before the file's start, as in a "
    assert [note for note in result.notes if note.startswith(said)] == [said + "recording cut mid-stream): left out"]


def test_side_channel_5_1_re_encoded_declares_which_channel_is_which(tmp_path):
    """FFmpeg decodes DTS, TrueHD and 6-channel PCM as 5.1(side), which AAC has no channel configuration for: its
    encoder wrote a program config element that reads back as "6 channels", positions unknown, so players guessed.
    The output is AAC's own 5.1, the side channels on its back ones, each tone on its own channel."""
    source = write_clip(tmp_path / "in.mov", 24, SIZE, Fraction(24), audio_codec="pcm_s16le", layout="5.1(side)")
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    with av.open(str(output)) as container:
        stream = container.streams.audio[0]
        assert (stream.codec_context.name, stream.codec_context.layout.name) == ("aac", "5.1")
        samples = np.concatenate([frame.to_ndarray() for frame in container.decode(stream)], axis=1)
    spectrum = np.abs(np.fft.rfft(samples[:, 2048 : 2048 + 24000], axis=1))
    peaks = np.fft.rfftfreq(24000, 1 / 48000)[spectrum.argmax(axis=1)]
    wanted = 440 * 1.5 ** np.arange(6)  # `tone`: a fifth higher on each further channel
    lfe = 3  # AAC keeps only the lowest frequencies of the LFE channel
    assert np.allclose(np.delete(peaks, lfe), np.delete(wanted, lfe), rtol=0.01), peaks


def test_a_stream_that_grows_mid_way_is_upscaled_at_its_largest_parts_size(tmp_path):
    """A screen recorder following a window, a live stream switching quality: 160x120, then 320x240, in one MPEG-TS
    stream. Sized from the first part, the output was 320x240 at x2: the later part came back no larger than the
    source's. Now it is 640x480, the later part at its full resolution, and the job says why."""
    first = write_clip(tmp_path / "a.ts", 12, (120, 160))
    then = write_clip(tmp_path / "b.ts", 12, (240, 320), timestamps=range(14, 26), time_base=Fraction(1, 24))
    source = tmp_path / "in.ts"
    source.write_bytes(first.read_bytes() + then.read_bytes())
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)
    back = read_back(output)
    assert (back.width, back.height, back.frames) == (640, 480, 24)
    assert any("changes size mid-way (160x120, 320x240)" in note for note in result.notes), result.notes
    with av.open(str(source)) as container:
        later = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)][-1].astype(float)
    with av.open(str(output)) as container:
        last = [frame for frame in container.decode(video=0)][-1].to_ndarray(format="rgb24", width=320, height=240)
    assert np.abs(last - later).mean() < 2.8  # 3.5 through 160x120


# bytes into it: its video's tfhd, its video's trun (the samples' sizes), its audio's trun
@pytest.mark.parametrize("into", [44, 130, 290])
def test_a_fragmented_mp4_cut_inside_a_fragments_header_keeps_the_whole_fragments_before_it(tmp_path, into):
    """A recording that stopped while it wrote the next fragment's header (`moof`): FFmpeg reads every fragment's
    header as it opens such a file, failed on the cut one, and the job was refused input_unreadable, though the
    fragments before it are whole. Now they are read one by one as demuxed, and the cut one ends the file."""
    source = _fragmented(tmp_path / "in.mp4")
    data, boxes, position = source.read_bytes(), [], 0
    while position < len(data):
        size, kind = struct.unpack(">I4s", data[position : position + 8])
        boxes.append((kind, position, size))
        position += size
    _, start, _ = [box for box in boxes if box[0] == b"moof"][2]  # the third fragment's header
    cut, whole = tmp_path / "cut.mp4", tmp_path / "whole.mp4"
    cut.write_bytes(data[: start + into])
    whole.write_bytes(data[:start])  # the oracle: the same file cut between fragments, which was always read
    for path in (cut, whole):
        upscale_file(path, path.with_suffix(".out.mp4"), LanczosUpscaler(), FAST)
    back = read_back(cut.with_suffix(".out.mp4"))
    assert back.frames == 20
    assert back.audio == read_back(whole.with_suffix(".out.mp4")).audio  # the sound of the two whole fragments


def test_a_closed_caption_track_left_out_is_said_to_be_captions_not_bitmaps(tmp_path):
    """QuickTime's closed-caption track (EIA-608, `c608`: text) was left out as "a bitmap format MP4 cannot hold"."""
    source = tmp_path / "in.mov"
    with av.open(str(source), "w", format="mov") as container:
        video = container.add_stream("libx264", rate=24)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        captions = container.add_mux_stream("eia_608", time_base=Fraction(1, 24))
        for index in range(5):
            image = av.VideoFrame.from_ndarray(np.full((48, 64, 3), index * 40, np.uint8), format="rgb24")
            image.pts = index
            container.mux(video.encode(image))
            pair = av.Packet(b"\x94\x20\x94\x20")  # a caption command, twice: what each frame of a track carries
            pair.stream, pair.pts, pair.dts, pair.duration, pair.time_base = captions, index, index, 1, Fraction(1, 24)
            container.mux(pair)
        container.mux(video.encode())
    result = upscale_file(source, tmp_path / "out.mp4", LanczosUpscaler(), FAST)
    said = "subtitle #1 (eia_608, closed captions, which MP4's muxer cannot carry): left out"
    assert said in result.notes, result.notes


def _phone_clip(path: Path, metadata: dict[str, str]) -> Path:
    """A clip whose container keys are QuickTime's `mdta` keys, as phones write them."""
    return _flat_clip(path, 4, {"movflags": "use_metadata_tags"}, metadata)


def test_a_phone_clips_capture_date_place_and_camera_are_kept(tmp_path):
    """An iPhone clip came out with none of its QuickTime keys: photo libraries dated it by the export, not the
    capture, and placed it nowhere (FFmpeg's MP4 muxer drops keys it has no iTunes atom for)."""
    phone = {
        "com.apple.quicktime.creationdate": "2025-12-13T14:00:03+0100",
        "com.apple.quicktime.location.ISO6709": "+38.3446-000.4792+003.153/",
        "com.apple.quicktime.make": "Apple",
        "com.apple.quicktime.model": "iPhone 15 Pro Max",
        "title": "Beach",
    }
    output = tmp_path / "out.mp4"
    upscale_file(_phone_clip(tmp_path / "IMG_0001.mov", phone), output, LanczosUpscaler(), FAST)
    assert phone.items() <= read_back(output).metadata.items(), read_back(output).metadata
    # an Android clip's one such key (its OS version) does not cost its title the atom players read (`©nam`)
    android = _phone_clip(tmp_path / "VID_0001.mp4", {"com.android.version": "13", "title": "Beach"})
    upscale_file(android, tmp_path / "android-out.mp4", LanczosUpscaler(), FAST)
    title = b"\xa9nam\x00\x00\x00\x15data\x00\x00\x00\x01\x00\x00\x00\x00Beach"  # its iTunes atom, UTF-8
    assert title in (tmp_path / "android-out.mp4").read_bytes()


def test_an_mp4s_cover_art_and_timecode_are_kept(tmp_path):
    """A camera's or an editor's MP4 with a timecode track (tmcd) and cover art (covr, a poster file browsers show):
    both were left out without a word. The picture is copied byte for byte, the timecode written again for the
    output's first frame, as ffprobe reads each back."""
    base = write_clip(tmp_path / "base.mp4", 24, (64, 96), Fraction(24), audio_codec="aac")
    poster = Image.fromarray(np.full((32, 32, 3), 200, np.uint8))
    jpeg = tmp_path / "poster.jpg"
    poster.save(jpeg, "JPEG")
    source = tmp_path / "in.mp4"
    with av.open(str(base)) as original, av.open(str(source), "w") as edited:
        streams = {stream.index: edited.add_stream_from_template(stream) for stream in original.streams}
        streams[0].metadata["timecode"] = "01:02:03:04"  # FFmpeg's muxer writes it as a tmcd track
        cover = edited.add_stream("mjpeg")
        cover.width, cover.height, cover.pix_fmt = 32, 32, "yuvj420p"
        cover.disposition = av.stream.Disposition.attached_pic
        for packet in original.demux():
            if packet.dts is not None:
                packet.stream = streams[packet.stream.index]
                edited.mux(packet)
        picture = av.Packet(jpeg.read_bytes())
        picture.stream, picture.pts, picture.dts, picture.time_base = cover, 0, 0, Fraction(1, 90000)
        edited.mux(picture)
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)
    with av.open(str(output)) as container:
        assert container.streams.video[0].metadata.get("timecode") == "01:02:03:04"
        assert [s.metadata.get("timecode") for s in container.streams.data] == ["01:02:03:04"]
        covers = [s for s in container.streams.video if s.disposition & av.stream.Disposition.attached_pic]
        assert len(covers) == 1
        assert [bytes(p) for p in container.demux(covers[0]) if p.size] == [jpeg.read_bytes()]
    assert {c.describe() for c in result.carried} >= {"cover art #3 (mjpeg): copied", "data #2 (timecode 01:02:03:04): kept as the output's timecode"}


def test_a_timecode_s_reel_name_is_said_to_be_left_out(tmp_path):
    """A camera master's QuickTime timecode track names its reel (the card or tape: "A001"): the output's MP4 keeps the
    timecode, and FFmpeg writes a reel name in QuickTime's timecode track only. The notes said the timecode was kept
    and nothing of the reel; they now say the reel name is not."""
    source = tmp_path / "master.mov"
    with av.open(str(source), "w") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        stream.metadata.update({"timecode": "01:00:00:00", "reel_name": "A001"})  # its timecode track takes both
        for index in range(3):
            frame = av.VideoFrame.from_ndarray(np.full((64, 96, 3), 40 * index, np.uint8), format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    result = upscale_file(source, tmp_path / "out.mp4", LanczosUpscaler(), FAST)
    said = ("data #1 (timecode 01:00:00:00; reel A001 not kept: MP4's timecode track has no reel name): kept as the "
            "output's timecode")  # fmt: skip
    assert said in {c.describe() for c in result.carried}, result.carried
    with av.open(str(tmp_path / "out.mp4")) as container:
        assert [s.metadata.get("timecode") for s in container.streams.data] == ["01:00:00:00"]


@pytest.mark.parametrize(
    ("timecode", "written", "carried"),
    [
        ("01:00:00;02", None, "data #1 (timecode 01:00:00;02, drop-frame at 30 a second, which the output's rate "
         "(20.29 fps) does not count): left out"),
        ("01:00:00:25", "01:00:00:17", "data #1 (timecode 01:00:00:25 as 01:00:00:17, counted at 20 a second as the "
         "output's rate (20.29 fps) is, not 30): kept as the output's timecode"),
    ],
)  # fmt: skip
def test_a_timecode_counted_otherwise_than_the_outputs_rate_names_the_same_time_or_is_left_out(
    tmp_path, timecode, written, carried
):
    """A camera's variable-rate MP4 (29.97 nominal, every third frame dropped) with a timecode its muxer counted at
    30. The output keeps the variable rate, and FFmpeg's muxer counts the timecode at its average (20): drop-frame it
    cannot count (it left it out, and a note said so after the work), and 01:00:00:25 it wrote as 01:00:01:05, 0.4 s
    late, while the note said it was left out. The timecode is now written counted at 20, naming the source's time
    (25/30 s: 17/20), and drop-frame at 30 is left out as the job is planned, saying why."""
    times = [i + i // 2 for i in range(24)]  # in 1/30 s
    base = write_clip(tmp_path / "base.mp4", len(times), (64, 96), Fraction(30000, 1001), timestamps=times,
                      time_base=Fraction(1, 30))  # fmt: skip
    source = tmp_path / "in.mp4"
    with av.open(str(base)) as original, av.open(str(source), "w") as edited:
        stream = edited.add_stream_from_template(original.streams.video[0])
        stream.metadata["timecode"] = timecode  # FFmpeg's muxer writes it as a tmcd track, counted at 30
        for packet in original.demux():
            if packet.dts is not None:
                packet.stream = stream
                edited.mux(packet)
    with av.open(str(source)) as container:  # the oracle: the source has its timecode track
        assert [s.metadata.get("timecode") for s in container.streams.data] == [timecode]
    assert not probe(source).video.cfr
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)
    with av.open(str(output)) as container:
        assert container.streams.video[0].metadata.get("timecode") == written
        assert [s.metadata.get("timecode") for s in container.streams.data] == ([written] if written else [])
    assert [c.describe() for c in result.carried if c.kind == "data"] == [carried]
    assert not any("could not be written" in note for note in result.notes), result.notes  # nothing found late


def _n_vop(bits: int = 5) -> bytes:
    """An MPEG-4 Part 2 VOP that codes nothing (vop_coded 0): the chunk a packed stream puts where a B-frame was.
    P type, time increment 0 in `bits` bits (those of the encoder's time base, 1/24), then next_start_code stuffing."""
    value = "01" + "0" + "1" + "0" * bits + "1" + "0"
    value += "0" + "1" * (-(len(value) + 1) % 8)
    return b"\x00\x00\x01\xb6" + int(value, 2).to_bytes(len(value) // 8, "big")


def _packed_avi(path: Path, frames: int, divx_flag: bool) -> Path:
    """MPEG-4 Part 2 in AVI with packed B-frames, as DivX 5 and old XviD wrote them: decode order I0 P2 B1 P4 B3 …
    stored as chunks I0 | P2+B1 | N-VOP | P4+B3 | N-VOP …, one chunk a frame time. `divx_flag`: the user data that
    tells FFmpeg's decoder so ("DivX503b1393p"); a remuxed or re-tagged file has none."""
    encoder = av.codec.CodecContext.create("mpeg4", "w")
    encoder.width, encoder.height, encoder.pix_fmt = 96, 64, "yuv420p"
    encoder.time_base, encoder.framerate, encoder.max_b_frames, encoder.gop_size = Fraction(1, 24), Fraction(24), 1, 12
    packets = []
    for index, pixels in enumerate(pattern(frames, 64, 96)):
        frame = av.VideoFrame.from_ndarray((pixels.permute(1, 2, 0).numpy() * 255).astype(np.uint8), format="rgb24")
        frame = frame.reformat(format="yuv420p")
        frame.pts = index
        packets += [(bytes(p), p.is_keyframe, p.pts) for p in encoder.encode(frame)]
    packets += [(bytes(p), p.is_keyframe, p.pts) for p in encoder.encode(None)]
    chunks, index = [], 0
    while index < len(packets):
        data, key, pts = packets[index]
        if index + 1 < len(packets) and packets[index + 1][2] < pts:  # a B-frame shown before this one: packed
            chunks += [(data + packets[index + 1][0], key), (_n_vop(), False)]
            index += 2
        else:
            chunks.append((data, key))
            index += 1
    with av.open(str(path), "w", format="avi") as container:
        stream = container.add_stream("mpeg4", rate=24)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        stream.codec_context.extradata = encoder.extradata
        for number, (data, key) in enumerate(chunks):
            packet = av.Packet((b"\x00\x00\x01\xb2DivX503b1393p" if divx_flag and number == 0 else b"") + data)
            packet.stream, packet.pts, packet.dts, packet.time_base, packet.is_keyframe = stream, number, number, Fraction(1, 24), key
            container.mux(packet)
    return path


def test_packed_b_frames_in_avi_without_the_divx_flag_are_read_whole(tmp_path):
    """Without the DivX flag FFmpeg's decoder dropped every packed B-frame (13 of 24 frames), and the job failed as
    input_corrupt ("decoded 13 frames, the container holds 24") once the upscaling was done, with nothing a user could
    do. Unpacked first (mpeg4_unpack_bframes), every frame is read: the frames FFmpeg decodes from the flagged file."""
    source = _packed_avi(tmp_path / "in.avi", 24, divx_flag=False)
    flagged = _packed_avi(tmp_path / "flagged.avi", 24, divx_flag=True)
    with av.open(str(flagged)) as container:  # the oracle: FFmpeg's decoder reordering them itself
        expected = [frame.to_ndarray(format="rgb24", **_source_colour(frame), interpolation=EXACT_8_BIT)
                    for frame in container.decode(video=0)]  # fmt: skip
    got = list(read_frames(source, probe(source).video))
    assert len(got) == len(expected) == 24
    assert all(np.array_equal(frame, reference) for frame, reference in zip(got, expected))
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    assert read_back(output).frames == 24


def test_6_1_sound_re_encoded_declares_which_channel_is_which(tmp_path):
    """6.1 (a DTS-ES track, 7-channel PCM from a camera or a WAV) has no AAC channel configuration: its encoder wrote
    a program config element that reads back as "7 channels", positions unknown, so players guessed. The output is
    AAC's 7.1, each channel in its place and the back centre between the two back channels, as a 7.1 system plays it."""
    source = write_clip(tmp_path / "in.mov", 24, SIZE, Fraction(24), audio_codec="pcm_s16le", layout="6.1")
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    spectrum, peaks_hz = _aac_7_1_spectrum(output)
    peaks = dict(zip(["FL", "FR", "FC", "LFE", "BL", "BR", "SL", "SR"], peaks_hz))  # AAC 7.1's order
    tones = dict(zip(["FL", "FR", "FC", "LFE", "BC", "SL", "SR"], 440 * 1.5 ** np.arange(7)))  # `tone`: 6.1's order
    for channel in ("FL", "FR", "FC", "SL", "SR"):  # AAC keeps only the lowest frequencies of the LFE channel
        assert peaks[channel] == pytest.approx(tones[channel], rel=0.01), (channel, peaks)
    assert peaks["BL"] == pytest.approx(tones["BC"], rel=0.01) and peaks["BR"] == pytest.approx(tones["BC"], rel=0.01), peaks
    back = spectrum[:, 4:6].max(axis=0)
    assert back[0] == pytest.approx(back[1], rel=0.05)  # the back centre in the middle


@pytest.mark.parametrize(("layout", "declared"), [("3.1", "5.1"), ("4.1", "5.1"), ("6.0", "7.1"), ("6.1", "7.1"),
                                                  ("5.1(side)", "5.1"), ("quad(side)", "quad"), ("5.1", "5.1")])  # fmt: skip
def test_sound_re_encoded_to_aac_gets_the_smallest_declared_layout_with_room_for_every_channel(layout, declared):
    """The standard layout of as many channels dropped what it has no place for: 3.1's and 4.1's LFE (quad, 5.0: the
    resampler mixes no LFE), a whole channel of 6.0 (5.1: its LFE left silent)."""
    assert aac_format(48000, layout, av.AudioLayout(layout).nb_channels) == (48000, declared)


def _simple_blocks(data: bytes) -> list[tuple[int, int]]:
    """(offset of its 16-bit relative timestamp, track number) of every SimpleBlock of a Matroska file."""

    def number(at: int, marker: bool = False) -> tuple[int, int]:  # an EBML variable-size integer, and its length
        length = 9 - data[at].bit_length()
        value = data[at] if marker else data[at] & (0xFF >> length)
        for byte in data[at + 1 : at + length]:
            value = value << 8 | byte
        return value, length

    found = []

    def walk(at: int, end: int) -> None:
        while at < end:
            element, length = number(at, marker=True)
            size, size_length = number(at + length)
            body = at + length + size_length
            if element in (0x18538067, 0x1F43B675):  # Segment, Cluster
                walk(body, min(body + size, len(data)))
            elif element == 0xA3:  # SimpleBlock
                track, track_length = number(body)
                found.append((body + track_length, track))
            at = body + size

    walk(0, len(data))
    return found


def test_a_lone_timestamp_that_runs_back_is_retimed_not_taken_for_a_restarted_clock(tmp_path):
    """A variable-rate Matroska file whose muxer wrote one frame's time 0.6 s early, the frames after it going on:
    refused as input_corrupt, "its clock starts over, as in recordings joined end to end", which it does not. That
    frame is now timed between its neighbours (its true time, here) and the job says so."""
    times = VFR + [VFR[-1] + 33 * i for i in range(1, 25)]
    whole = write_clip(tmp_path / "whole.mkv", len(times), SIZE, Fraction(30), timestamps=times, time_base=Fraction(1, 1000),
                       audio_codec="aac", video_options={"bf": "0"})  # fmt: skip
    data = bytearray(whole.read_bytes())
    at = [offset for offset, track in _simple_blocks(data) if track == 1][30]
    struct.pack_into(">h", data, at, struct.unpack_from(">h", data, at)[0] - 600)
    source = tmp_path / "in.mkv"
    source.write_bytes(bytes(data))
    with av.open(str(source)) as container:  # the oracle: what the file declares
        declared = [packet.pts for packet in container.demux(video=0) if packet.size]
    assert declared[30] == times[30] - 600 and declared[31] == times[31]
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)
    assert np.allclose(frame_times(output), np.array(times) / 1000, atol=1e-3)
    assert any("timed between its neighbours" in note for note in result.notes), result.notes


def test_an_hevc_movie_with_a_box_cut_short_in_its_header_is_read_as_ffmpeg_reads_it(tmp_path):
    """A box in `moov` whose 64-bit size is cut short: FFmpeg reads the movie and its frames, and the probe's own box
    reads (an HEVC track's extra layer, the chapter tracks) raised struct.error: internal_error."""
    clip = write_clip(tmp_path / "in.mov", 5, SIZE, video_codec="libx265")
    data = bytearray(clip.read_bytes())
    moov = data.find(b"moov") - 4
    size = struct.unpack_from(">I", data, moov)[0]
    cut = struct.pack(">I4s", 1, b"trak") + b"\0\0\0"  # a 64-bit size follows: 3 of its 8 bytes
    data[moov + size : moov + size] = cut
    struct.pack_into(">I", data, moov, size + len(cut))
    clip.write_bytes(bytes(data))
    with av.open(str(clip)) as container:  # the oracle
        assert sum(1 for _ in container.decode(video=0)) == 5
    info = probe(clip)
    assert (info.video.codec, info.video.frames, info.video.stereo) == ("hevc", 5, False)


def test_a_lone_timestamp_far_ahead_is_retimed_not_held(tmp_path):
    """The other slip: one frame timed 30 s late, the frames after it going on. Shown after 60 frames decoded after
    it, no decoder's reordering: the output held its last frame for 30 s. Now it is timed between its neighbours."""
    times = [33 * i for i in range(90)]
    whole = write_clip(tmp_path / "whole.mkv", len(times), SIZE, Fraction(30), timestamps=times,
                       time_base=Fraction(1, 1000), video_options={"bf": "0"})  # fmt: skip
    data = bytearray(whole.read_bytes())
    at = [offset for offset, track in _simple_blocks(data) if track == 1][20]
    struct.pack_into(">h", data, at, struct.unpack_from(">h", data, at)[0] + 30000)
    source = tmp_path / "in.mkv"
    source.write_bytes(bytes(data))
    with av.open(str(source)) as container:  # the oracle: what the file declares
        declared = [packet.pts for packet in container.demux(video=0) if packet.size]
    assert declared[20] == times[20] + 30000 and declared[21] == times[21]
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)
    assert np.allclose(frame_times(output), np.array(times) / 1000, atol=1e-3)
    assert any("timed between its neighbours" in note for note in result.notes), result.notes


def _hdr10(path: Path) -> tuple[list[float], tuple[int, int]]:
    """The first frame's HDR10 metadata as FFmpeg decodes it: the mastering display (red, green, blue, white point x
    and y, then minimum and maximum luminance) and the content light level (MaxCLL, MaxFALL)."""
    with av.open(str(path)) as container:
        frame = next(container.decode(video=0))
        found = {str(data.type): bytes(data) for data in frame.side_data}
    fields = struct.unpack("=22i", found["Type.MASTERING_DISPLAY_METADATA"][:88])
    assert fields[20:] == (1, 1)  # it has primaries and luminance
    return [fields[i] / fields[i + 1] for i in range(0, 20, 2)], struct.unpack("=2I", found["Type.CONTENT_LIGHT_LEVEL"][:8])


@pytest.mark.parametrize("codec", ["h264", "hevc", "av1"])
def test_hdr10_mastering_display_and_light_levels_are_kept(tmp_path, codec):
    """An HDR10 clip (10-bit HEVC, BT.2020, PQ) carries the display it was graded on and its light levels, which
    players tone-map by. The output kept its primaries and transfer but dropped these, as ffprobe read it back."""
    hdr10 = ("colorprim=bt2020:transfer=smpte2084:colormatrix=bt2020nc:hdr10=1:max-cll=1000,400:"
             "master-display=G(13250,34500)B(7500,3000)R(34000,16000)WP(15635,16450)L(10000000,1)")  # fmt: skip
    # The input written on one x265 thread: twice a pytest process died in this test (session 43: a segfault inside
    # x265 as it wrote this clip; CI's run of session 46's code, its stack not kept), never reproduced (120 runs)
    source = write_clip(tmp_path / "in.mp4", 9, (64, 96), Fraction(24), video_codec="libx265", pix_fmt="yuv420p10le",
                        video_options={"x265-params": "log-level=error:pools=1:frame-threads=1:" + hdr10})  # fmt: skip
    (mastering, light), expected = _hdr10(source), [0.68, 0.32, 0.265, 0.69, 0.15, 0.06, 0.3127, 0.329, 0.0001, 1000]
    assert np.allclose(mastering, expected) and light == (1000, 400)
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), replace(FAST, codec=codec))
    written, written_light = _hdr10(output)
    assert np.allclose(written, mastering, rtol=1e-3, atol=1e-4) and written_light == light  # AV1: fixed point
    assert any("mastering display and light levels kept" in note for note in result.notes), result.notes


@pytest.mark.parametrize(("size", "tags"), [((576, 720), (5, 6)), ((480, 720), (6, 6)), ((360, 640), (1, 1)),
                                            ((720, 1280), (1, 1))])  # fmt: skip
def test_an_untagged_source_is_written_with_the_primaries_players_assumed_of_it(tmp_path, size, tags):
    """An untagged PAL or NTSC source (a DV tape's capture, a DVD's rip) is read with BT.601's matrix and shown with its
    system's primaries; its output, HD-sized, was tagged BT.709 throughout, so players showed it with other primaries
    than the source's. It now names what players assumed of the source (mpv's guess by size); matrix BT.709, as
    written; a source of another size keeps BT.709."""
    source = write_clip(tmp_path / "in.mp4", 3, size)
    assert (probe(source).video.color_primaries, probe(source).video.color_trc) == (2, 2)  # untagged
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    video = probe(output).video
    assert (video.color_primaries, video.color_trc, video.color_matrix) == (*tags, 1)


@pytest.mark.parametrize(("pix_fmt", "said"), [
    ("yuv422p", "4:2:2: the output's is 4:2:0, as every output here is written for players to take it (half the colour "
                "resolution down the picture)"),
    ("yuv444p10le", "4:4:4: the output's is 4:2:0, as every output here is written for players to take it (half the "
                    "colour resolution across and down)"),
    ("yuv420p", None),
])  # fmt: skip
def test_a_source_with_finer_colour_than_4_2_0_says_its_output_has_half(tmp_path, pix_fmt, said):
    """A 4:2:2 camera or mezzanine master (XDCAM, ProRes, DNxHR) or a 4:4:4 one came out 4:2:0 with notes that named
    its depth, never its colour resolution halved. Now they say it; a 4:2:0 source's say nothing of it."""
    source = write_clip(tmp_path / "in.mp4", 3, (64, 96), pix_fmt=pix_fmt)
    result = upscale_file(source, tmp_path / "out.mp4", LanczosUpscaler(), FAST)
    assert probe(tmp_path / "out.mp4").video.pix_fmt in ("yuv420p", "yuv420p10le")
    told = [note for note in result.notes if "the output's is 4:2:0" in note]
    assert told == ([f"the source's colour is {said}"] if said else []), result.notes


def _luma_levels(path: Path) -> tuple[str, int]:
    """The first frame's pixel format and the distinct luma codes along its middle row (the ramp's direction)."""
    with av.open(str(path)) as container:
        frame = next(container.decode(video=0))
    dtype = np.uint16 if frame.format.name.endswith("10le") else np.uint8
    plane = frame.planes[0]
    rows = np.frombuffer(bytes(plane), dtype).reshape(-1, plane.line_size // np.dtype(dtype).itemsize)
    return frame.format.name, len(np.unique(rows[frame.height // 2, : frame.width]))


@pytest.mark.parametrize(("transfer", "trc", "codec"), [("hlg", 18, "hevc"), ("pq", 16, "hevc"), ("pq", 16, "av1")])
def test_a_10_bit_hdr_source_is_upscaled_and_written_at_10_bits(tmp_path, transfer, trc, codec):
    """An iPhone's HLG video or an HDR10 (PQ) one, 10-bit BT.2020: the output was 8-bit, its smooth ramps cut into
    at most 219 bands (visible in an HDR sky). Now it is 10-bit, tagged as the source, and keeps the ramp's levels."""
    source = gradient_clip(tmp_path / "in.mp4", transfer=transfer)
    assert _luma_levels(source) == ("yuv420p10le", 512)
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), replace(FAST, codec=codec))
    video = probe(output).video
    assert (video.pix_fmt, video.bit_depth) == ("yuv420p10le", 10)
    assert (video.color_primaries, video.color_trc, video.color_matrix) == (9, trc, 9)  # BT.2020 non-constant
    pix_fmt, levels = _luma_levels(output)
    assert pix_fmt == "yuv420p10le" and levels > 256, levels
    assert any("written at 10 bits" in note for note in result.notes), result.notes


def test_a_10_bit_source_asked_in_h264_is_written_at_8_bits_and_says_why(tmp_path):
    """x264 here has High 10, but most hardware decoders (every Apple device) do not play it: an h264 output stays
    8-bit, and the job's notes say so and which codecs keep 10 bits."""
    source = gradient_clip(tmp_path / "in.mp4", transfer="hlg")
    result = upscale_file(source, tmp_path / "out.mp4", LanczosUpscaler(), replace(FAST, codec="h264"))
    assert probe(tmp_path / "out.mp4").video.bit_depth == 8
    assert any("written at 8 bits" in note and "hevc" in note for note in result.notes), result.notes


def test_the_probe_beats_as_it_reads_and_stops_at_a_cancel(tmp_path, corpus_cache):
    """A probe of minutes (thousands of animated WebP frames on a 4K canvas, a long all-keyframe source) sent no
    heartbeat: it outlasted the lease three times and the job failed `lease_expired`, however it was cancelled."""
    from worker.errors import Cancelled

    clip = write_clip(tmp_path / "clip.mp4", FRAMES, SIZE, audio_codec="aac")
    for source in (clip, corpus_cache / "pillow-iss634.webp"):
        beats: list[int] = []

        def alive() -> bool:
            beats.append(1)
            return False  # not cancelled

        probe(source, alive=alive)
        assert len(beats) >= FRAMES, (source.name, len(beats))
        with pytest.raises(Cancelled):
            probe(source, alive=lambda: True)


def test_a_variable_rate_mp4_with_b_frames_keeps_its_length(tmp_path):
    """Frames reordered (B-frames) at a variable rate: the decode span is no measure of the last frame's time. A phone
    clip came back 0.151 s longer than its source (its last frame 0.188 s against the edit list's 0.037 s), its
    picture running past its sound."""
    from worker.media.mp4_boxes import movie, presented

    times = [0, 320, 2704, 3408, 9648, 10624, 11296, 14880, 16240, 16560, 19056, 19680, 25968]  # a recording's, 1/16000
    source = write_clip(tmp_path / "vfr.mp4", len(times), SIZE, timestamps=times, time_base=Fraction(1, 16000),
                        audio_codec="aac")  # fmt: skip
    with av.open(str(source)) as container:
        stream = container.streams.video[0]
        packets = [packet for packet in container.demux(stream) if packet.size]
        track = stream.id
    assert any(packet.pts != packet.dts for packet in packets)  # reordered: B-frames
    shown = presented(movie(source), track)
    output = upscale_file(source, tmp_path / "out.mp4", LanczosUpscaler(), UpscaleOptions(preset="ultrafast")).output
    with av.open(str(output)) as container:
        stream = container.streams.video[0]
        written = presented(movie(output), stream.id)
    assert abs(float(written - shown)) <= 0.002, (float(shown), float(written))


def test_a_passthrough_goes_with_its_last_reference_not_with_the_cycle_collector(tmp_path):
    """Its handlers hold it back weakly: a passthrough that held them and was held by them stayed, with their decoders
    and encoders and the FFmpeg threads these run (256 for 64 sound tracks re-encoded), until Python's cyclic
    collector ran, jobs later on a worker."""
    source = write_clip(tmp_path / "in.mov", 6, SIZE, Fraction(24), audio_codec="pcm_s16le")  # re-encoded to AAC
    info = probe(source, Limits())
    passthrough = Passthrough(info, plan_streams(info), offset=0.0)
    with av.open(str(tmp_path / "out.mp4"), "w") as output:
        passthrough.add_streams(output)
    assert passthrough.handlers
    gone = weakref.ref(passthrough)
    gc.disable()
    try:
        passthrough.close()
        del passthrough
        assert gone() is None
    finally:
        gc.enable()


def test_a_decoding_error_handed_on_by_prefetch_keeps_nothing_of_the_decoder_s_stack(tmp_path):
    """The error `prefetch` raises in its consumer once held the consumer's frame in its traceback and that frame held
    the error: a cycle that kept every frame of the decoder's stack, with their locals (a refused 8000x8000 picture,
    the decoder and its threads), until Python's cyclic collector ran."""
    pictures = []

    class Picture:
        pass

    def decoded():
        picture = Picture()  # a local of the decoder's frame, as `_pictures`'s refused frame is
        pictures.append(weakref.ref(picture))
        yield 1
        raise InputCorrupt("a frame too many")

    gc.disable()
    try:
        try:
            for _ in prefetch(decoded(), 2):
                pass
        except InputCorrupt:
            pass
        assert pictures and pictures[0]() is None
    finally:
        gc.enable()
