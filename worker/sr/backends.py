"""Pick an upscaler by name: `lanczos`, or a Kandinsky 6 SR checkpoint (directory or hub id) in a performance mode."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from worker import started as process
from worker.sr import compile_cache, precompiled, readahead
from worker.sr import devices as device_names
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.offload import Offload
from worker.sr.request import FrameSink, Progress, RunInfo, SRRequest
from worker.sr.windows import DEFAULT_WINDOW

if TYPE_CHECKING:
    from worker.sr.checkpoint import Components

# The K6 engine, its checkpoint loader and decoder (diffusers, and through it torch's compiler stack: ~2.5 CPU-s) are
# imported where a diffusion model is opened: a Lanczos worker starts without them.

log = logging.getLogger("vsrq.engine")

PerformanceMode = Literal["speed", "balanced", "memory", "offload", "offload_layers"]
# Measured on W1, one H200 (bench/RESULTS.md): peaks 40.7 / 27.5 / 22.0 GiB for 1 / 1.12 / ~1.2x the time (memory:
# an earlier engine, against that engine's speed); the offloaded modes: not measured yet (bench/bench.py's cap
# phases, README's GPU sizing). The same bits at the same segment length, wherever the weights live; segment 2
# moves some pixels by up to 2/255 on GPUs, whose kernels are picked per shape.
PERFORMANCE_MODES: dict[PerformanceMode, dict[str, Any]] = {
    # every tile's decoder cache resident (parked where they would crowd the GPU), frames stream out per segment
    "speed": {"decode_order": "lockstep", "decode_segment": 4, "offload": None},
    # the caches parked in pinned host memory between segments (1.85 GiB per W1 tile), frames stream out
    "balanced": {"decode_order": "parked", "decode_segment": 2, "offload": None},
    # one tile's decoder cache per GPU at a time, two latent frames at a time; frames leave with the last tile
    "memory": {"decode_order": "tile_major", "decode_segment": 2, "offload": None},
    # memory's decoding, the weights in pinned host memory: each component on the GPU only while it runs (16 GB)
    "offload": {"decode_order": "tile_major", "decode_segment": 2, "offload": Offload()},
    # and the transformer's blocks streamed (4 resident, 2 in flight), one latent frame at a time (12 GB cards)
    "offload_layers": {"decode_order": "tile_major", "decode_segment": 1, "offload": Offload(layers=True, resident_blocks=4, prefetch=2)},
}
# A decode segment's working set on the GPU, one tile's decoder cache included, in units of that cache: W1's tile
# (1.85 GiB of cache) took 15.0 / 8.8 / 5.8 GiB above the weights at segments of 4 / 2 / 1 latent frames
# (bench/RESULTS.md, levers). Caches held at once: every tile's in lockstep until they crowd the GPU, then about
# three parked, as in `parked`; one in `tile_major`.
_DECODE_WORKING_SET = {4: 8.1, 2: 4.8, 1: 3.1}
_CACHES_HELD = {"lockstep": 3, "parked": 3, "tile_major": 1}
_SLACK = 1.15  # the allocator's reserve above what is allocated (growable segments: 2-4 GiB on W1's 20-40 GiB)


def needed_bytes(mode: PerformanceMode, replica: Components) -> int:
    """GPU memory `mode` needs for one tile of the largest trained size: the weights on the GPU at the time plus a
    decode segment's working set, at the busiest stretch of a call, with the allocator's slack. Offloaded, the
    stretches are: encode (encoder + the upscaler on its way), latent upscale (upscaler + the transformer on its
    way), denoise (transformer, its block slots + the decoder on its way) and decode (decoder + working set); the
    encoder's and the transformer's activations are not counted (not measured apart)."""
    from worker.sr.checkpoint import module_bytes
    from worker.sr.fast_vae import tile_cache_bytes

    settings = PERFORMANCE_MODES[mode]
    vae = replica.vae
    largest = max(replica.transformer.config.tile_sizes, key=lambda hw: hw[0] * hw[1])
    cache = tile_cache_bytes(vae, *(size // vae.spatial_compression_ratio for size in largest))
    working = cache * (_DECODE_WORKING_SET[settings["decode_segment"]] + _CACHES_HELD[settings["decode_order"]] - 1)
    encoder, decoder = module_bytes(vae.encoder), module_bytes(vae.decoder)
    bank = replica.latent_upscaler
    upscaler = module_bytes(bank) if bank is not None else 0
    transformer = module_bytes(replica.transformer)
    offload: Offload | None = settings["offload"]
    if offload is None:
        return int(_SLACK * (encoder + decoder + upscaler + transformer + working))
    upscaler = max((module_bytes(model) for model in bank._models), default=0) if bank is not None else 0  # one scale
    if offload.layers:
        blocks = list(replica.transformer.visual_transformer_blocks._modules.values())
        streamed = max(len(blocks) - offload.resident_blocks, 0)
        block = module_bytes(blocks[0])
        transformer -= (streamed - min(offload.prefetch + 1, streamed)) * block  # only the ring's slots stream
    stretches = (encoder + upscaler, upscaler + transformer, transformer + decoder, decoder + working)
    return int(_SLACK * max(stretches))


def choose_mode(replica: Components, free_bytes: int) -> PerformanceMode:
    """The fastest mode whose `needed_bytes` fits in `free_bytes` (the smallest if none does)."""
    modes: list[PerformanceMode] = list(PERFORMANCE_MODES)
    return next((mode for mode in modes if needed_bytes(mode, replica) <= free_bytes), modes[-1])


def free_gpu_bytes(device: torch.device) -> int:
    """What this process may still allocate on `device`: the device's free memory, or less under a per-process cap
    (`torch.cuda.set_per_process_memory_fraction`)."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _device: 1.0)(device)
    return int(min(free, fraction * total - torch.cuda.memory_reserved(device)))


