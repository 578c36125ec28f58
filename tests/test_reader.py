"""Decoding (worker.media.reader): the frames `read_frames` hands on are PyAV's own per-frame conversion of real files,
bit for bit, and the conversion's threads are started once per stream, not once per frame."""

from __future__ import annotations

import os
from fractions import Fraction
from itertools import islice
from pathlib import Path

import av
import numpy as np
import pytest
from av.video.reformatter import ColorRange

from worker.media.errors import InputCorrupt
from worker.media.probe import decode_declared_picture, probe
from worker.media.reader import EXACT_8_BIT, Reading, _source_colour, read_frames
from worker.media.synthetic import write_clip

# Real files (tests/corpus/manifest.toml) of each kind of conversion: 10-bit HEVC (BT.601 tagged), RGB (argb) and
# palette pictures, a full-range tagged 190 px wide one, a BT.709 phone clip in 1080p, an untagged odd height. The
# corpus has no rotated file nor one that changes size: those are written here.
CORPUS = [
    "puremagic-test.mkv",
    "filetype-sample.mov",
    "pillow-2422.flc",
    "hachoir-quicktime.mp4",
    "forensics-VID_20191220_170832.mp4",
    "kivy-cityCC0.mpg",
]
FRAMES = 24  # the first ones of each file


def _exact(frame: av.VideoFrame, video) -> dict:
    """PyAV's conversion of `frame` as the reader asks it: the source's colours, swscale's exact path at 8 bits."""
    return _source_colour(frame) | ({"interpolation": EXACT_8_BIT} if video.bit_depth <= 8 else {})


def plain_pyav(path: Path, count: int) -> list[np.ndarray]:
    """The first `count` frames as PyAV gives them: each frame's own `to_ndarray`, turned upright."""
    video = probe(path).video
    turns = video.rotation // 90
    width, height = (video.height, video.width) if turns % 2 else (video.width, video.height)
    pixel_format = "rgb24" if video.bit_depth <= 8 else "rgb48le"
    with av.open(str(path)) as container:
        stream = container.streams[video.index]
        decode_declared_picture(stream)
        frames = islice(container.decode(stream), count)
        return [
            np.rot90(frame.to_ndarray(format=pixel_format, width=width, height=height, **_exact(frame, video)), turns)
            for frame in frames
        ]


def read(path: Path, count: int) -> list[np.ndarray]:
    frames = read_frames(path, probe(path).video)
    try:
        return list(islice(frames, count))
    finally:
        frames.close()


@pytest.mark.parametrize("name", CORPUS)
def test_frames_are_pyavs_own_conversion_bit_for_bit_on_real_files(corpus_cache, name):
    path = corpus_cache / name
    expected = plain_pyav(path, FRAMES)
    got = read(path, FRAMES)
    assert len(got) == len(expected) == min(FRAMES, probe(path).video.frames)
    for index, (frame, reference) in enumerate(zip(got, expected)):
        assert frame.dtype == reference.dtype and frame.shape == reference.shape, index
        assert np.array_equal(frame, reference), f"frame {index} differs"
    if name == "puremagic-test.mkv":
        assert got[0].dtype == np.uint16


@pytest.mark.parametrize("rotation", [90, 270])
def test_rotated_frames_are_pyavs_own_conversion_turned_upright(tmp_path, rotation):
    path = write_clip(tmp_path / "rotated.mp4", 9, (48, 80), rotation=rotation)
    got, expected = read(path, 9), plain_pyav(path, 9)
    assert [frame.shape for frame in got] == [(80, 48, 3)] * 9
    assert all(np.array_equal(frame, reference) for frame, reference in zip(got, expected, strict=True))


def joined(tmp_path: Path, second: tuple[int, int]) -> Path:
    """6 frames of 64x48, then 6 of `second` (height, width) in one MPEG-TS stream: the second part's SPS changes the
    size; its clock goes on from the first's (one that starts over is refused: probe._check_order)."""
    first = write_clip(tmp_path / "a.ts", 6, (48, 64))
    then = write_clip(tmp_path / "b.ts", 6, second, timestamps=range(10, 16), time_base=Fraction(1, 24))
    path = tmp_path / "both.ts"
    path.write_bytes(first.read_bytes() + then.read_bytes())
    return path


