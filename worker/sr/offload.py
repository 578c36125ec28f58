"""Weights that wait in pinned host memory and visit the GPU only while their component runs (the offloaded
performance modes), so a 12 or 16 GB card runs what needs ~10 GiB of resident weights elsewhere.

A replica's weights fall into units, each brought to the GPU for one stretch of an engine call and let go after:
- `encoder` (the whole-video encode) and the latent upscaler of the call's scale (each tile's latent upscale): once
  per call (window);
- `transformer`: while the device denoises its tiles; with `Offload.layers` only its embeddings, output layer and
  first `resident_blocks` blocks, the other blocks streamed one after another through a ring of `prefetch` + 1
  device slots, each copied in `prefetch` blocks ahead of the one that runs;
- `decoder`: while the device decodes its tiles (all its blocks resident meanwhile), then let go.
The engine asks for the next unit (`prefetch`) before it queues the current one's work, so the copy, on a side
stream of its own, runs beside that work.

Each unit's home is one host buffer, page-locked where it is (`cudaHostRegister`; PyTorch's pinned allocator rounds
every allocation up to a power of two: the 4.4 GB latent upscaler would take 8 GB, all units 17 GB instead of 10.7),
and on the device one buffer of the same layout: one copy per unit or block. A weight is the same `nn.Parameter` (or buffer) object throughout; only its `.data` points at the home
view or at the device view. Compiled blocks guard on a parameter's shape, strides, dtype and device, never on its
address, so a streamed block runs the graphs a resident one built (CPU test on Dynamo's counters). The copies are
exact and every view keeps its tensor's strides at a 512-byte alignment (the CUDA allocator's): where weights live
never changes a bit of the output.

On a CPU "device" home and device are both host memory: the same code runs, with synchronous copies.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

_ALIGN = 512  # bytes: where the CUDA allocator starts its blocks, so kernels see the alignment they would resident
log = logging.getLogger("vsrq.engine")


class _Registration:
    """Host memory page-locked in place; unlocked before the memory can be freed (it holds the buffer)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.locked = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)) == 0

    def __del__(self) -> None:
        if self.locked:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            except (AttributeError, RuntimeError):  # interpreter shutdown; the process's exit unlocks it anyway
                pass


def _host_buffer(size: int, pin: bool) -> tuple[torch.Tensor, _Registration | None]:
    """`size` bytes of host memory, page-locked if `pin` (in place; from PyTorch's pinned allocator where the
    driver refuses that)."""
    buffer = torch.empty(size, dtype=torch.uint8)
    if not pin:
        return buffer, None
    try:
        registration = _Registration(buffer)
        if registration.locked and buffer.is_pinned():
            return buffer, registration
    except (AttributeError, RuntimeError, TypeError) as error:  # a torch without (this form of) the binding
        log.info("page-locking in place failed (%s): pinned allocations instead", error)
    return torch.empty(size, dtype=torch.uint8, pin_memory=True), None


@dataclass(frozen=True)
class Offload:
    """How a replica's weights are placed: units on demand, and with `layers` the transformer's blocks past the
    first `resident_blocks` streamed with `prefetch` blocks in flight (a setting to sweep: bench/bench.py)."""

    layers: bool = False
    resident_blocks: int = 4
    prefetch: int = 2

    def __post_init__(self) -> None:
        if self.resident_blocks < 0 or self.prefetch < 1:
            raise ValueError("offload needs resident_blocks >= 0 and prefetch >= 1")


