"""Our tile plan is the reference pipeline's plan: same positions, windows and sizes."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_sr import _hann_window_2d, _tile_positions

from worker.sr.tiling import (
    RELEASED_TILE_SIZES as FULL_TILES,
    hann_window_2d,
    output_size,
    plan_tiles,
    pre_upscaled_size,
    split_scale,
    tile_positions,
)


def test_the_released_tile_sizes_are_the_transformer_s_own():
    """`vsrq probe` plans with these without loading a model: the K6 SR transformer's default, which the released
    checkpoint's config keeps (../shared/docs/kandinsky6-sr.md)."""
    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRTransformer3DModel

    default = inspect.signature(Kandinsky6SRTransformer3DModel.__init__).parameters["tile_sizes"].default
    assert FULL_TILES == tuple(map(tuple, default))


@pytest.mark.parametrize("overlap", [0.0, 0.2, 0.5, 0.9])
def test_positions_match_reference(overlap):
    for length, tile, snap in itertools.product(range(16, 1200, 16), (128, 192, 256, 384), (4, 16)):
        assert tile_positions(length, tile, overlap, snap) == _tile_positions(length, tile, overlap, snap)


def test_hann_window_matches_reference_and_is_positive():
    ours = hann_window_2d(512, 768)
    assert torch.equal(ours, _hann_window_2d(512, 768, torch.device("cpu")))
    assert ours.min() > 0


@pytest.mark.parametrize(
    ("scale", "tiles", "output", "tile"),
    [(2, 9, (1024, 1536), (256, 384)), (2.25, 9, (1152, 1728), (256, 384)), (4, 25, (2048, 3072), (128, 192))],
)
def test_worked_case_768x512(scale, tiles, output, tile):
    tiling_scale, _ = split_scale(scale)
    plan = plan_tiles(*pre_upscaled_size(512, 768, scale), tiling_scale, FULL_TILES, snap=16)
    assert len(plan.tiles) == tiles
    assert plan.output_size == output == output_size(512, 768, scale)
    assert (plan.tile_height, plan.tile_width) == tile
    # Every output pixel is covered, and the weights never vanish.
    assert plan.weight_map().min() > 0


@pytest.mark.parametrize(("size", "scale", "expected"), [((190, 250), 2.25, (428, 562)), ((21, 43), 2.25, (48, 96)), ((21, 43), 4, (84, 172)), ((10, 10), 1.5, (15, 15))])
def test_output_size_is_the_scale_exactly(size, scale, expected):
    assert output_size(*size, scale) == expected


def test_too_small_input_is_refused():
    with pytest.raises(ValueError, match="smaller than one"):
        plan_tiles(128, 128, 2, FULL_TILES, snap=16)
