"""Kept windows' frames packed as FFV1 (worker/media/lossless.py): the very same bytes back, smaller for real video."""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch

from worker.frames import quantise
from worker.media.lossless import compress, expand
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.request import SRRequest

CITY = "kivy-cityCC0.mpg"  # 720x405 MPEG-1 of a city street: detail everywhere


def upscaled(path, frames: int, dtype: torch.dtype) -> np.ndarray:
    """The clip's first `frames` frames upscaled x2 by lanczos, quantised as the encoder (and the kept window) gets
    them: (n, H, W, 3)."""
    with av.open(str(path)) as container:
        video = [frame.to_ndarray(format="rgb24") for _, frame in zip(range(frames), container.decode(video=0))]
    out: list[torch.Tensor] = []
    clip = torch.from_numpy(np.stack(video)).permute(0, 3, 1, 2)
    LanczosUpscaler().upscale(clip, SRRequest(scale=2), lambda chunk: out.append(quantise(chunk, dtype)))
    return torch.cat(out).numpy()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16], ids=["8-bit", "16-bit"])
def test_a_real_window_comes_back_byte_for_byte_and_smaller(dtype, corpus_cache, tmp_path):
    frames = upscaled(corpus_cache / CITY, 3, dtype)
    raw, packed, back = tmp_path / "w.u8", tmp_path / "w.mkv", tmp_path / "back.u8"
    raw.write_bytes(frames.tobytes())
    compress(raw, frames.shape, frames.dtype.name, packed)
    expand(packed, frames.shape, frames.dtype.name, back)
    ratio = raw.stat().st_size / packed.stat().st_size
    print(f"FIGURE lossless {frames.dtype.name} {frames.shape}: {ratio:.2f} x smaller")
    assert back.read_bytes() == raw.read_bytes()
    assert ratio > 1.3  # 3.4 at 8 bits, 1.7 at 16 (their low bits are lanczos' rounding)


def test_noise_comes_back_byte_for_byte_and_a_file_of_other_frames_is_refused(tmp_path):
    frames = np.random.default_rng(0).integers(0, 256, (5, 17, 35, 3), dtype=np.uint8)  # odd sizes, no structure
    raw, packed, back = tmp_path / "w.u8", tmp_path / "w.mkv", tmp_path / "back.u8"
    raw.write_bytes(frames.tobytes())
    compress(raw, frames.shape, "uint8", packed)
    expand(packed, frames.shape, "uint8", back)
    assert back.read_bytes() == raw.read_bytes()
    for other in ((4, 17, 35, 3), (6, 17, 35, 3), (5, 17, 37, 3)):  # fewer frames, more, another size
        with pytest.raises(ValueError):
            expand(packed, other, "uint8", back)
