"""The compile gate with real threads: a call with a new key never shares the gate; calls with seen keys do."""

from __future__ import annotations

import threading
import time

from worker.sr.compile_gate import CompileGate


def test_a_new_key_runs_alone_and_seen_keys_run_together():
    gate, lock = CompileGate(), threading.Lock()
    inside: list[str] = []
    overlaps: list[tuple[str, ...]] = []

    def call(key: str, name: str) -> None:
        with gate.call(key):
            with lock:
                if inside:
                    overlaps.append((name, *inside))
                inside.append(name)
            time.sleep(0.05)
            with lock:
                inside.remove(name)

    def together(*calls: tuple[str, str]) -> None:
        threads = [threading.Thread(target=call, args=args) for args in calls]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    together(("a", "a1"), ("a", "a2"), ("b", "b1"))  # every key new: one at a time
    assert overlaps == []
    together(("a", "a3"), ("b", "b2"), ("a", "a4"))  # all seen: side by side
    assert len(overlaps) >= 1
    overlaps.clear()
    together(("a", "a5"), ("c", "c1"), ("b", "b3"), ("a", "a6"))  # c is new: it never shares
    assert not any("c1" in overlap for overlap in overlaps)


def test_a_failed_call_leaves_its_key_new():
    gate = CompileGate()
    try:
        with gate.call("k"):
            raise RuntimeError("the compilation failed")
    except RuntimeError:
        pass
    entered = threading.Event()

    def other() -> None:
        with gate.call("seen-later"):
            entered.set()

    with gate.call("k"):  # runs alone again: nothing else gets in meanwhile
        thread = threading.Thread(target=other)
        thread.start()
        assert not entered.wait(0.2)
    thread.join()
    assert entered.is_set()
