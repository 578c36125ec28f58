"""Side-by-side benchmark: diffusers' `Kandinsky6SRPipeline` vs the vsrq engine, same GPU(s), same process.

Full-size configuration with random bf16 weights (compute does not depend on the values). Every phase appends one
JSON line to --out as soon as it is measured, so a run cut short still reports what it finished.

    python bench/bench.py --phases ref:W1,ours:W1:cuda:0,ours:W1:cuda:0+cuda:1,batch:W1short:2 --hot 2 --out r.jsonl

Phases:
  ref:WL              the reference pipeline: one cold run, --hot hot runs (every ref: phase must come first)
  ours:WL:DEVICES[~SPLIT][@ORDER[/SEGMENT]][%QUALITY]  or  ours:WL:DEVICES[~SPLIT]@MODE[/PREFETCH][%QUALITY]
                      the engine + MP4 encoding, cold + hot; then (unless --no-check), if ref:WL or another
                      ours:WL phase runs, one run in reference noise mode compared with the reference output and
                      for bit-identity against the first ours:WL phase, and the first of the same decode order and
                      segment (where the weights live must not change a bit). ORDER is lockstep (default), parked or tile_major,
                      SEGMENT the decode segment (4); MODE a worker performance mode (speed, balanced, memory,
                      offload, offload_layers) or auto (chosen from the free memory under the cap), PREFETCH the
                      transformer blocks in flight (offload_layers). A phase that runs out of GPU memory is
                      recorded as not completing, and the run goes on.
                      Clips longer than one window (W3) run in temporal windows, as the worker runs them.
                      SPLIT: whether the devices share a tile's denoising (auto, the default: where there are
                      fewer tiles than devices; on; off; N devices per tile; `worker/sr/split.py`): e.g.
                      ours:W1:cuda:0+cuda:1~on. The
                      record gives the split degree, the scaling efficiency T(1) / (n T(n)) against the last 1-device
                      phase of the workload, and with the check max |delta| and PSNR to the first ours phase
                      QUALITY: every run a `quality=high` request, compiled as the worker runs it: `high` (the
                      worker's engine and levers, `worker.sr.quality.HIGH_LEVERS`) or one lever alone (fp8_linear,
                      fp8_attention); without it, lossless. The record says the tier, the levers that ran and how
                      (FP8 attention on cudnn_fp8 or fp8_emulated, and why), the hot ratio to the lossless phase and
                      to the reference; the check gives per-frame PSNR and SSIM (mean, worst frame) against the
                      first lossless ours:WL phase (`vs_lossless`): e.g. ref:W1,ours:W1:cuda:0,ours:W1:cuda:0%high
  cap:GIB             the process may use at most GIB of the first GPU from here on
                      (`torch.cuda.set_per_process_memory_fraction`, as a smaller card would have; cap:0 lifts it)
  batch:WL:N          tile batch N vs 1 on the first device: bit-identity
  threads:N           host threads (`torch.set_num_threads`) for the phases after it: the calling thread's blending
                      and quantising share the cores with x264's threads
A phase ending in *N runs N hot runs instead of --hot's or --ref-hot's (e.g. ours:W1:cuda:0*0: cold and the check
only; ref:W2*3).
`--diagnose` runs each ours phase once more, untimed, and adds where its GPU idled and which lines synchronised the
host with it (`bench/diagnose.py`).
`--compile none|transformer|decoder` builds engines with less compiled (default both): which compiled part changes
what; `--compile-on-cpu` compiles on a CPU too. `--tiny` runs the same phases on the CPU with the tiny configuration, so
CI keeps this script working.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import resource
import statistics
import sys
import tempfile
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import diffusers

from bench.diagnose import Diagnosis
from bench.similarity import summary as similarity
from worker.frames import quantise
from worker.media.synthetic import pattern
from worker.media.writer import Mp4Writer
from worker.sr import fp8_attention, quality, tiling
from worker.sr.attention import DenseSDPAProcessor
from worker.sr.backends import PERFORMANCE_MODES, choose_mode, free_gpu_bytes
from worker.sr.checkpoint import Components, module_bytes, prune_upscaler, tiny_components
from worker.sr.engine import SREngine
from worker.sr.noise import NoiseMode
from worker.sr.offload import Offload
from worker.sr.request import SRRequest
from worker.sr.windows import DEFAULT_WINDOW, plan_windows, upscale_windows

WORKLOADS = {  # (height, width, frames, scale)
    "W1": (512, 768, 121, 2),
    "W1x4": (512, 768, 121, 4),
    "W2": (256, 384, 33, 2),
    "W3": (512, 768, 481, 2),
    "W1short": (512, 768, 17, 2),  # W1's 9 tiles on 17 frames: cheap bit-identity checks
    "SQ": (320, 320, 33, 2),  # bench/service.py's square clip: 2x2 square tiles
    "HD9": (1080, 1920, 9, 2),  # bench/service.py's 1080p clip: 42 tiles of 3 latent frames, each its own segment
    # One W2 tile at the worker's window (121 frames, what it warms up for) and at two other lengths: what the first
    # job of a new clip length compiles (graphs_compiled) and costs (cold_s against hot_s)
    "L121": (256, 384, 121, 2),
    "L109": (256, 384, 109, 2),
    "L113": (256, 384, 113, 2),
}
SEED = 42
# `ours:...%OPTION`: the levers a `quality=high` request runs on the engine of the phase. `high` is the worker's own
# engine (its default `high_levers`); a lever's name builds the engine with that lever alone.
QUALITY_OPTIONS = {"high": quality.HIGH_LEVERS, **{lever: (lever,) for lever in quality.LEVERS}}
# FLOPs of one W1 tile (512x768 output, 121 frames, 47,616 tokens) from ../shared/docs/kandinsky6-sr.md, in TF.
W1_TOKENS, W1_ATTENTION, W1_LINEAR, W1_DECODE, W1_ENCODE, W1_UPSCALE = 47_616, 520.0, 118.0, 837.6, 96.3, 22.6


def stage_tflop(height: int, width: int, frames: int, scale: float, tile_sizes, snap: int) -> dict[str, float]:
    """TFLOP per stage, scaled from the W1 counts: attention ~ tokens^2, everything else ~ size; summed over the
    temporal windows a long clip runs in."""
    if frames > DEFAULT_WINDOW:
        windows = [stage_tflop(height, width, window.frames, scale, tile_sizes, snap) for window in plan_windows(frames).windows]
        return {stage: sum(window[stage] for window in windows) for stage in windows[0]}
    plan = tiling.plan_video(height, width, scale, tile_sizes, snap)  # the engine's plan
    tokens = ((frames - 1) // 4 + 1) * (plan.base_height // snap) * (plan.base_width // snap)
    ratio = tokens / W1_TOKENS
    tiles = len(plan.tiles)
    return {
        "dit": tiles * 2 * (W1_ATTENTION * ratio**2 + W1_LINEAR * ratio),
        "decode": tiles * W1_DECODE * ratio,
        "encode": W1_ENCODE * frames * height * width / (121 * 512 * 768),
        "latent_upscale": tiles * W1_UPSCALE * ratio,
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compiled_graphs() -> int:
    """Graphs Dynamo has built in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class StageTimer:
    """Seconds per model stage from forward hooks, summed over devices (GPU-seconds).

    On GPUs each stage call is timed by CUDA events recorded on the stream that runs it and read once the run is
    over, so timing never makes the host wait: a hook that synchronised would stop the host from queueing work
    ahead and hide every overlap of copies with compute (W1 with parked decoder caches lost 4.9 s to lockstep so,
    2.4 s with events, measured on two machines)."""

    def __init__(self) -> None:
        self._spans: list[tuple[str, Any, Any]] = []  # (stage, start, end): events, or perf_counter on CPUs
        self._started: dict[tuple[int, int], Any] = {}  # (module, thread): CPU replicas share modules

    def attach(self, module: torch.nn.Module, stage: str, device: torch.device) -> None:
        def mark() -> Any:
            if device.type != "cuda":
                return time.perf_counter()
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event

        def before(*_) -> None:
            self._started[(id(module), threading.get_ident())] = mark()

        def after(*_) -> None:
            self._spans.append((stage, self._started.pop((id(module), threading.get_ident())), mark()))

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)

    def take(self) -> dict[str, float]:
        spans, self._spans = self._spans, []
        seconds: dict[str, float] = {}
        for stage, start, end in spans:
            if isinstance(start, float):
                elapsed = end - start
            else:
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1000
            seconds[stage] = seconds.get(stage, 0.0) + elapsed
        return {stage: round(value, 3) for stage, value in seconds.items()}


