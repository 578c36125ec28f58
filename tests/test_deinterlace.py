"""Interlaced sources (DV, DVD, broadcast TS, AVCHD 1080i) are deinterlaced as they are read (worker.media.reader):
upscaled as stored, the two fields of a frame, taken at two instants, would be magnified into combs on every moving
edge. The sources here are genuinely interlaced: the fields of a real clip's consecutive frames woven together and
encoded as interlaced H.264 (x264's MBAFF) or MPEG-2 (field DCT and motion, as DVDs and broadcasts carry it), top or
bottom field first; what is measured is the upscaled MP4 a user gets back."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from itertools import islice
from pathlib import Path

import av
import numpy as np
import pytest

from tests.field_pictures import mpeg2_fields, paff
from worker.errors import Cancelled
from worker.media.probe import probe
from worker.media.reader import EXACT_8_BIT, _source_colour, at_cadence, read_frames
from worker.media.synthetic import _write_audio, tone
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.request import SRRequest
from worker.sr.windows import DirectoryWindowStore
from worker.upscale import UpscaleOptions, upscale_file

CLIP = "hachoir-flashmob.mkv"  # tests/corpus/manifest.toml: people dancing, motion everywhere, 384x288 at 25 fps
INSTANTS = 24  # the clip's first frames, each one field's instant: 12 interlaced frames
RATE = Fraction(25, 2)  # so each frame's two fields are 1/25 s apart, as the clip's frames
FAST = UpscaleOptions(request=SRRequest(scale=2), preset="ultrafast")


@pytest.fixture(scope="module")
def instants(corpus_cache) -> list[np.ndarray]:
    path = corpus_cache / CLIP
    frames = read_frames(path, probe(path).video)
    try:
        return list(islice(frames, INSTANTS))
    finally:
        frames.close()


def weave(instants: list[np.ndarray], order: str) -> list[np.ndarray]:
    """A frame from each two instants: the field shown first (top: the even rows) from the earlier one."""
    woven = []
    for earlier, later in zip(instants[0::2], instants[1::2]):
        frame = earlier.copy()
        second = slice(1, None, 2) if order == "tff" else slice(0, None, 2)
        frame[second] = later[second]
        woven.append(frame)
    return woven


def encode(path: Path, frames: list[np.ndarray], codec: str, order: str | None, rate: Fraction | None = None) -> Path:
    """H.264, MPEG-2 or DV, coded interlaced with the field `order` ("tff", "bff"), or progressive (None)."""
    rate = rate or (Fraction(25) if codec == "dv" else RATE)  # DV has PAL's rate or NTSC's, no other
    with av.open(str(path), "w") as container:
        if codec == "h264":
            options = {"crf": "12"} | ({"x264-params": f"interlaced=1:{order}=1"} if order else {})
        else:  # MPEG-2 and DV take each picture's field order from the frame: `setfield` marks them
            options = {"qscale": "2"} | ({"flags": "+ildct+ilme"} if order else {})
        encoder = {"h264": "libx264", "mpeg2": "mpeg2video", "dv": "dvvideo"}[codec]
        stream = container.add_stream(encoder, rate=rate, options=options)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        graph = av.filter.Graph()
        nodes = [graph.add_buffer(width=stream.width, height=stream.height, format="rgb24", time_base=1 / rate)]
        nodes += [graph.add("setfield", order)] if order and codec != "h264" else []
        nodes += [graph.add("format", "yuv420p"), graph.add("buffersink")]
        for a, b in zip(nodes, nodes[1:]):
            a.link_to(b)
        graph.configure()
        for index, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts, frame.time_base = index, 1 / rate
            graph.push(frame)
            container.mux(stream.encode(graph.vpull()))
        container.mux(stream.encode())
    return path


def luma(rgb: np.ndarray) -> np.ndarray:
    return rgb.astype(np.float64) @ np.array([0.299, 0.587, 0.114])


def moving(instants: list[np.ndarray]) -> list[np.ndarray]:
    """Where each frame's two field instants differ: there woven fields comb, elsewhere they agree."""
    return [np.abs(luma(a) - luma(b)) > 25 for a, b in zip(instants[0::2], instants[1::2])]


