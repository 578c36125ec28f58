"""bench/high_bytes.py on the CPU, tiny: `high`'s output is the same bytes in a process that compiled its blocks and
in one that loaded them from the directory (a resumed `high` job's windows come from both), and the script that
asks this on a GPU keeps working."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor's CPU code needs a C++ compiler")
def test_high_gives_the_same_bytes_compiled_and_loaded_in_another_process(tmp_path):
    out, cache, keep = tmp_path / "high-bytes.jsonl", tmp_path / "cache", tmp_path / "keep"
    script = [sys.executable, "bench/high_bytes.py", "--out", str(out)]
    for label in ("compiled", "loaded"):
        subprocess.run(
            [*script, "--tiny", "--cache", str(cache), "--clips", "SQ33", "--label", label, "--keep", str(keep)],
            cwd=ROOT, check=True, capture_output=True, timeout=600, env={**os.environ, "TORCHINDUCTOR_VEC_ISA_OK": "1"},
        )  # fmt: skip
    subprocess.run([*script, "--compare", str(keep)], cwd=ROOT, check=True, timeout=120)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    runs = {(r["label"], r["clip"]): r for r in records if "label" in r}
    assert set(runs) == {("compiled", "SQ33"), ("loaded", "SQ33")}
    compiled, loaded = runs["compiled", "SQ33"], runs["loaded", "SQ33"]
    assert compiled["levers"] == {"fp8_linear": "scaled_mm_rowwise", "fp8_attention": "fp8_emulated"}
    assert compiled["functions"]["compiled"] == 1 and loaded["functions"] == {"loaded": 1, "compiled": 0, "fallback": 0}
    assert loaded["graphs"]["traced"] == 0  # nothing traced again: the loaded function ran
    assert compiled["sha256"] == loaded["sha256"]
    assert [(r["clip"], r["identical"]) for r in records if "identical" in r] == [("SQ33", True)]
