"""The spatial tile plan: where tiles sit, how big they are, and how they blend.

It reproduces `Kandinsky6SRPipeline`'s plan exactly (same tile size choice, positions and Hann window), so the
engine's output can be compared with the reference bit for bit; only the execution around it is ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCALES = (2, 2.25, 4)
# The x2.25 route bilinearly pre-upscales the input by this factor, then runs the x2 path.
PRE_UPSCALE_2_25 = 1.125
# The released checkpoint's (checkpoint.HUB_ID) transformer `tile_sizes` and VAE spatial factor: what `vsrq probe`
# plans with, as it loads no model (a job plans with the loaded checkpoint's own).
RELEASED_TILE_SIZES = ((512, 512), (512, 768), (768, 512))
RELEASED_SNAP = 16


@dataclass(frozen=True)
class Tile:
    index: int
    top: int  # input-pixel coordinates (after any pre-upscale)
    left: int


@dataclass(frozen=True)
class TilePlan:
    """Tile grid of one video at one scale."""

    tiling_scale: int  # what the model does per tile: 2 or 4
    height: int  # model input size (after the x2.25 pre-upscale and padding)
    width: int
    tile_height: int  # input tile
    tile_width: int
    base_height: int  # output tile: one of the trained tile sizes
    base_width: int
    snap: int  # VAE spatial factor: tiles align to the latent grid
    tiles: tuple[Tile, ...]

    @property
    def output_size(self) -> tuple[int, int]:
        return self.height * self.tiling_scale, self.width * self.tiling_scale

    def output_box(self, tile: Tile) -> tuple[slice, slice]:
        top, left = tile.top * self.tiling_scale, tile.left * self.tiling_scale
        return slice(top, top + self.base_height), slice(left, left + self.base_width)

    def input_box(self, tile: Tile) -> tuple[slice, slice]:
        return slice(tile.top, tile.top + self.tile_height), slice(tile.left, tile.left + self.tile_width)

    def latent_box(self, tile: Tile) -> tuple[slice, slice]:
        rows, cols = self.input_box(tile)
        return slice(rows.start // self.snap, rows.stop // self.snap), slice(cols.start // self.snap, cols.stop // self.snap)

    def window(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return hann_window_2d(self.base_height, self.base_width, device)

    def weight_map(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Sum of all tiles' windows over the output canvas, accumulated in tile order like the reference."""
        weights = torch.zeros(self.output_size, device=device)
        window = self.window(device)
        for tile in self.tiles:
            weights[self.output_box(tile)] += window
        return weights


def tile_positions(length: int, tile: int, min_overlap: float, snap: int) -> list[int]:
    """Evenly spread, `snap`-aligned starts covering `[0, length - tile]`, neighbours sharing >= `min_overlap`."""
    if tile >= length:
        return [0]
    span = (length - tile) // snap
    max_stride = max(1, math.floor(tile * (1.0 - min_overlap) / snap))
    count = math.ceil(span / max_stride) + 1
    return [round(index * span / (count - 1)) * snap for index in range(count)]


def hann_window_2d(height: int, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Separable Hann window without its zero ends, so an area one tile alone covers keeps a positive weight."""
    window_y = torch.hann_window(height + 2, device=device)[1:-1]
    window_x = torch.hann_window(width + 2, device=device)[1:-1]
    return window_y[:, None] * window_x[None, :]


def split_scale(scale: float) -> tuple[int, float]:
    """(model scale per tile, pixel pre-upscale factor) for a user-facing scale."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale}")
    return (2, PRE_UPSCALE_2_25) if scale == 2.25 else (int(scale), 1.0)


