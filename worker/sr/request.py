"""What a caller of an upscaler asks for and gets back: the request, its progress events, the frame sink and what
the call did. Every upscaler (the engine, Lanczos, the window runner) speaks these types."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from worker.errors import InvalidRequest
from worker.sr import tiling
from worker.sr.noise import NoiseMode

# Receives finished output frames, in order: (n, 3, H, W) float32 in [0, 1], on the CPU.
FrameSink = Callable[[torch.Tensor], None]
# The quality tiers (worker/sr/quality.py says what `high` changes).
LOSSLESS, HIGH = "lossless", "high"
QUALITIES = (LOSSLESS, HIGH)


@dataclass(frozen=True)
class SRRequest:
    scale: float = 2
    num_inference_steps: int = 2
    seed: int = 42
    min_overlap: float = 0.2
    lq_noise_scale: float = 0.7
    tiles_batch_size: int = 1
    noise_mode: NoiseMode = NoiseMode.PER_TILE
    # Extra seed material, e.g. the temporal window index of a long clip, so windows get unrelated noise.
    noise_key: tuple[int, ...] = ()
    # "lossless": the exact engine; "high": faster arithmetic that is not bit-exact (worker/sr/quality.py)
    quality: str = LOSSLESS

    def validate(self) -> None:
        if self.quality not in QUALITIES:
            raise InvalidRequest(f"quality must be one of {', '.join(QUALITIES)}, got {self.quality!r}")
        if not 0 <= self.seed < 2**63:
            raise InvalidRequest(f"seed must be 0 to 2**63 - 1, got {self.seed}")
        if self.scale not in tiling.SCALES:
            raise InvalidRequest(f"scale must be one of {tiling.SCALES}, got {self.scale}")
        if self.num_inference_steps < 1:
            raise InvalidRequest(f"num_inference_steps must be >= 1, got {self.num_inference_steps}")
        if not 0.0 < self.lq_noise_scale <= 1.0:
            raise InvalidRequest(f"lq_noise_scale must be in (0, 1], got {self.lq_noise_scale}")
        if not 0.0 <= self.min_overlap < 1.0:
            raise InvalidRequest(f"min_overlap must be in [0, 1), got {self.min_overlap}")
        if self.tiles_batch_size < 1:
            raise InvalidRequest(f"tiles_batch_size must be >= 1, got {self.tiles_batch_size}")


@dataclass(frozen=True)
class Progress:
    stage: str  # "denoise", "decode" (devices report both at once when they work on different stages)
    done: int  # work units done over the whole call: one per tile and step, one per tile and decode segment
    total: int


@dataclass
class RunInfo:
    """What one call did, for logs, job records and benchmarks."""

    input_size: tuple[int, int]
    output_size: tuple[int, int]
    frames: int
    padded_input: tuple[int, int, int]  # (frames, height, width) the model actually ran on
    tiles: int
    devices: list[str]
    split: int = 1  # devices that denoised each tile together (1: whole tiles)
    # Wall seconds: "encode" and "denoise_decode" (the devices synchronised at each end); and, within the latter,
    # the calling thread's own work: "blend" (adding tiles into canvases, normalising) and "sink" (the caller's sink).
    stage_seconds: dict[str, float] = field(default_factory=dict)
    quality: str = LOSSLESS  # the tier that ran (an upscaler without a faster path runs `lossless` for `high`)
    levers: dict[str, str] = field(default_factory=dict)  # `high`'s levers and how each ran (quality.Applied)

    def made_like(self, other: RunInfo) -> bool:
        """Whether `other`'s frames were computed as these were (the tier, its levers as they ran, the split), so
        that windows of the two may sit in one output."""
        return (self.quality, self.levers, self.split) == (other.quality, other.levers, other.split)

    def kept(self) -> dict[str, Any]:
        """What made the frames, as JSON kept beside them (a replayed window reports it): no timings."""
        return {name: value for name, value in asdict(self).items() if name != "stage_seconds"}

    @classmethod
    def of_kept(cls, kept: Any) -> RunInfo | None:
        """`kept()` read back; None where it cannot be read (the window is computed again). Fields this version does
        not know (kept by a newer worker, in a rolling deploy) are left out."""
        try:
            known = {name: kept[name] for name in {f.name for f in fields(cls)} & kept.keys()}
            sizes = {name: tuple(kept[name]) for name in ("input_size", "output_size", "padded_input")}
            return cls(**{**known, **sizes, "devices": list(kept["devices"]), "levers": dict(kept["levers"])})
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
