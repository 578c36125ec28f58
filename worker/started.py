"""When this process started, by the operating system's clock: the interpreter's start and the imports count too,
which a timer started by the worker's own code would miss. The worker logs each step of its start against it."""

from __future__ import annotations

import os
import time

import psutil


def seconds() -> float:
    """Seconds since this process started."""
    try:
        # Linux: the start in clock ticks since boot, against the boot clock (to 10 ms; psutil's wall-clock start
        # rests on a boot time in whole seconds)
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError, IndexError):
        return time.time() - psutil.Process().create_time()
