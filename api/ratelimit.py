"""Per-key limits: requests per window, jobs queued or running at once, and upload bytes. Each key may set its own
(storage/config.py `ApiKey`); what it leaves unset takes the service-wide default, and None means unlimited.

Requests are counted with GCRA (the generic cell rate algorithm: one timestamp per key, a burst of `requests` at
once, then one every `window / requests` seconds), and job slots are reserved against the owner's queued and running
jobs, each as one Lua script, so concurrent API processes can never let more through than the limit. A refusal is
429 problem+json with `Retry-After`; an upload over the key's size is 413 where it streams (api/uploads.py).

Hand-written rather than the `limits` library: its Redis extra pins redis-py below the version this service runs,
and it has nothing for the concurrency quota, which needs a script of its own anyway.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from redis import Redis

from api.errors import ApiError
from storage.budget import Budget
from storage.config import ApiKey, Settings

# When a job slot frees depends on jobs that take minutes: a client is told to look again after a poll interval.
ACTIVE_RETRY_AFTER_S = 30
# A slot is reserved before the upload streams and released once the job exists; one whose request died (the
# process was killed mid-upload) frees itself after this.
RESERVATION_TTL_S = 3600

# KEYS[1]: the key's theoretical arrival time (ms). ARGV: emission interval (ms), window (ms).
# Returns 0 when admitted, else the milliseconds until a request would be.
_GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local interval, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = math.max(tonumber(redis.call('GET', KEYS[1]) or 0), now)
local allow_at = tat + interval - window
if now < allow_at then return math.ceil(allow_at - now) end  -- an integer reply: never 0 here
redis.call('SET', KEYS[1], tat + interval, 'PX', window)
return 0
"""

# KEYS: zsets that count against the limit (for jobs: the owner's queued and running jobs, kept by storage/jobs.py),
# the last one the reservations (zset by expiry). ARGV: limit, reservation token, reservation TTL (ms).
# Returns 1 when a slot was reserved, else 0.
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local slots = KEYS[#KEYS]
redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
local active = 0
for i = 1, #KEYS do active = active + redis.call('ZCARD', KEYS[i]) end
if active >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', slots, now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', slots, ARGV[3])
return 1
"""


@dataclass(frozen=True)
class KeyLimits:
    requests: int | None  # per `window_s`
    window_s: int
    active_jobs: int | None  # queued + in progress
    upload_bytes: int
    bodies: int | None  # request bodies being read at once


def limits_of(key: ApiKey, settings: Settings) -> KeyLimits:
    """The key's own limits, the service-wide default for each it leaves unset."""
    return KeyLimits(
        requests=key.rate_limit_requests or settings.rate_limit_requests,
        window_s=key.rate_limit_window_s or settings.rate_limit_window_s,
        active_jobs=key.max_active_jobs or settings.max_active_jobs_per_key,
        upload_bytes=key.max_upload_bytes or settings.max_upload_bytes,
        bodies=key.max_concurrent_bodies or settings.max_concurrent_bodies_per_key,
    )


