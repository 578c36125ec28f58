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

A webhook's attempt is held the same way (storage.webhooks records its delivery worker and when it started): a delivery
worker killed mid-attempt held its event for `webhook_claim_s` (120 s); the reaper makes the event due again once its
holder is gone and the attempt began `worker_ttl_s` ago, and `webhook_timeout_s` at least (the attempt's own limit,
counted from before its start is recorded: the payload, the host's lookup and the POST end within it), and a
delivery worker started again under its name does so at once (worker.signals), as a GPU worker does for its
predecessor's jobs.

What it costs: a live worker cut off from Redis (a partition) looks gone too, so its job goes back after about 1.5 ×
`worker_ttl_s` and a pass, where the lease alone waited `VSRQ_LEASE_S` (fenced: the cut-off worker's later writes are
refused, its work is redone from its kept windows); a deployment that must ride out longer partitions raises
`VSRQ_WORKER_TTL_S`. And one worker per name, running its own tasks (the solo or threads pool): a second process of
the same name, or a pool child's pid, is a holder no entry names.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import monotonic

from redis import Redis

from storage.jobs import JobStore
from storage.workers import Held, WorkerInfo, WorkerRegistry


class GoneWorkers:
    """`grace_s`: how long a holder must be found gone from the registry, over two looks at least, before what it holds
    is due; `silent_s`: how long nothing may have written it (the registry's TTL: a live worker beats far more often).
    One instance per kind of holding (jobs' leases, webhooks' attempts): a look forgets what it was not shown."""

    def __init__(self, grace_s: float, silent_s: float) -> None:
        self.grace_s, self.silent_s = grace_s, silent_s
        self._missing_since: dict[tuple[str, str], float] = {}  # (id, token) -> when a look first missed its holder:
        # a holding's own, so that a job leased again (a container's new process may hold its predecessor's name and
        # pid) starts a grace of its own

    def due(self, held: Sequence[Held], redis: Redis) -> list[str]:
        """One look: the ids of `held` whose holder was gone from the registry on every look for `grace_s`, for the
        caller to take back if still silent (`JobStore.take_back_silent`, `Outbox.take_back`). `held` is read
        before this call reads the registry: a worker that registers between the two reads is seen alive."""
        alive = {worker.name: worker for worker in WorkerRegistry(redis).list()} if held else {}
        now = monotonic()
        missing = {(holding.id, holding.token) for holding in held if not _alive(holding, alive)}
        # a holder seen alive again, or a holding ended, starts its grace again at its next absence
        self._missing_since = {key: self._missing_since.get(key, now) for key in missing}
        waited = {key: now - since for key, since in self._missing_since.items()}
        # two looks at least (a holding first missed on this one has waited 0), and the grace
        return [held_id for (held_id, _), seconds in waited.items() if 0 < seconds and seconds >= self.grace_s]


def leases(jobs: JobStore) -> list[Held]:
    """The running jobs' leases."""
    return [
        Held(job.id, job.lease_token or job.worker, job.worker, job.leased_at) for job in jobs.running() if job.worker
    ]


def _alive(held: Held, alive: dict[str, WorkerInfo]) -> bool:
    """Whether the process holding it is the live worker of its name: not where none is, nor where the one that is has
    another pid or registered after it was taken (a worker started again under its name, whose own look for its
    predecessor's holdings failed; in a container, the new process may get the dead one's pid)."""
    name, _, pid = held.holder.rpartition("/")
    live = alive.get(name)
    return live is not None and str(live.pid) == pid and (held.since is None or live.started_at <= held.since)
