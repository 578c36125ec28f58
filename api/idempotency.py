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

A claim is held by its request while it runs (`Claim.held`: renewed every third of `lease_s` on a thread of its own),
and names the job it will make, and the request's fingerprint once known, before the job is made. An API process
that dies mid-request (a `kill -9`, the OOM killer, a node lost) stops renewing it: a repeat `lease_s` later finds it
lapsed and either replays the job that request had made (the crash came after it) or takes the key over. Until then
its claim held the key for `in_flight_ttl_s` (an hour): `vsrq bulk` run again after a restart gave up on it, and a
job made just before the crash was made again by the run after the hour.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import BaseModel
from redis import Redis

from api.errors import ApiError
from storage.jobs import new_job_id

log = logging.getLogger("vsrq.api")

HEADER = "Idempotency-Key"
MAX_RETRY_AFTER_S = 60  # OpenAI's SDK gives up at once on one over 120 s


class Remembered(BaseModel):
    state: Literal["in_flight", "done"]
    started_at: float | None = None  # in flight: when the first request claimed the key (epoch seconds)
    fingerprint: str | None = None  # in flight: once the request has read what it asks for
    status: int | None = None
    body: Any = None
    token: str | None = None  # in flight: the claiming request's, which its renewals and its end are fenced on
    job: str | None = None  # in flight: the id of the job the request makes
    alive_until: float | None = None  # in flight: the request lapses unless it renews its claim by then (Redis time)


# KEYS[1]: the key's record. ARGV: the claim (JSON), the record's TTL, the lease. {outcome, record}: `claimed`, `held`
# (in flight and renewed, or done), or `lapsed` (in flight, its request not heard from for a lease: it died)
_CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local raw = redis.call('GET', KEYS[1])
if raw then
  local held = cjson.decode(raw)
  if held.state == 'in_flight' and type(held.alive_until) == 'number' and held.alive_until < now then
    return {'lapsed', raw}
  end
  return {'held', raw}
end
local claim = cjson.decode(ARGV[1])
claim.started_at = now
claim.alive_until = now + tonumber(ARGV[3])
raw = cjson.encode(claim)
redis.call('SET', KEYS[1], raw, 'EX', ARGV[2])
return {'claimed', raw}
"""

# KEYS[1]: the key's record. ARGV: the claim's token, then the JSON fields to set, the lease ('' keeps the TTL and
# the lease), the TTL ('' keeps it). 0 unless the record is still that claim's.
_UPDATE = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local record = cjson.decode(raw)
if record.state ~= 'in_flight' or record.token ~= ARGV[1] then return 0 end
for field, value in pairs(cjson.decode(ARGV[2])) do record[field] = value end
if ARGV[3] ~= '' then
  local t = redis.call('TIME')
  record.alive_until = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[3])
end
if ARGV[4] ~= '' then
  redis.call('SET', KEYS[1], cjson.encode(record), 'EX', ARGV[4])
else
  redis.call('SET', KEYS[1], cjson.encode(record), 'KEEPTTL')
end
return 1
"""

# KEYS[1]: the key's record. ARGV[1]: the claim's token. Deletes it if it is still that claim's.
_RELEASE = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local record = cjson.decode(raw)
if record.state ~= 'in_flight' or record.token ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


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


class Claim:
    """A key this request holds: the job it makes (`job`), renewed while `held`, ended by `finish` or `release`."""

    def __init__(self, store: Idempotency, name: str, token: str, job: str) -> None:
        self.store, self.name, self.token, self.job = store, name, token, job

    @contextmanager
    def held(self) -> Iterator[None]:
        """Renews the claim every third of the lease while the block runs (an upload may take minutes)."""
        ended = threading.Event()

        def renew() -> None:
            while not ended.wait(self.store.lease_s / 3):
                try:
                    if not self.store._update(self.name, self.token, {}, lease=True):
                        return  # ended, or taken over by a repeat that found it lapsed
                except Exception as error:  # Redis briefly away: the next renewal, or the lease, decides
                    log.warning("idempotency claim not renewed (%s)", type(error).__name__)

        renewer = threading.Thread(target=renew, name="idempotency claim", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            ended.set()

    def making(self, fingerprint: str) -> str:
        """Says what the request asks for, before it makes its job: a repeat after a crash from here on finds the
        job, or its absence, and compares itself with it. The job's id."""
        if not self.store._update(self.name, self.token, {"fingerprint": fingerprint}, lease=True):
            raise ApiError(409, "idempotency_in_flight",
                           f"A repeat of this request took its `{HEADER}` over while it was silent; it made no job.",
                           headers={"Retry-After": "1"})  # fmt: skip
        return self.job

    def finish(self, fingerprint: str, status: int, body: dict[str, Any]) -> bool:
        """Remembers the answer; False if the claim is no longer this request's (taken over as lapsed)."""
        done = Remembered(state="done", fingerprint=fingerprint, status=status, body=body)
        if not self.store._update(self.name, self.token, done.model_dump(), ttl_s=self.store.ttl_s):
            return False
        self.store.redis.set(self.store._made(body["id"]), self.name, ex=self.store.ttl_s)  # for `forget_job`
        return True

    def release(self) -> None:
        """A failed request is not remembered: the caller may fix it and retry."""
        self.store._release(keys=[self.name], args=[self.token])


class Idempotency:
    def __init__(
        self, redis: Redis, ttl_s: int, in_flight_ttl_s: int, lease_s: float = 30, prefix: str = "vsrq"
    ) -> None:
        self.redis, self.ttl_s, self.in_flight_ttl_s, self.prefix = redis, ttl_s, in_flight_ttl_s, prefix
        self.lease_s = lease_s
        self._claim, self._update_script = redis.register_script(_CLAIM), redis.register_script(_UPDATE)
        self._release = redis.register_script(_RELEASE)

    def _key(self, owner: str, key: str) -> str:
        return f"{self.prefix}:idem:{owner}:{hashlib.sha256(key.encode()).hexdigest()}"

    def claim(self, owner: str, key: str, made: Callable[[str], dict[str, Any] | None]) -> Claim | Remembered:
        """A `Claim` when this request now holds the key; otherwise what the key holds. A claim whose request died
        (lapsed) is taken over, or, where that request made its job (`made(id)`: the job as GET shows it, or None),
        ends as that job's answer, which is what the key holds then."""
        name = self._key(owner, key)
        while True:
            token = secrets.token_hex(8)
            claim = Remembered(state="in_flight", token=token, job=new_job_id())
            outcome, raw = self._claim(keys=[name], args=[claim.model_dump_json(), self.in_flight_ttl_s, self.lease_s])
            record = Remembered.model_validate_json(raw)
            if outcome == b"claimed":
                return Claim(self, name, token, record.job or "")
            if outcome == b"held":
                return record
            lapsed = Claim(self, name, record.token or "", record.job or "")
            body = made(lapsed.job) if record.job and record.fingerprint else None
            if body is not None:  # the dead request made its job: the key answers with it from now on
                lapsed.finish(record.fingerprint or "", 200, body)
            else:  # it died before making one: the key is free
                lapsed.release()
            # and look again (another repeat may have been quicker)

    def _update(self, name: str, token: str, fields: dict[str, Any], *, lease: bool = False, ttl_s: int | None = None
                ) -> bool:  # fmt: skip
        args = [token, json.dumps(fields), self.lease_s if lease else "", ttl_s if ttl_s is not None else ""]
        return bool(self._update_script(keys=[name], args=args))

    def _made(self, job_id: str) -> str:
        return f"{self.prefix}:idem-made:{job_id}"

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
