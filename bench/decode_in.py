"""What a job waits for before the engine's first call: its first window's frames decoded, made RGB and made the
tensor the upscaler takes (issue 22's `head_s.first_window_decoded`, `windows_s.frames_in`). One JSON line per
measurement, on W1 and W2 as bench/service.py writes them (and `W1-noisy`, bench/tail.py's grain, which decodes
slower):

  profile  the steps apart, on frames decoded beforehand: the decode alone (PyAV, `thread_type` AUTO); the RGB
           conversion with a swscale context per frame (`frame.to_ndarray(format=...)`) or one per stream, and the
           threads each way started; the float tensor as `upscale_windows` made it before it handed over integers
           (fresh pages, as the worker's allocator maps every block of 1 MiB or more anew: worker/heap.py), and the
           same into pages touched already
  window   the window's tensor as `upscale_windows` hands it to the upscaler (`frames_in` less the decoder wait), from
           frames decoded beforehand: before (stacked, then the float (F, 3, H, W) in [0, 1]) and now (stacked
           integers, `worker.sr.windows._video`), alternating; and `worker.frames.unit` on the CPU, the conversion
           the engine now runs on its device (CPU runs only: a GPU does it in its own time)
  path     the worker's path: `prefetch(read_frames)` into `upscale_windows` with lanczos, from the start until the
           upscaler has the first window (its first `cancelled` check, where the run stops): `upscaler_s`, and when
           the window's last frame left the decoder, `decoded_s`; with --tree, alternating with another tree's code
           (`git archive` of the commit before), each run in a fresh process after one unmeasured run

    python bench/decode_in.py --parts profile,path --runs 5
    python bench/decode_in.py --parts window --clips W1 --runs 10
    mkdir -p /tmp/before && git archive <before> worker | tar -x -C /tmp/before
    python bench/decode_in.py --parts path --runs 5 --tree before=/tmp/before --out r.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIPS = {"W1": (768, 512, 121), "W2": (384, 256, 33), "W1-noisy": (768, 512, 121)}  # as bench/service.py's


def write_clips(directory: Path, names: list[str]) -> dict[str, Path]:
    from bench.tail import noisy_clip
    from worker.media.synthetic import write_clip

    clips = {}
    for name in names:
        width, height, frames = CLIPS[name]
        path = directory / f"{name}.mp4"
        if not path.exists():
            if name.endswith("-noisy"):
                noisy_clip(path, width, height, frames)
            else:
                write_clip(path, frames, (height, width), audio_codec="aac")  # bench/service.py's `write_clips`
        clips[name] = path
    return clips


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def profile(path: Path) -> dict:
    """The steps apart, each on its own (seconds); threads started by each RGB conversion."""
    import av
    import numpy as np
    import torch
    from av.video.reformatter import VideoReformatter

    from worker.media.probe import decode_declared_picture, probe
    from worker.media.reader import _decode, _source_colour

    video = probe(path).video

    def decode() -> list:
        with av.open(str(path)) as container:
            stream = container.streams[video.index]
            stream.thread_type = "AUTO"
            decode_declared_picture(stream)
            return list(_decode(container, stream, path.stat().st_size))

    figures = {}
    started = time.perf_counter()
    frames = decode()
    figures["decode_s"] = time.perf_counter() - started
    size = {"format": "rgb24", "width": video.width, "height": video.height}

    def rgb(name: str, convert) -> list:
        frames = decode()  # fresh frames: a frame keeps the context it made
        before, seen, arrays = _threads(), set(), []
        started = time.perf_counter()
        while frames:  # each frame let go once converted, as `read_frames` does (and with it a context it made)
            frame = frames.pop(0)
            arrays.append(convert(frame))
            seen |= _threads()
            del frame
        figures[f"rgb_{name}_s"] = time.perf_counter() - started
        figures[f"rgb_{name}_threads"] = len(seen - before)  # started while converting
        return arrays

    old = rgb("context_per_frame", lambda frame: frame.to_ndarray(**size, **_source_colour(frame)))
    reformatter = VideoReformatter()
    new = rgb("one_context", lambda frame: reformatter.reformat(frame, **size, **_source_colour(frame)).to_ndarray())
    assert all(np.array_equal(a, b) for a, b in zip(old, new, strict=True))
    # swscale's automatic count is one thread per core: 16 on the GPU host, its cost there shown here as far as 2
    # cores can (16 threads started per frame, or once)
    sixteen = {**size, "threads": 16}
    rgb("context_per_frame_16_threads", lambda frame: frame.to_ndarray(**sixteen, **_source_colour(frame)))
    shared = VideoReformatter()
    rgb("one_context_16_threads", lambda frame: shared.reformat(frame, **sixteen, **_source_colour(frame)).to_ndarray())

    pixels = torch.from_numpy(np.stack(new))
    started = time.perf_counter()
    fresh = _video(pixels, torch.empty(pixels.shape[0], 3, *pixels.shape[1:3]))  # as `worker.sr.windows._video`
    figures["float_s"] = time.perf_counter() - started
    started = time.perf_counter()
    _video(pixels, fresh)  # the same into pages touched already: what is left is the conversion
    figures["float_touched_s"] = time.perf_counter() - started
    return {name: round(value, 4) if isinstance(value, float) else value for name, value in figures.items()}


def _video(pixels, video):
    video.copy_(pixels.permute(0, 3, 1, 2))
    return video.div_(255.0)


def window(path: Path) -> dict:
    """The window's tensor, before and now, from the same decoded frames (seconds); bytes each hands the device."""
    import numpy as np
    import torch

    from worker.frames import unit
    from worker.media.probe import probe
    from worker.media.reader import read_frames
    from worker.sr.windows import _video as window_now

    frames = list(read_frames(path, probe(path).video))

    def window_before(frames):  # `worker.sr.windows._video` before it handed over integers
        pixels = torch.from_numpy(np.stack(frames))
        return _video(pixels, torch.empty(pixels.shape[0], 3, *pixels.shape[1:3]))

    figures = {}
    for name, make in (("before", window_before), ("now", window_now)):
        started = time.perf_counter()
        video = make(frames)
        figures[f"{name}_s"] = time.perf_counter() - started
        figures[f"{name}_to_device_mb"] = round(video.numel() * video.element_size() / 1e6)
        if name == "now":
            started = time.perf_counter()
            unit(video)
            figures["unit_on_cpu_s"] = time.perf_counter() - started
        del video
    return {name: round(value, 4) if isinstance(value, float) else value for name, value in figures.items()}


