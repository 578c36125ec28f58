"""Child processes that end when the process that started them ends, however it ends.

The embedded stack starts each service in a session of its own (a Ctrl-C meant for `vsrq dev` must reach them only
through its orderly stop). A parent killed hard (SIGKILL, a closed terminal, an OOM kill) runs no stop at all, so the
kernel is asked to signal each child when its parent dies: Linux's parent-death signal (prctl PR_SET_PDEATHSIG). It is
not inherited by grandchildren: a child that forks its own workers (gunicorn) asks the same for them (gunicorn.conf.py).
Elsewhere (macOS) there is no such signal and this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Looked up once here, not in the forked child: the child of a threaded parent should do as little as it can.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(sig: signal.Signals, parent: int) -> None:
    """In a freshly forked process: receive `sig` when `parent` (its parent's thread that forked it) ends.

    The kernel ties the signal to the thread that forked, so start long-lived children from a thread that lives as long
    as they should (the main thread)."""
    if _prctl is None:
        return
    if _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the call above took effect: no signal would come
        os.kill(os.getpid(), sig)


def ending_with_this_process(sig: signal.Signals) -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child gets `sig` when the calling process (its thread) ends.

    SIGTERM for a process that stops cleanly and promptly on it (Redis, gunicorn's master, which then stops its
    workers); SIGKILL for one whose graceful stop could wait on a job or hang (the Celery workers, weed)."""
    parent = os.getpid()
    return lambda: die_with_parent(sig, parent)