def combing(path: Path, masks: list[np.ndarray]) -> float:
    """Comb energy in the moving areas, at the source's line pitch (each 2x2 block of the x2 output averaged back):
    a row's differences from the rows above and below multiplied where they have one sign, i.e. a row unlike both of
    its neighbours the same way, the line-to-line alternation of woven fields. Progressive pictures have some too
    (thin horizontal detail), which is why the figures are compared with a progressive source's."""
    energy, count = 0.0, 0
    for y, mask in zip(upscaled(path, masks), masks, strict=True):
        y = (y[0::2, 0::2] + y[1::2, 0::2] + y[0::2, 1::2] + y[1::2, 1::2]) / 4
        above, row, below = y[:-2], y[1:-1], y[2:]
        alternation = np.maximum(0.0, (row - above) * (row - below))[mask[1:-1]]
        energy, count = energy + alternation.sum(), count + alternation.size
    return energy / count


def upscaled(path: Path, masks: list[np.ndarray]) -> list[np.ndarray]:
    """The x2 output's luma, cropped to the masks' picture (the clip, where a DV frame has it in a corner)."""
    height, width = 2 * masks[0].shape[0], 2 * masks[0].shape[1]
    with av.open(str(path)) as container:
        return [luma(frame.to_ndarray(format="rgb24"))[:height, :width] for frame in container.decode(video=0)]


def distance(path: Path, reference: Path, masks: list[np.ndarray]) -> float:
    """Mean luma difference in the moving areas between two x2 outputs."""
    pairs = zip(upscaled(path, masks), upscaled(reference, masks), masks, strict=True)
    differences = [np.abs(a - b)[mask.repeat(2, 0).repeat(2, 1)] for a, b, mask in pairs]
    return float(np.concatenate(differences).mean())


def times(path: Path) -> list[float]:
    with av.open(str(path)) as container:
        stamps = sorted(float(frame.time) for frame in container.decode(video=0))
    return [t - stamps[0] for t in stamps]


@pytest.fixture(scope="module")
def progressive(instants, tmp_path_factory) -> tuple[Path, Path]:
    """The same instants as progressive clips, upscaled: a frame at each first field's instant, and at each second's."""
    scratch = tmp_path_factory.mktemp("progressive")
    outputs = scratch / "first.mp4", scratch / "second.mp4"
    for frames, output in zip((instants[0::2], instants[1::2]), outputs):
        upscale_file(encode(output.with_suffix(".in.mp4"), frames, "h264", None), output, LanczosUpscaler(), FAST)
    return outputs


# H.264 as AVCHD and broadcasts carry it, MPEG-2 as DVDs (program stream) and broadcasts do, DV as camcorders
# record it: PAL's 720x576, bottom field first, an order its stream does not declare (each frame's header says it)
CASES = {"h264-tff-ts": ("h264", "tff", "ts"), "h264-bff-mp4": ("h264", "bff", "mp4"),
         "mpeg2-tff-mpg": ("mpeg2", "tff", "mpg"), "mpeg2-bff-ts": ("mpeg2", "bff", "ts"),
         "dv-bff-avi": ("dv", "bff", "avi")}
