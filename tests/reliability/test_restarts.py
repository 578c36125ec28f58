"""Processes of the service dying and coming back (issue 27): a gunicorn master killed with SIGKILL mid-upload must
leave no worker holding its listening socket, so its replacement serves at once; a dead reaper and a job past its
lease show in /healthz and `vsrq status`; a Redis outage costs the reaper's log two lines, not a traceback a pass."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import redis
import requests

from infra.stack import REDIS_CONF, binary, free_ports
from storage.jobs import InputInfo, job_key

from . import processes
from .conftest import TOKENS, auth, status_counts, wait_all


def post_lanczos_job(url: str, clip: bytes) -> str:
    """A lanczos x2 job of `clip`, created as a user does; its id."""
    response = requests.post(
        f"{url}/v1/videos", files={"video_reference": ("c.mp4", clip, "video/mp4")},
        data={"model": "lanczos", "sr_resolution_scale": "2"}, headers=auth("dave"), timeout=30,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["id"]

def test_a_killed_gunicorn_master_leaves_no_worker_holding_the_socket(rel_env, tmp_path):
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    first = processes.serving(processes.api(rel_env, port, tmp_path).start(), url)
    workers = psutil.Process(first.pid).children()
    upload = socket.create_connection(("127.0.0.1", port), timeout=30)  # a long upload, in flight when it dies
    upload.sendall(
        f"POST /v1/uploads HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKENS['alice']}\r\n"
        f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 5000000\r\n\r\n--b\r\n".encode()
    )
    time.sleep(0.5)
    killed = time.monotonic()
    os.kill(first.pid, signal.SIGKILL)  # the master alone, as the OOM killer would pick it
    second = processes.api(rel_env, port, tmp_path)
    try:
        _, alive = psutil.wait_procs(workers, timeout=5)
        workers_gone = time.monotonic() - killed
        processes.serving(second.start(), url, timeout_s=30)
        serving = time.monotonic() - killed
        print(f"FIGURE gunicorn master SIGKILLed mid-upload: its workers gone after {workers_gone:.2f} s "
              f"({len(alive)} left), the replacement serving {serving:.1f} s after the kill")
        assert not alive and serving < 10
    finally:
        upload.close()
        second.stop()
        for worker in workers:
            if worker.is_running():
                worker.kill()


def test_health_tells_a_dead_reaper_and_a_job_past_its_lease(rel_env, jobs, tmp_path):
    """A reaper passing every 0.2 s, then SIGKILLed, and a job whose worker vanished: /healthz goes from counting a
    live reaper to "degraded", naming the reaper and the job past its lease; `vsrq status` says the same."""
    env = {**rel_env, "VSRQ_REAP_INTERVAL_S": "0.2", "VSRQ_REAPER_STALE_S": "2"}
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    api = processes.serving(processes.api(env, port, tmp_path).start(), url)
    reaper = processes.reaper(env, tmp_path).start()
    job = None
    try:

        def reaper_check() -> dict:
            time.sleep(1.1)  # /healthz is kept for a second
            return requests.get(f"{url}/healthz", timeout=10).json()

        deadline = time.monotonic() + 60
        while not (health := reaper_check())["checks"]["reaper"]["ok"]:
            assert time.monotonic() < deadline, health
        reaper.kill()
        killed = time.monotonic()
        job = jobs.create(owner="dave", model="lanczos", queue="vsrq.health-probe", params={}, input=InputInfo(key="x"))
        jobs.lease(job.id, "a-worker-that-dies", lease_s=1)
        while health["checks"]["reaper"]["ok"] or not health["checks"]["leases"]["overdue"]:
            assert time.monotonic() - killed < 30, health
            health = reaper_check()
        status = subprocess.run(
            [sys.executable, "-m", "client.cli", "status"], env={**os.environ, **env}, capture_output=True, text=True
        )
        print(f"FIGURE dead reaper: /healthz {health['status']} {time.monotonic() - killed:.1f} s after the kill: "
              f"{health['problems']}")
        assert health["status"] == "degraded"
        assert any("reaper has not passed" in problem for problem in health["problems"])
        assert any("past their lease" in problem for problem in health["problems"])
        assert "reaper has not passed" in status.stdout and "past their lease" in status.stdout, status.stdout
    finally:
        reaper.stop()
        api.stop()
        if job is not None:  # requeued (its queue has no worker) and cancelled: nothing left past a lease
            jobs.reap()
            jobs.cancel(job.id)


def test_healthz_answers_at_once_while_its_checks_hang(rel_env, stack, tmp_path):
    """The API's Redis partitioned (bytes dropped, connections left open; Redis timeout 8 s): /healthz keeps answering
    at once, from its last checks, then 503 naming the checks that have not finished once they are 5 s old. Before,
    the caller that found the checks a second old ran them itself and waited out the Redis timeout."""
    partition = processes.Partition(("127.0.0.1", stack.ports["redis"]))
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    # one API process: each has its checks, and one sharing the socket may get every call while another still boots
    env = {**rel_env, "VSRQ_REDIS_URL": f"redis://127.0.0.1:{partition.port}/0", "VSRQ_REDIS_TIMEOUT_S": "8",
           "VSRQ_WEB_WORKERS": "1"}  # fmt: skip
    api = processes.serving(processes.api(env, port, tmp_path).start(), url)
    try:
        while sum(requests.get(f"{url}/healthz", timeout=5).status_code == 200 for _ in range(10)) < 10:
            time.sleep(0.2)  # its first checks done
        partition.cut()
        cut = time.monotonic()
        answers = []
        while time.monotonic() - cut < 7:
            started = time.monotonic()
            response = requests.get(f"{url}/healthz", timeout=5)
            answers.append((started - cut, time.monotonic() - started, response.status_code, response.json()))
            time.sleep(0.1)
        slowest = max(seconds for _, seconds, _, _ in answers)
        first_503 = next(at for at, _, status, _ in answers if status == 503)
        print(f"FIGURE /healthz, Redis partitioned: {len(answers)} answers in 7 s, the slowest {slowest * 1000:.0f} ms; "
              f"503 from {first_503:.1f} s after the cut: {answers[-1][3]['problems']}")
        assert slowest < 1
        assert all(status == 200 for at, _, status, _ in answers if at < 3)  # the last checks, still fresh
        assert first_503 < 6.5 and all(status == 503 for at, _, status, _ in answers if at > 6.5)
        assert "the health checks have not finished for" in answers[-1][3]["problems"][0]
    finally:
        partition.heal()
        api.stop()
        partition.close()


def test_a_worker_running_another_model_than_its_queue_serves_is_said(rel_env, tmp_path):
    """A GPU worker started without VSRQ_WORKER_MODEL runs the default, lanczos, on the queue VSRQ_MODELS gives to
    Kandinsky: its jobs came back lanczos while /healthz said ok (an operator's trial; one warning in its log)."""
    queue = f"vsrq.k6-probe-{os.getpid()}"
    env = {**rel_env, "VSRQ_MODELS": json.dumps({"kandinskylab/Kandinsky-6.0-VSR": queue}), "VSRQ_WEB_WORKERS": "1"}
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    api = processes.serving(processes.api(env, port, tmp_path).start(), url)
    worker = processes.started(processes.worker(env, queue, tmp_path).start())
    try:
        deadline = time.monotonic() + 30
        said = f"a worker on {queue} runs lanczos for jobs of kandinskylab/Kandinsky-6.0-VSR"
        while True:  # the worker registers once ready, the checks run every second
            health = requests.get(f"{url}/healthz", timeout=10).json()
            if any(problem.startswith(said) for problem in health["problems"]):
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.5)
        assert health["status"] == "degraded", health
        status = subprocess.run(
            [sys.executable, "-m", "client.cli", "status"], env={**os.environ, **env}, capture_output=True, text=True
        )  # fmt: skip
        assert said in status.stdout and f"{worker.name}@localhost" in status.stdout, status.stdout
        assert worker.name not in json.dumps(health)  # /healthz is public: counts, no names
    finally:
        worker.stop()
        api.stop()


