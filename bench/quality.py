"""What `quality=high` buys and costs, lever by lever, in one short GPU run (full-size model, random bf16 weights).

    python3 bench/quality.py --out quality.jsonl [--phases attention,dit,pipeline] [--budget-s 190] [--tiny]

Phases:
  attention one W1 tile's attention alone (28 heads x 47,616 tokens x 64, random bf16 q/k/v): bf16 SDPA against
            FP8 attention (`worker.sr.fp8_attention`) at softmax scales 64, 256 and 448, milliseconds and relative
            L2 error against bf16
and, each lever set in turn (lossless, fp8_linear, fp8_attention, both):
  dit       one DiT forward at one W1 tile's shape (31x32x48 latent tokens, 47,616 tokens; eager, CUDA-synchronised,
            warm-up then --repeat timed calls): seconds per call, speed-up against lossless, and the prediction's
            relative L2 error against lossless's
  pipeline  the whole engine (eager) on the test pattern (worker.media.synthetic.pattern) at --workload (W2 by
            default: 33 frames of 256x384 at x2, one tile), or on the first --frames frames of a real clip
            (--source, x2): seconds of one warm call, and the output's per-frame PSNR and SSIM against lossless
            (mean and worst frame)
Every line is printed and appended to --out as soon as it is measured, so a run cut short keeps what it finished;
a phase that would start after --budget-s seconds (counted from the start of the process) is skipped with a line
saying so. Eager unless `--compile` (the dit phase only: the transformer's repeated blocks compiled as the worker
compiles them; each lever set's first call builds its graph, `first_call_s`), and `--levers` picks and orders the
lever sets (lossless first); `--profile` adds one profiled DiT call per lever set: its top kernels by time.
`fp8_attention` says which attention ran (`cudnn_fp8`, or `fp8_emulated` when nvidia-cudnn-frontend is missing or
its graph does not build: then the timing is the emulation's, not a speed figure). `--tiny` runs the same phases on
the CPU with the tiny configuration, so CI keeps this script working.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

STARTED = time.monotonic()  # the budget counts the imports too

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import similarity
from bench.bench import SEED, WORKLOADS, build
from worker.media.synthetic import pattern
from worker.sr import fp8_attention, quality
from worker.sr.checkpoint import Components, prune_upscaler
from worker.sr.compilation import COMPILE, allow_many_graphs
from worker.sr.engine import SREngine
from worker.sr.request import SRRequest

LEVER_SETS = {
    "lossless": (),
    "fp8_linear": (quality.FP8_LINEAR,),
    "fp8_attention": (quality.FP8_ATTENTION,),
    "both": (quality.FP8_LINEAR, quality.FP8_ATTENTION),
}
W1_TILE_LATENT = (31, 32, 48)  # (frames, height, width) of one W1 tile's latents: 47,616 tokens
TINY_TILE_LATENT = (3, 8, 8)
TINY_WORKLOAD = (24, 48, 9, 2)  # (height, width, frames, scale): 2x2 tiny tiles


class Run:
    def __init__(self, out: Path, budget_s: float, device: torch.device, tiny: bool, compile: bool = False,
                 levers: Sequence[str] = tuple(LEVER_SETS), profile: bool = False) -> None:  # fmt: skip
        self.out, self.budget_s, self.device, self.tiny = out, budget_s, device, tiny
        self.compile, self.levers, self.profile = compile, levers, profile

    def emit(self, record: dict) -> None:
        record = {"elapsed_s": round(time.monotonic() - STARTED, 1), **record}
        line = json.dumps(record)
        print(line, flush=True)
        with open(self.out, "a") as out:
            out.write(line + "\n")

    def within_budget(self, phase: str) -> bool:
        if time.monotonic() - STARTED < self.budget_s:
            return True
        self.emit({"phase": phase, "skipped": f"past --budget-s {self.budget_s:g}"})
        return False

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def attention(run: Run, repeat: int) -> None:
    """FP8 attention against bf16 SDPA at one tile's attention shape, and what the softmax scale does to its error."""
    heads, dim = 28, 64
    tokens = 3 * 8 * 8 if run.tiny else math.prod(W1_TILE_LATENT)
    dtype = torch.float32 if run.tiny else torch.bfloat16
    generator = torch.Generator().manual_seed(SEED)
    # (B, H, S, D) views over (B, S, H, D) memory, as the projections make them
    q, k, v = (torch.randn(1, tokens, heads, dim, generator=generator).to(run.device, dtype).transpose(1, 2) for _ in range(3))

    def timed(call) -> tuple[float, torch.Tensor]:
        out = call()  # warm-up (and the cuDNN graph)
        run.sync()
        started = time.perf_counter()
        for _ in range(repeat):
            out = call()
        run.sync()
        return (time.perf_counter() - started) / repeat, out

    seconds, exact = timed(lambda: F.scaled_dot_product_attention(q, k, v).transpose(1, 2))
    run.emit({"phase": "attention", "variant": "bf16_sdpa", "shape": [1, heads, tokens, dim], "ms": round(seconds * 1e3, 3)})
    default = fp8_attention.SOFTMAX_SCALE
    try:
        for scale in (64.0, 256.0, 448.0):
            if not run.within_budget("attention"):
                return
            fp8_attention.SOFTMAX_SCALE = scale
            fp8_attention.reset_backend_used()
            try:
                seconds, out = timed(lambda: fp8_attention.fp8_attention(q, k, v))
            except Exception as error:
                run.emit({"phase": "attention", "variant": "fp8", "softmax_scale": scale, "error": f"{type(error).__name__}: {error}"[:500]})
                continue
            error_l2 = ((out.float() - exact.float()).norm() / exact.float().norm()).item()
            record = {"phase": "attention", "variant": "fp8", "ran": fp8_attention.backend_used(), "softmax_scale": scale,
                      "ms": round(seconds * 1e3, 3), "relative_l2_vs_bf16": round(error_l2, 5)}  # fmt: skip
            if fp8_attention.why_emulated():  # cuDNN refused or is missing: why, in the results
                record["why_emulated"] = fp8_attention.why_emulated()
            run.emit(record)
    finally:
        fp8_attention.SOFTMAX_SCALE = default


