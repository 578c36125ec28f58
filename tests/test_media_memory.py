"""A long clip runs in temporal windows with the tiny model, and its peak memory does not grow with its length."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction

from tests.mediatools import read_back
from worker.media.synthetic import write_clip

# Runs one job in a fresh process and reports its peak RSS over the job alone (the kernel's high-water mark is reset
# once the model is loaded). A fixed mmap threshold makes glibc hand freed tensors back to the OS, so RSS follows
# live memory instead of the allocator's fragmentation.
CHILD = """
import json, sys
from pathlib import Path
from worker.sr.engine import SREngine
from worker.upscale import UpscaleOptions, upscale_file

def status(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))
    return int(line.split()[1]) * 1024

engine = SREngine.from_pretrained(sys.argv[1])
Path("/proc/self/clear_refs").write_text("5")
baseline = status("VmHWM")
result = upscale_file(sys.argv[2], sys.argv[3], engine, UpscaleOptions(preset="ultrafast"))
print(json.dumps({"windows": result.windows, "baseline": baseline, "peak": status("VmHWM")}))
"""


def job(tiny_piflow, tmp_path, frames: int) -> dict:
    source = write_clip(tmp_path / f"in-{frames}.mp4", frames, (16, 32), Fraction(30), audio_codec="aac")  # one tile
    output = tmp_path / f"out-{frames}.mp4"
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_piflow), str(source), str(output)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    back = read_back(output)
    assert (back.frames, back.width, back.height) == (frames, 64, 32)
    assert abs(back.audio[0].seconds - frames / 30) <= 1 / 30
    return report


def test_300_frames_run_in_windows_within_one_and_a_half_times_the_memory_of_100(tiny_piflow, tmp_path):
    short, long = job(tiny_piflow, tmp_path, 100), job(tiny_piflow, tmp_path, 300)
    assert (short["windows"], long["windows"]) == (1, 3)
    assert long["peak"] <= 1.5 * short["peak"]
    # What the job itself added: the same for one window and three (one call on the whole clip would need ~3x).
    assert long["peak"] - long["baseline"] <= 1.5 * (short["peak"] - short["baseline"])
