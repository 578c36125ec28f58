"""Each key's compute per hour, in output megapixel-frames (a frame's output pixels / 1e6, summed over frames): the
worker charges a job once its probe knows the cost, before any work, and fails it when the last hour's charges leave
no room; from then until there is room, or while the charges fill the budget, the API refuses new jobs of the key
(429 with `Retry-After`).

    vsrq:budget:{owner}         zset: '{job id}:{megapixel-frames}' by the Redis time it was charged
    vsrq:budget:{owner}:full    set when a job did not fit, expiring when it would have
    vsrq:job:{id} budget_charged_at    on the job's record: it was charged then

A job is charged once in its life, by the attempt that first gets this far: a later attempt (a retry, a requeue after a
worker died) is neither charged again nor refused, however late it runs. The marker is on the job's record, so it
lasts exactly as long as the job; the window's entry alone would be gone an hour later, and an attempt after that was
charged again, or failed `compute_budget_exceeded` for the charges of jobs that came after it. Retries are the
service's failures, not the key's use: their compute is not the key's to pay.
"""

from __future__ import annotations

import math

from redis import Redis

from storage.clock import redis_now
from storage.jobs import job_key

HOUR_S = 3600

# KEYS: the owner's charges, its "full" marker, the job's record. ARGV: member, cost, budget, window (s). Returns 0
# when charged (or already; or the job is gone: its attempt is fenced out), else the seconds until the charges of the
# last window leave room for it.
_CHARGE = """
if redis.call('EXISTS', KEYS[3]) == 0 or redis.call('HEXISTS', KEYS[3], 'budget_charged_at') == 1 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local window = tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local entries = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local used, cost, budget = 0, tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 1, #entries, 2 do used = used + tonumber(string.match(entries[i], ':([^:]+)$')) end
if used + cost > budget then
  -- the oldest charges leave first: wait until enough of them have
  local need, wait = used + cost - budget, math.ceil(window)
  for i = 1, #entries, 2 do
    need = need - tonumber(string.match(entries[i], ':([^:]+)$'))
    wait = math.max(1, math.ceil(tonumber(entries[i + 1]) + window - now))
    if need <= 0 then break end
  end
  redis.call('SET', KEYS[2], '1', 'EX', wait)
  return wait
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('EXPIRE', KEYS[1], math.ceil(window))
redis.call('HSET', KEYS[3], 'budget_charged_at', now)
return 0
"""


class Budget:
    def __init__(self, redis: Redis, prefix: str = "vsrq", window_s: float = HOUR_S) -> None:
        self.redis, self.prefix, self.window_s = redis, prefix, window_s  # an hour; shorter in tests
        self._charge = redis.register_script(_CHARGE)

    def _key(self, owner: str) -> str:
        return f"{self.prefix}:budget:{owner}"

    def charge(self, owner: str, job_id: str, megapixel_frames: float, per_hour: float) -> int:
        """Charges the job, unless it was already; 0 when done, else the seconds to wait (nothing charged)."""
        cost = round(megapixel_frames, 3)  # the member's figure is what the sums add up
        member = f"{job_id}:{cost:.3f}"
        keys = [self._key(owner), f"{self._key(owner)}:full", job_key(self.prefix, job_id)]
        return int(self._charge(keys=keys, args=[member, cost, per_hour, self.window_s]))

    def full_for(self, owner: str) -> int:
        """Seconds until a job refused for the budget would have fitted; 0 when none was refused since."""
        return max(0, self.redis.ttl(f"{self._key(owner)}:full"))

    def used(self, owner: str) -> tuple[float, int]:
        """(megapixel-frames charged in the last hour, seconds until the oldest of them leaves it: 0 when none)."""
        now = redis_now(self.redis)
        entries = self.redis.zrangebyscore(self._key(owner), now - self.window_s, "+inf", withscores=True)
        used = sum(float(member.decode().rsplit(":", 1)[1]) for member, _ in entries)
        return used, (max(1, math.ceil(entries[0][1] + self.window_s - now)) if entries else 0)
