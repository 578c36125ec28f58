"""What the service is doing now, read from Redis at the moment it is asked: jobs waiting per queue, jobs by status,
the live workers, and whether the service can make progress (`health`: model workers per served queue, the reaper's
last pass, jobs past their lease). `vsrq status` prints it; the API's /metrics exports it (api/metrics.py) and
/healthz answers with `health`, so the figures are the records' own and cannot drift the way counters kept in a
process do.

    vsrq:reaper:last_pass    the Redis time the reaper last finished a pass (written by `reaper_passed`)
    vsrq:reaper:lost_messages_resent    how many messages lost by dying consumers the reaper sent again (a counter)
    vsrq:reaper:sweep_failing    why the reaper's last storage sweep failed, until one passes (written by `sweep_ended`)
"""

from __future__ import annotations

import botocore.exceptions
from pydantic import BaseModel
from redis import Redis
from redis.exceptions import AuthenticationError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from storage.blobs import refusal
from storage.jobs import JobRecord, JobStore, Stage, Status
from storage.workers import WorkerInfo, WorkerRegistry


class Health(BaseModel):
    workers: dict[str, int]  # served queue -> live model workers taking jobs from it
    reaper_last_pass_s: float | None  # seconds since the reaper last finished a pass; None: no pass on record
    reaper_ok: bool  # it passed within the staleness bound
    overdue_jobs: int  # in progress past their lease: the reaper requeues them on its next pass
    problems: list[str]  # what makes the service degraded, for a person; empty: healthy

    @property
    def ok(self) -> bool:
        return not self.problems


class Running(BaseModel):
    """A job a live worker runs, as far as it got."""

    stage: Stage | None
    progress: int  # as its owner sees it (`JobRecord.shown_progress`)
    attempt: int
    started_at: float | None  # the job's first attempt's start
    attempt_started_at: float | None = None  # this attempt's (its lease's, Redis time)
    eta: float | None = None  # while upscaling: when its worker expects the engine to finish (`JobRecord.shown_eta`)


class Overview(BaseModel):
    queues: dict[str, int]  # queue -> jobs queued on it
    jobs: dict[Status, int]  # status -> jobs (records still kept)
    workers: list[WorkerInfo]
    running: dict[str, Running] = {}  # job id -> how far it got, for each live worker's job
    health: Health | None = None
    lost_messages_resent: int = 0  # queued jobs' messages the reaper sent again, lost by dying consumers (worker.lost)


def _reaper_key(jobs: JobStore) -> str:
    return f"{jobs.prefix}:reaper:last_pass"


def reaper_passed(jobs: JobStore) -> None:
    """The reaper's heartbeat, after each pass."""
    jobs.redis.set(_reaper_key(jobs), repr(jobs.now()), ex=24 * 3600)


def _sweep_key(jobs: JobStore) -> str:
    return f"{jobs.prefix}:reaper:sweep_failing"


def sweep_ended(jobs: JobStore, problem: str | None) -> None:
    """The reaper's storage sweep ended, failing with `problem` (as an operator reads it) or not: said in `health`
    until one passes (a key without List: only the reaper's log said the sweep failed, storage filling unseen)."""
    if problem is None:
        jobs.redis.delete(_sweep_key(jobs))
    else:
        jobs.redis.set(_sweep_key(jobs), problem, ex=7 * 24 * 3600)


def _resent_key(jobs: JobStore) -> str:
    return f"{jobs.prefix}:reaper:lost_messages_resent"


def lost_message_resent(jobs: JobStore) -> None:
    jobs.redis.incr(_resent_key(jobs))


def health(jobs: JobStore, workers: list[WorkerInfo], models: dict[str, str], reaper_stale_s: float) -> Health:
    """Whether jobs of the served `models` (VSRQ_MODELS: name -> queue) make progress: a model worker on each queue,
    running a model served there, a reaper that passed within `reaper_stale_s`, no job left past its lease (a dead
    reaper, or one that cannot requeue)."""
    queues = list(models.values())
    now = jobs.now()
    served = {queue: sum(queue in w.queues for w in workers if w.model) for queue in sorted(set(queues))}
    last = jobs.redis.get(_reaper_key(jobs))
    since = now - float(last) if last is not None else None
    overdue = jobs.redis.zcount(f"{jobs.prefix}:leases", "-inf", now)
    problems = [f"no worker takes jobs from {queue}" for queue, count in served.items() if not count]
    for worker in workers:  # a GPU worker started without VSRQ_WORKER_MODEL ran the default, lanczos, for K6's jobs
        wanted = sorted({model for model, queue in models.items() if queue in worker.queues})
        if worker.served and wanted and worker.served not in wanted:  # no name: /healthz is public (`vsrq status`)
            problems.append(f"a worker on {', '.join(worker.queues)} runs {worker.served} for jobs of "
                            f"{', '.join(wanted)} (VSRQ_WORKER_MODEL, VSRQ_WORKER_SERVED_AS)")  # fmt: skip
    reaper_ok = since is not None and since <= reaper_stale_s
    if not reaper_ok:
        problems.append("the reaper has not passed " + (f"for {since:.0f} s" if since is not None else "yet"))
    if overdue:
        problems.append(f"{overdue} job(s) in progress past their lease")
    if (failing := jobs.redis.get(_sweep_key(jobs))) is not None:
        problems.append(f"the storage sweep fails: {failing.decode()}; uploads, parts and outputs are not deleted")
    problems += durability(jobs.redis)
    return Health(
        workers=served, reaper_last_pass_s=since, reaper_ok=reaper_ok, overdue_jobs=overdue, problems=problems
    )