def test_a_misspelt_variable_is_said_at_start_not_ignored(rel_env, tmp_path):
    """`VSRQ_S3_BUCKE=...` was ignored unsaid (pydantic's extra="ignore"), and the default bucket used: the API, the
    workers (upscaling and webhooks) and the reaper each say at start which VSRQ_* names no setting reads, and the name
    each is closest to."""
    env = {**rel_env, "VSRQ_S3_BUCKE": "ops-typo", "VSRQ_WORKER_MODLE": "lanczos", "VSRQ_WEB_WORKERS": "1"}
    port = free_ports(1)[0]
    api = processes.serving(processes.api(env, port, tmp_path).start(), f"http://127.0.0.1:{port}")
    worker = processes.started(processes.worker(env, f"vsrq.typo-{os.getpid()}", tmp_path).start())
    reaper = processes.reaper(env, tmp_path).start()
    hooks = processes.started(processes.webhooks(env, f"vsrq.typo-hooks-{os.getpid()}", tmp_path).start())
    try:
        reaper.wait_for(lambda: "no setting reads" in reaper.text(), "the reaper's warning", timeout_s=60)
        for process, said in ((api, ["VSRQ_S3_BUCKE (not VSRQ_S3_BUCKET?)"]), (reaper, ["VSRQ_S3_BUCKE"]),
                              (worker, ["VSRQ_S3_BUCKE", "VSRQ_WORKER_MODLE (not VSRQ_WORKER_MODEL?)"]),
                              (hooks, ["VSRQ_S3_BUCKE (not VSRQ_S3_BUCKET?)"])):  # fmt: skip
            line = next((line for line in process.text().splitlines() if "no setting reads" in line), "")
            assert all(name in line for name in said), process.text()[-2000:]
        assert "VSRQ_WORKER_MODLE" not in api.text() + hooks.text()  # the GPU worker's setting, not theirs to judge
    finally:
        processes.stop_all([hooks, reaper, worker, api])


