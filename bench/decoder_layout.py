"""Where one W1 tile's decode goes, by kernel kind, with the activations stored NCDHW or NDHWC (`channels_last_3d`):
cuDNN's 3D convolutions run on NDHWC, so an NCDHW convolution pays a layout conversion around it. Full-size random
VAE, the worker's decoder (`speed_up_decoder`, `compile_decoder`); `--tiny` runs the tiny one on the CPU (a smoke run).

    python bench/decoder_layout.py --out layout.jsonl [--layouts engine_before,engine_now,ndhwc,ncdhw]
                                   [--latent-frames 31] [--repeat 3] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import diffusers  # noqa: E402

from bench.bench import store_decoder_kernels, tiny_components  # noqa: E402
from bench.levers import decode  # noqa: E402
from worker.sr import fast_vae  # noqa: E402
from worker.sr.fast_vae import compile_decoder, speed_up_decoder  # noqa: E402

# Kernel names by kind (cuDNN's and CUTLASS's convolution kernels, their layout conversions, Inductor's Triton).
KINDS = (
    ("layout", re.compile(r"nchwToNhwc|nhwcToNchw|nchw_to_nhwc|nhwc_to_nchw|transpose|permute", re.I)),
    ("conv", re.compile(r"conv|xmma|cutlass|implicit|sm90_|fprop|dgrad|wgrad", re.I)),
    ("triton", re.compile(r"^triton_")),
    ("copy", re.compile(r"copy|cat|elementwise|vectorized|unrolled", re.I)),
)


def kind(name: str) -> str:
    return next((label for label, pattern in KINDS if pattern.search(name)), "other")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_kinds(run) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        run()
        synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    top: list[tuple[float, str]] = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if not us or event.key.startswith(("cuda", "aten::", "Memcpy", "Memset")) and "Kernel" not in event.key:
            continue
        by_kind[kind(event.key)] += us / 1e3
        top.append((us / 1e3, event.key[:120]))
    top.sort(reverse=True)
    by_kind = {name: round(ms, 2) for name, ms in sorted(by_kind.items())}
    return {"ms_by_kind": by_kind, "top": [(round(ms, 2), name) for ms, name in top[:20]]}


@torch.no_grad()
def timed_decodes(vae, z: torch.Tensor, repeat: int) -> tuple[float, list[float], torch.Tensor, dict]:
    """The first decode's seconds (it compiles), `repeat` more timed, the last one's output, one more profiled."""
    seconds, out = [], None
    for _ in range(1 + repeat):
        start = time.perf_counter()
        out = decode(vae, z, 4)
        synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds[0], seconds[1:], out, profile_kinds(lambda: decode(vae, z, 4))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layouts", default="engine_before,engine_now,ndhwc,ncdhw")
    parser.add_argument("--latent-frames", type=int, default=31)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda:0")

    def emit(**record) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        with args.out.open("a") as file:
            file.write(line + "\n")

    torch.manual_seed(0)
    if args.tiny:
        vae, size = tiny_components()["vae"].eval(), (8, 12)
    else:
        with torch.device(device):
            vae, size = diffusers.Kandinsky6SRVAE().to(torch.bfloat16).eval().requires_grad_(False), (32, 48)
    speed_up_decoder(vae)
    if not args.tiny:
        compile_decoder(vae)
    shape = (1, vae.config.latent_channels, args.latent_frames, *size)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device, vae.dtype)
    # (name, the latent's layout, the weights', whether an upsampling's output follows its input's layout): the engine
    # hands the decoder its latents as a (B, T, H, W, C) tensor permuted, i.e. NDHWC.
    variants = {
        "ncdhw": ("ncdhw", "ncdhw", True),
        "engine_before": ("ndhwc", "ncdhw", False),
        "engine_now": ("ndhwc", "ncdhw", True),
        "ndhwc": ("ndhwc", "ndhwc", True),
    }
    layouts = {"ncdhw": torch.contiguous_format, "ndhwc": torch.channels_last_3d}
    follow = fast_vae._layout
    reference = None
    try:
        for name in args.layouts.split(","):
            latent_layout, weight_layout, follows = variants[name]
            store_decoder_kernels(vae, layouts[weight_layout])
            fast_vae._layout = follow if follows else (lambda tensor: torch.contiguous_format)
            zl = z.contiguous(memory_format=layouts[latent_layout])
            first, seconds, out, kinds = timed_decodes(vae, zl, args.repeat)
            reference = out if reference is None else reference
            delta = (out - reference).abs().max().item()
            emit(section="decode_layout", variant=name, latent=latent_layout, weights=weight_layout,
                 upsampling_follows=follows, latent_frames=args.latent_frames, seconds=[round(s, 4) for s in seconds],
                 best_s=round(min(seconds), 4), first_call_s=round(first, 1), max_abs_delta_vs_first=delta,
                 same_bits_as_first=bool(torch.equal(out, reference)), **kinds)
            del out
    finally:  # the module's own rule again
        fast_vae._layout = follow


if __name__ == "__main__":
    main()
