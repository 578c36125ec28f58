"""Device threads of an engine call while compiled code may still be built.

An engine call of a new signature (its shapes, tile count and decode order) may compile at any of its model calls.
Its devices then take turns in slot order: each device does its whole share of the call, building its graphs,
before the next one starts. Once a call of that signature has succeeded, its graphs exist for every device, and
later calls run the devices side by side. An engine runs one call at a time (a worker runs one job at a time), so
no other call can be compiling meanwhile. Two failures measured on two H200s (`bench/RESULTS.md`) made it so:

- Dynamo tracing in one thread patches `nn.Module.__call__` for every thread: a forward in another thread fails
  ("FX to symbolically trace a dynamo-optimized function"). Gating only the first model call of each (device,
  shape) let that happen on the first 2-GPU W1 call.
- With model calls one at a time but devices alternating, the 2-GPU output stopped matching the 1-GPU one,
  reproducibly (W1 17 frames, max |delta| 0.0126 with the transformer's blocks alone compiled, 0.0088 with the
  decoder's alone; eager runs match). Compiling one GPU's whole call, synchronised, before the other's gave the
  same bits on one GPU, on the other and on both; which difference matters to Inductor was not found. The turns
  reproduce those conditions within one call (each device's share ends with its GPU idle: `engine`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

# slot -> the context a device thread's whole share of an engine call runs in
Turns = Callable[[int], AbstractContextManager[None]]


class CompileGate:
    def __init__(self) -> None:
        self._succeeded: set[Hashable] = set()

    @contextmanager
    def call(self, signature: Hashable, gated: bool = True) -> Iterator[Turns]:
        """Around one engine call: yields `turn(slot)`, which each of its device threads (slots 0, 1, ...) runs
        inside (`gated`: whether anything compiles at all)."""
        first = gated and signature not in self._succeeded
        yield _InOrder().turn if first else _side_by_side
        self._succeeded.add(signature)  # not reached when the call failed: it may have left a compilation unfinished


def _side_by_side(slot: int) -> AbstractContextManager[None]:
    return nullcontext()


class _InOrder:
    """Slots one after another, in slot order; a slot that fails still hands the turn on."""

    def __init__(self) -> None:
        self._next = 0
        self._changed = threading.Condition()

    @contextmanager
    def turn(self, slot: int) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: self._next == slot)
        try:
            yield
        finally:
            with self._changed:
                self._next += 1
                self._changed.notify_all()
