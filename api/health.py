"""Health, in three views:

    GET /livez        public: this process answers (a liveness probe: nothing it depends on is asked)
    GET /healthz      public: can the service do its job? Redis and the blob store answer (else 503), and jobs make
                      progress (else "degraded"): a model worker on each served queue, a recent reaper pass, no job
                      past its lease. Counts only, no names; kept for a second, so a crowd of callers costs nothing.
    GET /v1/health    with a key: the same, plus each registered worker, who answered Celery's ping (kept
                      `health_ping_cache_s`: one ping per process at a time, never one per caller) and queue depths.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from flask import Blueprint, Response, jsonify

from api.auth import admit_caller
from api.services import services
from storage.overview import health
from storage.workers import WorkerRegistry

blueprint = Blueprint("health", __name__)
detail = Blueprint("health_detail", __name__)
detail.before_request(admit_caller)

PUBLIC_CACHE_S = 1.0
_cache: dict[str, tuple[float, Any]] = {}
_pinging = threading.Lock()


@blueprint.get("/livez")
def livez() -> Response:
    return jsonify(status="ok")


@blueprint.get("/healthz")
def healthz() -> tuple[Response, int]:
    cached = _cache.get("public")
    if cached is None or time.monotonic() - cached[0] > PUBLIC_CACHE_S:
        cached = _cache["public"] = (time.monotonic(), _checks(detailed=False))
    body, status = cached[1]
    return jsonify(body), status


@detail.get("/v1/health")
def detailed() -> tuple[Response, int]:
    body, status = _checks(detailed=True)
    return jsonify(body), status


def _checks(*, detailed: bool) -> tuple[dict[str, Any], int]:
    svc = services()
    checks: dict[str, Any] = {}
    try:
        svc.redis.ping()
        checks["redis"] = {"ok": True}
    except Exception as error:
        checks["redis"] = {"ok": False, "error": type(error).__name__}
    try:
        svc.blobs.check()
        checks["storage"] = {"ok": True, "backend": svc.settings.blob_backend}
    except Exception as error:
        checks["storage"] = {"ok": False, "backend": svc.settings.blob_backend, "error": type(error).__name__}
    problems: list[str] = []
    if checks["redis"]["ok"]:
        registered = WorkerRegistry(svc.redis, ttl_s=svc.settings.worker_ttl_s).list()
        now = health(svc.jobs, registered, list(svc.settings.models.values()), svc.settings.reaper_stale_s)
        problems = now.problems
        checks["workers"] = {"ok": all(now.workers.values()), "seen": sum(now.workers.values()), "queues": now.workers}
        checks["reaper"] = {"ok": now.reaper_ok, "last_pass_s": now.reaper_last_pass_s}
        checks["leases"] = {"ok": not now.overdue_jobs, "overdue": now.overdue_jobs}
        if detailed:
            checks["workers"]["registered"] = [
                {"name": w.name, "queues": w.queues, "model": w.model, "job": w.job} for w in registered
            ]
            checks["workers"]["answering"] = _answering()
            checks["queues"] = {q: svc.jobs.queue_depth(q) for q in sorted(set(svc.settings.models.values()))}
    healthy = checks["redis"]["ok"] and checks["storage"]["ok"]
    status = "unavailable" if not healthy else "degraded" if problems else "ok"
    return {"status": status, "problems": problems, "checks": checks}, 200 if healthy else 503


def _answering() -> list[str] | None:
    """The workers that answered the last Celery ping, pinged again once it is older than the setting; None before
    the first answer. A caller that finds a ping under way takes the last one rather than wait for it."""
    svc = services()
    cached = _cache.get("ping")
    if (cached is None or time.monotonic() - cached[0] > svc.settings.health_ping_cache_s) and _pinging.acquire(
        blocking=False
    ):
        try:
            replies = svc.celery.control.ping(timeout=svc.settings.health_ping_timeout_s)
            cached = _cache["ping"] = (time.monotonic(), sorted(name for reply in replies for name in reply))
        except Exception:  # the broker is down: the Redis check says so
            cached = _cache["ping"] = (time.monotonic(), [])
        finally:
            _pinging.release()
    return cached[1] if cached else None
