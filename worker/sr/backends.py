"""Pick an upscaler by name: `lanczos`, or a Kandinsky 6 SR checkpoint (directory or hub id) in a performance mode."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from time import perf_counter
from typing import Any, Literal, Protocol

import torch

from worker.sr import compile_cache
from worker.sr.engine import SREngine
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.request import FrameSink, Progress, RunInfo, SRRequest
from worker.sr.windows import DEFAULT_WINDOW

log = logging.getLogger("vsrq.engine")

PerformanceMode = Literal["speed", "balanced", "memory"]
# Measured on W1, one H200 (bench/RESULTS.md): peaks 40.7 / 27.5 / 22.0 GiB for 1 / 1.12 / ~1.2x the time (memory:
# an earlier engine, against that engine's speed). The same bits at the same segment length; segment 2 moves some
# pixels by up to 2/255 on GPUs, whose kernels are picked per shape.
PERFORMANCE_MODES: dict[PerformanceMode, dict[str, Any]] = {
    # every tile's decoder cache resident (parked where they would crowd the GPU), frames stream out per segment
    "speed": {"decode_order": "lockstep", "decode_segment": 4},
    # the caches parked in pinned host memory between segments (1.85 GiB per W1 tile), frames stream out
    "balanced": {"decode_order": "parked", "decode_segment": 2},
    # one tile's decoder cache per GPU at a time, two latent frames at a time; frames leave with the last tile
    "memory": {"decode_order": "tile_major", "decode_segment": 2},
}


def _allocator_configured() -> bool:
    """Whether the operator configured PyTorch's allocator: then it is theirs to tune."""
    return any(os.environ.get(name) for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))


class Upscaler(Protocol):
    devices: list[torch.device]

    def output_size(self, height: int, width: int, scale: float) -> tuple[int, int]: ...

    def upscale(
        self,
        video: torch.Tensor,
        request: SRRequest,
        sink: FrameSink,
        progress: Callable[[Progress], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> RunInfo: ...


def open_upscaler(
    model: str,
    devices: Sequence[str] = ("cpu",),
    performance_mode: PerformanceMode = "speed",
    warmup_frames: int | None = DEFAULT_WINDOW,
    warmup_every_tile_size: bool = True,
    compile_cache_dir: str | Path | None = None,
) -> Upscaler:
    """`warmup_frames` (the worker's window length; None: no warmup) builds the compiled blocks (GPUs) with one
    throwaway window, and with `warmup_every_tile_size` a short clip of each other tile size (portrait, square), so
    the first job is not the cold one. `compile_cache_dir`: where compiled graphs persist between processes
    (worker.sr.compile_cache): a restart loads the warmup's graphs instead of compiling them."""
    if compile_cache_dir is not None:
        log.info("compile cache in %s", compile_cache.use(compile_cache_dir))
    if model == "lanczos":
        return LanczosUpscaler()
    if any(device.startswith("cuda") for device in devices) and not _allocator_configured():
        # Blocks of many sizes come and go while decoding: growable segments keep the reserve near what is in use
        # (W1 in `speed`, with decoder caches updated in place: 40.7 GiB reserved for 40.0 allocated, at the same
        # speed; 52-54 GiB before both, measured together). Set at runtime, since the worker may have touched CUDA
        # already; it holds for the whole process, as the environment variable would.
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    engine = SREngine.from_pretrained(model, devices, **PERFORMANCE_MODES[performance_mode])
    if warmup_frames and engine.compiles:
        tiles = "every tile size" if warmup_every_tile_size else "landscape tiles"
        log.info("warming up %s (compiling for a %d-frame window, %s)", ",".join(map(str, engine.devices)), warmup_frames, tiles)
        started = perf_counter()
        info = engine.warmup(warmup_frames, every_tile_size=warmup_every_tile_size)
        cache = compile_cache.stats()
        log.info(
            "warm after %.1f s (%d tiles over %d devices; compiled graphs from the cache: %d, compiled anew: %d)",
            perf_counter() - started, info.tiles, len(info.devices), cache["fxgraph_cache_hit"],
            cache["fxgraph_cache_miss"] + cache["fxgraph_cache_bypass"],
        )  # fmt: skip
    return engine
