"""A target resolution after super-resolution, like SGLang's `sr_target_resolution`: downscale only.

`fit` keeps the aspect ratio inside the target box, as the picture is displayed: a video of non-square pixels keeps
them and is boxed at its displayed width (a 16:9 DVD's 720 pixels are shown 1024 wide); `exact` resizes to the box
itself, in square pixels, so that it is the size shown. Named targets follow the video's orientation (`hd` is
1280x720 for landscape, 720x1280 for portrait); `WxH` is taken as written. Sizes are even, as 4:2:0 video needs,
and never pass the box (an odd side gets the even size below it).
The resize runs on the upscaler's frames in float, on its device, before quantisation (worker/resized.py wraps an
upscaler with it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F

from worker.errors import InvalidRequest

NAMED = {"hd": (1280, 720), "fullhd": (1920, 1080), "2k": (2560, 1440)}  # width, height
MODES = ("fit", "exact")


@dataclass(frozen=True)
class Target:
    width: int
    height: int
    mode: str = "fit"
    named: bool = False  # follows the video's orientation

    @classmethod
    def parse(cls, text: str, mode: str = "fit") -> Target:
        if mode not in MODES:
            raise InvalidRequest(f"resize mode must be one of {MODES}, got {mode!r}")
        key = text.strip().lower()
        if key in NAMED:
            return cls(*NAMED[key], mode=mode, named=True)
        match = re.fullmatch(r"(\d+)x(\d+)", key)
        if not match or min(int(match[1]), int(match[2])) < 2:
            raise InvalidRequest(f"target resolution must be one of {', '.join(NAMED)} or WxH, got {text!r}")
        return cls(int(match[1]), int(match[2]), mode=mode)

    def size(self, height: int, width: int, sar: Fraction = Fraction(1)) -> tuple[int, int]:
        """(height, width) for an upscaled `height` x `width` video of pixels `sar` wide (width : height); never
        larger than it."""
        box_width, box_height = self.width, self.height
        shown = width * sar  # the width players display
        if self.named and (height > shown) != (box_height > box_width):
            box_width, box_height = box_height, box_width
        if self.mode == "exact":
            if box_width > width or box_height > height:
                raise InvalidRequest(
                    f"target {box_width}x{box_height} is larger than the upscaled {width}x{height}: "
                    "the target resolution only downscales (use a larger scale or the fit mode)"
                )
            return _even_within(box_height), _even_within(box_width)
        if shown <= box_width and height <= box_height:
            return height, width
        # Into the largest even box inside it: the nearest even size then never passes it, where the box itself could
        # be passed by a pixel (a side of 4k + 3: 299 rounded to 300) or by a non-square pixel's share
        ratio = min(1.0, _even_within(box_width / sar) / width, _even_within(box_height) / height)
        return _even(height * ratio), _even(width * ratio)

    def pixel_aspect(self, sar: Fraction) -> Fraction:
        """The output's pixel shape for a video of pixels `sar` wide: `fit` keeps them; `exact` fills the box as it is
        displayed, in square pixels (kept, a 16:9 DVD's 64:45 showed an exact 1280x720 1820 pixels wide)."""
        return sar if self.mode == "fit" else Fraction(1)


def _even(size: float) -> int:
    return max(2, 2 * round(size / 2))


def _even_within(size: float) -> int:
    """The largest even size within `size` (at least 2)."""
    return max(2, 2 * math.floor(size / 2))


def resize_frames(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(n, 3, H, W) frames in [0, 1] at `size` (height, width); as they are when they have it already."""
    if tuple(frames.shape[-2:]) == size:
        return frames
    # Antialiased bicubic: a plain bicubic downscale aliases fine detail the model just made.
    return F.interpolate(frames, size=size, mode="bicubic", antialias=True, align_corners=False).clamp_(0, 1)
