from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.sr.checkpoint import write_tiny
from worker.sr.engine import SREngine

VARIANTS = [("piflow", True), ("piflow", False), ("flowmatch", True), ("flowmatch", False)]
# Inputs the tiny model's (32, 64) landscape tile covers with 2x2 tiles (3x3 at x2.25, whose x1.125 pre-upscale
# lands on the VAE grid only from 32 px), 9 frames = 3 latent frames.
CLIP_SIZE = {2: (24, 48), 2.25: (32, 64), 4: (12, 24)}
FRAMES = 9


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        (variant, upscaler): write_tiny(root / f"{variant}-{'lu' if upscaler else 'pixel'}", variant, upscaler)
        for variant, upscaler in VARIANTS
    }


@pytest.fixture(scope="session")
def tiny_piflow(tiny_checkpoints) -> Path:
    return tiny_checkpoints[("piflow", True)]


@pytest.fixture(scope="session")
def engine(tiny_piflow) -> SREngine:
    return SREngine.from_pretrained(str(tiny_piflow))


def clip(scale: float, seed: int = 0, frames: int = FRAMES) -> torch.Tensor:
    """A random (F, 3, H, W) clip in [0, 1] that the tiny model tiles without padding at `scale`."""
    height, width = CLIP_SIZE[scale]
    return torch.rand(frames, 3, height, width, generator=torch.Generator().manual_seed(seed))


def run(engine: SREngine, video: torch.Tensor, request, **kwargs) -> torch.Tensor:
    chunks: list[torch.Tensor] = []
    engine.upscale(video, request, chunks.append, **kwargs)
    return torch.cat(chunks)


@pytest.fixture(scope="module")
def corpus_cache() -> Path:
    """The real-world media corpus (`make corpus`): a file missing from it fails the test, never skips it."""
    from tests.corpus.check import corpus

    try:
        return corpus()[0]
    except AssertionError as error:
        pytest.fail(str(error))
