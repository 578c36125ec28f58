"""Micro-benchmarks of the GPU levers, one W1 tile at full size (random bf16 weights): where decode and DiT time
goes (torch.profiler), and what each candidate change buys and costs in accuracy.

    python bench/levers.py --out levers.jsonl [--sections profile,decode,memory,attention,dit,nabla,mp4,threading,host]

`host`, `mp4` and `threading` run on the CPU alone (no GPU needed).

Run `nabla` and `dit` in separate processes: each compiles the transformer's blocks for its own processor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench import build  # noqa: E402
from worker.media.writer import THREAD_TYPE  # noqa: E402
from worker.sr.compilation import COMPILE  # noqa: E402

TILE_LATENT = (1, 64, 31, 32, 48)  # (B, C, T, H, W): one W1 tile, 121 frames of 512x768
TOKENS = 31 * 32 * 48


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    fn()  # warm-up (and cuDNN autotune where enabled)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeat, out


def decode(vae, z: torch.Tensor, segment: int) -> torch.Tensor:
    cache = vae.decoder.make_cache()
    bounds = [0, 1, *range(1 + segment, z.shape[2], segment), z.shape[2]]
    frames = []
    for a, b in zip(bounds, bounds[1:]):
        frames.append(vae.decoder(z[:, :, a:b], cache).float())
    return torch.cat(frames, dim=2)


def compiled_dit_call(transformer, x: torch.Tensor, t: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """Compiles the transformer's blocks: (compile seconds, seconds per call, output)."""
    started = time.perf_counter()
    transformer.compile_repeated_blocks(**COMPILE)  # as the engine compiles them
    transformer(x, t)
    torch.cuda.synchronize()
    compile_seconds = time.perf_counter() - started
    seconds, out = timed(lambda: transformer(x, t, return_dict=False)[0], repeat=2)
    return compile_seconds, seconds, out


