"""The Flask app factory: `gunicorn 'api.app:create_app()'` (see the Procfile and infra/gunicorn.conf.py).

Nothing here imports torch or the engine: jobs are handed to the GPU workers as Celery messages, by task name.
"""

from __future__ import annotations

from flask import Flask
from redis import Redis

from api import errors, health, uploads, videos
from api.idempotency import Idempotency
from api.services import Services
from storage.blobs import open_blob_store
from storage.config import Settings
from storage.jobs import JobStore
from worker.celery_app import make_celery


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings()
    if not settings.api_keys:
        raise RuntimeError("no API keys configured: set VSRQ_API_KEYS (see storage/config.py)")
    redis = Redis.from_url(settings.redis_url, health_check_interval=30)
    app = Flask("vsrq", static_folder=None)
    app.json.sort_keys = False  # objects keep their documented field order
    app.extensions["vsrq"] = Services(
        settings=settings,
        redis=redis,
        blobs=open_blob_store(settings),
        jobs=JobStore(redis, result_ttl_s=settings.result_ttl_s, max_attempts=settings.max_attempts),
        celery=make_celery(settings),
        idempotency=Idempotency(redis, settings.idempotency_ttl_s, settings.idempotency_in_flight_ttl_s),
    )
    errors.register(app)
    for module in (videos, uploads, health):
        app.register_blueprint(module.blueprint)
    return app
