"""A generated test clip: moving shapes over a gradient, so motion and detail are visible after upscaling."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from worker.media.writer import Mp4Writer


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


def write_clip(path: str | Path, num_frames: int = 17, size: tuple[int, int] = (64, 96), fps: Fraction = Fraction(24)) -> Path:
    with Mp4Writer(path, fps, size, crf=12) as writer:
        writer.write(pattern(num_frames, *size))
    return Path(path)
