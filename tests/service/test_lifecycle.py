"""Storage lifecycle (storage/lifecycle.py) against real SeaweedFS and the local backend, with job records in the real
Redis: the sweep of incomplete multipart uploads, unclaimed uploads, expired jobs and the leftovers of ended or
deleted jobs; DELETE removing a job's kept windows; the reaper process sweeping on its own.

Each sweep runs over a bucket and a job-key prefix of its own, so it never touches what other tests keep."""

from __future__ import annotations

import io
import json
import os
import secrets
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from storage.blobs import (
    BlobStore,
    LocalBlobStore,
    S3BlobStore,
    attempt_output_key,
    new_upload_id,
    output_prefix,
    upload_key,
    work_prefix,
)
from storage.jobs import InputInfo, JobStore, OutputInfo, job_key
from storage.lifecycle import SweepReport, sweep

from .conftest import PART, ROOT, auth

TTL_S = 3  # upload TTL and multipart age; S3 modification times have whole seconds
EXPIRED_TTL_S = 1  # result TTL of the jobs that expire during the test


@pytest.fixture(params=["s3", "local"])
def blobs(request, s3: S3BlobStore, tmp_path: Path) -> Iterator[BlobStore]:
    if request.param == "local":
        yield LocalBlobStore(tmp_path / "blobs")
        return
    bucket = f"lifecycle-{secrets.token_hex(4)}"
    s3.client.create_bucket(Bucket=bucket)
    store = S3BlobStore(s3.client, bucket, part_bytes=PART)
    yield store
    store.abort_incomplete(time.time() + 60)
    store.delete_prefix("")
    s3.client.delete_bucket(Bucket=bucket)


def stores(redis_client) -> tuple[JobStore, JobStore]:
    """Two views of one fresh job-key prefix: jobs that expire at once, and jobs that keep their results."""
    prefix = f"lc-{secrets.token_hex(4)}"
    short = JobStore(redis_client, result_ttl_s=EXPIRED_TTL_S, max_attempts=3, prefix=prefix)
    return short, JobStore(redis_client, result_ttl_s=3600, max_attempts=3, prefix=prefix)


def put(blobs: BlobStore, key: str, data: bytes = b"x" * 1000) -> str:
    blobs.put(key, io.BytesIO(data))
    return key


def new_job(jobs: JobStore, blobs: BlobStore, *, owned: bool, input_key: str | None = None) -> str:
    key = input_key or put(blobs, upload_key("erin", new_upload_id()))
    job = jobs.create(
        owner="erin",
        model="lanczos",
        queue="vsrq.none",
        params={},
        input=InputInfo(key=key, bytes=1000, owned_by_job=owned),
    )
    return job.id


def finish(jobs: JobStore, blobs: BlobStore, job_id: str, attempts: int = 1) -> None:
    """Runs `attempts` attempts that each write an output and kept windows; the last completes."""
    for attempt in range(1, attempts + 1):
        lease = jobs.lease(job_id, "w", 60)
        put(blobs, attempt_output_key(job_id, attempt, lease.token))
        put(blobs, f"{work_prefix(job_id)}windows/window-0000{attempt}.json")
        if attempt < attempts:
            lease.retry("gpu_oom", "out of memory")
    key = attempt_output_key(job_id, attempts, lease.token)
    lease.complete(OutputInfo(key=key, bytes=1000, sha256="0" * 64))


def incomplete_upload(blobs: BlobStore, key: str) -> None:
    """A write that began and never finished: an S3 multipart upload with a part, or a local `.partial` file."""
    if isinstance(blobs, S3BlobStore):
        upload = blobs.client.create_multipart_upload(Bucket=blobs.bucket, Key=key)
        blobs.client.upload_part(
            Bucket=blobs.bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"p" * PART
        )
    else:
        partial = blobs.root / f"{key}.partial"
        partial = partial.with_name("." + partial.name)
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(b"p" * 1000)


def incomplete(blobs: BlobStore) -> set[str]:
    if isinstance(blobs, S3BlobStore):
        uploads = blobs.client.list_multipart_uploads(Bucket=blobs.bucket).get("Uploads", [])
        return {upload["Key"] for upload in uploads}
    return {path.relative_to(blobs.root).as_posix() for path in blobs.root.rglob(".*.partial")}


def test_deleting_a_job_s_work_drops_the_window_upload_a_killed_worker_left(blobs):
    """A worker killed mid-upload of a kept window (a chaos trial: the whole stack `kill -9`ed) left an S3 multipart
    upload under its job's work/ prefix: in no listing of blobs, and kept for the sweep's day after the job had
    completed and its work/ was deleted. Another job's upload in flight stays."""
    job, other = ("video_" + secrets.token_hex(12) for _ in range(2))
    incomplete_upload(blobs, f"{work_prefix(job)}windows/k/window-00002.tail.npy")
    incomplete_upload(blobs, f"{work_prefix(other)}windows/k/window-00001.tail.npy")
    put(blobs, f"{work_prefix(job)}windows/k/window-00001.json")
    assert blobs.delete_prefix(work_prefix(job)) == 1
    assert {key.split("/")[1] for key in incomplete(blobs) if key.startswith("work/")} >= {other}
    assert not any(key.startswith(work_prefix(job)) for key in incomplete(blobs))
    blobs.delete_prefix(work_prefix(other))
    assert not any(key.startswith(work_prefix(other)) for key in incomplete(blobs))


