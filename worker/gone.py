"""Running jobs whose worker is gone: a worker killed (`kill -9`, the OOM killer, a node lost, a pod evicted and
replaced under another name) holds its job until the lease runs out, 120 s after its last heartbeat by default. The
lease is that long because a live engine may send none for a while (a first job's compile); so it cannot tell a dead
process sooner. The worker registry can: every worker rewrites its entry from a thread of its own every third of
`worker_ttl_s` whatever its engine does, and the entry expires `worker_ttl_s` (30 s) after the last write
(storage.workers). The reaper takes back a job once its holder is not the live worker of its name (no entry, or
another process's: a worker started again under its name whose own look for its predecessor's jobs failed) and nothing
has written the job for `worker_ttl_s`, on every look for `grace_s` and on two looks at least.

Why both, and the looks: a Redis restarted from disk brings entries back expired where it was down longer than their
TTL, while their workers live on; they write them again at their next beat (a third of the TTL), and their jobs'
heartbeats come sooner still. The looks are this process's own, as worker.lost's are: a reaper that restarts starts
its grace again. The silence is checked again in the requeue's script (`JobStore.take_back_silent`), so a job leased
again since the look is not touched. What a gone worker was holding is requeued as its lease running out would have
requeued it (`worker_gone`), and counts as that would.

What it costs: a live worker cut off from Redis (a partition) looks gone too, so its job goes back after about 1.5 ×
`worker_ttl_s` and a pass, where the lease alone waited `VSRQ_LEASE_S` (fenced: the cut-off worker's later writes are
refused, its work is redone from its kept windows); a deployment that must ride out longer partitions raises
`VSRQ_WORKER_TTL_S`. And one worker per name, running its own tasks (the solo pool): a second process of the same name,
or a pool child's pid, is a holder no entry names.
"""

from __future__ import annotations

from time import monotonic

from storage.jobs import JobRecord, JobStore
from storage.workers import WorkerInfo, WorkerRegistry


class GoneWorkers:
    """`grace_s`: how long a holder must be found gone from the registry, over two looks at least, before its jobs are
    due; `silent_s`: how long nothing may have written a job of its (the registry's TTL: a live worker beats far more
    often)."""

    def __init__(self, grace_s: float, silent_s: float) -> None:
        self.grace_s, self.silent_s = grace_s, silent_s
        self._missing_since: dict[tuple[str, str], float] = {}  # (job id, lease token) -> when a look first missed
        # its holder: a lease's own, so that a job leased again (a container's new process may hold its predecessor's
        # name and pid) starts a grace of its own

    def due(self, jobs: JobStore) -> list[str]:
        """One look: the running jobs whose holder was gone from the registry on every look for `grace_s`, for the
        caller to take back with `JobStore.take_back_silent(ids, self.silent_s)`."""
        # the jobs first, then the registry: a worker that registers between the two reads is seen alive
        running = [job for job in jobs.running() if job.worker]
        alive = {worker.name: worker for worker in WorkerRegistry(jobs.redis).list()} if running else {}
        now = monotonic()
        missing = {(job.id, job.lease_token or job.worker) for job in running if not _alive(job, alive)}
        # a holder seen alive again, or a lease ended, starts its grace again at its next absence
        self._missing_since = {lease: self._missing_since.get(lease, now) for lease in missing}
        waited = {lease: now - since for lease, since in self._missing_since.items()}
        # two looks at least (a lease first missed on this one has waited 0), and the grace
        return [job_id for (job_id, _), seconds in waited.items() if 0 < seconds and seconds >= self.grace_s]


def _alive(job: JobRecord, alive: dict[str, WorkerInfo]) -> bool:
    """Whether the process holding the job's lease is the live worker of its name: not where none is, nor where the one
    that is has another pid or registered after the lease was taken (a worker started again under its name, whose
    own look for its predecessor's jobs failed; in a container, the new process may get the dead one's pid)."""
    name, _, pid = job.worker.rpartition("/")
    live = alive.get(name)
    return live is not None and str(live.pid) == pid and (job.leased_at is None or live.started_at <= job.leased_at)