@pytest.mark.parametrize("second", [(36, 48), (72, 96)])  # the same 4:3 shape, smaller then larger
def test_a_stream_that_changes_size_mid_way_is_scaled_to_its_largest_part_as_pyav_scales_each_frame(tmp_path, second):
    """The picture is the largest part's: sized from the first part, a screen recording or a live stream that went
    from 64x48 to 96x72 lost a third of its later part's resolution before the upscaling."""
    # one context for the stream: swscale sets itself up again for the new size, as a fresh context would
    path = joined(tmp_path, second)
    largest = max((48, 64), second)
    assert (probe(path).video.height, probe(path).video.width) == largest
    got, expected = read(path, 12), plain_pyav(path, 12)
    assert [frame.shape for frame in got] == [(*largest, 3)] * 12
    assert all(np.array_equal(frame, reference) for frame, reference in zip(got, expected, strict=True))


def _converted(path: Path, parts: slice, height: int, width: int) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        frames = list(container.decode(video=0))[parts]
        return [frame.to_ndarray(format="rgb24", width=width, height=height, **_source_colour(frame),
                                 interpolation=EXACT_8_BIT) for frame in frames]  # fmt: skip


def test_a_smaller_part_of_another_shape_keeps_its_shape_between_black_bars(tmp_path):
    """4:3, then a smaller 16:9 (a recording whose source changed, a phone turned): the 16:9 part was stretched over
    the 4:3 picture, squashed to 3/4 of its width. Players show it whole between bars; so does the output now."""
    path = joined(tmp_path, (36, 64))
    got = read(path, 12)
    assert [frame.shape for frame in got] == [(48, 64, 3)] * 12
    assert all(np.array_equal(frame[6:42], inner) for frame, inner in zip(got[6:], _converted(path, slice(6, None), 36, 64), strict=True))
    assert all(not frame[:6].any() and not frame[42:].any() for frame in got[6:])  # black above and below
    assert all(np.array_equal(frame, reference) for frame, reference in zip(got[:6], plain_pyav(path, 6)))


def test_a_larger_part_of_another_shape_sizes_the_picture_and_the_first_part_keeps_its_shape(tmp_path):
    """4:3 at 64x48, then 16:9 at 96x54: the picture is the 16:9 part's, whole; the 4:3 part is shown as large as
    it fits (72x54), between bars left and right, as a player shows it full screen."""
    path = joined(tmp_path, (54, 96))
    got = read(path, 12)
    assert [frame.shape for frame in got] == [(54, 96, 3)] * 12
    assert all(np.array_equal(frame[:, 12:84], inner) for frame, inner in zip(got[:6], _converted(path, slice(0, 6), 54, 72), strict=True))
    assert all(not frame[:, :12].any() and not frame[:, 84:].any() for frame in got[:6])  # black left and right
    assert all(np.array_equal(frame, reference) for frame, reference in zip(got[6:], _converted(path, slice(6, None), 54, 96), strict=True))


def test_the_conversions_threads_start_once_per_stream_not_once_per_frame(tmp_path):
    # swscale starts one thread per core for a context (none on one core, where this cannot tell); a context per
    # frame started and joined them for every frame: thousands per window on a 16-core host
    path = write_clip(tmp_path / "clip.mp4", 40, (48, 64))
    cores = len(os.sched_getaffinity(0))
    before, seen = set(os.listdir("/proc/self/task")), set()
    for _ in read_frames(path, probe(path).video):
        seen |= set(os.listdir("/proc/self/task"))
    started = seen - before
    assert len(started) <= 2 * cores + 20, f"{len(started)} threads started for 40 frames on {cores} cores"


def test_an_alpha_channel_a_file_leaves_unused_keeps_its_pictures(corpus_cache, tmp_path):
    """Uncompressed 32-bit AVI (VirtualDub's, Windows capture tools'): FFmpeg reads it as BGRA with alpha 0 everywhere,
    a channel the file does not use. Frames with transparent pixels are shown over black: these came out black; an
    alpha of 0 everywhere is taken as none, and the frames are the pictures stored, bit for bit."""
    clip = corpus_cache / "hachoir-flashmob.mkv"
    pictures = list(islice(read_frames(clip, probe(clip).video), 4))
    path = tmp_path / "rgb32.avi"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("rawvideo", rate=25)
        stream.height, stream.width = pictures[0].shape[:2]
        stream.pix_fmt = "bgra"
        for index, rgb in enumerate(pictures):
            bgra = np.concatenate([rgb[..., ::-1], np.zeros_like(rgb[..., :1])], axis=2)
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(bgra), format="bgra")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    video = probe(path).video
    assert video.pix_fmt == "bgra"
    for read, stored in zip(read_frames(path, video), pictures, strict=True):
        assert np.array_equal(read, stored)


