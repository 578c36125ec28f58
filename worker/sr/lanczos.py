"""Classical Lanczos resampling behind the engine's interface: any scale, CPU only, no weights.

For machines without a GPU, previews, and as the quality baseline the diffusion model has to beat.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter

import numpy as np
import PIL
import torch
from PIL import Image

from worker.errors import Cancelled, InvalidRequest
from worker.frames import unit
from worker.sr import tiling
from worker.sr.request import LOSSLESS, FrameSink, Progress, RunInfo, SRRequest


class LanczosUpscaler:
    devices = [torch.device("cpu")]
    default_steps = None  # a resampling filter: no denoising steps
    qualities = (LOSSLESS,)  # no faster path: a `high` job runs, and says, `lossless`

    def signature(self, request: SRRequest) -> str:
        """What decides the bits beyond the request (`SREngine.signature`): Pillow's resampling."""
        return f"pillow {PIL.__version__}"

    def output_size(self, height: int, width: int, scale: float) -> tuple[int, int]:
        return tiling.output_size(height, width, scale)

    def upscale(
        self,
        video: torch.Tensor,
        request: SRRequest,
        sink: FrameSink,
        progress: Callable[[Progress], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> RunInfo:
        if request.scale <= 0:
            raise InvalidRequest(f"scale must be positive, got {request.scale}")
        num_frames, _, height, width = video.shape
        out_height, out_width = self.output_size(height, width, request.scale)
        started = perf_counter()
        for index, frame in enumerate(video):
            if cancelled is not None and cancelled():
                raise Cancelled("the job was cancelled")
            # Resample each channel as 32-bit float ("F" mode) so no precision is lost before the encoder.
            channels = [
                np.asarray(Image.fromarray(channel.numpy(), mode="F").resize((out_width, out_height), Image.LANCZOS))
                for channel in unit(frame).float()
            ]
            sink(torch.from_numpy(np.stack(channels)).clamp(0, 1).unsqueeze(0))
            if progress is not None:
                progress(Progress("resample", index + 1, num_frames))
        return RunInfo(
            input_size=(height, width),
            output_size=(out_height, out_width),
            frames=num_frames,
            padded_input=(num_frames, height, width),
            tiles=1,
            devices=["cpu"],
            stage_seconds={"denoise_decode": perf_counter() - started},  # as the engine names its call's span
        )