SAID = {"tff": "top field first", "bff": "bottom field first"}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_interlaced_video_comes_out_progressive_without_combs_frame_for_frame(
    instants, progressive, tmp_path, case
):
    codec, order, suffix = CASES[case]
    masks = moving(instants)
    if codec == "dv":  # the clip in the top left corner of DV's picture
        instants = [np.pad(frame, ((0, 576 - frame.shape[0]), (0, 720 - frame.shape[1]), (0, 0))) for frame in instants]
    woven = weave(instants, order)
    source = encode(tmp_path / f"in.{suffix}", woven, codec, order)
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)

    # What upscaling the frames as stored gives: the same woven frames, not flagged interlaced
    stored = encode(tmp_path / "stored.mp4", woven, "h264", None)
    upscale_file(stored, tmp_path / "stored-out.mp4", LanczosUpscaler(), FAST)
    first, second = progressive
    as_stored, deinterlaced = combing(tmp_path / "stored-out.mp4", masks), combing(output, masks)
    assert deinterlaced * 6 < as_stored  # measured: 12 to 16 times less
    assert deinterlaced < combing(first, masks)  # no more than a progressive clip of the same instants
    # Each frame shows its first field's instant, as its timestamp says: the field order was read right (read the
    # other way, a frame shows its second field's instant, half a frame late: 41 against 11 in the h264-tff case)
    assert distance(output, first, masks) * 2 < distance(output, second, masks)  # measured: 9 to 17 against 38 to 43

    assert times(output) == pytest.approx(times(source), abs=1e-3)  # every frame, each at its own time
    with av.open(str(output)) as container:
        assert container.streams.video[0].codec_context.field_order == 1  # AV_FIELD_PROGRESSIVE: what ffprobe shows
        assert not any(frame.interlaced_frame for frame in container.decode(video=0))
    said = "each frame's field order" if codec == "dv" else SAID[order]
    assert any(f"deinterlaced with bwdif ({said})" in note for note in result.notes), result.notes
    assert not any("woven" in note for note in result.notes)


@pytest.mark.parametrize("container, order", [("mpegts", "tff"), ("mp4", "bff")])
def test_field_pictures_as_camcorders_code_them_count_a_frame_for_each_pair(
    instants, progressive, tmp_path, container, order
):
    """AVCHD camcorders (and many 1080i broadcasts) code each field as a picture of its own (PAFF): FFmpeg's parser
    hands over two packets a frame, its decoder one frame a pair. Counted a frame a packet, the probe said 24 frames
    at 25 fps, and the job was refused after all of it was upscaled ("decoded 12 frames, the container holds 24").
    Now: 12 frames at the source's rate, deinterlaced in its field order, each showing its first field's instant;
    at the field rate, 24 frames at twice it. In a TS (start codes) and in an MP4 (length-prefixed units, avcC)."""
    masks = moving(instants)
    source = tmp_path / f"paff.{'ts' if container == 'mpegts' else 'mp4'}"
    paff(source, weave(instants, order), order, RATE, container)
    video = probe(source).video
    assert (video.frames, video.fps, video.cfr, video.interlaced) == (12, RATE, True, True)

    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)
    assert (result.written.video.frames, result.written.video.fps) == (12, RATE)
    assert times(output) == pytest.approx([index / RATE for index in range(12)], abs=1e-3)
    # an MP4 declares no field order (a TS's parser reads one): bwdif reads each frame's, which the decoder sets
    said = SAID[order] if container == "mpegts" else "each frame's field order"
    assert any(f"deinterlaced with bwdif ({said})" in note for note in result.notes), result.notes
    first, second = progressive
    assert distance(output, first, masks) * 2 < distance(output, second, masks)  # the field order read right

    result = upscale_file(source, tmp_path / "fields.mp4", LanczosUpscaler(), FIELD_RATE)
    assert (result.written.video.frames, result.written.video.fps) == (24, 2 * RATE)


def test_mpeg2_field_pictures_as_broadcast_encoders_code_them_are_one_frame_a_pair(instants, tmp_path):
    """MPEG-2 broadcast encoders code interlaced video as field pictures too. FFmpeg's MPEG-2 parser, unlike its
    H.264 one, keeps a frame's two fields in one packet: a frame a packet holds, and the probe must not pair them
    again. 12 frames at the stream's 25, deinterlaced bottom field first."""
    source = tmp_path / "fields.ts"
    mpeg2_fields(source, weave(instants, "bff"), "bff")
    video = probe(source).video
    assert (video.frames, video.fps, video.interlaced) == (12, 25, True)
    result = upscale_file(source, tmp_path / "out.mp4", LanczosUpscaler(), FAST)
    assert result.written.video.frames == 12
    assert any("deinterlaced with bwdif (bottom field first)" in note for note in result.notes), result.notes


