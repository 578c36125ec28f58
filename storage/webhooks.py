"""The webhook outbox: the durable record deliveries are made from (signed by storage.signatures).

A job's terminal transition writes its webhook into the outbox in the same Lua script (storage.jobs, `announce`), so
an ended job always has its event, even if every process dies right after. Keys:

    vsrq:webhooks:outbox     zset: event ids by when they are due (now, a retry's time, or a claim's expiry)
    vsrq:webhooks:events     hash: {id} -> the event (JSON: job, owner, url, type, at), and beside it {id}:claim,
                             {id}:attempts, {id}:payload (the exact body, fixed at the first attempt), {id}:started
                             (the last claim that started an attempt: one a claim) and, while an attempt runs,
                             {id}:holder ("{claim} {name}/{pid}": the claim it started under and its worker, as the
                             worker registry names it)
    vsrq:webhooks:held       zset: the events whose attempt is running, by when it started

The relay (worker.webhooks) `take`s due events: each take is a new claim, and pushes the event's due time past the
claim's expiry, so an event whose relay or delivery worker died is taken again then (at least once; receivers
dedupe on `webhook-id`). A delivery `start`s, fenced by its claim; it ends with `retry` or `done`, both fenced.
An event leaves the outbox only through `done`: delivered, or given up. An attempt whose worker is gone is taken back
sooner than its claim (`held`, `take_back`: worker.gone).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from celery import Celery
from pydantic import BaseModel
from redis import Redis

from storage.clock import redis_now
from storage.workers import Held

log = logging.getLogger("vsrq.webhooks")

DELIVER_TASK = "vsrq.deliver_webhook"  # args: [event id, claim]; worker.webhooks delivers
QUEUE = "vsrq.webhooks"


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
# A new claim of event `id` for ARGV[1] seconds (it is due again then): its number. An attempt of an earlier claim no
# longer holds it.
_CLAIM = """
local function claim(id)
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), id)
  redis.call('ZREM', KEYS[3], id)
  redis.call('HDEL', KEYS[2], id .. ':holder')
  return redis.call('HINCRBY', KEYS[2], id .. ':claim', 1)
end
"""
# The end of an attempt: nothing holds the event now.
_RELEASE = """
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1] .. ':holder')
"""
# ARGV: claim seconds, limit. Returns [id, claim, id, claim...].
_TAKE = (
    _NOW
    + _CLAIM
    + """
local taken = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))) do
  if redis.call('HEXISTS', KEYS[2], id) == 1 then
    table.insert(taken, id)
    table.insert(taken, claim(id))
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return taken
"""
)
# The fence of start / retry / done: only the latest claim of an event may act on it.
_FENCE = "if redis.call('HGET', KEYS[2], ARGV[1] .. ':claim') ~= ARGV[2] then return false end\n"
# ARGV: claim seconds, id. Takes that one event, as _TAKE does, where it is due. Returns its claim, or false.
_TAKE_ONE = (
    _NOW
    + _CLAIM
    + """
local due = redis.call('ZSCORE', KEYS[1], ARGV[2])
if not due or tonumber(due) > now or redis.call('HEXISTS', KEYS[2], ARGV[2]) == 0 then return false end
return claim(ARGV[2])
"""
)
# ARGV: id, claim, hold seconds (the attempt's longest run), holder. Returns [event, attempt, payload or nil]; false
# under a later claim, or once this claim has started an attempt: one attempt a claim (Celery gives a message again
# whose ack a lost broker connection cut off, its attempt running or ended; a dead holder's is taken back, a new claim).
_START = (
    _FENCE
    + _NOW
    + """
if redis.call('HGET', KEYS[2], ARGV[1] .. ':started') == ARGV[2] then return false end
redis.call('HSET', KEYS[2], ARGV[1] .. ':started', ARGV[2])
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[3]), ARGV[1])
redis.call('ZADD', KEYS[3], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1] .. ':holder', ARGV[2] .. ' ' .. ARGV[4])
local attempt = redis.call('HINCRBY', KEYS[2], ARGV[1] .. ':attempts', 1)
return {redis.call('HGET', KEYS[2], ARGV[1]), attempt, redis.call('HGET', KEYS[2], ARGV[1] .. ':payload')}
"""
)
# ARGV: id, claim, delay seconds.
_RETRY = (
    _FENCE
    + _NOW
    + _RELEASE
    + """
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[3]), ARGV[1])
return 1
"""
)
# ARGV: id, claim.
_DONE = (
    _FENCE
    + _RELEASE
    + """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1], ARGV[1] .. ':claim', ARGV[1] .. ':attempts', ARGV[1] .. ':payload',
  ARGV[1] .. ':started')