def pre_upscaled_size(height: int, width: int, scale: float) -> tuple[int, int]:
    """Size after the x2.25 route's bilinear x1.125 pre-upscale (unchanged for other scales).

    The reference rounds this to a multiple of 16, which makes its "x2.25" anything from x2.1 to x2.4 on small
    inputs; we keep the exact size and pad instead, so the output is 2 x round(1.125 x size). The two agree whenever
    1.125 x size is a multiple of 16.
    """
    _, pre_upscale = split_scale(scale)
    return round(height * pre_upscale), round(width * pre_upscale)


def output_size(height: int, width: int, scale: float) -> tuple[int, int]:
    """The output size every backend promises: x2 and x4 exactly, 2 x round(1.125 x size) for x2.25; any other
    scale (classical backends only) rounds."""
    if scale not in SCALES:
        return round(height * scale), round(width * scale)
    tiling_scale, _ = split_scale(scale)
    return tuple(size * tiling_scale for size in pre_upscaled_size(height, width, scale))


def choose_base_tile(height: int, width: int, tile_sizes: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The trained tile size whose aspect ratio is closest to the video's."""
    return min(tile_sizes, key=lambda hw: abs(hw[1] / hw[0] - width / height))


def plan_tiles(
    height: int,
    width: int,
    tiling_scale: int,
    tile_sizes: tuple[tuple[int, int], ...],
    snap: int,
    min_overlap: float = 0.2,
    base: tuple[int, int] | None = None,
) -> TilePlan:
    """Plan the tiles of a `height` x `width` model input (multiples of `snap`, after any pre-upscale).

    `base` fixes the output tile; by default it is the trained size closest to the input's aspect ratio.
    """
    if not 0.0 <= min_overlap < 1.0:
        raise ValueError(f"min_overlap must be in [0, 1), got {min_overlap}")
    if height % snap or width % snap:
        raise ValueError(f"input size {height}x{width} must be a multiple of {snap}")
    base_height, base_width = base or choose_base_tile(height, width, tile_sizes)
    if base_height % (snap * tiling_scale) or base_width % (snap * tiling_scale):
        raise ValueError(f"tile size {(base_height, base_width)} is not divisible by {snap * tiling_scale}")
    tile_height, tile_width = base_height // tiling_scale, base_width // tiling_scale
    if height < tile_height or width < tile_width:
        raise ValueError(f"input {height}x{width} is smaller than one {tile_height}x{tile_width} tile at x{tiling_scale}")
    tops = tile_positions(height, tile_height, min_overlap, snap)
    lefts = tile_positions(width, tile_width, min_overlap, snap)
    tiles = tuple(Tile(i, top, left) for i, (top, left) in enumerate((t, l) for t in tops for l in lefts))
    return TilePlan(
        tiling_scale=tiling_scale,
        height=height,
        width=width,
        tile_height=tile_height,
        tile_width=tile_width,
        base_height=base_height,
        base_width=base_width,
        snap=snap,
        tiles=tiles,
    )


def padded_size(height: int, width: int, base: tuple[int, int], tiling_scale: int, snap: int) -> tuple[int, int]:
    """The model input's size: each side up to the VAE grid (`snap`) and to at least one input tile of `base`."""
    return tuple(max(-(-size // snap) * snap, tile // tiling_scale) for size, tile in zip((height, width), base))


def plan_video(
    height: int,
    width: int,
    scale: float,
    tile_sizes: tuple[tuple[int, int], ...],
    snap: int,
    min_overlap: float = 0.2,
) -> TilePlan:
    """The tiles a `height` x `width` video is upscaled in at `scale`, as the engine runs them: after the x2.25
    pre-upscale, at the trained size closest to its aspect ratio, over the input padded to `padded_size`."""
    tiling_scale, _ = split_scale(scale)
    model_height, model_width = pre_upscaled_size(height, width, scale)
    # chosen on the unpadded input: padding to the grid must not turn a tile's shape
    base = choose_base_tile(model_height, model_width, tile_sizes)
    padded = padded_size(model_height, model_width, base, tiling_scale, snap)
    return plan_tiles(*padded, tiling_scale, tile_sizes, snap, min_overlap, base)
