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

# KEYS: the owner's queued jobs, running jobs (zsets kept by storage/jobs.py), its reservations (zset by expiry).
# ARGV: limit, reservation token, reservation TTL (ms). Returns 1 when a slot was reserved, else 0.
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local active = redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[2]) + redis.call('ZCARD', KEYS[3])
if active >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
return 1
"""


@dataclass(frozen=True)
class KeyLimits:
    requests: int | None  # per `window_s`
    window_s: int
    active_jobs: int | None  # queued + in progress
    upload_bytes: int


def limits_of(key: ApiKey, settings: Settings) -> KeyLimits:
    """The key's own limits, the service-wide default for each it leaves unset."""
    return KeyLimits(
        requests=key.rate_limit_requests or settings.rate_limit_requests,
        window_s=key.rate_limit_window_s or settings.rate_limit_window_s,
        active_jobs=key.max_active_jobs or settings.max_active_jobs_per_key,
        upload_bytes=key.max_upload_bytes or settings.max_upload_bytes,
    )


class RateLimiter:
    def __init__(self, redis: Redis, prefix: str = "vsrq") -> None:
        self.prefix = prefix
        self._gcra, self._reserve = redis.register_script(_GCRA), redis.register_script(_RESERVE)
        self._redis = redis

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
                f"This key may have {limits.active_jobs} jobs queued or running at once; wait for one to end.",
                headers={"Retry-After": str(ACTIVE_RETRY_AFTER_S)},
            )
        try:
            yield
        finally:
            self._redis.zrem(reservations, token)
