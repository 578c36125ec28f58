"""Running jobs whose worker is gone: a worker killed (`kill -9`, the OOM killer, a node lost, a pod evicted and
replaced under another name) holds its job until the lease runs out, 120 s after its last heartbeat by default. The
lease is that long because a live engine may send none for a while (a first job's compile); so it cannot tell a dead
process sooner. The worker registry can: every worker rewrites its entry from a thread of its own every third of
`worker_ttl_s` whatever its engine does, and the entry expires `worker_ttl_s` (30 s) after the last write
(storage.workers). The reaper takes back a job once its holder has no entry and nothing has written the job for
`worker_ttl_s`, on every look for `grace_s` and on two looks at least.

Why both, and the looks: a Redis restarted from disk brings entries back expired where it was down longer than their
TTL, while their workers live on; they write them again at their next beat (a third of the TTL), and their jobs'
heartbeats come sooner still. The looks are this process's own, as worker.lost's are: a reaper that restarts starts
its grace again. The silence is checked again in the requeue's script (`JobStore.take_back_silent`), so a job leased
again since the look is not touched. What a gone worker was holding is requeued as its lease running out would have
requeued it (`worker_gone`), and counts as that would.
"""

from __future__ import annotations

from time import monotonic

from storage.jobs import JobStore
from storage.workers import WorkerRegistry


def holder_name(holder: str) -> str:
    """The worker's registry name from a lease holder, "{worker name}/{pid}"."""
    return holder.rpartition("/")[0]


class GoneWorkers:
    """`grace_s`: how long a holder must be found missing from the registry, over two looks at least, before its jobs
    are due; `silent_s`: how long nothing may have written a job of its (the registry's TTL: a live worker beats far
    more often)."""

    def __init__(self, grace_s: float, silent_s: float) -> None:
        self.grace_s, self.silent_s = grace_s, silent_s
        self._missing_since: dict[str, float] = {}  # holder name -> when a look first found it missing

    def due(self, jobs: JobStore) -> list[str]:
        """One look: the running jobs whose holder was missing from the registry on every look for `grace_s`, for the
        caller to take back with `JobStore.take_back_silent(ids, self.silent_s)`."""
        # the jobs first, then the registry: a worker that registers between the two reads is seen alive
        held = {job.id: holder_name(job.worker) for job in jobs.running() if job.worker}
        alive = {worker.name for worker in WorkerRegistry(jobs.redis).list()} if held else set()
        now = monotonic()
        missing = set(held.values()) - alive
        # a holder seen alive again, or holding nothing now, starts its grace again at its next absence
        self._missing_since = {name: self._missing_since.get(name, now) for name in missing}
        gone = {name for name, since in self._missing_since.items() if since < now and now - since >= self.grace_s}
        return [job_id for job_id, name in held.items() if name in gone]
