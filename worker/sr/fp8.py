"""FP8 linears for the `high` quality tier: `torch._scaled_mm` in float8_e4m3fn with one scale per activation row and
one per weight output channel (row-wise scaling), the output in the layer's own dtype.

The weights are quantised once per weight tensor and device, and kept (`Fp8Linear.of`); activations are quantised on
every call. The same code runs on the CPU (torch's CPU `_scaled_mm` takes float8 with row-wise scales), so CI checks
the numerics the GPU runs.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448: the scales map each row's largest magnitude onto it
_TINY = 1e-12  # an all-zero row keeps a finite scale


def quantise_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (M, K) float8 and the (M, 1) float32 scales with x ~= q * scale.

    The multiplier is rounded to x's dtype and the scale is its exact reciprocal in float32, so the scale undoes
    what was applied; casting to float8 saturates at 448 (a value one rounding step above stays 448)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(_TINY)
    inverse = (FP8_MAX / amax).to(x.dtype)
    return (x * inverse).to(FP8).contiguous(), inverse.float().reciprocal()  # row-major, as cuBLASLt wants it


def _fp8_gemm_ok(linear: nn.Linear, dtype: torch.dtype, device: torch.device) -> bool:
    """cuBLASLt's row-wise FP8 GEMM needs both matrix sides in multiples of 16 and a 16-bit output (every linear of
    the full-size DiT qualifies); the CPU takes any."""
    if device.type != "cuda":
        return True
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0 and dtype in (torch.bfloat16, torch.float16)


class Fp8Linear(nn.Module):
    """Runs `linear` (its weight and bias, not copies of them) as a row-wise scaled FP8 GEMM.

    A wrapper rather than a subclass: swapped into a block for the length of a `high` call and back out, the model's
    parameters and state dict never change."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        weight = linear.weight.detach()
        self.source = (weight.device, weight.data_ptr(), weight._version)
        quantised, scale = quantise_rows(weight)
        # (K, N) column-major, as `_scaled_mm` wants its second matrix; (1, N) scales per output channel
        self.weight_t = quantised.t()
        self.weight_scale = scale.t().contiguous()

    @classmethod
    def of(cls, linear: nn.Linear) -> Fp8Linear:
        """The FP8 twin of `linear`, quantised on first use and kept while the weight stays where and what it was."""
        weight = linear.weight.detach()
        with _LOCK:
            twin = _TWINS.get(linear)
            if twin is None or twin.source != (weight.device, weight.data_ptr(), weight._version):
                twin = _TWINS[linear] = cls(linear)
        return twin

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _fp8_gemm_ok(self.linear, x.dtype, x.device):
            return self.linear(x)
        quantised, scale = quantise_rows(x.reshape(-1, x.shape[-1]))
        return self._gemm(quantised, scale, x.dtype).reshape(*x.shape[:-1], self.out_features)

    def forward_fp8(self, x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The layer on `x` already in float8 with one 0-d float32 `scale` for all of it (x ~= x8 * scale), the output
        in `dtype`: FP8 attention's output goes in as the kernel wrote it, not dequantised and quantised again."""
        if not _fp8_gemm_ok(self.linear, dtype, x.device):
            return self.linear(x.to(dtype) * scale.to(dtype))
        rows = x.reshape(-1, x.shape[-1])
        scales = scale.reshape(1, 1).expand(rows.shape[0], 1).contiguous()  # cuBLASLt's row-wise scales: one per row
        return self._gemm(rows, scales, dtype).reshape(*x.shape[:-1], self.out_features)

    def _gemm(self, rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        weight_t, weight_scale = self.weight_t, self.weight_scale
        if weight_t.device != rows.device:  # a block streamed in layer by layer (offload_layers): its weight just came
            quantised, scale_w = quantise_rows(self.linear.weight.detach())
            weight_t, weight_scale = quantised.t(), scale_w.t().contiguous()
        bias = None if self.linear.bias is None else self.linear.bias.to(dtype)
        return torch._scaled_mm(rows, weight_t, scale_a=scale, scale_b=weight_scale, bias=bias, out_dtype=dtype)


def forget(linear: nn.Linear) -> None:
    """Drops the kept FP8 weight of `linear` (an offloaded model must not keep 1.3 GB of it on the GPU)."""
    with _LOCK:
        _TWINS.pop(linear, None)


_TWINS: weakref.WeakKeyDictionary[nn.Linear, Fp8Linear] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # device threads of one engine may apply the lever to a shared (CPU) replica at once
