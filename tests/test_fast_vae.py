"""The faster decoder computes the same decode (fp32, CPU), segment by segment through the causal cache."""

from __future__ import annotations

import copy

import diffusers
import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRUpsample

from worker.sr import fast_vae
from worker.sr.checkpoint import tiny_components
from worker.sr.decoder_caches import cache_bytes, tensors
from worker.sr.fast_vae import (
    DECODER_SWAPS,
    BroadcastSpatialNorm3D,
    ImplicitPadCausalConv3d,
    SubPixelUpsample,
    speed_up_decoder,
    tile_cache_bytes,
)


def decode_in_segments(vae, z: torch.Tensor) -> torch.Tensor:
    cache = vae.decoder.make_cache()
    return torch.cat([vae.decoder(z[:, :, a:b], cache) for a, b in [(0, 1), (1, 3), (3, 5)]], dim=2)


FAST_CLASSES = {
    "broadcast_norm": BroadcastSpatialNorm3D,
    "implicit_pad": ImplicitPadCausalConv3d,
    "sub_pixel_upsample": SubPixelUpsample,
}


@pytest.mark.parametrize("swaps", [None, *([name] for name in DECODER_SWAPS)], ids=lambda swaps: (swaps or ["all"])[0])
def test_fast_decoder_decodes_like_stock(swaps):
    """All swaps (the default: the engine's decoder), and each alone (as bench/levers.py measures them)."""
    stock = tiny_components()["vae"].eval()
    fast = speed_up_decoder(copy.deepcopy(stock), **({} if swaps is None else {"swaps": swaps}))
    applied = set(DECODER_SWAPS if swaps is None else swaps)
    kinds = {type(m) for m in fast.decoder.modules()}
    assert {FAST_CLASSES[name] for name in applied} <= kinds
    assert not {FAST_CLASSES[name] for name in DECODER_SWAPS.keys() - applied} & kinds
    assert (Kandinsky6SRUpsample in kinds) == ("sub_pixel_upsample" not in applied)
    z = torch.randn(1, 4, 5, 8, 12, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, ours = decode_in_segments(stock, z), decode_in_segments(fast, z)
    assert ours.shape == expected.shape == (1, 3, 17, 32, 48)
    assert (ours - expected).abs().max() <= 1e-5
    assert expected.std() > 0.01


def test_a_tiles_decoder_cache_keeps_its_memory_from_segment_to_segment():
    """The fast causal convolutions carry their frames in place: no cache allocation after a tile's first segment."""
    vae = speed_up_decoder(tiny_components()["vae"].eval())
    z = torch.randn(1, 4, 5, 8, 12, generator=torch.Generator().manual_seed(0))
    cache = vae.decoder.make_cache()
    places = []
    with torch.no_grad():
        for a, b in [(0, 1), (1, 3), (3, 5)]:
            vae.decoder(z[:, :, a:b], cache)
            places.append([tensor.data_ptr() for tensor in tensors(cache)])
    assert places[0] == places[1] == places[2] and len(places[0]) > 10


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "too_big_for_one_convolution"])
@pytest.mark.parametrize("compress_time", [False, True])
def test_sub_pixel_upsampling_matches_stock_across_segments(compress_time, layout, monkeypatch):
    """Odd sizes, non-zero biases and weights loaded after the swap; the temporal doubling's cache carries over from
    one segment to the next. The interleave reads the phases through their strides, whatever the input's layout;
    inputs whose phases would pass cuDNN's element limit take the stock convolutions."""
    if layout == "too_big_for_one_convolution":
        monkeypatch.setattr(fast_vae, "CONV_CHUNK_ELEMENTS", 100)
    torch.manual_seed(0)
    stock = Kandinsky6SRUpsample(8, compress_time=compress_time).eval()
    fast = SubPixelUpsample.fold(copy.deepcopy(stock))
    for parameter in stock.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    fast.load_state_dict(stock.state_dict())  # the phases follow the weights
    x = torch.randn(2, 8, 5, 5, 7)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last_3d)
    stock_cache, fast_cache = stock.make_cache(), fast.make_cache()
    with torch.no_grad():
        for segment in (slice(0, 3), slice(3, 5)):
            expected, ours = stock(x[:, :, segment], stock_cache), fast(x[:, :, segment], fast_cache)
            assert ours.shape == expected.shape
            assert (ours - expected).abs().max() <= 1e-5 * expected.abs().max()
            if layout != "too_big_for_one_convolution" and not compress_time:
                # The output keeps the layout of what it upsamples (NDHWC for cuDNN; the CPU's 3D convolutions, as
                # the temporal one, return NCDHW whatever they are given)
                assert ours.is_contiguous(memory_format=torch.channels_last_3d) == (layout == "channels_last")


def test_sub_pixel_upsampling_in_bf16_is_as_close_to_the_exact_result_as_stock():
    """Folding the 1x1 into the 3x3 rounds differently, not worse: both bf16 results' RMS error against float64."""
    torch.manual_seed(0)
    stock = Kandinsky6SRUpsample(64, compress_time=False).eval()
    x = torch.randn(1, 64, 2, 12, 16)
    with torch.no_grad():
        exact = copy.deepcopy(stock).double()(x.double(), {})
        stock = stock.to(torch.bfloat16)
        errors = [
            (module(x.bfloat16(), {}).double() - exact).pow(2).mean().sqrt().item()
            for module in (stock, SubPixelUpsample.fold(copy.deepcopy(stock)))
        ]
    assert 0 < errors[1] <= 1.02 * errors[0]  # folded in bf16 instead of float64: 1.035


def test_full_size_decoder_layout_has_integer_upsampling_factors():
    """Every norm of the real decoder meets zq at an integer multiple of its size (the broadcast path applies)."""
    with torch.device("meta"):
        vae = speed_up_decoder(diffusers.Kandinsky6SRVAE())
    factors = []

    def record(module, args, _output):
        hidden, zq = args[0], args[1]
        factors.append(tuple(full / small for full, small in zip(hidden.shape[2:], zq.shape[2:])))

    for module in vae.decoder.modules():
        if isinstance(module, BroadcastSpatialNorm3D):
            module.register_forward_hook(record)
    cache = vae.decoder.make_cache()
    with torch.no_grad():
        for frames in (1, 4):
            vae.decoder(torch.empty(1, 64, frames, 32, 48, device="meta"), cache)
    assert factors and all(float(f).is_integer() for triple in factors for f in triple)


def test_a_tiles_decoder_cache_is_sized_without_memory_or_arithmetic():
    """The meta-device dry run gives the bytes a real cache holds: on the tiny model here, and for the full-size
    VAE the 1,988,493,312 bytes measured on an H200 for a W1 tile (bench/results/2026-11-30-levers-memory-mp4.jsonl)."""
    vae = speed_up_decoder(tiny_components()["vae"])
    cache = vae.decoder.make_cache()
    latents = torch.randn(1, vae.config.latent_channels, 6, 8, 16)
    with torch.no_grad():
        for segment in (slice(0, 1), slice(1, 5), slice(5, 6)):
            vae.decoder(latents[:, :, segment], cache)
    assert cache_bytes(cache) == tile_cache_bytes(vae, 8, 16) > 0
    with torch.device("meta"):
        full_size = diffusers.Kandinsky6SRVAE()
    torch.nn.Module.to(full_size, torch.bfloat16)
    assert tile_cache_bytes(full_size, 32, 48) == 1_988_493_312
