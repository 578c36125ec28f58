"""The compile gate with real threads: in a call of a new signature the devices take turns in slot order, each
doing its whole share before the next starts; once such a call succeeded, calls of that signature run them side by
side; a failing device hands its turn on."""

from __future__ import annotations

import threading
import time

import pytest

from worker.sr.compile_gate import CompileGate


def trace_of(gate: CompileGate, signature: str, slots: int = 3, fail: int | None = None) -> list[tuple[str, int]]:
    """("enter" or "leave", slot) of each model call (20 ms each, 2 per slot) of one call; threads start in reverse
    slot order, so that only the gate can put them in order. Slot `fail` raises before its first model call."""
    lock, trace = threading.Lock(), []

    def device(turn, slot: int) -> None:
        try:
            with turn(slot):
                if slot == fail:
                    raise RuntimeError("compilation failed")
                for _ in range(2):
                    with lock:
                        trace.append(("enter", slot))
                    time.sleep(0.02)
                    with lock:
                        trace.append(("leave", slot))
        except RuntimeError:
            pass

    with gate.call(signature) as turn:
        workers = [threading.Thread(target=device, args=(turn, slot)) for slot in reversed(range(slots))]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=10)
        assert not any(worker.is_alive() for worker in workers), "a device waits for a turn that never comes"
    return trace


def in_turns(trace: list[tuple[str, int]]) -> bool:
    """Whether every slot's model calls all came before the next slot's, slots in order."""
    slots = [slot for _, slot in trace]
    return slots == sorted(slots)


def test_a_new_signature_runs_devices_one_after_another_in_slot_order_then_side_by_side():
    gate = CompileGate()
    assert in_turns(trace_of(gate, "W1"))
    assert not in_turns(trace_of(gate, "W1"))  # it succeeded once: every device's graphs exist
    assert in_turns(trace_of(gate, "W3"))  # another signature is new again


def test_a_failing_device_hands_its_turn_on():
    trace = trace_of(CompileGate(), "W1", fail=1)
    assert in_turns(trace) and {slot for _, slot in trace} == {0, 2}


def test_a_failed_call_leaves_its_signature_new():
    gate = CompileGate()
    with pytest.raises(RuntimeError), gate.call("W1"):
        raise RuntimeError("the compilation failed")
    assert in_turns(trace_of(gate, "W1"))
