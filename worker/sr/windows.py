"""Clips longer than one model window, in overlapping temporal windows over any upscaler.

A window is a run of input frames, 1 + 4k long so the model pads nothing; neighbours share `overlap` frames, which
are crossfaded in float (a raised-cosine ramp) before anything is quantised, so boundaries show no seam. Frames go
to the sink as the upscaler finishes them: only the current window's input and the previous window's overlap tail
are ever held (and the previous window's input, where it was replayed without its tail), so memory does not grow
with the clip. Each window draws its own noise (`noise_key=(index,)`).

Finished windows can be kept in a `WindowStore`; a rerun of the same job replays them instead of computing them.
Each kept window says what made it (its `RunInfo`: the tier, its levers as they ran, the split): an output is never
a mix of windows made in different ways, and one replayed whole reports what made its pixels.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from time import perf_counter
from typing import Protocol

import numpy as np
import torch

from worker.errors import Cancelled, InvalidRequest
from worker.frames import dequantise, quantise
from worker.sr.request import FrameSink, Progress, RunInfo, SRRequest

DEFAULT_WINDOW = 121  # frames the released checkpoint was trained on (5 s at 24 fps)
DEFAULT_OVERLAP = 16  # at most half a shorter window (`overlap_for`)


@dataclass(frozen=True)
class Window:
    index: int
    start: int  # input frames [start, stop)
    stop: int

    @property
    def frames(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class WindowPlan:
    frames: int
    length: int  # frames per window (the last may be shorter)
    overlap: int
    windows: tuple[Window, ...]

    def ramp(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Weight of the incoming window over the overlap, (overlap, 1, 1, 1), strictly between 0 and 1."""
        steps = torch.arange(1, self.overlap + 1, dtype=torch.float32, device=device) / (self.overlap + 1)
        return (0.5 - 0.5 * torch.cos(math.pi * steps)).view(-1, 1, 1, 1)

    def finished_frames(self, window: Window) -> int:
        """Output frames final once `window` is done: all but the tail the next window fades into."""
        return window.frames - (self.overlap if window.index < len(self.windows) - 1 else 0)

    @property
    def tails_stand_alone(self) -> bool:
        """Whether a window's tail is its own frames alone, none of them faded into from the window before (windows
        at least twice the overlap long): then it can be computed again from the window's input alone, and a store
        may drop it once the next window is kept."""
        return self.length >= 2 * self.overlap


