"""The queue contract the API (which sends tasks) and the workers (which run them) share: the task's name, its
message, and the Celery app both sides build from the same settings.

It imports no torch and no engine: the API enqueues by task name. Authoritative job state lives in our own Redis
records (storage.jobs), not in Celery: a message only says "run job X", and a worker that gets one for a job that is
no longer queued drops it (but for a message a worker sent again after losing a lease's reply: worker.tasks).
"""

from __future__ import annotations

import base64
import json
import ssl
import time
from collections import Counter
from collections.abc import Iterable
from urllib.parse import urlsplit

from celery import Celery
from kombu.transport.redis import PRIORITY_STEPS, Channel

from storage.config import Settings
from storage.jobs import JOB_ID, TERMINAL, JobRecord, JobStore

BROKER_TRANSPORT = "storage.primary:BrokerTransport"  # kombu's Redis transport, following failovers
UPSCALE_TASK = "vsrq.upscale"  # args: [job_id]; a message sent again may carry a header (worker.tasks.upscale)


def make_celery(settings: Settings, *, await_primary_s: float = 0.0) -> Celery:
    """The app both sides build; `await_primary_s`: how long a broker connection that reaches a replica (a Redis
    failover whose endpoint has not moved yet) or a full primary waits for one that takes writes there
    (storage.primary): the workers' and the reaper's (worker.celery_app), not the API's, whose request would rather be
    told to come back."""
    # No result backend: results live in the job records (Celery's Redis one also refused a rediss:// URL without
    # `ssl_cert_reqs`, so that every create answered 503)
    app = Celery("vsrq", broker=settings.celery_broker_url)
    scheme = urlsplit(settings.celery_broker_url).scheme
    # Redis redelivers an unacknowledged message after the visibility timeout, even while its worker still runs it:
    # keep it above the longest job. Recovery of dead workers is the reaper's, through leases, not Celery's. A
    # publish into a partition fails after the socket timeout instead of hanging its sender (API, reaper, worker).
    transport = {
        "visibility_timeout": settings.longest_job_s + 3600,
        "socket_timeout": settings.redis_timeout_s,
        "socket_connect_timeout": settings.redis_timeout_s,
        "await_primary_s": await_primary_s,
        **settings.broker_transport_options,
    }
    app.conf.update(
        task_acks_late=True,  # acknowledged when the task ends: a worker that dies mid-job leaves it to redeliver
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,  # a GPU worker holds one message at a time, never one it cannot start
        # Neither pool a worker runs (solo, threads) can cancel a running task: Celery's try logged a traceback
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_connection_retry_on_startup=True,
        broker_transport=BROKER_TRANSPORT if scheme in ("redis", "rediss") else None,  # a Sentinel's follows already
        # a TLS broker's certificate verified, as redis-py verifies the job store's, unless the URL's ssl_* say
        # otherwise (kombu alone verifies nothing for a rediss:// URL without them)
        broker_use_ssl={"ssl_cert_reqs": ssl.CERT_REQUIRED} if scheme == "rediss" else None,
        broker_transport_options=transport,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=next(iter(settings.models.values())),
        worker_hijack_root_logger=False,
    )
    return app


# kombu's Redis transport LPUSHes a message and workers BRPOP it: the list's tail is its front. KEYS[1]: the queue's
# list; ARGV[1]: the message's task id. Moves that message (among the newest, where it was just pushed) to the front;
# 0 when a worker took it already.
_TO_FRONT = """
local items = redis.call('LRANGE', KEYS[1], 0, 99)
for _, item in ipairs(items) do
  if string.find(item, ARGV[1], 1, true) then
    redis.call('LREM', KEYS[1], 1, item)
    redis.call('RPUSH', KEYS[1], item)
    return 1
  end
end
return 0
"""