def plain(path: Path) -> list[np.ndarray]:
    """Every frame as PyAV converts it, with no filter: what `read_frames` gives for progressive video (test_reader)."""
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24", **_source_colour(frame), interpolation=EXACT_8_BIT)
                for frame in container.decode(video=0)]  # fmt: skip


def test_a_source_that_turns_interlaced_midway_has_those_frames_deinterlaced_and_says_how_many(instants, tmp_path):
    """A DVD or a broadcast whose first frames are progressive (film) and the later ones interlaced (video): its
    first frame is progressive; the frames themselves decide. The progressive ones pass untouched; the note counts
    the interlaced ones. Asked for a frame per field, it is doubled from its first frame (the probe saw a later
    keyframe interlaced): 24 frames at 25, the progressive ones shown twice; before, it kept its rate."""
    parts = [encode(tmp_path / "film.m2v", instants[0:12:2], "mpeg2", None),
             encode(tmp_path / "video.m2v", weave(instants[12:], "tff"), "mpeg2", "tff")]  # fmt: skip
    elementary = tmp_path / "joined.m2v"  # one stream: the second sequence header turns it interlaced
    elementary.write_bytes(b"".join(part.read_bytes() for part in parts))
    source = tmp_path / "in.mpg"
    with av.open(str(elementary)) as raw, av.open(str(source), "w") as container:
        stream = container.add_stream_from_template(raw.streams.video[0])
        for index, packet in enumerate(p for p in raw.demux(video=0) if p.size):  # no B-frames: decode order is shown
            packet.stream, packet.time_base, packet.pts, packet.dts = stream, 1 / RATE, index, index
            container.mux(packet)
    video = probe(source).video
    assert (video.interlaced, video.turns_interlaced) == (False, True)

    as_decoded, read = plain(source), list(read_frames(source, video))
    assert len(read) == 12
    assert all(np.array_equal(a, b) for a, b in zip(read[:6], as_decoded[:6]))  # no filter touched them
    assert not any(np.array_equal(a, b) for a, b in zip(read[6:], as_decoded[6:]))
    result = upscale_file(source, tmp_path / "out.mp4", LanczosUpscaler(), FAST)
    assert any("interlaced (6 of its 12 frames)" in note and "bwdif" in note for note in result.notes), result.notes

    fields = list(read_frames(source, at_cadence(video, "field"), cadence="field"))
    assert len(fields) == 24 and all(np.array_equal(fields[2 * i], fields[2 * i + 1]) for i in range(6))
    result = upscale_file(source, tmp_path / "fields.mp4", LanczosUpscaler(), FIELD_RATE)
    assert (result.written.video.frames, result.written.video.fps) == (24, 2 * RATE)
    assert times(tmp_path / "fields.mp4") == pytest.approx([index / (2 * RATE) for index in range(24)], abs=1e-3)
    assert any("(6 of its 12 frames)" in note and "one frame for each field" in note for note in result.notes)


def test_a_resumed_job_replays_kept_windows_of_the_same_deinterlaced_frames(instants, tmp_path):
    """bwdif reads the frames around each one; a job that resumes from kept windows decodes from the first frame
    again (it never seeks to a window), so the windows it computes after the kept ones see the frames the first
    attempt saw, and the output is the uninterrupted run's, combing-free."""
    source = encode(tmp_path / "in.ts", weave(instants, "tff"), "h264", "tff")
    options = UpscaleOptions(request=SRRequest(scale=2), window=5, window_overlap=2, preset="ultrafast")  # 4 windows
    upscale_file(source, tmp_path / "whole.mp4", LanczosUpscaler(), options)

    windows = tmp_path / "windows"
    kept = lambda: len(list(windows.glob("window-*.json")))
    with pytest.raises(Cancelled):
        upscale_file(source, tmp_path / "cut.mp4", LanczosUpscaler(), options, cancelled=lambda: kept() == 2,
                     store=DirectoryWindowStore(windows, "job"))  # fmt: skip
    result = upscale_file(source, tmp_path / "resumed.mp4", LanczosUpscaler(), options,
                          store=DirectoryWindowStore(windows, "job"))  # fmt: skip
    assert result.restored == 2
    resumed, whole = plain(tmp_path / "resumed.mp4"), plain(tmp_path / "whole.mp4")
    assert all(np.array_equal(a, b) for a, b in zip(resumed, whole, strict=True))
    stored = encode(tmp_path / "stored.mp4", weave(instants, "tff"), "h264", None)
    upscale_file(stored, tmp_path / "stored-out.mp4", LanczosUpscaler(), options)
    masks = moving(instants)
    assert combing(tmp_path / "resumed.mp4", masks) * 6 < combing(tmp_path / "stored-out.mp4", masks)