def dit(run: Run, transformer: torch.nn.Module, repeat: int) -> None:
    """One DiT forward per lever set at one tile's token grid."""
    frames, height, width = TINY_TILE_LATENT if run.tiny else W1_TILE_LATENT
    channels = transformer.config.in_visual_dim
    generator = torch.Generator().manual_seed(SEED)
    dtype = next(transformer.visual_transformer_blocks.parameters()).dtype
    # noisy latents, then the anchor-free conditioning the engine appends (zeros), as `SREngine._denoise` builds it
    latents = torch.randn(1, frames, height, width, channels, generator=generator).to(run.device, dtype)
    x = torch.cat([latents, torch.zeros((*latents.shape[:-1], channels + 1), dtype=dtype, device=run.device)], dim=-1)
    t = torch.tensor([700.0], device=run.device)
    if run.compile:  # as the worker runs the DiT: its repeated blocks compiled; a lever set's first call compiles its own
        allow_many_graphs()
        transformer.compile_repeated_blocks(**COMPILE)
    baseline, baseline_s = None, None
    for name in run.levers:
        levers = LEVER_SETS[name]
        if not run.within_budget(f"dit:{name}"):
            return
        quality.reset()
        try:
            with torch.no_grad(), quality.applied(transformer, levers) as applied:
                first_started = time.perf_counter()
                out = transformer(hidden_states=x, timestep=t, return_dict=False)[0]  # warm-up: FP8 weights, cuDNN graph
                run.sync()
                first_s = time.perf_counter() - first_started
                started = time.perf_counter()
                for _ in range(repeat):
                    out = transformer(hidden_states=x, timestep=t, return_dict=False)[0]
                run.sync()
                seconds = (time.perf_counter() - started) / repeat
                report = applied.report()
                kernels = None
                if run.profile:
                    kernels = profile(run, lambda: transformer(hidden_states=x, timestep=t, return_dict=False))
        except Exception as error:  # a lever that fails here is a finding: record it, go on with the others
            run.emit({"phase": "dit", "levers": name, "error": f"{type(error).__name__}: {error}"[:500]})
            continue
        record = {"phase": "dit", "levers": name, "ran": report, "tokens": frames * height * width, "repeat": repeat,
                  "seconds": round(seconds, 4), "first_call_s": round(first_s, 3), "compiled": run.compile,
                  "output_sha256": hashlib.sha256(out.float().cpu().numpy().tobytes()).hexdigest()[:16]}  # fmt: skip
        if baseline is None:
            baseline, baseline_s = out.float(), seconds
        else:
            record["speedup_vs_lossless"] = round(baseline_s / seconds, 3)
            record["relative_l2_vs_lossless"] = round(((out.float() - baseline).norm() / baseline.norm()).item(), 5)
        if kernels is not None:
            record["kernels"] = kernels
        run.emit(record)