def mp4_tail(
    lookahead: int | None,
    frames: int = 121,
    chunk: int = 16,
    every_s: float = 0.6,
    content: str = "pattern",
    size: tuple[int, int] = (1024, 1536),
    thread_type: str = THREAD_TYPE,
) -> dict:
    """The W1 output (1536x1024; `size` (height, width)) through the product's writer, 16 frames every `every_s` as
    the engine delivers them: how long the file takes to finish after the last frame (x264 holds its lookahead and
    one frame per thread), and its size at the same CRF. `content`: the synthetic test pattern, or noise, which is
    what random weights' output encodes like (on a 2-core CPU, W2's 33 frames: tail 0.21 s for the pattern, 2.7 s
    for noise). `every_s` 0: as fast as the encoder takes them (its throughput)."""
    import tempfile
    from fractions import Fraction

    from worker.media.synthetic import pattern
    from worker.media.writer import Mp4Writer

    video = pattern(frames, *size)  # on the CPU, as the engine hands frames to the sink
    if content == "noise":
        video = (video + 0.2 * torch.randn(video.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "out.mp4"
        writer = Mp4Writer(path, Fraction(24), size, lookahead=lookahead, thread_type=thread_type)
        first = time.perf_counter()
        for start in range(0, frames, chunk):
            if start:
                time.sleep(every_s)
            writer.write(video[start : start + chunk])
        started = time.perf_counter()  # right after the last frames, as `engine.upscale` returns
        writer.close()
        finished = time.perf_counter()
        return {
            "size": f"{size[1]}x{size[0]}",
            "thread_type": thread_type,
            "every_s": every_s,
            "lookahead": lookahead,
            "content": content,
            "tail_s": round(finished - started, 3),
            "wall_s": round(finished - first, 3),
            "bytes": path.stat().st_size,
            "encode_thread_s": round(writer.encode_seconds, 3),
        }


def host_segment(height: int, width: int, frames: int = 16) -> dict:
    """The host's share of one output segment after the tiles are blended, as the engine and the writer run it:
    normalising the canvas, quantising to 8 bits, converting to the encoder's YUV (the encoder thread's part before
    x264). Best of three, seconds."""
    from worker.media.writer import yuv_frame
    from worker.sr.engine import _normalise
    from worker.frames import quantise

    generator = torch.Generator().manual_seed(0)
    canvas = torch.randn(3, frames, height, width, generator=generator)
    weights = torch.rand(height, width, generator=generator) + 0.5

    def best(step):
        seconds = []
        for _ in range(3):
            started = time.perf_counter()
            out = step()
            seconds.append(time.perf_counter() - started)
        return round(min(seconds), 3), out

    normalise_s, video = best(lambda: _normalise(canvas, weights))
    quantise_s, pixels = best(lambda: quantise(video))
    arrays = pixels.numpy()
    convert_s, _ = best(lambda: [yuv_frame(pixel) for pixel in arrays])
    return {"size": f"{width}x{height}x{frames}", "threads": torch.get_num_threads(), "normalise_s": normalise_s,
            "quantise_s": quantise_s, "yuv_convert_s": convert_s}


def top_kernels(prof) -> str:
    averages = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            return averages.table(sort_by=key, row_limit=25)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=25)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", default="decode,dit")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    device = torch.device("cuda:0")

    def emit(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        with args.out.open("a") as file:
            file.write(line + "\n")

    if "host" in sections:  # W1's output segment, and W1 at x4's
        for height, width in ((1024, 1536), (2048, 3072)):
            emit({"section": "host_segment"} | host_segment(height, width))
    if "mp4" in sections:
        for lookahead, content in ((None, "pattern"), (16, "pattern"), (8, "pattern"), (16, "noise")):
            emit({"section": "mp4_tail"} | mp4_tail(lookahead, content=content))
    if "threading" in sections:  # x264's sliced threads (PyAV's default) against frame threads, on each output
        for size, frames, every_s in (((512, 768), 33, 0.2), ((1024, 1536), 121, 0.6), ((2048, 3072), 121, 0.0)):
            for content in ("noise", "pattern"):
                for thread_type in ("SLICE", "FRAME"):
                    record = mp4_tail(16, frames, every_s=every_s, content=content, size=size, thread_type=thread_type)
                    emit({"section": "mp4_tail"} | record)
    if not sections - {"host", "mp4", "threading"}:
        return

    parts = build(device, tiny=False)  # the benchmark's full-size random components, SDPA attention set
    del parts["latent_upscaler"]  # not measured here: keep its 7.3 GB out of the memory figures
    vae, transformer = parts["vae"], parts["transformer"]
    z = torch.randn(TILE_LATENT, device=device, dtype=torch.bfloat16)

    with torch.no_grad():
        if "profile" in sections:
            from torch.profiler import ProfilerActivity, profile

            decode(vae, z[:, :, :9], 4)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                decode(vae, z[:, :, :9], 4)
                torch.cuda.synchronize()
            emit({"section": "profile_decode_9_latent_frames", "table": top_kernels(prof)})
            x = torch.randn(1, 31, 32, 48, 129, device=device, dtype=torch.bfloat16)
            t = torch.tensor([700.0], device=device)
            transformer(x, t)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                transformer(x, t)
                torch.cuda.synchronize()
            emit({"section": "profile_dit_call", "table": top_kernels(prof)})

        if "decode" in sections:
            from worker.sr.fast_vae import compile_decoder, speed_up_decoder

            reference = None
            variants = [  # each adds one change to the decoder measured before it
                ("stock", None),
                ("broadcast_norm", lambda vae: speed_up_decoder(vae, ["broadcast_norm"])),
                ("broadcast_norm+implicit_pad", lambda vae: speed_up_decoder(vae, ["implicit_pad"])),
                ("broadcast_norm+implicit_pad+compiled_blocks", compile_decoder),
                (
                    "broadcast_norm+implicit_pad+compiled_blocks+sub_pixel_upsample",
                    lambda vae: speed_up_decoder(vae, ["sub_pixel_upsample"]),
                ),
            ]
            for name, change in variants:
                if change is not None:
                    change(vae)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                first = time.perf_counter()
                decode(vae, z, 4)  # first call: compiles where compiled
                torch.cuda.synchronize()
                first = time.perf_counter() - first
                seconds, out = timed(lambda: decode(vae, z, 4), repeat=2)
                reference = out if reference is None else reference
                emit({
                    "section": "decode_one_tile",
                    "variant": name,
                    "seconds": round(seconds, 3),
                    "first_call_s": round(first, 1),
                    "tflop_per_s": round(837.6 / seconds, 1),
                    "peak_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
                    "max_abs_delta_vs_stock": (out - reference).abs().max().item(),
                    "psnr_vs_stock_db": round(10 * torch.log10(4 / (out - reference).pow(2).mean().clamp_min(1e-20)).item(), 1),
                })
                del out

        if "memory" in sections:
            # Where a resident W1 job's decode memory goes: one tile's causal cache, and the activations of one
            # segment by its length (the compiled decoder, as the engine runs it).
            from worker.sr.decoder_caches import cache_bytes
            from worker.sr.fast_vae import compile_decoder, speed_up_decoder

            compile_decoder(speed_up_decoder(vae))
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            cache = vae.decoder.make_cache()
            vae.decoder(z[:, :, :1], cache)
            vae.decoder(z[:, :, 1:5], cache)
            held = cache_bytes(cache)
            emit({"section": "decode_cache", "bytes_per_tile": held, "gib_per_tile": round(held / 2**30, 2)})
            del cache
            for segment in (4, 2, 1):
                decode(vae, z, segment)  # compiles this segment length
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                seconds, out = timed(lambda: decode(vae, z, segment), repeat=1)
                emit({
                    "section": "decode_memory",
                    "segment": segment,
                    "seconds": round(seconds, 3),
                    "peak_allocated_above_weights_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2),
                    "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
                    "weights_gib": round(base / 2**30, 2),
                })
                del out

        if "nabla" in sections:
            from worker.sr.attention import NablaFlexProcessor, nabla_density, qkv

            x = torch.randn(1, 31, 32, 48, 129, device=device, dtype=torch.bfloat16)
            t = torch.tensor([700.0], device=device)
            densities: list[float] = []
            hooks = [
                block.self_attention.register_forward_pre_hook(
                    lambda attn, args: densities.append(nabla_density(*qkv(attn, args[0], args[1])[:2], args[2]).item())
                )
                for block in transformer.visual_transformer_blocks
            ]
            dense = transformer(x, t, return_dict=False)[0].float()  # eager, dense SDPA: the exact reference
            for hook in hooks:
                hook.remove()
            emit({"section": "nabla", "density_mean": round(sum(densities) / len(densities), 4), "density_per_layer": [round(d, 3) for d in densities]})
            transformer.set_attn_processor(NablaFlexProcessor())
            compile_seconds, seconds, out = compiled_dit_call(transformer, x, t)
            delta = out.float() - dense
            emit({
                "section": "dit_call",
                "variant": "compiled_blocks_nabla_flex",
                "compile_s": round(compile_seconds, 1),
                "seconds": round(seconds, 3),
                "max_abs_delta_vs_dense": delta.abs().max().item(),
                "rel_rms_delta_vs_dense": (delta.pow(2).mean().sqrt() / dense.pow(2).mean().sqrt()).item(),
            })

        if "attention" in sections:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            q, k, v = (torch.randn(1, 28, TOKENS, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * TOKENS * TOKENS * 64 * 28
            base = None
            for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
                try:
                    with sdpa_kernel(backend):
                        seconds, out = timed(lambda: F.scaled_dot_product_attention(q, k, v), repeat=3)
                except RuntimeError as error:
                    emit({"section": "attention", "backend": backend.name, "error": str(error)[:200]})
                    continue
                base = out if base is None else base
                emit({"section": "attention", "backend": backend.name, "ms": round(seconds * 1e3, 2), "tflop_per_s": round(flops / seconds / 1e12, 1), "max_abs_delta_vs_flash": (out - base).abs().max().item()})
            seconds, _ = timed(lambda: F.scaled_dot_product_attention(q, k, v), repeat=3)
            emit({"section": "attention", "backend": "default_dispatch", "ms": round(seconds * 1e3, 2)})

        if "dit" in sections:
            x = torch.randn(1, 31, 32, 48, 129, device=device, dtype=torch.bfloat16)
            t = torch.tensor([700.0], device=device)
            seconds, eager = timed(lambda: transformer(x, t, return_dict=False)[0], repeat=2)
            emit({"section": "dit_call", "variant": "eager_sdpa", "seconds": round(seconds, 3)})
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                seconds, out = timed(lambda: transformer(x, t, return_dict=False)[0], repeat=2)
            emit({"section": "dit_call", "variant": "eager_cudnn_attention", "seconds": round(seconds, 3), "max_abs_delta": (out.float() - eager.float()).abs().max().item()})
            compile_seconds, seconds, out = compiled_dit_call(transformer, x, t)
            emit({"section": "dit_call", "variant": "compiled_blocks_sdpa", "compile_s": round(compile_seconds, 1), "seconds": round(seconds, 3), "max_abs_delta": (out.float() - eager.float()).abs().max().item()})


if __name__ == "__main__":
    main()
