"""Whether `quality=high` gives the same bytes in every worker process: one engine per process (full-size random
weights, the transformer's blocks compiled as the worker compiles them, the decoder eager: lossless code, the same
in every process), clips upscaled in order at `high`, each output's SHA-256 and the graphs and precompiled functions
its call built or loaded. A killed `high` job resumes in another process with the windows the first one kept: the
bytes must not depend on which process made them.

    python3 bench/high_bytes.py --cache DIR --precompile on|off --clips PT21,SQ33 --label A --out high-bytes.jsonl
    python3 bench/high_bytes.py --compare DIR --out high-bytes.jsonl   # PSNR between the outputs kept under DIR

Clips: `bench.bench.WORKLOADS` names, and PT21 (one portrait tile's 21 frames: the worker's portrait warmup clip,
whose 9,216 tokens a 33-frame square tile also has). `--keep DIR` saves each output there for `--compare`.
`--tiny` runs the same on the CPU (CI keeps the script working; the bytes there say nothing about a GPU's).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench import SEED, WORKLOADS, build
from bench.similarity import psnr_per_frame
from worker.media.synthetic import pattern
from worker.sr import compile_cache, precompiled
from worker.sr.checkpoint import Components, prune_upscaler
from worker.sr.engine import SREngine
from worker.sr.request import SRRequest

CLIPS = {**WORKLOADS, "PT21": (384, 256, 21, 2), "SQ33": WORKLOADS["SQ"]}  # (height, width, frames, scale)
TINY_CLIPS = {"PT21": (48, 24, 9, 2), "SQ33": (32, 32, 13, 2)}


def emit(out: Path, record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    with open(out, "a") as file:
        file.write(line + "\n")


def upscale(args: argparse.Namespace) -> None:
    device = torch.device("cpu" if args.tiny else "cuda:0")
    cache = compile_cache.use(args.cache)
    precompiled.use(cache / "precompiled" if args.precompile == "on" else None)
    parts = build(device, args.tiny)
    prune_upscaler(parts["latent_upscaler"])
    replica = Components(device, parts["transformer"], parts["vae"], parts["scheduler"], parts["latent_upscaler"])
    engine = SREngine([replica], compile_transformer=True, compile_decoder=False)
    clips = TINY_CLIPS if args.tiny else CLIPS
    for name in args.clips.split(","):
        height, width, frames, scale = clips[name]
        chunks: list[torch.Tensor] = []
        graphs, functions = compile_cache.graphs_built(), precompiled.stats()
        started = time.perf_counter()
        request = SRRequest(scale=scale, quality="high", seed=SEED)
        info = engine.upscale(pattern(frames, height, width), request, chunks.append)
        seconds = time.perf_counter() - started
        output = torch.cat(chunks).cpu().contiguous()
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            torch.save(output, args.keep / f"{args.label}-{name}.pt")
        built = {key: value - graphs[key] for key, value in compile_cache.graphs_built().items()}
        now = precompiled.stats()
        made = {key: now[key] - functions[key] for key in ("loaded", "compiled", "fallback")}
        digest = hashlib.sha256(output.numpy().tobytes()).hexdigest()
        emit(args.out, {"label": args.label, "clip": name, "precompile": args.precompile, "sha256": digest,
                        "levers": info.levers, "tiles": info.tiles, "seconds": round(seconds, 2), "graphs": built,
                        "functions": made})  # fmt: skip


def compare(directory: Path, out: Path) -> None:
    outputs = {path.stem: torch.load(path) for path in sorted(directory.glob("*.pt"))}
    by_clip: dict[str, list[str]] = {}
    for key in outputs:
        by_clip.setdefault(key.split("-", 1)[1], []).append(key)
    for clip, keys in by_clip.items():
        for a, b in itertools.combinations(keys, 2):
            full = 255.0 if outputs[a].dtype == torch.uint8 else 1.0
            x, y = outputs[a].float() / full, outputs[b].float() / full
            record = {"clip": clip, "a": a, "b": b, "identical": bool(torch.equal(outputs[a], outputs[b]))}
            if not record["identical"]:
                differing = (x != y).flatten(1).any(1)
                record |= {"psnr_db_worst_frame": round(psnr_per_frame(x, y).min().item(), 2),
                           "max_abs_delta": round((x - y).abs().max().item() * full, 4),
                           "frames_differing": int(differing.sum())}  # fmt: skip
            emit(out, record)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    parser.add_argument("--cache", type=Path, help="the compile cache directory (as the worker's)")
    parser.add_argument("--precompile", choices=("on", "off"), default="on")
    parser.add_argument("--clips", default="PT21,SQ33")
    parser.add_argument("--label", default="A")
    parser.add_argument("--keep", type=Path, help="save each output under this directory")
    parser.add_argument("--compare", type=Path, help="compare the outputs saved under this directory, and exit")
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny configuration")
    args = parser.parse_args(argv)
    if args.compare:
        compare(args.compare, args.out)
    elif args.cache is None:
        parser.error("--cache is required to upscale")
    else:
        upscale(args)


if __name__ == "__main__":
    main()
