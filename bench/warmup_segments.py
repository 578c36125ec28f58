"""The warmup's seconds on the tiny checkpoint with its blocks compiled (CPU), decoding each segment signature once
(today) against every segment of the window (before: `--every-segment`), each a fresh process on one compile cache,
as a worker's restart loads its functions. Each run then upscales a clip of the window at the landscape tile size
and at 2x2 tiles, which must build and load nothing. One JSON line per run.

    python bench/warmup_segments.py --runs 3 --window 121 --out /tmp/warmup_segments.jsonl
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
import json, os, sys, time, torch
from worker.sr import engine as engine_module, precompiled
from worker.sr.backends import open_upscaler
from worker.sr.request import SRRequest

checkpoint, cache, window, variant = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if variant == "every-segment":  # what the warmup did before: each segment of the window decoded
    engine_module.DecodeEachSignatureOnce = lambda decoder: decoder
upscaler = open_upscaler(checkpoint, compile_cache_dir=cache, warmup_frames=None, compile="on")
calls, decoding = [], [0.0]
decoder = upscaler.replicas[0].vae.decoder
decoder.register_forward_pre_hook(lambda *_: calls.append(time.perf_counter()))
decoder.register_forward_hook(lambda *_: decoding.__setitem__(0, decoding[0] + time.perf_counter() - calls[-1]))
graphs, functions = torch._dynamo.utils.counters["stats"]["unique_graphs"], precompiled.stats()
started = time.perf_counter()
upscaler.warmup(window, every_tile_size=True)
seconds = time.perf_counter() - started
warm_calls, warm_decoding, calls[:] = len(calls), decoding[0], []
traced, before = torch._dynamo.utils.counters["stats"]["unique_graphs"], precompiled.stats()
started = time.perf_counter()
for size in ((16, 32), (24, 48)):
    upscaler.upscale(torch.rand(window, 3, *size), SRRequest(scale=2, seed=3), lambda _: None)
after = precompiled.stats()
print(json.dumps({
    "variant": variant, "warmup_s": round(seconds, 3), "warmup_decoder_calls": warm_calls,
    "warmup_decode_s": round(warm_decoding, 3),
    "warmup_loaded": before["loaded"] - functions["loaded"],
    "warmup_compiled": before["compiled"] - functions["compiled"], "warmup_traced": traced - graphs,
    "jobs_s": round(time.perf_counter() - started, 3), "jobs_decoder_calls": len(calls),
    "jobs_traced": torch._dynamo.utils.counters["stats"]["unique_graphs"] - traced,
    "jobs_loaded": after["loaded"] - before["loaded"], "jobs_compiled": after["compiled"] - before["compiled"],
    "load_average": os.getloadavg()[0],
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each variant, alternating")
    parser.add_argument("--window", type=int, default=121)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from worker.sr.checkpoint import write_tiny

    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = write_tiny(Path(scratch) / "tiny")
        cache = Path(scratch) / "cache"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        # The first run compiles every function into the cache; the measured ones load them
        variants = ["once"] + ["every-segment", "once"] * args.runs
        with args.out.open("a") as out:
            for number, variant in enumerate(variants):
                done = subprocess.run(
                    [sys.executable, "-c", START, str(checkpoint), str(cache), str(args.window), variant],
                    cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800,
                )  # fmt: skip
                if done.returncode:
                    sys.exit(done.stderr[-3000:])
                line = json.loads(done.stdout.strip().splitlines()[-1])
                line |= {"run": number, "cache": "cold" if number == 0 else "warm"}
                print(json.dumps(line), flush=True)
                out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