def test_a_title_that_fades_out_to_transparent_shows_the_background_to_its_end(tmp_path):
    """A ProRes 4444 title (After Effects' export) fading out ends with frames transparent everywhere. Taken for an
    alpha channel left unused (as in 32-bit AVI), they showed the colour stored under them (red here) after frames
    shown over the background: a flash. A stream whose alpha was partly used before is transparent there."""
    path = tmp_path / "title.mov"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("prores_ks", rate=25, options={"profile": "4"})  # 4444, with alpha
        stream.height, stream.width, stream.pix_fmt = 32, 48, "yuva444p10le"
        for index, alpha in enumerate((255, 128, 0, 0)):
            rgba = np.zeros((32, 48, 4), np.uint8)
            rgba[..., 0], rgba[..., 3] = 255, alpha
            frame = av.VideoFrame.from_ndarray(rgba, format="rgba")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    frames = [frame >> 8 for frame in read_frames(path, probe(path).video, background=(255, 255, 255))]  # 10-bit
    assert len(frames) == 4 and frames[0][..., 1].max() < 8  # opaque red
    assert 120 < frames[1][..., 1].mean() < 136  # red at half over white
    assert all(frame.min() > 247 for frame in frames[2:]), [frame.reshape(-1, 3)[0] for frame in frames[2:]]


