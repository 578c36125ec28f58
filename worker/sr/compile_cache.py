"""Where compiled code persists between worker processes: Inductor's FX graph cache and AOTAutograd's cache (with
the Triton kernels bundled into their entries) under one directory, so a restart (`kill -9`, a deploy, a KEDA
scale-up onto a volume that holds it) loads the warmup's graphs instead of compiling them again.

Both caches are keyed on the graph, the compile options (`compilation.COMPILE`: Inductor's deterministic mode is
part of the key, the same at every start), torch/Triton versions and the device, so a directory shared by workers of
one image and GPU model is portable between them; one from another version or GPU only misses. Dynamo still traces
at every start (seconds); the code generation and the kernel compiles (most of a cold start) are what the cache
saves. A directory on a volume is what `torch.compiler.save_cache_artifacts` would rebuild elsewhere: the worker uses
the directory itself and ships no artifact blob.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Inductor's, AOTAutograd's and Triton's on-disk caches all live under TORCHINDUCTOR_CACHE_DIR (Triton's in
# triton/<device>/ unless TRITON_CACHE_DIR says otherwise); the flags force the caches on whatever the defaults say.
_ENVIRONMENT = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
COUNTERS = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")


def use(directory: str | Path) -> Path:
    """Makes `directory` the process's compile cache (created if missing); call before the first compile."""
    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ.update(_ENVIRONMENT, TORCHINDUCTOR_CACHE_DIR=str(path))
    # The flags are read when torch's config modules load (torch may be imported already): set them as well. They are
    # process-wide defaults, which the engine's device threads start from.
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    return path


def stats() -> dict[str, int]:
    """This process's FX graph cache hits, misses and bypasses, and AOTAutograd's hits and misses so far."""
    counters = torch._dynamo.utils.counters
    found = {name: int(counters["inductor"][name]) for name in COUNTERS}
    for name in ("autograd_cache_hit", "autograd_cache_miss"):
        found[name] = int(counters["aot_autograd"][name])
    return found


# Dynamo's own timers (`torch._dynamo.utils.compile_times`), summed over the process: all of its work on a frame, the
# bytecode tracing in it, the backend (AOTAutograd and Inductor: a compile, or a cache entry loaded) and the guards.
_TIMERS = {
    "compile": "_compile.compile_inner",
    "tracing": "bytecode_tracing",
    "backend": "OutputGraph.call_user_compiler",
    "guards": "build_guards",
}


def seconds() -> dict[str, float]:
    """Seconds this process has spent compiling so far (`_TIMERS`; 0 for a timer this torch does not keep): what
    of a warmup was building or loading graphs rather than running them."""
    timers = torch._dynamo.utils.compilation_time_metrics
    return {name: sum(timers.get(key, ())) for name, key in _TIMERS.items()}


def graphs_built() -> dict[str, int]:
    """Graphs built so far: Dynamo's traced graphs, and how many Inductor loaded from the cache or compiled."""
    found = stats()
    return {
        "traced": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        "from_cache": found["fxgraph_cache_hit"],
        "compiled": found["fxgraph_cache_miss"] + found["fxgraph_cache_bypass"],
    }