def profile(run: Run, call, top: int = 12) -> dict:
    """One more call under torch.profiler: its kernels' time in all, the `top` kernels by time (name, calls,
    milliseconds, share): where a lever set's time goes, and every kernel's name (what ran, whatever its time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CUDA] if run.device.type == "cuda" else [ProfilerActivity.CPU]
    with profiler(activities=activities) as prof:
        call()
        run.sync()
    attribute = "self_device_time_total" if run.device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attribute, 0) > 0]
    total_us = sum(getattr(e, attribute) for e in events)
    events.sort(key=lambda e: getattr(e, attribute), reverse=True)
    return {
        "total_ms": round(total_us / 1e3, 2),
        "top": [
            {"name": e.key[:90], "calls": e.count, "ms": round(getattr(e, attribute) / 1e3, 2),
             "share": round(getattr(e, attribute) / max(total_us, 1), 4)}
            for e in events[:top]
        ],
        "names": sorted({e.key[:90] for e in events}),
    }  # fmt: skip


def pipeline(run: Run, parts: dict, workload: str, source: Path | None = None, frames: int = 49) -> None:
    """The whole engine on the test pattern or a real clip per lever set: a warm call's seconds (after an untimed
    one), the output against lossless's."""
    height, width, length, scale = TINY_WORKLOAD if run.tiny else WORKLOADS[workload]
    prune_upscaler(parts["latent_upscaler"])
    replica = Components(run.device, parts["transformer"], parts["vae"], parts["scheduler"], parts["latent_upscaler"])
    if source is None:
        video = pattern(length, height, width)
    else:
        video, scale, workload = _clip(source, frames), 2, source.name
    baseline = None
    for name in run.levers:
        levers = LEVER_SETS[name]
        if not run.within_budget(f"pipeline:{name}"):
            return
        engine = SREngine([replica], compile_transformer=False, compile_decoder=False, high_levers=levers)
        tier = SRRequest(scale=scale, quality="high" if levers else "lossless")
        try:
            # untimed first: cuDNN's autotuning, the allocator's growth, the FP8 weights and attention graph
            engine.upscale(video, tier, lambda _: None)
            chunks: list[torch.Tensor] = []
            run.sync()
            started = time.perf_counter()
            info = engine.upscale(video, tier, chunks.append)
            run.sync()
            seconds = time.perf_counter() - started
        except Exception as error:
            run.emit({"phase": "pipeline", "levers": name, "error": f"{type(error).__name__}: {error}"[:500]})
            continue
        output = torch.cat(chunks)
        record = {"phase": "pipeline", "workload": "tiny" if run.tiny and source is None else workload, "levers": name, "quality": info.quality,
                  "ran": info.levers, "tiles": info.tiles, "frames": info.frames, "seconds": round(seconds, 3)}  # fmt: skip
        if baseline is None:
            baseline, baseline_s = output, seconds
        else:
            record |= {"speedup_vs_lossless": round(baseline_s / seconds, 3)} | similarity.summary(output.to(run.device), baseline)
        run.emit(record)


def _clip(source: Path, frames: int) -> torch.Tensor:
    """The first `frames` frames of a real clip as (F, 3, H, W) floats in [0, 1], as the worker reads them (turned
    upright, converted with the stream's own colour matrix and range)."""
    from itertools import islice

    import numpy as np

    from worker.media.probe import probe
    from worker.media.reader import read_frames

    decoded = list(islice(read_frames(source, probe(source).video), frames))
    return torch.from_numpy(np.stack(decoded)).permute(0, 3, 1, 2).float() / 255


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    parser.add_argument("--phases", default="attention,dit,pipeline")
    parser.add_argument("--budget-s", type=float, default=190.0, help="no phase starts after this many seconds")
    parser.add_argument("--repeat", type=int, default=3, help="timed DiT calls per lever set, after one warm-up")
    parser.add_argument("--workload", default="W2", choices=sorted(WORKLOADS), help="the pipeline phase's clip")
    parser.add_argument("--source", type=Path, help="the pipeline phase on this real clip (x2) instead of --workload")
    parser.add_argument("--frames", type=int, default=49, help="the real clip's first frames the pipeline phase runs")
    parser.add_argument("--tiny", action="store_true", help="the tiny configuration on the CPU (CI)")
    parser.add_argument("--compile", action="store_true", help="the dit phase with the blocks compiled, as the worker")
    parser.add_argument("--levers", default=",".join(LEVER_SETS), help="the lever sets, in this order")
    parser.add_argument("--profile", action="store_true", help="the dit phase also profiles one call per lever set")
    args = parser.parse_args(argv)
    phases = args.phases.split(",")
    unknown = set(phases) - {"attention", "dit", "pipeline"}
    if unknown:
        parser.error(f"unknown phase(s) {sorted(unknown)}")

    device = torch.device("cpu" if args.tiny else "cuda:0")
    levers = args.levers.split(",")
    if unknown := set(levers) - set(LEVER_SETS):
        parser.error(f"--levers: unknown {sorted(unknown)}; known: {', '.join(LEVER_SETS)}")
    if levers[0] != "lossless":
        parser.error("--levers: lossless first (the others are measured against it)")
    run = Run(args.out, args.budget_s, device, args.tiny, args.compile, levers, args.profile)
    info = {"phase": "setup", "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    try:
        import cudnn

        info["cudnn_frontend"] = cudnn.__version__
    except Exception as error:  # the optional `fp8` extra: FP8 attention is then emulated, and the lines say so
        info["cudnn_frontend"] = f"unavailable: {type(error).__name__}: {error}"[:200]
    if device.type == "cuda":
        info["cudnn"] = torch.backends.cudnn.version()
    parts = build(device, args.tiny)
    run.emit(info | {"build_done_s": round(time.monotonic() - STARTED, 1)})
    if "attention" in phases and run.within_budget("attention"):
        attention(run, args.repeat)
    if "dit" in phases:
        dit(run, parts["transformer"], args.repeat)
    if "pipeline" in phases and run.within_budget("pipeline"):
        pipeline(run, parts, args.workload, args.source, args.frames)
    run.emit({"phase": "done"})


if __name__ == "__main__":
    main()
