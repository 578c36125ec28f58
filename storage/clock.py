"""Redis's clock: the one time every host of the service reads alike (leases, due times, windows of use), where each
machine's own may drift."""

from __future__ import annotations

from redis import Redis


def redis_now(redis: Redis) -> float:
    """Redis's time, in seconds since the epoch."""
    seconds, micros = redis.time()
    return seconds + micros / 1_000_000