class _Layout:
    """Where each tensor of a group sits in one flat byte buffer, strides kept."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.places, size = [], 0
        for tensor in tensors:
            stride = torch.empty_like(tensor, device="meta").stride()  # no gaps: what a resident copy would have
            self.places.append((size, tensor.shape, stride, tensor.dtype, tensor.nbytes))
            size += -(-tensor.nbytes // _ALIGN) * _ALIGN
        self.size = size

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        views = []
        for offset, shape, stride, dtype, nbytes in self.places:
            flat = buffer[offset : offset + nbytes].view(dtype)
            views.append(flat.as_strided(shape, stride, flat.storage_offset()))
        return views

    def matches(self, other: _Layout) -> bool:
        return self.size == other.size and self.places == other.places


def _weights(module: nn.Module, skip: tuple[nn.Module, ...] = ()) -> list[torch.Tensor]:
    """The parameters and buffers of `module` outside the modules in `skip`, each once."""
    skipped = {id(tensor) for part in skip for tensor in (*part.parameters(), *part.buffers())}
    seen: dict[int, torch.Tensor] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in skipped:
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _point(tensors: list[torch.Tensor], views: list[torch.Tensor]) -> None:
    for tensor, view in zip(tensors, views, strict=True):
        tensor.data = view


class _Unit:
    """A group of weights with its pinned home copy; `.data` of each points home unless the unit is on the device."""

    def __init__(self, tensors: list[torch.Tensor], pin: bool) -> None:
        self.tensors = tensors
        self.layout = _Layout(tensors)
        self.home, self._registration = _host_buffer(self.layout.size, pin)
        self.home_views = self.layout.views(self.home)
        for view, tensor in zip(self.home_views, tensors):
            view.copy_(tensor.detach())
        self.go_home()  # the device copies they had are freed once nothing else holds them

    def go_home(self) -> None:
        _point(self.tensors, self.home_views)

    def free_home(self) -> None:
        """Drops the home copy (unlocked first where it was page-locked in place); the unit is done with."""
        self.home_views = []
        self._registration = None  # its __del__ unlocks the pages while it still holds the buffer
        self.home = torch.empty(0, dtype=torch.uint8)


class _Group:
    """Units brought in and let go together, into one device buffer: a component (the transformer: its embeddings
    and output layer, and the blocks not streamed)."""

    def __init__(self, members: list[_Unit]) -> None:
        self.members = members
        self.size = sum(member.layout.size for member in members)
        self.buffer: torch.Tensor | None = None  # on the device, while brought in
        self.ready: torch.cuda.Event | None = None
        self.users = 0


class Placement:
    """One replica's offloaded weights: `prefetch(unit)` starts bringing a unit in, `using(unit)` holds it on the
    device (and waits, on the current stream, for its copy), the last user lets it go. Replicas shared by several
    CPU "devices" count their users. The homes are made once; another `Offload` only regroups them (`configure`)."""

    def __init__(self, replica, offload: Offload) -> None:
        self.device = replica.device
        on_gpu = self.device.type == "cuda"
        self.copies = 0  # copies queued so far (a unit, or a block), and their bytes: what tests and the bench count
        self.bytes_copied = 0
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if on_gpu else None
        transformer, vae = replica.transformer, replica.vae
        self._owner = transformer.visual_transformer_blocks
        blocks = list(self._owner._modules.values())
        self._core = _Unit(_weights(transformer, skip=tuple(blocks)), on_gpu)  # embeddings, output layer
        self._blocks = [_Unit(_weights(block), on_gpu) for block in blocks]
        self.units: dict[str, _Group] = {
            "encoder": _Group([_Unit(_weights(vae.encoder), on_gpu)]),
            "decoder": _Group([_Unit(_weights(vae.decoder), on_gpu)]),
        }
        bank = replica.latent_upscaler
        if bank is not None:  # one unit per scale: a call runs one of them (x2's 1.4 GiB, x4's 2.7 GiB)
            for scale, model in zip(bank.config.scales, bank._models):
                self.units[upscaler_unit(scale)] = _Group([_Unit(_weights(model), on_gpu)])
            for tensor in _weights(bank, skip=tuple(bank._models)):  # none in diffusers 0.42.1: resident if any
                tensor.data = tensor.data.to(self.device)
        self.blocks: _BlockStream | None = None
        self.configure(offload)

    def configure(self, offload: Offload) -> None:
        """Which blocks come with the transformer and which stream (between calls; no copies)."""
        self.offload = offload
        resident = min(offload.resident_blocks, len(self._blocks)) if offload.layers else len(self._blocks)
        self.units["transformer"] = _Group([self._core, *self._blocks[:resident]])
        streamed = self._blocks[resident:]
        self.blocks = _BlockStream(self, streamed) if streamed else None
        if self.blocks is not None:
            self._owner.__class__ = StreamedBlocks
            self._owner.vsrq_stream = self.blocks
        elif isinstance(self._owner, StreamedBlocks):
            self._owner.__class__ = nn.ModuleList
            del self._owner.vsrq_stream

    @property
    def pinned_bytes(self) -> int:
        """Host bytes the homes take (page-locked on GPUs)."""
        return sum(unit.home.numel() for unit in self._all_units())

    def resident_bytes(self, *names: str) -> int:
        """Device bytes units `names` take while brought in (the transformer's with its block slots)."""
        size = sum(self.units[name].size for name in names if name in self.units)
        if "transformer" in names and self.blocks is not None:
            size += self.blocks.slot_bytes
        return size

    def prefetch(self, name: str) -> None:
        """Starts copying unit `name` to the device (nothing if it is there or on its way, or not offloaded)."""
        with self._lock:
            group = self.units.get(name)
            if group is None or group.buffer is not None:
                return
            # From the current stream's pool: one pool for weights and activations, each reusing the other's memory.
            group.buffer = buffer = torch.empty(group.size, dtype=torch.uint8, device=self.device)
            if self._stream is not None:
                buffer.record_stream(self._stream)  # freed early (a call that stops), it must outwait the copy
            pairs, offset = [], 0
            for member in group.members:
                place = buffer[offset : offset + member.layout.size]
                pairs.append((member.home, place))
                _point(member.tensors, member.layout.views(place))
                offset += member.layout.size
            group.ready = self._copy(pairs)

    @contextmanager
    def using(self, name: str) -> Iterator[None]:
        """Unit `name` on the device for the block's work, queued on the current stream behind its copy."""
        self._acquire(name)
        try:
            yield
        finally:
            self._release(name)

    def restore(self) -> None:
        """Every weight back on the device for good, as a resident replica has it (a resident mode takes over), and
        the homes freed now: the placement and its block stream refer to each other, so waiting for the last
        reference would keep gigabytes of pinned memory until a full garbage collection."""
        with self._lock:
            for unit in self._all_units():
                _point(unit.tensors, [view.to(self.device, copy=True) for view in unit.home_views])
                unit.free_home()
            if isinstance(self._owner, StreamedBlocks):
                self._owner.__class__ = nn.ModuleList
                del self._owner.vsrq_stream
            self.blocks = None

    def _all_units(self) -> list[_Unit]:
        return [self._core, *self._blocks, *(m for name, g in self.units.items() if name != "transformer" for m in g.members)]

    def _acquire(self, name: str) -> None:
        self.prefetch(name)
        with self._lock:
            group = self.units.get(name)
            if group is None:
                return
            if group.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(group.ready)
            group.users += 1
            if name == "transformer" and self.blocks is not None and group.users == 1:
                self.blocks.open()

    def _release(self, name: str) -> None:
        with self._lock:
            group = self.units.get(name)
            if group is None:
                return
            group.users -= 1
            if group.users:
                return
            # The device buffer goes back to the current stream's pool, behind the work queued on it.
            for member in group.members:
                member.go_home()
            group.buffer = group.ready = None
            if name == "transformer" and self.blocks is not None:
                self.blocks.close()

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        """Copies each home into its device place on the side stream, once `after` (default: the work queued on
        the current stream so far) is done; returns the event that ends the copies (None on a CPU)."""
        self.copies += 1
        self.bytes_copied += sum(home.numel() for home, _ in pairs)
        if self._stream is None:
            for home, place in pairs:
                place.copy_(home)
            return None
        # The memory may have held tensors the current stream still reads (freed by work queued before now): the
        # copy starts once that work is done, and runs beside whatever is queued after it.
        issued = torch.cuda.current_stream(self.device).record_event() if after is None else after
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(issued)
            for home, place in pairs:
                place.copy_(home, non_blocking=True)
            return self._stream.record_event()


class _BlockStream:
    """The transformer's streamed blocks: while the transformer is in use, a ring of `prefetch + 1` device slots of
    one block's layout; block j runs from slot j mod ring, copied in while the `prefetch` blocks before it run."""

    def __init__(self, placement: Placement, units: list[_Unit]) -> None:
        self.placement, self.units = placement, units
        self.layout = units[0].layout
        if not all(unit.layout.matches(self.layout) for unit in units):
            raise ValueError("streamed transformer blocks must share one layout")
        self.depth = placement.offload.prefetch
        self.ring = min(self.depth + 1, len(units))
        self.slot_bytes = self.ring * self.layout.size
        self.slots: list[torch.Tensor] = []
        self._one_forward = threading.Lock()  # replicas shared by CPU "devices": one stream of blocks at a time

    def open(self) -> None:
        device = self.placement.device
        self.slots = [torch.empty(self.layout.size, dtype=torch.uint8, device=device) for _ in range(self.ring)]
        if self.placement._stream is not None:
            for slot in self.slots:  # freed by a call that stopped part-way, a slot must outwait its copy
                slot.record_stream(self.placement._stream)
        self._slot_views = [self.layout.views(slot) for slot in self.slots]

    def close(self) -> None:
        self.slots, self._slot_views = [], []

    def run(self, blocks: list[nn.Module]) -> Iterator[nn.Module]:
        """The transformer's blocks in order, each streamed one on the device while (and only while) it is queued."""
        streamed = len(blocks) - len(self.units)
        if not self.slots:  # not inside the transformer's use (a module walk): the blocks as they are
            yield from blocks
            return
        yield from blocks[:streamed]
        device = self.placement.device
        on_gpu = device.type == "cuda"
        done: list[torch.cuda.Event | None] = [None] * self.ring  # the last block run from each slot
        ready: dict[int, torch.cuda.Event | None] = {}
        count = len(self.units)

        def issue(j: int) -> None:
            slot = j % self.ring
            ready[j] = self.placement._copy([(self.units[j].home, self.slots[slot])], after=done[slot])

        with self._one_forward:
            try:
                for j in range(min(self.depth, count)):
                    issue(j)
                for j in range(count):
                    if j + self.depth < count:
                        issue(j + self.depth)  # into the slot of block j - 1, once it has run
                    unit = self.units[j]
                    if on_gpu:
                        torch.cuda.current_stream(device).wait_event(ready.pop(j))
                    _point(unit.tensors, self._slot_views[j % self.ring])
                    yield blocks[streamed + j]
                    # Block j is queued (run, on a CPU): its slot is free once the device gets past this point.
                    done[j % self.ring] = torch.cuda.current_stream(device).record_event() if on_gpu else None
                    unit.go_home()
            finally:
                for unit in self.units:
                    unit.go_home()


class StreamedBlocks(nn.ModuleList):
    """The transformer's block list while its blocks are streamed: iterating it (the transformer's forward does,
    once per call) brings each block in ahead of its turn."""

    vsrq_stream: _BlockStream

    def __iter__(self) -> Iterator[nn.Module]:
        return self.vsrq_stream.run(list(self._modules.values()))


def place(replica, offload: Offload | None) -> Placement | None:
    """Puts `replica`'s weights where `offload` wants them (None: all resident on its device), undoing another
    placement first; nothing to do where they already are so."""
    current = replica.placement
    if current is not None and current.offload == offload:
        return current
    if current is not None and offload is not None:
        current.configure(offload)  # the homes stay: nothing moves to the device and back
        return current
    if current is not None:
        current.restore()
        replica.placement = None
    if offload is None:
        for module in replica.modules().values():
            module.to(replica.device)
        return None
    replica.placement = Placement(replica, offload)
    return replica.placement


def align_on_cpu(replica) -> None:
    """A CPU replica's weights that sit unaligned (a checkpoint file's mapping keeps each tensor at its byte offset
    in the file) get memory of their own: CPU kernels round differently on unaligned operands (the tiny model's
    output moved by 4e-7), and offloaded homes are aligned, so resident weights must be too."""
    for module in replica.modules().values():
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor.device.type == "cpu" and tensor.data_ptr() % 64:
                tensor.data = tensor.data.clone()  # the CPU allocator aligns to 64 bytes


def upscaler_unit(scale: int) -> str:
    """The unit of the latent upscaler bank's model for `scale`."""
    return f"latent_upscaler_x{scale}"


class _Resident:
    """The placement of resident weights: nothing to bring in or let go."""

    offload = None
    pinned_bytes = 0

    def prefetch(self, name: str) -> None:
        pass

    @contextmanager
    def using(self, name: str) -> Iterator[None]:
        yield


RESIDENT = _Resident()


def placement_of(replica) -> Placement | _Resident:
    return replica.placement if replica.placement is not None else RESIDENT
