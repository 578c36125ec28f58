"""`Idempotency-Key` on create, after Stripe and the IETF draft: the first request with a key claims it; once it
succeeds, its response is kept for 24 h with a fingerprint of the request. A repeat with the same fingerprint gets
the same response replayed; a repeat while the first is still running gets 409; a repeat with a different request
gets 422. Requests that fail are not remembered, so the caller can fix and retry under the same key.

The 409 carries `Retry-After`: as long again as the first request has run so far (an upload that took 20 s is not
likely done in 1), from 1 s to 60 s and never past the moment its claim lapses. A client that doubles nothing itself
(OpenAI's SDK retries twice, waiting what the header says) thus waits out a first request up to about 4 times as long
as it had run when the repeat came, instead of giving up after two half-second backoffs.

Keys are per API key: one caller's key never replays another caller's response. Deleting the job a key made frees
the key: a replay would answer with a job nobody can fetch any more, so the same request makes a new one.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel
from redis import Redis

from api.errors import ApiError

HEADER = "Idempotency-Key"
MAX_RETRY_AFTER_S = 60  # OpenAI's SDK gives up at once on one over 120 s


class Remembered(BaseModel):
    state: Literal["in_flight", "done"]
    started_at: float | None = None  # in flight: when the first request claimed the key (epoch seconds)
    fingerprint: str | None = None
    status: int | None = None
    body: Any = None


def fingerprint(kind: str, content: Any) -> str:
    """A stable digest of what a request asks for (field order and encoding do not matter)."""
    return hashlib.sha256(json.dumps([kind, content], sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def key_from(headers) -> str | None:
    key = headers.get(HEADER)
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not key.isprintable():
        raise ApiError(400, "invalid_idempotency_key", f"`{HEADER}` must be 1 to 255 printable characters.")
    return key


class Idempotency:
    def __init__(self, redis: Redis, ttl_s: int, in_flight_ttl_s: int, prefix: str = "vsrq") -> None:
        self.redis, self.ttl_s, self.in_flight_ttl_s, self.prefix = redis, ttl_s, in_flight_ttl_s, prefix

    def _key(self, owner: str, key: str) -> str:
        return f"{self.prefix}:idem:{owner}:{hashlib.sha256(key.encode()).hexdigest()}"

    def claim(self, owner: str, key: str) -> Remembered | None:
        """None when this request now holds the key; otherwise what the key already holds. The in-flight claim
        expires on its own, so a request that died does not block its key for a day."""
        name = self._key(owner, key)
        while True:
            claim = Remembered(state="in_flight", started_at=time.time()).model_dump_json()
            if self.redis.set(name, claim, nx=True, ex=self.in_flight_ttl_s):
                return None
            raw = self.redis.get(name)
            if raw is not None:  # else it expired between the two calls: claim again
                return Remembered.model_validate_json(raw)

    def _made(self, job_id: str) -> str:
        return f"{self.prefix}:idem-made:{job_id}"

    def finish(self, owner: str, key: str, fingerprint: str, status: int, body: dict[str, Any]) -> None:
        done = Remembered(state="done", fingerprint=fingerprint, status=status, body=body)
        name = self._key(owner, key)
        with self.redis.pipeline() as pipe:
            pipe.set(name, done.model_dump_json(), ex=self.ttl_s)
            pipe.set(self._made(body["id"]), name, ex=self.ttl_s)  # which key made the job, for `forget_job`
            pipe.execute()

    def forget_job(self, job_id: str) -> None:
        """Frees the key that made `job_id` (now deleted), unless it has since been released and made another."""
        with self.redis.pipeline() as pipe:  # GET and DEL in one transaction: GETDEL needs Redis 6.2
            name, _ = pipe.get(self._made(job_id)).delete(self._made(job_id)).execute()
        raw = self.redis.get(name) if name is not None else None
        if raw is not None and (Remembered.model_validate_json(raw).body or {}).get("id") == job_id:
            self.redis.delete(name)

    def retry_after_s(self, remembered: Remembered) -> int:
        """Seconds a repeat of an in-flight request should wait (see the module's docstring)."""
        if remembered.started_at is None:  # claimed by an API of an earlier version
            return 1
        elapsed = max(0.0, time.time() - remembered.started_at)
        lapses_in = self.in_flight_ttl_s - elapsed
        return max(1, min(math.ceil(elapsed), MAX_RETRY_AFTER_S, math.ceil(lapses_in)))

    def release(self, owner: str, key: str) -> None:
        self.redis.delete(self._key(owner, key))

    def check_replay(self, remembered: Remembered, request_fingerprint: Callable[[], str]) -> Remembered:
        """What to answer a repeat with: the remembered response, or the error that says why not. The repeat's
        fingerprint (which may mean reading its whole body) is computed only when there is one to compare with."""
        if remembered.state == "in_flight":
            wait = self.retry_after_s(remembered)
            raise ApiError(
                409,
                "idempotency_in_flight",
                f"A request with this `{HEADER}` is still being processed; retry in {wait} s.",
                headers={"Retry-After": str(wait)},
            )
        if remembered.fingerprint != request_fingerprint():
            raise ApiError(422, "idempotency_key_reused", f"This `{HEADER}` was used for a different request.")
        return remembered