def test_a_real_interlaced_broadcast_is_deinterlaced_in_its_field_order_keeping_still_detail(corpus_cache, tmp_path):
    """The corpus's one real interlaced file: a cut of a Swedish DVB broadcast (MPEG-2 720x576, both frames coded
    interlaced, top field first), a dark still picture under a caption. bwdif adapts to motion: where nothing moves
    it keeps both fields' lines, so the picture changes by a fraction of a level, not a blur."""
    source = corpus_cache / "hachoir-sample.ts"
    video = probe(source).video
    assert video.interlaced
    as_stored, read = plain(source), list(read_frames(source, video))
    change = [np.abs(a.astype(int) - b.astype(int)) for a, b in zip(as_stored, read, strict=True)]
    assert all(0 < d.mean() < 1 for d in change)  # measured: 0.14 and 0.17

    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)
    assert any("deinterlaced with bwdif (top field first)" in note for note in result.notes), result.notes
    assert times(output) == pytest.approx(times(source), abs=1e-3)
    with av.open(str(output)) as container:
        assert container.streams.video[0].codec_context.field_order == 1


FIELD_RATE = replace(FAST, deinterlace="field")


@pytest.mark.parametrize("case", ["h264-tff-ts", "mpeg2-bff-ts"])
def test_at_the_field_rate_each_field_becomes_a_frame_at_its_own_instant(instants, progressive, tmp_path, case):
    """`deinterlace=field` (50i as 50p): twice the frames at twice the rate over the same time, each showing its
    field's instant. The even frames match a progressive clip of the first fields' instants, the odd ones one of the
    second fields': the motion between two fields, which a frame per source frame leaves out, is in the output."""
    codec, order, suffix = CASES[case]
    masks = moving(instants)
    source = encode(tmp_path / f"in.{suffix}", weave(instants, order), codec, order)
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FIELD_RATE)

    assert (result.source.video.frames, result.written.video.frames) == (INSTANTS // 2, INSTANTS)
    assert (result.source.video.fps, result.written.video.fps) == (RATE, 2 * RATE)
    assert times(output) == pytest.approx([index / (2 * RATE) for index in range(INSTANTS)], abs=1e-3)
    assert result.written.video.duration == pytest.approx(result.source.video.duration, abs=1e-3)
    frames, (first, second) = upscaled(output, masks), (upscaled(path, masks) for path in progressive)
    first, second = list(first), list(second)

    def apart(outputs: list[np.ndarray], reference: list[np.ndarray]) -> float:
        pairs = zip(outputs, reference, masks, strict=True)
        return float(np.concatenate([np.abs(a - b)[m.repeat(2, 0).repeat(2, 1)] for a, b, m in pairs]).mean())

    assert apart(frames[0::2], first) * 2 < apart(frames[0::2], second)
    assert apart(frames[1::2], second) * 2 < apart(frames[1::2], first)
    assert any(f"bwdif ({SAID[order]}), one frame for each field" in note and "12.5 frames/s in, 25 out" in note
               for note in result.notes), result.notes  # fmt: skip


def test_at_the_field_rate_a_real_broadcast_keeps_its_time_and_a_progressive_source_its_rate(
    corpus_cache, instants, tmp_path
):
    """The DVB cut at the field rate: a frame at each field's instant, the same span of time (its sound stays in
    sync). A progressive source asked for the field rate keeps its frames and says why."""
    source = corpus_cache / "hachoir-sample.ts"
    video = probe(source).video
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FIELD_RATE)
    assert (result.written.video.frames, result.written.video.fps) == (2 * video.frames, 2 * video.fps)
    fields = sorted(t + half / (2 * float(video.fps)) for t in times(source) for half in (0, 1))
    assert times(output) == pytest.approx(fields, abs=1e-3)
    assert result.written.video.duration == pytest.approx(video.duration, abs=1e-3)

    progressive = encode(tmp_path / "film.mp4", instants[:6], "h264", None)
    result = upscale_file(progressive, tmp_path / "film-out.mp4", LanczosUpscaler(), FIELD_RATE)
    assert (result.written.video.frames, result.written.video.fps) == (6, RATE)
    assert "deinterlace=field was asked, but the source is progressive: the output keeps the source's frame rate" in result.notes


