"""The worker's compile cache directory (VSRQ_WORKER_COMPILE_CACHE_DIR): a second process on the same directory loads
its graphs from it instead of compiling them. Real Inductor compiles on the CPU (a C++ compiler), with the options
the engine compiles with (`compilation.COMPILE`, deterministic mode included), through `open_upscaler`'s setup."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Inductor trusts the CPU's flags for its vector ISAs instead of test-compiling each one (~13 CPU-s per fresh cache
# directory, ~3 s per process): the same ISA is picked here, and the generated code is the same
ENV = {**os.environ, "TORCHINDUCTOR_VEC_ISA_OK": "1"}

# One process's start: the worker's upscaler setup with the cache directory, then a block compiled as the engine
# compiles its blocks; prints the cache counters.
START = """
import json, sys, torch
from worker.sr import compile_cache
from worker.sr.backends import open_upscaler
from worker.sr.compilation import COMPILE

open_upscaler("lanczos", compile_cache_dir=sys.argv[1])

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8, 8))

    def forward(self, x):
        return torch.nn.functional.gelu(x @ self.weight).sum(-1)

block = Block().eval().requires_grad_(False)
block.compile(**COMPILE)
with torch.no_grad():
    assert block(torch.ones(3, 8)).shape == (3,)
print(json.dumps(compile_cache.stats()))
"""


def start(cache) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", START, str(cache)], cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor's CPU code needs a C++ compiler")
def test_a_restart_loads_the_compiled_graphs_from_the_cache_directory(tmp_path):
    cache = tmp_path / "compile-cache"
    cold = start(cache)
    assert (cold["fxgraph_cache_miss"], cold["fxgraph_cache_hit"], cold["autograd_cache_miss"]) == (1, 0, 1), cold
    assert (cache / "fxgraph").is_dir() and (cache / "aotautograd").is_dir()

    warm = start(cache)  # a new process: only the directory carries the graph over
    assert (warm["fxgraph_cache_hit"], warm["fxgraph_cache_miss"], warm["fxgraph_cache_bypass"]) == (1, 0, 0), warm
    assert warm["autograd_cache_hit"] == 1 and warm["autograd_cache_miss"] == 0, warm
