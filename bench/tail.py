"""A job's tail step by step, on the CPU: the worker's own code after the engine (x264 flush, `verify`, previews,
the uploads) on a lanczos upscale of a noisy clip, so that the output is as large as a model's (W1: ~31 MB).

    python bench/tail.py --size 768x512 --frames 121 --runs 3 --out tail.jsonl      # W1's output, 1536x1024x121
    python bench/tail.py --size 384x256 --frames 33 --runs 5                        # W2's, 768x512x33

Each run prints one JSON line: the seconds of each step, in the order the worker runs them (`worker.tasks._complete`
reports the same steps in its `run` event's `tail_s`). Redis's steps (`settle`, `complete`) are not here: they are
round trips, milliseconds on the GPU machine. `--blobs local,s3` uploads to each (S3: SeaweedFS, started here).
"""

from __future__ import annotations

import argparse
import sys
import shutil
import tempfile
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from time import monotonic

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: `bench` the package

from bench.lines import emit  # noqa: E402
from infra.stack import Stack  # noqa: E402
from storage.blobs import BlobStore, LocalBlobStore, S3BlobStore  # noqa: E402
from worker.sr.lanczos import LanczosUpscaler  # noqa: E402
from worker.upscale import UpscaleOptions, begin_upscale  # noqa: E402
from worker.sr.request import SRRequest  # noqa: E402


def noisy_clip(path: Path, width: int, height: int, frames: int, seed: int = 0) -> Path:
    """A clip whose 2x lanczos upscale encodes at about a random-weights model's bit rate: a moving gradient under
    fine grain (x264 spends its bits on the grain, as on the model's output)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24, options={"crf": "12", "preset": "veryfast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            base = np.stack([(x + 3 * index) % width / width, y / height, 0.5 + 0 * x], axis=-1) * 200
            pixels = np.clip(base + rng.normal(0, 24, base.shape), 0, 255).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def run_once(source: Path, scratch: Path, stores: dict[str, BlobStore], decode_previews: bool) -> dict:
    from worker.tasks import _previews  # the worker's own step (and its fallback)

    output = scratch / "output.mp4"
    began = monotonic()
    encoding = begin_upscale(source, output, LanczosUpscaler(), UpscaleOptions(request=SRRequest(scale=2)))
    engine_done = monotonic()
    result = encoding.finish()
    steps = {"engine_and_head": engine_done - began, **result.tail}
    at = monotonic()
    # `decode_previews`: as before this change, decoding the output (now the fallback)
    made = _previews("bench", replace(result, previews=None) if decode_previews else result, scratch)
    steps["previews"] = monotonic() - at
    for name, blobs in stores.items():  # the output's upload, then the previews', to each store named
        at = monotonic()
        with open(result.output, "rb") as file:
            stored = blobs.put("outputs/bench/attempt-1-x.mp4", file, content_type="video/mp4")
        steps[f"upload_{name}"] = monotonic() - at
        at = monotonic()
        for variant, path in made.items():
            with open(path, "rb") as file:
                blobs.put(f"outputs/bench/attempt-1-x.{variant}.jpg", file, content_type="image/jpeg")
        steps[f"upload_previews_{name}"] = monotonic() - at
    steps["after_engine"] = monotonic() - engine_done  # with every store's uploads
    return {
        "output": f"{result.written.video.width}x{result.written.video.height}x{result.written.video.frames}",
        "bytes": stored.size,
        "sha256": stored.sha256,
        "steps_s": {step: round(seconds, 3) for step, seconds in steps.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="768x512", help="the input, WIDTHxHEIGHT (the output is twice)")
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--label", default="")
    parser.add_argument("--blobs", default="local", help="local, s3 (SeaweedFS started here) or local,s3")
    parser.add_argument("--decode-previews", choices=("no", "yes", "alternate"), default="no",
                        help="previews decoded from the output (the fallback), not from the frames taken")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    width, height = map(int, args.size.split("x"))
    with tempfile.TemporaryDirectory(prefix="vsrq-tail-") as directory, ExitStack() as running:
        root = Path(directory)
        source = noisy_clip(root / "input.mp4", width, height, args.frames)
        stores: dict[str, BlobStore] = {}
        for name in args.blobs.split(","):
            if name == "local":
                stores[name] = LocalBlobStore(root / "blobs")
            else:
                stack = running.enter_context(Stack(root / "stack"))
                stores[name] = S3BlobStore(stack.s3_client(), stack.bucket)
        for number in range(args.runs):
            scratch = root / f"scratch-{number}"
            scratch.mkdir()
            decode = args.decode_previews == "yes" or (args.decode_previews == "alternate" and number % 2 == 1)
            line = {"label": args.label, "input": f"{width}x{height}x{args.frames}", "run": number,
                    "previews": "decoded" if decode else "taken", **run_once(source, scratch, stores, decode)}
            emit(line, args.out)
            shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