def overlap_for(window: int, overlap: int | None) -> int:
    """The overlap asked for, else the default as far as `window` takes it: `--window 9` alone was refused for the
    default's 16 frames, which the person never gave."""
    return min(DEFAULT_OVERLAP, (window - 1) // 2) if overlap is None else overlap


def plan_windows(frames: int, window: int = DEFAULT_WINDOW, overlap: int | None = None) -> WindowPlan:
    """As few windows as cover `frames` with at most `window` frames each, all of one balanced length."""
    overlap = overlap_for(window, overlap)
    if window < 5 or (window - 1) % 4:
        raise InvalidRequest(f"the window must be 1 + 4k frames (5, 9, ..., 121), got {window}")
    if not 0 <= 2 * overlap < window:
        raise InvalidRequest(f"the window overlap must be in [0, {(window - 1) // 2}] frames, got {overlap}")
    if frames < 1:
        raise InvalidRequest("a clip needs at least one frame")
    if frames <= window:
        return WindowPlan(frames, frames, overlap, (Window(0, 0, frames),))
    count = window_count(frames, window, overlap)
    # Shortest 1 + 4k length with which `count` windows cover the clip: never longer than `window`.
    length = 1 + 4 * math.ceil((math.ceil((frames + (count - 1) * overlap) / count) - 1) / 4)
    stride = length - overlap
    windows = tuple(Window(i, i * stride, min(i * stride + length, frames)) for i in range(count))
    return WindowPlan(frames, length, overlap, windows)


def window_count(frames: int, window: int = DEFAULT_WINDOW, overlap: int | None = None) -> int:
    """How many windows `plan_windows` cuts `frames` into, without making them (a bound on a header's claim)."""
    overlap = overlap_for(window, overlap)
    return 1 if frames <= window else math.ceil((frames - overlap) / (window - overlap))


@dataclass(frozen=True)
class WindowProgress:
    window: int  # index of the window being worked on
    windows: int
    stage: str  # the upscaler's stage, or "restored" for a window replayed from the store
    done: int  # the upscaler's units within this window
    total: int
    tiles: int | None  # tiles per window, once the first window has told

    @property
    def fraction(self) -> float:
        return (self.window + (self.done / self.total if self.total else 1.0)) / self.windows


@dataclass(frozen=True)
class WindowsRun:
    windows: int
    restored: int  # windows replayed from the store
    runs: tuple[RunInfo, ...]  # one per computed window
    made: tuple[RunInfo, ...] = ()  # one per window, in order: what computed it (here, or in the run that kept it)
    # seconds around the upscaler's calls, inside the engine's span but not its work: `frames_in` (the window's input
    # frames taken from the decoder and made a tensor), `kept` (each window's commit to the store as the engine's
    # thread waits for it: its tail and marker written, its upload handed on; its raw frames are written as they come,
    # inside the upscaler's calls)
    host_s: dict[str, float] = field(default_factory=dict)


class KeptWindowsDisagree(Exception):
    """A window computed now was made otherwise than the kept windows already replayed before it (e.g. cuDNN's FP8
    attention where they were emulated): the output would mix the two. The caller drops the kept windows and starts
    over (`upscale.begin_upscale`)."""


# --- keeping finished windows ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredWindow:
    pixels: np.ndarray  # (n, H, W, 3) uint8 (uint16 for a 10-bit output): the window's finished frames, exactly as
    # the encoder got them
    tail: torch.Tensor | None  # (overlap, 3, H, W) float32: its last frames before the crossfade, None if last
    made: RunInfo  # what computed it (no timings)


class WindowRecorder(Protocol):
    def add(self, pixels: np.ndarray) -> None: ...

    # `supersedes`: the window's replay makes the previous window's tail useless (`WindowPlan.tails_stand_alone`)
    def commit(self, tail: torch.Tensor | None, made: RunInfo, supersedes: bool = True) -> None: ...


class WindowStore(Protocol):
    def load(self, index: int) -> StoredWindow | None: ...

    # Every window is recorded; `last` (the job's last window, whose frames go straight into the encoder) lets a store
    # whose keeping costs the output's tail (a blob store's upload, joined before the job ends) decide at its commit
    # whether to keep it (worker.kept_windows)
    def record(self, index: int, last: bool = False) -> WindowRecorder: ...

    def drop(self) -> None:
        """Forget every kept window (the store stays usable for this key)."""

    def join(self) -> float:
        """Waits for what the store does in the background (a blob store's uploads), raising what stopped it; the
        seconds that work took (0 for a store that does it all in `commit`)."""


class DirectoryWindowStore:
    """Finished windows as raw files in a directory: the frames as the encoder got them, 8-bit or 16-bit (as big as
    the raw output of those windows; the JSON names the sample type) and the float overlap tail. `key` names the job
    (input, model, options): windows kept for another key are deleted, so a stale window can never be replayed into a
    different job. Only the store's own files are ever deleted: a directory holding others is refused
    (`refuse_foreign`)."""

    MARKER = "job.json"  # {"key": key}: the job the windows were computed for
    _OWN = re.compile(r"window-\d{5,}\.(json|json\.partial|u8|u8\.partial|tail\.npy|mkv)|job\.json\.partial")

    def __init__(self, directory: str | Path, key: str, drop_superseded_tails: bool = True) -> None:
        """`drop_superseded_tails`: a window's tail goes once the next window is kept (`superseded_tail`)."""
        self.directory, self.drop_superseded_tails = Path(directory), drop_superseded_tails
        self.refuse_foreign(self.directory)
        marker = self.directory / self.MARKER
        if marker.exists() and _marker_key(marker) != key:
            self.drop()
        self.directory.mkdir(parents=True, exist_ok=True)
        _write_whole(marker, {"key": key})  # whole or absent: a half-written one refused the folder

    @classmethod
    def refuse_foreign(cls, directory: Path) -> None:
        """Raises InvalidRequest where `directory` is not a store's (a file, or a folder holding other files): its
        windows are deleted once the video is done, and a user's folder named by mistake must lose nothing."""
        if directory.exists() and not directory.is_dir():
            raise InvalidRequest(f"{directory} is a file: windows are kept in a folder (name a new or empty one)")
        marker = directory / cls.MARKER
        foreign = sorted(
            path.name
            for path in (directory.iterdir() if directory.is_dir() else ())
            if not (cls._OWN.fullmatch(path.name) or (path == marker and _marker_key(path) is not None))
        )
        if foreign:
            raise InvalidRequest(
                f"{directory} holds files that are not kept windows ({', '.join(foreign[:3])}"
                f"{', …' if len(foreign) > 3 else ''}): name a new or empty folder (its windows are deleted once the "
                "video is done)"
            )

    def kept(self) -> bool:
        """Whether any window is kept here (a rerun would replay it)."""
        return any(self.directory.glob("window-*.json"))

    def load(self, index: int) -> StoredWindow | None:
        kept = _read_whole(self._path(index, "json"))
        if kept is None:  # none, or not this store's writing (it writes JSON whole): computed again
            return None
        # kept by a version that did not say what made it, or says it in a way this one cannot read: computed again
        made, layout = RunInfo.of_kept(kept.get("made")), _frame_layout(kept)
        if made is None or layout is None:
            return None
        shape, dtype, pixels_path = layout[0], np.dtype(layout[1]), self._path(index, "u8")
        # a pixel file missing or not the JSON's (files that did not come from one commit): computed again, not a crash
        if not pixels_path.exists() or pixels_path.stat().st_size != math.prod(shape) * dtype.itemsize:
            return None
        pixels = np.memmap(pixels_path, dtype=dtype, mode="r", shape=shape)
        tail_path = self._path(index, "tail.npy")
        tail = torch.from_numpy(np.load(tail_path)) if tail_path.exists() else None
        return StoredWindow(pixels, tail, made)

    def frame_layout(self, index: int) -> tuple[tuple[int, ...], str] | None:
        """The shape and dtype of the frames kept for window `index`, as its JSON says; None where it says none."""
        kept = _read_whole(self._path(index, "json"))
        return None if kept is None else _frame_layout(kept)

    def record(self, index: int, last: bool = False) -> _DirectoryRecorder:
        # a local directory (`vsrq upscale --keep-windows`) keeps every window, the last too: a rerun replays them all
        return _DirectoryRecorder(self, index)

    def drop(self) -> None:
        self._unlink("window-*")
        (self.directory / f"{self.MARKER}.partial").unlink(missing_ok=True)

    def _unlink(self, pattern: str) -> None:
        for path in self.directory.glob(pattern):
            if self._OWN.fullmatch(path.name):
                path.unlink(missing_ok=True)

    def join(self) -> float:
        return 0.0

    def forget(self, index: int) -> None:
        """Deletes one window's files (kept elsewhere: blob storage). A replay already reading them keeps its pages."""
        self._unlink(f"window-{index:05d}.*")

    def clear(self) -> None:
        """Deletes the store's files, and its directory where nothing else is left in it."""
        self.drop()
        (self.directory / self.MARKER).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # gone already, or someone put a file in it since
            self.directory.rmdir()

    def _path(self, index: int, suffix: str) -> Path:
        return self.directory / f"window-{index:05d}.{suffix}"

    @staticmethod
    def superseded_tail(index: int) -> str | None:
        """The file that window `index`, once kept, makes useless: the previous window's tail, read only to compute
        this one (a replay of this one needs none; `upscale_windows` computes it again where this one is not
        replayed after all). 16 frames in float32, 61 % of the bytes of a 121-frame window's 105 finished ones (1.6
        GB at 2160p): kept, the tails were over a third of a long job's kept windows."""
        return f"window-{index - 1:05d}.tail.npy" if index > 0 else None


def _write_whole(path: Path, value: object) -> None:
    """Writes `value` as JSON to `path` so that readers find the whole file or none (a `.partial` renamed over it)."""
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(json.dumps(value))
    partial.replace(path)


def _read_whole(path: Path) -> dict | None:
    """The JSON object at `path`; None where there is none (missing, unreadable, cut short, not an object)."""
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _frame_layout(kept: dict) -> tuple[tuple[int, ...], str] | None:
    """A kept window's frame shape and dtype, from its JSON (None where it has no shape)."""
    if not isinstance(kept.get("shape"), list):
        return None
    return tuple(kept["shape"]), kept.get("dtype", "uint8")  # kept before 16-bit windows: 8-bit


def _marker_key(path: Path) -> str | None:
    """The key a store's marker names; None where the file is not one (unreadable, or not `{"key": str}`)."""
    marker = _read_whole(path)
    ours = marker is not None and set(marker) == {"key"} and isinstance(marker["key"], str)
    return marker["key"] if ours else None


class _DirectoryRecorder:
    def __init__(self, store: DirectoryWindowStore, index: int) -> None:
        self.store, self.index = store, index
        self.partial = store._path(index, "u8.partial")
        self.partial.unlink(missing_ok=True)  # left by an attempt that died in this window
        self.shape: list[int] | None = None
        self.dtype = "uint8"

    def add(self, pixels: np.ndarray) -> None:
        with self.partial.open("ab") as file:
            file.write(np.ascontiguousarray(pixels).tobytes())
        self.shape = [(self.shape[0] if self.shape else 0) + len(pixels), *pixels.shape[1:]]
        self.dtype = pixels.dtype.name

    def commit(self, tail: torch.Tensor | None, made: RunInfo, supersedes: bool = True) -> None:
        if tail is not None:
            np.save(self.store._path(self.index, "tail.npy"), tail.cpu().numpy())
        self.partial.replace(self.store._path(self.index, "u8"))
        # Written last, whole: a window counts as kept only once everything it needs is on disk (Ctrl-C can land
        # between a file's creation and its bytes)
        kept = {"shape": self.shape, "dtype": self.dtype, "made": made.kept()}
        _write_whole(self.store._path(self.index, "json"), kept)
        if supersedes and self.store.drop_superseded_tails and (superseded := self.store.superseded_tail(self.index)):
            (self.store.directory / superseded).unlink(missing_ok=True)

    def discard(self) -> None:
        """The window is not kept: its frames written so far go."""
        self.partial.unlink(missing_ok=True)


# --- running ------------------------------------------------------------------------------------------------


def upscale_windows(
    upscaler,
    frames: Iterable[np.ndarray],
    plan: WindowPlan,
    request: SRRequest,
    sink: FrameSink,
    progress: Callable[[WindowProgress], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    store: WindowStore | None = None,
    dtype: torch.dtype = torch.uint8,
) -> WindowsRun:
    """Upscale `plan.frames` frames ((H, W, 3) uint8 or uint16 RGB arrays, in order) window by window; `sink` gets
    the output frames in order, like an upscaler's sink. `dtype` is what the encoder quantises them to (uint16 for a
    10-bit output): the store keeps them so, and replays only windows kept so."""
    source = iter(frames)
    held: list[np.ndarray] = []  # input frames [held_from, held_from + len(held))
    held_from = 0
    tail: torch.Tensor | None = None
    tailless: Window | None = None  # the window before, replayed without its tail (the store dropped it, superseded)
    runs: list[RunInfo] = []  # computed here
    made: list[RunInfo] = []  # every window so far, computed or replayed
    restored = 0
    host_s = {"frames_in": 0.0, "kept": 0.0}
    for window in plan.windows:
        if cancelled is not None and cancelled():
            raise Cancelled("the job was cancelled")
        first = tailless.start if tailless is not None else window.start  # its input kept until this one replays
        del held[: first - held_from]
        held_from = first
        taking = perf_counter()
        held.extend(_take(source, window.stop - held_from - len(held), held_from + len(held)))
        host_s["frames_in"] += perf_counter() - taking
        tiles = runs[0].tiles if runs else None

        stored = store.load(window.index) if store is not None else None
        # Replayed only if made as every window before it: one made otherwise is computed again (and kept anew)
        last = window.index == len(plan.windows) - 1
        if (
            stored is not None
            and len(stored.pixels) == plan.finished_frames(window)
            and stored.pixels.dtype == torch.empty((), dtype=dtype).numpy().dtype
            and all(stored.made.made_like(before) for before in made)
            and (stored.tail is not None or last or not plan.overlap or plan.tails_stand_alone)  # else not redone
        ):
            for start in range(0, len(stored.pixels), 8):
                sink(dequantise(torch.from_numpy(np.array(stored.pixels[start : start + 8]))))
            tail, restored = stored.tail, restored + 1
            tailless = window if tail is None and not last and plan.overlap else None
            made.append(stored.made)
            stored = None  # its pages go before the next window is downloaded (the scratch estimate counts one)
            if progress is not None:
                progress(WindowProgress(window.index, len(plan.windows), "restored", 1, 1, tiles))
            continue
        stored = None  # kept otherwise: computed again, its pages not held meanwhile (its file is gone already)

        def on_progress(event: Progress, index: int = window.index, tiles: int | None = tiles) -> None:
            if progress is not None:
                progress(WindowProgress(index, len(plan.windows), event.stage, event.done, event.total, tiles))

        if tailless is not None:  # this window is computed after all: the one before's tail, computed again
            # (its tail stands alone, `WindowPlan.tails_stand_alone`: the window before it plays no part)
            retail = _Blender(plan, tailless, None, lambda frames: None, None, dtype)
            # (its progress unsaid: the job's would go back; its cancel still seen between tiles)
            computed = _computed(
                upscaler, held[: tailless.frames], request, tailless, retail, lambda _: None, cancelled, made
            )
            tail, tailless = retail.finish(computed), None
            runs.append(computed)  # the engine's seconds
            del held[: window.start - held_from]
            held_from = window.start
        blender = _Blender(plan, window, tail, sink, store.record(window.index, last) if store is not None else None, dtype)
        taking = perf_counter()
        video = _video(held)
        host_s["frames_in"] += perf_counter() - taking
        run = _computed(upscaler, video, request, window, blender, on_progress, cancelled, made if restored else [])
        del video
        tail = blender.finish(run)
        host_s["kept"] += blender.committed_s
        runs.append(run)
        made.append(run)
    if next(source, None) is not None:
        raise ValueError(f"the frame source holds more than the planned {plan.frames} frames")
    return WindowsRun(len(plan.windows), restored, tuple(runs), tuple(made), host_s)


def _computed(
    upscaler,
    frames: list[np.ndarray] | torch.Tensor,
    request: SRRequest,
    window: Window,
    sink: _Blender,
    progress: Callable[[Progress], None],
    cancelled: Callable[[], bool] | None,
    replayed: list[RunInfo],
) -> RunInfo:
    """`window` computed into `sink` with its own noise; raises KeptWindowsDisagree where it was made otherwise than the
    kept windows `replayed` before it."""
    video = _video(frames) if isinstance(frames, list) else frames
    own_noise = replace(request, noise_key=(*request.noise_key, window.index))
    run = upscaler.upscale(video, own_noise, sink, progress, cancelled)
    if not all(run.made_like(before) for before in replayed):
        raise KeptWindowsDisagree(
            f"window {window.index} ran {run.quality} {run.levers} split {run.split}; the kept windows replayed before "
            f"it ran {replayed[0].quality} {replayed[0].levers} split {replayed[0].split}"
        )
    return run


def _take(source: Iterator[np.ndarray], count: int, position: int) -> list[np.ndarray]:
    taken = [frame for _, frame in zip(range(count), source)]
    if len(taken) < count:
        raise ValueError(f"the frame source ended at frame {position + len(taken)}, before the plan's end")
    return taken


def _video(frames: list[np.ndarray]) -> torch.Tensor:
    """(F, 3, H, W) integer RGB, a view of the (H, W, 3) frames stacked: the upscaler makes it float where it computes
    (`worker.frames.unit`), so the host neither writes nor copies 4 bytes a sample."""
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)


class _Blender:
    """The sink of one window: fades its head into the previous window's tail, passes the middle on, holds its own
    tail for the next window; tees finished frames to the store's recorder."""

    def __init__(
        self,
        plan: WindowPlan,
        window: Window,
        previous_tail: torch.Tensor | None,
        sink: FrameSink,
        recorder: WindowRecorder | None,
        dtype: torch.dtype = torch.uint8,
    ) -> None:
        self.plan, self.window, self.previous_tail, self.dtype = plan, window, previous_tail, dtype
        self.sink, self.recorder = sink, recorder
        self.head = plan.overlap if previous_tail is not None else 0
        self.finished = plan.finished_frames(window)
        self.position = 0
        self.tail: list[torch.Tensor] = []
        self.committed_s = 0.0  # the recorder's commit: the window written and kept

    def __call__(self, frames: torch.Tensor) -> None:
        start, count = self.position, len(frames)
        self.position += count
        if start < self.head:
            fade = min(count, self.head - start)
            previous = self.previous_tail[start : start + fade].to(frames.device)
            weight = self.plan.ramp(frames.device)[start : start + fade]
            frames = torch.cat([previous + (frames[:fade] - previous) * weight, frames[fade:]])
        keep = max(0, min(count, self.finished - start))
        if keep < count:
            self.tail.append(frames[keep:].clone())
        if keep:
            self.sink(frames[:keep])
            if self.recorder is not None:
                self.recorder.add(quantise(frames[:keep], self.dtype).cpu().numpy())

    def finish(self, made: RunInfo) -> torch.Tensor | None:
        if self.position != self.window.frames:
            raise RuntimeError(f"window {self.window.index}: the upscaler emitted {self.position} of {self.window.frames} frames")
        tail = torch.cat(self.tail) if self.tail else None
        if self.recorder is not None:
            started = perf_counter()
            self.recorder.commit(tail, made, self.plan.tails_stand_alone)
            self.committed_s = perf_counter() - started
        return tail
