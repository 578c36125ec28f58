"""The frames upscalers take and emit.

In: (F, 3, H, W), float in [0, 1] or integer RGB at full scale (uint8, or uint16 for deeper sources) as the reader
decodes them; `unit` makes either the float an upscaler computes on, where it computes. Out: (n, 3, H, W) float32 in
[0, 1], on the CPU; `quantise` is the one place they become integers (8-bit, or 16-bit where the output is deeper):
the encoder and the window store must round identically, or a resumed job would not reproduce an uninterrupted one.
"""

from __future__ import annotations

import torch

FULL_SCALE = {torch.uint8: 255.0, torch.uint16: 65535.0}


def unit(video: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """`video` as float in [0, 1] on `device` (default: its own), same shape. Float frames as they are; integer ones
    cross as integers (a quarter of float32's bytes at 8 bits) and become float32 there, contiguous, x / full scale
    correctly rounded: the same bits on any device, and as the CPU made them before frames crossed as integers."""
    if video.is_floating_point():
        return video.to(device)
    if video.dtype not in FULL_SCALE:
        raise TypeError(f"frames must be float in [0, 1], uint8 or uint16, got {video.dtype}")  # only code makes them
    # `to` keeps a dense tensor's strides: frames stacked (F, H, W, 3) and viewed as (F, 3, H, W) cross in one copy,
    # and the permute happens in the conversion on the device
    pixels = video.to(device)
    values = torch.empty(pixels.shape, dtype=torch.float32, device=pixels.device).copy_(pixels)
    # Divided by a tensor on the device: CUDA divides by a CPU scalar through its reciprocal, which rounds 126 of
    # the 256 8-bit values otherwise
    return values.div_(torch.full((), FULL_SCALE[video.dtype], device=pixels.device))


def quantise(frames: torch.Tensor, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """(n, H, W, 3) `dtype` (uint8, or uint16 at full 16-bit scale for a 10-bit output: 8 bits would band its
    gradients) on the frames' device, contiguous: the encoder's RGB-to-YUV conversion reads a strided frame at a
    third of the speed."""
    scale = FULL_SCALE[dtype]
    return (frames * scale).round_().clamp_(0, scale).to(dtype).permute(0, 2, 3, 1).contiguous()


def dequantise(pixels: torch.Tensor) -> torch.Tensor:
    """The inverse, at the pixels' own scale: `quantise(dequantise(p), p.dtype) == p` exactly."""
    return pixels.permute(0, 3, 1, 2).float() / FULL_SCALE[pixels.dtype]
