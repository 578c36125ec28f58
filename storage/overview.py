"""What the service is doing now, read from Redis at the moment it is asked: jobs waiting per queue, jobs by status,
the live workers. `vsrq status` prints it; the API's /metrics exports it (api/metrics.py), so the figures are
the records' own and cannot drift the way counters kept in a process do.
"""

from __future__ import annotations

from pydantic import BaseModel

from storage.jobs import JobStore, Status
from storage.workers import WorkerInfo, WorkerRegistry


class Overview(BaseModel):
    queues: dict[str, int]  # queue -> jobs queued on it
    jobs: dict[Status, int]  # status -> jobs (records still kept)
    workers: list[WorkerInfo]


def job_counts(jobs: JobStore) -> dict[Status, int]:
    """Jobs by status, summed over the owners' per-status indexes (vsrq:owner:{owner}:{status}, storage/jobs.py).
    Owners are found with SCAN, so one whose API key was removed still counts; the cost is one pass over the keyspace
    in batches of 1000 keys, cheap at a scrape interval."""
    counts = dict.fromkeys(Status, 0)
    suffix = ":all"
    with jobs.redis.pipeline(transaction=False) as pipe:
        for key in jobs.redis.scan_iter(match=f"{jobs.prefix}:owner:*{suffix}", count=1000):
            owner_prefix = key.decode().removesuffix(suffix)
            for status in Status:
                pipe.zcard(f"{owner_prefix}:{status}")
        sizes = pipe.execute()
    for index, size in enumerate(sizes):
        counts[list(Status)[index % len(Status)]] += size
    return counts


def overview(jobs: JobStore, registry: WorkerRegistry, queues: list[str]) -> Overview:
    """`queues`: those the settings serve; one that a live model worker takes from is shown too (a misrouted worker)."""
    workers = registry.list()
    names = sorted(set(queues).union(*(worker.queues for worker in workers if worker.model)))
    return Overview(queues={queue: jobs.queue_depth(queue) for queue in names}, jobs=job_counts(jobs), workers=workers)