return 1
"""
)
# Returns [id, "{claim} {holder}", began, ...] of every attempt running. An entry whose event has a later claim (taken
# by an older relay, which leaves it) or is gone is no attempt's now: dropped.
_HELD = """
local held = {}
local began = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
for i = 1, #began, 2 do
  local id = began[i]
  local claim, holder = unpack(redis.call('HMGET', KEYS[2], id .. ':claim', id .. ':holder'))
  if claim and holder and string.sub(holder, 1, #claim + 1) == claim .. ' ' then
    for _, value in ipairs({id, holder, began[i + 1]}) do table.insert(held, value) end
  else
    redis.call('ZREM', KEYS[3], id)
    redis.call('HDEL', KEYS[2], id .. ':holder')
  end
end
return held
"""
# ARGV: id, claim, silent seconds. Makes the event due now where that claim is the latest, its attempt still runs and
# began at least `silent` seconds ago (0: any), so that the relay's next take hands it out under a new claim. Returns
# 1, or false.
_TAKE_BACK = (
    _FENCE
    + _NOW
    + """
local began, holder = redis.call('ZSCORE', KEYS[3], ARGV[1]), redis.call('HGET', KEYS[2], ARGV[1] .. ':holder')
if not began or not holder or string.sub(holder, 1, #ARGV[2] + 1) ~= ARGV[2] .. ' ' then return false end
if now - tonumber(began) < tonumber(ARGV[3]) then return false end
redis.call('ZADD', KEYS[1], 'XX', now, ARGV[1])
"""
    + _RELEASE
    + """
return 1
"""
)


class Outbox:
    def __init__(self, redis: Redis, prefix: str = "vsrq") -> None:
        self.redis = redis
        self.keys = [*outbox_keys(prefix), f"{prefix}:webhooks:held"]
        scripts = (_TAKE, _TAKE_ONE, _START, _RETRY, _DONE, _HELD, _TAKE_BACK)
        self._take, self._take_one, self._start, self._retry, self._done, self._held, self._take_back = (
            redis.register_script(script) for script in scripts
        )

    def take(self, claim_s: float, limit: int = 100) -> list[Claim]:
        """The due events, each under a new claim that expires (makes the event due again) in `claim_s`."""
        flat = self._take(keys=self.keys, args=[claim_s, limit])
        return [Claim(flat[i].decode(), int(flat[i + 1])) for i in range(0, len(flat), 2)]

    def take_one(self, event_id: str, claim_s: float) -> Claim | None:
        """`take` for one event: None unless it is due (taken already, or no such event)."""
        claim = self._take_one(keys=self.keys, args=[claim_s, event_id])
        return Claim(event_id, int(claim)) if claim else None

    def start(self, event_id: str, claim: int, hold_s: float, holder: str) -> Started | None:
        """Counts one more attempt, made by `holder` ("{worker name}/{pid}"), and holds the event for `hold_s`; None
        when `claim` is no longer the latest, or has started an attempt already (one attempt a claim)."""
        reply = self._start(keys=self.keys, args=[event_id, claim, hold_s, holder])
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

    def held(self) -> list[Held]:
        """The attempts running now, as one snapshot: each event's claim, its holder and when it began."""
        flat = [value.decode() for value in self._held(keys=self.keys)]
        held = ((flat[i], *flat[i + 1].split(" ", 1), float(flat[i + 2])) for i in range(0, len(flat), 3))
        return [Held(event_id, claim, holder, began) for event_id, claim, holder, began in held]

    def take_back(self, held: list[Held], silent_s: float = 0) -> list[str]:
        """Makes each of these attempts' events due now, where its claim is still the latest and the attempt began
        `silent_s` ago or more (its worker is gone: worker.gone); the relay hands them out again. The ids taken back."""
        taken = (self._take_back(keys=self.keys, args=[holding.id, holding.token, silent_s]) for holding in held)
        return [holding.id for holding, took in zip(held, taken, strict=True) if took]

    def next_due_s(self) -> float:
        """Seconds until `take` has an event to give (0: now; inf: none waiting)."""
        first = self.redis.zrange(self.keys[0], 0, 0, withscores=True)
        if not first:
            return float("inf")
        return max(0.0, first[0][1] - redis_now(self.redis))

    def pending(self) -> list[str]:
        return [event_id.decode() for event_id in self.redis.zrange(self.keys[0], 0, -1)]


def relay_once(box: Outbox, celery: Celery, claim_s: float) -> list[Claim]:
    """Every due event, under a new claim, becomes one `vsrq.deliver_webhook` message. A relay that dies after taking
    an event and before its message is sent leaves it claimed: it is due again when the claim expires."""
    taken = box.take(claim_s)
    for claim in taken:
        celery.send_task(DELIVER_TASK, args=[claim.event_id, claim.claim], queue=QUEUE)
    return taken


def event_id(job_id: str, status: str) -> str:
    """The id of the event a job's move to `status` wrote (storage.jobs' `announce`): its webhook-id."""
    return f"msg_{job_id}_{status}"


def relay_now(box: Outbox, celery: Celery, claim_s: float, job_id: str, status: str) -> None:
    """Relays the webhook a job's end just wrote, from the process that ended it (a worker, the API cancelling), not
    at the reaper's next pass, up to `reap_interval_s` later. Best effort, and one try: an event this cannot send is
    due again at once, for the reaper."""
    try:
        claim = box.take_one(event_id(job_id, status), claim_s)
        if claim is None:  # no webhook, or a reaper's pass took it first
            return
        try:
            celery.send_task(DELIVER_TASK, args=[claim.event_id, claim.claim], queue=QUEUE, retry=False)
        except Exception:
            box.retry(claim.event_id, claim.claim, 0)
            raise
    except Exception as error:  # Redis or the broker: the event waits in the outbox
        log.warning("%s: its webhook waits for the reaper's next pass (%s: %s)", job_id, type(error).__name__, error)