@pytest.mark.parametrize("matrix", ["bt601", "bt709"])
def test_8_bit_pictures_are_read_in_their_exact_colours(tmp_path, matrix):
    """75 % colour bars as a broadcast or DV source stores them (8-bit 4:2:0, limited range; BT.601 at 640x480,
    BT.709 at 1920x1080), written losslessly: each bar is read as its Y'CbCr values convert to, within rounding.
    swscale's fast path read them up to 3 levels off (the green bar 188 for 190.6, white 190 for 191): every 8-bit
    source's colours shifted."""
    from bench.colour_read import WEIGHTS, bars_frame

    colorspace, kr, kb, (height, width) = WEIGHTS[matrix]
    frame, exact = bars_frame(kr, kb, height, width)
    frame.colorspace, frame.color_range = colorspace, ColorRange.MPEG
    path = tmp_path / f"bars-{matrix}.mkv"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=25)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.colorspace, stream.codec_context.color_range = colorspace, ColorRange.MPEG
        for index in range(2):
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    picture = next(read_frames(path, probe(path).video)).astype(float)
    bars = [picture[:, bar * width // 8 + 16 : (bar + 1) * width // 8 - 16].reshape(-1, 3).mean(0) for bar in range(8)]
    error = np.abs(np.array(bars) - exact).max()
    assert error <= 0.75, (error, np.round(bars, 1).tolist(), np.round(exact, 1).tolist())


# -- damaged real files: read as players read them, or refused before the work ----------------------------------------


def _segment(corpus_cache: Path) -> bytes:
    """A real MPEG-TS (H.264 and AAC, 134 frames of 388x300): what a damaged download or recording starts from."""
    return (corpus_cache / "muxjs-test-segment.ts").read_bytes()


def _read(path: Path) -> tuple[list[np.ndarray], Reading]:
    reading = Reading()
    return list(read_frames(path, probe(path).video, reading)), reading


def test_frames_a_damaged_file_does_not_decode_are_the_frames_before_them(corpus_cache, tmp_path):
    """5 % of an MPEG-TS lost a third of the way in (a download that skipped a block): FFmpeg's decoder gives 120 of
    its 128 frames, silently. Counted only at the end, the job failed after every window had run (`input_corrupt`,
    "decoded 120 frames, the container holds 128"); players show the frame before each missing one, and so does the
    reader now, each in its place, so the sound stays in sync."""
    data = _segment(corpus_cache)
    damaged = tmp_path / "lost.ts"
    damaged.write_bytes(data[: len(data) // 3] + data[len(data) // 3 + len(data) // 20 :])
    video = probe(damaged).video
    with av.open(str(damaged)) as container:  # what the decoder gives, and where
        given = [frame.pts for frame in container.decode(container.streams.video[0])]
    frames, reading = _read(damaged)
    assert (video.frames, len(given)) == (128, 120) and len(frames) == video.frames
    assert reading.repeated == video.frames - len(given) == 8
    missing = [index for index, pts in enumerate(video.presented) if pts not in given]
    assert len(missing) == 8 and all(np.array_equal(frames[index], frames[index - 1]) for index in missing)


def test_a_file_missing_a_tenth_of_its_frames_is_refused_where_that_is_met(corpus_cache, tmp_path):
    data = _segment(corpus_cache)[: 62_416]  # its first 40 frames, then 5 % of them lost
    damaged = tmp_path / "ruined.ts"
    damaged.write_bytes(data[: len(data) // 3] + data[len(data) // 3 + len(data) // 20 :])
    video = probe(damaged).video
    read = 0
    with pytest.raises(InputCorrupt, match="over a tenth of its 40 frames do not decode"):
        for _ in read_frames(damaged, video):
            read += 1
    assert read < 30 < video.frames


def test_a_stream_that_appears_mid_file_ends_nothing(corpus_cache, tmp_path):
    """One bit flipped in a TS packet's PID: FFmpeg meets a stream its header did not list, and PyAV 18's demux then
    raised IndexError after the last packet (the job: `internal_error`; it reads a table past its end, so it may not,
    elsewhere). Its packets are not the video's: every frame is read, and the probe reads to the end."""
    data = bytearray(_segment(corpus_cache))
    at = 645 * 188  # a packet that starts a frame of the video (PID 0x100), two thirds in
    assert data[at : at + 3] == bytes.fromhex("474100")
    data[at + 2] = 0x10  # PID 0x110: no stream of the file's
    moved = tmp_path / "moved.ts"
    moved.write_bytes(bytes(data))
    frames, reading = _read(moved)
    assert len(frames) == probe(moved).video.frames > 120


def test_a_ts_cut_in_its_sound_reads_what_it_holds(corpus_cache, tmp_path):
    """The first 8 KiB of an MPEG-TS (a download stopped at once): FFmpeg's AAC parser hands on pieces of the cut
    packet flagged corrupt, with no position in the file; taken for a position, None failed the job as
    `internal_error`."""
    cut = tmp_path / "cut.ts"
    cut.write_bytes(_segment(corpus_cache)[:8192])
    frames, _ = _read(cut)
    assert len(frames) == probe(cut).video.frames > 0


def test_timestamps_no_recording_has_are_called_damaged(corpus_cache, tmp_path):
    """An FLV appended to itself: its second part's sound starts over, and the span FFmpeg gives wraps to 9.2e15 s.
    That is damage to say so, not a length over the limit ("its audio runs to 9223372032559810 s")."""
    data = (corpus_cache / "hachoir-breakdance.flv").read_bytes()
    joined = tmp_path / "joined.flv"
    joined.write_bytes(data + data)
    with pytest.raises(InputCorrupt, match="timestamps jump .* ahead, longer than any recording: they are damaged"):
        probe(joined)


def test_decode_times_stored_as_presentation_times_are_no_missing_frames(tmp_path):
    """x264 with B-frames muxed with each packet's decode time as its presentation time (`ffmpeg -c copy` from an AVI,
    an MP4 without `ctts`): the decoder's frames carry their timestamps shuffled (0, 80, 120, 40...). Placed by them,
    each B-frame looked missing, a repeat stood in, and past a tenth the healthy file was refused (a review's)."""
    path = tmp_path / "dts.mkv"
    with av.open(str(path), "w", format="matroska") as out:
        stream = out.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt, stream.options = 64, 48, "yuv420p", {"bf": "2", "g": "30"}
        packets = []
        for index in range(60):
            pixels = np.full((48, 64, 3), index * 4, np.uint8)
            pixels[:, index] = 255  # a line that moves: each frame its own
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts, frame.time_base = index, Fraction(1, 25)
            packets += stream.encode(frame)
        for packet in [*packets, *stream.encode(None)]:
            packet.pts = packet.dts
            out.mux(packet)
    frames, reading = _read(path)
    assert len(frames) == 60 and reading.repeated == 0
    assert [int(np.argmax(frame[24, :, 0] == frame[24, :, 0].max())) for frame in frames] == list(range(60))
