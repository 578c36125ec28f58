"""Service settings, read from `VSRQ_*` environment variables (or a `.env` file); the defaults run the embedded mode:
one machine, Redis on its default loopback port, blobs in a local directory, downloads streamed by the API.

Nested values are JSON, e.g.
    VSRQ_API_KEYS='[{"id": "alice", "token": "sk-...", "webhook_secret": "whsec_..."}]'
    VSRQ_MODELS='{"kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers": "vsrq.k6"}'
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import os
import secrets
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from storage.signatures import InvalidSecret, secret_key

K6_VSR = "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"
MiB = 1024 * 1024


def served_name(model: str) -> str:
    """The name a worker's model is served and reported under: `lanczos`, a hub id as given, a checkpoint directory
    by its own name."""
    path = Path(model)
    return path.resolve().name if model != "lanczos" and path.is_dir() else model


def loopback(bind: str) -> bool:
    """Whether a gunicorn bind (`host:port`, `[v6]:port`, `unix:path`) listens on this machine only."""
    if bind.startswith("unix:"):
        return True
    host = bind.rsplit(":", 1)[0] if bind.count(":") == 1 or bind.startswith("[") else bind
    return loopback_host(host.strip("[]"))


# VSRQ_* names read outside the settings: the client's (a server started in the shell `vsrq dev` printed them into sees
# them too), the corpus', and the Procfile's
OTHER_VARIABLES = frozenset(
    {"VSRQ_API_URL", "VSRQ_TOKEN", "VSRQ_DEV_PORT", "VSRQ_CORPUS_DIR", "VSRQ_WORKER_NAME", "VSRQ_WORKER_QUEUE"}
)


def unknown_variables(known: Iterable[str] = (), other_prefix: str = "VSRQ_WORKER_") -> list[str]:
    """The VSRQ_* variables set that no setting of this process reads (`known`: its own beyond `Settings`; names under
    `other_prefix` are another process's), each with the name it is closest to: the bucket's name misspelt was
    ignored unsaid, and the default bucket used."""
    names = {f"VSRQ_{field.upper()}" for field in Settings.model_fields} | OTHER_VARIABLES | set(known)
    said = []
    for name in sorted(os.environ):
        if not name.startswith("VSRQ_") or name in names or (other_prefix and name.startswith(other_prefix)):
            continue
        close = difflib.get_close_matches(name, names, n=1)
        said.append(f"{name} (not {close[0]}?)" if close else name)
    return said


def say_unknown_variables(log: Any, known: Iterable[str] = (), other_prefix: str = "VSRQ_WORKER_") -> None:
    """Logs, at a process's start, the VSRQ_* names it ignores (`unknown_variables`); `log`: any logger."""
    if unknown := unknown_variables(known, other_prefix):
        log.warning("VSRQ_* variables no setting reads, ignored: %s", ", ".join(unknown))


def loopback_host(host: str) -> bool:
    """Whether `host` (an address, or `localhost`: no other name is looked up) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class ApiKey(BaseModel):
    """One caller: its bearer token, the id its jobs and uploads are filed under, its webhook signing secret."""

    model_config = ConfigDict(hide_input_in_errors=True)  # a refused token or secret is not printed with its error
    # The id appears in storage keys (uploads/{id}/...), so it is kept to a safe alphabet.
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    token: SecretStr = Field(min_length=16)
    webhook_secret: SecretStr | None = None  # whsec_<base64 of 24-64 random bytes> (Standard Webhooks)
    # This key's own limits (api/ratelimit.py); unset: the service-wide defaults (Settings' per-key defaults).
    rate_limit_requests: int | None = Field(None, ge=1)
    rate_limit_window_s: int | None = Field(None, ge=1)
    max_active_jobs: int | None = Field(None, ge=1)
    max_upload_bytes: int | None = Field(None, ge=1)
    max_concurrent_bodies: int | None = Field(None, ge=1)
    # Compute (worker/media/limits.py, storage/budget.py): output size per frame and per job, output per hour
    max_output_pixels: int | None = Field(None, ge=1)
    max_output_megapixel_frames: float | None = Field(None, gt=0)
    megapixel_frames_per_hour: float | None = Field(None, gt=0)

    @field_validator("webhook_secret")
    @classmethod
    def _whsec(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None:
            try:
                secret_key(secret.get_secret_value())
            except InvalidSecret as error:  # the message names the rule, never the value
                raise ValueError(
                    f"webhook_secret {error}; make one with `python -c \"from storage.signatures import new_secret; "
                    f'print(new_secret())"`'
                ) from None
        return secret


class Settings(BaseSettings):
    # `unlimited` lifts a limit that has none as a value (VSRQ_MEGAPIXEL_FRAMES_PER_HOUR=unlimited)
    model_config = SettingsConfigDict(
        env_prefix="VSRQ_", env_file=".env", extra="ignore", env_parse_none_str="unlimited"
    )

    # Redis holds the job records and is Celery's broker.
    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str | None = None  # defaults to redis_url
    # A Redis connection or reply silent this long fails: a partition costs this, not a hang (the kernel never
    # retransmits a request a middlebox accepted and dropped).
    redis_timeout_s: float = Field(10, gt=0)
    # A broker connection of a worker or the reaper that reaches a replica (a failover whose endpoint has not moved
    # yet) or a full primary waits this long for writes to be taken there before it counts as lost (0: at once).
    # Managed Redis moves its endpoint in seconds.
    redis_failover_wait_s: float = Field(30, ge=0)

    # Blob storage: "s3" for any S3 endpoint (SeaweedFS, AWS, R2...), "local" for a directory (embedded mode).
    blob_backend: Literal["s3", "local"] = "local"
    local_blob_dir: Path = Path("var/blobs")
    s3_endpoint_url: str | None = None  # None: AWS itself
    # The endpoint as clients reach it, where that is not the service's own address (a cluster's internal name): the
    # presigned URLs of `content_delivery` "redirect" are signed for it. None: s3_endpoint_url.
    s3_public_url: str | None = None
    s3_bucket: str = "vsrq"
    s3_region: str = "us-east-1"
    s3_access_key: str | None = None
    s3_secret_key: SecretStr | None = None
    s3_part_bytes: int = Field(8 * MiB, ge=5 * MiB)  # multipart threshold and part size (S3's minimum part: 5 MiB)
    s3_upload_concurrency: int = Field(4, ge=1)  # parts in flight: bounds memory to parts x part size
    # A storage request unanswered this long (connecting, or waiting for a reply) fails and is tried again: what a
    # partition costs each try, rather than forever.
    s3_timeout_s: float = Field(60, gt=0)

    # How GET /v1/videos/{id}/content delivers: through the API, or a 302 to a presigned URL (S3 only).
    content_delivery: Literal["stream", "redirect"] = "stream"
    presign_ttl_s: int = Field(3600, ge=1, le=7 * 24 * 3600)

    api_keys: list[ApiKey] = []
    # "none" serves requests without a known key as one local owner (the first key's id, else "local"): the embedded
    # stack on loopback, so SGLang's request works without a header. Refused on a non-loopback `bind` unless
    # `auth_none_public` says the operator means it (a private network behind its own gate).
    auth: Literal["keys", "none"] = "keys"
    auth_none_public: bool = False
    poll_after_ms: int = Field(1000, ge=0)  # `openai-poll-after-ms` on a running job: how soon to look again
    webhook_allow_loopback: bool = False  # development only: lets webhooks reach a receiver on this machine
    # Webhook deliveries (worker/webhooks.py): a failed attempt is retried after about base x 2^n (with jitter, at
    # most retry_max_s), webhook_max_attempts in all; the defaults spread 8 attempts over 2-4 hours.
    webhook_ca_bundle: Path | None = None  # the CAs receivers are verified against (None: certifi's)
    webhook_timeout_s: float = Field(10, gt=0)  # one attempt, connection to response
    webhook_max_attempts: int = Field(8, ge=1)
    webhook_retry_base_s: float = Field(120, gt=0)
    webhook_retry_max_s: float = Field(4 * 3600, gt=0)
    # A webhook handed to a delivery worker is handed out again if its attempt has not ended by then (the worker died;
    # sooner once that worker is gone from the registry: worker/gone.py)
    webhook_claim_s: float = Field(120, gt=0)

    # Inputs named by an https URL, fetched by the worker (worker/fetch.py)
    fetch_allow_loopback: bool = False  # development only: lets inputs come from a server on this machine
    fetch_ca_bundle: Path | None = None  # the CAs input URLs are verified against (None: certifi's)
    fetch_connect_timeout_s: float = Field(10, gt=0)
    fetch_read_timeout_s: float = Field(60, gt=0)  # per read: a stalled origin ends the attempt, and it is retried
    # An origin that is down, overloaded or slow (5xx, 429, a reset, a timeout) gets time before the job's next attempt:
    # about base x 2^(attempt-1) with jitter, at most the max, never sooner than its Retry-After (worker.backoff)
    fetch_retry_base_s: float = Field(30, gt=0)
    fetch_retry_max_s: float = Field(600, gt=0)

    # Served models and the Celery queue (pipeline group) of each; the first is the default.
    models: dict[str, str] = {K6_VSR: "vsrq.k6"}

    # Limits and retention. Per-key defaults (a key's own values win; README: "Limits" says how to raise them), sized
    # so that one person, the web app or `vsrq bulk` at its default concurrency never meets them; None: unlimited.
    max_upload_bytes: int = Field(2 * 1024 * MiB, ge=1)
    max_form_field_bytes: int = Field(64 * 1024, ge=1024)  # one non-file multipart field
    rate_limit_requests: int | None = Field(1200, ge=1)  # per window: 20/s sustained, a 1200-request burst
    rate_limit_window_s: int = Field(60, ge=1)
    max_active_jobs_per_key: int | None = Field(1000, ge=1)  # queued + running
    # Failed authentications per client address (a bad token): past this, every request that carries a token from
    # that address answers 429 until the window has passed, so guessing is throttled and learns nothing meanwhile.
    auth_failures_per_window: int | None = Field(60, ge=1)
    auth_failure_window_s: int = Field(60, ge=1)
    # Reverse proxies in front of the API (infra/nginx.conf: 1) whose X-Forwarded-For names the client: without it
    # every client behind a proxy would share the proxy's address, and its failed-authentication budget.
    trusted_proxies: int = Field(0, ge=0)
    # Request bodies (api/body.py): a client silent for body_idle_timeout_s mid-request, or sending slower than
    # body_min_bytes_per_s on average once body_grace_s has passed, is answered 408; a key sends at most
    # max_concurrent_bodies_per_key bodies at once (more: 429 before a byte is read), so slow clients of one key
    # hold at most that many of the API's threads.
    body_idle_timeout_s: float = Field(30, gt=0)
    body_grace_s: float = Field(30, gt=0)
    body_min_bytes_per_s: int = Field(8 * 1024, ge=0)  # 64 kbit/s
    max_concurrent_bodies_per_key: int | None = Field(8, ge=1)  # half of gunicorn's default 2 x 8 threads
    # Compute per job, checked at probe time before any work (worker/media/limits.py): output pixels per frame (8K: the
    # largest input, 4K, at x2; a 15360x8640 output took 8.36 GB of worker RSS for 4 frames, a quarter of that per
    # frame fits a worker host), output megapixel-frames per job (10 min of 4K at 30 fps); and output megapixel-frames
    # per key per hour (storage/budget.py; None: unlimited).
    max_output_pixels: int | None = Field(7680 * 4320, ge=1)
    max_output_megapixel_frames: float | None = Field(150_000, gt=0)
    # The input's length (a slideshow lecture at 1 fps is long in seconds and small in compute); its frames at most
    # 60 a second of it (`worker.costs.job_limits`); None: the compute limits above bound it alone
    max_input_seconds: float | None = Field(3600, gt=0)
    megapixel_frames_per_hour: float | None = Field(1_000_000, gt=0)
    result_ttl_s: int = Field(7 * 24 * 3600, ge=60)  # finished jobs keep their output this long (expires_at)
    # The reaper's storage sweep (storage.lifecycle): uploads no job claims, writes never finished
    upload_ttl_s: int = Field(24 * 3600, ge=1)  # an upload (POST /v1/uploads) no live job names is deleted after this
    multipart_abort_s: int = Field(24 * 3600, ge=1)  # incomplete multipart uploads older than this are aborted
    sweep_interval_s: float = Field(600, gt=0)
    idempotency_ttl_s: int = Field(24 * 3600, ge=60)
    idempotency_in_flight_ttl_s: int = Field(3600, ge=10)  # a create's claim outlives its last renewal this long
    idempotency_lease_s: float = Field(30, ge=1)  # a create not heard from this long died: a repeat takes its key
    list_limit_max: int = Field(100, ge=1)

    # Workers and recovery
    lease_s: int = Field(120, ge=1)  # a worker that misses heartbeats this long loses its job to the reaper
    max_attempts: int = Field(3, ge=1)  # then the job fails: redelivering an OOM forever helps nobody
    # A queued job whose Celery message was not confirmed sent this long (the sender died) gets one from the reaper
    enqueue_grace_s: float = Field(30, gt=0)
    # A queued job whose message no queue and no consumer has held this long (a consumer killed as it took it, and at
    # least two of the reaper's passes) gets another: a live consumer holds one outside both for microseconds
    lost_message_grace_s: float = Field(30, ge=0)
    # A queued job whose message a consumer took this long ago and still holds unacknowledged: that consumer died
    # before its lease (a worker leases first thing), and kombu gives it back only after the visibility timeout
    # (hours): it counts as lost too (worker.lost). Older than a worker's longest wait before its lease (a few seconds)
    lost_unacked_s: float = Field(300, gt=0)
    longest_job_s: int = Field(12 * 3600, ge=60)  # Celery's visibility timeout is set above this
    # Overrides kombu's Redis transport options, e.g. {"visibility_timeout": 5, "unacked_restore_interval": 1,
    # "unacked_restore_throttle": 1} to see an unacknowledged message redelivered in seconds.
    broker_transport_options: dict[str, int | float | str] = {}
    health_ping_timeout_s: float = Field(0.5, gt=0)
    health_ping_cache_s: float = Field(10, gt=0)  # one Celery ping per API process this often, whoever asks
    reap_interval_s: float = Field(10, gt=0)  # between the reaper's passes (worker/reaper.py)
    reaper_stale_s: float = Field(60, gt=0)  # a reaper whose last pass is older than this is reported dead

    # The API's server (infra/gunicorn.conf.py): threads, not more processes (requests mostly wait on I/O)
    bind: str = "127.0.0.1:8000"  # where gunicorn listens; `auth` "none" checks it is loopback
    web_workers: int = Field(2, ge=1)
    web_threads: int = Field(8, ge=1)
    # How long an idle kept-alive connection stays open (gunicorn's `keepalive`; 0: none). Past gunicorn's 2 s, the
    # common poll intervals of 2-3 s met the server's close as they sent; longer than a load balancer's idle timeout
    # (60 s on AWS ALB) in front, as nginx's 75 s. An idle connection holds no thread, only a socket.
    web_keepalive_s: int = Field(75, ge=0)

    # Operations: log lines (storage/logs.py) and each Celery worker's Prometheus port (worker/metrics.py)
    log_format: Literal["json", "text"] = "json"  # text for people (the dev stack), json for a log pipeline
    log_level: str = "INFO"
    metrics_port: int = Field(0, ge=0, le=65535)  # 0: no /metrics on the workers
    metrics_host: str = "127.0.0.1"  # 0.0.0.0 in a container, for the scraper
    # a worker missing from the registry this long is gone (storage/workers.py); the reaper takes its jobs back
    worker_ttl_s: int = Field(30, ge=3)  # half this later (worker/gone.py)

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
        if self.auth == "none" and not self.auth_none_public and not loopback(self.bind):
            raise ValueError(
                f"auth=none would serve anyone who reaches {self.bind}: bind to loopback, configure VSRQ_API_KEYS, "
                "or set VSRQ_AUTH_NONE_PUBLIC=true if a gate in front of it does the authentication"
            )
        if self.idempotency_lease_s >= self.idempotency_in_flight_ttl_s:
            raise ValueError("idempotency_lease_s must be below idempotency_in_flight_ttl_s: a claim outlives its lease")
        if self.webhook_claim_s <= self.webhook_timeout_s:
            raise ValueError("webhook_claim_s must exceed webhook_timeout_s: an attempt in flight would be handed out")
        return self

    @cached_property
    def anonymous_key(self) -> ApiKey | None:
        """Who a request without a known key acts as when auth is off: the first key's owner, else "local"."""
        if self.auth != "none":
            return None
        if self.api_keys:
            return self.api_keys[0]
        return ApiKey(id="local", token=SecretStr(secrets.token_urlsafe(32)))

    def compute_limits(self, key_id: str) -> tuple[int | None, float | None, float | None]:
        """(output pixels per frame, output megapixel-frames per job, per hour) for a key: its own, else the
        service-wide ones."""
        key = next((key for key in self.api_keys if key.id == key_id), None)
        return (
            (key and key.max_output_pixels) or self.max_output_pixels,
            (key and key.max_output_megapixel_frames) or self.max_output_megapixel_frames,
            (key and key.megapixel_frames_per_hour) or self.megapixel_frames_per_hour,
        )

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
