"""What the service accepts. The probe checks each limit as soon as the file can tell it, before any GPU work."""

from __future__ import annotations

from dataclasses import dataclass


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

    @classmethod
    def none(cls) -> Limits:
        """No limits: for probing our own outputs."""
        return cls(max_pixels=None, max_frames=None, max_seconds=None, max_bytes=None, max_fps=None, min_frames=1)
