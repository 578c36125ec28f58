"""Queued jobs whose `vsrq.upscale` message was lost: kombu's Redis transport pops a message off its list (BRPOP)
before the consumer writes it to its `unacked` hash, and a consumer killed in between takes it with it. The job stays
`queued`, its message sent, with nothing left to run it: the reaper sends it another (worker.reaper).

A job is lost when the broker holds no message for it (storage.queue.held_job_ids: its queue's lists, `unacked`) on
every look for `grace_s` at least, and on two looks at least. A live consumer holds a message out of both places only
between BRPOP's reply and its next write, so a grace of seconds only delays a lost job; a consumer paused there past it
(SIGSTOP, swapping) gets a duplicate, which is harmless: the first delivery leases the job, and a message for a job
that is not queued is dropped (worker.tasks).

A consumer killed after its write to `unacked`, before its task leased the job (a worker whose tail runs takes its next
message meanwhile), leaves the message there until kombu's visibility timeout, set above the longest job: hours. A
worker leases its job first thing once it has the message, so one in `unacked` whose job is still queued `unacked_s`
after it was taken is counted as not held (then lost after the grace, as above).

The looks are this process's own, not kept in Redis: a reaper that restarts, or a Redis that lost writes, starts its
grace again rather than taking an old sighting for a second look. Several reapers may each send one; see above.
"""

from __future__ import annotations

from time import monotonic

from celery import Celery

from storage.jobs import JobRecord, JobStore, Status
from storage.queue import drop_ended, held_job_ids


class LostMessages:
    """`queues`: the served ones (a job of another has no worker to lose its message to); `front`: how many of each
    queue's first jobs are looked at per pass: a message a consumer takes is the front of its queue, and the jobs
    behind a lost one are leased and leave the queue, so lost jobs gather there; `depth`: how many messages of each list
    are read (bounded cost; messages of ended jobs among them are removed first, and a look whose reach held nothing
    else counts for nothing; a job whose message still waits deeper is taken for lost: one harmless duplicate);
    `unacked_s`: how long ago a consumer may have taken a queued job's message and still hold it (None: for as long as
    `unacked` keeps it)."""

    def __init__(
        self, queues: list[str], grace_s: float, front: int = 100, depth: int = 1000, unacked_s: float | None = None
    ) -> None:
        self.queues, self.grace_s, self.front, self.depth, self.unacked_s = queues, grace_s, front, depth, unacked_s
        self._missing_since: dict[str, float] = {}  # job id -> when a look first found no message for it

    def due(self, jobs: JobStore, celery: Celery) -> list[JobRecord]:
        """One look: the queued jobs found without a message on every look for `grace_s` and two looks at least, for
        the caller to send one each (they start their grace again)."""
        # the jobs first, then the broker: a message sent after the jobs were read is not needed by any of them
        candidates = [job_id for queue in self.queues for job_id in jobs.sent_front(queue, self.front)]
        if not candidates:
            return []
        # messages of ended jobs ahead of the live ones go first; where a list's whole reach was such, more may hide
        # the live ones deeper still (a cancelled backlog): this look says nothing, and starts no grace
        if drop_ended(celery, jobs, self.queues, self.depth):
            return []
        held = held_job_ids(celery, self.queues, self.depth, self.unacked_s)
        now = monotonic()
        # a job found with a message, or no longer at the front, is forgotten: its next loss is a new one
        self._missing_since = {
            job_id: self._missing_since.get(job_id, now) for job_id in candidates if job_id not in held
        }
        due = []
        for job_id, since in list(self._missing_since.items()):
            if since < now and now - since >= self.grace_s:
                del self._missing_since[job_id]
                job = jobs.get(job_id)
                if job is not None and job.status == Status.QUEUED:  # leased since the look: nothing to send
                    due.append(job)
        return due
