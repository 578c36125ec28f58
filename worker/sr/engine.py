"""The tiled Kandinsky 6 SR executor.

`SREngine.upscale` reads top to bottom like a diffusers `__call__`: pad, plan, noise, low-res latents, then denoise
and a streaming decode that hand finished output frames to a sink. Compared with `Kandinsky6SRPipeline` it
- spreads whole tiles over a device group (one replica per device, each running its own denoise-then-decode
  pipeline, with the denoising and decoding of a tile balanced separately; the host blends in tile order, so the
  output is bit-identical whatever the device count), or, with fewer tiles than devices, splits each tile's
  denoising over several devices (`split`: sequence parallel, the same output to float rounding),
- draws every tile's noise from its own generator (output independent of tile batching and device count),
- decodes all tiles in lockstep, one temporal segment at a time through each tile's causal cache, blending each
  segment on the host as soon as its tiles are in, so the GPU holds no canvas and memory does not grow with clip
  length (the caches resident, or parked in host memory between segments where they would crowd the GPU; or tile
  by tile, one cache per GPU),
- computes attention with dense SDPA instead of eager flex attention (which materialises the score matrix), or,
  as an option, NABLA sparse attention through compiled flex attention.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, closing, contextmanager, nullcontext
from time import perf_counter
from typing import Any

import torch
import torch.nn.functional as F

from worker.errors import Cancelled, InvalidRequest
from worker.frames import unit
from worker.sr import checkpoint, compile_cache, fp8_attention, precompiled, quality, stepper, tiling
from worker.sr import split as _split
from worker.sr.attention import PROCESSORS
from worker.sr.checkpoint import Components
from worker.sr.compilation import allow_many_graphs
from worker.sr.compile_gate import CompileGate
from worker.sr.decode_order import DECODE_ORDERS, decode_order_for
from worker.sr.decoder_caches import DecoderCaches, host_bytes_available
from worker.sr.devices import Pipeline, Schedule, to_device, to_host
from worker.sr.fast_vae import compile_decoder as compile_decoder_blocks
from worker.sr.fast_vae import speed_up_decoder, tile_cache_bytes
from worker.sr.k6_models import transformer as k6_transformer
from worker.sr.k6_models import vae as k6_vae
from worker.sr.noise import tile_noise
from worker.sr.offload import Offload, align_on_cpu, place, placement_of, upscaler_unit
from worker.sr.request import HIGH, LOSSLESS, FrameSink, Progress, RunInfo, SRRequest
from worker.sr.tiling import Tile, TilePlan
from worker.sr.warm_decoder import DecodeEachSignatureOnce

log = logging.getLogger("vsrq.engine")
# The blocks an engine compiles (worker.sr.precompiled's functions), in the order a call first runs them
COMPILED_BLOCKS = (k6_transformer.Kandinsky6SRTransformerBlock, k6_vae.Kandinsky6SRResnetBlock3D)


class _Clock:
    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = devices
        self.seconds: dict[str, float] = {}

    def lap(self, stage: str, started: float) -> float:
        for device in self.devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        now = perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - started
        return now

    @contextmanager
    def host(self, stage: str) -> Iterator[None]:
        """Adds the host time of the block to `stage`, without waiting for the devices."""
        started = perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + perf_counter() - started


class SREngine:
    """Runs Kandinsky 6 SR over a group of devices, each holding a replica of the model."""

    def __init__(
        self,
        replicas: Sequence[Components],
        decode_segment: int = 4,
        decode_order: str = "lockstep",
        fast_decode: bool = True,
        compile_transformer: bool | None = None,
        compile_decoder: bool | None = None,
        attention: str = "sdpa",
        offload: Offload | None = None,
        split: str | int = "auto",
        high_levers: Sequence[str] = quality.HIGH_LEVERS,
    ) -> None:
        """`decode_order`: "lockstep" streams frames out segment by segment and keeps every tile's decoder cache on
        its device; "parked" streams the same way with the caches in pinned host memory between segments (two per
        GPU, copied beside the decoding: `decoder_caches`); "tile_major" decodes one whole tile at a time
        per device (one cache, no host copies) and emits the frames with the last tile. All give the same bits; a
        call whose lockstep caches would crowd a GPU parks them.

        `replicas` are prepared in place: `fast_decode` swaps the decoder's norms, causal convolutions and
        upsamplings for `fast_vae`'s (same maths: half the norms' memory traffic, 12 % less arithmetic);
        `compile_transformer` compiles its repeated blocks and `compile_decoder` the decoder's resnet blocks
        (default: on GPUs; `warmup` pays for the compilation before the first job); `attention` is "sdpa" (dense,
        exact) or "nabla" (the trained sparse pattern; needs the compiled transformer at full size); `offload` keeps
        the weights in pinned host memory and brings each component to its device only while it runs (`offload`;
        None: all resident). The replicas' weights move where `offload` wants them, here and again at a call if
        another engine has placed them otherwise since. `split`: whether the devices may share a tile's denoising
        ("auto": where there are fewer tiles than devices; "on": always; "off": never; a number: that many devices
        per tile; `split.degree`). Dense attention only: a split group runs its blocks uncompiled, and eager NABLA
        (flex attention) materialises the score matrix. `high_levers`: what a `quality="high"` request runs
        (`worker.sr.quality`); `lossless` requests always run the exact engine."""
        if attention not in PROCESSORS:
            raise ValueError(f"attention must be one of {tuple(PROCESSORS)}, got {attention!r}")
        if attention == "nabla" and compile_transformer is False and any(r.device.type == "cuda" for r in replicas):
            raise ValueError("attention='nabla' needs the compiled transformer on GPUs (eager flex attention "
                             "materialises the whole score matrix)")
        if decode_order not in DECODE_ORDERS:
            raise ValueError(f"decode_order must be one of {DECODE_ORDERS}, got {decode_order!r}")
        if not replicas:
            raise ValueError("an engine needs at least one replica")
        _split.check(split)
        if decode_segment < 1:
            raise ValueError("decode_segment must be >= 1 latent frame")
        self.replicas = list(replicas)
        self.decode_segment = decode_segment
        self.decode_order = decode_order
        # Offloaded blocks stream through one replica's slots a forward at a time: CPU "devices", which share one
        # replica, cannot run a split group's forwards side by side.
        shared = len({id(r) for r in replicas}) < len(replicas)
        self.split = "off" if len(replicas) == 1 or (shared and offload is not None) or attention != "sdpa" else split
        self.last_decode_order = decode_order  # what the latest call ran: lockstep may give way (`_decode_order`)
        self.fast_decode = fast_decode
        self.attention = attention
        self.high_levers = quality.check_levers(high_levers)
        self._cache_sizes: dict[tuple[int, int], int] = {}
        prepared: set[int] = set()  # CPU "devices" share one replica: prepare it once
        for replica in self.replicas:
            if id(replica) in prepared:
                continue
            prepared.add(id(replica))
            if fast_decode:
                if replica.placement is None:
                    # The sub-pixel upsampling derives its kernels from the weights where they run: the same bits
                    # as a resident decoder's, wherever the weights live later.
                    replica.vae.decoder.to(replica.device)
                speed_up_decoder(replica.vae)
            _use_attention(replica.transformer, PROCESSORS[attention])
            if self.split != "off":
                _split.wrap_attention(replica.transformer)
            on_gpu = replica.device.type == "cuda"
            compiles_transformer = (on_gpu if compile_transformer is None else compile_transformer) and not _is_compiled(replica.transformer)
            compiles_decoder = on_gpu if compile_decoder is None else compile_decoder
            if compiles_transformer:
                precompiled.compile_repeated_blocks(replica.transformer)
            if compiles_decoder:
                compile_decoder_blocks(replica.vae)
        self.offload = offload
        self._place()
        first = self.replicas[0]
        self.snap = first.vae.spatial_compression_ratio
        self.frame_stride = first.vae.temporal_compression_ratio
        self.tile_sizes = tuple(tuple(size) for size in first.transformer.config.tile_sizes)
        self.scaling_factor = first.vae.config.scaling_factor
        # Whether the first call on new shapes builds compiled code (worth a `warmup`); such calls run alone.
        self.compiles = any(_is_compiled(r.transformer) or _is_compiled_decoder(r.vae) for r in self.replicas)
        self._gate = CompileGate()
        # One thread per device, also for one: the caller's thread blends and encodes while the device works. Every
        # model call runs on these threads, so they set Dynamo's limits (kept per thread) for themselves.
        initializer = allow_many_graphs if self.compiles else None
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="vsrq-device", initializer=initializer)

    @classmethod
    def from_pretrained(cls, source: str, devices: Sequence[str | torch.device] = ("cpu",), **kwargs) -> SREngine:
        replicas, _ = checkpoint.load(source, [torch.device(d) for d in devices], kwargs.pop("dtype", None))
        return cls(replicas, **kwargs)

    def _place(self) -> None:
        """The replicas' weights where this engine's `offload` wants them (another engine may have moved them)."""
        for replica in {id(r): r for r in self.replicas}.values():
            if placement_of(replica).offload != self.offload:
                place(replica, self.offload)
            elif self.offload is None:
                for module in replica.modules().values():  # loaded on the host (`checkpoint.load(on_host=True)`)
                    module.to(replica.device)
            if self.offload is None and replica.device.type == "cpu":
                align_on_cpu(replica)

    def pinned_bytes(self) -> int:
        """Pinned host memory the offloaded weights take (0 when resident)."""
        return sum(placement_of(r).pinned_bytes for r in {id(r): r for r in self.replicas}.values())

    @property
    def default_steps(self) -> int:
        """Denoising steps per tile when a request names none: what the checkpoint's scheduler was made for (the
        distilled pi-Flow checkpoint: 2 model calls; flow matching: 4, as SGLang's presets)."""
        return 2 if type(self.replicas[0].scheduler).__name__ == "PiflowScheduler" else 4

    @property
    def devices(self) -> list[torch.device]:
        return [replica.device for replica in self.replicas]

    @property
    def qualities(self) -> tuple[str, ...]:
        """The tiers it runs as asked: `high` where it has levers and its FP8 GEMMs run on every device (an A100's
        `high` would change the arithmetic for no speed: its workers offer `lossless` alone, by the registry)."""
        faster = self.high_levers and all(quality.fp8_supported(device) for device in self.devices)
        return (LOSSLESS, HIGH) if faster else (LOSSLESS,)

    def signature(self, request: SRRequest) -> str:
        """What decides the bits this engine gives `request`, beyond the request: windows kept under another
        signature are never replayed into this engine's output (worker.kept_windows). Left out, as they give the same
        bits: the decode order, where the weights live (offload), the tile batch and, for whole tiles, the device
        count (tests/test_execution.py, tests/test_offload.py)."""
        import diffusers

        parts: dict[str, Any] = {
            "weights": self.replicas[0].identity,  # a weights update under the same path
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "devices": sorted({_device_kind(device) for device in self.devices}),
            "dtype": str(self.replicas[0].dtype),
            "attention": self.attention,
            "compiled": self.compiles,
            "fast_decode": self.fast_decode,
            "decode_segment": self.decode_segment,  # 2 against 4 moves pixels by up to 2/255 on GPUs
            # a split tile matches a whole one to float rounding, not to the bit; the degree follows the device count
            "split": "off" if self.split == "off" else f"{self.split} of {len(self.replicas)} devices",
        }
        if any(device.type == "cuda" for device in self.devices):  # their kernels, and so their bits, change by release
            parts["cuda"], parts["cudnn"] = torch.version.cuda, torch.backends.cudnn.version()
        levers = quality.request_levers(request.quality, self.high_levers)
        if levers:
            parts["levers"], parts["levers_revision"] = list(levers), quality.REVISION
            if quality.FP8_ATTENTION in levers:  # cuDNN's kernel or its emulation: other bits
                parts[quality.FP8_ATTENTION] = fp8_attention.expected_backend(self.devices)
        return json.dumps(parts, sort_keys=True)

    def output_size(self, height: int, width: int, scale: float) -> tuple[int, int]:
        return tiling.output_size(height, width, scale)

    def warmup(
        self, frames: int, scale: float = 2, every_tile_size: bool = False, qualities: Sequence[str] = (LOSSLESS,)
    ) -> RunInfo:
        """Throwaway calls that build the compiled blocks before the first job, with at least one tile per device:
        landscape tiles `frames` long (a temporal window: the transformer's graph for it too) and, with
        `every_tile_size`, the other trained tile sizes (portrait, square) on a short clip. They decode every segment
        shape a job of at most `frames` needs (`_segments`), each once (`DecodeEachSignatureOnce`): a job of another
        length builds only the transformer's graph. `lossless` is always warmed up; with `high` in `qualities`, the
        landscape window is denoised once more with its levers, whose blocks are graphs of their own (the decoder's
        are shared, and a short clip's transformer graph serves only clips of its length)."""
        landscape = max(self.tile_sizes, key=lambda hw: hw[1] / hw[0])
        info = self._warm(landscape, frames, scale)
        if every_tile_size:
            short = 1 + self.frame_stride * (1 + self.decode_segment)  # latent: the leading frame, a segment, one more
            for size in self.tile_sizes:
                if size != landscape:
                    self._warm(size, short, scale)
        if HIGH in qualities:
            if self.high_levers:
                self._warm(landscape, frames, scale, HIGH)
            else:
                log.warning("warmup: quality high has no levers on this engine (it runs lossless): not warmed up")
        return info

    def _warm(self, base: tuple[int, int], frames: int, scale: float, tier: str = LOSSLESS) -> RunInfo:
        """One call on tiles of `base` (output pixels at x2), and a 2-latent-frame one where `frames` leaves no
        single-frame remainder to decode (the exact tier's call builds the decoder's graphs; another tier's
        transformer only needs its window)."""
        height, width = base[0] // 2, base[1] // 2
        portrait = base[0] > base[1]
        unit = (base[0] // math.gcd(*base), base[1] // math.gcd(*base))
        while len(tiling.plan_tiles(height, width, 2, self.tile_sizes, self.snap, SRRequest.min_overlap).tiles) < len(self.replicas):
            # A tile more along the long side (width for square tiles), for as long as the plan keeps `base`; then
            # both sides in `base`'s exact aspect ratio (a square clip widened far enough would turn landscape)
            longer = (height + self.snap, width) if portrait else (height, width + self.snap)
            if tiling.choose_base_tile(*longer, self.tile_sizes) == base:
                height, width = longer
            else:
                height, width = height + unit[0] * self.snap, width + unit[1] * self.snap

        def run(length: int) -> RunInfo:
            # One denoising step: every step runs the same graphs (the timestep is a tensor input), so more would
            # only repeat them
            request = SRRequest(scale=scale, num_inference_steps=1, quality=tier)
            # uint8 frames, as a job's windows come
            video = torch.zeros(length, 3, height, width, dtype=torch.uint8)
            return self.upscale(video, request, lambda _: None, warming=True)

        started, graphs, compiling = perf_counter(), compile_cache.graphs_built(), compile_cache.seconds()
        functions = precompiled.stats()
        info = run(frames)
        if tier == LOSSLESS:  # the decoder's shapes: another tier's call needs none of its own
            lengths = [part.stop - part.start for part in self._segments(self._latent_frames(frames))[1:]]
            if 1 not in lengths:
                run(1 + self.frame_stride)  # the leading frame and one more: the single-frame shape
        graphs = {name: count - graphs[name] for name, count in compile_cache.graphs_built().items()}
        compiling = {name: value - compiling[name] for name, value in compile_cache.seconds().items()}
        functions = {name: value - functions[name] for name, value in precompiled.stats().items()}
        shape = "portrait" if portrait else "landscape" if base[0] < base[1] else "square"
        log.info(
            "warmed up %s tiles (%dx%d, %d frames, %d tiles, %s) in %.1f s: %d graphs traced, %d of them from the "
            "compile cache, %d compiled; %.1f s building them (Dynamo tracing %.1f s, guards %.1f s, Inductor %.1f s); "
            "precompiled functions: %d loaded in %.1f s, %d compiled in %.1f s; the rest running them",
            shape, base[1], base[0], frames, info.tiles, tier, perf_counter() - started, graphs["traced"],
            graphs["from_cache"], graphs["compiled"], compiling["compile"], compiling["tracing"], compiling["guards"],
            compiling["backend"], functions["loaded"], functions["loading_s"], functions["compiled"],
            functions["compiling_s"],
        )  # fmt: skip
        return info

    def memory_report(self) -> list[str]:
        """One line per GPU after a job: weights, the job's peak and what is left, and which placement fits."""
        lines = []
        for replica in self.replicas:
            if replica.device.type != "cuda":
                continue
            total = torch.cuda.get_device_properties(replica.device).total_memory
            peak = torch.cuda.max_memory_reserved(replica.device)
            weights = _weight_bytes(replica)
            if replica.placement is not None:
                verdict = f"weights offloaded to {replica.placement.pinned_bytes / 2**30:.1f} GiB of pinned host memory"
            elif peak < 0.9 * total:
                verdict = "everything stays resident"
            else:
                verdict = (
                    "close to the limit: performance_mode=balanced parks the decoder caches in host memory (W1: "
                    "27.5 GiB instead of 40.7, 1.12x the time), memory decodes one tile at a time (22 GiB, ~1.2x), "
                    "offload and offload_layers keep the weights in host memory (auto picks from the free memory)"
                )
            lines.append(
                f"{replica.device}: weights {weights / 2**30:.1f} GiB, peak reserved {peak / 2**30:.1f} GiB of "
                f"{total / 2**30:.0f} GiB ({self.last_decode_order} decode): {verdict}"
            )
        return lines

    @torch.no_grad()
    def upscale(
        self,
        video: torch.Tensor,
        request: SRRequest,
        sink: FrameSink,
        progress: Callable[[Progress], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
        *,
        warming: bool = False,
    ) -> RunInfo:
        """Upscale `video` ((F, 3, H, W): float in [0, 1], or uint8 / uint16 RGB at full scale; any F >= 1 and any
        size) and stream the result to `sink`.
        `warming`: a warmup's throwaway call, which decodes each decoder call signature once
        (`DecodeEachSignatureOnce`): its frames are not the clip's."""
        request.validate()
        if video.ndim != 4 or video.shape[1] != 3:
            raise InvalidRequest(f"video must be (frames, 3, height, width), got {tuple(video.shape)}")
        if any(placement_of(r).offload != self.offload for r in self.replicas):
            self._place()
        clock = _Clock(self.devices)
        started = perf_counter()
        num_frames, _, height, width = video.shape
        home = self.replicas[0]
        dtype = home.dtype
        tracker = _Tracker(progress, cancelled)
        tiling_scale, _ = tiling.split_scale(request.scale)

        # 1. To the first device, as (1, 3, F, H, W) in [-1, 1]; integer frames cross as they are and become float there
        video = (2.0 * unit(video, home.device) - 1.0).permute(1, 0, 2, 3).unsqueeze(0)

        # 2. The x2.25 route: bilinear x1.125 pre-upscale, then the x2 model
        model_height, model_width = tiling.pre_upscaled_size(height, width, request.scale)
        if (model_height, model_width) != (height, width):
            frames = F.interpolate(video[0].transpose(0, 1), size=(model_height, model_width), mode="bilinear", align_corners=False)
            video = frames.transpose(0, 1).unsqueeze(0)

        # 3. Plan the tiles (`vsrq probe` plans with the same call); pad to what the model takes: 1 + 4k frames,
        #    sizes a multiple of the VAE factor and at least one tile
        plan = tiling.plan_video(height, width, request.scale, self.tile_sizes, self.snap, request.min_overlap)
        video = self._pad(video, plan.height, plan.width)
        _, _, padded_frames, padded_height, padded_width = video.shape

        # 4. Share the work out over the devices: whole tiles, or a tile over a group (`split`)
        schedule = Schedule.split(plan.tiles, len(self.replicas), _split.degree(len(plan.tiles), len(self.replicas), self.split))
        latent_frames = self._latent_frames(padded_frames)
        tracker.total = len(plan.tiles) * (request.num_inference_steps + len(self._segments(latent_frames)))

        # 5. Starting noise of every tile, drawn on the CPU
        latent_shape = (1, latent_frames, plan.base_height // self.snap, plan.base_width // self.snap, home.transformer.config.in_visual_dim)
        noise = tile_noise(
            request.noise_mode,
            request.seed,
            latent_shape,
            len(plan.tiles),
            dtype,
            key=request.noise_key,
            chunk_size=request.tiles_batch_size,
        )

        # 6. Low-resolution latent tiles at the trained tile size, on the devices that denoise them
        lq_latents = self._low_res_latents(video, plan, schedule.encode)
        started = clock.lap("encode", started)

        # 7. Denoise and decode: one pipeline per device, blended here in tile order as segments arrive
        out_height, out_width = model_height * tiling_scale, model_width * tiling_scale
        emitted = 0

        def emit(frames: torch.Tensor) -> None:
            nonlocal emitted
            frames = frames[: num_frames - emitted, :, :out_height, :out_width]  # the padding goes
            if len(frames):
                with clock.host("sink"):
                    sink(frames)
                emitted += len(frames)

        #    `high` swaps its levers into the transformers for the denoising (lossless: nothing changes)
        self.last_decode_order = order = self._decode_order(plan, schedule)
        levers = quality.request_levers(request.quality, self.high_levers)
        quality.reset()
        applied: list[quality.Applied] = []
        self._generate(plan, schedule, order, lq_latents, noise, request, levers, applied, tracker, emit, clock, warming)
        clock.lap("denoise_decode", started)

        return RunInfo(
            input_size=(height, width),
            output_size=(out_height, out_width),
            frames=emitted,
            padded_input=(padded_frames, padded_height, padded_width),
            tiles=len(plan.tiles),
            devices=[str(device) for device in self.devices],
            split=max(map(len, schedule.groups), default=1),
            stage_seconds=clock.seconds,
            quality=request.quality if levers else quality.LOSSLESS,
            levers={lever: how for run in applied for lever, how in run.report().items()},
        )

    # --- step 3 -----------------------------------------------------------------------------------------------

    def _pad(self, video: torch.Tensor, padded_height: int, padded_width: int) -> torch.Tensor:
        """Repeat the last frame up to 1 + 4k frames; mirror the edges out to the plan's size (`tiling.padded_size`:
        the VAE grid and one tile)."""
        *_, num_frames, height, width = video.shape
        extra_frames = -(num_frames - 1) % self.frame_stride
        if extra_frames:
            video = torch.cat([video, video[:, :, -1:].expand(-1, -1, extra_frames, -1, -1)], dim=2)
        pad_bottom, pad_right = padded_height - height, padded_width - width
        if pad_bottom or pad_right:
            # Reflection needs the pad to be shorter than the side; tiny inputs fall back to edge replication.
            mode = "reflect" if pad_bottom < height and pad_right < width else "replicate"
            frames = F.pad(video[0].transpose(0, 1), (0, pad_right, 0, pad_bottom), mode=mode)
            video = frames.transpose(0, 1).unsqueeze(0)
        return video

    # --- step 6 -----------------------------------------------------------------------------------------------

    def _low_res_latents(self, video: torch.Tensor, plan: TilePlan, placement: dict[int, list[Tile]]) -> dict[int, torch.Tensor]:
        """(1, C, T, h, w) latents per tile index, on the device that denoises the tile, in the model dtype."""
        home = self.replicas[0]
        upscaler = home.latent_upscaler
        if upscaler is not None and plan.tiling_scale in upscaler.config.scales:
            # Encode the whole video once, crop each tile's latents and upscale them in latent space. Offloaded, each
            # component asks for the next one before queueing its work: the copy runs beside that work.
            with placement_of(home).using("encoder"):
                placement_of(home).prefetch(upscaler_unit(plan.tiling_scale))
                whole = self._encode(home, video)

            def upscale(replica: Components, tiles: list[Tile]) -> dict[int, torch.Tensor]:
                weights = placement_of(replica)
                with weights.using(upscaler_unit(plan.tiling_scale)):
                    weights.prefetch("transformer")
                    return {
                        tile.index: replica.latent_upscaler(
                            whole[(..., *plan.latent_box(tile))].to(replica.device), scale=plan.tiling_scale, return_dict=False
                        )[0].to(replica.dtype)
                        for tile in tiles
                    }

            return self._on_devices(placement, upscale)

        def encode(replica: Components, tiles: list[Tile]) -> dict[int, torch.Tensor]:
            encoded = {}
            weights = placement_of(replica)
            with weights.using("encoder"):
                weights.prefetch("transformer")
                for tile in tiles:
                    pixels = video[(..., *plan.input_box(tile))].to(replica.device)[0].transpose(0, 1)
                    pixels = F.interpolate(pixels, size=(plan.base_height, plan.base_width), mode="bilinear", align_corners=False)
                    encoded[tile.index] = self._encode(replica, pixels.transpose(0, 1).unsqueeze(0)).to(replica.dtype)
            return encoded

        return self._on_devices(placement, encode)

    def _encode(self, replica: Components, video: torch.Tensor) -> torch.Tensor:
        # The K-VAE was trained on `pixels / 128 - 1`, not the `pixels / 127.5 - 1` the input is in.
        video = (video.to(replica.vae.dtype) + 1) * (127.5 / 128) - 1
        return replica.vae.encode(video, return_dict=False)[0].mode() * self.scaling_factor

    # --- step 7 -----------------------------------------------------------------------------------------------

    def _generate(
        self,
        plan: TilePlan,
        schedule: Schedule,
        decode_order: str,
        lq_latents: dict[int, torch.Tensor],
        noise: list[torch.Tensor],
        request: SRRequest,
        levers: tuple[str, ...],
        applied: list[quality.Applied],
        tracker: _Tracker,
        emit: FrameSink,
        clock: _Clock,
        warming: bool = False,
    ) -> None:
        """Denoise and decode every tile; `emit` blended output frames ((n, 3, H, W) in [0, 1]) in order.

        Every device runs a pipeline of its own: it denoises its tiles, handing each tile's latents over as soon as
        they exist, then decodes its share of the tiles (which `Schedule` balances) segment by segment, weighted
        by the window, into pinned host memory without waiting. The calling thread adds them into host canvases,
        one per segment, in tile order whatever the device and decode order, so the output is bit-identical for
        any device count and every order; a canvas leaves as frames once its last tile is in. Model calls go
        through the engine's `CompileGate` when blocks are compiled: one at a time in a call of a new signature.
        `warming`: each decoder call signature is decoded once per device (`upscale`)."""
        segments = self._segments(noise[0].shape[1])
        pipeline = Pipeline(len(plan.tiles))
        shards = _split.join(schedule.groups, self.devices)  # the split groups' devices (none for whole tiles)
        for group in {id(shard.group): shard.group for shard in shards.values()}.values():
            pipeline.on_failure(group.abort)  # a device waiting for its group stops with the call

        def run(slot: int) -> None:
            replica = self.replicas[slot]
            shard = shards.get(slot)
            turn = (lambda: shard.turn(pipeline.turn)) if shard is not None else pipeline.turn
            leaving = {tile.index for tile in schedule.denoise[slot]} - {tile.index for tile in schedule.decode[slot]}
            # closed on the way out, also by an error here: the levers and offloaded weights it holds go back now,
            # not when a traceback's reference cycle is collected (maybe mid-forward in the next job)
            with closing(self._denoise(replica, schedule.denoise[slot], lq_latents, noise, request, levers, applied, tracker, turn, shard)) as denoised:
                for latents in denoised:
                    if not schedule.hands_over(slot):
                        continue
                    # A tile decoded elsewhere leaves through pinned host memory, its copy queued right behind its
                    # last step: a GPU-to-GPU copy would tie both GPUs' streams, and a copy started by the receiver
                    # would wait behind whatever the sender has queued by then.
                    pipeline.hand_over({i: to_host(latent) if i in leaving else (latent, None) for i, latent in latents.items()})
            tiles = schedule.decode[slot]
            z = {tile.index: pipeline.take(tile.index).to(replica.device).permute(0, 4, 1, 2, 3) for tile in tiles}
            window = plan.window(replica.device)
            decoder = DecodeEachSignatureOnce(replica.vae.decoder) if warming else replica.vae.decoder
            # lockstep and parked: segment by segment over all tiles, frames stream out; parked keeps the caches
            # in host memory between segments. tile_major: tile by tile, one cache at a time; frames leave with
            # the last tile.
            if decode_order != "tile_major":
                order = [(number, tile) for number in range(len(segments)) for tile in tiles]
            else:
                order = [(number, tile) for tile in tiles for number in range(len(segments))]
            caches = DecoderCaches(replica.vae.decoder.make_cache, replica.device, park=decode_order == "parked")
            # Offloaded: the decoder on the device for all its tiles (on its way since the last denoising step)
            with placement_of(replica).using("decoder") if tiles else nullcontext():
                for step, (number, tile) in enumerate(order):
                    cache = caches.take(tile.index)
                    latent = z[tile.index][:, :, segments[number]].to(replica.vae.dtype) / self.scaling_factor
                    with pipeline.turn():
                        tracker.check()
                        frames = decoder(latent, cache)
                    if step + 1 < len(order):
                        caches.prefetch(order[step + 1][1].index)  # arrives while this segment decodes
                    caches.give_back(tile.index, cache, last=number == len(segments) - 1)
                    # NCDHW whatever the decoder's layout: the host adds NDHWC frames into its canvas at half speed
                    frames = frames.to(torch.float32, memory_format=torch.contiguous_format)
                    frames = ((frames + 1) * (128 / 127.5) - 1).clamp(-1, 1)
                    pipeline.put(number, tile.index, *to_host(frames[0] * window))
                    tracker.advance(1, "decode")

        # The weights as the first device computes them (its cos may differ from the CPU's in the last bit).
        weights = plan.weight_map(self.replicas[0].device).cpu()
        blends: dict[int, _Blend] = {}
        finished = 0
        signature = (tuple(noise[0].shape), len(plan.tiles), decode_order, request.tiles_batch_size, levers)
        try:
            with self._gate.call(signature, gated=self.compiles) as model_call:
                pipeline.start(self._pool, [self._on_device(slot, run) for slot in range(len(self.replicas))], model_call)
                for number, index, weighted in pipeline.results():
                    with clock.host("blend"):
                        blends.setdefault(number, _Blend(plan)).add(index, weighted)
                    while finished in blends and blends[finished].complete:
                        with clock.host("blend"):
                            frames = _normalise(blends.pop(finished).canvas, weights)
                        emit(frames)
                        finished += 1
        finally:
            pipeline.stop()
        assert not blends and finished == len(segments), "every segment of every tile is blended"

    def _decode_order(self, plan: TilePlan, schedule: Schedule) -> str:
        """The decode order of this call (`decode_order_for`), from the GPUs' sizes and the host memory free now."""
        gpus = [
            (len(tiles), torch.cuda.get_device_properties(replica.device).total_memory, _decoding_weight_bytes(replica))
            for slot, tiles in schedule.decode.items()
            if (replica := self.replicas[slot]).device.type == "cuda" and tiles
        ]
        if not gpus:  # CPUs: nothing to crowd, and parking is a plain copy there
            return self.decode_order
        per_tile = self._cache_bytes(plan.base_height // self.snap, plan.base_width // self.snap)
        order = decode_order_for(self.decode_order, gpus, per_tile, host_bytes_available())
        if order != self.decode_order:
            log.info("decoding %s instead of %s: %d tiles, %.2f GiB of decoder cache each", order, self.decode_order, len(plan.tiles), per_tile / 2**30)
        return order

    def _cache_bytes(self, latent_height: int, latent_width: int) -> int:
        key = (latent_height, latent_width)
        if key not in self._cache_sizes:  # once per tile size
            self._cache_sizes[key] = tile_cache_bytes(self.replicas[0].vae, *key, fast=self.fast_decode)
        return self._cache_sizes[key]

    def _denoise(
        self,
        replica: Components,
        tiles: list[Tile],
        lq_latents: dict[int, torch.Tensor],
        noise: list[torch.Tensor],
        request: SRRequest,
        levers: tuple[str, ...],
        applied: list[quality.Applied],
        tracker: _Tracker,
        turn: Callable[[], AbstractContextManager],
        shard: _split.Shard | None = None,
    ) -> Iterator[dict[int, torch.Tensor]]:
        """Denoised (1, T, h, w, C) latents per tile index, a chunk of `tiles_batch_size` tiles at a time; with a
        `shard`, this device's part of its group's denoising (every device of the group yields the same latents);
        `levers` in force in the transformer while it runs (where the weights are on the device: FP8 weights are made
        there)."""
        if not tiles:
            return
        device, dtype = replica.device, replica.dtype
        scheduler = stepper.fresh(replica.scheduler)
        placement = placement_of(replica)
        # offloaded: on the device for all of this device's steps (and no FP8 weights kept there after them)
        with placement.using("transformer"), quality.applied(replica.transformer, levers, self.offload is None) as run:
            applied.append(run)
            for start in range(0, len(tiles), request.tiles_batch_size):
                chunk = tiles[start : start + request.tiles_batch_size]
                # The transformer works on (batch, frames, height, width, channels).
                lq = torch.cat([lq_latents[tile.index] for tile in chunk]).to(device).permute(0, 2, 3, 4, 1)
                eps = to_device(torch.cat([noise[tile.index] for tile in chunk]), device)
                latents = math.sqrt(1 - request.lq_noise_scale**2) * lq + request.lq_noise_scale * eps
                stepper.restart(scheduler, request.num_inference_steps, device)
                # Released checkpoints are anchor-free: anchor latent and anchor mask channels are zeros.
                anchor = torch.zeros((*latents.shape[:-1], latents.shape[-1] + 1), dtype=dtype, device=device)
                for number, t in enumerate(scheduler.timesteps):
                    if start + len(chunk) == len(tiles) and number == len(scheduler.timesteps) - 1:
                        placement.prefetch("decoder")  # copied in beside the last step
                    with turn():
                        tracker.check()  # between steps: a full-size step takes seconds
                        # One timestep row broadcasts over the batch: a batch of rows would take another GEMM path
                        # in the timestep MLP and change the low bits with the batch size.
                        model_input = torch.cat([latents, anchor], dim=-1)
                        prediction = _split.transformer(replica.transformer, model_input, t.reshape(1), shard)
                    latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
                    if shard is None or shard.rank == 0:  # a split tile's steps count once
                        tracker.advance(len(chunk), "denoise")
                yield {tile.index: latents[i : i + 1] for i, tile in enumerate(chunk)}

    def _latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of `frames` once `_pad` has made it 1 + 4k frames long."""
        return -(-(frames - 1) // self.frame_stride) + 1

    def _segments(self, latent_frames: int) -> list[slice]:
        """Latent-frame slices decoded one after another: the leading frame alone (it yields one pixel frame), then
        `decode_segment` frames at a time, and what is left one frame at a time. A compiled decoder builds a graph
        per segment shape, so every clip length decodes through the same three shapes, which a warmup builds: a new
        length builds no decoder graph (a remainder of 1 to 3 frames decoded whole was a shape of its own: after a
        121-frame warmup, whose remainder is 2, half of all clip lengths compiled the decoder again)."""
        step = self.decode_segment
        whole = 1 + (latent_frames - 1) // step * step  # where the last full segment ends
        bounds = [0, *range(1, whole + 1, step), *range(whole + 1, latent_frames + 1)]
        return [slice(a, b) for a, b in zip(bounds, bounds[1:])]

    # --- the device group -------------------------------------------------------------------------------------

    def _on_device(self, slot: int, work: Callable[[int], Any]) -> Callable[[], Any]:
        """`work(slot)` as a pool thread runs it: on the slot's GPU, with the caller's grad mode (thread-local: pool
        threads would run with gradients on, and compiled code guarded on grad mode would recompile there)."""
        device, grad = self.replicas[slot].device, torch.is_grad_enabled()

        def call() -> Any:
            # Tensors a component creates without naming a device must land on this replica's GPU.
            with torch.cuda.device(device) if device.type == "cuda" else nullcontext(), torch.set_grad_enabled(grad):
                return work(slot)

        return call

    def _on_devices(self, placement: dict[int, list[Tile]], work: Callable[[Components, list[Tile]], dict]) -> dict:
        """Run `work(replica, tiles)` on every device that has tiles, at once; merge the per-tile dicts."""
        calls = [self._on_device(slot, lambda slot, tiles=tiles: work(self.replicas[slot], tiles)) for slot, tiles in placement.items() if tiles]
        futures = [self._pool.submit(call) for call in calls]
        wait(futures)  # all of them, also when one fails: nothing of this call may run on into the next
        return {key: value for future in futures for key, value in future.result().items()}


def _device_kind(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _weight_bytes(replica: Components) -> int:
    return sum(checkpoint.module_bytes(m) for m in (replica.transformer, replica.vae, replica.latent_upscaler) if m is not None)


def _decoding_weight_bytes(replica: Components) -> int:
    """Weights on the device while it decodes: all of them, or offloaded the decoder's."""
    return replica.placement.resident_bytes("decoder") if replica.placement is not None else _weight_bytes(replica)


def _use_attention(transformer: torch.nn.Module, processor: type) -> None:
    """Sets the processor unless it is already in use (a new one would make compiled blocks recompile)."""
    if not all(isinstance(_split.unwrapped(p), processor) for p in transformer.attn_processors.values()):
        transformer.set_attn_processor(processor())


def _is_compiled(transformer: torch.nn.Module) -> bool:
    """Whether `compile_repeated_blocks` already ran (another engine on the same replica): compiling twice would
    throw the compiled code away."""
    return getattr(transformer.visual_transformer_blocks[0], "_compiled_call_impl", None) is not None


def _is_compiled_decoder(vae: torch.nn.Module) -> bool:
    return any(getattr(module, "_compiled_call_impl", None) is not None for module in vae.decoder.modules())


class _Blend:
    """One segment of output frames on the host: window-weighted tiles added in tile order (the order fixes the
    float sum)."""

    def __init__(self, plan: TilePlan) -> None:
        self.plan = plan
        self.canvas: torch.Tensor | None = None
        self._added = 0
        self._waiting: dict[int, torch.Tensor] = {}

    @property
    def complete(self) -> bool:
        return self._added == len(self.plan.tiles)

    def add(self, index: int, weighted: torch.Tensor) -> None:
        # A tile that must wait for an earlier one leaves pinned memory, which the host allocator would keep.
        self._waiting[index] = weighted if index == self._added or not weighted.is_pinned() else weighted.clone()
        while self._added in self._waiting:
            frames = self._waiting.pop(self._added)
            if self.canvas is None:
                self.canvas = torch.zeros((3, frames.shape[1], *self.plan.output_size))
            self.canvas[(..., *self.plan.output_box(self.plan.tiles[self._added]))] += frames
            self._added += 1


def _normalise(canvas: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Canvas (3, n, H, W) in [-1, 1] units -> frames (n, 3, H, W) in [0, 1].

    One new tensor and three in-place passes (a host-bound step: W1 x4 makes 1.2 GB segments). Clamping to [0, 1]
    after the affine map gives the same bits as clamping to [-1, 1] before it: the map is exact at the bounds."""
    return (canvas / weights).mul_(0.5).add_(0.5).clamp_(0, 1).transpose(0, 1)


class _Tracker:
    """Thread-safe progress counting and the cancellation check before every model call."""

    def __init__(self, progress: Callable[[Progress], None] | None, cancelled: Callable[[], bool] | None) -> None:
        self.progress, self.cancelled = progress, cancelled
        self.done, self.total = 0, 0
        self._lock = threading.Lock()

    def check(self) -> None:
        if self.cancelled is not None and self.cancelled():
            raise Cancelled("the job was cancelled")

    def advance(self, units: int, stage: str) -> None:
        with self._lock:  # devices report concurrently: events go out in order
            self.done += units
            if self.progress is not None:
                self.progress(Progress(stage, self.done, self.total))
