"""/metrics of the live API (gunicorn, two processes: multiprocess mode) and of a real Celery worker (lanczos) around
one job: each figure moves by what the job did, and the worker's log lines about the job are JSON with its id."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from infra.stack import free_ports

from .conftest import KEYS, serve_api
from .test_worker import celery_worker, create, wait_for

Samples = dict[tuple[str, frozenset], float]
METRICS_PREFIX = "vsrq-api-metrics-"  # infra/gunicorn.conf.py's


def scrape(url: str) -> Samples:
    response = requests.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/plain")
    assert response.headers["Content-Type"].count("charset") == 1, response.headers["Content-Type"]
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def metered_worker(service_env, redis_client, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """The lanczos worker (vsrq.cpu) with its metrics port: (its /metrics base URL, its log file)."""
    redis_client.delete("vsrq.cpu")  # messages other tests left for jobs they only inspected
    port = free_ports(1)[0]
    env = {**service_env, "VSRQ_METRICS_PORT": str(port), "VSRQ_LOG_FORMAT": "json"}
    log = tmp_path_factory.mktemp("metered") / "worker.log"
    with celery_worker(env, "lanczos", "vsrq.cpu", log):
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                requests.get(f"{url}/metrics", timeout=5)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.3)
        yield url, log


def test_a_job_moves_the_metrics_by_what_it_did(api, metered_worker, clip, service_env):
    worker_url, log = metered_worker
    api_before, worker_before = scrape(api), scrape(worker_url)

    job_id = create(api, clip)["id"]
    polls = 0

    def done(job: dict) -> bool:
        nonlocal polls
        polls += 1
        return job["status"] in ("completed", "failed", "cancelled")

    job = wait_for(api, job_id, log, until=done)
    assert job["status"] == "completed", job
    api_after = scrape(api)
    # The worker records a job's metrics and logs its end just after the completion the API showed: wait for both.
    deadline = time.monotonic() + 30
    while True:
        worker_after, text = scrape(worker_url), log.read_text()
        attempts = value(worker_after, "vsrq_worker_attempts_total", queue="vsrq.cpu", outcome="completed")
        recorded = attempts > value(worker_before, "vsrq_worker_attempts_total", queue="vsrq.cpu", outcome="completed")
        if (recorded and f"{job_id} completed" in text) or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    # the API: every request counted once, whichever of gunicorn's two processes served it
    def requests_of(samples: Samples, method: str, route: str) -> float:
        name = "vsrq_http_request_duration_seconds_count"
        return value(samples, name, method=method, route=route, status="200")

    assert requests_of(api_after, "POST", "/v1/videos") - requests_of(api_before, "POST", "/v1/videos") == 1
    route = "/v1/videos/<job_id>"
    assert requests_of(api_after, "GET", route) - requests_of(api_before, "GET", route) == polls
    # the service's state, from Redis: the job moved from nowhere to completed, nothing more is left queued
    assert value(api_after, "vsrq_jobs", status="completed") - value(api_before, "vsrq_jobs", status="completed") == 1
    assert value(api_after, "vsrq_jobs", status="queued") == value(api_before, "vsrq_jobs", status="queued")
    # (other tests' jobs may wait on the shared queue: it must hold what it held before, not this job)
    assert value(api_after, "vsrq_queue_depth", queue="vsrq.cpu") == value(api_before, "vsrq_queue_depth", queue="vsrq.cpu")
    assert value(api_after, "vsrq_workers", queue="vsrq.cpu") >= 1

    # the worker: one completed attempt, its latency as the record tells it, every stage timed once
    def delta(name: str, **labels: str) -> float:
        return value(worker_after, name, **labels) - value(worker_before, name, **labels)

    assert delta("vsrq_worker_attempts_total", queue="vsrq.cpu", outcome="completed") == 1
    assert delta("vsrq_job_duration_seconds_count", queue="vsrq.cpu", status="completed") == 1
    latency = delta("vsrq_job_duration_seconds_sum", queue="vsrq.cpu", status="completed")
    assert abs(latency - (job["completed_at"] - job["created_at"])) <= 1.0  # the API shows whole seconds
    for stage in ("queued", "probing", "uploading"):
        assert delta("vsrq_job_stage_duration_seconds_count", queue="vsrq.cpu", stage=stage) == 1, stage
    stages = sum(
        delta("vsrq_job_stage_duration_seconds_sum", queue="vsrq.cpu", stage=stage)
        for stage in ("queued", "probing", "upscaling", "encoding", "uploading")
    )
    assert 0 < stages <= latency + 1.0
    assert delta("vsrq_worker_output_frames_total") == job["output"]["media"]["frames"]
    assert delta("vsrq_worker_tiles_total") >= 1 and value(worker_after, "vsrq_worker_output_frames_per_second") > 0
    assert not any(name == "vsrq_gpu_memory_peak_bytes" for name, _ in worker_after)  # a CPU worker has no GPU peak

    # its log: JSON lines, the job's own carrying its id, no secret anywhere
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    mine = [line for line in lines if line.get("job_id") == job_id]
    assert any(line["logger"] == "vsrq.worker" and "completed" in line["message"] for line in mine), text[-4000:]
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    assert KEYS["dave"] not in text and service_env["VSRQ_S3_SECRET_KEY"] not in text


def test_metrics_needs_no_key_and_counts_refusals(api):
    before = scrape(api)
    refused = requests.get(f"{api}/v1/videos", headers={"Authorization": "Bearer sk-not-a-key-0000000"}, timeout=10)
    assert refused.status_code == 401
    after = scrape(api)
    name = "vsrq_http_request_duration_seconds_count"
    labels = {"method": "GET", "route": "/v1/videos", "status": "401"}
    assert value(after, name, **labels) - value(before, name, **labels) == 1


def test_the_api_s_metrics_directory_goes_when_it_stops(service_env, tmp_path):
    """The directory gunicorn's master makes for its workers' samples, where none is given, holds them while the API
    serves and goes when it stops. Before: one more /tmp/vsrq-metrics-* at every start, kept for good."""
    with mock.patch.dict(os.environ):
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        with serve_api({**service_env, "TMPDIR": str(tmp_path)}, tmp_path / "gunicorn.log") as url:
            scrape(url)
            [made] = tmp_path.glob(f"{METRICS_PREFIX}*")
            assert any(made.glob("*.db"))
    assert list(tmp_path.glob(f"{METRICS_PREFIX}*")) == []


def test_a_killed_api_s_metrics_directory_goes_at_the_next_start(service_env, tmp_path):
    """A master killed hard (SIGKILL, the OOM killer) never cleans up: its directory goes when the next API starts in
    the same temporary directory (a container's /tmp outlives its process), a live one's stays. Before: a soak trial
    found one kept for good at every kill."""
    env = {**service_env, "TMPDIR": str(tmp_path)}
    with mock.patch.dict(os.environ):
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        with serve_api(env, tmp_path / "killed.log") as url:
            scrape(url)
            [killed] = tmp_path.glob(f"{METRICS_PREFIX}*")
            children = psutil.Process().children()
            [master] = [child for child in children if child.environ().get("TMPDIR") == env["TMPDIR"]]
            workers = master.children()
            master.kill()
            assert psutil.wait_procs([master, *workers], timeout=30)[1] == []  # its workers die with it
        assert killed.exists()
        with serve_api(env, tmp_path / "live.log"):
            with serve_api(env, tmp_path / "next.log") as url:
                scrape(url)
                assert not killed.exists()
                assert len(list(tmp_path.glob(f"{METRICS_PREFIX}*"))) == 2  # the live API's kept
    assert list(tmp_path.glob(f"{METRICS_PREFIX}*")) == []


def test_jobs_are_counted_by_owner_without_reading_the_keyspace(tmp_path):
    """A /metrics scrape and `vsrq status` found the owners by SCAN, every call: 57 SCANs and 88 ms a scrape at 50,000
    jobs in a trial, growing with them. Owners are a set each create adds to, filled once where a store was written
    before it. On a Redis of its own, whose command counts are this test's."""

    import redis

    from infra.stack import REDIS_CONF, binary
    from storage.blobs import LocalBlobStore
    from storage.config import Settings
    from storage.jobs import InputInfo, JobStore, Status
    from storage.lifecycle import sweep

    port = free_ports(1)[0]
    server = subprocess.Popen([binary("redis-server"), str(REDIS_CONF), "--port", str(port), "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        store = JobStore(client, result_ttl_s=60, max_attempts=3)
        for owner in ("ann", "ann", "bob"):
            store.create(owner=owner, model="lanczos", queue="q", params={}, input=InputInfo(key="k"))
        store.cancel(store.create(owner="cid", model="lanczos", queue="q", params={}, input=InputInfo(key="k")).id)
        client.delete("vsrq:owners", "vsrq:owners:filled")  # a store written before the set: found once by SCAN
        expected = {**dict.fromkeys(Status, 0), Status.QUEUED: 3, Status.CANCELLED: 1}
        assert store.counts() == expected and store.owners() == ["ann", "bob", "cid"]
        scans = client.info("commandstats")["cmdstat_scan"]["calls"]
        store.create(owner="dee", model="lanczos", queue="q", params={}, input=InputInfo(key="k"))
        assert store.counts() == {**expected, Status.QUEUED: 4}
        assert client.info("commandstats")["cmdstat_scan"]["calls"] == scans  # no scan once filled
        # an API older than the set (a rolling deploy's old pod) makes a job for a new owner: counted from the next
        # storage sweep, not only once the hourly fill comes round
        store.create(owner="eve", model="lanczos", queue="q", params={}, input=InputInfo(key="k"))
        client.srem("vsrq:owners", "eve")
        assert store.counts() == {**expected, Status.QUEUED: 4}
        sweep(store, LocalBlobStore(tmp_path / "blobs"), Settings(_env_file=None))
        assert store.counts() == {**expected, Status.QUEUED: 5} and "eve" in store.owners()
    finally:
        server.kill()
        server.wait(10)
