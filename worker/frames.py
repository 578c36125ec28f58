"""The frames every upscaler emits: (n, 3, H, W) float32 in [0, 1], on the CPU.

`quantise` is the one place they become 8-bit: the encoder and the window store must round identically, or a
resumed job would not reproduce an uninterrupted one.
"""

from __future__ import annotations

import torch


def quantise(frames: torch.Tensor) -> torch.Tensor:
    """(n, H, W, 3) uint8 on the frames' device, contiguous: the encoder's RGB-to-YUV conversion reads a strided
    frame at a third of the speed."""
    return (frames * 255.0).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def dequantise(pixels: torch.Tensor) -> torch.Tensor:
    """The inverse on 8-bit values: `quantise(dequantise(p)) == p` exactly."""
    return pixels.permute(0, 3, 1, 2).float() / 255.0