def _allocator_configured() -> bool:
    """Whether the operator configured PyTorch's allocator: then it is theirs to tune."""
    return any(os.environ.get(name) for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))


class Upscaler(Protocol):
    devices: list[torch.device]
    qualities: tuple[str, ...]  # the `quality` tiers it runs as asked (`high`: only where its levers run faster)

    def output_size(self, height: int, width: int, scale: float) -> tuple[int, int]: ...

    def signature(self, request: SRRequest) -> str: ...

    def upscale(
        self,
        video: torch.Tensor,  # (F, 3, H, W): float in [0, 1], or uint8 / uint16 at full scale (`worker.frames.unit`)
        request: SRRequest,
        sink: FrameSink,
        progress: Callable[[Progress], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> RunInfo: ...


def open_upscaler(
    model: str,
    devices: Sequence[str] = ("cpu",),
    performance_mode: PerformanceMode | Literal["auto"] = "auto",
    warmup_frames: int | None = DEFAULT_WINDOW,
    warmup_every_tile_size: bool = True,
    warmup_qualities: Sequence[str] = ("lossless",),
    compile_cache_dir: str | Path | None = None,
    offload_prefetch: int | None = None,
    split: str | int = "auto",
    compile: Literal["auto", "on", "off"] = "auto",
    precompile: bool = True,
) -> Upscaler:
    """`performance_mode` "auto": the fastest mode whose need (`needed_bytes`) fits in the free memory of the
    smallest GPU (`speed` on CPUs). `offload_prefetch`: transformer blocks in flight in `offload_layers` (the
    mode's default if None). `warmup_frames` (the worker's window length; None: no warmup) builds the compiled
    blocks (GPUs) with one throwaway window, and with `warmup_every_tile_size` a short clip of each other tile size
    (portrait, square), so the first job is not the cold one; `warmup_qualities` with "high": its levers' graphs for
    the landscape window too (a start takes longer; the first `high` job of such windows does not compile).
    `compile_cache_dir`: where compiled graphs persist between processes (worker.sr.compile_cache): a restart loads
    the warmup's graphs instead of compiling them. `split`: whether devices may share a tile (`SREngine`).
    `compile`: the transformer's and the decoder's blocks compiled on GPUs ("auto"), everywhere ("on": also on
    CPUs, where a start then measures what a GPU's does) or nowhere ("off"). `precompile`: with a
    `compile_cache_dir`, the compiled blocks' calls go through functions compiled ahead of time and kept there
    (worker.sr.precompiled): a restart loads them instead of tracing."""
    parsed = device_names.parse(devices)
    if model != "lanczos":
        readahead.start(model)  # the weights come off the disk while the model's code is imported (seconds)
    cache = compile_cache.use(compile_cache_dir) if compile_cache_dir is not None else None
    if cache is not None:
        log.info("compile cache in %s", cache)
    if model == "lanczos":
        return LanczosUpscaler()
    if precompiled.use(cache / "precompiled" if cache is not None and precompile else None) is not None:
        log.info("compiled blocks precompiled in %s", cache / "precompiled")
    from worker.sr import checkpoint
    from worker.sr.engine import COMPILED_BLOCKS, SREngine

    log.info("model code imported, %.1f s after the process started", process.seconds())
    on_gpus = any(device.type == "cuda" for device in parsed)
    if compile == "on" or (compile == "auto" and on_gpus):
        # The blocks' functions come off the disk while the weights load and move (seconds on GPUs): the warmup
        # takes them instead of loading them (no directory, or precompile off: nothing); only those of this
        # environment on these devices (a shared volume holds other images' and GPUs' too)
        precompiled.preload(COMPILED_BLOCKS, parsed)

    if on_gpus and not _allocator_configured():
        # Blocks of many sizes come and go while decoding: growable segments keep the reserve near what is in use
        # (W1 in `speed`, with decoder caches updated in place: 40.7 GiB reserved for 40.0 allocated, at the same
        # speed; 52-54 GiB before both, measured together). Set at runtime, since the worker may have touched CUDA
        # already; it holds for the whole process, as the environment variable would.
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    # On the host until the mode is known: an offloaded mode never holds every weight on the GPU at once.
    loading = perf_counter()
    replicas, _ = checkpoint.load(model, parsed, on_host=True)
    log.info("weights loaded in %.1f s, %.1f s after the process started", perf_counter() - loading, process.seconds())
    gpus = sorted({r.device for r in replicas if r.device.type == "cuda"}, key=str)
    if performance_mode == "auto":
        free = min((free_gpu_bytes(device) for device in gpus), default=None)
        performance_mode = "speed" if free is None else choose_mode(replicas[0], free)
        if free is not None:
            log.info("performance mode %s: %.1f GiB free on the smallest GPU, it needs %.1f GiB", performance_mode,
                     free / 2**30, needed_bytes(performance_mode, replicas[0]) / 2**30)
    options = dict(PERFORMANCE_MODES[performance_mode])
    if offload_prefetch is not None and options["offload"] is not None:
        options["offload"] = dataclasses.replace(options["offload"], prefetch=offload_prefetch)
    compiled = {"auto": None, "on": True, "off": False}[compile]
    engine = SREngine(replicas, split=split, compile_transformer=compiled, compile_decoder=compiled, **options)
    engine.performance_mode = performance_mode
    log.info("engine built (%s), %.1f s after the process started", performance_mode, process.seconds())
    built = precompiled.stats()  # what the preloader has loaded before the warmup
    if warmup_frames and engine.compiles:
        tiles = "every tile size" if warmup_every_tile_size else "landscape tiles"
        log.info("warming up %s (compiling for a %d-frame window, %s, quality %s)", ",".join(map(str, engine.devices)),
                 warmup_frames, tiles, ",".join(warmup_qualities))
        started = perf_counter()
        info = engine.warmup(warmup_frames, every_tile_size=warmup_every_tile_size, qualities=warmup_qualities)
        found, functions = compile_cache.stats(), precompiled.stats()
        log.info(
            "warm after %.1f s (%d tiles over %d devices; compiled graphs from the cache: %d, compiled anew: %d); "
            "precompiled functions loaded: %d, compiled: %d; preloaded: %d in %.1f s on a thread, %d of them before "
            "the warmup",
            perf_counter() - started, info.tiles, len(info.devices), found["fxgraph_cache_hit"],
            found["fxgraph_cache_miss"] + found["fxgraph_cache_bypass"], functions["loaded"], functions["compiled"],
            functions["preloaded"], functions["preloading_s"], built["preloaded"],
        )  # fmt: skip
    return engine