NTSC, FILM_RATE = Fraction(30000, 1001), Fraction(24000, 1001)
FILM = replace(FAST, deinterlace="film")


def telecine(film: list[np.ndarray], order: str) -> list[np.ndarray]:
    """3:2 pulldown, as an NTSC DVD or broadcast carries a film: every four film frames A B C D become five video
    frames, A, B, B's first field with C's second, C's first with D's second, then D."""
    first = slice(0, None, 2) if order == "tff" else slice(1, None, 2)

    def woven(earlier: np.ndarray, later: np.ndarray) -> np.ndarray:
        frame = later.copy()
        frame[first] = earlier[first]
        return frame

    video = []
    for a, b, c, d in zip(*[iter(film)] * 4):
        video += [a, b, woven(b, c), woven(c, d), d]
    return video


@pytest.mark.parametrize("case", ["h264-tff-ts", "mpeg2-bff-ts"])
def test_telecined_film_gets_its_own_frames_back(instants, tmp_path, case):
    """`deinterlace=film` on a film telecined to 29.97i: the film's own 20 frames out of 25, at 23.976 over the same
    time, each one its film frame (the two woven from two film frames in every five put back together), where
    deinterlacing frame for frame leaves 25 frames, five of them a blend of two film frames."""
    codec, order, suffix = CASES[case]
    film = instants[4:24]  # the clip's first frames hardly move
    source = encode(tmp_path / f"in.{suffix}", telecine(film, order), codec, order, NTSC)
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FILM)

    assert (result.source.video.frames, result.written.video.frames) == (25, 20)
    assert (result.source.video.fps, result.written.video.fps) == (NTSC, FILM_RATE)
    assert times(output) == pytest.approx([index / FILM_RATE for index in range(20)], abs=1e-3)
    assert result.written.video.duration == pytest.approx(result.source.video.duration, abs=1e-3)
    moves = [np.abs(luma(a) - luma(b)) > 25 for a, b in zip(film, film[1:])]
    # where each film frame differs from a neighbour
    masks = [a | b for a, b in zip(moves[:1] + moves, moves + moves[-1:])]
    reference = tmp_path / "film.mp4"
    upscale_file(encode(tmp_path / "film.in.mp4", film, "h264", None, FILM_RATE), reference, LanczosUpscaler(), FAST)
    frames, films = upscaled(output, masks), upscaled(reference, masks)

    def apart(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
        return float(np.abs(a - b)[mask.repeat(2, 0).repeat(2, 1)].mean())

    owns = []
    for index, (frame, mask) in enumerate(zip(frames, masks, strict=True)):
        owns.append(apart(frame, films[index], mask))
        nearest_other = min(apart(frame, other, mask) for number, other in enumerate(films) if number != index)
        assert owns[-1] < nearest_other, (index, owns[-1], nearest_other)
    if codec == "h264":  # its fields put back together, not interpolated: measured median 2.7 levels, 5.3 without
        # fieldmatch (bwdif then decimate); MPEG-2's own coding drift over its GOP (1 to 6 levels) hides the difference
        assert float(np.median(owns)) < 4, owns
    assert any(f"telecine undone ({SAID[order]})" in note and "25 frames in, 20 out (29.97 frames/s in, 23.976 out)"
               in note for note in result.notes), result.notes  # fmt: skip


def test_film_asked_of_a_source_at_another_rate_keeps_its_rate_and_says_why(instants, tmp_path):
    """Telecine makes 29.97 or 30 frames a second: a 50i source asked for `film` is deinterlaced frame for frame."""
    source = encode(tmp_path / "in.ts", weave(instants[:8], "tff"), "h264", "tff")
    result = upscale_file(source, tmp_path / "out.mp4", LanczosUpscaler(), FILM)
    assert (result.written.video.frames, result.written.video.fps) == (4, RATE)
    assert any("deinterlaced with bwdif" in note for note in result.notes), result.notes
    assert ("deinterlace=film was asked, but its rate is 12.5 frames/s, and telecine (3:2 pulldown) makes 29.97 or 30: "
            "the output keeps the source's frame rate") in result.notes  # fmt: skip


@pytest.mark.parametrize("name", ["devede-base_ntsc.mpg", "puremagic-test.mp4"])
def test_film_on_real_ntsc_files_keeps_four_frames_in_five_and_a_last_short_cycle_whole(corpus_cache, tmp_path, name):
    """Real 29.97 streams (a DVD authoring tool's MPEG-2, an MP4 that rounds the rate to 2997/100), 29 frames each:
    five cycles of five lose one frame each, the last four are kept, 24 frames at 4/5 the rate, read back so."""
    source = corpus_cache / name
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FILM)
    assert (result.source.video.frames, result.written.video.frames) == (29, 24)
    assert float(result.written.video.fps) == pytest.approx(23.976, abs=1e-3)
    assert len(times(output)) == 24 and times(output)[-1] == pytest.approx(23 / 23.976, abs=2e-3)
    assert any("29 frames in, 24 out (29.97 frames/s in, 23.976 out)" in note for note in result.notes), result.notes


