"""The device threads of one engine call: which device denoises and which decodes each tile (`Schedule`), the
latents and weighted segments handed between the threads and the caller (`Pipeline`), and the host copies they
travel as (`to_host`, `arrived`); the devices a user names, checked (`parse`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from worker.errors import InvalidRequest
from worker.sr.tiling import Tile


def parse(names: Sequence[str]) -> list[torch.device]:
    """The devices `names` name ("cpu", "cuda", "cuda:N"), each one this machine has; `InvalidRequest` naming the
    first that is not, before any weight is read (torch's own errors name neither the option nor what there is)."""
    devices = []
    for name in names:
        try:
            device = torch.device(name.strip())
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise InvalidRequest(f"unknown device {name!r}: cpu, cuda or cuda:N")
        if device.type == "cuda" and (device.index or 0) >= (count := torch.cuda.device_count()):
            there = f"it has {count} (cuda:0 to cuda:{count - 1})" if count else "its torch sees no CUDA GPU"
            raise InvalidRequest(f"{name} is not a GPU of this machine: {there}")
        devices.append(device)
    if not devices:
        raise InvalidRequest("no device given: cpu, cuda or cuda:N")
    return devices


@dataclass(frozen=True)
class Schedule:
    """Which device denoises and which decodes each tile (slot -> tiles, in tile order), and the groups of slots that
    denoise each of their tiles together (`split`)."""

    denoise: dict[int, list[Tile]]
    decode: dict[int, list[Tile]]
    groups: tuple[tuple[int, ...], ...] = ()

    @property
    def encode(self) -> dict[int, list[Tile]]:
        """Slot -> the tiles whose low-resolution latents it makes: a split group's first slot makes them for all."""
        sharing = {slot for group in self.groups for slot in group[1:]}
        return {slot: [] if slot in sharing else tiles for slot, tiles in self.denoise.items()}

    def hands_over(self, slot: int) -> bool:
        """Whether `slot` hands its denoised tiles on: all of a split group hold them, its first slot hands them."""
        return not any(slot in group[1:] for group in self.groups)

    @classmethod
    def split(cls, tiles: Sequence[Tile], slots: int, degree: int) -> Schedule:
        """Groups of `degree` consecutive slots, each denoising its tiles together (dealt round-robin over the
        groups); decoding dealt round-robin over all slots, from the last one: a split group's first slot also
        hands its tiles over."""
        if degree == 1:
            return cls.balanced(tiles, slots)
        groups = [tuple(range(start, start + degree)) for start in range(0, slots, degree)]
        denoise = {slot: list(tiles[number :: len(groups)]) for number, group in enumerate(groups) for slot in group}
        decode = {slot: list(tiles[slots - 1 - slot :: slots]) for slot in range(slots)}
        return cls(denoise, decode, tuple(groups))

    @classmethod
    def balanced(cls, tiles: Sequence[Tile], slots: int) -> Schedule:
        """Denoising is dealt round-robin; decoding mirrors its counts (the device with the most tiles to denoise
        gets the fewest to decode), so every device does about the same work. A device short of tiles to decode
        takes the earliest-denoised tiles of one with a surplus, which are ready long before it needs them.

        9 tiles on 2 devices: denoise 5 + 4, decode 4 + 5 (tile 0 changes device), instead of 5 + 5 on the busier."""
        denoise = {slot: list(tiles[slot::slots]) for slot in range(slots)}
        wanted = {slot: len(denoise[slots - 1 - slot]) for slot in range(slots)}
        surplus = [tile for slot in range(slots) for tile in denoise[slot][: max(0, len(denoise[slot]) - wanted[slot])]]
        decode = {}
        for slot in range(slots):
            own = denoise[slot][max(0, len(denoise[slot]) - wanted[slot]) :]
            taken, surplus = surplus[: wanted[slot] - len(own)], surplus[wanted[slot] - len(own) :]
            decode[slot] = sorted(taken + own, key=lambda tile: tile.index)
        return cls(denoise, decode)


class Pipeline:
    """The device threads of one call: latents handed between them, segments of weighted tiles to the caller, and
    the first failure, which stops every thread at its next model call."""

    def __init__(self, tiles: int) -> None:
        self._running = 0
        self._latents: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._handed = threading.Condition()
        # Bounded (about two segments of every tile): a slow sink holds the devices back instead of piling
        # segments up in pinned memory (the engine's `_Blend` moves those that wait for an earlier tile out of it).
        self._results: queue.Queue = queue.Queue(maxsize=2 * tiles)
        self._model_call: Callable[[], AbstractContextManager] = nullcontext
        self._on_failure: list[Callable[[], Any]] = []
        self.error: BaseException | None = None

    def on_failure(self, callback: Callable[[], Any]) -> None:
        """`callback()` once the first failure is recorded (e.g. breaking a barrier the threads may wait at)."""
        self._on_failure.append(callback)

    def start(self, pool: ThreadPoolExecutor, calls: list[Callable[[], Any]], model_call: Callable[[], AbstractContextManager]) -> None:
        """Runs `calls` on `pool`, each model call of theirs inside `model_call()` (the compile gate's context)."""
        self._model_call = model_call

        def thread(call: Callable[[], Any]) -> None:
            try:
                call()
            except BaseException as error:  # handed to the caller's thread
                self._fail(error)
            finally:
                self._results.put(_DONE)  # `stop` drains the queue: this never blocks for long

        for call in calls:
            pool.submit(thread, call)
            self._running += 1

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Around each model call: as the compile gate has it, and stopping the thread once another failed."""
        with self._model_call():
            if self.error is not None:  # checked once inside: the wait may have been another call's compilation
                raise Stopped
            yield

    def hand_over(self, latents: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]]) -> None:
        """Denoised latents by tile index, each with the event its copy to the host ends with (None: no copy)."""
        with self._handed:
            self._latents.update(latents)
            self._handed.notify_all()

    def take(self, index: int) -> torch.Tensor:
        with self._handed:
            self._handed.wait_for(lambda: index in self._latents or self.error is not None)
            if self.error is not None:
                raise Stopped
            handed = self._latents[index]
        return arrived(*handed)

    def put(self, number: int, index: int, weighted: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        while True:  # a caller that stopped consuming (it failed) must not leave this thread blocked
            try:
                self._results.put((number, index, weighted, ready), timeout=0.1)
                return
            except queue.Full:
                if self.error is not None:
                    raise Stopped from None

    def results(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(segment number, tile index, weighted frames on the host) as the devices produce them, until all are
        done; then their first error."""
        while self._running:
            item = self._results.get()
            if item is _DONE:
                self._running -= 1
            elif self.error is None:
                number, index, *weighted = item
                yield number, index, arrived(*weighted)
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """Stops the devices early (the caller failed) and waits for them; nothing once they are done."""
        if self._running:
            self._fail(Stopped())
        while self._running:
            if self._results.get() is _DONE:
                self._running -= 1

    def _fail(self, error: BaseException) -> None:
        with self._handed:
            self.error = self.error or error
            self._handed.notify_all()
        for callback in self._on_failure:
            callback()


class Stopped(Exception):
    """Another device thread failed, or the caller stopped: this thread ends quietly."""


_DONE = object()


def to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`tensor` in pinned host memory, the copy started without waiting for it: (host tensor, the event that marks
    the copy done). A tensor already on the CPU comes back as it is, with no event.

    The copy keeps the tensor's strides: compiled graphs are specialised on them, and denoised latents are
    channel-major in memory. A tile handed to another GPU in another layout than its local twins was decoded by other
    graphs, with other bits (measured on two H200s: `bench/RESULTS.md`)."""
    if tensor.device.type != "cuda":
        return tensor, None
    host = torch.empty_like(tensor, device="cpu", pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    ready = torch.cuda.Event(blocking=True)  # waited on from another thread: sleep there, do not spin a core
    ready.record(torch.cuda.current_stream(tensor.device))
    return host, ready


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host `tensor` on `device`; to a GPU from pinned memory without waiting: a copy from pageable memory waits
    for everything queued on the device before it (the tile's steps before it, a whole transformer call)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def arrived(tensor: torch.Tensor, ready: torch.cuda.Event | None) -> torch.Tensor:
    """A `to_host` copy once its copy is done."""
    if ready is not None:
        ready.synchronize()
    return tensor