def send_upscale(app: Celery, jobs: JobStore, job: JobRecord, *, first: bool = False) -> None:
    """Puts one `vsrq.upscale` message for `job` on its queue (the pipeline group serving its model), then confirms
    it on the record: a job left unconfirmed (its sender died in between) gets one from the reaper. `first`: at the
    front of the queue, for an attempt requeued after a failure or a lost worker (it waited its turn already)."""
    message = app.send_task(UPSCALE_TASK, args=[job.id], queue=job.queue)
    if first:
        # kombu adds `global_keyprefix` to the keys of the commands it knows, not to EVAL's: added here
        prefix = (app.conf.broker_transport_options or {}).get("global_keyprefix", "")
        with app.connection_for_write() as connection:
            connection.default_channel.client.eval(_TO_FRONT, 1, f"{prefix}{job.queue}", message.id)
    jobs.sent(job.id)


def next_job_ids(app: Celery, queues: Iterable[str], limit: int = 8) -> list[str]:
    """The jobs of the `vsrq.upscale` messages a worker of `queues` takes next, in the order it takes them, read without
    taking any (a worker that prefetches the next input, worker.prefetch): at most `limit` per list. A message another
    worker takes first, or one for a job that is no longer queued, is a guess that does not come true; nothing here
    changes the queue."""
    keys = _list_keys(app, queues)
    with app.pool.acquire(block=True) as connection:  # the app's pool: no new connection (and PING) per call
        # kombu's client adds `global_keyprefix` to the commands it sends itself, LRANGE is not one: the keys carry it
        with connection.default_channel.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.lrange(key, -limit, -1)
            lists = pipe.execute()
    ids = []
    for raw in (item for items in lists for item in reversed(items)):
        if (job_id := _upscale_job_id(raw)) is not None:
            ids.append(job_id)
    return ids


def drop_ended(app: Celery, jobs: JobStore, queues: Iterable[str], depth: int = 1000) -> bool:
    """Removes, from the `depth` messages each list of `queues` gives next, those for jobs that ended or are gone (a
    worker drops them): a cancelled backlog stayed ahead of the live messages until a worker reached it, ~1 KB a
    message, and hid them from the lost-message look (worker.lost), which sent them again. Not those of jobs in
    progress: a message sent again after a lease's lost reply takes the lease over (worker.tasks). Whether a list's
    whole reach (`depth` messages) went: more such may wait behind."""
    keys = _list_keys(app, queues)
    with app.pool.acquire(block=True) as connection:
        client = connection.default_channel.client  # LRANGE and LREM are not prefixed by kombu: the keys are
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.lrange(key, -depth, -1)
            lists = pipe.execute()
        found = [(key, raw, job_id) for key, items in zip(keys, lists) for raw in items
                 if (job_id := _upscale_job_id(raw)) is not None]  # fmt: skip
        statuses = jobs.statuses(job_id for _, _, job_id in found)
        ended = [(key, raw) for key, raw, job_id in found if statuses[job_id] in (None, *TERMINAL)]
        if ended:
            with client.pipeline(transaction=False) as pipe:
                for key, raw in ended:
                    pipe.lrem(key, -1, raw)  # from the consuming end; gone meanwhile (taken): nothing
                pipe.execute()
    per_list = Counter(key for key, _ in ended)
    return any(len(items) == depth and per_list[key] == depth for key, items in zip(keys, lists))


def drop_ended_unacked(app: Celery, jobs: JobStore, queues: Iterable[str]) -> int:
    """Removes from kombu's `unacked` the messages of `queues` whose jobs ended or are gone: a worker killed mid-job
    left its message there for the visibility timeout (13 hours) after its job was requeued and ended (a soak: one
    per kill). Not those of jobs in progress: a dead worker's comes back at the timeout, a last resort. Returns how
    many."""
    queues = list(queues)
    prefix, unacked, index = _unacked_keys(app)
    with app.pool.acquire(block=True) as connection:
        client = connection.default_channel.client  # kombu prefixes HDEL and ZREM, not HGETALL
        held = {tag: job_id for tag, raw in client.hgetall(prefix + unacked).items()
                if (job_id := _unacked_job_id(raw, queues)) is not None}  # fmt: skip
        statuses = jobs.statuses(held.values())
        ended = [tag for tag, job_id in held.items() if statuses[job_id] in (None, *TERMINAL)]
        if ended:
            with client.pipeline(transaction=False) as pipe:
                for tag in ended:  # as kombu's own ack removes it: acknowledged meanwhile, nothing
                    pipe.zrem(index, tag)
                    pipe.hdel(unacked, tag)
                pipe.execute()
    return len(ended)


