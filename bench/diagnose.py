"""Where a run leaves its GPU idle: the kernels' busy time against the wall (torch.profiler) and every host-device
synchronisation by the line of ours or diffusers' that asked for it (`torch.cuda.set_sync_debug_mode`).

    with Diagnosis() as diagnosis:
        engine.upscale(...)
    diagnosis.record()  # {"wall_s", "gpu_kernel_s", "gpu_idle_s", "gaps_over_1ms", "syncs": [...]}

A synchronisation stalls the host until the GPU has drained its queue: the GPU then idles while the host launches
its next kernels. Few are harmless on W1's second-long calls; on a clip of many small tiles they add up. CPUs have
no kernels and no synchronisations: there the record has the wall and no GPU figures.
"""

from __future__ import annotations

import time
import traceback
import warnings
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import torch

# Frames worth naming: the product's code and the model's (diffusers); torch's own frames say nothing actionable.
_OURS = ("/worker/", "/bench/", "/tests/", "/diffusers/")
SYNC_WARNING = "synchronizing CUDA operation"  # the text torch's sync debug mode warns with


class Diagnosis:
    """A context: everything run inside it is profiled and its synchronisations counted (`record()` after)."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.syncs: Counter[str] = Counter()
        self._context = ExitStack()
        self._profile = None
        self._started = self._wall = 0.0

    def __enter__(self) -> Diagnosis:
        from torch.profiler import ProfilerActivity, profile

        self._context.enter_context(warnings.catch_warnings())  # puts the filters and `showwarning` back on exit
        shown = warnings.showwarning
        # process-wide: the engine's device threads warn from its pool
        warnings.showwarning = lambda message, *rest: self._warned(shown, message, *rest)
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}.*")
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            self._context.callback(torch.cuda.set_sync_debug_mode, "default")
        activities = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
        self._profile = self._context.enter_context(profile(activities=activities))
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._wall = time.perf_counter() - self._started
        self._context.__exit__(*exc)

    def _warned(self, shown, message, *rest) -> None:
        if SYNC_WARNING in str(message):
            self.syncs[call_site(traceback.extract_stack()[:-2])] += 1  # less this frame and the lambda's
        else:
            shown(message, *rest)

    def record(self) -> dict:
        record = {"wall_s": round(self._wall, 3)}
        if self.cuda:
            kernels = [(e.time_range.start, e.time_range.end) for e in self._profile.events() if _is_kernel(e)]
            busy, gaps = kernel_busy(kernels)
            record |= {
                "gpu_kernel_s": round(busy / 1e6, 3),
                "gpu_idle_s": round(self._wall - busy / 1e6, 3),
                "gaps_over_1ms": {"count": len(gaps), "s": round(sum(gaps) / 1e6, 3)},
            }
        record["syncs"] = [{"where": where, "count": count} for where, count in self.syncs.most_common()]
        return record


def _is_kernel(event) -> bool:
    kind = getattr(event, "device_type", None)
    return kind == torch.autograd.DeviceType.CUDA and event.time_range.end > event.time_range.start


def kernel_busy(intervals: list[tuple[float, float]], gap: float = 1000.0) -> tuple[float, list[float]]:
    """The union of `intervals` (µs) and the idle gaps between them longer than `gap` µs."""
    busy, gaps, end = 0.0, [], None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            if end is not None and start - end > gap:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy, gaps


def call_site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of ours (or diffusers') in `stack`, with the one of ours that called into it, e.g.
    "worker/sr/engine.py:640 _denoise" or
    "diffusers/schedulers/scheduling_piflow.py:130 policy_rollout_fm < worker/sr/engine.py:653 _denoise"."""
    named = [frame for frame in stack if any(part in frame.filename for part in _OURS)]
    if not named:
        return "elsewhere"

    def short(frame: traceback.FrameSummary) -> str:
        path = Path(frame.filename)
        parts = path.parts
        for root in ("worker", "bench", "tests", "diffusers"):
            if root in parts:
                path = Path(*parts[len(parts) - 1 - parts[::-1].index(root) :])
                break
        return f"{path}:{frame.lineno} {frame.name}"

    innermost = named[-1]
    if "/diffusers/" in innermost.filename:
        caller = next((frame for frame in reversed(named) if "/diffusers/" not in frame.filename), None)
        if caller is not None:
            return f"{short(innermost)} < {short(caller)}"
    return short(innermost)
