"""The tiled Kandinsky 6 SR executor.

`SREngine.upscale` reads top to bottom like a diffusers `__call__`: pad, plan, noise, low-res latents, denoise,
then a streaming decode that hands finished output frames to a sink. Compared with `Kandinsky6SRPipeline` it
- spreads whole tiles over a device group (one replica per device; the host blends in tile order, so the output is
  bit-identical whatever the device count),
- draws every tile's noise from its own generator (output independent of tile batching and device count),
- decodes all tiles in lockstep, one temporal segment at a time through each tile's causal cache, so only one
  segment of the output canvas ever exists and peak memory does not grow with clip length,
- computes attention with dense SDPA instead of eager flex attention (which materialises the score matrix), or,
  as an option, NABLA sparse attention through compiled flex attention.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from itertools import zip_longest
from dataclasses import dataclass, field
from time import perf_counter

import torch
import torch.nn.functional as F

from worker.sr import checkpoint, tiling
from worker.sr.attention import PROCESSORS
from worker.sr.checkpoint import Components
from worker.sr.errors import Cancelled, InvalidRequest
from worker.sr.fast_vae import compile_decoder as compile_decoder_blocks
from worker.sr.fast_vae import speed_up_decoder
from worker.sr.noise import NoiseMode, tile_noise
from worker.sr.tiling import Tile, TilePlan

# Receives finished output frames, in order: (n, 3, H, W) float32 in [0, 1], on the first device or the CPU.
FrameSink = Callable[[torch.Tensor], None]
DECODE_ORDERS = ("lockstep", "tile_major")


@dataclass(frozen=True)
class SRRequest:
    scale: float = 2
    num_inference_steps: int = 2
    seed: int = 42
    min_overlap: float = 0.2
    lq_noise_scale: float = 0.7
    tiles_batch_size: int = 1
    noise_mode: NoiseMode = NoiseMode.PER_TILE
    # Extra seed material, e.g. the temporal window index of a long clip, so windows get unrelated noise.
    noise_key: tuple[int, ...] = ()

    def validate(self) -> None:
        if self.scale not in tiling.SCALES:
            raise InvalidRequest(f"scale must be one of {tiling.SCALES}, got {self.scale}")
        if self.num_inference_steps < 1:
            raise InvalidRequest(f"num_inference_steps must be >= 1, got {self.num_inference_steps}")
        if not 0.0 < self.lq_noise_scale <= 1.0:
            raise InvalidRequest(f"lq_noise_scale must be in (0, 1], got {self.lq_noise_scale}")
        if not 0.0 <= self.min_overlap < 1.0:
            raise InvalidRequest(f"min_overlap must be in [0, 1), got {self.min_overlap}")
        if self.tiles_batch_size < 1:
            raise InvalidRequest(f"tiles_batch_size must be >= 1, got {self.tiles_batch_size}")


@dataclass(frozen=True)
class Progress:
    stage: str  # "encode", "denoise", "decode"
    done: int  # work units done over the whole call: one per tile and step, one per tile and decode segment
    total: int


@dataclass
class RunInfo:
    """What one call did, for logs, job records and benchmarks."""

    input_size: tuple[int, int]
    output_size: tuple[int, int]
    frames: int
    padded_input: tuple[int, int, int]  # (frames, height, width) the model actually ran on
    tiles: int
    devices: list[str]
    stage_seconds: dict[str, float] = field(default_factory=dict)


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
    ) -> None:
        """`decode_order`: "lockstep" streams frames out segment by segment and keeps every tile's decoder cache on
        its device; "tile_major" decodes one whole tile at a time per device (one cache, least GPU memory) into a
        host canvas and emits the frames at the end. Both give the same bits.

        `replicas` are prepared in place: `fast_decode` swaps the decoder's norms for `fast_vae`'s (same maths,
        about half the memory traffic); `compile_transformer` compiles its repeated blocks and `compile_decoder` the
        decoder's resnet blocks (default: on GPUs; `warmup` pays for the compilation before the first job);
        `attention` is "sdpa" (dense, exact) or "nabla" (the trained sparse pattern; needs the compiled transformer at
        full size)."""
        if attention not in PROCESSORS:
            raise ValueError(f"attention must be one of {tuple(PROCESSORS)}, got {attention!r}")
        if attention == "nabla" and compile_transformer is False and any(r.device.type == "cuda" for r in replicas):
            raise ValueError("attention='nabla' needs the compiled transformer on GPUs (eager flex attention "
                             "materialises the whole score matrix)")
        if decode_order not in DECODE_ORDERS:
            raise ValueError(f"decode_order must be one of {DECODE_ORDERS}, got {decode_order!r}")
        if not replicas:
            raise ValueError("an engine needs at least one replica")
        if decode_segment < 1:
            raise ValueError("decode_segment must be >= 1 latent frame")
        self.replicas = list(replicas)
        self.decode_segment = decode_segment
        self.decode_order = decode_order
        prepared: set[int] = set()  # CPU "devices" share one replica: prepare it once
        for replica in self.replicas:
            if id(replica) in prepared:
                continue
            prepared.add(id(replica))
            if fast_decode:
                speed_up_decoder(replica.vae)
            _use_attention(replica.transformer, PROCESSORS[attention])
            on_gpu = replica.device.type == "cuda"
            if (on_gpu if compile_transformer is None else compile_transformer) and not _is_compiled(replica.transformer):
                replica.transformer.compile_repeated_blocks(fullgraph=True)
            if on_gpu if compile_decoder is None else compile_decoder:
                compile_decoder_blocks(replica.vae)
        first = self.replicas[0]
        self.snap = first.vae.spatial_compression_ratio
        self.frame_stride = first.vae.temporal_compression_ratio
        self.tile_sizes = tuple(tuple(size) for size in first.transformer.config.tile_sizes)
        self.scaling_factor = first.vae.config.scaling_factor
        # Whether the first call on new shapes builds compiled code (worth a `warmup`), and the shapes built so far.
        self.compiles = any(_is_compiled(r.transformer) or _is_compiled_decoder(r.vae) for r in self.replicas)
        self._warm_shapes: set[tuple] = set()
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="vsrq-device") if len(self.replicas) > 1 else None

    @classmethod
    def from_pretrained(cls, source: str, devices: Sequence[str | torch.device] = ("cpu",), **kwargs) -> SREngine:
        replicas, _ = checkpoint.load(source, [torch.device(d) for d in devices], kwargs.pop("dtype", None))
        return cls(replicas, **kwargs)

    @property
    def devices(self) -> list[torch.device]:
        return [replica.device for replica in self.replicas]

    def output_size(self, height: int, width: int, scale: float) -> tuple[int, int]:
        return tiling.output_size(height, width, scale)

    def warmup(self, frames: int, scale: float = 2) -> RunInfo:
        """Runs one throwaway call with at least one tile per device, `frames` long (a temporal window) and landscape,
        so that the compiled blocks are built before the first job."""
        base_height, base_width = max(self.tile_sizes, key=lambda hw: hw[1] / hw[0])  # output pixels at x2
        height, width = base_height // 2, base_width // 2
        while len(tiling.plan_tiles(height, width, 2, self.tile_sizes, self.snap, SRRequest.min_overlap).tiles) < len(self.replicas):
            width += self.snap
        return self.upscale(torch.zeros(frames, 3, height, width), SRRequest(scale=scale), lambda _: None)

    def memory_report(self) -> list[str]:
        """One line per GPU after a job: weights, the job's peak and what is left, and which placement fits."""
        lines = []
        for replica in self.replicas:
            if replica.device.type != "cuda":
                continue
            total = torch.cuda.get_device_properties(replica.device).total_memory
            peak = torch.cuda.max_memory_reserved(replica.device)
            weights = sum(checkpoint.module_bytes(m) for m in (replica.transformer, replica.vae, replica.latent_upscaler) if m is not None)
            verdict = (
                "everything stays resident"
                if peak < 0.9 * total
                else "close to the limit: performance_mode=memory decodes one tile at a time in under half the memory"
            )
            lines.append(
                f"{replica.device}: weights {weights / 2**30:.1f} GiB, peak reserved {peak / 2**30:.1f} GiB of "
                f"{total / 2**30:.0f} GiB ({self.decode_order} decode): {verdict}"
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
    ) -> RunInfo:
        """Upscale `video` ((F, 3, H, W) float in [0, 1], any F >= 1 and any size) and stream the result to `sink`."""
        request.validate()
        if video.ndim != 4 or video.shape[1] != 3:
            raise InvalidRequest(f"video must be (frames, 3, height, width), got {tuple(video.shape)}")
        clock = _Clock(self.devices)
        started = perf_counter()
        num_frames, _, height, width = video.shape
        home = self.replicas[0]
        dtype = home.dtype
        tracker = _Tracker(progress, cancelled)
        tiling_scale, _ = tiling.split_scale(request.scale)

        # 1. To the first device, as (1, 3, F, H, W) in [-1, 1]
        video = (2.0 * video.to(home.device) - 1.0).permute(1, 0, 2, 3).unsqueeze(0)

        # 2. The x2.25 route: bilinear x1.125 pre-upscale, then the x2 model
        model_height, model_width = tiling.pre_upscaled_size(height, width, request.scale)
        if (model_height, model_width) != (height, width):
            frames = F.interpolate(video[0].transpose(0, 1), size=(model_height, model_width), mode="bilinear", align_corners=False)
            video = frames.transpose(0, 1).unsqueeze(0)

        # 3. Pad to what the model takes: 1 + 4k frames, sizes a multiple of the VAE factor and at least one tile
        base = tiling.choose_base_tile(model_height, model_width, self.tile_sizes)
        video = self._pad(video, base, tiling_scale)
        _, _, padded_frames, padded_height, padded_width = video.shape

        # 4. Plan the tiles and assign them to devices
        plan = tiling.plan_tiles(padded_height, padded_width, tiling_scale, self.tile_sizes, self.snap, request.min_overlap, base)
        assignment = _assign(plan.tiles, len(self.replicas))
        latent_frames = (padded_frames - 1) // self.frame_stride + 1
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

        # 6. Low-resolution latent tiles at the trained tile size
        tracker.stage = "encode"
        lq_latents = self._low_res_latents(video, plan, assignment)
        started = clock.lap("encode", started)

        # 7. Denoise every tile on its device
        tracker.stage = "denoise"
        latents = self._on_devices(
            assignment,
            lambda replica, tiles: self._denoise(replica, tiles, lq_latents, noise, request, tracker),
            compiles=("denoise", latent_shape, request.tiles_batch_size),
        )
        del lq_latents
        started = clock.lap("denoise", started)

        # 8. Decode all tiles segment by segment, blend each segment, crop the padding and hand frames to the sink
        tracker.stage = "decode"
        out_height, out_width = model_height * tiling_scale, model_width * tiling_scale
        emitted = 0
        for segment in self._decode_and_blend(plan, assignment, latents, tracker):
            segment = segment[: num_frames - emitted, :, :out_height, :out_width]
            if len(segment):
                sink(segment)
                emitted += len(segment)
        clock.lap("decode", started)

        return RunInfo(
            input_size=(height, width),
            output_size=(out_height, out_width),
            frames=emitted,
            padded_input=(padded_frames, padded_height, padded_width),
            tiles=len(plan.tiles),
            devices=[str(device) for device in self.devices],
            stage_seconds=clock.seconds,
        )

    # --- step 3 -----------------------------------------------------------------------------------------------

    def _pad(self, video: torch.Tensor, base: tuple[int, int], tiling_scale: int) -> torch.Tensor:
        """Repeat the last frame up to 1 + 4k frames; mirror the edges out to the VAE grid and one tile."""
        *_, num_frames, height, width = video.shape
        extra_frames = -(num_frames - 1) % self.frame_stride
        if extra_frames:
            video = torch.cat([video, video[:, :, -1:].expand(-1, -1, extra_frames, -1, -1)], dim=2)
        padded_height, padded_width = (
            max(-(-size // self.snap) * self.snap, tile // tiling_scale) for size, tile in zip((height, width), base)
        )
        pad_bottom, pad_right = padded_height - height, padded_width - width
        if pad_bottom or pad_right:
            # Reflection needs the pad to be shorter than the side; tiny inputs fall back to edge replication.
            mode = "reflect" if pad_bottom < height and pad_right < width else "replicate"
            frames = F.pad(video[0].transpose(0, 1), (0, pad_right, 0, pad_bottom), mode=mode)
            video = frames.transpose(0, 1).unsqueeze(0)
        return video

    # --- step 4 -----------------------------------------------------------------------------------------------

    def _low_res_latents(
        self, video: torch.Tensor, plan: TilePlan, assignment: dict[int, list[Tile]]
    ) -> dict[int, torch.Tensor]:
        """(1, C, T, h, w) latents per tile index, on the tile's device, in the model dtype."""
        home = self.replicas[0]
        upscaler = home.latent_upscaler
        if upscaler is not None and plan.tiling_scale in upscaler.config.scales:
            # Encode the whole video once, crop each tile's latents and upscale them in latent space.
            whole = self._encode(home, video)

            def upscale(replica: Components, tiles: list[Tile]) -> dict[int, torch.Tensor]:
                return {
                    tile.index: replica.latent_upscaler(
                        whole[(..., *plan.latent_box(tile))].to(replica.device), scale=plan.tiling_scale, return_dict=False
                    )[0].to(replica.dtype)
                    for tile in tiles
                }

            return self._on_devices(assignment, upscale)

        def encode(replica: Components, tiles: list[Tile]) -> dict[int, torch.Tensor]:
            encoded = {}
            for tile in tiles:
                pixels = video[(..., *plan.input_box(tile))].to(replica.device)[0].transpose(0, 1)
                pixels = F.interpolate(pixels, size=(plan.base_height, plan.base_width), mode="bilinear", align_corners=False)
                encoded[tile.index] = self._encode(replica, pixels.transpose(0, 1).unsqueeze(0)).to(replica.dtype)
            return encoded

        return self._on_devices(assignment, encode)

    def _encode(self, replica: Components, video: torch.Tensor) -> torch.Tensor:
        # The K-VAE was trained on `pixels / 128 - 1`, not the `pixels / 127.5 - 1` the input is in.
        video = (video.to(replica.vae.dtype) + 1) * (127.5 / 128) - 1
        return replica.vae.encode(video, return_dict=False)[0].mode() * self.scaling_factor

    # --- step 5 -----------------------------------------------------------------------------------------------

    def _denoise(
        self,
        replica: Components,
        tiles: list[Tile],
        lq_latents: dict[int, torch.Tensor],
        noise: list[torch.Tensor],
        request: SRRequest,
        tracker: _Tracker,
    ) -> dict[int, torch.Tensor]:
        """Denoised (1, T, h, w, C) latents per tile index."""
        device, dtype = replica.device, replica.dtype
        scheduler = replica.scheduler.__class__.from_config(replica.scheduler.config)  # step state is per thread
        out: dict[int, torch.Tensor] = {}
        for start in range(0, len(tiles), request.tiles_batch_size):
            chunk = tiles[start : start + request.tiles_batch_size]
            # The transformer works on (batch, frames, height, width, channels).
            lq = torch.cat([lq_latents[tile.index] for tile in chunk]).permute(0, 2, 3, 4, 1)
            eps = torch.cat([noise[tile.index] for tile in chunk]).to(device)
            latents = math.sqrt(1 - request.lq_noise_scale**2) * lq + request.lq_noise_scale * eps
            scheduler.set_timesteps(request.num_inference_steps, device=device)
            # Released checkpoints are anchor-free: anchor latent and anchor mask channels are zeros.
            anchor = torch.zeros((*latents.shape[:-1], latents.shape[-1] + 1), dtype=dtype, device=device)
            for t in scheduler.timesteps:
                tracker.check()  # between steps: a full-size step takes seconds
                model_input = torch.cat([latents, anchor], dim=-1)
                # One timestep row broadcasts over the batch: a batch of rows would take another GEMM path in the
                # timestep MLP and change the low bits with the batch size.
                prediction = replica.transformer(hidden_states=model_input, timestep=t.reshape(1), return_dict=False)[0]
                latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
                tracker.advance(len(chunk))
            out.update({tile.index: latents[i : i + 1] for i, tile in enumerate(chunk)})
        return out

    # --- step 6 -----------------------------------------------------------------------------------------------

    def _segments(self, latent_frames: int) -> list[slice]:
        """Latent-frame slices decoded one after another; the leading frame alone yields one pixel frame."""
        bounds = [0, 1, *range(1 + self.decode_segment, latent_frames, self.decode_segment), latent_frames]
        return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]

    def _decode_and_blend(
        self,
        plan: TilePlan,
        assignment: dict[int, list[Tile]],
        latents: dict[int, torch.Tensor],
        tracker: _Tracker,
    ) -> Iterator[torch.Tensor]:
        """Yield blended output frames, (n, 3, H, W) in [0, 1], in order.

        Each device weights its tiles by the window before they travel; the canvas adds them in tile order, so the
        sum does not depend on the device count or the decode order (the two orders are bit-identical).
        """
        home = self.replicas[0].device
        windows = {replica.device: plan.window(replica.device) for replica in self.replicas}
        z = {index: latent.permute(0, 4, 1, 2, 3) for index, latent in latents.items()}  # (1, C, T, h, w)
        segments = self._segments(next(iter(z.values())).shape[2])

        def decode(replica: Components, tile: Tile, segment: slice, cache: dict) -> torch.Tensor:
            tracker.check()
            vae = replica.vae
            frames = vae.decoder(z[tile.index][:, :, segment].to(vae.dtype) / self.scaling_factor, cache)
            frames = ((frames.float() + 1) * (128 / 127.5) - 1).clamp(-1, 1)
            tracker.advance(1)
            return frames[0] * windows[replica.device]

        if self.decode_order == "lockstep":
            # Every tile's causal cache stays on its device; only one segment of the canvas ever exists.
            caches = {tile.index: self.replicas[0].vae.decoder.make_cache() for tile in plan.tiles}
            weights = plan.weight_map(home)
            for segment in segments:
                weighted = self._on_devices(
                    assignment,
                    lambda replica, tiles: {t.index: decode(replica, t, segment, caches[t.index]) for t in tiles},
                    compiles=("decode", segment.start == 0, segment.stop - segment.start, plan.base_height, plan.base_width),
                )
                frames = next(iter(weighted.values())).shape[1]
                canvas = _blend(plan, weighted, torch.zeros((3, frames, *plan.output_size), device=home))
                yield _normalise(canvas, weights)
            return

        # tile_major: one decoder cache per device at a time and a host canvas of the whole call (at most one
        # temporal window long): the least GPU memory, frames leave only at the end.
        latent_frames = segments[-1].stop
        canvas = torch.zeros((3, 1 + self.frame_stride * (latent_frames - 1), *plan.output_size))

        def whole_tiles(replica: Components, tiles: list[Tile]) -> dict[int, torch.Tensor]:
            cache = replica.vae.decoder.make_cache()
            return {tiles[0].index: torch.cat([decode(replica, tiles[0], s, cache).cpu() for s in segments], dim=1)}

        # Round-robin assignment makes each round a run of consecutive tiles: adding rounds in order is tile order.
        for round_ in zip_longest(*assignment.values()):
            weighted = self._on_devices(
                {slot: [tile] for slot, tile in enumerate(round_) if tile is not None},
                whole_tiles,
                compiles=("decode", latent_frames, plan.base_height, plan.base_width),
            )
            _blend(plan, weighted, canvas)
        # The weights as the first device computes them (its cos may differ from the CPU's in the last bit).
        yield from _normalise(canvas, plan.weight_map(home).cpu()).split(4 * self.decode_segment)

    # --- the device group -------------------------------------------------------------------------------------

    def _on_devices(self, assignment: dict[int, list[Tile]], work: Callable, compiles: tuple | None = None) -> dict:
        """Run `work(replica, tiles)` for every device at once; merge the per-tile dicts they return.

        `compiles` names work that runs compiled blocks on these shapes. The first time, devices take turns: while
        Dynamo traces in one thread it patches `nn.Module.__call__` for every thread, so another device's forward
        would fail ("FX to symbolically trace a dynamo-optimized function")."""
        jobs = [(self.replicas[slot], tiles) for slot, tiles in assignment.items() if tiles]
        # Which devices run how many tiles is part of the shapes: a device that sat out, or gets another batch
        # remainder, compiles then.
        shapes = (compiles, tuple(len(tiles) for tiles in assignment.values()))
        first_compile = compiles is not None and self.compiles and shapes not in self._warm_shapes

        grad = torch.is_grad_enabled()  # thread-local: pool threads would run with gradients on, and compiled code
        # guarded on grad mode would recompile there, concurrently

        def on_device(replica: Components, tiles: list[Tile]) -> dict:
            # Tensors a component creates without naming a device must land on this replica's GPU.
            with torch.cuda.device(replica.device) if replica.device.type == "cuda" else nullcontext(), torch.set_grad_enabled(grad):
                return work(replica, tiles)

        if self._pool is None or len(jobs) == 1 or first_compile:
            results = [on_device(replica, tiles) for replica, tiles in jobs]
            if first_compile:
                self._warm_shapes.add(shapes)
        else:
            results = [future.result() for future in [self._pool.submit(on_device, r, t) for r, t in jobs]]
        return {key: value for result in results for key, value in result.items()}


def _use_attention(transformer: torch.nn.Module, processor: type) -> None:
    """Sets the processor unless it is already in use (a new one would make compiled blocks recompile)."""
    if not all(isinstance(p, processor) for p in transformer.attn_processors.values()):
        transformer.set_attn_processor(processor())


def _is_compiled(transformer: torch.nn.Module) -> bool:
    """Whether `compile_repeated_blocks` already ran (another engine on the same replica): compiling twice would
    throw the compiled code away."""
    return getattr(transformer.visual_transformer_blocks[0], "_compiled_call_impl", None) is not None


def _is_compiled_decoder(vae: torch.nn.Module) -> bool:
    return any(getattr(module, "_compiled_call_impl", None) is not None for module in vae.decoder.modules())


def _assign(tiles: Sequence[Tile], slots: int) -> dict[int, list[Tile]]:
    """Tiles dealt round-robin to device slots: balanced, and each round of whole tiles is consecutive."""
    return {slot: list(tiles[slot::slots]) for slot in range(slots)}


def _blend(plan: TilePlan, weighted: dict[int, torch.Tensor], canvas: torch.Tensor) -> torch.Tensor:
    """Add window-weighted tiles into `canvas` in tile order (the order fixes the float sum)."""
    for index in sorted(weighted):
        canvas[(..., *plan.output_box(plan.tiles[index]))] += weighted[index].to(canvas.device)
    return canvas


def _normalise(canvas: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Canvas (3, n, H, W) in [-1, 1] units -> frames (n, 3, H, W) in [0, 1]."""
    video = (canvas / weights).clamp(-1, 1)
    return (video * 0.5 + 0.5).clamp(0, 1).transpose(0, 1)


class _Tracker:
    """Thread-safe progress counting and the cancellation check between tiles."""

    def __init__(self, progress: Callable[[Progress], None] | None, cancelled: Callable[[], bool] | None) -> None:
        self.progress, self.cancelled = progress, cancelled
        self.stage, self.done, self.total = "encode", 0, 0
        self._lock = threading.Lock()

    def check(self) -> None:
        if self.cancelled is not None and self.cancelled():
            raise Cancelled("the job was cancelled")

    def advance(self, units: int) -> None:
        with self._lock:
            self.done += units
            event = Progress(self.stage, self.done, self.total)
        if self.progress is not None:
            self.progress(event)
