"""PiFlow's two scheduler steps on one tile's latents, diffusers' scheduler against the engine's
(`worker/sr/stepper.py`), side by side on one device: seconds per schedule, operations sent to the device, and
whether the two give the same bits there. The released checkpoint's scheduler (shift 5, 10 grid points); a tile's
latents as the engine steps them, bf16 (batch, frames, height, width, 64 channels).

    python bench/rollout.py --out rollout.jsonl [--shapes HD9,W1] [--repeat 5] [--device cuda:0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers import PiflowScheduler  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.lines import emit  # noqa: E402
from worker.sr import stepper  # noqa: E402

# One tile's latents: the 1080p clip's (3 latent frames), W1's (31), and a tiny one for a smoke run.
SHAPES = {"HD9": (1, 3, 32, 48, 64), "W1": (1, 31, 32, 48, 64), "tiny": (1, 3, 4, 6, 8)}
STEPS = 2


class Operations(TorchDispatchMode):
    """Operations that compute (views aside) with an output on `device`: on a GPU, a kernel launch each."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.count = device, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        outputs = result if isinstance(result, (tuple, list)) else [result]
        if not func.is_view and any(isinstance(out, torch.Tensor) and out.device == self.device for out in outputs):
            self.count += 1
        return result


def schedule(scheduler, restart, sample: torch.Tensor, outputs: list[torch.Tensor]) -> torch.Tensor:
    restart()
    for t, output in zip(scheduler.timesteps, outputs):
        sample = scheduler.step(output, t, sample, return_dict=False)[0]
    return sample


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="HD9,W1")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    theirs = PiflowScheduler(n_grid=10, shift=5.0)
    ours = stepper.fresh(theirs)
    sides = {
        "diffusers": (theirs, lambda: theirs.set_timesteps(STEPS, device=device)),
        "engine": (ours, lambda: stepper.restart(ours, STEPS, device)),
    }
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        generator = torch.Generator().manual_seed(0)
        sample = torch.randn(*shape, generator=generator).to(device, torch.bfloat16)
        outputs = [torch.randn(*shape[:-1], 10 * shape[-1], generator=generator).to(device, torch.bfloat16)
                   for _ in range(STEPS)]
        results = {}
        for side, (scheduler, restart) in sides.items():
            first = time.perf_counter()
            results[side] = schedule(scheduler, restart, sample, outputs)  # the engine's host plan: once a process
            synchronize(device)
            first = time.perf_counter() - first
            seconds = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                schedule(scheduler, restart, sample, outputs)
                synchronize(device)
                seconds.append(time.perf_counter() - start)
            with Operations(device) as operations:
                schedule(scheduler, restart, sample, outputs)
            emit({"section": "rollout", "shape": name, "latents": list(shape), "side": side, "device": str(device),
                  "steps": STEPS, "first_s": round(first, 4), "seconds": [round(s, 5) for s in seconds],
                  "best_s": round(min(seconds), 5), "median_s": round(statistics.median(seconds), 5),
                  "device_operations": operations.count}, args.out)
        emit({"section": "rollout_bits", "shape": name, "device": str(device),
              "same_bits": bool(torch.equal(results["engine"], results["diffusers"]))}, args.out)


if __name__ == "__main__":
    main()