def soft_telecine(path: Path, film: list[np.ndarray], sound: bool) -> Path:
    """Film as an NTSC DVD (program stream, AC-3 sound) or an ATSC broadcast (TS) carries it, soft-telecined: the
    film's own progressive frames coded at 23.976, flagged the way DVD authoring's pulldown tools (DGPulldown) flag
    them: 29.97 in the sequence header, the sequence interlaced, each picture progressive, shown top field first or
    not and with its first field repeated or not, in the cycle that makes 3:2 pulldown (A: 3 fields, B: 2, C: 3, D:
    2)."""
    elementary = path.with_suffix(".m2v")
    with av.open(str(elementary), "w", format="mpeg2video") as container:
        stream = container.add_stream("mpeg2video", rate=FILM_RATE, options={"qscale": "2"})  # no B-frames: coded
        stream.height, stream.width = film[0].shape[:2]  # order is display order, the flags' cycle
        stream.pix_fmt = "yuv420p"
        for index, pixels in enumerate(film):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24").reformat(format="yuv420p")
            frame.pts, frame.time_base = index, 1 / FILM_RATE
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    data, start, pictures = bytearray(elementary.read_bytes()), 0, 0
    while (start := data.find(b"\x00\x00\x01", start) + 3) > 2:
        code, extension = data[start], data[start + 1] >> 4
        if code == 0xB3:  # sequence header: frame_rate_code 4, 30000/1001
            data[start + 4] = (data[start + 4] & 0xF0) | 4
        elif code == 0xB5 and extension == 1:  # sequence extension: progressive_sequence 0
            data[start + 2] &= ~0x08
        elif code == 0xB5 and extension == 8:  # picture coding extension
            top_first, repeat = [(1, 1), (0, 0), (0, 1), (1, 0)][pictures % 4]
            data[start + 4] = (data[start + 4] & ~0x82) | top_first << 7 | repeat << 1
            data[start + 5] |= 0x80  # progressive_frame
            pictures += 1
    elementary.write_bytes(bytes(data))
    with av.open(str(elementary), format="mpegvideo") as source, av.open(str(path), "w") as container:
        video = container.add_stream_from_template(source.streams.video[0])
        audio = container.add_stream("ac3", rate=48000, layout="stereo") if sound else None
        for packet in source.demux(video=0):
            if packet.size:
                packet.stream = video
                container.mux(packet)
        if audio is not None:
            _write_audio(container, audio, tone(len(film) / float(FILM_RATE)), "stereo")
    return path


