"""Model calls from several device threads while compiled code may still be built.

While Dynamo traces in one thread it patches `nn.Module.__call__` for every thread, so a forward in another thread
fails ("FX to symbolically trace a dynamo-optimized function"). An engine call of a new signature (its shapes, tile
count and decode order) may compile at any of its model calls, so they run one at a time, whatever their device.
Once a call of that signature has succeeded, the graphs it needs exist, and later calls run side by side. An engine
runs one call at a time (a worker runs one job at a time), so no other call can be compiling meanwhile.

Gating only the first model call of each (device, input shape) was not enough on two H200s: the first 2-GPU W1 call
failed so (`bench/RESULTS.md`), most likely because a later call of a seen (device, shape) compiled again while the
other GPU ran. A candidate, found later: a tile handed to the other GPU arrived in another memory layout, and its
decoder graphs were built anew (fixed since: W1 on 2 GPUs builds 56 graphs instead of 83; not re-tried without the
gate).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext


class CompileGate:
    def __init__(self) -> None:
        self._succeeded: set[Hashable] = set()
        self._one_at_a_time = threading.Lock()

    @contextmanager
    def call(self, signature: Hashable, gated: bool = True) -> Iterator[Callable[[], AbstractContextManager]]:
        """Around one engine call: yields the context every model call of it runs in (`gated`: whether anything
        compiles at all)."""
        first = gated and signature not in self._succeeded
        yield (lambda: self._one_at_a_time) if first else nullcontext
        self._succeeded.add(signature)  # not reached when the call failed: it may have left a compilation unfinished
