"""The workers' Celery app, built from the settings by the queue contract both sides share (storage.queue).

Importing it reads the settings: `celery -A` and the worker's modules import it, the API builds its own.
"""

from __future__ import annotations

from storage.config import Settings
from storage.queue import make_celery

settings = Settings()
app = make_celery(settings, await_primary_s=settings.redis_failover_wait_s)
