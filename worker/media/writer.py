"""Encode frames into an MP4 as they arrive, so encoding overlaps the engine's work."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from types import TracebackType

import av
import torch


class Mp4Writer:
    """H.264 (yuv420p, +faststart) MP4 writer; `write` takes (n, 3, H, W) float frames in [0, 1]."""

    def __init__(self, path: str | Path, fps: Fraction, size: tuple[int, int], crf: int = 18, preset: str = "medium") -> None:
        height, width = size
        self.path = Path(path)
        self.container = av.open(str(self.path), mode="w", options={"movflags": "+faststart"})
        self.stream = self.container.add_stream("libx264", rate=fps, options={"crf": str(crf), "preset": preset})
        self.stream.width, self.stream.height, self.stream.pix_fmt = width, height, "yuv420p"
        self.frames = 0

    def write(self, frames: torch.Tensor) -> None:
        # Quantise where the frames are (a GPU moves a quarter of the bytes to the host this way).
        pixels = (frames * 255.0).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        for pixel in pixels:
            self.container.mux(self.stream.encode(av.VideoFrame.from_ndarray(pixel, format="rgb24")))
            self.frames += 1

    def close(self) -> None:
        self.container.mux(self.stream.encode())
        self.container.close()

    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:  # never leave a partial output behind
            self.container.close()
            self.path.unlink(missing_ok=True)
