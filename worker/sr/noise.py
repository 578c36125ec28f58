"""Where each tile's starting noise comes from.

`per_tile` (default): every tile draws from its own CPU generator seeded from (seed, *key), so a tile's noise does
not depend on how tiles are batched or spread over devices. `reference`: one generator consumed in order, chunk by
chunk, exactly as `Kandinsky6SRPipeline` does; only for parity with it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np
import torch


class NoiseMode(str, enum.Enum):
    PER_TILE = "per_tile"
    REFERENCE = "reference"


def tile_seed(seed: int, *key: int) -> int:
    """A well-mixed 63-bit seed for (seed, *key): neighbouring tiles get unrelated streams."""
    return int(np.random.SeedSequence([seed, *key]).generate_state(1, np.uint64)[0] >> 1)


def tile_noise(
    mode: NoiseMode,
    seed: int,
    shape: Sequence[int],
    num_tiles: int,
    dtype: torch.dtype,
    *,
    key: Sequence[int] = (),
    chunk_size: int = 1,
) -> list[torch.Tensor]:
    """Noise of `shape` (one tile, batch dim included) for each of `num_tiles` tiles, on the CPU."""
    # diffusers' own sampler, for its bits; imported here, since diffusers.utils pulls in torch's compiler stack
    # (~2.5 CPU-s), which a Lanczos worker or `vsrq probe` never needs
    from diffusers.utils.torch_utils import randn_tensor

    if mode is NoiseMode.PER_TILE:
        return [
            randn_tensor(tuple(shape), generator=torch.Generator().manual_seed(tile_seed(seed, *key, i)), dtype=dtype)
            for i in range(num_tiles)
        ]
    generator = torch.Generator().manual_seed(seed)
    noise: list[torch.Tensor] = []
    for start in range(0, num_tiles, chunk_size):
        count = min(chunk_size, num_tiles - start)
        chunk = randn_tensor((count, *shape[1:]), generator=generator, dtype=dtype)
        noise.extend(chunk.split(1))
    return noise
