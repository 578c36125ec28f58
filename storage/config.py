"""Service settings, read from `VSRQ_*` environment variables (or a `.env` file); the defaults run the embedded mode:
one machine, Redis on its default loopback port, blobs in a local directory, downloads streamed by the API.

Nested values are JSON, e.g.
    VSRQ_API_KEYS='[{"id": "alice", "token": "sk-...", "webhook_secret": "whsec_..."}]'
    VSRQ_MODELS='{"kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers": "vsrq.k6"}'
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

K6_VSR = "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"
MiB = 1024 * 1024


class ApiKey(BaseModel):
    """One caller: its bearer token, the id its jobs and uploads are filed under, its webhook signing secret."""

    # The id appears in storage keys (uploads/{id}/...), so it is kept to a safe alphabet.
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    token: SecretStr = Field(min_length=16)
    webhook_secret: SecretStr | None = None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VSRQ_", env_file=".env", extra="ignore")

    # Redis holds the job records and is Celery's broker.
    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str | None = None  # defaults to redis_url

    # Blob storage: "s3" for any S3 endpoint (SeaweedFS, AWS, R2...), "local" for a directory (embedded mode).
    blob_backend: Literal["s3", "local"] = "local"
    local_blob_dir: Path = Path("var/blobs")
    s3_endpoint_url: str | None = None  # None: AWS itself
    s3_bucket: str = "vsrq"
    s3_region: str = "us-east-1"
    s3_access_key: str | None = None
    s3_secret_key: SecretStr | None = None
    s3_part_bytes: int = Field(8 * MiB, ge=5 * MiB)  # multipart threshold and part size (S3's minimum part: 5 MiB)
    s3_upload_concurrency: int = Field(4, ge=1)  # parts in flight: bounds memory to parts x part size

    # How GET /v1/videos/{id}/content delivers: through the API, or a 302 to a presigned URL (S3 only).
    content_delivery: Literal["stream", "redirect"] = "stream"
    presign_ttl_s: int = Field(3600, ge=1, le=7 * 24 * 3600)

    api_keys: list[ApiKey] = []
    webhook_allow_loopback: bool = False  # development only: lets webhooks reach a receiver on this machine

    # Served models and the Celery queue (pipeline group) of each; the first is the default.
    models: dict[str, str] = {K6_VSR: "vsrq.k6"}

    # Limits and retention
    max_upload_bytes: int = Field(4 * 1024 * MiB, ge=1)
    max_form_field_bytes: int = Field(64 * 1024, ge=1024)  # one non-file multipart field
    result_ttl_s: int = Field(7 * 24 * 3600, ge=60)  # finished jobs keep their output this long (expires_at)
    idempotency_ttl_s: int = Field(24 * 3600, ge=60)
    idempotency_in_flight_ttl_s: int = Field(3600, ge=10)  # a claim whose request died is released after this
    list_limit_max: int = Field(100, ge=1)

    # Workers and recovery
    lease_s: int = Field(120, ge=1)  # a worker that misses heartbeats this long loses its job to the reaper
    max_attempts: int = Field(3, ge=1)  # then the job fails: redelivering an OOM forever helps nobody
    longest_job_s: int = Field(12 * 3600, ge=60)  # Celery's visibility timeout is set above this
    health_ping_timeout_s: float = Field(0.5, gt=0)

    @field_validator("models")
    @classmethod
    def _some_model(cls, models: dict[str, str]) -> dict[str, str]:
        if not models:
            raise ValueError("at least one model must be served")
        return models

    @model_validator(mode="after")
    def _distinct_keys(self) -> Settings:
        tokens = [key.token.get_secret_value() for key in self.api_keys]
        if len(set(tokens)) != len(tokens) or len({key.id for key in self.api_keys}) != len(self.api_keys):
            raise ValueError("api_keys: every key needs its own id and token")
        if self.blob_backend == "s3" and not (self.s3_access_key and self.s3_secret_key):
            raise ValueError("the s3 blob backend needs s3_access_key and s3_secret_key")
        return self

    @property
    def default_model(self) -> str:
        return next(iter(self.models))

    @property
    def celery_broker_url(self) -> str:
        return self.broker_url or self.redis_url

    @cached_property
    def keys_by_token_hash(self) -> dict[bytes, ApiKey]:
        """Tokens are looked up by their SHA-256, so a lookup's timing says nothing about a token's prefix."""
        return {hashlib.sha256(key.token.get_secret_value().encode()).digest(): key for key in self.api_keys}
