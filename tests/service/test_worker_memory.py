"""A real lanczos worker's host memory over repeated big jobs, their tails overlapped with the next job's head and
engine: what a job freed goes back to the system (worker.heap), so the worker's resident memory once several jobs
have ended stays near what it was once the first had (issue 22, item 5)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from infra.stack import free_ports
from worker.media.synthetic import write_clip

from .conftest import ROOT
from .test_worker import create, wait_for

# 720p to 1440p: output frames of 11 MB, which glibc's arenas kept resident once freed (worker.heap); 3 frames
# a job: quick on a CPU
SIZE, FRAMES = (720, 1280), 3
# Jobs submitted at once, so each tail overlaps the next job. The first wave is the baseline: its overlapped tails
# are a path the worker's first job never takes, and its first use costs 13-18 MiB for good (measured: 3 waves with
# the fixed mmap threshold 447-451 -> 464-469 -> 469-478 MiB; without it 604-640 -> 824-854 -> 1024-1040 MiB)
JOBS, WAVES = 3, 3
BOUND = 1.05  # the issue's: within 5 % of the peak once the first of each shape has run


@pytest.fixture(scope="module")
def big_clip(tmp_path_factory) -> bytes:
    return write_clip(tmp_path_factory.mktemp("big") / "big.mp4", FRAMES, SIZE).read_bytes()


@pytest.fixture(scope="module")
def metered_worker(service_env, redis_client, tmp_path_factory) -> Iterator[tuple[int, str, Path]]:
    """A lanczos worker (vsrq.cpu) with its metrics port, tails overlapped (the default): (its pid, its /metrics URL,
    its log file)."""
    redis_client.delete("vsrq.cpu")  # messages other tests left for jobs they only inspected
    port = free_ports(1)[0]
    env = {**os.environ, **service_env, "VSRQ_WORKER_MODEL": "lanczos", "VSRQ_WORKER_DEVICES": "cpu",
           "VSRQ_METRICS_PORT": str(port)}  # fmt: skip
    log = tmp_path_factory.mktemp("memory") / "worker.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "--pool", "solo", "--concurrency", "1",
             "-Q", "vsrq.cpu", "-n", f"memory-{secrets.token_hex(3)}@localhost", "--without-gossip",
             "--without-mingle", "--loglevel", "info"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield process.pid, f"http://127.0.0.1:{port}/metrics", log
    finally:
        process.terminate()
        process.wait(30)


def resident_once_ended(pid: int, metrics: str, jobs: int, log: Path) -> int:
    """The worker's resident bytes (/proc) once `jobs` attempts have ended, their tails included (a tail counts its
    attempt last): the worker idle, holding only what it keeps between jobs."""
    deadline = time.monotonic() + 60
    while True:
        try:
            text = requests.get(metrics, timeout=5).text
            ended = sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "vsrq_worker_attempts_total"
            )
            if ended >= jobs:
                break
        except requests.ConnectionError:  # not serving yet
            pass
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.05)
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


def test_host_memory_after_repeated_big_jobs_stays_near_the_first_jobs(api, metered_worker, big_clip, jobs):
    pid, metrics, log = metered_worker
    resident, tails = [], []
    for wave in range(WAVES):
        ids = [create(api, big_clip)["id"] for _ in range(JOBS)]
        for job_id in ids:
            job = wait_for(api, job_id, log, limit_s=180)  # the worker's start included, for the first
            assert job["status"] == "completed" and job["size"] == f"{2 * SIZE[1]}x{2 * SIZE[0]}", job
        resident.append(resident_once_ended(pid, metrics, JOBS * (wave + 1), log))
        tails += [event.detail["tail"] for job_id in ids for event in jobs.events(job_id) if event.type == "run"]
    # the tails ran beside the next jobs, as in the GPU worker's queue
    assert tails == ["overlapped"] * (WAVES * JOBS), tails
    gib = 2**30
    assert resident[-1] <= BOUND * resident[0], (
        f"resident {resident[-1] / gib:.3f} GiB after {WAVES * JOBS} jobs against {resident[0] / gib:.3f} GiB after "
        f"the first {JOBS}"
    )