def test_a_worker_started_without_the_solo_pool_says_so_and_exits(rel_env, tmp_path):
    """`celery -A worker.tasks worker -Q vsrq.k6`, the Procfile's line without its `--pool solo`, ran Celery's default
    prefork pool: the process that loaded the model forked once per CPU core (on a GPU, CUDA cannot be used again in
    a fork) and each child ran a job beside the others. It exits at start now, status 78, saying how to start it."""
    for pool in ([], ["--pool", "threads", "--concurrency", "2"]):  # Celery's default (prefork), and another
        command = [sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", *pool, "-Q", "vsrq.pool-probe",
                   "-n", f"pool-probe-{len(pool)}@localhost", "--without-gossip", "--without-mingle"]  # fmt: skip
        env = {**rel_env, "VSRQ_WORKER_MODEL": "lanczos", "VSRQ_WORKER_DEVICES": "cpu"}
        worker = processes.Process(f"pool-{len(pool)}", command, env, tmp_path / f"pool-{len(pool)}.log").start()
        try:
            worker.wait_for(lambda: not worker.alive, "the worker's exit", timeout_s=60)
            assert worker.exit_status == 78, worker.text()[-3000:]
            said = "this worker runs its jobs one at a time on its model, with `--pool solo`"
            assert said in worker.text() and "ready." not in worker.text(), worker.text()[-3000:]
        finally:
            worker.stop()


