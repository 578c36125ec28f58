"""Per-frame PSNR and SSIM of one output against another: how far a `quality=high` run lands from `lossless`
(bench/quality.py, bench/bench.py's quality phases)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def psnr_per_frame(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(F, 3, H, W) in [0, 1] -> (F,) dB; identical frames count as 99 dB."""
    mse = (a.float() - b.float()).pow(2).flatten(1).mean(1)
    return torch.where(mse > 0, 10 * torch.log10(1 / mse.clamp_min(1e-20)), torch.full_like(mse, 99.0))


def ssim_per_frame(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(F, 3, H, W) in [0, 1] -> (F,) SSIM (Wang et al. 2004: 11-tap Gaussian window, sigma 1.5, K1 0.01, K2 0.03),
    averaged over channels and pixels. Written out here: a dozen lines, against a dependency the GPU image lacks."""
    taps = torch.arange(11, dtype=torch.float32, device=a.device) - 5
    kernel = torch.exp(-(taps**2) / (2 * 1.5**2))
    kernel = (kernel / kernel.sum()).reshape(1, 1, 1, 11).expand(3, 1, 1, 11)

    def blur(x: torch.Tensor) -> torch.Tensor:  # separable, valid region only
        return F.conv2d(F.conv2d(x, kernel, groups=3), kernel.transpose(2, 3), groups=3)

    a, b = a.float(), b.float()
    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b, cov = blur(a * a) - mu_a**2, blur(b * b) - mu_b**2, blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01**2, 0.03**2
    ssim = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return ssim.flatten(1).mean(1)


def summary(output: torch.Tensor, baseline: torch.Tensor) -> dict[str, float]:
    """Per-frame PSNR and SSIM of `output` against `baseline`: mean and worst frame (SSIM on `output`'s device)."""
    baseline = baseline.to(output.device)  # the bench keeps its first output on the host, a later one may be on the GPU
    psnr = psnr_per_frame(output, baseline)
    similarity = ssim_per_frame(output, baseline).cpu()
    return {
        "psnr_db_mean": round(psnr.mean().item(), 2),
        "psnr_db_worst_frame": round(psnr.min().item(), 2),
        "ssim_mean": round(similarity.mean().item(), 5),
        "ssim_worst_frame": round(similarity.min().item(), 5),
    }
