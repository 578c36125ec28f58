"""What the service accepts. The probe checks each limit as soon as the file can tell it, before any GPU work."""

from __future__ import annotations

from dataclasses import dataclass

from worker.media.errors import OutputTooLarge


@dataclass(frozen=True)
class Limits:
    # 4K input: the model's whole-video VAE encode stays under its 2e9-element convolution limit up to about there.
    max_pixels: int | None = 3840 * 2160
    max_frames: int | None = 216_000  # one hour at 60 fps
    max_seconds: float | None = 3600.0
    max_bytes: int | None = 16 * 2**30
    # One frame is a still image, not a video; set 1 to accept it anyway.
    min_frames: int = 2
    # Above this the MP4 written back loses frames (its time base cannot hold the rate): refused up front instead.
    max_fps: float | None = 1000.0
    # What the model computes (before any downscale to a target): pixels per output frame, and megapixel-frames per
    # job (time and storage). The service sets them from its settings and the job's key (storage/config.py).
    max_output_pixels: int | None = 7680 * 4320
    max_output_megapixel_frames: float | None = 150_000.0

    @classmethod
    def none(cls) -> Limits:
        """No limits: for probing our own outputs."""
        return cls(
            max_pixels=None,
            max_frames=None,
            max_seconds=None,
            max_bytes=None,
            max_fps=None,
            min_frames=1,
            max_output_pixels=None,
            max_output_megapixel_frames=None,
        )

    def check_output(self, height: int, width: int, frames: int) -> float:
        """The output's megapixel-frames; raises `OutputTooLarge` naming the limit it passes."""
        pixels, cost = height * width, height * width * frames / 1e6
        if self.max_output_pixels is not None and pixels > self.max_output_pixels:
            raise OutputTooLarge(
                f"the output would be {width}x{height} ({pixels / 1e6:.1f} megapixels a frame); the limit "
                f"(max_output_pixels) is {self.max_output_pixels / 1e6:.1f} megapixels: pick a smaller scale or a "
                "target resolution"
            )
        if self.max_output_megapixel_frames is not None and cost > self.max_output_megapixel_frames:
            raise OutputTooLarge(
                f"the output would be {cost:,.0f} megapixel-frames ({frames} frames of {width}x{height}); the limit "
                f"(max_output_megapixel_frames) is {self.max_output_megapixel_frames:,.0f}: send a shorter clip"
            )
        return cost
