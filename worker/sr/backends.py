"""Pick an upscaler by name: `lanczos`, or a Kandinsky 6 SR checkpoint (directory or hub id)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from worker.sr.engine import FrameSink, Progress, RunInfo, SREngine, SRRequest
from worker.sr.lanczos import LanczosUpscaler


class Upscaler(Protocol):
    devices: list[torch.device]

    def output_size(self, height: int, width: int, scale: float) -> tuple[int, int]: ...

    def upscale(
        self,
        video: torch.Tensor,
        request: SRRequest,
        sink: FrameSink,
        progress: Callable[[Progress], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> RunInfo: ...


def open_upscaler(model: str, devices: Sequence[str] = ("cpu",)) -> Upscaler:
    if model == "lanczos":
        return LanczosUpscaler()
    return SREngine.from_pretrained(model, devices)
