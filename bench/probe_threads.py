"""The output check's probe on a W1-sized noise-like output: its one picture decoded with frame threads (what the
probe does) or on the calling thread (tried in session 20: slower on the GPU host), alternating, 10 runs each;
medians. Writes the output first (bench/encoder_flush.py's frames).

    python bench/probe_threads.py
"""
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from encoder_flush import frames_like_model  # noqa: E402

import worker.media.probe as probe_module  # noqa: E402
from worker.media.writer import Mp4Writer  # noqa: E402

path = Path("/tmp/w1-out.mp4")
frames = frames_like_model((1024, 1536), 121)
with Mp4Writer(path, Fraction(24), (1024, 1536)) as writer:
    for start in range(0, 121, 16):
        writer.write(torch.from_numpy(frames[start : start + 16]))
declared = probe_module.decode_declared_picture
seconds = {"frame_threads": [], "calling_thread": []}
for _ in range(10):
    for mode in seconds:
        def setup(stream, mode=mode):
            if mode == "frame_threads":
                stream.codec_context.thread_count = 0
                stream.thread_type = "AUTO"
            declared(stream)
        probe_module.decode_declared_picture = setup
        began = time.perf_counter()
        probe_module.probe(path)
        seconds[mode].append(time.perf_counter() - began)
print({mode: round(statistics.median(values), 4) for mode, values in seconds.items()}, seconds)
