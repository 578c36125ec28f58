from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

# Inductor trusts the CPU's flags for its vector ISAs instead of test-compiling each one (~13 CPU-s per fresh cache
# directory, ~3 s per process; the same ISA is picked): read when torch._inductor.config is first imported, so before
# the engine's import below. Subprocesses (workers, the compile tests' processes) inherit it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import torch  # noqa: E402

from worker.sr.checkpoint import write_tiny  # noqa: E402
from worker.sr.engine import SREngine  # noqa: E402

# `make test` hands whole files to three processes (xdist --dist loadfile --no-loadscope-reorder) in the order the
# items are collected: the longest files first (their seconds in a clean 2-core CI run's junit report), so that
# the run does not end on a long file in one process while the others idle. Files not listed follow, most tests
# first (xdist's own order). A new file that takes over a minute belongs in this list.
LONGEST_FIRST = [
    "tests/reliability/test_faults.py",
    "tests/test_corpus.py",
    "tests/test_execution.py",
    "tests/test_precompiled.py",
    "tests/service/test_demo.py",
    "tests/service/test_recovery.py",
    "tests/reliability/test_restarts.py",
    "tests/test_cli.py",
    "tests/test_service_bench.py",
    "tests/test_bench.py",
    "tests/service/test_worker.py",
    "tests/test_media_memory.py",
    "tests/reliability/test_hostile.py",
    "tests/service/test_webhooks.py",
    "tests/test_parity.py",
    "tests/service/test_corpus_api.py",
    "tests/service/test_bulk.py",
    "tests/test_compile_cache.py",
    "tests/test_offload.py",
    "tests/service/test_web.py",
    "tests/service/test_worker_memory.py",
    "tests/test_media.py",
    "tests/reliability/test_security.py",
    "tests/service/test_lifecycle.py",
    "tests/service/test_openapi.py",
]
VARIANTS = [("piflow", True), ("piflow", False), ("flowmatch", True), ("flowmatch", False)]
# Inputs the tiny model's (32, 64) landscape tile covers with 2x2 tiles (3x3 at x2.25, whose x1.125 pre-upscale
# lands on the VAE grid only from 32 px), 9 frames = 3 latent frames.
CLIP_SIZE = {2: (24, 48), 2.25: (32, 64), 4: (12, 24)}
FRAMES = 9


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        (variant, upscaler): write_tiny(root / f"{variant}-{'lu' if upscaler else 'pixel'}", variant, upscaler)
        for variant, upscaler in VARIANTS
    }


@pytest.fixture(scope="session")
def tiny_piflow(tiny_checkpoints) -> Path:
    return tiny_checkpoints[("piflow", True)]


@pytest.fixture(scope="session")
def engine(tiny_piflow) -> SREngine:
    return SREngine.from_pretrained(str(tiny_piflow))


def clip(scale: float, seed: int = 0, frames: int = FRAMES) -> torch.Tensor:
    """A random (F, 3, H, W) clip in [0, 1] that the tiny model tiles without padding at `scale`."""
    height, width = CLIP_SIZE[scale]
    return torch.rand(frames, 3, height, width, generator=torch.Generator().manual_seed(seed))


def run(engine: SREngine, video: torch.Tensor, request, **kwargs) -> torch.Tensor:
    chunks: list[torch.Tensor] = []
    engine.upscale(video, request, chunks.append, **kwargs)
    return torch.cat(chunks)


@pytest.fixture(scope="module")
def corpus_cache() -> Path:
    """The real-world media corpus (`make corpus`): a file missing from it fails the test, never skips it."""
    from tests.corpus.check import corpus

    try:
        return corpus()[0]
    except AssertionError as error:
        pytest.fail(str(error))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files in LONGEST_FIRST's order, then the rest by their number of tests; each file's own order is kept."""
    rank = {path: place for place, path in enumerate(LONGEST_FIRST)}
    path = {id(item): item.nodeid.split("::", 1)[0] for item in items}
    tests = Counter(path.values())
    items.sort(key=lambda item: (rank.get(path[id(item)], len(rank)), -tests[path[id(item)]], path[id(item)]))
