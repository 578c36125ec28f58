"""A tile's decoder cache between its segments: kept, parked in host memory and brought back, or dropped."""

from __future__ import annotations

import pytest
import torch

from worker.sr.checkpoint import tiny_components
from worker.sr.decoder_caches import DecoderCaches, cache_bytes, tensors
from worker.sr.fast_vae import speed_up_decoder


def filled_cache(vae=None):
    """A real cache of the tiny decoder after one segment: padding tensors at every level and first-segment flags."""
    vae = vae or tiny_components()["vae"].eval()
    cache = vae.decoder.make_cache()
    with torch.no_grad():
        vae.decoder(torch.randn(1, vae.config.latent_channels, 1, 4, 4), cache)
    return vae, cache


def test_a_parked_cache_comes_back_equal_into_the_memory_of_the_cache_parked_after_it():
    vae, cache = filled_cache()
    _, later = filled_cache(vae)
    values = [tensor.clone() for tensor in tensors(cache)]
    caches = DecoderCaches(vae.decoder.make_cache, torch.device("cpu"), park=True)
    caches.give_back(3, cache, last=False)
    caches.give_back(4, later, last=False)
    caches.prefetch(3)
    back = caches.take(3)
    assert cache_bytes(back) == cache_bytes(cache) > 0
    assert all(torch.equal(a, b) for a, b in zip(tensors(back), values, strict=True))
    assert [a.data_ptr() for a in tensors(back)] == [b.data_ptr() for b in tensors(later)]
    assert repr(_flags(back)) == repr(_flags(cache)) and False in _flags(back)  # "is_first_segment" went along


@pytest.mark.parametrize("tiles", [1, 2, 3, 9])
def test_parked_lockstep_decoding_holds_two_caches_whatever_the_tile_count_and_decodes_the_same_bits(tiles):
    """The engine's order: take a tile's cache, decode its segment, prefetch the next tile's, give this one back.
    Parked caches come back into the memory of the one parked before, so after the first segment only two caches'
    memory ever holds the tiles' caches, and the frames are the resident ones."""
    vae = speed_up_decoder(tiny_components()["vae"].eval())  # the engine's decoder: caches updated in place
    latents = torch.randn(tiles, 1, vae.config.latent_channels, 5, 4, 4, generator=torch.Generator().manual_seed(0))
    segments = [slice(0, 1), slice(1, 3), slice(3, 5)]
    order = [(number, tile) for number in range(len(segments)) for tile in range(len(latents))]
    frames, memory = {}, {}
    for park in (False, True):
        caches = DecoderCaches(vae.decoder.make_cache, torch.device("cpu"), park=park)
        used = memory[park] = set()
        for step, (number, tile) in enumerate(order):
            cache = caches.take(tile)
            with torch.no_grad():
                frames[park, number, tile] = vae.decoder(latents[tile][:, :, segments[number]], cache)
            if number:
                used.add(tuple(tensor.data_ptr() for tensor in tensors(cache)))
            if step + 1 < len(order):
                caches.prefetch(order[step + 1][1])
            caches.give_back(tile, cache, last=number == len(segments) - 1)
    assert len(memory[True]) == min(tiles, 2) and len(memory[False]) == tiles
    assert all(torch.equal(frames[True, number, tile], frames[False, number, tile]) for number, tile in order)


def test_kept_caches_stay_and_a_last_segment_drops_the_cache():
    vae, cache = filled_cache()
    for park in (False, True):
        caches = DecoderCaches(vae.decoder.make_cache, torch.device("cpu"), park=park)
        caches.give_back(0, cache, last=False)
        assert (caches.take(0) is cache) is not park  # without parking the very same cache
        caches.give_back(0, cache, last=True)
        assert cache_bytes(caches.take(0)) == 0  # a new, empty cache: the old one is gone
        caches.prefetch(7)  # nothing parked under 7: nothing to do
        assert cache_bytes(caches.take(7)) == 0


def _flags(cache) -> list:
    if isinstance(cache, dict):
        return [flag for key, value in cache.items() for flag in ([value] if isinstance(value, bool) else _flags(value))]
    if isinstance(cache, list):
        return [flag for value in cache for flag in _flags(value)]
    return []


def test_parked_tensors_keep_dtype_layout_and_values_side_by_side_in_one_buffer():
    """Compiled decoder blocks guard on strides: a channels-last tensor must come back channels-last; tensors of
    different dtypes and odd sizes share the tile's buffer without overlapping; a second park reuses it."""

    def cache_of(seed: int) -> dict:
        torch.manual_seed(seed)
        wide = torch.randn(1, 3, 2, 5, 7).contiguous(memory_format=torch.channels_last_3d)
        narrow = torch.randn(3, 5).to(torch.bfloat16)
        blocks = [{"padding": narrow}, {"padding": None}]
        return {"conv": {"padding": wide}, "blocks": blocks, "is_first_segment": False}

    cache, other = cache_of(0), cache_of(1)
    expected = [tensor.clone() for tensor in tensors(cache)]
    caches = DecoderCaches(dict, torch.device("cpu"), park=True)
    for _ in range(2):
        caches.give_back(0, cache, last=False)
        caches.give_back(1, other, last=False)  # tile 0 comes back into the memory of this one
        back, other = caches.take(0), caches.take(1)
        assert back["conv"]["padding"].stride() == expected[0].stride() and back["blocks"][1] == {"padding": None}
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(tensors(back), expected, strict=True))
        assert back["is_first_segment"] is False
        cache = back


def test_host_memory_available_heeds_a_container_limit(tmp_path):
    """A container sees the machine's free memory but may only use what its cgroup limit leaves."""
    import psutil

    from worker.sr.decoder_caches import host_bytes_available

    machine = psutil.virtual_memory().available
    assert 0 < host_bytes_available(tmp_path) <= machine  # no cgroup files: the machine's figure
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1000\n")
    assert host_bytes_available(tmp_path) > 1000  # no limit set
    (tmp_path / "memory.max").write_text(f"{3 * 2**30}\n")
    assert host_bytes_available(tmp_path) == min(3 * 2**30 - 1000, psutil.virtual_memory().available)
