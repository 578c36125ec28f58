"""Big blocks (a job's frames) straight from the system and back to it when freed, not kept in glibc's arenas: a
fixed mmap threshold, set once at the worker's start.

glibc serves a block of 128 KiB or more with an mmap of its own, unmapped once freed, but raises that threshold to the
size of any such block freed, up to 32 MiB. After a job's first big frames, frames (6 MB at 1080p, 25 MB at 4K) came
from the arenas of the threads that allocate them (the engine's, the encoder's and decoder's, x264's, FFmpeg's, the
tail's: up to 8 arenas per core), which keep a freed block resident, among live ones, for reuse: the worker's RSS grew
job after job with no reference kept (bench/RESULTS.md, issue 22 item 5). A threshold set with `mallopt` stays put;
the price is page faults, a big block being mapped afresh each time (measured there too).
Elsewhere (musl, a preloaded jemalloc) this does nothing; a threshold the operator set (MALLOC_MMAP_THRESHOLD_,
GLIBC_TUNABLES) is kept.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("vsrq.worker")

M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc's malloc.h)
MMAP_THRESHOLD = 2**20  # blocks of 1 MiB or more: a 720p frame (2.8 MB) and up, not the many small ones


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Sets glibc's mmap threshold for the rest of the process: whether it was set here."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's C library: glibc's, if it is glibc
    except (OSError, AttributeError):
        return False
    if not mallopt(M_MMAP_THRESHOLD, threshold):
        log.warning("glibc refused an mmap threshold of %d bytes: big freed blocks may stay resident", threshold)
        return False
    return True