def store_decoder_kernels(vae: torch.nn.Module, memory_format: torch.memory_format) -> None:
    """The decoder's 3D kernels (its 5-D weights) stored in `memory_format`, the other tensors as they are."""
    for tensor in (*vae.decoder.parameters(), *vae.decoder.buffers()):
        if tensor.dim() == 5:  # `Module.to(memory_format=)` refuses the 4-D tensors beside them
            tensor.data = tensor.data.contiguous(memory_format=memory_format)


def build(device: torch.device, tiny: bool) -> dict:
    """Random components: full size in bf16 (fp32 where diffusers keeps them fp32), or tiny in fp32."""
    if tiny:
        parts = tiny_components()
    else:
        torch.manual_seed(SEED)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                parts = {
                    "transformer": diffusers.Kandinsky6SRTransformer3DModel(),
                    "vae": diffusers.Kandinsky6SRVAE(),
                    "latent_upscaler": diffusers.Kandinsky6SRLatentUpscalerBank(),
                    "scheduler": diffusers.PiflowScheduler(),
                }
        finally:
            torch.set_default_dtype(previous)
        keep = parts["transformer"]._keep_in_fp32_modules
        for name, module in parts["transformer"].named_modules():
            if name.split(".")[-1] in keep:
                module.float()
        parts["transformer"].pooled_bias.data = parts["transformer"].pooled_bias.data.float()
    parts["transformer"].set_attn_processor(DenseSDPAProcessor())
    for name in ("transformer", "vae", "latent_upscaler"):
        parts[name].to(device).eval().requires_grad_(False)
    return parts


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.float() - b.float()).pow(2).mean().item()
    return 99.0 if mse == 0 else round(10 * torch.log10(torch.tensor(1.0 / mse)).item(), 2)


