"""The Flask app factory: `gunicorn 'api.app:create_app()'` (see the Procfile and infra/gunicorn.conf.py).

Nothing here imports torch or the engine: jobs are handed to the GPU workers as Celery messages, by task name.
"""

from __future__ import annotations

import logging

from flask import Flask, g, request
from werkzeug.middleware.proxy_fix import ProxyFix

from api import body, errors, health, metrics, models, openapi, request_id, uploads, videos, web
from api.idempotency import Idempotency
from api.ratelimit import RateLimiter
from api.services import Services
from storage.blobs import open_blob_store
from storage.config import Settings
from storage.jobs import JobStore, open_redis
from storage.logs import current_job
from storage.queue import make_celery
from storage.uploads import UploadStore

log = logging.getLogger("vsrq.api")


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings()
    if not settings.api_keys and settings.auth != "none":
        raise RuntimeError("no API keys configured: set VSRQ_API_KEYS (see storage/config.py)")
    if settings.anonymous_key is not None:
        log.warning(
            "AUTHENTICATION IS OFF (VSRQ_AUTH=none): every request to %s without a known key acts as %r",
            settings.bind,
            settings.anonymous_key.id,
        )
    redis = open_redis(settings)
    app = Flask("vsrq", static_folder=None)
    app.json.sort_keys = False  # objects keep their documented field order
    app.extensions["vsrq"] = Services(
        settings=settings,
        redis=redis,
        blobs=open_blob_store(settings),
        jobs=JobStore.from_settings(settings, redis),
        celery=make_celery(settings),
        idempotency=Idempotency(
            redis, settings.idempotency_ttl_s, settings.idempotency_in_flight_ttl_s, settings.idempotency_lease_s
        ),
        limiter=RateLimiter(redis),
        uploads=UploadStore(redis, ttl_s=settings.upload_ttl_s),
    )
    request_id.register(app)  # first: every answer and every line logged for it carries the id
    errors.register(app)
    body.register(app)
    if settings.trusted_proxies:  # the client's address, as the proxies in front saw it (api/auth.py throttles by it)
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=settings.trusted_proxies)
    metrics.instrument(app)
    app.before_request(_log_job_id)
    app.teardown_request(_forget_job_id)
    for module in (videos, uploads, models, health, web, metrics):
        app.register_blueprint(module.blueprint)
    app.register_blueprint(health.detail)
    openapi.register(app)
    return app


def _log_job_id() -> None:
    """A request about one job logs its id on every line (storage.logs), until the request ends."""
    g.job_log_token = current_job.set((request.view_args or {}).get("job_id"))


def _forget_job_id(_: BaseException | None) -> None:
    if (token := g.pop("job_log_token", None)) is not None:
        current_job.reset(token)
