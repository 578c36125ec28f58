"""README's first command: `vsrq demo` runs the main job end to end on the embedded stack, then stops it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import av
import psutil


def test_demo_runs_the_main_job_through_the_embedded_stack(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "worker.cli", "demo", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "POST /v1/videos -> video_" in result.stdout and "completed" in result.stdout
    output = tmp_path / "output-x2.mp4"
    promised = json.loads(result.stdout.strip().splitlines()[-1].split(": ", 1)[1])
    assert promised["sha256"] == hashlib.sha256(output.read_bytes()).hexdigest()
    with av.open(str(output)) as container:
        video = container.streams.video[0]
        assert (video.width, video.height) == (192, 128)
        assert sum(1 for _ in container.decode(video)) == 33
        assert container.streams.audio[0].channels == 2
    # Everything it started is stopped: no process still runs out of the demo's directory.
    leftovers = [p.info for p in psutil.process_iter(["pid", "cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
