"""Decode a video file into the engine's input layout."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch


@dataclass(frozen=True)
class Clip:
    frames: torch.Tensor  # (F, 3, H, W) float32 in [0, 1]
    fps: Fraction


def read_clip(path: str | Path) -> Clip:
    """All frames of the first video stream, as RGB."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = stream.average_rate or stream.guessed_rate or Fraction(24)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).float() / 255.0
    return Clip(frames=video, fps=Fraction(fps))
