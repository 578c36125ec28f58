"""`Idempotency-Key` on create, after Stripe and the IETF draft: the first request with a key claims it; once it
succeeds, its response is kept for 24 h with a fingerprint of the request. A repeat with the same fingerprint gets
the same response replayed; a repeat while the first is still running gets 409; a repeat with a different request
gets 422. Requests that fail are not remembered, so the caller can fix and retry under the same key.

The 409 carries `Retry-After`: as long again as the first request has run so far (an upload that took 20 s is not
likely done in 1), from 1 s to 60 s and never past the moment its claim lapses unless renewed (a lease from now).
A client that doubles nothing itself (OpenAI's SDK retries twice, waiting what the header says) thus waits out a first
request up to about 4 times as long as it had run when the repeat came, instead of giving up after two half-second
backoffs.

Keys are per API key: one caller's key never replays another caller's response. Deleting the job a key made frees
the key: a replay would answer with a job nobody can fetch any more, so the same request makes a new one.

A claim is held by its request while it runs (`Claim.held`: renewed every third of `lease_s` on a thread of its own),
and names the job it will make, and the request's fingerprint once known, before the job is made. An API process
that dies mid-request (a `kill -9`, the OOM killer, a node lost) stops renewing it: a repeat `lease_s` later finds it
lapsed and either replays the job that request had made (the crash came after it) or takes the key over. Until then
its claim held the key for `in_flight_ttl_s` (an hour): `vsrq bulk` run again after a restart gave up on it, and a
job made just before the crash was made again by the run after the hour. A request that was only stalled for a lease
(a paused VM) and comes back makes its job only while its claim is still its own (`Claim.making`'s fence), and a
repeat frees a lapsed claim only while the job it names has not been made: one job a key, whichever comes first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import BaseModel
from redis import Redis

from api.errors import ApiError
from storage.clock import redis_now
from storage.jobs import Fence, job_key, new_job_id

log = logging.getLogger("vsrq.api")

HEADER = "Idempotency-Key"
MAX_RETRY_AFTER_S = 60  # OpenAI's SDK gives up at once on one over 120 s
MAX_LOOKS = 10  # a repeat's looks at a lapsed claim before it answers 409 (a job made meanwhile, other repeats)


class Remembered(BaseModel):
    state: Literal["in_flight", "done"]
    started_at: float | None = None  # in flight: when the first request claimed the key (epoch seconds)
    fingerprint: str | None = None  # in flight: once the request has read what it asks for
    status: int | None = None
    body: Any = None
    token: str | None = None  # in flight: the claiming request's, which its renewals and its end are fenced on
    job: str | None = None  # in flight: the id of the job the request makes
    alive_until: float | None = None  # in flight: the request lapses unless it renews its claim by then (Redis time)


# Redis time (`_NOW`), and the key's record when it is the in-flight claim of `token` (and lapsed, where asked), else
# nil.
# Only claims are encoded here: a done record's body never goes through cjson, which turns [] into {} and rounds
# numbers.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
"""
_PRELUDE = _NOW + """
local function claim_of(token, lapsed)
  local raw = redis.call('GET', KEYS[1])
  if not raw then return nil end
  local record = cjson.decode(raw)
  if record.state ~= 'in_flight' or record.token ~= token then return nil end
  if lapsed and not (type(record.alive_until) == 'number' and record.alive_until < now) then return nil end
  return record
end
"""

