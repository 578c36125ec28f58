"""Faults, injected on purpose into a service of real processes on loopback: Redis (AOF on) and SeaweedFS from
infra.stack, the API under gunicorn, solo Celery workers (lanczos on the CPU) and the reaper, all with short leases.

This module runs its own stack, not the session's: it kills, pauses and restarts the processes of it. Each test prints
its figures on one line starting `FIGURE `:

    pytest tests/reliability/test_faults.py -q -s | grep FIGURE
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import io
import json
import math
import os
import random
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from unittest import mock

import psutil
import pytest
import redis
import requests
from kombu.exceptions import OperationalError

from infra.stack import Stack, free_ports
from storage.blobs import S3BlobStore, output_prefix
from storage.config import Settings
from storage.jobs import TERMINAL, InputInfo, JobEvent, JobRecord, JobStore, Status, open_redis
from storage.lifecycle import sweep
from storage.queue import UPSCALE_TASK, make_celery
from storage.workers import WorkerRegistry
from worker.attempt import EX_CONFIG, OUTDATED_TRIES
from worker.errors import Cancelled
from worker.heartbeat import Heartbeat
from worker import service
from worker.costs import job_limits
from worker.media.errors import InputTooLarge
from worker.media.probe import probe
from worker.media.synthetic import write_clip

from tests.service.conftest import NO_LIST, READ_ONLY, embedded_stack
from tests.service.test_status import vsrq_status

from . import processes
from .processes import MemoryLimit, Partition, Process, Supervisor, serving, started

QUEUE = "vsrq.faults"
TOKEN = "sk-test-faults-" + "0" * 16
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LEASE_S = 10
MAX_ATTEMPTS = 2
UPLOAD_TTL_S = 6


# -- the service under test ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fault-logs")


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    with embedded_stack(tmp_path_factory.mktemp("fault-stack")) as running:
        yield running


@pytest.fixture(scope="module")
def env(stack: Stack) -> dict[str, str]:
    return {
        **stack.env(),
        "VSRQ_API_KEYS": json.dumps([{"id": "faults", "token": TOKEN}]),
        "VSRQ_MODELS": json.dumps({"lanczos": QUEUE}),
        "VSRQ_LEASE_S": str(LEASE_S),
        "VSRQ_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
        "VSRQ_REAP_INTERVAL_S": "0.5",
        "VSRQ_WORKER_HEARTBEAT_S": "0.2",
        "VSRQ_WEB_WORKERS": "2",
        "VSRQ_WEB_THREADS": "4",
        # the reaper's repairs, in seconds: a job whose message was never sent, an upload no job claimed
        "VSRQ_ENQUEUE_GRACE_S": "2",
        "VSRQ_UPLOAD_TTL_S": str(UPLOAD_TTL_S),
        "VSRQ_SWEEP_INTERVAL_S": "1",
    }


@pytest.fixture(scope="module")
def api(env: dict[str, str], logs: Path) -> Iterator[str]:
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    server = processes.api(env, port, logs).start()
    try:
        processes.serving(server, url)
        yield url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reaper(env: dict[str, str], logs: Path) -> Iterator[Process]:
    process = processes.reaper(env, logs).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def jobs(stack: Stack) -> JobStore:
    return JobStore(redis.Redis.from_url(stack.redis_url), result_ttl_s=3600, max_attempts=MAX_ATTEMPTS)


@pytest.fixture(scope="module")
def blobs(env: dict[str, str]) -> S3BlobStore:
    with mock.patch.dict(os.environ, env):  # read exactly as the service reads them
        return S3BlobStore.from_settings(Settings(_env_file=None))


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, bytes]:
    """Real MP4s with AAC audio: small (a fraction of a second of lanczos), medium (a couple of seconds), long (two
    windows, several seconds: long enough to be caught while it runs)."""
    root = tmp_path_factory.mktemp("fault-clips")
    sizes = {"small": (17, (32, 48)), "medium": (41, (96, 128)), "long": (181, (128, 192))}
    return {
        name: write_clip(root / f"{name}.mp4", frames, size, audio_codec="aac").read_bytes()
        for name, (frames, size) in sizes.items()
    }


@pytest.fixture
def workers(env: dict[str, str], logs: Path, jobs: JobStore) -> Iterator[Callable[..., Process]]:
    """Starts workers on the test's queue (extra settings as keyword arguments); every one is stopped afterwards."""
    started_here: list[Process] = []

    def start(**extra: str) -> Process:
        process = processes.worker({**env, **extra}, QUEUE, logs).start()
        started_here.append(process)
        return process

    yield start
    stop_idle(jobs, started_here)


def stop_idle(jobs: JobStore, workers: list[Process]) -> None:
    """Ends a test's workers once it is done: killed where none can hold anything (no message queued, no job of the
    key unfinished), else a warm stop. An idle worker's warm shutdown takes 2 s (Celery's loop polls once a second,
    then the interpreter's exit), each test's end; a warm shutdown with work in flight is a test of its own."""
    try:
        unfinished = [job for job in jobs.page("faults", limit=100).jobs if job.status not in TERMINAL]
        idle = jobs.redis.llen(QUEUE) == 0 and not unfinished
    except redis.RedisError:  # a test that failed with Redis down: nothing can be told
        idle = False
    if not idle:
        processes.stop_all(workers)
        return
    for process in workers:
        if process.alive:
            process.kill()


# -- helpers -------------------------------------------------------------------------------------------------------


