"""`vsrq status` against the real stack: a real Celery worker registers itself (queue, model, devices) with a heartbeat
that expires, shows in `vsrq status --json` and in /healthz, and leaves the registry when it stops."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import time

import redis

from storage.jobs import InputInfo, JobStore
from storage.workers import WorkerInfo, WorkerRegistry

from .conftest import vsrq
from .test_worker import celery_worker

QUEUE = "vsrq.status-probe"  # served by no model: this worker takes none of the other tests' jobs


def vsrq_status(service_env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return vsrq(service_env, "status", *args)


def test_vsrq_status_lists_a_live_worker(service_env, settings, tmp_path):
    log = tmp_path / "worker.log"
    with celery_worker(service_env, "lanczos", QUEUE, log):
        deadline = time.monotonic() + 120
        while True:
            result = vsrq_status(service_env, "--json")
            assert result.returncode == 0, result.stderr
            status = json.loads(result.stdout)
            found = [worker for worker in status["workers"] if QUEUE in worker["queues"]]
            if found:
                break
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        worker = found[0]
        assert (worker["queues"], worker["model"], worker["devices"], worker["gpus"], worker["job"]) == (
            [QUEUE], "lanczos", ["cpu"], [], None
        )
        assert worker["name"].startswith("test-") and worker["pid"] > 0
        assert set(status["queues"]) >= {*settings.models.values(), QUEUE}  # its queue shows beside the served ones
        assert set(status["jobs"]) == {"queued", "in_progress", "completed", "failed", "cancelled"}

        text = vsrq_status(service_env)
        assert text.returncode == 0 and worker["name"] in text.stdout and "lanczos on cpu" in text.stdout
        name = worker["name"]
    # a worker that stops says so: gone at once, not after its TTL
    status = json.loads(vsrq_status(service_env, "--json").stdout)
    assert name not in [worker["name"] for worker in status["workers"]]


def test_vsrq_status_shows_how_far_each_workers_job_got(service_env):
    """An operator saw a worker's job id only: its stage, how far, which attempt and when it ends took `vsrq events`."""
    env = {**service_env, "VSRQ_REDIS_URL": service_env["VSRQ_REDIS_URL"].rsplit("/", 1)[0] + "/7"}  # a db of its own
    client = redis.Redis.from_url(env["VSRQ_REDIS_URL"])
    client.flushdb()
    jobs = JobStore(client, result_ttl_s=60, max_attempts=3)
    job = jobs.create(owner="o", model="k6-vsr", queue=QUEUE, params={}, input=InputInfo(key="uploads/o/x", bytes=1))
    lease = jobs.lease(job.id, "gpu0@host", 30)
    lease.heartbeat(progress=45, stage="upscaling", seconds_left=3600)
    WorkerRegistry(client).register(
        WorkerInfo(name="gpu0@host", queues=[QUEUE], model="lanczos", devices=["cpu"], host="h", pid=1, started_at=0,
                   job=job.id)  # fmt: skip
    )
    running = json.loads(vsrq_status(env, "--json").stdout)["running"]
    assert running[job.id] | {"started_at": 0, "attempt_started_at": 0, "eta": 0} == {
        "stage": "upscaling", "progress": 45, "attempt": 1, "started_at": 0, "attempt_started_at": 0, "eta": 0
    }
    assert 3500 < running[job.id]["eta"] - time.time() <= 3600  # a loaded machine's CLI start takes seconds
    line = next(line for line in vsrq_status(env).stdout.splitlines() if "gpu0@host" in line)
    assert re.search(rf"job {job.id} upscaling 45 % attempt 1, running \d+s, about 59m\d\ds left  beat", line), line

    # a second attempt: its own time, and the job's since its first (it showed the job's as the attempt's)
    client.hset(f"vsrq:job:{job.id}", "started_at", time.time() - 74)  # the first attempt began 74 s ago
    lease.retry("worker_restarted", "its worker started again")
    jobs.lease(job.id, "gpu0@host", 30).heartbeat(progress=50, stage="upscaling")
    line = next(line for line in vsrq_status(env).stdout.splitlines() if "gpu0@host" in line)
    assert re.search(rf"job {job.id} upscaling \d+ % attempt 2, running \d+s \(1m1\ds since its first\)", line), line
    client.flushdb()


def test_a_silent_worker_expires(redis_client):
    registry = WorkerRegistry(redis_client, ttl_s=3, prefix=f"vsrq-test-{secrets.token_hex(3)}")
    info = registry.register(
        WorkerInfo(name="gone@host", queues=["q"], model="lanczos", devices=["cpu"], host="host", pid=1, started_at=0)
    )
    assert registry.list() == [info] and info.heartbeat_at > 0
    registry.register(info.model_copy(update={"job": "video_1"}))
    assert registry.list()[0].job == "video_1"
    time.sleep(3.2)  # no heartbeat since: a SIGKILLed worker
    assert registry.list() == []


def test_vsrq_status_without_redis_says_so(service_env):
    result = vsrq_status({**service_env, "VSRQ_REDIS_URL": "redis://127.0.0.1:1/0"}, "--json")
    assert (result.returncode, result.stdout) == (1, "") and result.stderr.startswith("vsrq: redis_unavailable: ")


def test_vsrq_status_says_a_refused_password_is_one_not_a_stack_down(service_env):
    """A wrong password was said as Redis not answering ("is the stack up?"), where /healthz named it."""
    url = service_env["VSRQ_REDIS_URL"].replace("redis://", "redis://someone:not-the-password@")
    result = vsrq_status({**service_env, "VSRQ_REDIS_URL": url})
    assert result.returncode == 1 and "it refuses the password or user" in result.stderr, result.stderr
    assert "is the stack up" not in result.stderr and "not-the-password" not in result.stderr, result.stderr


def test_vsrq_status_says_storage_is_unreachable(service_env):
    """As /healthz does (unavailable): before, `vsrq status` said `health ok`, checking workers, reaper and leases."""
    down = {**service_env, "VSRQ_S3_ENDPOINT_URL": "http://127.0.0.1:1"}
    result = vsrq_status(down, "--json")
    assert result.returncode == 0, result.stderr
    said = "storage: it does not answer (VSRQ_S3_ENDPOINT_URL)"
    assert said in json.loads(result.stdout)["health"]["problems"], result.stdout
    text = vsrq_status(down).stdout.splitlines()[0]
    assert text.startswith("health   degraded: ") and said in text, text
