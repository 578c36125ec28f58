"""How long the MP4 writer takes after the engine's last frame (the job tail's `flush`), per encoder setting, on
the CPU: frames arrive as the engine gives them (bursts of one decode segment, then the short last ones), noise-like
as a random-weights model's output, and `close()` is timed from the last `write`. Also the file's size and its
PSNR against the frames written, so that a faster tail's cost in bits or fidelity is on the same line.

    python bench/encoder_flush.py --shape W1 --variants base,la8,la4 --out flush.jsonl
    python bench/encoder_flush.py --source ~/.cache/vsrq/corpus/kivy-cityCC0.mpg --variants la40,base,la8,la4

`--source`: a real clip's first 121 frames, bicubic x2, instead of noise (what a setting costs on real video).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: `bench` the package

from bench.lines import emit  # noqa: E402
from worker.media import writer as writer_module  # noqa: E402
from worker.media.writer import Mp4Writer  # noqa: E402

# output (height, width, frames), the engine's bursts (frames each) and the seconds between bursts
SHAPES = {
    "W1": ((1024, 1536), 121, [16] * 7 + [4, 4, 1], 2.0),
    "W2": ((512, 768), 33, [16, 16, 1], 0.35),
    "2160p": ((2160, 3840), 9, [8, 1], 3.0),
}


def frames_like_model(size: tuple[int, int], count: int, seed: int = 0) -> np.ndarray:
    """Noise-like frames (grain at half resolution, upscaled) over a moving gradient, (n, 3, H, W) float in [0, 1]:
    W2 encodes to ~2.3 MB, as the random-weights model's output does."""
    rng = np.random.default_rng(seed)
    height, width = size
    y, x = np.mgrid[0 : height // 2, 0 : width // 2].astype(np.float32)
    out = np.empty((count, 3, height, width), np.float32)
    for index in range(count):
        base = np.stack([(x + 3 * index) % (width // 2) / (width // 2), y / (height // 2), 0.5 + 0 * x]) * 0.8
        small = np.clip(base + rng.normal(0, 0.04, base.shape), 0, 1)
        out[index] = small.repeat(2, axis=1).repeat(2, axis=2)
    return out


def frames_of(path: Path, count: int = 121) -> np.ndarray:
    """A real clip's first `count` frames, bicubic x2 (even sizes), (n, 3, H, W) float in [0, 1]."""
    pixels = []
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            pixels.append(frame.to_ndarray(format="rgb24"))
            if len(pixels) == count:
                break
    height, width = (side - side % 2 for side in pixels[0].shape[:2])
    small = torch.from_numpy(np.stack([p[:height, :width] for p in pixels])).permute(0, 3, 1, 2).float() / 255
    return torch.nn.functional.interpolate(small, scale_factor=2, mode="bicubic").clamp(0, 1).numpy()


def psnr(path: Path, frames: np.ndarray) -> float:
    errors = []
    with av.open(str(path)) as container:
        for index, frame in enumerate(container.decode(video=0)):
            got = frame.to_ndarray(format="rgb24").astype(np.float32)
            want = np.round(frames[index].transpose(1, 2, 0) * 255)
            errors.append(np.mean((got - want) ** 2))
    return float(10 * np.log10(255**2 / max(np.mean(errors), 1e-9)))


def run(shape: str, variant: str, frames: np.ndarray, scratch: Path) -> dict:
    size, count, bursts, gap = SHAPES[shape]
    lookahead, extra = writer_module.LOOKAHEAD, {}
    for part in variant.split("+"):
        if part.startswith("la"):
            lookahead = int(part[2:])
        elif part.startswith("sync"):
            extra["sync-lookahead"] = part[4:]
        elif part.startswith("threads"):
            extra["threads"] = part[7:]
    options = writer_module._encoder_options
    if extra:  # x264 params beside the writer's own
        def with_extra(encoder, crf, preset, la, hdr10=None):
            made = options(encoder, crf, preset, la, hdr10)
            key = f"{encoder[3:]}-params"
            made[key] = ":".join(filter(None, [made.get(key, ""), *(f"{k}={v}" for k, v in extra.items())]))
            return made
        writer_module._encoder_options = with_extra
    path = scratch / f"{shape}-{variant}.mp4"
    tensor = torch.from_numpy(frames)
    try:
        writer = Mp4Writer(path, Fraction(24), size, lookahead=lookahead)
        at = 0
        for number, burst in enumerate(bursts):
            if number:
                time.sleep(gap if burst > 4 else gap / 8)
            writer.write(tensor[at : at + burst])
            at += burst
        last = time.perf_counter()
        writer.close()
        flush = time.perf_counter() - last
    finally:
        writer_module._encoder_options = options
    return {"shape": shape, "variant": variant, "flush_s": round(flush, 3), "bytes": path.stat().st_size,
            "psnr_db": round(psnr(path, frames), 3), "encode_s": round(writer.encode_seconds, 3), "cores": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="W1", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--variants", default="base,la8,la4,la0,sync0,la8+sync0")
    parser.add_argument("--source", type=Path, help="a real clip instead of noise (its own shape, bursts of 16)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        for shape in [args.source.name] if args.source else args.shape.split(","):
            if args.source:
                frames = frames_of(args.source)
                SHAPES[shape] = (frames.shape[2:], len(frames), [16] * (len(frames) // 16) + [len(frames) % 16] * (len(frames) % 16 > 0), 2.0)
            else:
                size, count, _, _ = SHAPES[shape]
                frames = frames_like_model(size, count)
            for _ in range(args.runs):
                for variant in args.variants.split(","):
                    line = run(shape, variant, frames, Path(scratch))
                    emit(line, args.out)


if __name__ == "__main__":
    main()
