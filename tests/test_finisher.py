"""worker.finisher on real threads: a job's tail handed behind a long one (a 4K flush and check) does not hold the
task that hands it, so its worker takes the next job; tails still run one at a time, in order, and only so many
are held."""

import gc
import shutil
import threading
import weakref
from time import monotonic

from worker.finisher import Finisher
from worker.scratch import has_room


def test_a_tail_handed_behind_a_long_one_does_not_hold_its_task_and_runs_after_it():
    finisher = Finisher(held=2)
    release, ran, turns = threading.Event(), [], []

    def long_tail(turn):
        ran.append(turn(0))  # nothing before it: its turn at once
        release.wait(30)
        ran.append("long")

    def short_tail(turn):
        while not turn(0.01):
            turns.append(False)
        ran.append("short")

    finisher.hand(long_tail, lambda: 7.0)
    handed = monotonic()
    assert finisher.room(0)  # the second task hands its tail at once: it returns, its worker takes the next job
    finisher.hand(short_tail, lambda: 0.0)
    handed = monotonic() - handed
    assert not finisher.room(0.05)  # two held: a third task waits for the oldest tail
    assert ran in ([], [True]) and finisher.busy()
    assert finisher.silent_s() == 7.0  # the running tail's, which a stuck tail's check reads
    release.set()
    assert finisher.wait(30) and not finisher.busy()
    assert ran == [True, "long", "short"]  # one at a time, in the order handed
    assert turns and not any(turns)  # the short one waited its turn, its own thread calling back
    assert finisher.room(0)
    assert handed < 1.0, handed


def test_a_tail_that_fails_lets_the_next_one_run():
    finisher = Finisher(held=2)
    ran = []

    def failing(turn):
        raise RuntimeError("a bug")

    def following(turn):
        while not turn(0.01):
            pass
        ran.append("following")

    finisher.hand(failing, lambda: 0.0)
    finisher.hand(following, lambda: 0.0)
    assert finisher.wait(30)
    assert ran == ["following"]


def test_no_tail_is_handed_while_the_held_ones_leave_the_disk_without_room_for_the_next_job(tmp_path):
    """Room for a tail also needs free disk (`fits`: worker.scratch.has_room on the scratch disk) while any is held:
    the task waits for the held tail to end; with none held, waiting frees nothing, so it is handed at once."""
    finisher = Finisher(held=3)
    release = threading.Event()
    finisher.hand(lambda turn: release.wait(30), lambda: 0.0)
    free = shutil.disk_usage(tmp_path).free
    assert finisher.room(0, lambda: has_room(tmp_path, free // 2))  # one of three held, the disk roomy
    started = monotonic()
    assert not finisher.room(0.2, lambda: has_room(tmp_path, 2 * free))  # a slot free, the disk not: it waits
    assert monotonic() - started >= 0.2
    release.set()
    assert finisher.room(30, lambda: has_room(tmp_path, 2 * free))  # the held tail ended: nothing left to wait for
    assert not finisher.busy()


def test_the_tails_waiting_behind_a_stuck_one_are_waited_for_not_the_stuck_one():
    """At a stuck tail's exit, the worker gives the tails waiting their turn behind it time to send their jobs back:
    it waits for those, not for the stuck one, whose call never returns."""
    finisher = Finisher(held=3)
    stuck, behind = threading.Event(), []

    def stuck_tail(turn):
        stuck.wait(30)

    def waiting_tail(turn):
        turn(0.05)  # sees the one ahead still running: its job goes back to the queue
        behind.append("requeued")

    finisher.hand(stuck_tail, lambda: 99.0)
    finisher.hand(waiting_tail, lambda: 0.0)
    finisher.hand(waiting_tail, lambda: 0.0)
    began = monotonic()
    assert finisher.wait_behind(10)
    assert behind == ["requeued", "requeued"] and finisher.busy()
    assert monotonic() - began < 5
    stuck.set()
    assert finisher.wait(30)


def test_a_tail_that_has_ended_is_not_kept_until_the_next_one_is_handed():
    """The task hands `tail.silent_s`, a bound method of the job's tail (its encoder, the writer's streams and their
    FFmpeg threads, the job's record): once the tail's thread has ended, nothing of it stays referenced, though no
    other tail is handed after it (the worker's last job before an idle spell)."""

    class Tail:  # stands for worker.tasks._Tail
        def silent_s(self):
            return 0.0

    refs, go = [], threading.Event()
    finisher = Finisher(held=2)

    def hand():  # as the task does: its tail is referred to by the finisher alone once it returns
        tail = Tail()
        refs.append(weakref.ref(tail))
        finisher.hand(lambda turn: go.wait(30) and tail.silent_s(), tail.silent_s)

    hand()
    go.set()
    assert finisher.wait(30) and not finisher.busy()
    gc.collect()
    assert refs[0]() is None  # with the finisher's list holding (thread, silent_s), kept until the next `room`/`hand`
    assert finisher.silent_s() == 0.0 and finisher.room(0)