def create(api: str, clip: bytes, **fields: str) -> str:
    data = {"model": "lanczos", "sr_resolution_scale": "2", "seed": "7", **fields}
    files = {"video_reference": ("clip.mp4", clip, "video/mp4")}
    response = requests.post(f"{api}/v1/videos", data=data, files=files, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["id"]


def wait_until(jobs: JobStore, job_id: str, ready: Callable[[JobRecord], bool], limit_s: float = 120) -> JobRecord:
    """Polls the record in Redis (not the API: faster, and up while the API is not)."""
    deadline = time.monotonic() + limit_s
    while not ready(job := jobs.require(job_id)):
        assert time.monotonic() < deadline, f"{job_id} stuck: {job}"
        time.sleep(0.02)
    return job


def ended(job: JobRecord) -> bool:
    return job.status in TERMINAL


def wait_all(jobs: JobStore, ids: list[str], limit_s: float) -> list[JobRecord]:
    deadline = time.monotonic() + limit_s
    while True:
        try:
            records = [jobs.require(job_id) for job_id in ids]
        except redis.ConnectionError:  # Redis restarting
            records = []
        if records and all(ended(job) for job in records):
            return records
        assert time.monotonic() < deadline, [(job.id, job.status, job.stage, job.attempt) for job in records]
        time.sleep(0.1)


def leases(jobs: JobStore, job_id: str) -> list[float]:
    """When each attempt leased the job (Redis time)."""
    return [event.at for event in jobs.events(job_id) if event.type == "leased"]


def first_event(jobs: JobStore, job_id: str, kind: str) -> float:
    return next(event.at for event in jobs.events(job_id) if event.type == kind)


def history(jobs: JobStore, job_id: str) -> list[tuple[str, dict]]:
    """A job's events, for a failure's message: what each attempt did and why it ended."""
    return [(event.type, event.detail) for event in jobs.events(job_id) if event.type != "progress"]


def requeues(jobs: JobStore, job_id: str) -> list[dict]:
    """Why each of a job's attempts that did not end it ended (a lost lease, or an error to retry)."""
    return [event.detail for event in jobs.events(job_id) if event.type == "requeued"]


def outputs(blobs: S3BlobStore, job_id: str, settle_s: float = 10) -> list[str]:
    """The job's output videos (each attempt's previews go with its video), once the completing attempt's cleanup (just
    after its promotion) had its chance."""
    deadline = time.monotonic() + settle_s
    while len(found := [k for k in blobs.keys(output_prefix(job_id)) if k.endswith(".mp4")]) > 1:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return found


def content_sha256(api: str, job_id: str) -> str:
    response = requests.get(f"{api}/v1/videos/{job_id}/content", headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return hashlib.sha256(response.content).hexdigest()


def holder(job: JobRecord, candidates: list[Process]) -> Process | None:
    """The worker process that holds a job's lease (its record names `host/pid`)."""
    return next((p for p in candidates if p.alive and job.worker and job.worker.endswith(f"/{p.pid}")), None)


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


# -- 1. workers killed ---------------------------------------------------------------------------------------------


def test_workers_killed_mid_job_lose_no_job(stack, env, api, reaper, jobs, blobs, clips, logs):
    """4 jobs, each one's worker SIGKILLed at its own point of its progress: 0 (while it probes), 30 and 60 (in the
    engine's windows) and 90 (the encoder's flush, the check and the upload), in a seeded random order; supervisors
    start new workers.

    Two jobs run at a time on three workers, so that a worker is free when a killed job comes back: the time from the
    kill to the next attempt is then the service's recovery, not a wait in the queue.

    Each job is killed once (its second attempt is its last: MAX_ATTEMPTS) however the processes race. A first
    attempt's output upload is held until its kill: no job ends before the test's poll has seen it at its point (the
    medium clip's tail, the 90 point, lasts 0.2-0.5 s: a busy test process missed it). The worker is paused before it
    is killed, and the jobs it holds are read then: one whose engine is done takes its next message while its tail
    runs, and its kill waits while it holds a job killed once already, or a message whose job it has not leased (that
    job would wait VSRQ_LOST_UNACKED_S, minutes: tests/service/test_lost_messages.py proves it)."""
    rng = random.Random(20261130)
    # each kill costs a worker start (seconds of CPU): one point per stage the kill can land in, both ends included
    # (progress 1-89 is all the engine's windows: more points there prove the same recovery again)
    count = 4
    points = [round(90 * n / (count - 1)) for n in range(count)]
    rng.shuffle(points)
    lease_s = 4  # the workers' own, shorter than the module's: recovery is lease-bound, and 4 of them run here
    partition = Partition(("127.0.0.1", stack.ports["s3"]))
    through = {"VSRQ_S3_ENDPOINT_URL": f"http://127.0.0.1:{partition.port}", "VSRQ_LEASE_S": str(lease_s)}
    supervisors = [Supervisor(lambda: processes.worker({**env, **through}, QUEUE, logs)) for _ in range(3)]
    try:
        for supervisor in supervisors:
            started(supervisor.current)
        ids: list[str] = []
        targets: dict[str, int] = {}  # 0: while it probes; 90: the encoder's flush and the check, after the last window
        killed: dict[str, tuple[float, int]] = {}  # job -> (when, progress at the kill)
        dead: dict[str, float] = {}  # worker (host/pid) -> when it was killed
        holding: set[str] = set()  # jobs whose first attempt's output upload is held
        let_go: set[str] = set()  # jobs let go unkilled (see `kill`): their point is tried again with a new job
        put_off: list[str] = []  # why each kill was put off

        def upload(job_id: str) -> bytes:
            return f"PUT /{stack.bucket}/outputs/{job_id}/attempt-1-".encode()

        def release(job_id: str) -> None:
            if job_id in holding:
                holding.discard(job_id)
                partition.release(upload(job_id))

        def lost_before(job_id: str) -> bool:
            """Whether one of the job's attempts died with a worker killed for another job: that is its one kill. Not
            the attempt that completed it (its worker killed later, for another job)."""
            job = jobs.require(job_id)
            by = [(e.attempt, e.detail.get("worker")) for e in jobs.events(job_id) if e.type == "leased"]
            lost = [w for n, w in by if w in dead and not (job.status == Status.COMPLETED and n == job.attempt)]
            at = next((dead[worker] for worker in lost), None)
            if at is not None:
                killed.setdefault(job_id, (at, 0))
                release(job_id)
            return at is not None

        def taken(queued: set[str]) -> bool:
            """Whether a consumer took a queued job's message and has not leased the job yet. Within the lease: a
            killed attempt's message stays in kombu's `unacked` hash, and its job is queued again a lease later."""
            since = time.time() - lease_s
            tags = [tag for tag, at in jobs.redis.zrange("unacked_index", 0, -1, withscores=True) if at > since]
            raws = jobs.redis.hmget("unacked", tags) if tags else []
            return any(raw and job_id.encode() in raw for raw in raws for job_id in queued)

        def kill(victim: Process, job: JobRecord) -> None:
            """Kills `victim` for `job` unless it holds what must not die with it: a job killed once already, or a
            message whose job it has not leased yet. Paused first: the jobs read then are all it holds."""
            victim.pause()
            time.sleep(0.1)  # what it sent Redis before the stop has landed
            records = [jobs.require(job_id) for job_id in ids]
            held = [r for r in records if r.status == Status.IN_PROGRESS and r.worker == job.worker]
            twice = [r.id for r in held if r.id in killed]
            queued = {r.id for r in records if r.status == Status.QUEUED}
            if job.id not in {r.id for r in held} or twice or taken(queued):
                victim.resume()
                put_off.append("moved" if job.id not in {r.id for r in held} else "twice" if twice else "taken")
                if twice and job.progress >= 90:  # leased behind this tail, whose upload is held: it would wait
                    release(job.id)  # for good; this job ends unkilled, and its point is tried again
                    let_go.add(job.id)
                return
            victim.kill()
            at = dead[job.worker] = time.time()
            for record in held:  # every job the worker holds dies with it: the one behind a tail in its flush too
                killed[record.id] = (at, record.progress)
                release(record.id)

        deadline = time.monotonic() + 600
        while points or not all(ended(jobs.require(job_id)) for job_id in ids):
            assert time.monotonic() < deadline, f"killed {len(killed)}; {[jobs.require(i).status for i in ids]}"
            if points and sum(not ended(jobs.require(job_id)) for job_id in ids) < 2:
                ids.append(create(api, clips["medium"]))
                partition.hold(upload(ids[-1]))  # long before its engine is done: its head takes a second
                holding.add(ids[-1])
                targets[ids[-1]] = points.pop(0)
            for job_id in ids:
                job = jobs.require(job_id)
                if job_id in killed:
                    continue
                if job_id in let_go:
                    if ended(job) and job_id in targets and len(targets) < count + 3:
                        points.append(targets.pop(job_id))  # ended on its first attempt: its point again
                    continue
                if job.status != Status.IN_PROGRESS or job.progress < targets[job_id] or lost_before(job_id):
                    continue
                victim = holder(job, [supervisor.current for supervisor in supervisors])
                if victim is not None:
                    kill(victim, job)
            time.sleep(0.02)
        ids = [job_id for job_id in ids if job_id in targets]  # less those let go, whose point was tried again
        for job_id in ids:
            if job_id not in killed:
                lost_before(job_id)

        records = [jobs.require(job_id) for job_id in ids]
        completed = sum(job.status == Status.COMPLETED for job in records)
        per_job = [len(outputs(blobs, job_id)) for job_id in ids]
        # the kill of attempt 1 -> the reaper requeues it -> the next attempt leases it, on another (or a new) worker
        requeued = [first_event(jobs, job_id, "requeued") - at for job_id, (at, _) in killed.items()]
        resumed = [leases(jobs, job_id)[1] - at for job_id, (at, _) in killed.items() if len(leases(jobs, job_id)) > 1]
        restarts = sum(len(supervisor.history) - 1 for supervisor in supervisors)
        print(
            f"FIGURE worker_killed: completed {completed}/{len(ids)}, killed {len(killed)} (progress at kill "
            f"{sorted(p for _, p in killed.values())}), outputs per job min {min(per_job)} max {max(per_job)}, "
            f"kill->requeued max {max(requeued):.1f} s, kill->resumed max {max(resumed):.1f} s median "
            f"{statistics.median(resumed):.1f} s (lease {lease_s} s), workers restarted {restarts}; kills put off "
            f"{dict(collections.Counter(put_off))}, points tried again {len(let_go)}"
        )
        assert len(killed) == len(ids), [(i, targets[i], history(jobs, i)) for i in ids if i not in killed]
        assert completed == len(ids), [(job.id, job.error, history(jobs, job.id)) for job in records if job.error]
        assert per_job == [1] * len(ids)
        assert len(resumed) == len(ids) and max(resumed) <= lease_s + 30
        for job in records:  # a killed attempt never wins: the output is the last attempt's
            assert job.attempt >= 2 and f"/attempt-{job.attempt}-" in job.output.key, job
    finally:
        for supervisor in supervisors:
            supervisor.stop_watching()
        stop_idle(jobs, [process for supervisor in supervisors for process in supervisor.history])
        partition.close()


def test_a_long_job_killed_mid_way_resumes_from_its_kept_windows(env, api, reaper, jobs, blobs, clips, logs):
    """The medium clip in windows of 9 frames (8 of them): the worker is killed once two windows are kept; the next
    attempt replays what was kept and computes the rest, into the same bytes as an uninterrupted run."""
    windows = {"VSRQ_WORKER_WINDOW": "9", "VSRQ_WORKER_WINDOW_OVERLAP": "4"}
    lease = {"VSRQ_LEASE_S": "4"}  # the worker's own, shorter than the module's: the next attempt waits it out
    supervisor = Supervisor(lambda: processes.worker({**env, **windows, **lease}, QUEUE, logs))
    try:
        started(supervisor.current)
        reference = wait_all(jobs, [create(api, clips["medium"])], limit_s=180)[0]

        def kept(job_id: str) -> int:
            return sum(key.endswith(".json") and "window-" in key for key in blobs.keys(f"work/{job_id}/windows/"))

        def paused_mid_job() -> tuple[str, int] | None:
            """A new job, its worker paused once two of its windows are kept, and how many are; None where the job
            ended first (on a loaded machine the engine can outrun the uploads the test counts: CI's did once)."""
            job_id, deadline = create(api, clips["medium"]), time.monotonic() + 180
            while kept(job_id) < 2 and not ended(jobs.require(job_id)):
                assert time.monotonic() < deadline, "no window was kept"
                time.sleep(0.05)
            supervisor.current.pause()
            finished = kept(job_id)  # none can be added while it is paused
            if finished >= 2 and not ended(jobs.require(job_id)):
                return job_id, finished
            supervisor.current.resume()
            wait_all(jobs, [job_id], limit_s=180)
            return None

        paused = next(filter(None, (paused_mid_job() for _ in range(3))), None)
        assert paused is not None, "the job ended before the test could stop its worker, three times"
        job_id, finished = paused
        kept_prefix = f"work/{job_id}/windows/"
        supervisor.current.kill()
        job = wait_all(jobs, [job_id], limit_s=180)[0]
        pattern = re.compile(rf"{job_id} completed by attempt \d+: .*?(\d+) of (\d+) windows restored")
        deadline = time.monotonic() + 30  # the worker logs its line just after the completion the test saw
        while not (summary := pattern.search(supervisor.current.text())) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert summary, supervisor.current.text()[-3000:]
        restored, total = int(summary[1]), int(summary[2])
        recomputed = finished - restored
        print(
            f"FIGURE kept_windows: {total} windows, {finished} finished before the kill, {restored} replayed by "
            f"attempt {job.attempt}, recomputed {recomputed} (+1 in flight, lost); output identical to an "
            f"uninterrupted run: {job.output.sha256 == reference.output.sha256}"
        )
        assert job.status == Status.COMPLETED and job.attempt == 2
        assert recomputed <= 1
        assert job.output.sha256 == reference.output.sha256
        deadline = time.monotonic() + 30  # the job's end deletes its kept windows, just after the promotion
        while any(blobs.keys(kept_prefix)):
            assert time.monotonic() < deadline, list(blobs.keys(kept_prefix))
            time.sleep(0.1)
    finally:
        supervisor.stop_watching()
        stop_idle(jobs, supervisor.history)


# -- 2. Redis restarted --------------------------------------------------------------------------------------------


def test_redis_restart_loses_no_job_and_the_api_says_503(stack, env, api, reaper, jobs, blobs, clips, workers):
    crew = [workers(), workers()]
    for process in crew:
        started(process)
    running = [create(api, clips["long"]) for _ in range(2)]
    for job_id in running:
        wait_until(jobs, job_id, lambda job: job.stage == "upscaling")
    queued = [create(api, clips["small"]) for _ in range(10)]  # each runs after the restart: 10 make the point
    assert sum(jobs.require(job_id).status == Status.QUEUED for job_id in queued) >= 8  # the workers are busy

    stack.stop_service("redis")
    answers: list[tuple[int, str | None, str]] = []  # status, Retry-After, problem code
    try:
        outage_until = time.monotonic() + 4
        while time.monotonic() < outage_until or len(answers) < 3:
            for response in (
                requests.get(f"{api}/v1/videos/{queued[0]}", headers=AUTH, timeout=60),
                requests.get(f"{api}/v1/videos", headers=AUTH, timeout=60),
                requests.post(
                    f"{api}/v1/videos",
                    data={"model": "lanczos"},
                    files={"video_reference": ("clip.mp4", clips["small"], "video/mp4")},
                    headers=AUTH,
                    timeout=60,
                ),
            ):
                code = response.json().get("code") if response.headers["Content-Type"].endswith("json") else None
                answers.append((response.status_code, response.headers.get("Retry-After"), code))
    finally:
        stack.start_service("redis")

    records = wait_all(jobs, running + queued, limit_s=300)
    carried_on = [jobs.require(job_id).attempt for job_id in running]
    after = create(api, clips["small"])  # and the workers still consume, by themselves
    records.append(wait_all(jobs, [after], limit_s=120)[0])
    completed = sum(job.status == Status.COMPLETED for job in records)
    statuses = sorted({status for status, _, _ in answers})
    print(
        f"FIGURE redis_restart: jobs completed {completed}/{len(records)} (2 running + {len(queued)} queued + 1 "
        f"after), lost {len(records) - completed}; API during the outage: {len(answers)} requests, statuses {statuses}, "
        f"Retry-After {sorted({retry for _, retry, _ in answers if retry})}; worker processes restarted 0 of "
        f"{len(crew)} (alive: {sum(process.alive for process in crew)}); the running jobs ended on attempts "
        f"{carried_on}"
    )
    assert all(status == 503 and retry and code == "service_unavailable" for status, retry, code in answers), answers
    assert completed == len(records), [(job.id, job.status, job.error) for job in records if job.status != "completed"]
    assert all(len(outputs(blobs, job.id)) == 1 for job in records)
    assert all(process.alive for process in crew)
    # their heartbeats failed for a few seconds of a 10 s lease: the attempts went on (`Heartbeat.send`)
    assert carried_on == [1, 1], [requeues(jobs, job_id) for job_id in running]


# -- 3. S3 outage --------------------------------------------------------------------------------------------------


def test_a_storage_outage_during_download_and_upload_is_waited_out(stack, api, reaper, jobs, blobs, clips, workers):
    lease_s = 4  # the workers' own, shorter than the module's: the outage outlasts it sooner
    crew = [workers(VSRQ_LEASE_S=str(lease_s)) for _ in range(2)]  # started together: a start takes seconds of CPU
    for process in crew:
        started(process)
    upload_job = create(api, clips["long"])
    running = wait_until(jobs, upload_job, lambda job: job.stage == "upscaling")  # its input is downloaded
    spare = next(process for process in crew if process is not holder(running, crew))
    spare.pause()  # the idle one: it takes the next job, and downloads its input, only once storage is down
    download_job = create(api, clips["small"])

    stack.stop_service("weed")
    down_at = time.monotonic()
    try:
        spare.resume()
        wait_until(jobs, upload_job, lambda job: job.stage == "uploading")
        wait_until(jobs, download_job, lambda job: job.stage == "probing")
        time.sleep(lease_s + 1)  # both transfers now fail and retry for longer than the lease
    finally:
        stack.start_service("weed")
    outage_s = time.monotonic() - down_at

    records = wait_all(jobs, [upload_job, download_job], limit_s=120)
    matches = [content_sha256(api, job.id) == job.output.sha256 for job in records if job.output]
    print(
        f"FIGURE s3_outage: {outage_s:.1f} s down during an upload and a download (lease {lease_s} s); completed "
        f"{sum(job.status == Status.COMPLETED for job in records)}/2, attempts {[job.attempt for job in records]}, "
        f"output sha256 matches the recorded one {sum(matches)}/2"
    )
    assert [job.status for job in records] == [Status.COMPLETED] * 2, [job.error for job in records]
    # waited out inside the attempt, not retried from scratch (the events say why an attempt ended)
    assert [job.attempt for job in records] == [1, 1], [requeues(jobs, job.id) for job in records]
    assert matches == [True, True]
    assert all(len(outputs(blobs, job.id)) == 1 for job in records)


def test_a_job_deleted_while_storage_is_down_is_deleted_and_its_input_goes_once_storage_is_back(
    stack, env, api, reaper, jobs, blobs, clips
):
    """A user trial: DELETE while blob storage was down removed the record, then answered 503 "retry", and the retry
    got 404 (OpenAI's SDK raised NotFoundError for a delete that had worked); the job's own input stayed in the bucket
    for an unclaimed upload's TTL, a day. Now the delete answers that it deleted the job, and the storage sweep deletes
    the input once storage is back."""
    job_id = create(api, clips["small"])  # no worker runs here: it stays queued
    key = jobs.require(job_id).input.key
    assert blobs.exists(key)
    reaper.pause()  # its sweep (every second here) would race this test's own
    try:
        stack.stop_service("weed")
        try:
            response = requests.delete(f"{api}/v1/videos/{job_id}", headers=AUTH, timeout=60)
        finally:
            stack.start_service("weed")
        deleted = {"id": job_id, "object": "video.deleted", "deleted": True}
        assert (response.status_code, response.json()) == (200, deleted)
        assert requests.get(f"{api}/v1/videos/{job_id}", headers=AUTH, timeout=30).status_code == 404
        assert blobs.exists(key) and key in jobs.doomed_inputs()  # storage was down: left to the sweep
        with mock.patch.dict(os.environ, env):
            report = sweep(jobs, blobs, Settings(_env_file=None))
    finally:
        reaper.resume()
    assert not blobs.exists(key) and key not in jobs.doomed_inputs() and report.uploads_deleted >= 1


def problems(env: dict[str, str]) -> list[str]:
    """What `vsrq status` says is wrong, as /healthz would."""
    return json.loads(vsrq_status(env, "--json").stdout)["health"]["problems"]


def test_a_storage_sweep_that_fails_is_said_in_health(env, logs):
    """A key that may not list: uploads' parts and kept windows were never deleted, and the sweep that "will" failed,
    said only in the reaper's log; /healthz and `vsrq status` said ok. They say it now, until a sweep passes."""
    (logs / "no-list").mkdir()
    env, _ = own_redis_db(env, 8)
    reaper = processes.reaper({**env, **NO_LIST, "VSRQ_SWEEP_INTERVAL_S": "600"}, logs / "no-list").start()
    said = "the storage sweep fails: it refuses this key's listings ("
    try:
        deadline = time.monotonic() + 60
        while not any(said in problem for problem in problems(env)):
            assert time.monotonic() < deadline and reaper.alive, reaper.text()[-2000:]
            time.sleep(0.5)
    finally:
        reaper.stop()
    reaper = processes.reaper({**env, "VSRQ_SWEEP_INTERVAL_S": "600"}, logs / "no-list").start()  # the key mended
    try:
        deadline = time.monotonic() + 60
        while any(said in problem for problem in problems(env)):
            assert time.monotonic() < deadline and reaper.alive, reaper.text()[-2000:]
            time.sleep(0.5)
    finally:
        reaper.stop()


def test_a_job_whose_record_vanished_mid_run_is_dropped_in_a_line(api, jobs, clips, workers):
    """A Redis that evicts keys (allkeys-lru under pressure; /healthz warns of it) took a running job's record: the
    worker logged "raised unexpected: JobNotFound" with a traceback. One line says what happened; the worker goes on."""
    worker = started(workers())
    job_id = create(api, clips["long"])
    wait_until(jobs, job_id, lambda job: job.status == Status.IN_PROGRESS)
    jobs.redis.delete(f"vsrq:job:{job_id}", f"vsrq:job:{job_id}:events")  # evicted
    deadline = time.monotonic() + 60
    while "the job's record is gone from Redis" not in worker.text():
        assert time.monotonic() < deadline and worker.alive, worker.text()[-3000:]
        time.sleep(0.2)
    assert "raised unexpected" not in worker.text() and "Traceback" not in worker.text(), worker.text()[-3000:]
    for key in jobs.redis.keys("vsrq:owner:faults:*"):  # the vanished job's traces in the owner's indexes
        jobs.redis.zrem(key, job_id)
    [after] = wait_all(jobs, [create(api, clips["small"])], limit_s=120)
    assert after.status == Status.COMPLETED and worker.alive


def own_redis_db(env: dict[str, str], db: int) -> tuple[dict[str, str], redis.Redis]:
    """`env` on a Redis database of its own, and a client of it: a reaper there is not this module's (whose passes
    and sweeps write the keys a test looks at)."""
    url = env["VSRQ_REDIS_URL"].rsplit("/", 1)[0] + f"/{db}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    return {**env, "VSRQ_REDIS_URL": url, "VSRQ_BROKER_URL": url}, client


def test_a_sweep_that_storage_holds_up_holds_no_reaping(env, logs, s3_cut):
    """The storage sweep ran between the reaper's passes: expiring a day's jobs took a minute (a trial: 7,000 in 63 s),
    storage that hung held it as long, and meanwhile no lease was reaped, no message sent, and /healthz said the reaper
    was dead. The sweep runs on its own thread: with storage cut for its whole sweep, the passes go on."""
    partition, through = s3_cut
    partition.cut()
    (logs / "sweep-held").mkdir()
    own, store = own_redis_db(env, 7)
    held = {**own, **through, "VSRQ_S3_TIMEOUT_S": "20", "VSRQ_SWEEP_INTERVAL_S": "600"}
    reaper = processes.reaper(held, logs / "sweep-held").start()
    key = "vsrq:reaper:last_pass"
    try:
        deadline = time.monotonic() + 60
        while (first := store.get(key)) is None:  # this reaper's first pass
            assert time.monotonic() < deadline and reaper.alive, reaper.text()[-2000:]
            time.sleep(0.2)
        time.sleep(4)  # the sweep, started after that pass, waits on storage the whole time (20 s a try)
        assert "storage sweep failing" not in reaper.text(), "the sweep ended before the passes were looked at"
        assert float(store.get(key)) - float(first) >= 3, reaper.text()[-2000:]
    finally:
        reaper.stop()


def test_health_names_the_storage_it_waits_on(env, logs, s3_cut):
    """Storage that hangs holds the API's health checks (the network trial of session 53: 90 s). /healthz said only
    "the health checks have not finished for N s", the same for a Redis that hangs; it now says which."""
    partition, through = s3_cut
    port = free_ports(1)[0]
    (logs / "health-held").mkdir()
    server = processes.api({**env, **through, "VSRQ_S3_TIMEOUT_S": "30"}, port, logs / "health-held").start()
    url = f"http://127.0.0.1:{port}"
    try:
        processes.serving(server, url)
        partition.cut()
        deadline = time.monotonic() + 30
        while "storage has not answered" not in (said := requests.get(f"{url}/healthz", timeout=10).text):
            assert time.monotonic() < deadline, said
            time.sleep(0.5)
        assert "the health checks have not finished" in said and "Redis" not in said, said
    finally:
        partition.heal()
        server.stop()


def test_a_storage_partition_longer_than_the_lease_is_waited_out(stack, api, reaper, jobs, blobs, clips, workers):
    # The worker reaches S3 through a partition: cut, its requests go unanswered (not refused) until their timeout,
    # longer than the lease, and no bytes move to call back. Only a beat independent of the transfer keeps the job.
    partition = Partition(("127.0.0.1", stack.ports["s3"]))
    lease_s = 4  # the worker's own, shorter than the module's: each lost request is waited out past it
    timeout_s = lease_s + 2
    s3 = {"VSRQ_S3_ENDPOINT_URL": f"http://127.0.0.1:{partition.port}", "VSRQ_S3_TIMEOUT_S": str(timeout_s)}
    try:
        started(workers(**s3, VSRQ_LEASE_S=str(lease_s)))
        partition.cut()  # the input's download hangs
        job_id = create(api, clips["long"])
        lose_a_request(partition, lease_s)
        wait_until(jobs, job_id, lambda job: job.stage == "upscaling")
        partition.cut()  # its next window upload (or the output's) hangs
        lose_a_request(partition, lease_s)
        job = wait_all(jobs, [job_id], limit_s=180)[0]
    finally:
        partition.close()

    print(
        f"FIGURE s3_partition: a request of the download and one of an upload lost, each caller blocked {timeout_s} s "
        f"(lease {lease_s} s): {job.status} on attempt {job.attempt}"
    )
    assert job.status == Status.COMPLETED, job.error
    assert job.attempt == 1, requeues(jobs, job_id)
    assert content_sha256(api, job_id) == job.output.sha256


def test_an_upload_that_reaches_storage_cut_short_is_sent_again(stack, api, reaper, jobs, blobs, clips, workers):
    """A partition that heals mid-request: the output's PUT loses its head on the way, and SeaweedFS reads its body as
    a request and answers 400 Bad Request, with no S3 error code. The request was damaged, not refused: the worker
    sends the upload again inside the attempt, and the job completes on its first attempt (it was failed for good)."""
    partition = Partition(("127.0.0.1", stack.ports["s3"]))
    try:
        worker = started(workers(VSRQ_S3_ENDPOINT_URL=f"http://127.0.0.1:{partition.port}"))
        partition.swallow_head(f"PUT /{stack.bucket}/outputs/".encode())
        [job] = wait_all(jobs, [create(api, clips["small"])], limit_s=60)
    finally:
        partition.close()
    refused = re.findall(r"a blob transfer failed \((.*)\), tried again", worker.text())
    print(f"FIGURE upload_cut_short: storage answered {refused}; {job.status} on attempt {job.attempt}")
    assert partition.swallowed == 1
    assert (job.status, job.attempt) == (Status.COMPLETED, 1), job.error
    assert any("(400)" in answer and "Bad Request" in answer for answer in refused), worker.text()[-3000:]
    assert content_sha256(api, job.id) == job.output.sha256
    assert outputs(blobs, job.id) == [job.output.key]


def lose_a_request(partition: Partition, lease_s: float) -> None:
    """Once the cut partition drops a request, waits until its caller's lease would have expired without a beat (the
    caller waits out its whole timeout), then heals."""
    dropped, deadline = partition.dropped, time.monotonic() + 120
    while partition.dropped == dropped:
        assert time.monotonic() < deadline, "the worker sent storage nothing while cut off"
        time.sleep(0.05)
    time.sleep(lease_s + 1)
    partition.heal()


def test_a_redis_partition_fails_a_command_and_a_publish_instead_of_hanging(stack):
    # Bytes a middlebox accepted and dropped are never retransmitted: without a socket timeout a heartbeat (or a task
    # message) sent into a partition waits forever, and its worker (or API thread, or reaper) with it.
    partition = Partition(("127.0.0.1", stack.ports["redis"]))
    url = f"redis://127.0.0.1:{partition.port}/0"
    try:
        settings = Settings(_env_file=None, redis_url=url, models={"lanczos": "vsrq.partitioned"}, redis_timeout_s=1)
        store = JobStore(open_redis(settings), result_ttl_s=3600, max_attempts=MAX_ATTEMPTS)
        celery = make_celery(settings)
        assert store.get("video_none") is None  # both connected, through the partition
        celery.send_task(UPSCALE_TASK, args=["video_none"], queue="vsrq.partitioned")
        partition.cut()
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            store.get("video_none")
        command_s = time.monotonic() - started
        started = time.monotonic()
        with pytest.raises(OperationalError):  # after Celery's own publish retries
            celery.send_task(UPSCALE_TASK, args=["video_none"], queue="vsrq.partitioned")
        publish_s = time.monotonic() - started
    finally:
        partition.close()
    print(
        f"FIGURE redis_partition: a command sent into the partition failed after {command_s:.2f} s, a publish after "
        f"{publish_s:.2f} s (timeout 1 s)"
    )
    assert command_s < 5
    assert publish_s < 30


def test_a_worker_cut_off_from_the_job_store_loses_no_message(stack, api, reaper, jobs, clips, workers):
    # Job store and broker on separate connections (VSRQ_BROKER_URL): the worker gets the message, cannot lease its job,
    # and sends the message again, past Celery's default of 3 retries.
    partition = Partition(("127.0.0.1", stack.ports["redis"]))
    store = f"redis://127.0.0.1:{partition.port}/0"
    # each try waits out the Redis timeout three times (redis-py's retries), then its message comes back 2 s later:
    # five tries took 25 s at a 1 s timeout; any timeout shows the message kept
    worker = workers(VSRQ_REDIS_URL=store, VSRQ_BROKER_URL=stack.redis_url, VSRQ_REDIS_TIMEOUT_S="0.5")
    try:
        started(worker)
        partition.cut()
        job_id = create(api, clips["small"])

        def tries() -> int:
            return worker.text().count(f"{job_id} not leased")

        worker.wait_for(lambda: tries() >= 5, "5 lease attempts that timed out", timeout_s=120)
        partition.heal()
        job = wait_all(jobs, [job_id], limit_s=120)[0]
    finally:
        partition.close()
    print(
        f"FIGURE job_store_cut: {tries()} deliveries could not lease the job; after the heal it ended {job.status} "
        f"on attempt {job.attempt}"
    )
    assert job.status == Status.COMPLETED, job.error
    assert "Traceback" not in worker.text()  # a line per failure that says what happened, no stack dumps
    # the worker's own tries kept the message: the reaper, which would send a lost one again, never had to
    assert [line for line in reaper.text().splitlines() if job_id in line and ("sent" in line or "expired" in line)] == []


def test_a_lease_whose_reply_is_lost_is_taken_over_by_the_message_sent_again(stack, api, reaper, jobs, clips, workers):
    # The lease reaches Redis and its reply does not: the job is in progress under a lease its worker never saw.
    # The message sent again carries that try's token and takes the attempt over, instead of the job waiting out
    # its lease and starting again as attempt 2 (without the takeover it is dropped as "in progress").
    partition = Partition(("127.0.0.1", stack.ports["redis"]))
    store = f"redis://127.0.0.1:{partition.port}/0"
    worker = workers(VSRQ_REDIS_URL=store, VSRQ_BROKER_URL=stack.redis_url, VSRQ_REDIS_TIMEOUT_S="2")
    lease_script = jobs._scripts["lease"]
    jobs.redis.script_load(lease_script.script)  # the worker's EVALSHA finds it: the lease itself is what is cut
    try:
        started(worker)
        partition.cut_replies_after(lease_script.sha.encode())
        job_id = create(api, clips["small"])
        worker.wait_for(lambda: f"{job_id} not leased" in worker.text(), "a lease whose reply was lost", timeout_s=60)
        partition.heal()
        job = wait_all(jobs, [job_id], limit_s=120)[0]
    finally:
        partition.close()
    leased = [event for event in jobs.events(job_id) if event.type == "leased"]
    taken_over = [event for event in leased if "taken_over" in event.detail]
    print(
        f"FIGURE lease_reply_lost: {len(leased)} leases, {len(taken_over)} of them taking over a lost one; the job "
        f"ended {job.status} on attempt {job.attempt}, {job.completed_at - job.created_at:.1f} s after it was created "
        f"(lease {LEASE_S} s)"
    )
    assert job.status == Status.COMPLETED, job.error
    assert job.attempt == 1 and not requeues(jobs, job_id)
    assert taken_over and leased[-1] is taken_over[-1]
    assert f"{job_id} attempt 1 leased after" in worker.text()
    # the tokens travel in a header: a message with an argument more would fail on a worker of the older version
    deliveries = [json.loads(line)["data"] for line in worker.text().splitlines() if f"'{job_id}'" in line]
    deliveries = [data for data in deliveries if data.get("name") == UPSCALE_TASK and "eta" in data]
    assert len(deliveries) >= 2 and all(data["kwargs"] == "{}" for data in deliveries), deliveries


def partitioned_heartbeat(stack: Stack) -> tuple[Partition, Heartbeat]:
    """A job leased for 4 s through a forwarder in front of Redis (timeout 1 s), and its heartbeats every 0.1 s."""
    partition = Partition(("127.0.0.1", stack.ports["redis"]))
    settings = Settings(_env_file=None, redis_url=f"redis://127.0.0.1:{partition.port}/0", redis_timeout_s=1)
    store = JobStore(open_redis(settings), result_ttl_s=3600, max_attempts=MAX_ATTEMPTS)
    job = store.create(owner="erin", model="lanczos", queue="vsrq.beat", params={}, input=InputInfo(key="in", bytes=0))
    return partition, Heartbeat(store.lease(job.id, "test-heartbeat", lease_s=4), every_s=0.1)


def test_a_heartbeat_that_cannot_reach_redis_ends_its_attempt_only_once_the_lease_has_run_out(stack, jobs):
    # A Redis blip must not throw away minutes of GPU work whose lease still holds; once the lease has run out the
    # job may be another attempt's, so the attempt stops.
    partition, beat = partitioned_heartbeat(stack)
    job_id = beat.lease.job_id
    try:
        partition.cut()
        assert beat.send(progress=40, stage="upscaling", force=True) is False  # failed, and the attempt goes on
        partition.heal()
        assert beat.send(force=True) is False
        record = jobs.require(job_id)
        assert (record.status, record.progress, record.stage) == (Status.IN_PROGRESS, 40, "upscaling")  # delivered now

        # Before the attempt completes nothing may stay undelivered nor a cancel be missed: it waits for a beat.
        jobs.cancel(job_id)  # asked while the worker is cut off
        partition.cut()
        assert beat.send(progress=90, force=True) is False  # failed: the flag it knows is the old one
        threading.Timer(0.5, partition.heal).start()
        with pytest.raises(Cancelled):
            beat.settle()
        assert jobs.require(job_id).progress == 90

        partition.cut()
        delivered, failed = time.monotonic(), 0
        with pytest.raises(redis.RedisError):
            while time.monotonic() - delivered < 30:
                beat.send(force=True)
                failed += 1
        outlasted_s = time.monotonic() - delivered
    finally:
        partition.close()
    print(
        f"FIGURE heartbeat_cut: {failed} beats failed before the attempt ended, {outlasted_s:.1f} s after the last one "
        "delivered (lease 4 s)"
    )
    assert failed >= 2 and 3.5 <= outlasted_s < 7


def test_the_engine_never_waits_for_a_heartbeat_sent_into_a_partition(stack):
    # The engine asks `cancelled()` between tiles: a beat it makes due must not hold the GPU for the Redis timeout.
    # Once the lease has run out the attempt still stops, at the engine's next call.
    partition, beat = partitioned_heartbeat(stack)
    calls: list[float] = []
    try:
        partition.cut()
        cut = time.monotonic()
        with pytest.raises(redis.RedisError):
            while time.monotonic() - cut < 30:
                asked = time.monotonic()
                beat.cancelled()
                calls.append(time.monotonic() - asked)
                time.sleep(0.01)  # a tile
        stopped_s = time.monotonic() - cut
    finally:
        partition.close()
    print(
        f"FIGURE heartbeat_engine: {len(calls)} engine calls during the partition, the slowest {max(calls) * 1000:.1f} "
        f"ms (Redis timeout 1 s); the attempt stopped {stopped_s:.1f} s after the cut (lease 4 s)"
    )
    assert max(calls) < 0.2
    assert 3.5 <= stopped_s < 7


# -- 4. a poison job -----------------------------------------------------------------------------------------------


def _raw_windows(folders: list[Path]) -> list[str]:
    """The raw windows under `folders`: none in a directory the worker removes while it is listed."""
    found: list[str] = []
    for folder in folders:
        try:
            found += [path.name for path in folder.rglob("window-*")]
        except FileNotFoundError:
            continue
    return found


def _wrong_redis_password(env: dict[str, str]) -> dict[str, str]:
    host_port = env["VSRQ_REDIS_URL"].split("://", 1)[1]
    return {"VSRQ_REDIS_URL": f"redis://someone:not-the-password@{host_port}",
            "VSRQ_BROKER_URL": env.get("VSRQ_BROKER_URL") or env["VSRQ_REDIS_URL"]}  # fmt: skip


def _redis_user_without_the_stores_keys(env: dict[str, str]) -> dict[str, str]:
    """An ACL user that authenticates and may PING, its keys another application's (`~cache:*`)."""
    user, host_port = "other-app-" + secrets.token_hex(3), env["VSRQ_REDIS_URL"].split("://", 1)[1]
    redis.Redis.from_url(env["VSRQ_REDIS_URL"]).acl_setuser(
        user, enabled=True, passwords=["+its-password"], keys=["cache:*"], commands=["+@all"]
    )
    return {"VSRQ_REDIS_URL": f"redis://{user}:its-password@{host_port}",
            "VSRQ_BROKER_URL": env.get("VSRQ_BROKER_URL") or env["VSRQ_REDIS_URL"]}  # fmt: skip


@pytest.mark.parametrize(
    ("wrong", "said"),
    [
        (lambda env: {"VSRQ_S3_SECRET_KEY": "not-the-store-s-secret"}, ["blob storage refuses", "VSRQ_S3_SECRET_KEY"]),
        (lambda env: READ_ONLY, ["blob storage refuses", "it refuses this key's writes (PutObject, 403)"]),
        (_wrong_redis_password, ["Redis refuses this worker's password or user", "VSRQ_REDIS_URL"]),
        (_redis_user_without_the_stores_keys, ["refuses this worker's user the scripts or keys it needs", "ACL"]),
    ],
    ids=["storage", "storage-read-only", "redis", "redis-acl"],
)
def test_a_worker_that_storage_or_redis_refuses_takes_no_job(wrong, said, env, api, jobs, clips, logs):
    """A worker whose S3 secret is not the store's (a key rotation half done) started, registered, looked healthy and
    failed each job it took as internal_error within milliseconds: 31 queued jobs lost in 12 s, a healthy worker
    beside it losing the race for almost every one. One whose Redis password or user is not the store's leased
    nothing, each message it took sent back to the broker every 2 s while it looked healthy. Neither starts now; the
    job waits for a worker storage and Redis take."""
    job_id = create(api, clips["small"])
    refused = processes.worker({**env, **wrong(env)}, QUEUE, logs).start()
    deadline = time.monotonic() + 120
    while refused.alive:
        assert time.monotonic() < deadline, refused.text()[-2000:]
        time.sleep(0.2)
    assert refused.exit_status == EX_CONFIG, refused.text()[-2000:]
    assert all(words in refused.text() for words in said), refused.text()[-2000:]
    job = jobs.require(job_id)
    assert (job.status, job.attempt) == (Status.QUEUED, 0), job
    worker = started(processes.worker(env, QUEUE, logs).start())
    try:
        [done] = wait_all(jobs, [job_id], limit_s=120)
        assert (done.status, done.attempt) == (Status.COMPLETED, 1), done
    finally:
        worker.stop()


def test_an_api_whose_storage_key_may_not_write_answers_503_and_the_operator_is_told_why(env, clips, logs):
    """A key whose policy lacks PutObject: every create answered 500 `internal_error` ("something went wrong on our
    side"), and /healthz and `vsrq status` said ok. Now a create is 503 `storage_refused` with Retry-After, the API's
    log and the detailed health name the refusal, and so does `vsrq status` (each writes and deletes an object)."""
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    refused = {**env, **READ_ONLY}
    (logs / "read-only").mkdir()
    server = processes.api(refused, port, logs / "read-only").start()
    try:
        serving(server, url)
        files = {"video_reference": ("clip.mp4", clips["small"], "video/mp4")}
        made = requests.post(f"{url}/v1/videos", data={"model": "lanczos"}, files=files, headers=AUTH, timeout=60)
        assert (made.status_code, made.json()["code"]) == (503, "storage_refused"), made.text
        assert int(made.headers["Retry-After"]) > 0 and "Traceback" not in made.text
        said = "it refuses this key's writes (PutObject, 403)"
        assert said in server.text(), server.text()[-3000:]
        detail = requests.get(f"{url}/v1/health", headers=AUTH, timeout=30).json()
        assert said in " ".join(detail["problems"]), detail
        status = subprocess.run([sys.executable, "-m", "client.cli", "status"], env={**os.environ, **refused},
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert f"storage: {said}" in status.stdout, (status.stdout, status.stderr)
    finally:
        server.stop()


def test_a_job_from_a_newer_api_goes_back_rather_than_run_without_what_it_asks(env, api, jobs, clips, logs):
    """A rolling deploy, the API first: a worker older than a field a job asked for (`background`, field-rate
    `deinterlace`) ran it as if unset, completed, its record claiming the setting. The record says what the caller set
    (`asks`); a worker that does not know one of those gives the job back, uncounted, to wait for a newer worker."""
    plain, white, stale = (create(api, clips["small"], **fields) for fields in ({}, {"background": "#FFFFFF"}, {}))
    assert jobs.require(plain).asks == ["seed", "sr_resolution_scale"]  # what the caller set, at other than defaults
    assert jobs.require(white).asks == ["background", "seed", "sr_resolution_scale"]
    # the records a newer API writes for a field this worker does not have; one given back so for an hour already
    for job_id in (white, stale):
        params = {**json.loads(jobs.redis.hget(f"vsrq:job:{job_id}", "params")), "sharpen": "strong"}
        asks = json.dumps(["background", "sharpen"])
        jobs.redis.hset(f"vsrq:job:{job_id}", mapping={"params": json.dumps(params), "asks": asks})
    reason = {"code": "worker_outdated", "message": "The worker that took the job is older than the API"}
    given_back = JobEvent(type="requeued", at=time.time(), attempt=1, status=Status.QUEUED, detail={"reason": reason})
    jobs.redis.rpush(f"vsrq:job:{stale}:events", *[given_back.model_dump_json()] * OUTDATED_TRIES)
    record = f"vsrq:job:{white}"
    worker = started(processes.worker(env, QUEUE, logs).start())
    try:
        [done] = wait_all(jobs, [plain], limit_s=120)
        assert done.status == Status.COMPLETED
        deadline = time.monotonic() + 60
        while not (requeued := [event for event in jobs.events(white) if event.type == "requeued"]):
            assert time.monotonic() < deadline, jobs.events(white)
            time.sleep(0.2)
        reason = requeued[0].detail["reason"]
        assert reason["code"] == "worker_outdated" and "`sharpen`" in reason["message"], requeued
        assert requeued[0].detail["retry_in_s"] == 30  # out of line a while: taken at once, it would come back here
        job = jobs.require(white)
        assert (job.status, job.output, jobs.redis.hget(record, "excused")) == (Status.QUEUED, None, b"1"), job
        assert "deploy workers before the API" in worker.text()
        # given back so for an hour (a fleet left on an older image): it fails, saying what to do, rather than loop
        failed = wait_until(jobs, stale, ended, limit_s=60)
        assert (failed.status, failed.error.code) == (Status.FAILED, "worker_outdated"), failed
        assert "deploy workers that do" in failed.error.message
    finally:
        worker.stop()


def test_an_input_longer_than_the_operators_limit_fails_naming_it(workers, api, jobs, clips):
    """The input's length was bound at an hour that no setting changed (README said `VSRQ_WORKER_*` bound it): a
    feature film could never run, a short limit never be set. `VSRQ_MAX_INPUT_SECONDS` sets it for the service."""
    started(workers(VSRQ_MAX_INPUT_SECONDS="1"))
    short, long = create(api, clips["small"]), create(api, clips["long"])  # 17 and 181 frames at 30 fps
    done, refused = wait_all(jobs, [short, long], limit_s=120)
    assert done.status == Status.COMPLETED, done
    assert (refused.status, refused.error.code) == (Status.FAILED, "input_too_large"), refused
    assert "the limit is 1 s" in refused.error.message, refused.error


def test_an_operator_lifts_a_limit_by_setting_it_unlimited(jobs, monkeypatch, tmp_path):
    """A limit that None lifts (README: "None: unlimited") could not be lifted: `VSRQ_MAX_INPUT_SECONDS` took only
    a number, and `none` or an empty value failed the settings. `unlimited` lifts it: a 3,700 s lecture at 1 fps runs"""
    lecture = write_clip(tmp_path / "lecture.mp4", 3700, (16, 16), Fraction(1), video_options={"preset": "ultrafast"})
    job = jobs.create(owner="o", model="lanczos", queue="q", params={}, input=InputInfo(key="uploads/o/x", bytes=1))
    service.settings.cache_clear()  # the worker reads its settings once
    with pytest.raises(InputTooLarge, match="the limit is 3600 s"):
        probe(lecture, job_limits(job))
    for name in ("VSRQ_MAX_INPUT_SECONDS", "VSRQ_MAX_OUTPUT_MEGAPIXEL_FRAMES", "VSRQ_MEGAPIXEL_FRAMES_PER_HOUR"):
        monkeypatch.setenv(name, "unlimited")
    service.settings.cache_clear()
    try:
        assert service.settings().compute_limits(job.owner)[1:] == (None, None)
        assert probe(lecture, job_limits(job)).video.frames == 3700
    finally:
        monkeypatch.undo()
        service.settings.cache_clear()


def test_a_job_that_kills_its_worker_fails_after_max_attempts(env, api, reaper, jobs, blobs, clips, logs, tmp_path):
    # A valid 1080p clip at x4: lanczos holds frames of 7680x4320 that no 1 GiB-bounded worker can, so the memory
    # limit kills the worker on every attempt, as a container's OOM killer would.
    lease_s = 4  # the workers' own, shorter than the module's: each killed attempt is found when its lease runs out
    memory = MemoryLimit()
    worker_env = {**env, "VSRQ_LEASE_S": str(lease_s)}
    supervisor = Supervisor(lambda: processes.worker(worker_env, QUEUE, logs), on_start=memory.watch)
    try:
        # written while the worker starts; 3 frames, x264's fastest preset (9 frames took 6-17 s of CPU): the first
        # frame's 7680x4320 float channels are past the limit already (lanczos resamples frame by frame)
        fastest = {"preset": "ultrafast"}
        poison_clip = write_clip(tmp_path / "1080p.mp4", 3, (1080, 1920), crf=35, video_options=fastest).read_bytes()
        memory.limit_bytes = psutil.Process(started(supervisor.current).pid).memory_info().rss + 1024**3  # idle + 1 GiB
        poison = create(api, poison_clip, sr_resolution_scale="4")
        others = [create(api, clips["small"]) for _ in range(3)]
        records = wait_all(jobs, [poison, *others], limit_s=300)
        time.sleep(lease_s)  # a requeue or a redelivery would show by now (the reaper runs every 0.5 s)
        job = jobs.require(poison)
        attempts = len(leases(jobs, poison))
        waiting = redis.Redis.from_url(env["VSRQ_REDIS_URL"]).llen(QUEUE)
        print(
            f"FIGURE poison_job: {job.status} with {job.error.code if job.error else None} after {attempts} attempts "
            f"(max {MAX_ATTEMPTS}); workers killed by the memory limit {len(memory.kills)}; other jobs completed "
            f"{sum(r.status == Status.COMPLETED for r in records[1:])}/{len(others)}; messages left queued {waiting}"
        )
        assert (job.status, job.error.code) == (Status.FAILED, "lease_expired"), job
        assert "stopped sending heartbeats" in job.error.message and "Traceback" not in job.error.message
        assert attempts == job.attempt == MAX_ATTEMPTS and len(memory.kills) == MAX_ATTEMPTS
        assert outputs(blobs, poison) == []
        assert all(r.status == Status.COMPLETED for r in records[1:]), records[1:]
        assert waiting == 0
    finally:
        supervisor.stop_watching()
        stop_idle(jobs, supervisor.history)
        memory.stop()


# -- 5. cancellation -----------------------------------------------------------------------------------------------


def test_cancel_at_every_stage(stack, api, reaper, jobs, blobs, clips, workers):
    started(workers())
    latencies: dict[str, float] = {}

    def cancel(job_id: str, stage: str) -> None:
        asked = time.monotonic()
        response = requests.post(f"{api}/v1/videos/{job_id}/cancel", headers=AUTH, timeout=30)
        assert response.status_code == 200, response.text
        wait_until(jobs, job_id, ended, limit_s=30)
        latencies[stage] = time.monotonic() - asked

    def when(job_id: str, stage: str) -> bool:
        job = wait_until(jobs, job_id, lambda job: job.stage == stage or ended(job))
        return job.stage == stage

    long_job = create(api, clips["long"])
    assert when(long_job, "upscaling")
    queued_job = create(api, clips["small"])  # behind the running one
    cancel(queued_job, "queued")
    cancel(long_job, "upscaling")

    # encoding lasts from the end of the last window to the upload: caught by polling, so tried a few times
    for _ in range(4):
        job_id = create(api, clips["long"])
        if when(job_id, "encoding"):
            cancel(job_id, "encoding")
            break
        wait_until(jobs, job_id, ended)

    # the upload and the download are held where they are by a storage outage (the medium clip's whole attempt can
    # take 0.3 s: too short to stop storage in between)
    upload_job = create(api, clips["long"])
    download_job = create(api, clips["small"])
    assert when(upload_job, "upscaling")
    stack.stop_service("weed")
    try:
        assert when(upload_job, "uploading")
        cancel(upload_job, "uploading")
        assert when(download_job, "probing")
        cancel(download_job, "probing")
    finally:
        stack.start_service("weed")
    next_job = create(api, clips["small"])
    last = wait_all(jobs, [next_job], limit_s=120)[0]

    cancelled = [queued_job, long_job, upload_job, download_job]
    records = [jobs.require(job_id) for job_id in cancelled]
    running = [seconds for stage, seconds in latencies.items() if stage != "queued"]
    print(
        "FIGURE cancellation: seconds from request to cancelled "
        + ", ".join(f"{stage} {seconds:.2f}" for stage, seconds in latencies.items())
        + f"; p95 while running {p95(running):.2f} s; outputs kept {sum(len(outputs(blobs, i)) for i in cancelled)};"
        f" next job {last.status}"
    )
    assert set(latencies) == {"queued", "upscaling", "encoding", "uploading", "probing"}, latencies
    assert all(job.status == Status.CANCELLED and job.output is None for job in records), records
    assert all(outputs(blobs, job_id) == [] for job_id in cancelled)
    assert p95(running) <= 2.0, latencies
    assert last.status == Status.COMPLETED


# -- 6. duplicate delivery -----------------------------------------------------------------------------------------


def test_a_redelivered_message_and_a_stalled_worker_give_one_execution_and_one_output(
    api, reaper, jobs, blobs, clips, workers
):
    # Celery's real redelivery: an unacknowledged message goes back to the queue after the visibility timeout (here
    # 2 s, swept every second) while its first worker still holds it.
    redelivery = json.dumps({"visibility_timeout": 2, "unacked_restore_interval": 1, "unacked_restore_throttle": 1})
    # the workers' lease shorter than the module's: the stalled worker loses the job sooner, still past the redelivery
    crew = [workers(VSRQ_BROKER_TRANSPORT_OPTIONS=redelivery, VSRQ_LEASE_S="4") for _ in range(2)]
    for process in crew:
        started(process)
    job_id = create(api, clips["long"])
    job = wait_until(jobs, job_id, lambda job: job.stage == "upscaling")
    first = holder(job, crew)
    other = next(process for process in crew if process is not first)

    def dropped() -> int:  # copies of the message that a worker took and the lease refused
        return sum(process.text().count(f"dropped a message for {job_id}") for process in crew)

    first.pause()  # stalled (a GC pause, a frozen VM): its lease runs out, the reaper hands the job to another attempt
    try:
        wait_until(jobs, job_id, lambda job: job.attempt == 2 and job.status == Status.IN_PROGRESS, limit_s=60)
        # meanwhile its message, unacknowledged past the visibility timeout, is sent again: the other worker takes it
        # when it next reads its queue (under load, once attempt 2 is done). Woken before, the stalled worker would
        # acknowledge it first and leave nothing to redeliver.
        first.wait_for(lambda: dropped() >= 1, "the redelivered message's drop", 120)
    finally:
        first.resume()  # and now it wakes up, still running attempt 1
    done = wait_all(jobs, [job_id], limit_s=120)[0]
    first.wait_for(lambda: "lost the job" in first.text(), "the stale attempt's stop", 30)  # at its next heartbeat
    print(
        f"FIGURE duplicate_delivery: executions {len(leases(jobs, job_id))} (attempt {done.attempt} won), "
        f"redelivered messages dropped {dropped()}, outputs {len(outputs(blobs, job_id))}, "
        f"stale attempt stopped: {'lost the job' in first.text()}"
    )
    assert (done.status, done.attempt) == (Status.COMPLETED, 2)
    assert outputs(blobs, job_id) == [done.output.key] and "/attempt-2-" in done.output.key
    assert "lost the job" in first.text()


# -- 7. the API killed between the upload and the enqueue ----------------------------------------------------------


def test_an_api_killed_between_upload_and_enqueue_leaves_no_job_without_input_nor_an_orphan(
    stack, env, logs, reaper, jobs, blobs, clips, workers
):
    started(workers())
    # The API reaches the broker through a partition it can be cut off by, and its job store directly: its message
    # can be lost on its own.
    partition = Partition(("127.0.0.1", stack.ports["redis"]))
    api_env = {**env, "VSRQ_BROKER_URL": f"redis://127.0.0.1:{partition.port}/0"}
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    server = serving(processes.api(api_env, port, logs).start(), url)
    try:
        # 1. killed after it stored the upload, before the job exists: the form's file part is sent whole, then
        #    fields, more than one read of the server's (256 KiB) past the file, but never the form's last bytes
        before = set(blobs.keys("uploads/faults/"))
        boundary = "faults-boundary"
        parts = [
            f'--{boundary}\r\nContent-Disposition: form-data; name="video_reference"; filename="clip.mp4"\r\n'
            "Content-Type: video/mp4\r\n\r\n".encode() + clips["small"] + b"\r\n",
            *(
                f'--{boundary}\r\nContent-Disposition: form-data; name="pad{i}"\r\n\r\n{"x" * 60_000}\r\n'.encode()
                for i in range(6)
            ),
            f"--{boundary}--\r\n".encode(),
        ]
        body = b"".join(parts)
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(
            f"POST /v1/videos HTTP/1.1\r\nHost: {url[7:]}\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(body)}"
            "\r\n\r\n".encode() + body[:-64]
        )
        deadline = time.monotonic() + 60
        while not (orphans := set(blobs.keys("uploads/faults/")) - before):
            assert time.monotonic() < deadline, "the upload was never stored"
            time.sleep(0.05)
        server.kill()
        client.close()
        stored_at = time.monotonic()

        # 2. killed while it enqueues: the record is written, the message never reaches the broker
        server = serving(processes.api(api_env, port, logs).start(), url)
        newest = jobs.page("faults", limit=1).jobs
        partition.cut()
        threading.Thread(target=lambda: _post_quietly(url, clips["small"]), daemon=True).start()
        deadline = time.monotonic() + 60
        while (page := jobs.page("faults", limit=1).jobs) == newest or not page:
            assert time.monotonic() < deadline, "the job record was never written"
            time.sleep(0.05)
        time.sleep(0.5)  # well inside the enqueue, which waits on a broker that never answers
        server.kill()
        unsent = page[0].id

        job = wait_all(jobs, [unsent], limit_s=120)[0]
        deadline = time.monotonic() + UPLOAD_TTL_S + 60
        while orphans & set(blobs.keys("uploads/faults/")):
            assert time.monotonic() < deadline, f"orphaned uploads kept: {orphans}"
            time.sleep(0.2)
        swept_after = time.monotonic() - stored_at
        # every job of the key names an input that exists, or has ended
        live = [j for j in jobs.page("faults", limit=100).jobs if j.status not in TERMINAL]
        without_input = [j.id for j in live if not blobs.exists(j.input.key)]
        print(
            f"FIGURE api_crash: job recorded but never enqueued -> {job.status} (attempt {job.attempt}); orphaned "
            f"upload deleted {swept_after:.1f} s after it was stored (TTL {UPLOAD_TTL_S} s); live jobs without their "
            f"input {len(without_input)}"
        )
        assert job.status == Status.COMPLETED, job
        assert without_input == []
        assert swept_after <= UPLOAD_TTL_S + 30
    finally:
        server.stop()
        partition.close()


def _post_quietly(url: str, clip: bytes) -> None:
    """A create whose API dies under it: the connection error is the expected end."""
    try:
        requests.post(
            f"{url}/v1/videos",
            data={"model": "lanczos"},
            files={"video_reference": ("clip.mp4", clip, "video/mp4")},
            headers=AUTH,
            timeout=120,
        )
    except requests.ConnectionError:
        pass


# -- 8. one job's tail overlapped with the next job (worker.finisher) ----------------------------------------------


HEAD_STEPS = ("fetched", "windows_kept", "probed", "writer_open", "first_window_decoded")  # in the order they run
# as they start: the output's upload beside `verify`, `kept_join` and the previews (`verify_upload`: the pair's span)
TAIL_STEPS = (
    "flush", "uploading_beat", "upload", "verify_upload", "verify", "kept_join", "previews", "upload_previews", "settle"
)  # fmt: skip


def run_detail(jobs: JobStore, job_id: str) -> dict:
    """The completing attempt's `run` event: engine seconds, and whether its tail ran on the finisher's thread."""
    return [event.detail for event in jobs.events(job_id) if event.type == "run"][-1]


@pytest.fixture
def s3_cut(stack: Stack) -> Iterator[tuple[Partition, dict[str, str]]]:
    """A partition in front of storage, and the settings of a worker that reaches storage through it (a request that
    gets no answer times out in 1 s, then the worker tries again, its lease kept alive)."""
    partition = Partition(("127.0.0.1", stack.ports["s3"]))
    yield partition, {"VSRQ_S3_ENDPOINT_URL": f"http://127.0.0.1:{partition.port}", "VSRQ_S3_TIMEOUT_S": "1"}
    partition.close()


def hold_a_tail(api: str, jobs: JobStore, partition: Partition, clips, worker: Process) -> tuple[str, str]:
    """A job and a short one behind it on `worker`; storage is cut once the first job's engine is done, so that its
    tail waits on its upload. Returns (first, short) once `worker` has leased the short one meanwhile: the tail is in
    flight, its task returned and its message was acknowledged. The caller heals the partition."""
    for _ in range(3):  # the encoder's flush comes before the upload: a fraction of a second to cut storage in,
        # which a busy machine can miss
        tailing, following = create(api, clips["medium"]), create(api, clips["small"])
        held = wait_until(jobs, tailing, lambda job: job.stage in ("encoding", "uploading") or ended(job))
        partition.cut()
        if held.stage == "encoding":
            break
        partition.heal()
        wait_all(jobs, [tailing, following], limit_s=60)
    else:
        raise AssertionError("never caught a tail before its upload")
    wait_until(jobs, tailing, lambda job: job.stage == "uploading")
    wait_until(jobs, following, lambda job: job.status == Status.IN_PROGRESS and holder(job, [worker]) is worker)
    assert jobs.require(tailing).stage == "uploading"
    return tailing, following


def test_a_queue_runs_with_each_tail_overlapped_by_the_next_job(api, reaper, jobs, blobs, clips, workers):
    """Queued jobs on one worker: each next job is leased (and its engine started) before the previous one completed,
    and the outputs are the bytes a worker that runs its tails inline writes."""
    inline = started(workers(VSRQ_WORKER_OVERLAP_TAIL="false"))
    reference_id = create(api, clips["medium"])
    wait_until(jobs, reference_id, lambda job: job.status != Status.QUEUED)  # taken by the inline worker
    overlapping = workers()  # the default: tails overlapped; it starts while the reference runs (no message is left)
    [reference] = wait_all(jobs, [reference_id], limit_s=120)
    stop_idle(jobs, [inline])
    started(overlapping)
    ids = [create(api, clips["medium"]) for _ in range(4)]
    records = wait_all(jobs, ids, limit_s=120)
    ordered = sorted(ids, key=lambda job_id: leases(jobs, job_id)[0])
    ahead = [first_event(jobs, b, "leased") - first_event(jobs, a, "completed") for a, b in zip(ordered, ordered[1:])]
    tails = [run_detail(jobs, job_id)["tail"] for job_id in ids]
    print(
        f"FIGURE overlapped_tails: {len(ids)} jobs, next job leased before the previous completed by "
        f"{[round(-s, 3) for s in ahead]} s; tails {tails}; outputs identical to an inline tail's "
        f"{sum(job.output.sha256 == reference.output.sha256 for job in records)}/{len(ids)}"
    )
    print(f"FIGURE tail_steps: {[run_detail(jobs, job_id)['tail_s'] for job_id in [reference.id, *ids]]}")
    assert run_detail(jobs, reference.id)["tail"] == "inline"
    assert all(job.status == Status.COMPLETED and job.attempt == 1 for job in records), records
    assert tails == ["overlapped"] * len(ids)
    assert sum(seconds < 0 for seconds in ahead) >= len(ahead) - 1, ahead  # leased while the tail ran
    for job_id in ids:  # where each head went, step by step, up to the engine's first call
        run = run_detail(jobs, job_id)
        steps = [run["head_s"][step] for step in HEAD_STEPS]
        assert 0 <= steps[0] and steps == sorted(steps) and steps[-1] <= run["engine_span_s"][1], run
        assert 0 <= run["turn_waited_s"] <= run["upscale_s"], run
        assert set(run["tail_s"]) == set(TAIL_STEPS) and all(s >= 0 for s in run["tail_s"].values()), run
    assert all(job.output.sha256 == reference.output.sha256 for job in records)
    assert all(outputs(blobs, job_id) == [jobs.require(job_id).output.key] for job_id in ids)


def test_a_worker_killed_during_a_tail_loses_no_job_and_leaves_one_output(
    stack, env, api, reaper, jobs, blobs, clips, logs, s3_cut, tmp_path
):
    """Killed with a tail in flight, held on its output's upload (its message already acknowledged), and the next
    job leased: the reaper requeues both once their leases run out, a new worker completes each once. The held tail
    keeps no raw windows on the worker's disk once they are kept (only its input and MP4): the new attempt replays
    them from blob storage."""
    partition, s3 = s3_cut
    lease_s = 4
    scratch = tmp_path / "scratch"  # the workers' temporary directory, where each job's scratch directory goes
    scratch.mkdir()
    windows = {"VSRQ_WORKER_WINDOW": "9", "VSRQ_WORKER_WINDOW_OVERLAP": "4"}  # several, kept before storage is cut
    settings = {**env, **s3, **windows, "VSRQ_LEASE_S": str(lease_s), "TMPDIR": str(scratch)}
    supervisor = Supervisor(lambda: processes.worker(settings, QUEUE, logs))
    try:
        first = started(supervisor.current)
        tailing = create(api, clips["medium"])
        upload = f"PUT /{stack.bucket}/outputs/{tailing}/".encode()  # its output's, not its kept windows'
        partition.hold(upload)
        try:
            following = create(api, clips["small"])
            deadline = time.monotonic() + 120
            while not partition.held:  # the tail waits on its output's upload; its kept windows' go on
                assert time.monotonic() < deadline and not ended(jobs.require(tailing)), "the upload was never held"
                time.sleep(0.05)
            wait_until(jobs, following, lambda job: job.status == Status.IN_PROGRESS and holder(job, [first]) is first)
            # the tail's scratch: the one with an MP4 (under its hidden name until its check, beside the held upload,
            # puts it in place) and the medium clip's input (the next job's is the small one's); its raw windows go
            # once they are kept
            held = [
                path.parent for path in scratch.glob("vsrq-*/*output.mp4*")
                if (path.parent / "input").exists() and (path.parent / "input").stat().st_size == len(clips["medium"])
            ]  # fmt: skip
            while (raw := _raw_windows(held)) and not ended(jobs.require(tailing)):
                assert time.monotonic() < deadline, raw
                time.sleep(0.05)
            scratch_held = len(held) == 1 and (held[0] / "input").exists()
            first.kill()
            kept = sum(key.endswith(".json") and "window-" in key for key in blobs.keys(f"work/{tailing}/windows/"))
            killed_at = time.time()
        finally:
            partition.release(upload)
        records = wait_all(jobs, [tailing, following], limit_s=120)
        resumed = [leases(jobs, job_id)[-1] - killed_at for job_id in (tailing, following)]
        # the killed worker's scratch (its lock file held by nobody) went with the next job made beside it
        assert scratch_held and raw == [] and not held[0].exists(), (held, raw)
        pattern = re.compile(rf"{tailing} completed by attempt 2: .*?(\d+) of (\d+) windows restored")
        deadline = time.monotonic() + 30  # the worker logs its line just after the completion the test saw
        while not (replayed := pattern.search(supervisor.current.text())) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert replayed, supervisor.current.text()[-3000:]
        print(
            f"FIGURE killed_in_a_tail: {[job.status.value for job in records]} on attempts "
            f"{[job.attempt for job in records]}, kill -> next attempt {[round(s, 1) for s in resumed]} s "
            f"(lease {lease_s} s), outputs {[len(outputs(blobs, job.id)) for job in records]}; raw windows in the "
            f"held tail's scratch {raw}, replayed from blob storage {replayed[1]} of {replayed[2]} windows"
        )
        assert kept and int(replayed[1]) == kept  # each window kept in blob storage before the kill, replayed
        assert [(job.status, job.attempt) for job in records] == [(Status.COMPLETED, 2)] * 2, records
        assert [requeues(jobs, job_id)[0]["reason"]["code"] for job_id in (tailing, following)] == ["lease_expired"] * 2
        for job in records:  # one output, the last attempt's
            assert outputs(blobs, job.id) == [job.output.key] and "/attempt-2-" in job.output.key
    finally:
        supervisor.stop_watching()
        stop_idle(jobs, supervisor.history)


def test_a_cancel_during_a_tail_ends_the_job_and_the_next_one_completes(
    api, reaper, jobs, blobs, clips, workers, s3_cut
):
    """A cancel while the tail's output upload gets no answer (storage cut, as a paused SeaweedFS leaves it) and
    botocore's tries of it take long (`s3_timeout_s` 3: 3 tries, 12 s and more): the job is cancelled within a couple
    of heartbeats, as in an inline tail, not once those tries have ended (7.3 s with 1 s tries, 18.2 s with 5 s ones,
    when the tail waited for them); the job behind it completes at its first attempt, and nothing is left under the
    job's outputs, then or once the stopped upload's tries are over (storage healed: the next one lands)."""
    partition, s3 = s3_cut
    timeout_s = 3  # its tries (12 s) well past the 5 s the cancel is allowed; the test then waits them out
    worker = started(workers(**{**s3, "VSRQ_S3_TIMEOUT_S": str(timeout_s)}))
    try:
        tailing, following = hold_a_tail(api, jobs, partition, clips, worker)
        asked = time.monotonic()
        response = requests.post(f"{api}/v1/videos/{tailing}/cancel", headers=AUTH, timeout=30)
        assert response.status_code == 200, response.text
        cancelled = wait_until(jobs, tailing, ended, limit_s=60)
        latency = time.monotonic() - asked
    finally:
        partition.heal()
    [done] = wait_all(jobs, [following], limit_s=120)
    cancelled_left = outputs(blobs, tailing)
    time.sleep(max(0.0, asked + 3 * (timeout_s + 1) + 2 - time.monotonic()))  # the stopped upload's tries are over
    left = outputs(blobs, tailing)
    print(f"FIGURE cancel_in_a_tail: {cancelled.status} {latency:.2f} s after the request; next job {done.status}")
    assert cancelled.status == Status.CANCELLED and cancelled.output is None and latency <= 5, latency
    assert cancelled_left == left == []
    assert (done.status, done.attempt) == (Status.COMPLETED, 1)


def test_a_stalled_tail_that_lost_its_lease_promotes_nothing(api, reaper, jobs, blobs, clips, workers, s3_cut):
    """A worker paused with a tail in flight loses both of its jobs to another worker; woken up, its tail uploads,
    but its fenced `complete` is refused: one output per job, the new attempt's."""
    partition, s3 = s3_cut
    first = started(workers(**s3, VSRQ_LEASE_S="4"))
    try:
        tailing, following = hold_a_tail(api, jobs, partition, clips, first)
        first.pause()
        partition.heal()
        started(workers())
        records = wait_all(jobs, [tailing, following], limit_s=120)
    finally:
        partition.heal()
        first.resume()
    deadline = time.monotonic() + 30
    while first.text().count("lost the job") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    lost = first.text().count("lost the job")
    print(
        f"FIGURE stalled_tail: {[(job.status.value, job.attempt) for job in records]}, stale attempts stopped {lost}, "
        f"outputs {[outputs(blobs, job.id) == [job.output.key] for job in records]}"
    )
    assert [(job.status, job.attempt) for job in records] == [(Status.COMPLETED, 2)] * 2, records
    assert lost == 2, first.text()[-3000:]
    for job in records:
        assert outputs(blobs, job.id) == [job.output.key] and "/attempt-2-" in job.output.key


def test_a_warm_shutdown_finishes_the_tail_in_flight(stack, api, reaper, jobs, blobs, clips, workers, s3_cut):
    """SIGTERM (a deploy, a scale-in) with a tail in flight: the worker finishes it, and the job it had started, before
    it exits; nothing waits out a lease. Until then it stays in the worker registry: a reaper takes back the jobs of
    a worker gone from it (worker.gone)."""
    partition, s3 = s3_cut
    worker = started(workers(**s3))
    tailing, following = create(api, clips["medium"]), create(api, clips["small"])
    upload = f"PUT /{stack.bucket}/outputs/{tailing}/".encode()
    partition.hold(upload)  # the first job's output waits: its tail is in flight until released
    try:
        wait_until(jobs, tailing, lambda job: job.stage == "uploading")
        wait_until(jobs, following, lambda job: job.status == Status.IN_PROGRESS and holder(job, [worker]) is worker)
        os.kill(worker.pid, signal.SIGTERM)
        worker.wait_for(lambda: "waiting for the last job's tail" in worker.text(), "its shutdown waiting", 60)
        assert WorkerRegistry(jobs.redis).get(f"{worker.name}@localhost") is not None
    finally:
        partition.release(upload)
    deadline = time.monotonic() + 60
    while worker.alive:
        assert time.monotonic() < deadline, worker.text()[-3000:]
        time.sleep(0.1)
    records = [jobs.require(job_id) for job_id in (tailing, following)]
    print(f"FIGURE warm_shutdown_in_a_tail: {[(job.status.value, job.attempt) for job in records]} when it exited")
    assert [(job.status, job.attempt) for job in records] == [(Status.COMPLETED, 1)] * 2, records


def test_a_stuck_tail_sends_the_next_job_back_and_its_worker_exits(
    stack, env, api, reaper, jobs, blobs, clips, logs, tmp_path
):
    """A tail stuck in a call that never returns (its upload gets no answer, and the client's timeout outlasts the
    test) must not hold the job behind it, its lease renewed, forever. Silent past the lease's length, the tail is
    stuck: the waiting job goes back to the queue, the worker takes no more jobs and exits (status 70) for its
    supervisor to start a new one, which completes both jobs (the stuck one's once its lease ran out): one output
    each. The exiting worker leaves no prefetched input (the next job's, queued behind) on its disk."""
    partition = Partition(("127.0.0.1", stack.ports["s3"]))
    lease_s = 4
    stuck = {
        **env,
        "VSRQ_S3_ENDPOINT_URL": f"http://127.0.0.1:{partition.port}",
        "VSRQ_S3_TIMEOUT_S": "600",
        "VSRQ_LEASE_S": str(lease_s),
        "VSRQ_WORKER_STORAGE_RETRY_S": "1",  # the tail's lease is kept this long into its upload, then runs out
    }
    tailing, following, behind = (create(api, clips[name]) for name in ("medium", "small", "small"))
    partition.hang(f"PUT /{stack.bucket}/outputs/{tailing}/".encode())  # the output's upload
    # each worker its own prefetch root: the next one's sweep of dead workers' caches cannot clean up for the first
    roots = iter(tmp_path / str(n) for n in range(100))
    supervisor = Supervisor(
        lambda: processes.worker({**stuck, "VSRQ_WORKER_PREFETCH_DIR": str(next(roots))}, QUEUE, logs)
    )
    try:
        first = started(supervisor.current)
        records = wait_all(jobs, [tailing, following], limit_s=60)
        last = wait_all(jobs, [behind], limit_s=30)[0]
    finally:
        supervisor.stop_watching()
        stop_idle(jobs, supervisor.history)
        partition.close()
    left = [path.name for path in (tmp_path / "0").glob("*")]
    reasons = [[requeue["reason"]["code"] for requeue in requeues(jobs, job.id)] for job in records]
    print(
        f"FIGURE stuck_tail: {[(job.status.value, job.attempt) for job in records]}, requeued for {reasons}, the "
        f"stuck worker exited with {first.exit_status}, workers started {len(supervisor.history)}, its prefetch "
        f"cache left {left}"
    )
    assert partition.hung == 1
    assert first.exit_status == 70, first.text()[-3000:]
    assert '"reason": "tail_stuck"' in first.text()
    assert f"prefetched the input of {following}" in first.text() and left == [], (left, first.text()[-6000:])
    assert last.status == Status.COMPLETED
    assert [(job.status, job.attempt) for job in records] == [(Status.COMPLETED, 2)] * 2, records
    assert reasons == [["lease_expired"], ["worker_tail_stuck"]]  # the waiting job was sent back, not reaped
    for job in records:
        assert outputs(blobs, job.id) == [job.output.key] and "/attempt-2-" in job.output.key


def test_a_message_behind_a_stuck_tail_goes_to_the_front_and_costs_no_attempt(
    stack, env, api, reaper, jobs, blobs, clips, workers
):
    """Two jobs queued once a tail is stuck (silent past VSRQ_WORKER_TAIL_STALL_S, its lease not yet run out): the
    worker refuses the first message it takes, sends it back to the front of the queue unleased and exits (status 70).
    The next worker runs that job first, then the one queued behind it, each on its first attempt, and the stuck job
    once the reaper requeued it."""
    partition = Partition(("127.0.0.1", stack.ports["s3"]))
    stuck = {
        "VSRQ_S3_ENDPOINT_URL": f"http://127.0.0.1:{partition.port}",
        "VSRQ_S3_TIMEOUT_S": "600",
        "VSRQ_LEASE_S": "12",  # the stuck job stays leased while the next two arrive
        "VSRQ_WORKER_STORAGE_RETRY_S": "1",  # its tail goes silent a second into its upload
        # the idle worker exits two heartbeats and a stall past the stall (worker.tasks._finish_tails): at 2 s, a
        # loaded CI machine's two creates reached it after it had exited
        "VSRQ_WORKER_TAIL_STALL_S": "4",
    }
    tailing = create(api, clips["medium"])
    partition.hang(f"PUT /{stack.bucket}/outputs/{tailing}/".encode())  # the output's upload
    try:
        first = started(workers(**stuck))
        deadline = time.monotonic() + 60
        while partition.hung < 1:
            assert time.monotonic() < deadline, first.text()[-3000:]
            time.sleep(0.05)
        time.sleep(5.5)  # the retry's second, then silent past the stall
        refused, behind = create(api, clips["small"]), create(api, clips["small"])
        first.wait_for(lambda: not first.alive, "the stuck worker's exit", 60)
        started(workers())
        records = wait_all(jobs, [tailing, refused, behind], limit_s=90)
    finally:
        partition.close()
    order = {job.id: leases(jobs, job.id) for job in records}
    print(
        f"FIGURE refused_behind_a_stuck_tail: {[(job.status.value, job.attempt) for job in records]}, the stuck "
        f"worker exited with {first.exit_status}, the refused job leased {order[refused][0] - order[behind][0]:+.2f} s "
        "after the one queued behind it"
    )
    assert first.exit_status == 70, first.text()[-3000:]
    assert f"the message for {refused} goes back to the queue" in first.text()
    assert [(job.status, job.attempt) for job in records] == [
        (Status.COMPLETED, 2), (Status.COMPLETED, 1), (Status.COMPLETED, 1)
    ], records  # fmt: skip
    assert order[refused][0] < order[behind][0]  # at the front, as every job sent back
    assert len(order[refused]) == 1  # never leased by the stuck worker
    assert [requeue["reason"]["code"] for requeue in requeues(jobs, tailing)] == ["lease_expired"]


def test_sound_reencoded_after_the_last_frame_keeps_its_tail_alive(api, reaper, jobs, workers, tmp_path):
    """A second of video with an hour of MP2 sound (within every limit): the sound after the last frame is re-encoded
    to AAC as the encoder flushes, minutes with no heartbeat. The worker took the tail for a stuck one and exited, its
    lease ran out, and after four attempts the job failed `lease_expired`. Here five minutes of sound, seconds to
    re-encode, against a lease of 3 s and a stall limit of 2 s."""
    talk = write_clip(tmp_path / "talk.mkv", 24, (32, 48), audio_codec="mp2", layout="mono", audio_seconds=300)
    started(workers(VSRQ_LEASE_S="3", VSRQ_WORKER_TAIL_STALL_S="2"))
    talk_id = create(api, talk.read_bytes())
    [done] = wait_all(jobs, [talk_id], limit_s=240)
    requeued = requeues(jobs, talk_id)
    assert (done.status, done.attempt, requeued) == (Status.COMPLETED, 1, []), (done, requeued)
    assert any("re-encoded to AAC" in note for note in done.output.notes), done.output.notes


def test_a_completed_tail_held_in_its_cleanup_is_not_taken_for_a_stuck_one(
    stack, api, reaper, jobs, blobs, clips, workers
):
    """A tail whose job has completed sends no more heartbeats: its cleanup (listing what earlier attempts left) held
    by storage past VSRQ_WORKER_TAIL_STALL_S must not make the tail behind it throw away its finished encoding and its
    worker exit. Both jobs complete on their first attempt, on the one worker."""
    partition = Partition(("127.0.0.1", stack.ports["s3"]))
    through = {
        "VSRQ_S3_ENDPOINT_URL": f"http://127.0.0.1:{partition.port}",
        "VSRQ_S3_TIMEOUT_S": "5",  # the cleanup's listing, unanswered, fails after this (then goes on: housekeeping)
        "VSRQ_WORKER_TAIL_STALL_S": "2",
    }
    tailing, following = create(api, clips["medium"]), create(api, clips["small"])
    partition.hang(f"prefix=outputs%2F{tailing}".encode())  # the listing after `complete`
    try:
        worker = started(workers(**through))
        records = wait_all(jobs, [tailing, following], limit_s=60)
    finally:
        partition.close()
    print(f"FIGURE completed_tail_in_cleanup: {[(job.status.value, job.attempt) for job in records]}, the worker "
          f"{'alive' if worker.alive else f'exited with {worker.exit_status}'}")  # fmt: skip
    assert partition.hung == 1
    assert [(job.status, job.attempt) for job in records] == [(Status.COMPLETED, 1)] * 2, records
    assert worker.alive and "tail_stuck" not in worker.text(), worker.text()[-3000:]
    assert run_detail(jobs, following)["turn_waited_s"] > 2  # it did wait behind the held cleanup


def test_a_job_store_outage_past_the_stall_is_not_taken_for_a_stuck_tail(
    stack, api, reaper, jobs, blobs, clips, workers
):
    """The job store out of reach (the broker not) longer than VSRQ_WORKER_TAIL_STALL_S with a tail in flight: the
    tail cannot beat, so its silence says nothing. The next job's message, sent again while it cannot be leased, is
    not refused: the worker waits the outage out and runs both jobs, instead of exiting for a model reload."""
    store, s3 = Partition(("127.0.0.1", stack.ports["redis"])), Partition(("127.0.0.1", stack.ports["s3"]))
    tailing = create(api, clips["medium"])
    upload = f"PUT /{stack.bucket}/outputs/{tailing}/".encode()
    s3.hold(upload)  # the tail stays in flight through the outage
    worker = workers(
        VSRQ_REDIS_URL=f"redis://127.0.0.1:{store.port}/0",
        VSRQ_BROKER_URL=stack.redis_url,
        VSRQ_REDIS_TIMEOUT_S="0.5",  # each delivery past the cut waits out 3 of these, then 2 s: 11 s of outage at 1 s
        VSRQ_S3_ENDPOINT_URL=f"http://127.0.0.1:{s3.port}",
        VSRQ_LEASE_S="30",  # the tail's lease outlasts the outage: its silence is all that could end it
        VSRQ_WORKER_TAIL_STALL_S="2",
    )
    try:
        started(worker)
        wait_until(jobs, tailing, lambda job: job.stage == "uploading", limit_s=60)
        store.cut()
        cut_at = time.monotonic()
        following = create(api, clips["small"])
        worker.wait_for(lambda: worker.text().count(f"{following} not leased") >= 2 or not worker.alive,
                        "a second delivery past the stall", timeout_s=30)  # fmt: skip
        store.heal()
        outage_s = time.monotonic() - cut_at
        s3.release(upload)
        records = wait_all(jobs, [tailing, following], limit_s=60)
    finally:
        store.close()
        s3.close()
    print(f"FIGURE job_store_outage_with_a_tail: {[(job.status.value, job.attempt) for job in records]}, the worker "
          f"{'alive' if worker.alive else f'exited with {worker.exit_status}'}, outage {outage_s:.1f} s, "
          f"requeued for {[requeues(jobs, job.id) for job in records]}")  # fmt: skip
    assert worker.alive and "tail_stuck" not in worker.text(), worker.text()[-3000:]
    assert [(job.status, job.attempt) for job in records] == [(Status.COMPLETED, 1)] * 2, records


# -- 9. the next job's input prefetched while a job runs (worker.prefetch) ------------------------------------------


def input_key(jobs: JobStore, job_id: str) -> str:
    return jobs.require(job_id).input.key


def prefetched(worker: Process, job_id: str, limit_s: float = 60) -> None:
    """Waits until `worker` says it has downloaded `job_id`'s input ahead of its lease."""
    worker.wait_for(lambda: f"prefetched the input of {job_id}" in worker.text(), f"{job_id} prefetched", limit_s)


def prefetch_directory(worker: Process) -> Path:
    """The cache directory `worker` made (named at random: nobody can make it in advance)."""
    found = re.search(r'prefetching inputs into ([^\s"]+)', worker.text())
    assert found, worker.text()[-3000:]
    return Path(found[1])


def test_a_queue_runs_on_inputs_prefetched_while_the_previous_job_ran(
    api, reaper, jobs, blobs, clips, workers, tmp_path
):
    """Jobs queued before the worker starts: every job but the first reads the input downloaded while the job before
    it ran, and writes the bytes the first one, which downloaded its input once leased, wrote. A killed worker's cache
    (its lock file held by nobody) is removed by the next worker, a live one's (another worker sharing the volume, in
    another PID namespace) is not. The same for a job's scratch directory (input and raw frames: a killed worker's
    were never removed)."""
    dead, live = tmp_path / "vsrq-prefetch-dead", tmp_path / "vsrq-prefetch-live"
    # a job scratch being made (another worker's: hidden until its lock is taken), and one a worker killed just
    # before this one started left (no minute's grace: a restarted worker's next job needs its disk)
    dead_job, live_job, making = tmp_path / "vsrq-job-dead", tmp_path / "vsrq-job-live", tmp_path / ".vsrq-job-new"
    for directory in (dead, live, dead_job, live_job, making):
        directory.mkdir()
        (directory / "input-guess").write_bytes(b"a killed worker's download")
        (directory / "lock").touch()
    holders = [os.open(directory / "lock", os.O_RDWR) for directory in (live, live_job)]
    for holder in holders:
        fcntl.flock(holder, fcntl.LOCK_EX)  # as the live worker holds it
    # the medium clip: x264 writes the 96x64 small one's frames to other bytes from run to run (same pixels in)
    ids = [create(api, clips["medium"]) for _ in range(4)]
    # the default: prefetch on; the jobs' scratch in TMPDIR, beside the cache
    worker = started(workers(VSRQ_WORKER_PREFETCH_DIR=str(tmp_path), TMPDIR=str(tmp_path)))
    records = wait_all(jobs, ids, limit_s=120)
    cache = prefetch_directory(worker)
    left = sorted(path.name for path in cache.iterdir()) if cache.is_dir() else None  # each copy moved into its job
    worker.stop()
    for holder in holders:
        os.close(holder)
    ordered = sorted(records, key=lambda job: leases(jobs, job.id)[0])
    inputs = [run_detail(jobs, job.id)["input"] for job in ordered]
    print(
        f"FIGURE prefetched_inputs: {inputs}; outputs identical to the downloaded one's "
        f"{sum(job.output.sha256 == ordered[0].output.sha256 for job in ordered[1:])}/{len(ids) - 1}; "
        f"left in the cache {left}, its directory after shutdown {cache.exists()}"
    )
    assert all(job.status == Status.COMPLETED and job.attempt == 1 for job in records), records
    assert inputs == ["storage"] + ["prefetch"] * (len(ids) - 1)
    assert {job.output.sha256 for job in records} == {ordered[0].output.sha256}
    assert cache.parent == tmp_path and left == ["lock"] and not cache.exists()
    assert not dead.exists() and (live / "input-guess").exists()
    assert (live_job / "input-guess").exists()
    # the jobs' own went as they ended
    assert [path.name for path in tmp_path.glob("vsrq-job-*")] == ["vsrq-job-live"] and making.exists()


def test_a_prefetched_referenced_input_is_hashed_once_as_it_downloads(api, reaper, jobs, clips, workers, tmp_path):
    """Jobs naming an upload by id (bytes the API never hashed for them) are hashed each attempt; one whose input was
    prefetched records the digest taken as the prefetch downloaded that very file, not a second read of it."""
    uploaded = requests.post(
        f"{api}/v1/uploads", files={"file": ("clip.mp4", clips["small"], "video/mp4")}, headers=AUTH, timeout=30
    )
    assert uploaded.status_code in (200, 201), uploaded.text
    body = {"upload_id": uploaded.json()["id"], "model": "lanczos", "sr_resolution_scale": 2, "seed": 7}
    ids = []
    for _ in range(3):
        response = requests.post(f"{api}/v1/videos", json=body, headers=AUTH, timeout=30)
        assert response.status_code == 200, response.text
        ids.append(response.json()["id"])
    worker = started(workers(VSRQ_WORKER_PREFETCH_DIR=str(tmp_path)))
    records = wait_all(jobs, ids, limit_s=120)
    ordered = sorted(records, key=lambda job: leases(jobs, job.id)[0])
    inputs = [run_detail(jobs, job.id)["input"] for job in ordered]
    hashed = [re.search(rf"{job.id} read its input: .*?\(hashed ([a-z ]+)\)", worker.text()) for job in ordered]
    print(f"FIGURE prefetched_digest: inputs {inputs}, hashed {[found and found[1] for found in hashed]}")
    assert all(job.status == Status.COMPLETED for job in records), records
    assert inputs == ["storage", "prefetch", "prefetch"]
    assert [found and found[1] for found in hashed] == ["here"] + ["as it was prefetched"] * 2, worker.text()[-3000:]
    sha256 = hashlib.sha256(clips["small"]).hexdigest()
    assert [(job.input.bytes, job.input.sha256) for job in records] == [(len(clips["small"]), sha256)] * 3


def test_a_prefetch_stuck_on_a_dead_connection_does_not_hold_its_job(
    stack, api, reaper, jobs, blobs, clips, workers, s3_cut
):
    """The next job's input prefetched on a connection that goes dead (no answer, a long client timeout): when that
    job starts, it waits for the download only while bytes arrive, then downloads its input itself, long before the
    stuck call's timeout."""
    partition, through = s3_cut
    first, second = create(api, clips["medium"]), create(api, clips["small"])
    partition.hang(f"GET /{stack.bucket}/{input_key(jobs, second)}".encode())  # the prefetch's GET
    worker = started(workers(**{**through, "VSRQ_S3_TIMEOUT_S": "60"}))
    started_at = time.monotonic()
    records = wait_all(jobs, [first, second], limit_s=40)  # the stuck GET would hold the job 60 s
    seconds = time.monotonic() - started_at
    print(f"FIGURE stuck_prefetch: {[job.status.value for job in records]} in {seconds:.1f} s, the second's input "
          f"from {run_detail(jobs, second)['input']}")  # fmt: skip
    assert partition.hung == 1
    assert [job.status for job in records] == [Status.COMPLETED] * 2, records
    assert run_detail(jobs, second)["input"] == "storage"
    assert "moved no bytes" in worker.text()


def test_a_prefetched_input_s_check_slower_than_the_lease_keeps_its_job(
    stack, api, reaper, jobs, blobs, clips, workers, s3_cut
):
    """The next job's input prefetched, then the HEAD that checks storage still holds that blob, as the job starts,
    gets no answer for longer than the lease (`s3_timeout_s` past the lease; botocore's next try is answered): the
    job keeps its lease meanwhile (the reaper, every 0.5 s, requeues nothing) and completes at its first attempt on
    the prefetched input."""
    partition, through = s3_cut
    lease_s = 4  # the worker's own, shorter than the module's: the unanswered HEAD outlasts it sooner
    first, second = create(api, clips["long"]), create(api, clips["small"])
    worker = started(workers(**{**through, "VSRQ_LEASE_S": str(lease_s), "VSRQ_S3_TIMEOUT_S": str(lease_s + 3)}))
    prefetched(worker, second)  # its own HEADs done: the next one is `take`'s
    partition.hang(f"HEAD /{stack.bucket}/{input_key(jobs, second)} ".encode())
    records = wait_all(jobs, [first, second], limit_s=90)
    requeued = requeues(jobs, second)
    print(f"FIGURE prefetch_check_past_the_lease: {[(job.status.value, job.attempt) for job in records]}, the "
          f"second's requeues {requeued}")  # fmt: skip
    assert partition.hung == 1
    assert [(job.status, job.attempt) for job in records] == [(Status.COMPLETED, 1)] * 2, (records, requeued)
    assert run_detail(jobs, second)["input"] == "prefetch"


def test_a_prefetched_input_is_never_run_for_a_cancelled_job_nor_served_stale(
    stack, api, reaper, jobs, blobs, clips, workers, s3_cut
):
    """The next job's input prefetched, then the job cancelled, its input written again, or deleted: the cancelled job
    is not run, the others read what storage holds when they start (never the prefetched copy)."""
    partition, through = s3_cut
    first, cancelled, second, rewritten, third, deleted = (
        create(api, clips[name]) for name in ("medium", "small", "medium", "small", "medium", "small")
    )
    # each target's input is prefetched while the job before it runs; that job's output upload (its tail inline) is
    # held until the cancel, the rewrite or the delete is done, so the target starts after it however slow the
    # machine (on a fast one the job has not reached its upload by then: nothing to hold)
    held = {job_id: f"PUT /{stack.bucket}/outputs/{job_id}/".encode() for job_id in (first, second, third)}
    for marker in held.values():
        partition.hold(marker)
    worker = started(workers(**{**through, "VSRQ_S3_TIMEOUT_S": "60", "VSRQ_WORKER_OVERLAP_TAIL": "false"}))
    prefetched(worker, cancelled)
    response = requests.post(f"{api}/v1/videos/{cancelled}/cancel", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    partition.release(held[first])
    prefetched(worker, rewritten)
    blobs.put(input_key(jobs, rewritten), io.BytesIO(clips["medium"]), content_type="video/mp4")
    partition.release(held[second])
    prefetched(worker, deleted)
    blobs.delete(input_key(jobs, deleted))
    partition.release(held[third])
    records = dict(zip(("first", "cancelled", "second", "rewritten", "third", "deleted"),
                       wait_all(jobs, [first, cancelled, second, rewritten, third, deleted], limit_s=180)))  # fmt: skip
    print(
        "FIGURE prefetch_guesses: "
        + ", ".join(f"{name} {job.status.value}/{(run_detail(jobs, job.id) if job.output else {}).get('input')}"
                    for name, job in records.items())  # fmt: skip
        + f"; uploads held until the action was done {partition.held}"
    )
    assert records["cancelled"].status == Status.CANCELLED and leases(jobs, cancelled) == []
    assert outputs(blobs, cancelled) == []
    # the medium clip, written over the prefetched small one: 128x96 upscaled x2
    assert records["rewritten"].status == Status.COMPLETED, records["rewritten"]
    assert (records["rewritten"].output.media.width, run_detail(jobs, rewritten)["input"]) == (256, "storage")
    assert records["deleted"].status == Status.FAILED and records["deleted"].error.code == "input_not_found"
    assert run_detail(jobs, second)["input"] == "storage"  # the copy in the cache was the cancelled job's
