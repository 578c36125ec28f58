"""Where each tile's causal decoder cache lives between two of its segments.

Decoding every tile in lockstep, segment by segment, lets frames stream out as they are done, but every tile's
cache must survive between its segments: 1.85 GiB per W1 tile, 16.7 GiB for W1's 9 tiles, 46 GiB for the 25 of
W1 at x4. Parked caches wait in pinned host memory instead: after a tile's segment its cache leaves on one copy
stream, and the next tile's comes back on another while the current one decodes (both directions of the bus at
once), so a GPU holds two caches whatever the tile count. The copies are exact: parking never changes the
output.

Each tile parks into one pinned buffer of its own, reused for all its segments: PyTorch's pinned-memory cache rounds
every allocation up to a power of two, which for a cache's 38 tensors one by one comes to 2.47 GiB per W1 tile
instead of 2 GiB, and would allocate anew for every segment.

A cache comes back into the device memory of the cache parked just before it (once that one's copy out is done),
not into memory allocated on the copy stream: PyTorch's allocator keeps a pool per stream, and memory allocated on
the copy stream could only ever be reused there, so two pools would each grow to their own peak.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import psutil
import torch

Cache = dict[str, Any]  # `decoder.make_cache()`: nested dicts and lists of tensors (or None) and flags
_ALIGN = 64  # bytes: every tensor's place in a tile's buffer starts at a multiple of any element size


def tensors(cache: object) -> Iterator[torch.Tensor]:
    """Every tensor in a decoder cache."""
    if isinstance(cache, torch.Tensor):
        yield cache
    elif isinstance(cache, (dict, list, tuple)):
        for child in cache.values() if isinstance(cache, dict) else cache:
            yield from tensors(child)


def cache_bytes(cache: object) -> int:
    """Bytes the tensors of a decoder cache hold."""
    return sum(tensor.nbytes for tensor in tensors(cache))


def pinned_bytes(cache_bytes: int) -> int:
    """Pinned host memory one parked cache of `cache_bytes` takes (its buffer, as PyTorch's pinned cache rounds it)."""
    return 1 << max(cache_bytes - 1, 0).bit_length()


def host_bytes_available(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Host memory this process may still take: what the machine has free, or less where its container's memory
    limit (cgroup v2 or v1) leaves less, since a container's limit is not what the machine reports."""
    available = psutil.virtual_memory().available
    for limit, usage in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            left = int((cgroup / limit).read_text()) - int((cgroup / usage).read_text())
        except (OSError, ValueError):  # no such cgroup, or "max": no limit
            continue
        available = min(available, max(left, 0))
    return available


def _map(cache: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The cache with every tensor replaced by `move(tensor)`, in `tensors` order; flags and empty slots as they are."""
    if isinstance(cache, torch.Tensor):
        return move(cache)
    if isinstance(cache, dict):
        return {key: _map(value, move) for key, value in cache.items()}
    if isinstance(cache, (list, tuple)):
        return type(cache)(_map(value, move) for value in cache)
    return cache


def _same_layout(host: Cache, device: Cache) -> bool:
    """Whether `device`'s tensors can take `host`'s values one for one, strides included."""
    held, places = list(tensors(host)), list(tensors(device))
    return len(held) == len(places) and all(
        (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype) for a, b in zip(held, places)
    )


class DecoderCaches:
    """One device's decoder caches during a call: `take` a tile's cache before its segment (a new one before its
    first), `give_back` after it, and `prefetch` the next tile's while a segment decodes.

    `park`: between segments a cache waits in host memory; otherwise it stays on the device. On a CPU parking is a
    copy like any other (same code path, nothing saved)."""

    def __init__(self, make: Callable[[], Cache], device: torch.device, park: bool) -> None:
        self._make, self._device, self._park = make, device, park
        self._resident: dict[int, Cache] = {}
        # (cache, the event that ends its copy), in host memory and on the way back
        self._parked: dict[int, tuple[Cache, torch.cuda.Event | None]] = {}
        self._arriving: dict[int, tuple[Cache, torch.cuda.Event | None]] = {}
        self._buffers: dict[int, torch.Tensor] = {}  # tile index -> its pinned bytes
        # The device cache given back last, and the event after which its memory is free to take the next one in
        self._spare: tuple[Cache, torch.cuda.Event | None] | None = None
        streams = park and device.type == "cuda"
        self._out = torch.cuda.Stream(device) if streams else None
        self._in = torch.cuda.Stream(device) if streams else None

    def take(self, index: int) -> Cache:
        """Tile `index`'s cache, on the device and safe to use on the current stream."""
        if index in self._resident:
            return self._resident.pop(index)
        if index not in self._parked and index not in self._arriving:
            return self._make()
        self.prefetch(index)  # nothing if it is already on its way
        cache, arrived = self._arriving.pop(index)
        if arrived is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(arrived)
            for tensor in tensors(cache):
                tensor.record_stream(stream)  # where the copy stream allocated it: used and freed on this one
        return cache

    def prefetch(self, index: int) -> None:
        """Starts bringing tile `index`'s parked cache back to the device (nothing if it is not parked)."""
        if index not in self._parked:
            return
        host, left = self._parked.pop(index)
        spare, self._spare = self._spare, None
        with self._on(self._in):
            if left is not None:
                self._in.wait_event(left)  # the copy out, on the other stream, wrote what comes back
            if spare is not None and _same_layout(host, spare[0]):
                if spare[1] is not None:
                    self._in.wait_event(spare[1])  # its segment and its own copy out are done with it
                places = tensors(spare[0])
                cache = _map(host, lambda tensor: self._copy_in(tensor, next(places)))
            else:  # nothing parked before it, or another layout: new memory, from the copy stream's pool
                cache = _map(host, lambda tensor: tensor.to(self._device, non_blocking=True, copy=True))
            self._arriving[index] = (cache, self._recorded())

    def give_back(self, index: int, cache: Cache, last: bool) -> None:
        """After a segment of tile `index`: the cache is dropped after the tile's last segment (parked: its memory
        takes the next cache in), parked, or kept."""
        if last:
            self._buffers.pop(index, None)
            if self._park:
                self._spare = (cache, self._recorded())
            return
        if not self._park:
            self._resident[index] = cache
            return
        # The buffer's previous contents came back before this segment decoded: the copy out, queued behind the
        # segment, cannot overwrite them early.
        slots = iter(self._slots(index, cache))
        decoded = self._recorded()  # the segment's kernels, queued on the current stream
        with self._on(self._out):
            if decoded is not None:
                self._out.wait_event(decoded)
            host = _map(cache, lambda tensor: self._copy_out(tensor, next(slots)))
            copied = self._recorded()
        self._parked[index] = (host, copied)
        self._spare = (cache, copied)  # its memory takes the next cache in once this copy is done

    def _slots(self, index: int, cache: Cache) -> list[torch.Tensor]:
        """Host views for the cache's tensors, with their strides (a layout compiled code guards on), in tile
        `index`'s pinned buffer."""
        held, places, size = list(tensors(cache)), [], 0
        for tensor in held:
            places.append(size)
            size += -(-tensor.nbytes // _ALIGN) * _ALIGN
        buffer = self._buffers.get(index)
        if buffer is None or buffer.numel() < size:
            buffer = self._buffers[index] = torch.empty(size, dtype=torch.uint8, pin_memory=self._device.type == "cuda")
        slots = []
        for place, tensor in zip(places, held):
            flat = buffer[place : place + tensor.nbytes].view(tensor.dtype)
            # `empty_like` keeps the strides of a tensor without gaps (every cache tensor is a clone or a
            # concatenation) and makes others contiguous; on the meta device it allocates nothing.
            stride = torch.empty_like(tensor, device="meta").stride()
            slots.append(flat.as_strided(tensor.size(), stride, flat.storage_offset()))
        return slots

    def _copy_in(self, tensor: torch.Tensor, place: torch.Tensor) -> torch.Tensor:
        place.copy_(tensor, non_blocking=True)
        if place.is_cuda:  # freed untaken (a call that stops), its memory must still outwait this copy
            place.record_stream(self._in)
        return place

    def _copy_out(self, tensor: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        slot.copy_(tensor, non_blocking=True)
        if tensor.is_cuda:
            tensor.record_stream(self._out)  # its memory stays untouched until the copy is done
        return slot

    @staticmethod
    def _on(stream: torch.cuda.Stream | None) -> AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def _recorded(self) -> torch.cuda.Event | None:
        """An event recorded on the current stream (a copy stream inside `_on`); None on a CPU."""
        if self._device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event
