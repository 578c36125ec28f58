"""Webhooks, Standard Webhooks v1: the signature (`sign`, `verify`) and the durable outbox deliveries are made from.

A job's terminal transition writes its webhook into the outbox in the same Lua script (storage.jobs, `announce`), so
an ended job always has its event, even if every process dies right after. Keys:

    vsrq:webhooks:outbox     zset: event ids by when they are due (now, a retry's time, or a claim's expiry)
    vsrq:webhooks:events     hash: {id} -> the event (JSON: job, owner, url, type, at), and beside it {id}:claim,
                             {id}:attempts and {id}:payload (the exact body, fixed at the first attempt)

The relay (worker.webhooks) `take`s due events: each take is a new claim, and pushes the event's due time past the
claim's expiry, so an event whose relay or delivery worker died is taken again then (at least once; receivers
dedupe on `webhook-id`). A delivery `start`s, fenced by its claim; it ends with `retry` or `done`, both fenced.
An event leaves the outbox only through `done`: delivered, or given up.

`verify` needs only the standard library: receivers may copy it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from secrets import token_bytes

from pydantic import BaseModel
from redis import Redis

SECRET_PREFIX = "whsec_"
TOLERANCE_S = 300  # Standard Webhooks' default: a message more than 5 min older (or newer) than the clock is refused


# -- Signing -------------------------------------------------------------------------------------------------------


class InvalidSecret(ValueError):
    pass


class WebhookVerificationError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # missing_headers, invalid_timestamp, stale_timestamp, no_matching_signature


def secret_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_<base64>` secret; raises `InvalidSecret` for anything else."""
    if not secret.startswith(SECRET_PREFIX):
        raise InvalidSecret(f"must start with {SECRET_PREFIX!r}")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except binascii.Error:
        raise InvalidSecret(f"must be {SECRET_PREFIX!r} followed by standard base64") from None
    if not 24 <= len(key) <= 64:
        raise InvalidSecret(f"must hold 24 to 64 random bytes (this one holds {len(key)})")
    return key


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(token_bytes(32)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """One `v1,<base64 HMAC-SHA256>` signature of `{id}.{timestamp}.{body}`."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret_key(secret), signed, hashlib.sha256).digest()).decode()


def signed_headers(secrets: Iterable[str], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three headers; one signature per secret, so that receivers rotating their secret accept either."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(sign(secret, msg_id, timestamp, body) for secret in secrets),
    }


def verify(
    payload: bytes, headers: Mapping[str, str], secrets: Iterable[str], tolerance: float = TOLERANCE_S
) -> None:
    """Checks a received webhook: its raw body, its headers (any case), and the secrets it may be signed with (the
    current and, while rotating, the previous). Raises `WebhookVerificationError` unless one of its `v1` signatures
    matches one of the secrets and its timestamp is within `tolerance` seconds of this machine's clock."""
    lowered = {name.lower(): value for name, value in headers.items()}
    msg_id, stamp, signatures = (lowered.get(f"webhook-{name}") for name in ("id", "timestamp", "signature"))
    if not (msg_id and stamp and signatures):
        raise WebhookVerificationError("missing_headers", "webhook-id, webhook-timestamp and webhook-signature needed")
    try:
        timestamp = int(stamp)
    except ValueError:
        raise WebhookVerificationError("invalid_timestamp", "webhook-timestamp is not a Unix time") from None
    if abs(time.time() - timestamp) > tolerance:
        raise WebhookVerificationError("stale_timestamp", "webhook-timestamp is too far from now (a replay?)")
    received = {signature.removeprefix("v1,") for signature in signatures.split() if signature.startswith("v1,")}
    for secret in secrets:
        expected = sign(secret, msg_id, timestamp, payload).removeprefix("v1,")
        if any(hmac.compare_digest(expected.encode(), candidate.encode()) for candidate in received):  # constant time
            return
    raise WebhookVerificationError("no_matching_signature", "no signature matches the secret")


# -- The outbox ----------------------------------------------------------------------------------------------------


def outbox_keys(prefix: str = "vsrq") -> list[str]:
    """[the due-time zset, the events hash]: storage.jobs' scripts write into both."""
    return [f"{prefix}:webhooks:outbox", f"{prefix}:webhooks:events"]


class Event(BaseModel):
    """What the job's terminal transition wrote."""

    job: str
    owner: str
    url: str
    type: str  # video.completed, video.failed, video.cancelled
    at: float


@dataclass(frozen=True)
class Claim:
    event_id: str
    claim: int


@dataclass(frozen=True)
class Started:
    """An attempt of one event, fenced by its claim."""

    event_id: str
    claim: int
    attempt: int  # 1 for the first
    event: Event
    payload: bytes | None  # None until the first attempt fixes it


_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""
# ARGV: claim seconds, limit. Returns [id, claim, id, claim...].
_TAKE = (
    _NOW
    + """
local taken = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))) do
  if redis.call('HEXISTS', KEYS[2], id) == 1 then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), id)
    table.insert(taken, id)
    table.insert(taken, redis.call('HINCRBY', KEYS[2], id .. ':claim', 1))
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return taken
"""
)
# The fence of start / retry / done: only the latest claim of an event may act on it.
_FENCE = "if redis.call('HGET', KEYS[2], ARGV[1] .. ':claim') ~= ARGV[2] then return false end\n"
# ARGV: id, claim, hold seconds (the attempt's longest run). Returns [event, attempt, payload or nil].
_START = (
    _FENCE
    + _NOW
    + """
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[3]), ARGV[1])
local attempt = redis.call('HINCRBY', KEYS[2], ARGV[1] .. ':attempts', 1)
return {redis.call('HGET', KEYS[2], ARGV[1]), attempt, redis.call('HGET', KEYS[2], ARGV[1] .. ':payload')}
"""
)
# ARGV: id, claim, delay seconds.
_RETRY = (
    _FENCE
    + _NOW
    + """
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[3]), ARGV[1])
return 1
"""
)
# ARGV: id, claim.
_DONE = (
    _FENCE
    + """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1], ARGV[1] .. ':claim', ARGV[1] .. ':attempts', ARGV[1] .. ':payload')
return 1
"""
)


class Outbox:
    def __init__(self, redis: Redis, prefix: str = "vsrq") -> None:
        self.redis = redis
        self.keys = outbox_keys(prefix)
        self._take, self._start, self._retry, self._done = (
            redis.register_script(script) for script in (_TAKE, _START, _RETRY, _DONE)
        )

    def take(self, claim_s: float, limit: int = 100) -> list[Claim]:
        """The due events, each under a new claim that expires (makes the event due again) in `claim_s`."""
        flat = self._take(keys=self.keys, args=[claim_s, limit])
        return [Claim(flat[i].decode(), int(flat[i + 1])) for i in range(0, len(flat), 2)]

    def start(self, event_id: str, claim: int, hold_s: float) -> Started | None:
        """Counts one more attempt and holds the event for `hold_s`; None when `claim` is no longer the latest."""
        reply = self._start(keys=self.keys, args=[event_id, claim, hold_s])
        if not reply:
            return None
        raw, attempt, payload = reply
        return Started(event_id, claim, int(attempt), Event.model_validate_json(raw), payload)

    def keep_payload(self, event_id: str, payload: bytes) -> bytes:
        """Fixes the body every attempt sends (the first one written wins)."""
        field = f"{event_id}:payload"
        with self.redis.pipeline(transaction=True) as tx:
            tx.hsetnx(self.keys[1], field, payload)
            tx.hget(self.keys[1], field)
            return tx.execute()[1]

    def retry(self, event_id: str, claim: int, delay_s: float) -> bool:
        return bool(self._retry(keys=self.keys, args=[event_id, claim, delay_s]))

    def done(self, event_id: str, claim: int) -> bool:
        """Removes the event (delivered, or given up). False when `claim` is no longer the latest."""
        return bool(self._done(keys=self.keys, args=[event_id, claim]))

    def pending(self) -> list[str]:
        return [event_id.decode() for event_id in self.redis.zrange(self.keys[0], 0, -1)]
