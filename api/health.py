"""GET /healthz: can this API do its job? Redis and the blob store must answer (else 503); workers are counted, not
required (jobs queue up while none runs, and the API is still healthy)."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify

from api.services import services
from storage.workers import WorkerRegistry

blueprint = Blueprint("health", __name__)


@blueprint.get("/healthz")
def healthz() -> tuple[Response, int]:
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
    try:
        # Celery's broadcast ping: every live worker, whatever its queue, answers within the timeout.
        replies = svc.celery.control.ping(timeout=svc.settings.health_ping_timeout_s)
        workers = sorted(name for reply in replies for name in reply)
        checks["workers"] = {"ok": bool(workers), "seen": len(workers), "names": workers}
    except Exception as error:
        checks["workers"] = {"ok": False, "seen": 0, "error": type(error).__name__}
    if checks["redis"]["ok"]:
        checks["queues"] = {queue: svc.jobs.queue_depth(queue) for queue in sorted(set(svc.settings.models.values()))}
        # what the registry says each worker runs (storage.workers; `vsrq status` shows more)
        registered = WorkerRegistry(svc.redis, ttl_s=svc.settings.worker_ttl_s).list()
        checks["workers"]["registered"] = [{"name": w.name, "queues": w.queues, "job": w.job} for w in registered]
    healthy = checks["redis"]["ok"] and checks["storage"]["ok"]
    status = "ok" if healthy and checks["workers"]["ok"] else "degraded" if healthy else "unavailable"
    return jsonify(status=status, checks=checks), 200 if healthy else 503
