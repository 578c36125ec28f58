"""The tiny checkpoint's start → ready on the CPU with worker.sr.precompiled's preloader and without it, alternating,
on one warm compile cache directory (`open_upscaler` with every block compiled, `compile="on"`, and its warmup). A
first process fills the directory; then one JSON line per start: seconds after the process started at the engine
built and at ready (warmup over), the warmup's seconds, and the precompiled counts. The CPU's warmup is not a GPU's:
the tiny blocks load and run in milliseconds, so this shows the overlap, not the GPU's saving.

    python bench/preload_start.py --starts 3 --out preload.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

START = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from worker import started
from worker.sr import precompiled
from worker.sr.backends import open_upscaler

checkpoint, cache, setting = sys.argv[1:]
if setting == "without":
    precompiled.preload = lambda classes, devices: None  # today's start: the warmup loads each function itself
upscaler = open_upscaler(checkpoint, compile_cache_dir=cache, warmup_frames=5, compile="on")
print(json.dumps({"setting": setting, "ready_s": started.seconds(), **precompiled.stats()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\\n\\n")[0])
    parser.add_argument("--starts", type=int, default=3, help="starts of each setting, alternating")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache", type=Path, help="a compile cache kept between runs")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from worker.sr.checkpoint import write_tiny

    environment = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_VEC_ISA_OK": "1"}
    with tempfile.TemporaryDirectory() as scratch, args.out.open("w") as out:
        checkpoint = write_tiny(Path(scratch) / "tiny")
        cache = args.cache or Path(scratch) / "cache"
        fill = [] if (cache / "precompiled").is_dir() else ["fill"]
        for setting in fill + ["with", "without"] * args.starts:
            done = subprocess.run([sys.executable, "-c", START, str(checkpoint), str(cache), setting], cwd=ROOT,
                                  capture_output=True, text=True, env=environment, timeout=900)  # fmt: skip
            if done.returncode != 0:
                raise SystemExit(done.stderr[-3000:])
            lines = done.stderr.splitlines()
            row = json.loads(done.stdout.splitlines()[-1])
            row["log"] = [line for line in lines if "engine built" in line or "warm after" in line]
            row["load_average"] = os.getloadavg()
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(setting, f"ready {row['ready_s']:.2f} s", row["load_average"], flush=True)


if __name__ == "__main__":
    main()