def path_once(path: Path) -> dict:
    """The worker's path to the upscaler's first window: seconds from the start."""
    from worker.errors import Cancelled
    from worker.media.probe import probe
    from worker.media.reader import prefetch, read_frames
    from worker.sr.lanczos import LanczosUpscaler
    from worker.sr.request import SRRequest
    from worker.sr.windows import plan_windows, upscale_windows

    video = probe(path).video
    plan = plan_windows(video.frames)
    marks: dict[str, float] = {}
    checks = []

    def marking(frames):  # as worker.upscale's `_marking`
        for index, frame in enumerate(frames, 1):
            if index == plan.windows[0].stop:
                marks["decoded_s"] = time.perf_counter()
            yield frame

    def cancelled() -> bool:  # 1st: `upscale_windows` before the window; 2nd: the upscaler, the window in hand
        checks.append(time.perf_counter())
        return len(checks) == 2

    started = time.perf_counter()
    with closing(prefetch(read_frames(path, video), plan.length)) as frames:
        try:
            upscale_windows(
                LanczosUpscaler(), marking(frames), plan, SRRequest(scale=2), lambda _: None, cancelled=cancelled
            )
        except Cancelled:
            pass
    marks["upscaler_s"] = checks[1]
    return {name: round(at - started, 4) for name, at in marks.items()}


def summary(values: list[float]) -> dict:
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4), "max": round(max(values), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="profile,path")
    parser.add_argument("--clips", default="W1,W2,W1-noisy")
    parser.add_argument("--runs", type=int, default=5, help="repeats of each measurement (per tree for `path`)")
    parser.add_argument("--tree", action="append", default=[], help="NAME=DIR: another tree's `worker` for `path`")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "vsrq-decode-in", help="the clips")
    parser.add_argument("--out", type=Path, help="append the JSON lines here too")
    parser.add_argument("--once", help=argparse.SUPPRESS)  # a child: one `path` run of this clip, after one unmeasured
    args = parser.parse_args()
    if args.once:
        path_once(Path(args.once))
        print(json.dumps(path_once(Path(args.once))))
        return

    def emit(line: dict) -> None:
        text = json.dumps(line)
        print(text, flush=True)
        if args.out is not None:
            with args.out.open("a") as out:
                out.write(text + "\n")

    args.dir.mkdir(parents=True, exist_ok=True)
    clips = write_clips(args.dir, args.clips.split(","))
    host = {"cores": len(os.sched_getaffinity(0)), "load": round(os.getloadavg()[0], 2)}
    parts = args.parts.split(",")
    for name, path in clips.items():
        if "profile" in parts:
            profile(path)  # one unmeasured: imports, PyAV's and torch's first calls
            runs = [profile(path) for _ in range(args.runs)]
            emit({"part": "profile", "clip": name, **host, **{key: summary([r[key] for r in runs]) for key in runs[0]}})
        if "window" in parts:
            window(path)  # one unmeasured
            runs = [window(path) for _ in range(args.runs)]
            emit({"part": "window", "clip": name, **host, **{key: summary([r[key] for r in runs]) for key in runs[0]}})
        if "path" in parts:
            trees = {"this": ROOT, **dict(tree.split("=", 1) for tree in args.tree)}
            seconds: dict[str, list[dict]] = {tree: [] for tree in trees}
            for _ in range(args.runs):
                for tree, directory in trees.items():  # alternating: the box's load falls on both alike
                    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(directory), str(ROOT)])}
                    command = [sys.executable, __file__, "--once", str(path)]
                    child = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
                    seconds[tree].append(json.loads(child.stdout.splitlines()[-1]))
            for tree, runs in seconds.items():
                figures = {key: summary([r[key] for r in runs]) for key in runs[0]}
                emit({"part": "path", "clip": name, "tree": tree, **host, **figures})


if __name__ == "__main__":
    del sys.path[0]  # this script's directory: `bench` is the package
    sys.path.append(str(ROOT))  # after PYTHONPATH, where a child finds another tree's `worker`
    main()