def held_job_ids(
    app: Celery, queues: Iterable[str], depth: int = 1000, taken_within_s: float | None = None
) -> set[str]:
    """The jobs whose `vsrq.upscale` message the broker holds: waiting in the lists of `queues` (the `depth` messages
    taken next, per list) or taken by a consumer that has not acknowledged it (kombu's `unacked` hash, every queue's),
    read in one transaction, so that no message moving from one to the other in between is missed. What is not here is
    a message nobody holds but a consumer between its BRPOP's reply and its write to `unacked` (microseconds, unless
    it is paused there), or a lost one: a consumer killed in between (the reaper, worker.lost). `taken_within_s`: a
    message a consumer took longer ago than this is not counted (its consumer's clock: kombu's `unacked_index`)."""
    prefix, unacked, index = _unacked_keys(app)
    with app.pool.acquire(block=True) as connection:
        # kombu's client prefixes ZRANGE, not LRANGE or HGETALL: their keys carry the prefix here
        with connection.default_channel.client.pipeline(transaction=True) as pipe:
            for key in _list_keys(app, queues):
                pipe.lrange(key, -depth, -1)
            pipe.hgetall(prefix + unacked)
            pipe.zrange(index, 0, -1, withscores=True)
            *lists, taken, taken_at = pipe.execute()
    ids = {_upscale_job_id(raw) for items in lists for raw in items}
    since = None if taken_within_s is None else time.time() - taken_within_s
    taken_at = dict(taken_at)
    for tag, raw in taken.items():
        if since is None or taken_at.get(tag, since) >= since:
            ids.add(_unacked_job_id(raw))
    ids.discard(None)
    return ids


def _unacked_keys(app: Celery) -> tuple[str, str, str]:
    """The `global_keyprefix`, and kombu's `unacked` hash and `unacked_index` sorted set without it (its client adds it
    to some commands' keys, `PrefixedStrictRedis.PREFIXED_SIMPLE_COMMANDS`, not to others')."""
    options = app.conf.broker_transport_options or {}
    return (options.get("global_keyprefix", ""), options.get("unacked_key", Channel.unacked_key),
            options.get("unacked_index_key", Channel.unacked_index_key))  # fmt: skip


def _unacked_job_id(raw: bytes, queues: Iterable[str] | None = None) -> str | None:
    """The job id of an `unacked` entry, which kombu writes as [message, exchange, routing key]; with `queues`, only
    an entry routed to one of them (the hash is every queue's, another deployment's on the same Redis too)."""
    try:
        envelope, _, routing_key = json.loads(raw)
    except Exception:  # not kombu's: skipped
        return None
    return _envelope_job_id(envelope) if queues is None or routing_key in queues else None


def _list_keys(app: Celery, queues: Iterable[str]) -> list[str]:
    """kombu's Redis transport keeps a queue as one list per priority step (`queue`, `queue\\x06\\x163`, ...), LPUSHes
    and BRPOPs them in step order: the tail of the first non-empty list is the next message. Under the
    `global_keyprefix`, in consumption order."""
    options = app.conf.broker_transport_options or {}
    prefix, steps = options.get("global_keyprefix", ""), options.get("priority_steps", PRIORITY_STEPS)
    queues = list(queues)
    return [f"{prefix}{queue}{Channel.sep}{step}" if step else f"{prefix}{queue}" for step in steps for queue in queues]


def _upscale_job_id(raw: bytes) -> str | None:
    """The job id a message in kombu's Redis envelope carries (Celery's message protocol 2, JSON), or None for
    another task's message or one this cannot read."""
    try:
        envelope = json.loads(raw)
    except Exception:  # anything a stranger's bytes can raise (RecursionError on deep nesting): one message skipped
        return None
    return _envelope_job_id(envelope)


def _envelope_job_id(envelope: object) -> str | None:
    try:
        if envelope["headers"].get("task") != UPSCALE_TASK:
            return None
        body = envelope["body"]
        if envelope.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
    except Exception:  # anything a stranger's bytes can raise: one message skipped
        return None
    if isinstance(args, list) and args and isinstance(args[0], str) and JOB_ID.fullmatch(args[0]):
        return args[0]
    return None
