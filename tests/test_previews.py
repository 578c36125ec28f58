"""The thumbnail and sprite sheet: taken from the frames as they are encoded, not from a second decode of the output."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from PIL import Image

from worker.media.previews import PreviewFrames, make_previews
from worker.media.synthetic import write_clip
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.request import SRRequest
from worker.tasks import _previews
from worker.upscale import UpscaleOptions, upscale_file


def _pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)


def test_the_previews_need_no_second_decode_of_the_output_and_show_the_same_frames(tmp_path):
    """The job's tail used to decode the whole output again for them (W1: 121 frames at 1536x1024, most of its
    1.2-1.6 s of upload and complete on the GPU machine). The frames taken as they were encoded make the same
    pictures (the encoder's input against its lossy output): sizes exact, every pixel close, and each cell closer to
    the decoded one at its place than to any other cell of the sheet (the right frames, in order)."""
    source = write_clip(tmp_path / "in.mp4", 29, (64, 96))
    result = upscale_file(source, tmp_path / "out.mp4", LanczosUpscaler(), UpscaleOptions(request=SRRequest(scale=2)))
    (tmp_path / "decoded").mkdir()
    decoded = make_previews(result.output, result.written.video.frames, tmp_path / "decoded")

    result.output.unlink()  # no file to decode: the frames taken are all the tail has
    (tmp_path / "taken").mkdir()
    made = _previews("job", result, tmp_path / "taken")
    assert set(made) == {"thumbnail", "spritesheet"}

    for variant, path in made.items():
        taken, reference = _pixels(path), _pixels(getattr(decoded, variant))
        assert taken.shape == reference.shape, variant
        assert np.abs(taken - reference).mean() < 4, variant  # JPEG and x264 at crf 18: a few levels, no more
    sheet, reference = _pixels(made["spritesheet"]), _pixels(decoded.spritesheet)
    assert decoded.sprite_frames == 25
    cell_h, cell_w = sheet.shape[0] // 5, sheet.shape[1] // 5
    cells = [sheet[r * cell_h : (r + 1) * cell_h, c * cell_w : (c + 1) * cell_w] for r in range(5) for c in range(5)]
    for n, cell in enumerate(cells):
        r, c = divmod(n, 5)
        own = reference[r * cell_h : (r + 1) * cell_h, c * cell_w : (c + 1) * cell_w]
        nearest = min(range(25), key=lambda m: np.abs(cells[m] - own).mean())
        assert nearest == n, f"cell {n} looks like the decoded sheet's cell {nearest}"


def test_a_frame_that_could_not_be_taken_falls_back_to_decoding_the_output(tmp_path):
    """A preview never fails the encoding: a frame it cannot take (here, not RGB) leaves it incomplete, and the tail
    decodes the output as before."""
    source = write_clip(tmp_path / "in.mp4", 9, (64, 96))
    result = upscale_file(source, tmp_path / "out.mp4", LanczosUpscaler(), UpscaleOptions(request=SRRequest(scale=2)))
    assert result.previews is not None and result.previews.complete()
    broken = PreviewFrames(result.written.video.frames)
    broken.take(0, np.zeros((4, 4, 7), np.uint8))  # a frame PIL cannot read as RGB
    assert not broken.complete() and broken.error is not None

    made = _previews("job", replace(result, previews=broken), tmp_path)
    assert Image.open(made["thumbnail"]).size == (192, 128)  # decoded from the output: the middle frame, full size
