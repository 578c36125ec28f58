"""Blob storage lifecycle: what a job's deletion or expiry removes, and the periodic sweep of what nothing else will.

`sweep` is one pass; the reaper (worker/reaper.py) runs it every `sweep_interval_s`:

  (a) multipart uploads begun more than `multipart_abort_s` ago and never completed (the local backend: `.partial`
      files) are aborted;
  (b) uploads (uploads/{owner}/{upload_id}) older than `upload_ttl_s` that no live job names are deleted: reusable
      uploads past their TTL, and the files of requests that died between the upload and the job;
  (c) finished jobs past `expires_at` are deleted as DELETE /v1/videos/{id} deletes them: record, outputs, kept
      windows and the input the job owns;
  (d) kept windows (work/) of ended or deleted jobs, outputs of deleted jobs, and outputs of ended jobs other than the
      promoted one (attempts whose own cleanup failed) are deleted.

It lives in storage/ rather than worker/ because the API's delete path uses it too, and the API never imports the
worker's modules (torch). Ages are measured on Redis's clock, which wrote every `expires_at`, against the blob
store's modification times: the two servers' clocks are assumed to agree (NTP).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from storage.blobs import BlobStore, output_prefix, work_prefix
from storage.config import Settings
from storage.jobs import TERMINAL, JobNotFound, JobRecord, JobStore

log = logging.getLogger("vsrq.lifecycle")

UPLOADS, OUTPUTS, WORK = "uploads/", "outputs/", "work/"


def delete_job_files(jobs: JobStore, blobs: BlobStore, job: JobRecord) -> None:
    """A deleted or expired job's files, its record gone: every attempt's output, its kept windows, and its input when
    the job owns it (a reusable upload is left to its TTL). What storage failed to delete is the sweep's: outputs and
    windows of no job, and the input, which the record's deletion marked doomed (`JobStore.delete`)."""
    blobs.delete_prefix(output_prefix(job.id))
    blobs.delete_prefix(work_prefix(job.id))
    if job.input.owned_by_job:
        blobs.delete(job.input.key)
        jobs.forget_doomed(job.input.key)


def forget_attempts(blobs: BlobStore, job: JobRecord) -> None:
    """The files of a job that ended with no attempt to clean up after it (cancelled while queued after an attempt,
    or failed or cancelled as its lease ran out or its worker was found dead): its kept windows and what its attempts
    uploaded, none of it promoted. Deleted now, not at the next sweep (d): a long job's windows are hundreds of GB.
    Storage that fails leaves them to the sweep."""
    if job.status not in TERMINAL or job.output is not None or job.attempt == 0:  # nothing an attempt left, or kept
        return
    try:
        blobs.delete_prefix(work_prefix(job.id))
        blobs.delete_prefix(output_prefix(job.id))
    except Exception as error:
        log.warning("%s: its kept windows and outputs are left to the storage sweep (%s)", job.id, error)


@dataclass(frozen=True)
class SweepReport:
    multipart_aborted: int = 0
    uploads_deleted: int = 0
    jobs_expired: int = 0
    # blobs under work/ and outputs/, besides those of the jobs this sweep expired (those a stopped sweep left are
    # counted by the next, as files of no job)
    work_deleted: int = 0
    outputs_deleted: int = 0


@dataclass(frozen=True, slots=True)
class _Kept:
    """What the sweep holds of a live job while it lists storage: ~0.26 KB where its record is ~4.6 (250,000 live jobs
    were 1.2 GB of reaper)."""

    ended: bool  # no attempt will write again
    output: str | None  # the promoted output's key less `mp4`: the keys of it and its previews (`preview_key`) begin so

    @classmethod
    def of(cls, job: JobRecord) -> _Kept:
        return cls(job.status in TERMINAL, job.output.key.removesuffix("mp4") if job.output else None)

    def promoted(self, key: str) -> bool:
        return self.output is not None and key.startswith(self.output)


