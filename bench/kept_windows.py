"""What keeping a job's windows costs the engine's span: the real `upscale_windows` path with lanczos (the same frames
and sizes as the model's output) and a `BlobWindowStore` on a local blob store, alternating with no store. One JSON
line per run: the engine thread's wall seconds, the upscaler's own, `host_s` (input frames made tensors, windows
committed as the engine's thread waited for them), and with a store `kept_upload_s` (the uploads' seconds on the
store's uploader, beside the engine) and `join_s` (what was left of them once the windows were done: the worker
waits for it after the encoder's flush and check, which this bench does not run). The store keeps every window but
the job's last (worker/kept_windows.py): a clip of one window keeps nothing, so a window's price takes two. With a
store, `raw_bytes` (the kept windows' frames) beside `kept_bytes` (what blob storage holds for them: FFV1 where that
is smaller, `worker.media.lossless`, and the tails). The frames are noise (a random checkpoint's output is
noise-like), or a real clip's (`--clip`, its first frames looped), upscaled by lanczos.

    python bench/kept_windows.py --size 768x512 --frames 226 --runs 4      # two W1-sized windows, the first kept (571 MB raw)
    python bench/kept_windows.py --clip ~/.cache/vsrq/corpus/kivy-cityCC0.mpg --frames 226 --runs 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import av
import numpy as np
import torch

from storage.blobs import LocalBlobStore
from worker.kept_windows import BlobWindowStore
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.request import SRRequest
from worker.sr.windows import plan_windows, upscale_windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="768x512", help="input WxH (the output is twice that)")
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument("--window", type=int, default=121)
    parser.add_argument("--overlap", type=int, default=16, help="frames two windows share")
    parser.add_argument("--runs", type=int, default=4, help="runs in all, alternating without and with a store")
    parser.add_argument("--clip", type=Path, help="a video whose frames (at most 60, looped) are upscaled, not noise")
    args = parser.parse_args()
    if args.clip is not None:
        with av.open(str(args.clip)) as container:
            real = [frame.to_ndarray(format="rgb24") for _, frame in zip(range(60), container.decode(video=0))]
        frames = [real[index % len(real)] for index in range(args.frames)]
        height, width = frames[0].shape[:2]
    else:
        width, height = map(int, args.size.split("x"))
        rng = np.random.default_rng(0)
        frames = [rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8) for _ in range(args.frames)]
    with tempfile.TemporaryDirectory() as directory:
        for run_index in range(args.runs):
            kept = run_index % 2 == 1
            store = None
            if kept:
                blobs = LocalBlobStore(Path(directory, "blobs"))
                store = BlobWindowStore(blobs, "job", Path(directory, f"scratch-{run_index}"), f"key-{run_index}")
            started = time.perf_counter()
            run = upscale_windows(
                LanczosUpscaler(), iter(frames), plan_windows(args.frames, args.window, args.overlap), SRRequest(scale=2),
                lambda _: None, store=store,
            )  # fmt: skip
            wall = time.perf_counter() - started
            uploads = {}
            if store is not None:
                store.release_local()
                joined = time.perf_counter()
                uploads["kept_upload_s"] = round(store.join(), 3)
                uploads["join_s"] = round(time.perf_counter() - joined, 3)
                plan = plan_windows(args.frames, args.window, args.overlap)
                kept_frames = sum(plan.finished_frames(window) for window in plan.windows[:-1])
                uploads["raw_bytes"] = kept_frames * 4 * width * height * 3
                uploads["kept_bytes"] = sum(blob.size for blob in blobs.entries(store.prefix))
            upscaler = sum(sum(info.stage_seconds.values()) for info in run.runs)
            print(json.dumps({
                "kept": kept, "clip": args.clip.name if args.clip else "noise",
                "output": f"{2 * width}x{2 * height}x{args.frames}", "windows": run.windows,
                "wall_s": round(wall, 3), "upscaler_s": round(upscaler, 3),
                "host_s": {name: round(value, 3) for name, value in run.host_s.items()},
                **uploads,
                "torch_threads": torch.get_num_threads(),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
