"""An upscaler whose output is resized to a target resolution: the engine (or any upscaler) composed with media's
frame resizing, so that media knows frames and sizes, not the model."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import torch

from worker.media.resize import Target, resize_frames
from worker.sr.request import FrameSink, Progress, RunInfo, SRRequest


class Resized:
    """An upscaler whose output is resized to `target` (same interface as the upscaler it wraps), for a video of
    pixels `sar` wide: the target boxes the picture as displayed."""

    def __init__(self, upscaler, target: Target, sar: Fraction = Fraction(1)) -> None:
        self.upscaler, self.target, self.sar = upscaler, target, sar
        self.devices = upscaler.devices

    def output_size(self, height: int, width: int, scale: float) -> tuple[int, int]:
        return self.target.size(*self.upscaler.output_size(height, width, scale), self.sar)

    def upscale(
        self,
        video: torch.Tensor,
        request: SRRequest,
        sink: FrameSink,
        progress: Callable[[Progress], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> RunInfo:
        _, _, height, width = video.shape
        size = self.output_size(height, width, request.scale)

        def resize(frames: torch.Tensor) -> None:
            sink(resize_frames(frames, size))

        info = self.upscaler.upscale(video, request, resize, progress, cancelled)
        info.output_size = size
        return info
