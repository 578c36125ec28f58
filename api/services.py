"""What the request handlers use, built once per process by the app factory."""

from __future__ import annotations

from dataclasses import dataclass

from celery import Celery
from flask import current_app
from redis import Redis

from api.idempotency import Idempotency
from api.ratelimit import RateLimiter
from storage.blobs import BlobStore
from storage.config import Settings
from storage.jobs import JobStore
from storage.uploads import UploadStore


@dataclass(frozen=True)
class Services:
    settings: Settings
    redis: Redis
    blobs: BlobStore
    jobs: JobStore
    celery: Celery
    idempotency: Idempotency
    limiter: RateLimiter
    uploads: UploadStore


def services() -> Services:
    return current_app.extensions["vsrq"]