def test_the_sweep_deletes_what_no_job_needs_and_keeps_the_rest(blobs, redis_client, settings):
    expiring, keeping = stores(redis_client)

    # Old: written, then aged past the TTLs below
    incomplete_upload(blobs, "uploads/erin/upload_abandoned")
    orphan_upload = put(blobs, upload_key("erin", new_upload_id()))  # a request died between upload and job
    reusable = put(blobs, upload_key("erin", new_upload_id()))  # named by a queued job: kept past its TTL
    queued = new_job(keeping, blobs, owned=False, input_key=reusable)
    expired = new_job(expiring, blobs, owned=True)
    finish(expiring, blobs, expired)
    completed = new_job(keeping, blobs, owned=True)
    finish(keeping, blobs, completed, attempts=2)
    failed = new_job(keeping, blobs, owned=True)
    keeping.lease(failed, "w", 60).fail("input_corrupt", "cut short")
    put(blobs, f"{work_prefix(failed)}windows/window-00000.json")
    running = new_job(keeping, blobs, owned=True)
    lease = keeping.lease(running, "w", 60)
    running_files = {
        put(blobs, attempt_output_key(running, lease.attempt, lease.token)),
        put(blobs, f"{work_prefix(running)}windows/window-00000.json"),
    }
    gone = "video_" + secrets.token_hex(12)  # deleted while its storage was down: its files stayed
    put(blobs, attempt_output_key(gone, 1, secrets.token_hex(8)))
    put(blobs, f"{work_prefix(gone)}windows/window-00000.json")
    time.sleep(TTL_S + 1.5)

    # Young: within their TTLs
    incomplete_upload(blobs, "uploads/erin/upload_in_flight")
    young_upload = put(blobs, upload_key("erin", new_upload_id()))

    config = settings.model_copy(update={"upload_ttl_s": TTL_S, "multipart_abort_s": TTL_S})
    report = sweep(keeping, blobs, config)

    assert incomplete(blobs) == {
        "uploads/erin/upload_in_flight" if isinstance(blobs, S3BlobStore) else "uploads/erin/.upload_in_flight.partial"
    }
    assert expiring.get(expired) is None and keeping.get(completed) is not None  # expired: deleted like DELETE does
    completed_job = keeping.require(completed)
    assert set(blobs.keys("")) == {
        reusable,
        young_upload,
        completed_job.input.key,  # owned by a job that keeps its result
        keeping.require(failed).input.key,
        keeping.require(running).input.key,
        completed_job.output.key,  # the promoted output (attempt 2's); attempt 1's is gone, and both jobs' windows
        *running_files,  # a running job's files are its worker's
    }
    assert orphan_upload not in set(blobs.keys(""))
    assert report == SweepReport(
        multipart_aborted=1, uploads_deleted=1, jobs_expired=1, work_deleted=4, outputs_deleted=2
    ), report
    assert keeping.require(queued).status == "queued"

    # Nothing is left to do: a second sweep (with the default TTLs: what is young now ages meanwhile) deletes nothing
    assert sweep(keeping, blobs, settings) == SweepReport()


def test_an_expired_job_goes_with_its_files_but_an_upload_within_its_ttl_stays(blobs, redis_client, settings):
    expiring, keeping = stores(redis_client)
    reusable = put(blobs, upload_key("erin", new_upload_id()))
    job_id = new_job(expiring, blobs, owned=False, input_key=reusable)
    finish(expiring, blobs, job_id)
    time.sleep(EXPIRED_TTL_S + 0.5)
    # The upload is younger than its TTL: the expired job's files go, the reusable upload stays
    report = sweep(keeping, blobs, settings)
    assert (report.jobs_expired, report.uploads_deleted) == (1, 0)
    assert set(blobs.keys("")) == {reusable} and keeping.get(job_id) is None


def test_delete_removes_the_kept_windows_with_the_job(api, s3, clip):
    files = {"video_reference": ("clip.mp4", clip, "video/mp4")}
    data = {"model": "lanczos", "sr_resolution_scale": "2"}
    created = requests.post(f"{api}/v1/videos", data=data, files=files, headers=auth("erin"), timeout=30)
    assert created.status_code == 200, created.text
    job_id = created.json()["id"]
    window = put(s3, f"{work_prefix(job_id)}windows/window-00000.json")  # as a requeued attempt leaves them
    output = put(s3, attempt_output_key(job_id, 1, secrets.token_hex(8)))
    response = requests.delete(f"{api}/v1/videos/{job_id}", headers=auth("erin"), timeout=30)
    assert response.status_code == 200, response.text
    assert not s3.exists(window) and not s3.exists(output)
    assert list(s3.keys(work_prefix(job_id))) == list(s3.keys(output_prefix(job_id))) == []