class Bench:
    def __init__(
        self, out: Path, hot: int, tiny: bool, check: bool = True, ref_hot: int | None = None, compiled: str = "both", compile_on_cpu: bool = False
    ) -> None:
        self.out, self.hot, self.tiny, self.check, self.compiled, self.compile_on_cpu = out, hot, tiny, check, compiled, compile_on_cpu
        self.ref_hot = hot if ref_hot is None else ref_hot
        self.home = torch.device("cpu" if tiny else "cuda:0")
        self.timer = StageTimer()
        self.parts = build(self.home, tiny)
        self.snap = self.parts["vae"].spatial_compression_ratio
        self.tile_sizes = tuple(tuple(size) for size in self.parts["transformer"].config.tile_sizes)
        self.replicas: dict[torch.device, Components] = {}
        self.engines: dict[tuple[torch.device, ...], SREngine] = {}
        self.reference_frames: dict[str, torch.Tensor] = {}
        self.reference_hot: dict[str, float] = {}  # hot median of each workload's reference
        self.first_ours: dict[tuple, torch.Tensor] = {}  # (workload, decode order, segment); (workload, None, None)
        self.cap_gib: float | None = None  # `cap:` phases
        self.speed_hot: dict[str, float] = {}  # hot median of each workload's uncapped speed phase: the ratios' base
        self.single_hot: dict[str, float] = {}  # hot median of the latest 1-device phase of each workload
        self.split_degree = 1  # devices per tile in the latest run (`SREngine` split)
        self.compared: set[str] = set()  # workloads with a reference or another ours phase: worth the check run
        self.frames_written = self.mp4_bytes = 0  # by the latest run_ours
        self.quality_ran, self.levers_ran = quality.LOSSLESS, {}  # by the latest run_ours: the tier and how it ran
        self.diagnose = False  # `--diagnose`: one more run of each ours phase under `bench.diagnose`
        self.decoder_layout = "ncdhw"  # the decoder kernels' layout in the engines built from here on
        self._attach(self.parts, self.home)
        self.emit({"phase": "build", "bytes": {name: module_bytes(self.parts[name]) for name in ("transformer", "vae", "latent_upscaler")}})

    def _attach(self, parts: dict, device: torch.device) -> None:
        for module, stage in ((parts["transformer"], "dit"), (parts["vae"].decoder, "decode"), (parts["vae"].encoder, "encode"), (parts["latent_upscaler"], "latent_upscale")):
            self.timer.attach(module, stage, device)

    def emit(self, record: dict) -> None:
        record |= {
            "device": "cpu (tiny)" if self.tiny else torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "date": time.strftime("%Y-%m-%d"),
        }
        line = json.dumps(record)
        print(line, flush=True)
        with self.out.open("a") as file:
            file.write(line + "\n")

    def workload(self, name: str) -> tuple[int, int, int, float]:
        height, width, frames, scale = WORKLOADS[name]
        if self.tiny:  # the tiny VAE is x4 spatially (the real one x16), the tiny tiles 16x smaller
            # (a long clip keeps two windows' worth of frames, so the windowed path runs too)
            height, width = height // 16, width // 16
            frames = DEFAULT_WINDOW + 8 if frames > DEFAULT_WINDOW else min(frames, 9)
        return height, width, frames, scale

    def reset_peaks(self, devices: list[torch.device]) -> None:
        for device in devices:
            synchronize(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)

    def peaks(self, devices: list[torch.device], measure=torch.cuda.max_memory_reserved) -> dict[str, float]:
        return {str(d): round(measure(d) / 2**30, 2) for d in devices if d.type == "cuda"}

    @staticmethod
    def reserved_by_stream() -> dict[str, dict[str, float]]:
        """GiB reserved per device and allocator pool (one per stream) now: what a stream's pool holds, no other
        stream's allocations can use."""
        pools: dict[str, dict[str, float]] = {}
        for segment in torch.cuda.memory_snapshot() if torch.cuda.is_available() else ():
            device = pools.setdefault(f"cuda:{segment['device']}", {})
            stream = hex(segment["stream"])
            device[stream] = round(device.get(stream, 0.0) + segment["total_size"] / 2**30, 2)
        return pools

    # --- phases -------------------------------------------------------------------------------------------------

    def reference(self, name: str, hot: int | None = None) -> None:
        if self.replicas:
            raise SystemExit("every ref: phase must come before the first ours: phase (ours drops unused weights)")
        height, width, frames, scale = self.workload(name)
        pipe = diffusers.Kandinsky6SRPipeline(**self.parts)
        pipe.set_progress_bar_config(disable=True)
        video = pattern(frames, height, width)[None]
        runs, stages, output = [], [], None
        for _ in range(1 + (self.ref_hot if hot is None else hot)):
            self.reset_peaks([self.home])
            started = time.perf_counter()
            output = pipe(video=video, resolution_scale=scale, num_inference_steps=2, generator=torch.Generator().manual_seed(SEED), output_type="pt").frames[0]
            synchronize(self.home)
            runs.append(time.perf_counter() - started)
            stages.append(self.timer.take())
        self.reference_frames[name] = output.cpu()
        del output
        record = self.summary("diffusers-reference", name, runs, stages, self.peaks([self.home]), [self.home])
        self.reference_hot[name] = record["hot_median_s"]
        self.emit(record)

    def cap(self, gib: float) -> None:
        """Caps what the process may take of the first GPU (0: no cap): a smaller card, on this one."""
        self.cap_gib = gib or None
        if self.home.type == "cuda":
            total = torch.cuda.get_device_properties(self.home).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total) if gib else 1.0, self.home)

    def mode(self, name: str, devices: list[torch.device], prefetch: int | None) -> tuple[str, dict]:
        """A performance mode's engine options; `auto` chooses as the worker does, from the free memory (the weights
        of an earlier resident phase counted as free: they leave the GPU once the chosen mode offloads)."""
        if name == "auto":
            replica = self.replicas.get(self.home) or self.engine(devices).replicas[0]
            free = None
            if self.home.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
                resident = sum(module_bytes(m) for m in replica.modules().values()) if replica.placement is None else 0
                free = free_gpu_bytes(self.home)
                if self.cap_gib:  # (a torch without `get_per_process_memory_fraction` would not see the cap)
                    free = min(free, int(self.cap_gib * 2**30) - torch.cuda.memory_reserved(self.home))
                free += resident
            name = "speed" if free is None else choose_mode(replica, free)
        options = dict(PERFORMANCE_MODES[name])
        if prefetch is not None and options["offload"] is not None:
            options["offload"] = Offload(options["offload"].layers, options["offload"].resident_blocks, prefetch)
        return name, options

    def engine(
        self, devices: list[torch.device], order: str = "lockstep", segment: int = 4, offload: Offload | None = None, split: str | int = "auto",
        high_levers: tuple[str, ...] = quality.HIGH_LEVERS,
    ) -> SREngine:
        if not self.replicas:
            prune_upscaler(self.parts["latent_upscaler"])
            if self.home.type == "cuda":
                torch.cuda.empty_cache()
        for device in devices:
            if device in self.replicas:
                continue
            parts = self.parts
            if device != self.home:
                parts = build(device, self.tiny)
                prune_upscaler(parts["latent_upscaler"])
                for key in ("transformer", "vae", "latent_upscaler"):
                    parts[key].load_state_dict(self.parts[key].state_dict())
                self._attach(parts, device)
            self.replicas[device] = Components(device, parts["transformer"], parts["vae"], parts["scheduler"], parts["latent_upscaler"])
        key = (*devices, order, segment, offload, split, high_levers)
        if key not in self.engines:
            # None: the engine's default (compiled on GPUs; True with --compile-on-cpu); False: eager, to tell compiled
            # code's effects apart
            on = True if self.compile_on_cpu else None
            transformer, decoder = (on if self.compiled in (part, "both") else False for part in ("transformer", "decoder"))
            self.engines[key] = SREngine(
                [self.replicas[d] for d in devices], segment, order, compile_transformer=transformer, compile_decoder=decoder, offload=offload,
                split=split, high_levers=high_levers,
            )
            if self.decoder_layout == "ndhwc":  # `--decoder-layout`: a lever measured here before the worker takes it
                for replica in self.engines[key].replicas:
                    store_decoder_kernels(replica.vae, torch.channels_last_3d)
        return self.engines[key]

    def run_ours(self, engine: SREngine, name: str, request: SRRequest, collect: bool) -> tuple[float, dict, torch.Tensor | None]:
        """One end-to-end call: engine + MP4 encoding (closed, i.e. fully written, inside the timed region)."""
        height, width, frames, _ = self.workload(name)
        video = pattern(frames, height, width)
        collected: list[torch.Tensor] = []
        self.reset_peaks(engine.devices)
        with tempfile.TemporaryDirectory() as scratch:
            started = time.perf_counter()
            writer = Mp4Writer(Path(scratch) / "out.mp4", Fraction(24), engine.output_size(height, width, request.scale))

            def sink(chunk: torch.Tensor) -> None:
                writer.write(chunk)
                if collect:
                    collected.append(chunk.cpu())

            if frames > DEFAULT_WINDOW:  # as the product runs long clips: temporal windows, crossfaded
                pixels = (frame.numpy() for frame in quantise(video))
                runs = upscale_windows(engine, pixels, plan_windows(frames), request, sink).runs
            else:
                runs = (engine.upscale(video, request, sink),)
            engine_done = time.perf_counter()
            self.split_degree = max(run.split for run in runs)
            writer.close()
            elapsed = time.perf_counter() - started
            # How compressible the output is decides the encoder's share: random weights' output is noise-like.
            self.mp4_bytes = writer.path.stat().st_size
        # mp4_tail: from the engine's last frame to a finished file (what the encoder could not overlap). host_blend:
        # the calling thread adding tiles into canvases and normalising; host_sink: in `sink` (quantising, and waiting
        # for room in the encoder's queue).
        stages = self.timer.take() | {"mp4_encode_thread": round(writer.encode_seconds, 3), "mp4_tail": round(started + elapsed - engine_done, 3)}
        stages |= {f"host_{stage}": round(sum(run.stage_seconds.get(stage, 0.0) for run in runs), 3) for stage in ("blend", "sink")}
        self.frames_written = writer.frames
        self.quality_ran = runs[0].quality
        self.levers_ran = {lever: how for run in runs for lever, how in run.levers.items()}
        return elapsed, stages, torch.cat(collected) if collect else None

    def ours(
        self, name: str, devices: list[torch.device], order: str = "lockstep", segment: int = 4, hot: int | None = None,
        mode: str | None = None, offload: Offload | None = None, split: str | int = "auto", option: str | None = None,
    ) -> None:
        """`option`: a `QUALITY_OPTIONS` key, every run a `quality=high` request on an engine whose `high` runs those
        levers (None: lossless)."""
        scale = self.workload(name)[3]
        tier = quality.LOSSLESS if option is None else quality.HIGH
        high_levers = quality.HIGH_LEVERS if option is None else QUALITY_OPTIONS[option]
        runs, stages, graphs = [], [], []
        try:
            engine = self.engine(devices, order, segment, offload, split, high_levers)
            for _ in range(1 + (self.hot if hot is None else hot)):
                before = compiled_graphs()
                elapsed, stage, _ = self.run_ours(engine, name, SRRequest(scale=scale, seed=SEED, quality=tier), collect=False)
                runs.append(elapsed)
                stages.append(stage)
                graphs.append(compiled_graphs() - before)
            if self.diagnose:  # one more run, untimed: where the GPU idles and what synchronised it
                with Diagnosis() as diagnosis:
                    self.run_ours(engine, name, SRRequest(scale=scale, seed=SEED, quality=tier), collect=False)
        except torch.cuda.OutOfMemoryError as error:  # the finding under a cap: this mode does not fit
            peaks = self.peaks(devices)
            gc.collect()
            if self.home.type == "cuda":
                torch.cuda.empty_cache()
            self.emit(self.placement_record(name, devices, mode, order, segment, offload) | {
                "impl": "vsrq", "completes": False, "error": str(error).splitlines()[0][:300], "runs_completed": len(runs),
                "peak_reserved_gib": peaks,
            })
            return
        record = self.summary("vsrq", name, runs, stages, self.peaks(engine.devices), devices)
        record |= self.placement_record(name, devices, mode, order, segment, offload, engine)
        record |= self.quality_record(option, high_levers)
        if self.diagnose:
            record["diagnosis"] = diagnosis.record()
        # the ratios' bases are lossless phases: a quality phase's ratio_to_speed is its speed-up's inverse
        if option is None and (mode == "speed" or (mode is None and (order, segment) == ("lockstep", 4))):
            if self.cap_gib is None:
                self.speed_hot[name] = record["hot_median_s"]
        if name in self.speed_hot:
            record["ratio_to_speed"] = round(record["hot_median_s"] / self.speed_hot[name], 3)
        if name in self.reference_hot:
            record["ratio_to_reference"] = round(record["hot_median_s"] / self.reference_hot[name], 3)
        record["split"], record["split_degree"] = split, self.split_degree
        if len(devices) == 1:
            if option is None:
                self.single_hot[name] = record["hot_median_s"]
        elif name in self.single_hot:
            record["scaling_efficiency"] = round(self.single_hot[name] / (len(devices) * record["hot_median_s"]), 3)
        record |= {
            # Graphs Dynamo built per run: a hot run that builds any ran compilation beside other devices' calls
            # (what the compile gate must prevent) or met a shape its first run did not.
            "graphs_compiled": {"first": graphs[0], "hot": graphs[1:]},
            "decode_order": order,
            "decode_segment": segment,
            "peak_allocated_gib": self.peaks(engine.devices, torch.cuda.max_memory_allocated),
            "reserved_gib_by_stream_after_last_run": self.reserved_by_stream(),
            "frames_out": self.frames_written,
            "mp4_bytes": self.mp4_bytes,
            "host_threads": torch.get_num_threads(),
        }
        if not self.check or name not in self.compared:
            self.emit(record)
            return
        # One untimed run whose output is checked: in the reference's noise mode when the reference ran, so the same
        # output serves for the comparison with it and for bit-identity across device counts.
        mode = NoiseMode.REFERENCE if name in self.reference_frames else NoiseMode.PER_TILE
        _, _, output = self.run_ours(engine, name, SRRequest(scale=scale, seed=SEED, noise_mode=mode, quality=tier), collect=True)
        self.timer.take()
        # The first ours phase is the one a lossless phase set: a quality phase is measured against it, never one
        first = self.first_ours.setdefault((name, None, None), output) if option is None else self.first_ours.get((name, None, None))
        # the checked output's bits, to compare across processes and trees
        record["output_sha256"] = hashlib.sha256(output.cpu().contiguous().numpy().tobytes()).hexdigest()
        if first is not None:
            record["bit_identical_to_first_vsrq_phase"] = bool(torch.equal(first, output))
            record["max_abs_delta_to_first_vsrq_phase"] = (output - first).abs().max().item()
            record["psnr_db_to_first_vsrq_phase"] = psnr(output, first)
        if option is None:
            # Against the first phase that decoded the same way (on GPUs another segment length moves some pixels
            # by up to 2/255): where the weights live must not change a bit.
            same = self.first_ours.setdefault((name, order, segment), output)
            record["bit_identical_to_first_phase_of_its_decode"] = bool(torch.equal(same, output))
        elif first is not None:  # the tier's cost: per-frame PSNR and SSIM against lossless, mean and worst frame
            record["vs_lossless"] = similarity(output.to(self.home), first)
        else:
            record["vs_lossless"] = None  # no lossless phase of this workload ran before it
        if name in self.reference_frames:
            expected = self.reference_frames[name]
            record["vs_reference"] = {
                "noise_mode": mode.value,
                "max_abs_delta": round((output - expected).abs().max().item(), 6),
                "psnr_db": psnr(output, expected),
            }
        self.emit(record)

    def quality_record(self, option: str | None, high_levers: tuple[str, ...]) -> dict:
        """The tier the phase asked for, what ran (the engine's report of its latest run: each lever and how, FP8
        attention on `cudnn_fp8` or `fp8_emulated`), and why attention was emulated where it was."""
        record = {"quality": quality.LOSSLESS if option is None else quality.HIGH, "quality_option": option or quality.LOSSLESS,
                  "quality_ran": self.quality_ran, "levers_ran": self.levers_ran,
                  "decoder_layout": self.decoder_layout}  # fmt: skip
        if option is not None:
            record["high_levers"] = list(high_levers)
            if quality.FP8_ATTENTION in self.levers_ran and fp8_attention.why_emulated():
                record["fp8_attention_why_emulated"] = fp8_attention.why_emulated()
        return record

    def placement_record(self, name, devices, mode, order, segment, offload, engine: SREngine | None = None) -> dict:
        """Where the weights were and what the host held: the cap, the mode, host RSS now and at its peak, pinned
        bytes (the offloaded weights', and PyTorch's pinned allocator's)."""
        record = {
            "workload": name,
            "devices": [str(d) for d in devices],
            "completes": True,
            "cap_gib": self.cap_gib,
            "mode": mode,
            "offload": None if offload is None else {"layers": offload.layers, "resident_blocks": offload.resident_blocks, "prefetch": offload.prefetch},
            "host_rss_gib": round(psutil.Process().memory_info().rss / 2**30, 2),
            "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "offloaded_weights_pinned_gib": round(engine.pinned_bytes() / 2**30, 2) if engine is not None else None,
        }
        if self.home.type == "cuda" and hasattr(torch.cuda, "host_memory_stats"):
            stats = torch.cuda.host_memory_stats()
            record["pinned_allocator_gib"] = {key: round(value / 2**30, 2) for key, value in stats.items() if "bytes" in key and isinstance(value, int)}
        if engine is not None and engine.replicas[0].placement is not None:
            placement = engine.replicas[0].placement
            record["offload_copies"], record["offload_copied_gib"] = placement.copies, round(placement.bytes_copied / 2**30, 2)
        return record

    def batch(self, name: str, size: int) -> None:
        engine = self.engine([self.home])
        scale = self.workload(name)[3]
        outputs = {}
        for batch in (1, size):
            _, _, outputs[batch] = self.run_ours(engine, name, SRRequest(scale=scale, seed=SEED, tiles_batch_size=batch), collect=True)
        delta = (outputs[1] - outputs[size]).abs().max().item()
        self.emit({"phase": "batch", "workload": name, "tiles_batch_size": size, "bit_identical_to_batch_1": delta == 0, "max_abs_delta": delta})

    def summary(self, impl: str, name: str, runs: list[float], stages: list[dict], memory: dict, devices: list[torch.device]) -> dict:
        height, width, frames, scale = self.workload(name)
        hot = runs[1:] or runs
        last = stages[-1]
        flop = stage_tflop(height, width, frames, scale, self.tile_sizes, self.snap)
        return {
            "impl": impl,
            "workload": name,
            "input": f"{width}x{height}x{frames}",
            "scale": scale,
            "devices": [str(d) for d in devices],
            "cold_s": round(runs[0], 2),
            "hot_s": [round(r, 2) for r in hot],
            "hot_median_s": round(statistics.median(hot), 2),
            "stage_device_s_last_run": last,
            "achieved_tflop_per_s": {} if self.tiny else {k: round(flop[k] / last[k], 1) for k in flop if last.get(k)},
            "peak_reserved_gib": memory,
        }