def sweep(jobs: JobStore, blobs: BlobStore, settings: Settings, stop: threading.Event | None = None) -> SweepReport:
    """`stop`: set, the sweep ends after the record or the batch of blobs at hand (a reaper stopping); the next one
    goes on from there. An expired job's record goes first, as DELETE does; its files go with the listings below, in
    batches, and what a stop or a storage failure leaves is found by the next sweep as files of no job."""
    stopping = stop.is_set if stop is not None else lambda: False
    now = jobs.now()
    aborted = blobs.abort_incomplete(now - settings.multipart_abort_s)
    # 1. Listed before the jobs are read: an upload a job claims after this is younger than its TTL's start.
    born_before = now - settings.upload_ttl_s
    stale_uploads = {blob.key for blob in blobs.entries(UPLOADS) if (blob.modified or now) < born_before}

    # 2. The records: expired ones deleted (their own inputs marked doomed), live ones summed up
    live: dict[str, _Kept] = {}
    claimed: set[str] = set()  # stale uploads a live job names
    expired: set[str] = set()
    expired_inputs: set[str] = set()
    owners: set[str] = set()
    for job in jobs.records():
        owners.add(job.owner)
        if stopping():
            return SweepReport(aborted, 0, len(expired))
        if job.status in TERMINAL and job.expires_at is not None and job.expires_at < now:
            if _expire(jobs, job):
                expired.add(job.id)
                if job.input.owned_by_job:
                    expired_inputs.add(job.input.key)
        else:
            live[job.id] = _Kept.of(job)
            if job.input.key in stale_uploads:
                claimed.add(job.input.key)
    jobs.add_owners(owners)  # those of jobs an API older than the owners' set made (a rolling deploy's old pods)

    # 3. Deleted jobs' own inputs (expired now, or deleted before while storage failed), then uploads nobody names
    doomed = _delete_doomed(jobs, blobs)
    unclaimed = stale_uploads - claimed - doomed - expired_inputs
    unclaimed_gone = len(unclaimed) - len(_delete(blobs, unclaimed, "unclaimed uploads"))

    # 4. Files of no live job, and of ended jobs besides their promoted output
    known = _Known(jobs, live, expired)
    work = _delete_grouped(blobs, WORK, known, lambda job, key: not job.ended, stopping)
    outputs = _delete_grouped(blobs, OUTPUTS, known, lambda job, key: not job.ended or job.promoted(key), stopping)
    report = SweepReport(aborted, unclaimed_gone + len(doomed - expired_inputs), len(expired), work, outputs)
    if report != SweepReport():
        log.info("storage sweep: %s", report)
    return report


def _expire(jobs: JobStore, job: JobRecord) -> bool:
    try:
        jobs.delete(job.id)  # the record first, as DELETE does: nobody sees a job whose files are half gone
    except JobNotFound:  # deleted by its owner meanwhile
        return False
    return True


def promoted(job: JobRecord | None, key: str) -> bool:
    """Whether `key` is the job's output or one of its previews (the attempt that wrote it completed the job)."""
    return job is not None and job.output is not None and key in job.output.keys()


def _delete_doomed(jobs: JobStore, blobs: BlobStore) -> set[str]:
    """Deletes the inputs of deleted jobs that are marked doomed; returns those gone."""
    doomed = set(jobs.doomed_inputs(limit=None))
    gone = doomed.difference(_delete(blobs, doomed, "deleted jobs' inputs"))
    jobs.forget_doomed(*gone)
    return gone


def _delete(blobs: BlobStore, keys: Collection[str], what: str) -> Collection[str]:
    """Deletes `keys` in batches; returns those not deleted (storage refused them, or failed: tried next time)."""
    try:
        refused = blobs.delete_many(keys)
    except Exception as error:  # storage down: the next sweep goes on from here
        log.warning("storage sweep: %d %s not deleted (%s); tried again next time", len(keys), what, error)
        return keys
    if refused:  # one refusal (a lock, a policy) must not hold the rest of the sweep
        key, code = next(iter(refused.items()))
        log.warning("storage sweep: storage did not delete %d %s (%s: %s first)", len(refused), what, code, key)
    return refused.keys()


@dataclass
class _Known:
    """The jobs the listings' blobs belong to: the scan's live ones, those it expired, and others read as met (created
    since the scan, or gone: deleted, or expired by an earlier sweep that stopped), a batch's in one round trip."""

    jobs: JobStore
    live: dict[str, _Kept]
    expired: set[str]
    others: dict[str, _Kept | None] = field(default_factory=dict)

    def read(self, job_ids: set[str]) -> None:
        unknown = [job_id for job_id in job_ids if job_id not in self.live and job_id not in self.others]
        for job_id, record in self.jobs.get_many(unknown).items():
            self.others[job_id] = None if record is None else _Kept.of(record)

    def get(self, job_id: str) -> _Kept | None:
        return self.live.get(job_id) or self.others.get(job_id)


def _delete_grouped(
    blobs: BlobStore, root: str, known: _Known, keep: Callable[[_Kept, str], bool], stopping: Callable[[], bool]
) -> int:
    """Deletes the blobs under root/{job_id}/ that `keep(job, key)` refuses, and all of those of jobs that no longer
    exist, 1,000 of the listing at a time; returns how many, those of jobs this sweep expired aside."""
    deleted = 0
    listing = blobs.keys(root)
    while not stopping() and (batch := list(itertools.islice(listing, 1000))):
        job_ids = {key: key.removeprefix(root).split("/", 1)[0] for key in batch}
        known.read({job_id for job_id in job_ids.values() if job_id not in known.expired})
        doomed, counted = [], set()  # counted: the doomed of jobs this sweep did not expire
        for key, job_id in job_ids.items():
            if job_id in known.expired:
                doomed.append(key)
            elif (job := known.get(job_id)) is None or not keep(job, key):
                doomed.append(key)
                counted.add(key)
        deleted += len(counted.difference(_delete(blobs, doomed, f"blobs under {root}")))
    return deleted
