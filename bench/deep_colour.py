"""Banding and cost of the 10-bit path: a smooth 10-bit HLG gradient (HEVC Main 10) upscaled x2 with lanczos, its
output's luma levels counted along a row; and two 8-bit clips' output hashes, which the 10-bit path must not move.

    PYTHONPATH=$PWD .venv/bin/python bench/deep_colour.py /tmp/deep
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from time import perf_counter

import av
import numpy as np
import torch

from worker.frames import quantise
from worker.media.synthetic import gradient_clip, write_clip
from worker.media.writer import Mp4Writer, yuv_frame
from worker.sr.lanczos import LanczosUpscaler
from worker.upscale import UpscaleOptions, upscale_file

def luma_row(path: Path) -> tuple[np.ndarray, str]:
    """The middle row of the first frame's luma, in 10-bit code values, and the stream's pixel format."""
    with av.open(str(path)) as container:
        frame = next(container.decode(video=0))
        plane = frame.planes[0]
        deep = frame.format.name.endswith("10le")
        dtype = np.uint16 if deep else np.uint8
        rows = np.frombuffer(bytes(plane), dtype).reshape(-1, plane.line_size // np.dtype(dtype).itemsize)
        row = rows[frame.height // 2, : frame.width].astype(np.int64)
        return (row if deep else row * 4), frame.format.name


def banding(path: Path) -> dict:
    row, pix_fmt = luma_row(path)
    levels = np.unique(row)
    return {"pix_fmt": pix_fmt, "levels": len(levels), "max_step_10bit": int(np.diff(levels).max())}


def wider_cost(scratch: Path, frames: int = 9, size: tuple[int, int] = (720, 1280), repeats: int = 3) -> None:
    """CPU milliseconds per 720p frame of what the 10-bit path does wider: quantising and the RGB-to-YUV conversion
    (the writer's host work), and the whole HEVC writer (those and x265 `ultrafast`), at 8 and at 10 bits: the best
    of `repeats` runs, the two depths taking turns (a shared machine's load moves)."""
    video = torch.rand(frames, 3, *size)
    best: dict[tuple[int, str], float] = {}

    def timed(depth: int, step: str, work) -> None:
        started = perf_counter()
        work()
        seconds = 1000 * (perf_counter() - started) / frames
        best[depth, step] = min(best.get((depth, step), seconds), seconds)

    for _ in range(repeats):
        for depth, dtype in ((8, torch.uint8), (10, torch.uint16)):
            timed(depth, "quantise", lambda: quantise(video, dtype))
            pixels = quantise(video, dtype).numpy()
            timed(depth, "yuv", lambda: [yuv_frame(pixel) for pixel in pixels])

            def write() -> None:
                with Mp4Writer(scratch / f"cost-{depth}.mp4", Fraction(24), size, preset="ultrafast", codec="hevc", depth=depth) as writer:
                    writer.write(video)

            timed(depth, "writer", write)
    for depth in (8, 10):
        print(f"{depth}-bit 720p, ms/frame: quantise {best[depth, 'quantise']:.1f}, yuv {best[depth, 'yuv']:.1f}, "
              f"hevc writer in all {best[depth, 'writer']:.0f}")


def main(scratch: Path) -> None:
    scratch.mkdir(parents=True, exist_ok=True)
    options = UpscaleOptions(codec="hevc", preset="ultrafast")
    source = scratch / "gradient.mp4"
    source = source if source.exists() else gradient_clip(source)
    print("source", banding(source))
    for codec in ("hevc", "av1", "h264"):
        output = scratch / f"gradient-{codec}.mp4"
        started = perf_counter()
        result = upscale_file(source, output, LanczosUpscaler(), replace(options, codec=codec))
        seconds = perf_counter() - started
        print(codec, banding(output), f"job {1000 * seconds / 9:.0f} ms/frame")
    # the 8-bit path: the same clips' outputs must hash as before
    for name, codec, kwargs in (("h264-aac", "h264", {"audio_codec": "aac"}), ("hevc", "hevc", {"video_codec": "libx265"})):
        clip = scratch / f"eight-{name}.mp4"  # kept: x264 may not write the same input twice (writer._x264_asm)
        clip = clip if clip.exists() else write_clip(clip, 17, (64, 96), **kwargs)
        output = scratch / f"eight-{name}-out.mp4"
        upscale_file(clip, output, LanczosUpscaler(), replace(options, codec=codec))
        print("8-bit", name, hashlib.sha256(output.read_bytes()).hexdigest()[:16])
    wider_cost(scratch)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
