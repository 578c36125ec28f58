"""The compile gate with real threads: the model calls of a call of a new signature never overlap; once such a call
succeeded, calls of that signature do."""

from __future__ import annotations

import threading
import time

import pytest

from worker.sr.compile_gate import CompileGate


def overlaps_in(gate: CompileGate, signature: str, threads: int = 3) -> int:
    """Model calls (50 ms each, 2 per thread) of one gated call that found another inside."""
    lock, inside, overlaps = threading.Lock(), [0], [0]

    def device(model_call) -> None:
        for _ in range(2):
            with model_call():
                with lock:
                    overlaps[0] += inside[0] > 0
                    inside[0] += 1
                time.sleep(0.05)
                with lock:
                    inside[0] -= 1

    with gate.call(signature) as model_call:
        workers = [threading.Thread(target=device, args=(model_call,)) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    return overlaps[0]


def test_a_new_signature_runs_its_model_calls_one_at_a_time_then_side_by_side():
    gate = CompileGate()
    assert overlaps_in(gate, "W1") == 0
    assert overlaps_in(gate, "W1") > 0  # it succeeded once: every graph exists
    assert overlaps_in(gate, "W3") == 0  # another signature is new again


def test_a_failed_call_leaves_its_signature_new():
    gate = CompileGate()
    with pytest.raises(RuntimeError), gate.call("W1"):
        raise RuntimeError("the compilation failed")
    assert overlaps_in(gate, "W1") == 0
