"""README's first command: `vsrq demo` runs the main job end to end on the embedded stack, then stops it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import av
import psutil

from .conftest import as_a_shell_starts_it


def test_demo_runs_the_main_job_through_the_embedded_stack(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "client.cli", "demo", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300
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


def test_dev_serves_jobs_until_interrupted_then_stops_everything(tmp_path):
    import os
    import signal
    import time

    import requests

    from infra.stack import free_ports

    port = free_ports(1)[0]
    # its state file goes to this test's own config directory; `vsrq status` below finds the stack through it alone
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VSRQ_")}, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    dev = subprocess.Popen(
        [sys.executable, "-m", "client.cli", "dev", "--dir", str(tmp_path), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=as_a_shell_starts_it,
    )  # fmt: skip
    try:
        banner = [dev.stdout.readline() for _ in range(2)]
        assert banner[0].startswith(f"vsrq dev: API http://127.0.0.1:{port}, serving lanczos"), banner
        token = banner[1].split("VSRQ_TOKEN=")[1].strip()
        url = f"http://127.0.0.1:{port}"
        state = json.loads((tmp_path / "config" / "vsrq" / "dev.json").read_text())
        assert (state["url"], state["token"], state["env"]["OPENAI_BASE_URL"]) == (url, token, f"{url}/v1")
        models = requests.get(f"{url}/v1/models", timeout=10).json()  # no key: auth is off on loopback
        assert [model["id"] for model in models["data"]] == ["lanczos"]
        from worker.media.synthetic import write_clip

        clip = write_clip(tmp_path / "in.mp4", num_frames=9, size=(32, 48))
        with open(clip, "rb") as video:  # SGLang's form, no header
            job = requests.post(
                f"{url}/v1/videos", files={"video_reference": video}, data={"sr_resolution_scale": "2"}, timeout=30
            ).json()
        assert job["model"] == "lanczos", job  # the model the worker runs, not a name it does not
        api = requests.Session()
        api.headers["Authorization"] = f"Bearer {token}"
        deadline = time.monotonic() + 120
        while job["status"] not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
            time.sleep(0.3)
            job = api.get(f"{url}/v1/videos/{job['id']}").json()  # the key sees the anonymous job: one owner
        assert job["status"] == "completed", job
        assert (job["output"]["media"]["width"], job["output"]["model"]) == (96, "lanczos")
        status = subprocess.run(
            [sys.executable, "-m", "client.cli", "status", "--json"], capture_output=True, text=True, env=env, timeout=60
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["jobs"]["completed"] == 1
    finally:
        dev.send_signal(signal.SIGINT)
        assert dev.wait(60) == 0
    leftovers = [p.info for p in psutil.process_iter(["pid", "cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
    assert not (tmp_path / "config" / "vsrq" / "dev.json").exists()  # gone with the stack