class RateLimiter:
    def __init__(self, redis: Redis, prefix: str = "vsrq") -> None:
        self.prefix = prefix
        self._gcra, self._reserve = redis.register_script(_GCRA), redis.register_script(_RESERVE)
        self._redis = redis
        self._budget = Budget(redis, prefix)

    def check_budget(self, key: ApiKey, settings: Settings) -> None:
        """429 while the key's last hour of jobs has spent its compute budget (the worker charges each job)."""
        _, _, per_hour = settings.compute_limits(key.id)
        if per_hour is None:
            return
        used, wait_s = self._budget.used(key.id)
        full_s = self._budget.full_for(key.id)  # a job of the key did not fit: refused until it would have
        if used >= per_hour or full_s:
            raise ApiError(
                429,
                "compute_budget_exceeded",
                f"This key's jobs of the last hour spent its budget of {per_hour:,g} output megapixel-frames per "
                "hour (megapixel_frames_per_hour); retry after the pause.",
                headers={"Retry-After": str(full_s or wait_s)},
            )

    def admit(self, key: ApiKey, settings: Settings) -> None:
        """Counts one request of `key`; 429 when it is over its rate."""
        limits = limits_of(key, settings)
        if limits.requests is None:
            return
        window_ms = limits.window_s * 1000
        wait_ms = int(
            self._gcra(keys=[f"{self.prefix}:rate:{key.id}"], args=[window_ms / limits.requests, window_ms])
        )
        if wait_ms > 0:
            raise ApiError(
                429,
                "rate_limited",
                f"This key may send {limits.requests} requests per {limits.window_s} s; retry after the pause.",
                headers={"Retry-After": str(max(1, math.ceil(wait_ms / 1000)))},
            )

    def guessing(self, address: str, settings: Settings) -> int:
        """Seconds until `address` may try a token again after too many failures; 0 when it may now."""
        if settings.auth_failures_per_window is None:
            return 0
        window_ms = settings.auth_failure_window_s * 1000
        tat = self._redis.get(f"{self.prefix}:authfail:{address}")
        wait_ms = int(tat or 0) + window_ms / settings.auth_failures_per_window - window_ms - self._now_ms()
        return max(0, math.ceil(wait_ms / 1000))

    def failed(self, address: str, settings: Settings) -> int:
        """Counts a failed authentication from `address`: seconds to wait when it is over the rate, else 0."""
        if settings.auth_failures_per_window is None:
            return 0
        window_ms = settings.auth_failure_window_s * 1000
        interval = window_ms / settings.auth_failures_per_window
        wait_ms = int(self._gcra(keys=[f"{self.prefix}:authfail:{address}"], args=[interval, window_ms]))
        return max(1, math.ceil(wait_ms / 1000)) if wait_ms > 0 else 0

    def _now_ms(self) -> int:
        seconds, micros = self._redis.time()
        return seconds * 1000 + micros // 1000

    def body_slot(self, key: ApiKey, settings: Settings) -> str | None:
        """Takes one of the key's body slots for this request (release it with `release_body`): None when the key
        has no limit. 429 when all are taken: the request is answered before a byte of its body is read."""
        limits = limits_of(key, settings)
        if limits.bodies is None:
            return None
        token = secrets.token_hex(8)
        # a slot whose request died with its process frees itself once no body could still be read in it
        ttl_ms = int((settings.body_grace_s + settings.body_idle_timeout_s) * 1000) + 3_600_000
        if not self._reserve(keys=[f"{self.prefix}:bodies:{key.id}"], args=[limits.bodies, token, ttl_ms]):
            raise ApiError(
                429,
                "too_many_uploads",
                f"This key may send {limits.bodies} request bodies at once; wait for one to finish.",
                headers={"Retry-After": "1"},
            )
        return token

    def release_body(self, key: ApiKey, token: str) -> None:
        self._redis.zrem(f"{self.prefix}:bodies:{key.id}", token)

    @contextmanager
    def job_slot(self, key: ApiKey, settings: Settings, active_keys: list[str]) -> Iterator[None]:
        """Holds one of the key's job slots while its job is being created; 429 when all are taken. Once the job
        exists it counts itself (in `active_keys`: the key's queued and running jobs), so the hold ends."""
        limits = limits_of(key, settings)
        if limits.active_jobs is None:
            yield
            return
        reservations, token = f"{self.prefix}:slots:{key.id}", secrets.token_hex(8)
        reserved = self._reserve(
            keys=[*active_keys, reservations], args=[limits.active_jobs, token, RESERVATION_TTL_S * 1000]
        )
        if not reserved:
            raise ApiError(
                429,
                "too_many_active_jobs",
                f"This key may have {limits.active_jobs} job{'s' * (limits.active_jobs != 1)} queued or running at "
                "once; wait for one to end.",
                headers={"Retry-After": str(ACTIVE_RETRY_AFTER_S)},
            )
        try:
            yield
        finally:
            self._redis.zrem(reservations, token)