# KEYS[1]: the key's record. ARGV: the claim (JSON), the record's TTL, the lease. {outcome, record}: `claimed`, `held`
# (in flight and renewed, or done), or `lapsed` (in flight, its request not heard from for a lease: it died)
_CLAIM = _NOW + """
local raw = redis.call('GET', KEYS[1])
if raw then  -- returned as it is: a done record is decoded here, never encoded again
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

# KEYS[1]: the key's record. ARGV: the claim's token, a fingerprint ('' keeps it), the lease, the record's TTL. Its
# request is alive for another lease; 0 unless the record is still that claim's.
_RENEW = _PRELUDE + """
local record = claim_of(ARGV[1], false)
if not record then return 0 end
if ARGV[2] ~= '' then record.fingerprint = ARGV[2] end
record.alive_until = now + tonumber(ARGV[3])
redis.call('SET', KEYS[1], cjson.encode(record), 'EX', ARGV[4])
return 1
"""

# KEYS: the key's record, the made job's back reference, the claim's job. ARGV: the claim's token, '1' to end it only
# if it lapsed, then the answer (the done record, JSON, or '' to forget the key), its TTL, the record's name. 0 unless
# the record is still that claim's (and lapsed, where asked), or where the claim is to be forgotten but its job was
# made (by its request, failing after it, or come back after a lapse): the key answers with that job, not another.
_END = _PRELUDE + """
if not claim_of(ARGV[1], ARGV[2] == '1') then return 0 end
if ARGV[3] == '' and redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
if ARGV[3] == '' then return redis.call('DEL', KEYS[1]) end
redis.call('SET', KEYS[1], ARGV[3], 'EX', ARGV[4])
redis.call('SET', KEYS[2], ARGV[5], 'EX', ARGV[4])
return 1
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
    """A key this request holds: the job it makes (`job`), renewed while `held`, ended by `finish` or `release`.
    `lapsed`: a dead request's claim, which a repeat ends only while it stays lapsed (its request did not come back)."""

    def __init__(self, store: Idempotency, name: str, token: str, job: str, lapsed: bool = False) -> None:
        self.store, self.name, self.token, self.job, self.lapsed = store, name, token, job, lapsed

    @contextmanager
    def held(self) -> Iterator[None]:
        """Renews the claim every third of the lease while the block runs (an upload may take minutes)."""
        ended = threading.Event()

        def renew() -> None:
            while not ended.wait(self.store.lease_s / 3):
                try:
                    if not self.store._renew(self):
                        return  # ended, or taken over by a repeat that found it lapsed
                except Exception as error:  # Redis briefly away: the next renewal, or the lease, decides
                    log.warning("idempotency claim not renewed (%s)", type(error).__name__)

        threading.Thread(target=renew, name="idempotency claim", daemon=True).start()
        try:
            yield
        finally:
            ended.set()

    def making(self, fingerprint: str) -> tuple[str, Fence]:
        """Says what the request asks for, right before it makes its job: a repeat after a crash from here on finds
        the job, or its absence, and compares itself with it. The job's id, and the fence its making must pass: the
        claim still this request's (a request that went unheard for a lease between here and its job may have lost
        its key to a repeat, which made the job)."""
        if not self.store._renew(self, fingerprint):
            raise self.taken_over()
        return self.job, Fence(self.name, "token", self.token)

    def taken_over(self) -> ApiError:
        return ApiError(409, "idempotency_taken_over",
                        f"This request went unheard for {self.store.lease_s:g} s and a repeat under its `{HEADER}` "
                        "took the key over; it made no job: the repeat's answer is the one to use.",
                        headers={"Retry-After": "1"})  # fmt: skip

    def finish(self, fingerprint: str, status: int, body: dict[str, Any]) -> bool:
        """Remembers the answer; False if the claim is no longer this request's (taken over as lapsed)."""
        done = Remembered(state="done", fingerprint=fingerprint, status=status, body=body).model_dump_json()
        return self.store._end(self, done, made=body["id"])

    def release(self) -> bool:
        """A failed request is not remembered: the caller may fix it and retry. Unless it failed after making its job
        (Redis gone as it read the job back): the claim stays, unrenewed, and a repeat a lease later gets that job;
        forgotten, the repeat made a second one."""
        return self.store._end(self, "")