def test_a_redis_that_would_lose_jobs_is_said_in_health_and_status(rel_env, tmp_path):
    """A Redis without its append-only file (a restart comes back empty: every job a 404) and evicting keys when full
    (an operator's run: 21 of 30 jobs just accepted answered 404), while /healthz said ok and nothing logged it."""
    port = free_ports(1)[0]
    redis_server = subprocess.Popen(
        [binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    env = {**rel_env, "VSRQ_REDIS_URL": f"redis://127.0.0.1:{port}/0", "VSRQ_WEB_WORKERS": "1"}
    api_port = free_ports(1)[0]
    url = f"http://127.0.0.1:{api_port}"
    api = processes.serving(processes.api(env, api_port, tmp_path).start(), url)
    try:
        health = requests.get(f"{url}/healthz", timeout=10).json()
        status = subprocess.run(
            [sys.executable, "-m", "client.cli", "status"], env={**os.environ, **env}, capture_output=True, text=True
        )  # fmt: skip
        said = ["Redis keeps no append-only file (appendonly no): a restart loses the jobs since its last snapshot",
                "Redis evicts keys when full (maxmemory-policy allkeys-lru): jobs vanish; set noeviction"]  # fmt: skip
        assert health["status"] == "degraded" and set(said) <= set(health["problems"]), health
        assert all(line in status.stdout for line in said), status.stdout
    finally:
        api.stop()
        redis_server.terminate()
        redis_server.wait(10)


def test_the_reaper_logs_an_outage_once_and_its_end(rel_env, tmp_path):
    """Redis down under a reaper passing every 0.2 s, for 2 s (10 passes) after its first failing one: one line when
    each step starts failing and one when it recovers, no traceback."""
    port = free_ports(1)[0]
    env = {**rel_env, "VSRQ_REDIS_URL": f"redis://127.0.0.1:{port}/0", "VSRQ_REAP_INTERVAL_S": "0.2",
           "VSRQ_REDIS_TIMEOUT_S": "1", "VSRQ_LOG_FORMAT": "text"}  # fmt: skip
    reaper = processes.reaper(env, tmp_path).start()
    redis_server = None
    try:
        # from the reaper's first failure on, not from its start: a loaded machine took longer than the outage to
        # start it, which then saw none
        reaper.wait_for(lambda: "reap failing" in reaper.text(), "a failing pass", timeout_s=60)
        time.sleep(2)
        redis_server = subprocess.Popen(
            [binary("redis-server"), "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while "reap recovered" not in reaper.text():
            assert time.monotonic() < deadline and reaper.alive, reaper.text()[-3000:]
            time.sleep(0.2)
        time.sleep(0.5)
        log = reaper.text()
        failing = [line for line in log.splitlines() if " failing: " in line]
        print(f"FIGURE reaper during a Redis outage (2 s past its first failing pass): {len(log.splitlines())} log lines, {len(failing)} 'failing', "
              f"{log.count('recovered')} 'recovered', {log.count('Traceback')} tracebacks")
        assert "Traceback" not in log and 1 <= len(failing) <= 3 and "reap failing" in log, log[-3000:]
    finally:
        reaper.stop()
        if redis_server is not None:
            redis_server.terminate()
            redis_server.wait(10)


# `vsrq dev` bringing back each of its processes SIGKILLed: tests/service/test_demo.py, on the stack that proves the
# rest of `vsrq dev`


def test_a_requeued_job_goes_first_among_the_queued(rel_env, jobs, tmp_path):
    """Job A's worker is SIGKILLed mid-job (its input download held on the way from storage, so the kill is sure to
    land before A can end); B, C, D are queued behind it meanwhile; the reaper requeues A when its lease runs out
    (4 s). The next worker runs A before B, C and D: it waited its turn once already."""
    from worker.media.synthetic import write_clip

    env = {**rel_env, "VSRQ_MODELS": json.dumps({"lanczos": "vsrq.requeue-probe"}), "VSRQ_LEASE_S": "4",
           "VSRQ_REAP_INTERVAL_S": "0.2"}  # fmt: skip
    storage = urlsplit(env["VSRQ_S3_ENDPOINT_URL"])
    held = processes.Partition((storage.hostname, storage.port))  # the first worker's way to storage
    held.hold(b"/uploads/dave/")  # A's input: its HEAD or GET waits there until the test ends
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    api = processes.api(env, port, tmp_path).start()  # the three boot at once
    reaper = processes.reaper(env, tmp_path).start()
    first = processes.worker({**env, "VSRQ_S3_ENDPOINT_URL": f"http://127.0.0.1:{held.port}"}, "vsrq.requeue-probe",
                             tmp_path).start()  # fmt: skip
    second = processes.worker(env, "vsrq.requeue-probe", tmp_path)
    clip = write_clip(tmp_path / "clip.mp4", 9, (32, 48)).read_bytes()

    def create() -> str:
        return post_lanczos_job(url, clip)

    try:
        processes.serving(api, url)
        processes.started(first)
        a = create()
        first.wait_for(lambda: held.held > 0, "A's input requested", timeout_s=60)
        assert jobs.require(a).status == "in_progress"
        first.kill()
        behind = [create() for _ in range(3)]
        deadline = time.monotonic() + 60
        while not any(event.type == "requeued" for event in jobs.events(a)):  # the lease ran out: A is back
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second.start()  # only now: a worker ready sooner would take B, C and D before A was back in the queue
        deadline = time.monotonic() + 180
        while not all(jobs.require(job_id).status == "completed" for job_id in [a, *behind]):
            assert time.monotonic() < deadline, [jobs.require(job_id).status for job_id in [a, *behind]]
            time.sleep(0.2)
        requeued = next(event.at for event in jobs.events(a) if event.type == "requeued")
        assert requeued > max(jobs.require(job_id).created_at for job_id in behind)  # queued before A came back
        order = sorted([a, *behind], key=lambda job_id: [e.at for e in jobs.events(job_id) if e.type == "leased"][-1])
        print(f"FIGURE requeued job: A (worker killed) and B, C, D queued behind it run in the order "
              f"{[('A', 'B', 'C', 'D')[[a, *behind].index(job_id)] for job_id in order]}")
        assert order[0] == a, order
    finally:
        processes.stop_all([first, second, reaper, api])
        held.close()


def test_a_message_a_dying_consumer_took_is_sent_again_and_runs_once(rel_env, settings, jobs, tmp_path):
    """Kombu's Redis transport pops a message off its list before the consumer writes it to `unacked`: one killed in
    between loses it, and its job stays queued for good. Here the broker gives `lost`'s message to a consumer that died
    (the message taken off the list in Redis), while a live consumer holds `held`'s (taken, in `unacked`) and `listed`'s
    waits in the list. The reaper (every 0.2 s, grace 1 s) sends `lost` one message, and `held` and `listed` none; a
    worker started then runs `lost` and `listed` once each."""
    from storage.queue import UPSCALE_TASK, _upscale_job_id, make_celery, next_job_ids
    from worker.media.synthetic import write_clip

    queue = "vsrq.lost-probe"
    env = {**rel_env, "VSRQ_MODELS": json.dumps({"lanczos": queue}), "VSRQ_REAP_INTERVAL_S": "0.2",
           "VSRQ_LOST_MESSAGE_GRACE_S": "1"}  # fmt: skip
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    api = processes.api(env, port, tmp_path).start()  # the two boot at once
    reaper = processes.reaper(env, tmp_path).start()
    worker = processes.worker(env, queue, tmp_path)
    clip = write_clip(tmp_path / "clip.mp4", 9, (32, 48)).read_bytes()
    celery = make_celery(settings)

    def create() -> str:
        return post_lanczos_job(url, clip)

    def resent(job_id: str) -> int:
        return sum(job_id in line and "sent again" in line for line in reaper.text().splitlines())

    def resent_total() -> float:  # the API's /metrics, read from Redis
        text = requests.get(f"{url}/metrics", timeout=30).text
        return float(re.search(r"^vsrq_reaper_lost_messages_resent_total (\S+)$", text, re.MULTILINE)[1])

    held = held_message = None
    with celery.connection_for_read() as connection, connection.SimpleQueue(queue, no_ack=False) as consumer:
        try:
            processes.serving(api, url)
            before = resent_total()
            held = create()
            held_message = consumer.get_nowait()  # basic_get: off the list, into `unacked`, not acknowledged
            assert held_message.headers["task"] == UPSCALE_TASK and held_message.decode()[0] == [held]
            lost = create()
            [message] = [raw for raw in jobs.redis.lrange(queue, 0, -1) if _upscale_job_id(raw) == lost]
            assert jobs.redis.lrem(queue, 1, message) == 1  # the message a consumer took, and died with
            listed = create()

            reaper.wait_for(lambda: resent(lost) > 0, "the lost message sent again", timeout_s=30)
            assert next_job_ids(celery, [queue], limit=10) == [lost, listed]  # at the front: its turn had come
            worker.start()
            deadline = time.monotonic() + 120
            while not all(jobs.require(job_id).status == "completed" for job_id in (lost, listed)):
                assert time.monotonic() < deadline, worker.text()[-4000:]
                time.sleep(0.2)
            time.sleep(1.5)  # a few more passes past the grace: still nothing more sent
            runs = {job_id: [e.type for e in jobs.events(job_id)].count("leased") for job_id in (lost, listed)}
            print(f"FIGURE lost message: sent again {resent(lost)} time(s); leased {runs}; held/listed sent again "
                  f"{resent(held)}/{resent(listed)} time(s)")
            assert runs == {lost: 1, listed: 1} and resent(lost) == 1 and resent_total() == before + 1
            assert resent(held) == resent(listed) == 0
            assert f"dropped a message for {listed}" not in worker.text()  # no duplicate of `listed` either
            assert jobs.require(held).status == "queued" and next_job_ids(celery, [queue]) == []
        finally:
            if held_message is not None:
                held_message.ack()
            processes.stop_all([worker, reaper, api])
            if held is not None:  # queued for good: no consumer will ever run it
                jobs.cancel(held)


class RedisPair:
    """A managed Redis as its clients see it: two real servers, the second a replica of the first, behind a forwarder
    (`url`) that stands for the endpoint's name: new connections go where it points, open ones stay."""

    def __init__(self, tmp_path: Path) -> None:
        self.a, self.b = free_ports(2)
        self._servers: list[subprocess.Popen] = []
        for port, name, extra in ((self.a, "a", []), (self.b, "b", ["--replicaof", "127.0.0.1", str(self.a)])):
            (tmp_path / name).mkdir()
            command = [binary("redis-server"), str(REDIS_CONF), "--port", str(port), "--dir", str(tmp_path / name),
                       *extra]  # fmt: skip
            self._servers.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
        self.server = {port: redis.Redis(port=port) for port in (self.a, self.b)}
        self.endpoint = processes.Partition(("127.0.0.1", self.a))
        self.url = f"redis://127.0.0.1:{self.endpoint.port}/0"

    def fail_over(self, old: int, new: int, endpoint_moves: bool) -> None:
        """`new` (a replica of `old`, caught up on every write) becomes the primary, `old` its replica."""
        deadline = time.monotonic() + 30
        while True:
            written = self.server[old].info("replication")["master_repl_offset"]
            if self.server[new].info("replication")["master_repl_offset"] >= written:
                break
            assert time.monotonic() < deadline, self.server[new].info("replication")
            time.sleep(0.05)
        self.server[new].execute_command("REPLICAOF", "NO", "ONE")
        self.server[old].execute_command("REPLICAOF", "127.0.0.1", str(new))
        if endpoint_moves:
            self.move_endpoint(new)

    def move_endpoint(self, port: int) -> None:
        self.endpoint.target = ("127.0.0.1", port)

    def close(self) -> None:
        self.endpoint.close()
        for server in self._servers:
            server.kill()  # throwaway data: no shutdown save to wait for
            server.wait(10)


def test_a_redis_failover_is_followed_by_the_api_and_a_running_worker(rel_env, tmp_path):
    """A managed Redis fails over by promoting its replica and moving its endpoint to it; connections opened before
    still reach the old primary, now a replica that refuses every write (READONLY). The API answered 500 to every
    request that writes (any authenticated one: its rate limit) for as long as its processes lived. Here the endpoint
    is a forwarder (new connections go where it points) in front of two real Redis servers: after a failover the API,
    already serving, answers as before, and the worker, already running, runs a job created after it; a failover back
    whose endpoint moves later is answered 503 until it does."""
    from worker.media.synthetic import write_clip

    pair = RedisPair(tmp_path)
    a, b = pair.a, pair.b
    queue = "vsrq.failover-probe"
    env = {**rel_env, "VSRQ_REDIS_URL": pair.url, "VSRQ_WEB_WORKERS": "1",
           "VSRQ_MODELS": json.dumps({"lanczos": queue})}  # fmt: skip
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    api = processes.api(env, port, tmp_path).start()
    worker = processes.worker(env, queue, tmp_path).start()
    clip = write_clip(tmp_path / "clip.mp4", 9, (32, 48)).read_bytes()
    try:
        processes.serving(api, url)
        processes.started(worker)
        def a_job_runs() -> str:
            job_id = post_lanczos_job(url, clip)
            done = wait_all(url, "dave", [job_id], worker.log, limit_s=60)[job_id]
            assert (done["status"], worker.alive) == ("completed", True), done
            return job_id

        before = a_job_runs()
        # 1. the endpoint moves with the failover: the API's open connections reach the old primary, and its first
        # request after it is answered from the new one (a connection found to be a replica's is tried again anew)
        pair.fail_over(a, b, endpoint_moves=True)
        seen = requests.get(f"{url}/v1/videos/{before}", headers=auth("dave"), timeout=30)
        assert (seen.status_code, seen.json().get("status")) == (200, "completed"), seen.text
        after = a_job_runs()
        assert pair.server[b].info("replication")["role"] == "master" and pair.server[b].exists(job_key("vsrq", after))

        # 2. back again, the endpoint moving later: meanwhile every connection reaches a replica, and a request that
        # writes is told to come back; then the API and the worker carry on
        quiet_from = len(worker.text())
        pair.fail_over(b, a, endpoint_moves=False)
        waiting = requests.get(f"{url}/v1/videos/{before}", headers=auth("dave"), timeout=30)
        assert (waiting.status_code, waiting.json()["code"]) == (503, "service_unavailable"), waiting.text
        assert int(waiting.headers["Retry-After"]) > 0
        status = subprocess.run([sys.executable, "-m", "client.cli", "status"], env={**os.environ, **env},
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "reaches a replica" in status.stderr and "a failover is under way" in status.stderr, status.stderr
        time.sleep(2)  # a window of seconds, as a managed endpoint takes to move
        pair.move_endpoint(a)
        assert requests.get(f"{url}/v1/videos/{after}", headers=auth("dave"), timeout=30).status_code == 200
        # meanwhile the worker waited for a primary, saying so once: no error a second from Celery's reconnect loop
        window = worker.text()[quiet_from:]
        assert "is a replica (a failover): waiting up to" in window, window[-3000:]
        assert not re.search(r"ERROR|CRITICAL", window), window[-3000:]
        last = a_job_runs()
        assert pair.server[a].info("replication")["role"] == "master" and pair.server[a].exists(job_key("vsrq", last))
        assert 500 not in status_counts(api.log), api.text()[-3000:]
    finally:
        processes.stop_all([worker, api])
        pair.close()


def test_a_full_redis_is_an_outage_said_and_outlived_not_a_crash(rel_env, tmp_path):
    """Redis at its `maxmemory` (noeviction, as vsrq asks) refuses every write (OOM). Every authenticated request
    answered 500 (the rate limit writes), /healthz said ok, and a Celery worker exited "Unrecoverable error" at its
    next ack, and again at every start while it lasted (`vsrq dev` gave it up after 6). Here the API answers 503 with
    Retry-After and /healthz names it; a worker started meanwhile waits, saying so; once memory is freed, a job runs."""
    from worker.media.synthetic import write_clip

    port = free_ports(1)[0]
    (tmp_path / "redis").mkdir()
    server = subprocess.Popen([binary("redis-server"), str(REDIS_CONF), "--port", str(port), "--dir",
                               str(tmp_path / "redis")], stdout=subprocess.DEVNULL)  # fmt: skip
    store = redis.Redis(port=port)
    queue = "vsrq.full-probe"
    env = {**rel_env, "VSRQ_REDIS_URL": f"redis://127.0.0.1:{port}/0", "VSRQ_WEB_WORKERS": "1",
           "VSRQ_MODELS": json.dumps({"lanczos": queue})}  # fmt: skip
    url = f"http://127.0.0.1:{free_ports(1)[0]}"
    api = processes.api(env, int(url.rsplit(":", 1)[1]), tmp_path).start()
    worker = processes.worker(env, queue, tmp_path).start()
    late = None
    clip = write_clip(tmp_path / "clip.mp4", 9, (32, 48)).read_bytes()
    try:
        processes.serving(api, url)
        processes.started(worker)
        before = post_lanczos_job(url, clip)
        assert wait_all(url, "dave", [before], worker.log, limit_s=60)[before]["status"] == "completed"

        # 1. full: writes refused
        store.config_set("maxmemory", store.info("memory")["used_memory"] + 2**20)
        for size in (65536, 1024, 16):  # to the last bytes: a small write fits where a large one was refused
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                for n in range(100_000):
                    store.set(f"junk:{size}:{n}", b"x" * size)
        seen = requests.get(f"{url}/v1/videos/{before}", headers=auth("dave"), timeout=30)
        assert (seen.status_code, seen.json().get("code")) == (503, "service_unavailable"), seen.text
        assert int(seen.headers["Retry-After"]) > 0
        made = requests.post(f"{url}/v1/videos", files={"video_reference": ("c.mp4", clip, "video/mp4")},
                             data={"model": "lanczos"}, headers=auth("dave"), timeout=30)  # fmt: skip
        assert made.status_code == 503, made.text
        deadline = time.monotonic() + 20
        while True:  # the API's health checks run every few seconds
            said = requests.get(f"{url}/healthz", timeout=10).json()
            if any(problem.startswith("Redis is full") for problem in said["problems"]):
                break
            assert time.monotonic() < deadline, said
            time.sleep(0.5)
        (tmp_path / "late").mkdir()
        late = processes.worker(env, queue, tmp_path / "late").start()
        late.wait_for(lambda: "is full (maxmemory): waiting up to" in late.text(), "a worker that waits", 60)
        time.sleep(2)
        assert late.alive and worker.alive, late.text()[-3000:]

        # 2. freed: work goes on, with no process started again
        store.delete(*store.keys("junk:*"))
        store.config_set("maxmemory", 0)
        after = post_lanczos_job(url, clip)
        assert wait_all(url, "dave", [after], worker.log, limit_s=60)[after]["status"] == "completed"
        assert late.alive and worker.alive
        for process in (worker, late):
            assert "Unrecoverable error" not in process.text(), process.text()[-3000:]
        assert 500 not in status_counts(api.log), api.text()[-3000:]
    finally:
        processes.stop_all([p for p in (late, worker, api) if p is not None])
        server.kill()
        server.wait(10)


def test_a_create_whose_message_the_broker_refused_answers_its_job_which_runs_once_it_is_back(rel_env, tmp_path):
    """The broker (a Redis of its own here) down while a job is made: the API answered 503 `enqueue_failed`, "retry
    later", yet left a failed job in the user's list and sent its `video.failed` webhook; a retry made a second job.
    The job is made and waits for its message, which the reaper sends once the broker is back: it runs, once."""
    from worker.media.synthetic import write_clip

    broker_port = free_ports(1)[0]
    queue = "vsrq.unsent-probe"
    env = {**rel_env, "VSRQ_BROKER_URL": f"redis://127.0.0.1:{broker_port}/0", "VSRQ_WEB_WORKERS": "1",
           "VSRQ_MODELS": json.dumps({"lanczos": queue}), "VSRQ_ENQUEUE_GRACE_S": "1", "VSRQ_REAP_INTERVAL_S": "0.5",
           "VSRQ_REDIS_TIMEOUT_S": "2"}  # fmt: skip
    url = f"http://127.0.0.1:{free_ports(1)[0]}"
    api = processes.api(env, int(url.rsplit(":", 1)[1]), tmp_path).start()
    broker = worker = reaper = None
    clip = write_clip(tmp_path / "clip.mp4", 9, (32, 48)).read_bytes()
    try:
        processes.serving(api, url)
        job_id = post_lanczos_job(url, clip)  # nothing listens at the broker's port
        seen = requests.get(f"{url}/v1/videos/{job_id}", headers=auth("dave"), timeout=30).json()
        assert seen["status"] == "queued" and seen.get("error") is None, seen
        assert "its message was not sent" in api.text()

        (tmp_path / "broker").mkdir()
        broker = subprocess.Popen([binary("redis-server"), str(REDIS_CONF), "--port", str(broker_port), "--dir",
                                   str(tmp_path / "broker")], stdout=subprocess.DEVNULL)  # fmt: skip
        worker = processes.worker(env, queue, tmp_path).start()
        reaper = processes.reaper(env, tmp_path).start()
        done = wait_all(url, "dave", [job_id], worker.log, limit_s=90)[job_id]
        assert (done["status"], done["attempt"]) == ("completed", 1), done
        listed = requests.get(f"{url}/v1/videos?limit=100", headers=auth("dave"), timeout=30).json()["data"]
        assert not [job for job in listed if (job.get("error") or {}).get("code") == "enqueue_failed"], listed
    finally:
        processes.stop_all([p for p in (reaper, worker, api) if p is not None])
        if broker is not None:
            broker.kill()
            broker.wait(10)


def test_a_create_cut_off_by_its_api_s_death_leaves_its_key_to_a_repeat_once_lapsed(rel_env, redis_client, tmp_path):
    """`vsrq bulk` run again after its stack was killed mid-create: the key stayed `in_flight` for an hour (every
    repeat 409, the run gave up), and a job the dead request had made was made again after the hour (a chaos trial).
    With a lease of 2 s: killed mid-upload, the repeat gets 409 until the claim lapses, then makes the job; killed
    after the job was made but before the key remembered it, the repeat gets that job, replayed: one job each."""
    from worker.media.synthetic import write_clip

    clip = write_clip(tmp_path / "clip.mp4", 9, (32, 48)).read_bytes()
    plain = urlsplit(rel_env["VSRQ_REDIS_URL"])
    redis_way = processes.Partition((plain.hostname, plain.port))
    env = {**rel_env, "VSRQ_IDEMPOTENCY_LEASE_S": "2", "VSRQ_WEB_WORKERS": "1",
           "VSRQ_REDIS_URL": f"redis://127.0.0.1:{redis_way.port}/0"}  # fmt: skip
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    boundary = "vsrq-test-boundary"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="video_reference"; filename="clip.mp4"\r\n'
            "Content-Type: video/mp4\r\n\r\n").encode()  # fmt: skip
    tail = f"\r\n--{boundary}--\r\n".encode()

    def send(key: str, body, timeout_s: float = 60) -> requests.Response:
        headers = {**auth("dave"), "Idempotency-Key": key, "Content-Type": f"multipart/form-data; boundary={boundary}"}
        return requests.post(f"{url}/v1/videos", data=body, headers=headers, timeout=timeout_s)

    def claim_of(key: str) -> dict:
        raw = redis_client.get(f"vsrq:idem:dave:{hashlib.sha256(key.encode()).hexdigest()}")
        return json.loads(raw) if raw else {}

    def cut_off(key: str, body) -> None:
        """Sends the request on a thread, to be cut off where the test kills its API process."""

        def sending() -> None:
            with contextlib.suppress(requests.RequestException):
                send(key, body)

        threading.Thread(target=sending, daemon=True).start()

    api = processes.serving(processes.api(env, port, tmp_path).start(), url)
    try:
        # 1. killed mid-upload: no job made
        uploading, stalled = secrets.token_hex(8), threading.Event()

        def trickle():
            yield head + clip[:100]
            stalled.wait(30)
            yield clip[100:] + tail

        cut_off(uploading, trickle())
        deadline = time.monotonic() + 10
        while not claim_of(uploading):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        api.kill()
        stalled.set()
        api = processes.serving(processes.api(env, port, tmp_path).start(), url)
        early = send(uploading, head + clip + tail)
        waited = time.monotonic()
        while early.status_code == 409:  # the claim lapses 2 s after its dead request last renewed it
            assert early.json()["code"] == "idempotency_in_flight" and time.monotonic() - waited < 15, early.text
            time.sleep(0.5)
            early = send(uploading, head + clip + tail)
        assert early.status_code == 200 and "Idempotent-Replayed" not in early.headers, early.text
        assert send(uploading, head + clip + tail).json()["id"] == early.json()["id"]

        # 2. killed after its job was made, before its key remembered it: the key's answer never reaches Redis
        made = secrets.token_hex(8)
        redis_way.hang(b'"state":"done"')
        cut_off(made, head + clip + tail)
        deadline = time.monotonic() + 20
        while redis_way.hung == 0:
            assert time.monotonic() < deadline, api.text()[-3000:]
            time.sleep(0.05)
        job_id = claim_of(made)["job"]
        assert redis_client.exists(job_key("vsrq", job_id))  # the job the dead request made
        api.kill()
        api = processes.serving(processes.api(env, port, tmp_path).start(), url)
        time.sleep(2.5)  # the lease
        replayed = send(made, head + clip + tail)
        assert replayed.status_code == 200 and replayed.headers.get("Idempotent-Replayed") == "true", replayed.text
        assert replayed.json()["id"] == job_id
        listed = requests.get(f"{url}/v1/videos?limit=100", headers=auth("dave"), timeout=30).json()["data"]
        assert [job["id"] for job in listed].count(job_id) == 1
        assert send(made, head + clip[:-1] + b"\0" + tail).json()["code"] == "idempotency_key_reused"
    finally:
        api.stop()
        redis_way.close()


def test_a_replica_s_refusals_are_a_connection_to_try_again_not_an_error(tmp_path):
    """What a client of a failing-over endpoint meets from a server that is a replica now: a write refused (READONLY)
    and, where it serves no stale data, a read refused while it has no primary (MASTERDOWN). Each closes the
    connection and is an outage (503 in the API, a retry in a worker), not the request's error (500)."""
    from storage.primary import FailedOver, connect

    port, nowhere = free_ports(2)
    replica = subprocess.Popen(
        [binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--replicaof", "127.0.0.1", str(nowhere),
         "--replica-serve-stale-data", "no", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = connect(f"redis://127.0.0.1:{port}/0", socket_timeout=5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:  # not listening yet
                assert time.monotonic() < deadline
                time.sleep(0.05)
        for command in (lambda: client.get("vsrq:probe"), lambda: client.set("vsrq:probe", 1)):
            with pytest.raises(FailedOver):
                command()
    finally:
        replica.terminate()
        replica.wait(10)


def test_an_ack_a_failover_cut_off_is_sent_anew_or_frees_its_place(tmp_path):
    """A worker busy at a failover finished its job, could not acknowledge its message (its connection reached the
    old primary, now a replica) and took no other message again: a solo worker holds one unacknowledged message at
    most (a trial: 5 failovers of 5 during a job). On kombu's transport as the workers run it, against real Redis
    servers: the ack is sent once more on a new connection, and one that still reaches a replica frees its place."""
    from kombu import Connection, Exchange, Queue

    from storage.primary import FailedOver
    from storage.queue import BROKER_TRANSPORT

    pair = RedisPair(tmp_path)
    a, b = pair.a, pair.b
    exchange = Exchange("vsrq.ack-probe", type="direct")
    queue = Queue("vsrq.ack-probe", exchange, routing_key="probe")

    def one_message(n: int, await_primary_s: float = 0):
        """A message published and taken through the endpoint by a consumer allowed one unacknowledged message."""
        connection = Connection(pair.url, transport=BROKER_TRANSPORT,
                                transport_options={"await_primary_s": await_primary_s})  # fmt: skip
        connection.Producer().publish({"n": n}, exchange=exchange, routing_key="probe", declare=[queue])
        got: list = []
        consumer = connection.Consumer(queue, callbacks=[lambda body, message: got.append(message)], prefetch_count=1)
        consumer.consume()
        connection.drain_events(timeout=10)
        return connection, consumer, got[0]

    try:
        connection, _, message = one_message(1)
        pair.fail_over(a, b, endpoint_moves=True)
        message.ack()  # its connection reaches a replica; the new one, the new primary
        assert pair.server[b].hlen("unacked") == 0
        connection.release()

        connection, consumer, two = one_message(2)
        pair.fail_over(b, a, endpoint_moves=False)  # every connection reaches a replica
        with pytest.raises(FailedOver):
            two.ack()
        assert consumer.channel.qos.can_consume()  # its place is free: the next message is taken once it can be
        connection.release()

        # a worker's connection waits for a primary at the endpoint: an ack cut off while it moves lands
        pair.move_endpoint(a)
        connection, _, message = one_message(3, await_primary_s=20)
        pair.fail_over(a, b, endpoint_moves=False)
        threading.Timer(1.0, pair.move_endpoint, (b,)).start()
        message.ack()
        assert pair.server[b].info("replication")["role"] == "master"
        assert pair.server[b].hkeys("unacked") == [two.delivery_tag.encode()]  # the ack above that failed
        connection.release()
    finally:
        pair.close()
