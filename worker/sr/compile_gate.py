"""Model calls from several device threads while compiled code may still be built.

While Dynamo traces a new shape in one thread it patches `nn.Module.__call__` for every thread, so a forward in
another thread fails ("FX to symbolically trace a dynamo-optimized function"). A call whose key (its device and
input shapes) the gate has not seen succeed may compile: it runs alone. Calls with seen keys run side by side, so
only the first call of each new shape is serialised, not the whole job that brings it.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager


class CompileGate:
    def __init__(self) -> None:
        self._seen: set[Hashable] = set()
        self._state = threading.Condition()
        self._inside = 0  # calls with seen keys, side by side
        self._alone = False  # a call with a new key is inside
        self._queued = 0  # calls with new keys waiting: they go first, or a stream of others would starve them

    @contextmanager
    def call(self, key: Hashable) -> Iterator[None]:
        with self._state:
            alone = key not in self._seen
            if alone:
                self._queued += 1
                self._state.wait_for(lambda: not self._alone and not self._inside)
                self._queued -= 1
                self._alone = True
            else:
                self._state.wait_for(lambda: not self._alone and not self._queued)
                self._inside += 1
        succeeded = False
        try:
            yield
            succeeded = True
        finally:
            with self._state:
                if alone:
                    self._alone = False
                    if succeeded:  # a failed call may have left its compilation unfinished
                        self._seen.add(key)
                else:
                    self._inside -= 1
                self._state.notify_all()