@pytest.mark.parametrize("name", ["dvd.vob", "broadcast.ts"])
def test_soft_telecined_film_is_read_at_its_own_rate(instants, tmp_path, name):
    """Soft telecine: the decoder gives the film's 24 frames, but the container times them three fields and two in
    turn. Read at those times, the output had a variable rate ("24.186 fps") that kept the 3:2 judder, its last frame
    cut short (0.984 s for the film's 1.001); read at the film's rate, it is 23.976 progressive, every frame within
    half a field of its time, the sound where it was. Asked for `film`, nothing is decimated: it is film already."""
    film = instants[:24]
    source = soft_telecine(tmp_path / name, film, sound=name.endswith(".vob"))
    probed = probe(source)
    video = probed.video
    assert (video.frames, video.fps, video.cfr, video.pulldown) == (24, FILM_RATE, True, True)
    line = probed.describe()[1]  # (with its start where the file has sound: the DVD's, not the broadcast's)
    assert "24 frames at 23.976 fps (constant), 1.001 s" in line and ", film with 3:2 pulldown flags" in line, line
    assert video.duration == pytest.approx(24 / FILM_RATE, abs=1e-6)

    for deinterlace in ("frame", "film"):
        output = tmp_path / f"{deinterlace}.mp4"
        options = replace(FAST, deinterlace=deinterlace)
        result = upscale_file(source, output, LanczosUpscaler(), options)
        written = result.written
        assert (written.video.frames, written.video.fps, written.video.cfr) == (24, FILM_RATE, True)
        assert times(output) == pytest.approx([index / FILM_RATE for index in range(24)], abs=1e-3)
        for audio, heard in zip(written.audio, probed.audio, strict=True):  # the sound where it was
            assert written.video.start - audio.start == pytest.approx(video.start - heard.start, abs=1e-3)
        assert any("3:2 pulldown flags (soft telecine" in note and "output is 23.976 frames/s progressive" in note
                   for note in result.notes), result.notes  # fmt: skip
        assert not any("variable frame rate" in note or "deinterlaced" in note for note in result.notes), result.notes
    assert len(written.audio) == name.endswith(".vob")
    assert ("deinterlace=film was asked, but the source is film already, its own frames read at 23.976 frames/s "
            "(3:2 pulldown flags): the output keeps the source's frame rate") in result.notes  # fmt: skip


def test_a_telecined_source_read_frame_for_frame_says_film_would_give_its_frames_back(instants, tmp_path):
    """Read at the frame rate, a telecined film keeps two frames in every five that mix two film frames: the job's notes
    point to `deinterlace=film`. Genuinely interlaced video (every field its own instant) gets no such note."""
    hint = "the source looks like telecined film"
    telecined = encode(tmp_path / "film.ts", telecine(instants[4:24], "bff"), "h264", "bff", NTSC)
    result = upscale_file(telecined, tmp_path / "film.mp4", LanczosUpscaler(), FAST)
    assert result.written.video.frames == 25 and any(note.startswith(hint) for note in result.notes), result.notes
    video = encode(tmp_path / "video.ts", weave(instants, "tff"), "h264", "tff", NTSC)
    result = upscale_file(video, tmp_path / "video.mp4", LanczosUpscaler(), FAST)
    assert any("deinterlaced with bwdif" in note for note in result.notes), result.notes
    assert not any(note.startswith(hint) for note in result.notes), result.notes