NEARLY_FULL = 0.95  # of Redis's maxmemory: said before its writes are refused, and while they are


def durability(redis: Redis) -> list[str]:
    """How the job store's Redis would lose jobs unsaid, as its INFO says (infra/redis.conf: AOF on, no eviction): no
    append-only file (a restart comes back empty: every job a 404), or keys evicted at maxmemory (accepted jobs 404
    a moment later). Nothing where INFO is refused (an ACL, a managed Redis): not known, not said."""
    try:
        persistence, memory = redis.info("persistence"), redis.info("memory")
    except RedisError:
        return []
    problems = []
    if not persistence.get("aof_enabled", 1):
        problems.append("Redis keeps no append-only file (appendonly no): a restart loses the jobs since its last "
                        "snapshot")  # fmt: skip
    limit = memory.get("maxmemory", 0)
    if limit and memory.get("maxmemory_policy", "noeviction") != "noeviction":
        problems.append(f"Redis evicts keys when full (maxmemory-policy {memory['maxmemory_policy']}): jobs vanish; "
                        "set noeviction")  # fmt: skip
    # without eviction, it refuses a write that would take it past maxmemory: it may refuse them all a little below
    elif limit and (use := memory.get("used_memory", 0) / limit) >= NEARLY_FULL:
        problems.append(f"Redis is full or nearly ({use:.0%} of maxmemory {memory['maxmemory_human']}): full, it "
                        "refuses writes, so no job is made or run; free memory or raise maxmemory")  # fmt: skip
    if persistence.get("aof_last_write_status") == "err":
        problems.append("Redis cannot write its append-only file (aof_last_write_status err; a full disk?): it "
                        "refuses writes until it can; see its log")  # fmt: skip
    if persistence.get("rdb_last_bgsave_status") == "err":
        problems.append("Redis's last snapshot failed (rdb_last_bgsave_status err): it may refuse writes until one "
                        "succeeds (stop-writes-on-bgsave-error); see its log")  # fmt: skip
    return problems


def redis_problem(error: Exception) -> str:
    """What a failing Redis call says to an operator, as /healthz and `vsrq status` list it."""
    if isinstance(error, AuthenticationError):
        return "it refuses the password or user (VSRQ_REDIS_URL)"
    if isinstance(error, (RedisConnectionError, RedisTimeoutError)):
        return "it does not answer"
    return f"it fails ({type(error).__name__})"


# What a key denied only some requests lacks (a key refused everything fails HeadBucket, said as the key's refusal)
_KEY_LACKS = {"PutObject": "writes", "DeleteObject": "writes", "ListObjectsV2": "listings",
              "ListMultipartUploads": "listings"}  # fmt: skip


def storage_problem(error: Exception) -> str:
    """Storage's answer as an operator acts on it (a refused key and a missing bucket were both "ClientError")."""
    if isinstance(error, botocore.exceptions.ClientError):
        refused = refusal(error)
        lacks = error.response.get("Error", {}).get("Code") == "AccessDenied"  # not a wrong secret's refusal
        if lacks and (kind := _KEY_LACKS.get(error.operation_name)):
            return f"it refuses this key's {kind} ({error.operation_name}, 403): give it that access"
        if refused == "key":
            return "it refuses the key (VSRQ_S3_ACCESS_KEY, VSRQ_S3_SECRET_KEY), 403"
        if refused == "bucket":
            return "the bucket does not exist (VSRQ_S3_BUCKET): create it, 404"
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"it answers {status} {error.response.get('Error', {}).get('Code')}"
    if isinstance(error, (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionError)):
        return "it does not answer (VSRQ_S3_ENDPOINT_URL)"
    return f"it fails ({type(error).__name__})"


def overview(
    jobs: JobStore,
    registry: WorkerRegistry,
    models: dict[str, str],
    reaper_stale_s: float = 60,
    running: bool = False,
) -> Overview:
    """`models`: those the settings serve, and their queues; a queue that a live model worker takes from is shown too
    (a misrouted worker). `running`: read each live worker's job too (`vsrq status`; /metrics, scraped every few
    seconds, exports none of it)."""
    workers = registry.list()
    names = sorted(set(models.values()).union(*(worker.queues for worker in workers if worker.model)))
    return Overview(
        queues={queue: jobs.queue_depth(queue) for queue in names},
        jobs=jobs.counts(),
        workers=workers,
        running={job.id: _running(job) for job in map(jobs.get, {w.job for w in workers if w.job}) if job}
        if running
        else {},
        health=health(jobs, workers, models, reaper_stale_s),
        lost_messages_resent=int(jobs.redis.get(_resent_key(jobs)) or 0),
    )


def _running(job: JobRecord) -> Running:
    return Running(
        stage=job.stage, progress=job.shown_progress, attempt=job.attempt, started_at=job.started_at,
        attempt_started_at=job.leased_at, eta=job.shown_eta,
    )  # fmt: skip
