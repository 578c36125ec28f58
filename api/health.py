"""Health, in three views:

    GET /livez        public: this process answers (a liveness probe: nothing it depends on is asked)
    GET /healthz      public: can the service do its job? Redis and the blob store answer (else 503), and jobs make
                      progress (else "degraded"): a model worker on each served queue, a recent reaper pass, no job
                      past its lease. Counts only, no names.
    GET /v1/health    with a key: the same, checked at the call, plus each registered worker, who answered Celery's
                      ping (at most `health_ping_cache_s` old) and queue depths.

No request waits for /healthz's checks or the Celery ping: a thread of each API process (`Monitor`) keeps them, so a
probe is answered from memory even while every request thread is busy with Redis or S3 (issue 27: a probe that ran the
checks itself took up to 60 ms under load, and 0.5 s for a ping).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Flask, Response, current_app, jsonify

from api.auth import admit_caller
from api.services import Services, services
from storage.overview import health, redis_problem, storage_problem
from storage.workers import WorkerRegistry

log = logging.getLogger("vsrq.api.health")

blueprint = Blueprint("health", __name__)
detail = Blueprint("health_detail", __name__)
detail.before_request(admit_caller)

CHECK_EVERY_S = 1.0
# How long a caller waits for a process's first checks (started with the process: infra/gunicorn.conf.py), which take
# milliseconds when Redis and S3 answer
FIRST_WAIT_S = 1.0
# Checks older than this mean the thread is stuck in a call (Redis or S3 partitioned: each waits its socket timeout):
# /healthz answers 503 rather than the last good answer.
STALE_S = 5.0

Checks = tuple[dict[str, Any], int]  # body, status


@blueprint.get("/livez")
def livez() -> Response:
    return jsonify(status="ok")


@blueprint.get("/healthz")
def healthz() -> tuple[Response, int]:
    body, status = monitor(current_app).public()
    return jsonify(body), status


@detail.get("/v1/health")
def detailed() -> tuple[Response, int]:
    svc = services()
    body, status = checks(svc, detailed=True)
    if "workers" in body["checks"]:
        body["checks"]["workers"]["answering"] = monitor(current_app).answering()
    return jsonify(body), status


def checks(svc: Services, *, detailed: bool, step: Callable[[str], None] = lambda name: None) -> Checks:
    """Redis, storage, then what Redis says of the workers; `step` is told which before each is asked."""
    found: dict[str, Any] = {}
    try:
        step("Redis")
        svc.redis.ping()
        found["redis"] = {"ok": True}
    except Exception as error:
        found["redis"] = {"ok": False, "error": type(error).__name__, "detail": redis_problem(error)}
    try:
        step("storage")
        svc.blobs.check(write=detailed)  # an operator's look: writes too, an object written and deleted
        found["storage"] = {"ok": True, "backend": svc.settings.blob_backend}
    except Exception as error:
        found["storage"] = {"ok": False, "backend": svc.settings.blob_backend, "error": type(error).__name__,
                            "detail": storage_problem(error)}  # fmt: skip
    problems: list[str] = []
    if found["redis"]["ok"]:
        try:
            step("Redis")
            registered = WorkerRegistry(svc.redis, ttl_s=svc.settings.worker_ttl_s).list()
            now = health(svc.jobs, registered, svc.settings.models, svc.settings.reaper_stale_s)
            problems = now.problems
            served = now.workers
            found["workers"] = {"ok": all(served.values()), "seen": sum(served.values()), "queues": served}
            found["reaper"] = {"ok": now.reaper_ok, "last_pass_s": now.reaper_last_pass_s}
            found["leases"] = {"ok": not now.overdue_jobs, "overdue": now.overdue_jobs}
            if detailed:
                found["workers"]["registered"] = [
                    {"name": w.name, "queues": w.queues, "model": w.model, "job": w.job} for w in registered
                ]
                found["queues"] = {q: svc.jobs.queue_depth(q) for q in sorted(set(svc.settings.models.values()))}
        except Exception as error:  # Redis went away between the ping and these reads
            found["redis"] = {"ok": False, "error": type(error).__name__, "detail": redis_problem(error)}
    # what is down, said as the other problems are: a missing bucket and a refused key were both "ClientError"
    problems += [f"{name}: {found[name]['detail']}" for name in ("redis", "storage") if not found[name]["ok"]]
    healthy = found["redis"]["ok"] and found["storage"]["ok"]
    status = "unavailable" if not healthy else "degraded" if problems else "ok"
    return {"status": status, "problems": problems, "checks": found}, 200 if healthy else 503


class Monitor:
    """One API process's health checks, run by threads of its own: the public checks every `CHECK_EVERY_S`, and,
    from the first detailed call on, Celery's ping every `health_ping_cache_s`. Callers read the last results."""

    def __init__(self, svc: Services) -> None:
        self._svc = svc
        self._public: tuple[float, Checks] | None = None  # (monotonic time checked, result); replaced whole
        self._asking: tuple[str, float] | None = None  # what the checks wait on now, since when
        self._answering: list[str] | None = None
        self._checked, self._pinged = threading.Event(), threading.Event()
        self._ping_started = threading.Lock()
        self.pid = os.getpid()
        self._every(CHECK_EVERY_S, self._check, "health-checks")

    def public(self) -> Checks:
        if self._public is None:  # only right after the process started: the first checks are under way
            self._checked.wait(FIRST_WAIT_S)
        checked = self._public
        age = time.monotonic() - checked[0] if checked else None
        if checked is None or age > STALE_S:
            since = f"for {age:.0f} s" if age is not None else "yet"
            problem = f"the health checks have not finished {since}"
            if (asking := self._asking) is not None:  # a storage that hangs is not a Redis that does
                problem += f": {asking[0]} has not answered for {time.monotonic() - asking[1]:.0f} s"
            return {"status": "unavailable", "problems": [problem], "checks": {}}, 503
        return checked[1]

    def answering(self) -> list[str] | None:
        """The workers that answered the last ping. The first call of a process starts the pings and waits for the
        first answers (up to the ping's timeout); None if they have not come by then."""
        if self._ping_started.acquire(blocking=False):
            self._every(self._svc.settings.health_ping_cache_s, self._ping, "celery-ping")
        self._pinged.wait(self._svc.settings.health_ping_timeout_s + 1)
        return self._answering

    def _check(self) -> None:
        try:
            self._public = (time.monotonic(), checks(self._svc, detailed=False, step=self._ask))
        finally:
            self._asking = None
        self._checked.set()

    def _ask(self, name: str) -> None:
        self._asking = (name, time.monotonic())

    def _ping(self) -> None:
        try:
            replies = self._svc.celery.control.ping(timeout=self._svc.settings.health_ping_timeout_s)
            self._answering = sorted(name for reply in replies for name in reply)
        except Exception:  # the broker is down: the Redis check says so
            self._answering = []
        self._pinged.set()

    @staticmethod
    def _every(interval_s: float, run: Any, name: str) -> None:
        def loop() -> None:
            while True:
                started = time.monotonic()
                try:
                    run()
                except Exception:  # never expected (each check catches its own): logged, and the loop goes on
                    log.exception("health %s failed", name)
                time.sleep(max(interval_s - (time.monotonic() - started), 0.05))

        threading.Thread(target=loop, name=f"vsrq-{name}", daemon=True).start()


_creating = threading.Lock()


def monitor(app: Flask) -> Monitor:
    """The app's monitor, started by the first health call in this process (threads do not survive a fork, and
    gunicorn forks its workers after loading the config)."""
    found = app.extensions.get("vsrq_health")
    if found is None or found.pid != os.getpid():
        with _creating:
            found = app.extensions.get("vsrq_health")
            if found is None or found.pid != os.getpid():
                found = app.extensions["vsrq_health"] = Monitor(app.extensions["vsrq"])
    return found
