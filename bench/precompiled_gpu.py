"""Whether worker.sr.precompiled works on a GPU's torch and Triton: the tiny checkpoint's blocks, compiled as the
worker compiles them, in three processes on one cache directory (tests/test_precompiled.py's steps on `--device`):
today's `nn.Module.compile` then precompiled (compiled and saved) in the first, then a second and third process that
should load every function and trace nothing. One JSON line per setting: the outputs' hash, graphs traced,
functions loaded / compiled / fallen back, and the seconds of the block calls (the first call builds or loads).

    python bench/precompiled_gpu.py --device cuda:0 --out precompiled.jsonl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

START = """
import hashlib, json, sys, time, torch
from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRResnetBlock3D
from worker.sr import precompiled
from worker.sr.backends import open_upscaler

checkpoint, cache, device, *settings = sys.argv[1:]

def noise(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)

for setting in settings:
    traced, before = torch._dynamo.utils.counters["stats"], precompiled.stats()
    graphs = traced["unique_graphs"]
    upscaler = open_upscaler(checkpoint, devices=(device,), compile_cache_dir=cache, warmup_frames=None,
                             compile="on", precompile=setting == "on")
    transformer, vae = upscaler.replicas[0].transformer, upscaler.replicas[0].vae
    dtype = max(transformer.parameters(), key=torch.Tensor.numel).dtype
    block = next(module for module in vae.decoder.modules() if isinstance(module, Kandinsky6SRResnetBlock3D))
    state = block.make_cache()
    started = time.perf_counter()
    with torch.no_grad():
        latents = noise(1, 1, 8, 16, 2 * transformer.config.in_visual_dim + 1, seed=0).to(dtype)
        timestep = torch.tensor([0.5], device=device)
        outputs = [transformer(hidden_states=latents, timestep=timestep, return_dict=False)[0]]
        vae_dtype = max(block.parameters(), key=torch.Tensor.numel).dtype
        zq = noise(1, vae.config.latent_channels, 1, 8, 16, seed=1).to(vae_dtype)
        outputs += [block(noise(1, block.in_channels, 1, 8, 16, seed=2 + s).to(vae_dtype), state, zq=zq) for s in range(2)]
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    first_s = time.perf_counter() - started
    outputs += [state["conv1"]["padding"], state["conv2"]["padding"]]
    found = {name: value - before[name] for name, value in precompiled.stats().items()}
    digest = hashlib.sha256(b"".join(o.float().cpu().numpy().tobytes() for o in outputs)).hexdigest()
    print(json.dumps({"setting": setting, "output": digest, "traced": traced["unique_graphs"] - graphs,
                      "first_calls_s": round(first_s, 3), "torch": torch.__version__,
                      "available": precompiled.available(), **found}), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", type=Path, default=Path("precompiled.jsonl"))
    args = parser.parse_args()
    from worker.sr.checkpoint import write_tiny

    with tempfile.TemporaryDirectory() as directory:
        checkpoint = write_tiny(Path(directory) / "tiny")
        cache = Path(directory) / "cache"
        for process, settings in enumerate((["off", "on"], ["on"], ["on"]), 1):
            done = subprocess.run([sys.executable, "-c", START, str(checkpoint), str(cache), args.device, *settings],
                                  cwd=ROOT, capture_output=True, text=True, timeout=400)
            sys.stderr.write(done.stderr[-4000:])
            with args.out.open("a") as out:
                for line in done.stdout.splitlines():
                    if line.startswith("{"):
                        record = {"process": process, **json.loads(line)}
                        print(json.dumps(record), flush=True)
                        out.write(json.dumps(record) + "\n")
            if done.returncode:
                print(json.dumps({"process": process, "returncode": done.returncode}), flush=True)


if __name__ == "__main__":
    main()
