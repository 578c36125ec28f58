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

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

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
    work_deleted: int = 0  # blobs under work/
    outputs_deleted: int = 0  # blobs under outputs/, besides those of expired jobs


def sweep(jobs: JobStore, blobs: BlobStore, settings: Settings, stop: threading.Event | None = None) -> SweepReport:
    """`stop`: set, the sweep ends after the job it is expiring (a reaper stopping); the next one goes on from there."""
    now = jobs.now()
    aborted = blobs.abort_incomplete(now - settings.multipart_abort_s)
    doomed = 0  # deleted jobs' own inputs whose deletion failed (storage down, a crash)
    for key in jobs.doomed_inputs():
        try:
            blobs.delete(key)
        except Exception as error:  # one storage refuses (a lock, a policy) must not hold the rest of the sweep
            log.warning("storage sweep: %s not deleted (%s); tried again next time", key, error)
            continue
        jobs.forget_doomed(key)
        doomed += 1
    # Listed before the jobs are read: an upload a job claims after this is younger than its TTL's start.
    born_before = now - settings.upload_ttl_s
    stale_uploads = [blob.key for blob in blobs.entries(UPLOADS) if (blob.modified or now) < born_before]
    live: dict[str, JobRecord] = {}
    expired: list[JobRecord] = []
    for job in jobs.records():
        if stop is not None and stop.is_set():
            return SweepReport(aborted, doomed, len(expired))
        if job.status in TERMINAL and job.expires_at is not None and job.expires_at < now:
            expired += [job] if _expire(jobs, blobs, job) else []
        else:
            live[job.id] = job

    # What live jobs name stays; an expired job's own input went with it
    claimed = {job.input.key for job in live.values()} | {job.input.key for job in expired if job.input.owned_by_job}
    unclaimed = [key for key in stale_uploads if key not in claimed]
    for key in unclaimed:
        blobs.delete(key)

    work = _delete_grouped(jobs, blobs, WORK, live, keep=lambda job, key: job.status not in TERMINAL)
    outputs = _delete_grouped(
        jobs, blobs, OUTPUTS, live, keep=lambda job, key: job.status not in TERMINAL or promoted(job, key)
    )
    report = SweepReport(aborted, len(unclaimed) + doomed, len(expired), work, outputs)
    if report != SweepReport():
        log.info("storage sweep: %s", report)
    return report


def _expire(jobs: JobStore, blobs: BlobStore, job: JobRecord) -> bool:
    try:
        jobs.delete(job.id)  # the record first, as DELETE does: nobody sees a job whose files are half gone
    except JobNotFound:  # deleted by its owner meanwhile
        return False
    delete_job_files(jobs, blobs, job)
    return True


def promoted(job: JobRecord | None, key: str) -> bool:
    """Whether `key` is the job's output or one of its previews (the attempt that wrote it completed the job)."""
    return job is not None and job.output is not None and key in job.output.keys()


def _delete_grouped(
    jobs: JobStore, blobs: BlobStore, root: str, live: dict[str, JobRecord], keep: Callable[[JobRecord, str], bool]
) -> int:
    """Deletes the blobs under root/{job_id}/ that `keep(job, key)` refuses, and all of those of jobs that no longer
    exist. A job missing from the scan is read again first: it may have been created since."""
    by_job: dict[str, list[str]] = defaultdict(list)
    for key in blobs.keys(root):
        by_job[key.removeprefix(root).split("/", 1)[0]].append(key)
    deleted = 0
    for job_id, keys in by_job.items():
        job = live.get(job_id) or jobs.get(job_id)
        doomed = keys if job is None else [key for key in keys if not keep(job, key)]
        for key in doomed:
            blobs.delete(key)
        deleted += len(doomed)
    return deleted
