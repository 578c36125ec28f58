"""The decode-order policy: in which order a call decodes its tiles (lockstep, parked or tile by tile; all give
the same bits), from the GPUs' sizes and the host memory free."""

from __future__ import annotations

from collections.abc import Sequence

from worker.sr.decoder_caches import pinned_bytes

DECODE_ORDERS = ("lockstep", "parked", "tile_major")


def decode_order_for(order: str, gpus: Sequence[tuple[int, int, int]], cache_bytes: int, host_available: int) -> str:
    """A call's decode order (all give the same bits). `gpus`: (tiles it decodes, its memory, its weights' bytes) per
    GPU; `cache_bytes`: one tile's decoder cache.
    - lockstep parks the caches where resident ones would crowd a GPU (`crowded`);
    - parking saves nothing where no GPU decodes more than two tiles (it keeps up to three caches in flight);
    - parked caches decode tile by tile instead where their pinned buffers would take over half of the host memory
      available (the rest is for frames, blending and the encoder)."""
    if order == "lockstep" and any(crowded(tiles, cache_bytes, total, weights) for tiles, total, weights in gpus):
        order = "parked"
    if order == "parked" and max(tiles for tiles, *_ in gpus) <= 2:
        return "lockstep"
    if order == "parked" and sum(tiles for tiles, *_ in gpus) * pinned_bytes(cache_bytes) > host_available / 2:
        return "tile_major"
    return order


def crowded(tiles: int, cache_bytes: int, total_bytes: int, weight_bytes: int) -> bool:
    """Whether `tiles` resident decoder caches take more than half of what the weights leave on a GPU: the other
    half is for one segment's activations (W1 tiles at segment 4: 13 GiB, beside 1.85 GiB of cache per tile) and
    the allocator's slack."""
    return tiles * cache_bytes > (total_bytes - weight_bytes) / 2
