"""The warmup's decoder: each call signature decoded once.

A compiled decoder runs (and where new builds, loads or compiles) the functions of one signature per call: the
latent segment's shape and its cache's layout (`precompiled.describe`: shapes, strides, dtypes, flags). A window's
middle segments all share one signature, so a warmup decoding every segment of a full window ran the same functions
again and again (bench/RESULTS.md, issue 22). Jobs never use this: they decode every segment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from worker.sr.precompiled import describe


class DecodeEachSignatureOnce:
    """Wraps a decoder `decoder(latent, cache) -> frames`. A call whose signature was run before, by a call that left
    its cache's layout as it found it, is not run again: it returns that call's frames (same shape) and leaves the
    cache as it is, which is the layout running it would leave. So every later call has the signature it has in a
    full decode, and the warmup still meets every signature a job meets. A call that changes the layout (a tile's
    first segment) always runs."""

    def __init__(self, decoder: Callable[[torch.Tensor, Any], torch.Tensor]) -> None:
        self._decoder = decoder
        self._frames: dict[Any, torch.Tensor] = {}  # signature -> the frames of its call

    def __call__(self, latent: torch.Tensor, cache: Any) -> torch.Tensor:
        layout = describe(cache)
        signature = (describe(latent), layout)
        if (frames := self._frames.get(signature)) is not None:
            return frames
        frames = self._decoder(latent, cache)
        if describe(cache) == layout:
            self._frames[signature] = frames
        return frames
