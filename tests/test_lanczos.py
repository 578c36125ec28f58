from __future__ import annotations

import torch

from tests.conftest import run
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.request import SRRequest


def test_lanczos_any_scale_exact_size_and_flat_stays_flat():
    video = torch.full((3, 3, 21, 33), 0.25)
    out = run(LanczosUpscaler(), video, SRRequest(scale=2.25))
    assert out.shape == (3, 3, 48, 74)  # 2 x round(1.125 x size), like the SR engine
    assert (out - 0.25).abs().max() < 1e-5


def test_lanczos_keeps_detail_better_than_nearest():
    """Downscale a smooth pattern, upscale it back: Lanczos beats pixel repetition."""
    y, x = torch.meshgrid(torch.linspace(0, 6, 64), torch.linspace(0, 6, 96), indexing="ij")
    truth = (0.5 + 0.4 * torch.sin(x) * torch.cos(y)).expand(1, 3, 64, 96)
    small = torch.nn.functional.interpolate(truth, scale_factor=0.5, mode="area")
    lanczos = run(LanczosUpscaler(), small, SRRequest(scale=2))
    nearest = torch.nn.functional.interpolate(small, scale_factor=2, mode="nearest")
    assert (lanczos - truth).pow(2).mean() < 0.5 * (nearest - truth).pow(2).mean()
