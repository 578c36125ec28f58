"""Real files nobody here made, from androidx/media's test assets (tests/media/README.md), each once refused, crashed
on or upscaled wrongly: an iPhone-style spatial video, a VVC file, encrypted MP4 and WebM, WebVTT and SSA subtitles
as mkvmerge writes them. Each through the same path a job takes (`upscale_file`, the lanczos model)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import av
import numpy as np
import pytest

from worker.media.errors import InputEncrypted
from worker.media.probe import probe
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.request import SRRequest
from worker.upscale import UpscaleOptions, upscale_file

MEDIA = Path(__file__).parent / "media" / "androidx"
FAST = UpscaleOptions(request=SRRequest(scale=2), preset="ultrafast")
SHA256 = {
    "sample_fragmented_clearkey.mp4": "aef0ce11c2eeefd6dad1fe8e623308318c84ac43f0ff3098d15ede0db840ff47",
    "sample_vvc.mp4": "f8ed82dffabd10717a9659d48d3ea59c33eccf510e2b0ca6e0b8cedac796d47a",
    "sample_with_overlapping_ssa_subtitles.mkv": "a3fcd6a6208d6e2a85523b35cac47bea460d892384ecbef3223816e09d4080ab",
    "sample_with_ssa_subtitles.mkv": "678ff3a42e7a0b4182589420fd7f87435241eb54a3e91cb79404598db228e466",
    "sample_with_vtt_subtitles.mkv": "936acccd561455293d8963593b7560a8d8b42ba07d6ead123efbf76b49bac0fd",
    "subsample_encrypted_altref.webm": "0fca95ac5357c785f3809341cd3249c85bea1cdd4420a0c92971474ffd15ef56",
    "water_180_mvhevc_5frames.mov": "fe275d6144fc515503c38d958b9571a081ab9c793521e1ce1201bb590d60122a",
}


def test_the_files_are_the_ones_fetched():
    assert {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in MEDIA.iterdir()} == SHA256


def test_a_spatial_video_is_upscaled_from_its_first_view_and_says_so(tmp_path):
    """MV-HEVC, as an iPhone 15 Pro or a Vision Pro records spatial video: FFmpeg 8 marks each frame with its view,
    a side data type PyAV 18 has no name for, and reading any frame's side data raised ValueError (internal_error)."""
    source = MEDIA / "water_180_mvhevc_5frames.mov"
    info = probe(source)
    assert info.video.stereo and "stereo (MV-HEVC: its first view is read)" in info.describe()[1]
    output = tmp_path / "out.mp4"
    result = upscale_file(source, output, LanczosUpscaler(), FAST)
    assert (result.written.video.frames, result.written.video.width, result.written.video.height) == (5, 3868, 4320)
    assert any(note.startswith("the source is stereoscopic (MV-HEVC") for note in result.notes), result.notes


def test_a_vvc_file_whose_keyframes_come_23_frames_early_is_upscaled_in_order(tmp_path):
    """VVenC's open GOPs decode each keyframe before 23 frames shown ahead of it: the probe took frames decoded more
    than 16 after one shown later for a clock that starts over, and refused the file as two joined recordings."""
    source = MEDIA / "sample_vvc.mp4"
    output = tmp_path / "out.mp4"
    upscale_file(source, output, LanczosUpscaler(), FAST)
    with av.open(str(source)) as container:  # the oracle: every frame, in the order FFmpeg shows them
        frames = [frame.to_ndarray(format="rgb24").astype(float) for frame in container.decode(video=0)]
    with av.open(str(output)) as container:
        decoded = list(container.decode(video=0))
        times = [frame.time for frame in decoded]
        back = [frame.reformat(width=320, height=180).to_ndarray(format="rgb24").astype(float) for frame in decoded]
    assert len(back) == len(frames) == 120 and np.allclose(np.diff(times), 1 / 24, atol=1e-3)
    # each frame is its own, not its neighbour's: in order, not shuffled within a GOP
    psnr = [_psnr(a, b) for a, b in zip(frames, back, strict=True)]
    shifted = [_psnr(a, b) for a, b in zip(frames[1:], back[:-1], strict=False)]
    assert min(psnr) > 35 and np.mean(psnr) > np.mean(shifted) + 5, (min(psnr), np.mean(psnr), np.mean(shifted))


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    return 10 * np.log10(255**2 / max(float(np.mean((a - b) ** 2)), 1e-6))


@pytest.mark.parametrize(
    "name, scheme",
    [("sample_fragmented_clearkey.mp4", "Common Encryption"), ("subsample_encrypted_altref.webm", "WebM encryption")],
)
def test_encrypted_files_ffmpeg_cannot_read_are_refused_as_encrypted(name, scheme):
    """FFmpeg fails on these before any packet could say it is encrypted: they were `input_unreadable` ("not a video
    file") and `input_corrupt`; their headers say DRM (`encv` and `pssh` boxes, a WebM's ContentEncryption)."""
    with pytest.raises(InputEncrypted) as refused:
        probe(MEDIA / name)
    assert refused.value.code == "input_encrypted" and f"is encrypted (DRM: {scheme})" in refused.value.message


def _cues(path: Path) -> list[bytes]:
    """The output's mov_text samples as written (a 2-byte length, the text, then any style boxes)."""
    with av.open(str(path)) as container:
        return [bytes(packet) for packet in container.demux(container.streams.subtitles[0]) if packet.size > 2]


def test_webvtt_cues_as_mkvmerge_writes_them_are_kept(tmp_path):
    """`S_TEXT/WEBVTT`, the CodecID mkvmerge writes (this FFmpeg maps only `D_WEBVTT/*`): no codec, so the cues were
    left out as "unknown, a subtitle format MP4's muxer cannot carry"."""
    output = tmp_path / "out.mp4"
    result = upscale_file(MEDIA / "sample_with_vtt_subtitles.mkv", output, LanczosUpscaler(), FAST)
    assert any(c.kind == "subtitle" and c.action == "mov_text" and c.detail == "webvtt" for c in result.carried)
    assert _cues(output) == [b"\x00\x1bThis is the first subtitle."]


@pytest.mark.parametrize("name", ["sample_with_ssa_subtitles.mkv", "sample_with_overlapping_ssa_subtitles.mkv"])
def test_ssa_cues_of_a_style_the_header_lacks_stay_visible(name, tmp_path):
    """A cue naming a style its header does not define (`Default ` with a space), or a header with no styles at all:
    FFmpeg's mov_text encoder gave such a cue a style record of font size 0 and a transparent colour (hidden)."""
    output = tmp_path / "out.mp4"
    upscale_file(MEDIA / name, output, LanczosUpscaler(), FAST)
    cues = _cues(output)
    assert cues and all(b"subtitle" in cue for cue in cues)
    for cue in cues:
        at = 2 + struct.unpack(">H", cue[:2])[0]
        while at + 8 <= len(cue):  # the sample's boxes: a `styl` holds records of 12 bytes after a 2-byte count
            size, kind = struct.unpack_from(">I4s", cue, at)
            if kind == b"styl":
                for record in range(struct.unpack_from(">H", cue, at + 8)[0]):
                    font_size, rgba = struct.unpack_from(">B4s", cue, at + 10 + 12 * record + 7)
                    assert font_size > 0 and rgba[3] > 0, cue
            at += size