def parse_phase(phase: str) -> tuple[str, str, list[str], str, str | None]:
    """"ours:W1:cuda:0@tile_major/2%high*1" -> ("ours", "W1", ["cuda:0@tile_major/2"], "1", "high")."""
    phase, _, hot = phase.partition("*")
    phase, _, option = phase.partition("%")
    if option and option not in QUALITY_OPTIONS:
        raise SystemExit(f"unknown quality option %{option}: one of {', '.join(QUALITY_OPTIONS)}")
    kind, name, *rest = phase.split(":", 2)
    return kind, name, rest, hot, option or None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", required=True)
    parser.add_argument("--hot", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny configuration: checks the script, measures nothing")
    parser.add_argument("--out", type=Path, default=Path("bench-results.jsonl"))
    parser.add_argument("--ref-hot", type=int, help="hot runs of the reference (default: --hot)")
    parser.add_argument("--compile", choices=("both", "transformer", "decoder", "none"), default="both", help="what the engines compile (on GPUs)")
    parser.add_argument("--decoder-layout", choices=("ncdhw", "ndhwc"), default="ncdhw",
                        help="the engines' decoder kernels: NCDHW (the worker's) or NDHWC (bench/RESULTS.md)")
    parser.add_argument("--compile-on-cpu", action="store_true", help="compile what --compile says on a CPU too (with --tiny: the compiled path in CI)")
    parser.add_argument("--diagnose", action="store_true",
                        help="one more untimed run per ours phase: GPU idle time and each host-device sync by call site")
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the untimed output checks")
    parser.add_argument("--check-only", help="comma-separated workloads: of the checks that would run, only theirs")
    args = parser.parse_args(argv)
    bench = Bench(args.out, args.hot, args.tiny, args.check, args.ref_hot, args.compile, args.compile_on_cpu)
    bench.decoder_layout, bench.diagnose = args.decoder_layout, args.diagnose
    phases = [parse_phase(phase) for phase in args.phases.split(",")]
    ours = [name for kind, name, *_ in phases if kind == "ours"]
    bench.compared = {name for kind, name, *_ in phases if kind == "ref"} | {name for name in ours if ours.count(name) > 1}
    if args.check_only:
        bench.compared &= set(args.check_only.split(","))
    for kind, name, rest, hot, option in phases:
        if kind == "ref":
            bench.reference(name, int(hot) if hot else None)
        elif kind == "ours":
            devices, _, layout = (rest[0] if rest else str(bench.home)).partition("@")
            devices, _, split = devices.partition("~")
            devices, split = [torch.device(d) for d in devices.split("+")], int(split) if split.isdigit() else split or "auto"
            order, _, segment = (layout or "lockstep").partition("/")
            if order in PERFORMANCE_MODES or order == "auto":
                mode, options = bench.mode(order, devices, int(segment) if segment else None)
                order, segment = options["decode_order"], options["decode_segment"]
                bench.ours(name, devices, order, segment, int(hot) if hot else None, mode, options["offload"], split, option)
            else:
                bench.ours(name, devices, order, int(segment or 4), int(hot) if hot else None, split=split, option=option)
        elif kind == "cap":
            bench.cap(float(name))
        elif kind == "batch":
            bench.batch(name, int(rest[0]))
        elif kind == "threads":
            torch.set_num_threads(int(name))
        else:
            raise SystemExit(f"unknown phase kind {kind!r}")


if __name__ == "__main__":
    main()
