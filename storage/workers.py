"""The worker registry: every Celery worker says in Redis who it is (queues, model, devices), what job it holds, and
that it is alive, with a heartbeat that expires. `vsrq status`, /healthz and /metrics read it.

    vsrq:worker:{name}      hash: the worker's WorkerInfo, expiring `ttl_s` after its last heartbeat
    vsrq:workers            zset: worker names by the time their entry expires (what `list` reads)

Expiry rather than a goodbye: a worker killed with SIGKILL, or on a host that lost power, leaves no goodbye.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pydantic import BaseModel
from redis import Redis

from storage.clock import redis_now


class WorkerInfo(BaseModel):
    name: str  # Celery's node name (-n), e.g. gpu0@host
    queues: list[str]  # the pipeline group(s) it takes jobs from
    model: str | None = None  # None: a worker that runs no model (webhooks)
    served: str | None = None  # the name its jobs report, VSRQ_MODELS's key for it (None: no model, or a worker before)
    devices: list[str] = []
    gpus: list[str] = []  # the devices' product names, e.g. "NVIDIA H200"
    host: str
    pid: int
    started_at: float
    heartbeat_at: float = 0.0
    job: str | None = None  # the job it is running
    # the `quality` tiers its model runs as asked; None: a worker that runs none, or one before it said (not known)
    qualities: list[str] | None = None


_JSON_FIELDS = ("queues", "devices", "gpus", "qualities")


@dataclass(frozen=True)
class Held:
    """What a worker process holds, named as the registry names it: a job's lease, a webhook's attempt."""

    id: str  # the job's or the event's
    token: str  # this holding's own (a job's lease token, an event's claim): a new one is another holding
    holder: str  # "{worker name}/{pid}"
    since: float | None  # when it was taken, on Redis's clock (None: not recorded, by older code)


def this_process(name: str) -> str:
    """This process as the holder of what it takes, `Held.holder`: its worker's name (Celery's node name) and pid."""
    return f"{name}/{os.getpid()}"


class WorkerRegistry:
    def __init__(self, redis: Redis, *, ttl_s: int = 30, prefix: str = "vsrq") -> None:
        self.redis, self.ttl_s, self.prefix = redis, ttl_s, prefix

    def _key(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    @property
    def _index(self) -> str:
        return f"{self.prefix}:workers"

    def now(self) -> float:
        return redis_now(self.redis)

    def register(self, info: WorkerInfo) -> WorkerInfo:
        """Writes the whole entry and restarts its expiry: the worker calls it at start, on every heartbeat and when
        it takes or ends a job, so an entry lost with a Redis restart comes back whole at the next beat."""
        info = info.model_copy(update={"heartbeat_at": self.now()})
        fields = {
            name: json.dumps(value) if name in _JSON_FIELDS else "" if value is None else value
            for name, value in info.model_dump().items()
        }
        with self.redis.pipeline(transaction=True) as tx:
            tx.delete(self._key(info.name))
            tx.hset(self._key(info.name), mapping=fields)
            tx.expire(self._key(info.name), self.ttl_s)
            tx.zadd(self._index, {info.name: info.heartbeat_at + self.ttl_s})
            tx.execute()
        return info

    def remove(self, name: str) -> None:
        with self.redis.pipeline(transaction=True) as tx:
            tx.delete(self._key(name))
            tx.zrem(self._index, name)
            tx.execute()

    def get(self, name: str) -> WorkerInfo | None:
        """The live worker of this name, if one has beaten within the TTL."""
        raw = self.redis.hgetall(self._key(name))
        return _from_hash(raw) if raw else None

    def list(self) -> list[WorkerInfo]:
        """The live workers, by name."""
        self.redis.zremrangebyscore(self._index, "-inf", self.now())
        names = sorted(name.decode() for name in self.redis.zrange(self._index, 0, -1))
        with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(self._key(name))
            raws = pipe.execute()
        return [_from_hash(raw) for raw in raws if raw]  # an entry can expire between the two reads


def _from_hash(raw: dict[bytes, bytes]) -> WorkerInfo:
    data: dict[str, object] = {key.decode(): value.decode() for key, value in raw.items()}
    for name in _JSON_FIELDS:
        data[name] = json.loads(data[name]) if name in data else None  # `qualities`: absent in older workers' entries
    for name in ("model", "served", "job"):  # stored as "" when None
        data[name] = data.get(name) or None
    return WorkerInfo.model_validate(data)