class Idempotency:
    def __init__(
        self, redis: Redis, ttl_s: int, in_flight_ttl_s: int, lease_s: float = 30, prefix: str = "vsrq"
    ) -> None:
        """`in_flight_ttl_s`: how long a claim's record outlives its last renewal; `lease_s`: how long its request may
        go unheard before a repeat takes it for dead."""
        self.redis, self.ttl_s, self.in_flight_ttl_s, self.prefix = redis, ttl_s, in_flight_ttl_s, prefix
        self.lease_s = lease_s
        self._claim, self._renew_script = redis.register_script(_CLAIM), redis.register_script(_RENEW)
        self._end_script = redis.register_script(_END)

    def _key(self, owner: str, key: str) -> str:
        return f"{self.prefix}:idem:{owner}:{hashlib.sha256(key.encode()).hexdigest()}"

    def claim(self, owner: str, key: str, made: Callable[[str], dict[str, Any] | None]) -> Claim | Remembered:
        """A `Claim` when this request now holds the key; otherwise what the key holds. A claim whose request died
        (lapsed) is taken over, or, where that request made its job (`made(id)`: the job as GET shows it, or None),
        ends as that job's answer, which is what the key holds then."""
        name = self._key(owner, key)
        for _ in range(MAX_LOOKS):
            token = secrets.token_hex(8)
            claim = Remembered(state="in_flight", token=token, job=new_job_id())
            outcome, raw = self._claim(keys=[name], args=[claim.model_dump_json(), self.in_flight_ttl_s, self.lease_s])
            record = Remembered.model_validate_json(raw)
            if outcome == b"claimed":
                return Claim(self, name, token, record.job or "")
            if outcome == b"held":
                return record
            lapsed = Claim(self, name, record.token or "", record.job or "", lapsed=True)
            body = made(lapsed.job) if record.job and record.fingerprint else None
            if body is not None:  # the dead request made its job: the key answers with it from now on
                lapsed.finish(record.fingerprint or "", 200, body)
            else:  # it died before making one: the key is free
                lapsed.release()
            # and look again: another repeat may have been quicker, or the request heard from again
        # each look found the key changed since the one before (repeats racing): answered as still in flight
        raise _in_flight(1)

    def _renew(self, claim: Claim, fingerprint: str = "") -> bool:
        args = [claim.token, fingerprint, self.lease_s, self.in_flight_ttl_s]
        return bool(self._renew_script(keys=[claim.name], args=args))

    def _end(self, claim: Claim, done: str, made: str = "") -> bool:
        args = [claim.token, "1" if claim.lapsed else "", done, self.ttl_s, claim.name]
        keys = [claim.name, self._made(made), job_key(self.prefix, claim.job)]
        return bool(self._end_script(keys=keys, args=args))

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
        now = redis_now(self.redis)  # the clock the claim's times are on
        elapsed = max(0.0, now - remembered.started_at)
        if remembered.alive_until is not None:  # a request gone silent is taken for dead then
            lapses_in = remembered.alive_until - now
        else:
            lapses_in = self.in_flight_ttl_s - elapsed
        return max(1, min(math.ceil(elapsed), MAX_RETRY_AFTER_S, math.ceil(lapses_in)))

    def check_replay(self, remembered: Remembered, request_fingerprint: Callable[[], str]) -> Remembered:
        """What to answer a repeat with: the remembered response, or the error that says why not. The repeat's
        fingerprint (which may mean reading its whole body) is computed only when there is one to compare with."""
        if remembered.state == "in_flight":
            raise _in_flight(self.retry_after_s(remembered))
        if remembered.fingerprint != request_fingerprint():
            raise ApiError(422, "idempotency_key_reused", f"This `{HEADER}` was used for a different request.")
        return remembered


def _in_flight(wait_s: int) -> ApiError:
    return ApiError(409, "idempotency_in_flight",
                    f"A request with this `{HEADER}` is still being processed; retry in {wait_s} s.",
                    headers={"Retry-After": str(wait_s)})  # fmt: skip
