"""Real recordings of Chromium's `MediaRecorder` (tests/media/README.md), as a web app uploads a user's camera or
screen, each once upscaled wrongly: Chromium's `video/mp4` (VP9 in a fragmented MP4) and a canvas's VP8 WebM."""

from __future__ import annotations

import hashlib
from fractions import Fraction
from pathlib import Path

import av
import pytest

from worker.media.errors import InputEmpty
from worker.media.probe import probe
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.request import SRRequest
from worker.upscale import UpscaleOptions, upscale_file

MEDIA = Path(__file__).parent / "media" / "chromium"
FAST = UpscaleOptions(request=SRRequest(scale=2), preset="ultrafast")
SHA256 = {
    "mediarecorder_no_frames.webm": "34625a59ca017ae414573bcb4a21464514f695d9806955fa676098939005795c",
    "mediarecorder_vp8_vfr.webm": "02ff3c74f46ac5d29c4a1690bf2187940f1bb809bd8e6d0d903c5e5c0952e840",
    "mediarecorder_vp9_1.mp4": "3f1336f232668323115116a252f236363550fe222be744bbd1729361c6cee610",
    "mediarecorder_vp9_2.mp4": "93d6b5a04086e08374c5d411416f87b86cc45a77925aef350f44e981f2e9b778",
}


def test_the_files_are_the_ones_recorded():
    assert {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in MEDIA.iterdir()} == SHA256


def _timeline(path: Path) -> tuple[list[Fraction], Fraction | None]:
    """Each frame's time as FFmpeg shows it, and the video track's end (None: a WebM without a duration)."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        times = [frame.pts * stream.time_base for frame in container.decode(stream)]
        end = None if stream.duration is None else (stream.start_time + stream.duration) * stream.time_base
        return times, end


@pytest.mark.parametrize("name", ["mediarecorder_vp9_1.mp4", "mediarecorder_vp9_2.mp4"])
def test_chromiums_mp4_keeps_every_frame_and_its_last_frames_time(name, tmp_path):
    """FFmpeg gives VP9 packets in an MP4 durations of 0 or 1 tick, not their samples': the last frame lasted a tick,
    and the output's edit list (in milliseconds) cut it off. Half of Chromium's recordings then failed the read-back
    (`output_mismatch`: 57 frames, 58 expected), the rest came back a frame's time short."""
    source = MEDIA / name
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    (times, end), (out_times, out_end) = _timeline(source), _timeline(output)
    assert out_times == times and out_end == end, (len(out_times), len(times), out_end, end)


def test_a_canvas_recordings_lossy_alpha_is_no_transparency_to_tell(tmp_path):
    """Chromium keeps a canvas's alpha channel, and VP8's lossy alpha rounds the opaque picture's first keyframes to
    246-254: every recording's notes said it had transparent pixels (5 of its 39 frames). Its irregular frame times
    (`requestFrame()` at 20 to 400 ms) are kept."""
    source = MEDIA / "mediarecorder_vp8_vfr.webm"
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)
    assert not any("transparent" in note for note in result.notes), result.notes
    (times, _), (out_times, _) = _timeline(source), _timeline(output)
    assert len(out_times) == len(times) == 39 and max(abs(a - b) for a, b in zip(times, out_times)) < Fraction(1, 1000)


def test_a_recording_stopped_before_its_first_frame_is_said_to_be_empty():
    """Chromium writes the EBML header and zeros (110 bytes) for a recording stopped before a frame was drawn: it was
    `input_unreadable`, "not a video file FFmpeg can read (End of file)"."""
    with pytest.raises(InputEmpty, match="a recording stopped before its first frame"):
        probe(MEDIA / "mediarecorder_no_frames.webm")
