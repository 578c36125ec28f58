"""How vsrq compiles model blocks (`COMPILE`): static shapes, whole graphs, Inductor's deterministic mode, and many
graphs per block.

Two PyTorch behaviours decide where these settings live (both found on two H200s, where a second GPU's output
stopped matching the first's; `bench/RESULTS.md`):

- After tracing a frame, Dynamo puts `torch.use_deterministic_algorithms` back as it found it, and that function
  also sets Inductor's `deterministic` setting: set by assignment, the mode held for the first graph of the process
  only, and every later one timed candidate reduction kernels at their first launch, whose near-ties differ
  between GPUs and processes. So the mode is a compile option (`COMPILE`): Inductor applies it around each
  graph it builds.
- Dynamo's and Inductor's settings are kept per thread (context variables; torch 2.13), and a new thread starts
  from the defaults. Every model call runs on an engine's device threads, so they raise Dynamo's graph limits
  themselves (`allow_many_graphs` initialises them).
"""

from __future__ import annotations

import torch

# `torch.compile` / `nn.Module.compile` arguments for the transformer's and the decoder's blocks. Static shapes: every
# clip length gets graphs of its own, instead of Dynamo recompiling with dynamic sizes at the second length it meets.
COMPILE = {"fullgraph": True, "dynamic": False, "options": {"deterministic": True}}


def allow_many_graphs() -> None:
    """Raises Dynamo's recompile limits (8 graphs per code object, 256 in all) for the calling thread: a block class's
    code object is shared by every replica and device, each (shape, device) is a graph of its own, and with
    `fullgraph` a limit hit fails the job instead of falling back to eager."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 4096)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 65536)
