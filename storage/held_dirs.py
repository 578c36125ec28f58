"""Directories a process holds for its life on a local disk: a worker's job scratch and prefetch cache, the API's
metrics samples.

Each is held by a lock file its process flock's: one nobody holds is a dead process's (`kill -9`, the OOM killer), and
the next directory made with its prefix removes it. A killed worker's job scratch held its input and raw frames,
gigabytes at real sizes, until the disk filled. flock, not a PID: it works across PID namespaces sharing the volume,
where a PID says nothing (a container's first process is PID 1 at every start).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path

_LOCK = "lock"  # flock'ed by the directory's process for its life
_GRACE_S = 60  # a hidden directory younger than this may be being made


def held_directory(prefix: str, root: Path | None = None) -> tuple[Path, int]:
    """A new directory named `prefix`… under `root` (the temporary directory), and the descriptor of its lock file,
    flock'ed: the directory is this process's while the descriptor stays open (in it or in a process it forks or
    execs that inherits it). Dead processes' directories of the same prefix are removed first. It is made under a
    hidden name and shown once locked, so that a sweep never sees a live one unlocked (its lock file made, not yet
    locked: a sweep in between deleted a live job's scratch)."""
    root = root or Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{prefix}*"):
        if _abandoned(stale):
            shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f".{prefix}*"):  # its process killed before it showed it
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > _GRACE_S:
                shutil.rmtree(stale, ignore_errors=True)
    hidden = Path(tempfile.mkdtemp(prefix=f".{prefix}", dir=root))
    held = os.open(hidden / _LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    directory = hidden.with_name(hidden.name[1:])
    hidden.rename(directory)
    return directory, held


def release(directory: Path, held: int) -> None:
    """Removes a `held_directory` and lets go of it."""
    shutil.rmtree(directory, ignore_errors=True)
    os.close(held)


def _abandoned(directory: Path) -> bool:
    """Whether a held directory is a dead process's: this user's, and its lock file held by no process."""
    try:
        if directory.stat().st_uid != os.geteuid():
            return False
        handle = os.open(directory / _LOCK, os.O_RDWR)
    except FileNotFoundError:  # none: made before lock files were (or gone already)
        return directory.exists()
    except OSError:
        return False
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # its process is alive
        return False
    finally:
        os.close(handle)
    return True