def test_the_reaper_process_sweeps_storage(service_env, s3, jobs, tmp_path):
    # A deleted job's leftovers in the service's own bucket; the reaper, with the default TTLs, sweeps them at start
    gone = "video_" + secrets.token_hex(12)
    leftovers = {
        put(s3, attempt_output_key(gone, 1, secrets.token_hex(8))),
        put(s3, f"{work_prefix(gone)}windows/window-00000.json"),
    }
    # (with a long enqueue grace: other tests' jobs, queued on purpose without a message, stay so)
    env = {
        **os.environ,
        **service_env,
        "VSRQ_REAP_INTERVAL_S": "0.2",
        "VSRQ_SWEEP_INTERVAL_S": "3600",
        "VSRQ_ENQUEUE_GRACE_S": "86400",
    }
    log = tmp_path / "reaper.log"
    with open(log, "wb") as out:
        reaper = subprocess.Popen([sys.executable, "-m", "worker.reaper"], cwd=ROOT, env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while any(s3.exists(key) for key in leftovers):
            assert reaper.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        reaper.terminate()
        reaper.wait(30)
    assert "storage sweep" in log.read_text()


def copies(jobs: JobStore, job_id: str, n: int, *, own_inputs: bool = False) -> list[str]:
    """`n` more records like `job_id`'s as the store wrote it, under new ids (one pipeline: thousands in a second);
    `own_inputs`: each naming an input of its own, uploads/erin/{id}."""
    fields = jobs.redis.hgetall(job_key(jobs.prefix, job_id))
    ids = ["video_" + secrets.token_hex(12) for _ in range(n)]
    with jobs.redis.pipeline(transaction=False) as pipe:
        for new_id in ids:
            copy = {**fields, b"id": new_id.encode()}
            if own_inputs:
                copy[b"input"] = json.dumps({**json.loads(fields[b"input"]), "key": f"uploads/erin/{new_id}"})
            pipe.hset(job_key(jobs.prefix, new_id), mapping=copy)
        pipe.execute()
    return ids


def test_a_sweep_over_thousands_of_jobs_holds_little_and_expires_them_in_few_requests(
    s3, redis_client, settings, request
):
    """At 250,000 live jobs the reaper held 1.2 GB of records through each sweep, and expired ~110 jobs a second at
    seven storage requests each (the scale trial of session 51)."""
    bucket = f"lifecycle-{secrets.token_hex(4)}"
    s3.client.create_bucket(Bucket=bucket)
    blobs = S3BlobStore(s3.client, bucket, part_bytes=PART)
    expiring, keeping = stores(redis_client)
    live = new_job(keeping, blobs, owned=True)
    finish(keeping, blobs, live)
    doomed = new_job(expiring, blobs, owned=True)
    finish(expiring, blobs, doomed)
    live_ids = copies(keeping, live, 2000)
    expired_ids = copies(expiring, doomed, 100, own_inputs=True)
    for job_id in expired_ids:  # each expired job's input, output and kept window
        put(blobs, f"uploads/erin/{job_id}", b"i")
        put(blobs, attempt_output_key(job_id, 1, "t"), b"o")
        put(blobs, f"{work_prefix(job_id)}windows/window-00001.json", b"w")
    time.sleep(EXPIRED_TTL_S + 0.5)

    requests_made = []

    def count(event_name: str, **_) -> None:
        requests_made.append(event_name)

    blobs.client.meta.events.register("before-call.s3", count)
    tracemalloc.start()
    try:
        report = sweep(keeping, blobs, settings)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        blobs.client.meta.events.unregister("before-call.s3", count)
        request.addfinalizer(lambda: redis_client.delete(*redis_client.keys(f"{keeping.prefix}:*")))
        request.addfinalizer(lambda: (blobs.delete_prefix(""), s3.client.delete_bucket(Bucket=bucket)))

    assert report.jobs_expired == 101 and all(keeping.get(job_id) is None for job_id in expired_ids[:20])
    left = set(blobs.keys(""))
    assert not any(key.startswith((output_prefix(doomed), work_prefix(doomed))) for key in left)
    assert not [key for key in left if key.split("/")[-1] in set(expired_ids) or key.split("/")[1] in set(expired_ids)]
    completed = keeping.require(live)
    assert completed.output.key in left and completed.input.key in left  # the live job's, read through its copies
    assert keeping.get(live_ids[-1]) is not None
    assert len(requests_made) < 30, Counter(requests_made)  # listings and batched deletes, not seven per job
    assert peak < 8 * 2**20, f"{peak / 2**20:.1f} MiB at the peak for 2,001 live jobs"
