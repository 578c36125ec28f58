"""Recovery inside the job service, with real Celery worker processes (lanczos) on a queue of this module's own:

- a worker killed (SIGKILL) after its first kept window: the reaper requeues the job, a new worker replays the kept
  windows from blob storage, computes only the rest, and writes the same bytes as an uninterrupted job;
- an attempt that replays every window reports what made them (the tier and its levers); kept windows made in
  another way are never mixed into an output, and the key keeps them apart where the worker gives other bits or the
  input holds other bytes; an upload an ended attempt left in flight, landing once the next one has begun, never
  reaches an attempt with another key;
- a blob transfer slower than the lease keeps the lease through its progress callbacks (and loses it without them);
- an attempt that ends while blob storage hangs leaves its kept windows' queued uploads at once;
- a job whose Celery message was never sent (the API died between the record and the send) is sent by the reaper.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import secrets
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import redis
import requests
import torch

from api.schemas import UpscaleParams
from infra.stack import free_ports
from storage.blobs import BlobStore, LocalBlobStore, S3BlobStore, new_upload_id, output_prefix, upload_key, work_prefix
from storage.config import Settings
from storage.jobs import InputInfo, JobRecord, JobStore, Lease, OutputInfo, StaleAttempt
from storage.queue import make_celery, send_upscale
from storage.workers import WorkerInfo, WorkerRegistry
from worker import service
from worker.errors import Cancelled, InvalidRequest
from worker.frames import quantise
from worker.gone import GoneWorkers, leases
from worker.heartbeat import Heartbeat
from worker.media import lossless
from worker.kept_windows import WINDOWS_HELD, BlobWindowStore, windows_key
from worker.media.synthetic import write_clip
from worker.reaper import reap_once
from worker.scratch import scratch_bytes
from worker.service import WorkerSettings
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.request import SRRequest
from worker.sr.windows import plan_windows, upscale_windows
from worker.tasks import job_options
from worker.upscale import UpscaleOptions, begin_upscale, upscale_file

from ..reliability.processes import Partition
from ..test_windows import Recording
from .conftest import MiB, auth
from .test_webhooks import running
from .test_worker import celery_worker

# Small windows, so that a 37-frame clip is 4 of them (of 13 frames, crossfading over 4)
WINDOWS = {"VSRQ_WORKER_WINDOW": "13", "VSRQ_WORKER_WINDOW_OVERLAP": "4"}


@pytest.fixture(scope="module")
def steady_worker(service_env, queue, tmp_path_factory) -> Iterator[Path]:
    """A worker that is left to finish its jobs: its log."""
    env = {**service_env, **WINDOWS}
    with celery_worker(env, "lanczos", queue, tmp_path_factory.mktemp("steady") / "worker.log") as log:
        yield log


@pytest.fixture(scope="module")
def long_clip(tmp_path_factory) -> bytes:
    """37 frames of 192x144 H.264 with AAC: 4 windows, each long enough (lanczos, x2) to be caught between two."""
    return write_clip(tmp_path_factory.mktemp("long") / "long.mp4", 37, (144, 192), audio_codec="aac").read_bytes()


def create_record(jobs: JobStore, s3: S3BlobStore, clip: bytes, queue: str, **fields) -> JobRecord:
    """The job as the API's create writes it, up to (not including) the Celery message."""
    key = upload_key("erin", new_upload_id())
    stored = s3.put(key, io.BytesIO(clip))
    params = UpscaleParams(sr_resolution_scale=2, seed=7, **fields).model_dump()
    upload_id = key.rsplit("/", 1)[1]
    source = InputInfo(key=key, bytes=stored.size, sha256=stored.sha256, upload_id=upload_id, owned_by_job=True)
    return jobs.create(owner="erin", model="lanczos", queue=queue, params=params, input=source)


def enqueue(jobs: JobStore, settings: Settings, job: JobRecord) -> None:
    send_upscale(make_celery(settings), jobs, job)


def wait_until(condition: Callable[[], object], limit_s: float, log: Path | None = None, step_s: float = 0.1):
    deadline = time.monotonic() + limit_s
    while not (value := condition()):
        assert time.monotonic() < deadline, log.read_text()[-4000:] if log else "timed out"
        time.sleep(step_s)
    return value


def ended(jobs: JobStore, job_id: str) -> JobRecord | None:
    job = jobs.require(job_id)
    return job if job.status in ("completed", "failed", "cancelled") else None


def unsent_ids(jobs: JobStore) -> list[str]:
    return [job.id for job in jobs.unsent(0, limit=100_000)]


def kept_windows(blobs: BlobStore, job_id: str) -> list[str]:
    return sorted(key for key in blobs.keys(f"{work_prefix(job_id)}windows/") if re.search(r"window-\d+\.json$", key))


def output_sha256(s3: S3BlobStore, job: JobRecord) -> str:
    with s3.open(job.output.key) as stream:
        return hashlib.sha256(stream.read()).hexdigest()


def test_a_killed_worker_s_job_resumes_from_its_kept_windows(
    request, service_env, settings, jobs, s3, queue, long_clip, tmp_path
):
    job = create_record(jobs, s3, long_clip, queue)
    enqueue(jobs, settings, job)

    # Attempt 1, on a worker with a short lease: killed as soon as its first window is kept
    env = {**service_env, **WINDOWS, "VSRQ_LEASE_S": "4", "VSRQ_WORKER_HEARTBEAT_S": "0.2"}
    with celery_worker(env, "lanczos", queue, tmp_path / "killed.log") as log:
        wait_until(lambda: kept_windows(s3, job.id), 120, log, step_s=0.02)
        running = jobs.require(job.id)
        os.kill(int(running.worker.rsplit("/", 1)[1]), signal.SIGKILL)  # the process holding the lease
        time.sleep(0.5)  # a request it had fully sent may still land
        kept = kept_windows(s3, job.id)
    assert running.status == "in_progress" and running.attempt == 1 and 1 <= len(kept) < 4, (running, kept)

    # The reaper requeues it once the lease runs out; a new worker takes it
    celery = make_celery(settings)
    wait_until(lambda: reap_once(jobs, celery, enqueue_grace_s=3600).get(job.id) == "queued", 30)
    log = request.getfixturevalue("steady_worker")
    resumed = wait_until(lambda: ended(jobs, job.id), 120, log)
    assert (resumed.status, resumed.attempt) == ("completed", 2), resumed
    pattern = re.compile(rf"{job.id} completed by attempt 2: .*?(\d+) of (\d+) windows")
    line = wait_until(lambda: pattern.search(log.read_text()), 30, log)  # logged just after the record changes
    restored, windows = int(line[1]), int(line[2])
    computed = windows - restored
    recomputed = computed - (windows - len(kept) - 1)  # begun by attempt 1 but not kept: the one it died in
    print(f"FIGURE windows: {windows}, kept before the kill: {len(kept)}, restored by attempt 2: {restored}, "
          f"computed by attempt 2: {computed}, recomputed: {recomputed}")  # fmt: skip
    assert windows == 4 and restored == len(kept), (windows, restored, kept)  # every kept window replayed, none redone

    # The same job, uninterrupted, writes the same bytes (the same frames, and x264 off its AVX-512 kernels, which
    # did not: tests/test_media.py)
    again = create_record(jobs, s3, long_clip, queue)
    enqueue(jobs, settings, again)
    uninterrupted = wait_until(lambda: ended(jobs, again.id), 120, log)
    assert uninterrupted.status == "completed" and uninterrupted.attempt == 1
    assert resumed.output.sha256 == uninterrupted.output.sha256 == output_sha256(s3, resumed)
    assert resumed.output.media.frames == 37

    # The job has ended: its kept windows go (just after the promotion the test saw), and one output is left
    wait_until(lambda: not any(s3.keys(work_prefix(job.id))) and not any(s3.keys(work_prefix(again.id))), 30, log)
    assert sorted(s3.keys(output_prefix(job.id))) == sorted(resumed.output.keys())


def test_a_worker_restarted_under_its_name_takes_back_its_dead_predecessor_s_job_at_once(
    service_env, settings, jobs, s3, long_clip, tmp_path
):
    """As `vsrq dev`, a container or systemd restart a killed worker: its job was left to its lease (120 s by default,
    60 s here), the restarted worker idle meanwhile. No reaper runs here: only the restarted worker can requeue it."""
    queue = f"vsrq.restarted-{secrets.token_hex(3)}"  # no other worker of this module's takes it
    job = create_record(jobs, s3, long_clip, queue)
    enqueue(jobs, settings, job)
    env = {**service_env, **WINDOWS, "VSRQ_LEASE_S": "60"}
    name = f"restarted-{secrets.token_hex(3)}@localhost"
    with celery_worker(env, "lanczos", queue, tmp_path / "killed.log", name=name) as log:
        running = wait_until(lambda: (held := jobs.require(job.id)).status == "in_progress" and held, 120, log, 0.02)
        os.kill(int(running.worker.rsplit("/", 1)[1]), signal.SIGKILL)
    killed = time.monotonic()
    with celery_worker(env, "lanczos", queue, tmp_path / "restarted.log", name=name) as log:
        done = wait_until(lambda: ended(jobs, job.id), 120, log)
        assert time.monotonic() - killed < 45, "waited for the lease"  # it had almost 60 s left
    assert (done.status, done.attempt) == ("completed", 2), done
    [requeued] = [event for event in jobs.events(job.id) if event.type == "requeued"]
    assert requeued.detail["reason"]["code"] == "worker_restarted"
    [said] = [line for line in log.read_text().splitlines() if "dead predecessor" in line]
    assert json.loads(said)["message"] == f"{job.id}: held by this worker's dead predecessor, now queued"


def test_a_worker_gone_from_the_registry_loses_its_job_only_when_missing_on_two_looks_and_silent(jobs, s3, long_clip):
    """The reaper's rule (worker.gone), on the real store: a job is due once its holder has been missing from the
    worker registry for the grace, over two looks; it is taken back only where nothing has written it for `silent_s`.
    A live holder's job, a holder seen again, and a job still beaten are left alone."""
    registry, name = WorkerRegistry(jobs.redis, ttl_s=30), f"gone-{secrets.token_hex(3)}@host"
    info = WorkerInfo(name=name, queues=["q"], host="host", pid=123, started_at=time.time())
    job = create_record(jobs, s3, long_clip, f"vsrq.gone-{secrets.token_hex(3)}")
    lease = jobs.lease(job.id, f"{name}/123", 60)
    gone = GoneWorkers(grace_s=0.5, silent_s=1.0)

    registry.register(info)
    assert job.id not in gone.due(leases(jobs), jobs.redis)  # alive
    registry.remove(name)  # as its entry expires
    assert job.id not in gone.due(leases(jobs), jobs.redis)  # one look: the grace starts
    time.sleep(0.6)
    registry.register(info)  # back (a Redis restart had lost the entry): its grace starts again at its next absence
    assert job.id not in gone.due(leases(jobs), jobs.redis)
    registry.remove(name)
    assert job.id not in gone.due(leases(jobs), jobs.redis)
    time.sleep(0.6)
    lease.heartbeat(progress=10)  # its heartbeats go on: not silent
    assert job.id in gone.due(leases(jobs), jobs.redis)
    assert jobs.take_back_silent([job.id], gone.silent_s) == {}
    assert jobs.require(job.id).status == "in_progress"
    time.sleep(1.1)  # silent for `silent_s`
    assert job.id in gone.due(leases(jobs), jobs.redis)
    assert jobs.take_back_silent([job.id], gone.silent_s) == {job.id: "queued"}
    [requeued] = [event for event in jobs.events(job.id) if event.type == "requeued"]
    assert requeued.detail["reason"]["code"] == "worker_gone"
    with pytest.raises(StaleAttempt):
        lease.heartbeat()  # the gone worker, were it only cut off, finds it lost

    # Started again under its name, by a process whose own look for its predecessor's jobs failed (Redis down as it
    # started): the name is alive, the holder is not: another pid, or (a container's) the same pid registered since
    for pid, registered_since_s in ((456, -60), (123, 1)):
        lease = jobs.lease(job.id, f"{name}/123", 60)
        registered = time.time() + registered_since_s
        registry.register(info.model_copy(update={"pid": pid, "started_at": registered}))
        assert job.id not in gone.due(leases(jobs), jobs.redis)
        time.sleep(1.1)
        assert job.id in gone.due(leases(jobs), jobs.redis)
        assert jobs.take_back_silent([job.id], gone.silent_s) == {job.id: "queued"}, pid
    registry.register(info.model_copy(update={"started_at": time.time() - 60}))  # the holder itself, alive
    lease = jobs.lease(job.id, f"{name}/123", 60)
    time.sleep(1.1)
    assert job.id not in gone.due(leases(jobs), jobs.redis)
    registry.remove(name)
    lease.complete(OutputInfo(key="k", bytes=0, sha256="0" * 64))  # no lease left to a later test's reaper


def test_a_killed_worker_s_job_goes_to_another_once_its_registry_entry_expires(
    service_env, settings, long_clip, tmp_path
):
    """A pod evicted, a node lost: the killed worker is not started again under its name, so its job waited for its
    lease (120 s by default, 60 s here) while another worker idled. The reaper (its process, as deployed) takes it back
    once the killed worker's registry entry has expired (`VSRQ_WORKER_TTL_S`, 3 s here) and half that again, and
    another worker completes it. A Redis database and a blob store of the test's own: the reaper sees no other test's
    jobs, and its storage sweep deletes no other test's files."""
    store_url = settings.redis_url.rsplit("/", 1)[0] + "/7"
    own = redis.Redis.from_url(store_url)
    own.flushdb()
    jobs = JobStore(own, result_ttl_s=settings.result_ttl_s, max_attempts=settings.max_attempts)
    queue = f"vsrq.gone-{secrets.token_hex(3)}"
    env = {**service_env, **WINDOWS, "VSRQ_REDIS_URL": store_url, "VSRQ_LEASE_S": "60", "VSRQ_WORKER_TTL_S": "3",
           "VSRQ_REAP_INTERVAL_S": "0.5", "VSRQ_MODELS": json.dumps({"lanczos": queue}),
           "VSRQ_BLOB_BACKEND": "local", "VSRQ_LOCAL_BLOB_DIR": str(tmp_path / "blobs")}  # fmt: skip
    job = create_record(jobs, LocalBlobStore(tmp_path / "blobs"), long_clip, queue)
    send_upscale(make_celery(settings.model_copy(update={"redis_url": store_url})), jobs, job)
    with running(["worker.reaper"], env, tmp_path / "reaper.log"):
        with celery_worker(env, "lanczos", queue, tmp_path / "killed.log") as log:
            running_job = wait_until(lambda: (held := jobs.require(job.id)).status == "in_progress" and held, 120, log)
            os.kill(int(running_job.worker.rsplit("/", 1)[1]), signal.SIGKILL)
        killed = time.monotonic()
        with celery_worker(env, "lanczos", queue, tmp_path / "other.log") as log:
            done = wait_until(lambda: ended(jobs, job.id), 120, log)
            took = time.monotonic() - killed
    print(f"FIGURE killed worker's job completed by another {took:.1f} s after the kill (lease 60 s, registry TTL 3 s)")
    assert took < 40, f"waited for the lease: {took:.1f} s"  # it had almost 60 s left
    assert (done.status, done.attempt) == ("completed", 2), done
    [requeued] = [event for event in jobs.events(job.id) if event.type == "requeued"]
    assert requeued.detail["reason"]["code"] == "worker_gone"
    assert f"{job.id}: its worker gone, now queued" in (tmp_path / "reaper.log").read_text()
    own.flushdb()


def test_a_job_cancelled_while_its_worker_is_dead_leaves_nothing_of_its_attempt(
    service_env, settings, jobs, s3, long_clip, tmp_path
):
    """A user trial: the worker killed once the job had kept a window, the job cancelled meanwhile, the worker started
    again under its name: the job ended `cancelled` there, and its kept windows stayed in blob storage until the
    storage sweep, 10 minutes later by default (hundreds of GB for a long job). They go as it ends."""
    queue = f"vsrq.cancelled-dead-{secrets.token_hex(3)}"
    job = create_record(jobs, s3, long_clip, queue)
    enqueue(jobs, settings, job)
    env = {**service_env, **WINDOWS, "VSRQ_LEASE_S": "60"}
    name = f"cancelled-dead-{secrets.token_hex(3)}@localhost"
    with celery_worker(env, "lanczos", queue, tmp_path / "killed.log", name=name) as log:
        wait_until(lambda: kept_windows(s3, job.id), 120, log, step_s=0.02)
        os.kill(int(jobs.require(job.id).worker.rsplit("/", 1)[1]), signal.SIGKILL)
    assert jobs.cancel(job.id).status == "in_progress"  # asked: its attempt is the one to end it, and it is dead
    with celery_worker(env, "lanczos", queue, tmp_path / "restarted.log", name=name) as log:
        done = wait_until(lambda: ended(jobs, job.id), 60, log)
        assert done.status == "cancelled", done
        # deleted just after the record changed, by the restarted worker (no reaper, and so no storage sweep, here)
        files = lambda: [*s3.keys(work_prefix(job.id)), *s3.keys(output_prefix(job.id))]
        wait_until(lambda: not files(), 10, log)


@pytest.mark.parametrize("end", ["cancelled_while_queued", "cancelled_as_its_lease_ran_out", "failed_at_its_last"])
def test_a_job_that_ends_with_no_attempt_alive_leaves_nothing_of_its_attempts(
    end, api, settings, redis_client, s3, queue, clip, monkeypatch
):
    """A job an earlier attempt kept windows for (and uploaded an output it never promoted) ends with no attempt
    alive to clean up: cancelled over the API while queued again, or cancelled or failed by the reaper as its lease
    ran out. Its files go as it ends, not at the storage sweep."""
    monkeypatch.setattr(service, "blobs", lambda: s3)  # the reaper's store: the session's SeaweedFS
    jobs = JobStore(redis_client, result_ttl_s=60, max_attempts=1 if end == "failed_at_its_last" else 3)
    job = create_record(jobs, s3, clip, queue)
    lease = jobs.lease(job.id, "test-recovery/1", lease_s=1)
    for key in (f"{work_prefix(job.id)}windows/0123456789abcdef/window-00000.mkv", f"{output_prefix(job.id)}a1.mp4"):
        s3.put(key, io.BytesIO(b"kept"))
    if end == "cancelled_while_queued":
        assert lease.retry("worker_lost", "its worker gave it back") == "queued"
        answer = requests.post(f"{api}/v1/videos/{job.id}/cancel", headers=auth("erin"), timeout=30)
        assert answer.json()["status"] == "cancelled", answer.text
    else:
        if end == "cancelled_as_its_lease_ran_out":
            jobs.cancel(job.id)
        time.sleep(1.1)
        assert reap_once(jobs, make_celery(settings)).get(job.id) == end.split("_")[0]
    assert not any(s3.keys(work_prefix(job.id))) and not any(s3.keys(output_prefix(job.id)))


def window_files(keys: Iterator[str] | list[str]) -> dict[int, set[str]]:
    """Window index -> the suffixes of its files (u8, tail.npy, json)."""
    files: dict[int, set[str]] = {}
    for key in keys:
        if found := re.search(r"window-(\d+)\.(.+)$", key):
            files.setdefault(int(found[1]), set()).add(found[2])
    return files


@pytest.mark.parametrize(("frames", "kept"), [(13, []), (37, [0, 1, 2])])
def test_a_job_keeps_every_window_but_its_last(frames, kept, s3, tmp_path):
    """The worker's path (`begin_upscale` with the attempt's `BlobWindowStore` on SeaweedFS, `release_local`, the
    tail's `finish`): a job of one window keeps nothing, its frames written on the worker's disk during the engine
    dropped at its commit (no tail held: `keep_last`) and none uploaded (its tail joins no upload); one of 4 keeps the
    first 3, each whole but for the tails the next window superseded, and not the last. The worker's disk keeps no
    window once it is up: holding every window until the engine was done (the raw output), a long job filled it."""
    source = write_clip(tmp_path / "input.mp4", frames, (144, 192), audio_codec="aac")
    options = UpscaleOptions(SRRequest(scale=2, seed=7), window=13, window_overlap=4)
    job_id = f"video_{secrets.token_hex(4)}"
    store = BlobWindowStore(s3, job_id, tmp_path / "windows", "key", uploads_behind=100)  # none skipped, however slow
    encoding = begin_upscale(source, tmp_path / "output.mp4", LanczosUpscaler(), options, store=store)
    store.wait(60)  # the uploads handed over by the engine's end
    written = window_files(path.name for path in (tmp_path / "windows").iterdir())
    store.release_local()
    result = encoding.finish()
    store.close()
    uploaded = window_files(s3.keys(work_prefix(job_id)))
    assert result.windows == (1 if frames == 13 else 4) and result.restored == 0
    assert written == {} and sorted(uploaded) == kept, (written, uploaded)
    # each whole, its frames as FFV1; a window's float tail went once the next window was kept (only the next
    # window's computation reads it, and a replay computes it again where that one is not replayed after all:
    # tests/test_windows.py)
    assert all(uploaded[i] == {"mkv", "json"} | ({"tail.npy"} if i == kept[-1] else set()) for i in kept), uploaded
    if kept:
        packed = sum(s3.head(key).size for key in s3.keys(work_prefix(job_id)) if key.endswith(".mkv"))
        raw = sum(map(len, pixels_of(s3, job_id)))
        print(f"FIGURE kept_frames: {raw} bytes of frames kept in {packed} ({raw / packed:.1f} x smaller)")
        assert packed < raw / 2, (raw, packed)
    # every window is committed, the last dropping its local copy (a file's unlink)
    assert (result.kept_upload_s > 0) == bool(kept) and 0 < result.windows_s["kept"], result
    s3.delete_prefix(work_prefix(job_id))


def test_windows_not_kept_while_storage_is_down_log_a_line_each_not_a_traceback(settings, tmp_path, caplog):
    """A user trial: through a 40 s storage outage a worker logged every window it could not keep as a WARNING with a
    traceback of up to 6.8 KB (40 of them): an outage is a dependency's, not a bug. One line each now, with the cause;
    the job completes all the same."""
    import logging

    down = settings.model_copy(update={"s3_endpoint_url": f"http://127.0.0.1:{free_ports(1)[0]}"})  # nothing listens
    blobs = S3BlobStore.from_settings(down)
    store = BlobWindowStore(blobs, "video_1", tmp_path / "windows", "key", earlier=False, uploads_behind=100)
    source = write_clip(tmp_path / "input.mp4", 37, (144, 192))
    options = UpscaleOptions(SRRequest(scale=2, seed=7), window=13, window_overlap=4)
    with caplog.at_level(logging.WARNING, logger="vsrq.worker"):
        encoding = begin_upscale(source, tmp_path / "output.mp4", LanczosUpscaler(), options, store=store)
        store.wait(60)
        result = encoding.finish()
        store.close()
    unkept = [record for record in caplog.records if "not kept" in record.getMessage()]
    assert result.windows == 4 and len(unkept) == 3, [record.getMessage() for record in caplog.records]
    assert all(record.exc_info is None for record in unkept)
    assert all("blob storage unavailable (EndpointConnectionError" in record.getMessage() for record in unkept)


def noting_requests(settings: Settings, job_id: str) -> tuple[S3BlobStore, list[str]]:
    """A store on SeaweedFS that notes each S3 call botocore makes about the job's kept windows (its operation), as
    it makes it."""
    blobs = S3BlobStore.from_settings(settings)
    return blobs, note_requests(blobs, job_id)


def note_requests(blobs: S3BlobStore, job_id: str) -> list[str]:
    """The S3 calls `blobs`' client makes from now on about the job's work prefix (their operations), as made."""
    calls: list[str] = []

    def note(model, params, **_) -> None:
        if work_prefix(job_id) in str((params.get("Key"), params.get("Prefix"), params.get("Delete"))):
            calls.append(model.name)

    blobs.client.meta.events.register("before-parameter-build.s3", note)
    return calls


@pytest.mark.parametrize("tail_held", [False, True])
def test_a_first_attempt_of_one_window_sends_no_request_for_its_windows_unless_it_keeps_one(
    tail_held, settings, jobs, queue, tmp_path, monkeypatch
):
    """The worker's path for a job of one window (its `KeptPrefix` from its lease, its store, the engine, the tail's
    join; the job's end by `end`), each request on SeaweedFS noted. On an idle worker its first attempt lists, marks,
    uploads and deletes nothing under the job's prefix, also as the job ends. Where another job's tail is held as the
    window is committed, the window is kept (its marker with it, nothing listed); the job's next attempt finds it and
    replays it, and the job's end deletes the prefix."""
    from worker.attempt import end
    from worker.kept_windows import KeptPrefix

    source = write_clip(tmp_path / "input.mp4", 13, (144, 192), audio_codec="aac")
    options = UpscaleOptions(SRRequest(scale=2, seed=7), window=13, window_overlap=4)  # one window
    job = jobs.create(owner="erin", model="lanczos", queue=queue, params={}, input=InputInfo(key="unused", bytes=0))
    blobs, calls = noting_requests(settings, job.id)
    monkeypatch.setattr(service, "jobs", lambda: jobs)  # `end`'s stores: the test stack's
    monkeypatch.setattr(service, "blobs", lambda: blobs)

    def attempt(name: str) -> tuple[KeptPrefix, Lease, int]:
        lease = jobs.lease(job.id, name, lease_s=60)
        prefix = KeptPrefix(lease.attempt)
        prefix.store = BlobWindowStore(
            blobs, job.id, tmp_path / name, "key", keep_last=lambda: tail_held, earlier=prefix.earlier,
            uploads_behind=100,
        )  # fmt: skip
        encoding = begin_upscale(source, tmp_path / f"{name}.mp4", LanczosUpscaler(), options, store=prefix.store)
        prefix.store.release_local()
        result = encoding.finish()
        prefix.store.join()  # as the tail does: a kept window's upload ends before the attempt
        prefix.store.close()
        return prefix, lease, result.restored

    prefix, lease, restored = attempt("first")
    assert (lease.attempt, restored) == (1, 0)
    if not tail_held:
        assert not prefix.may_hold()
        end(job, lease, "outputs/unused.mp4", InvalidRequest("the job ends here"), windows=prefix.may_hold())
        assert jobs.require(job.id).status == "failed" and calls == [], calls
        return
    assert prefix.may_hold() and calls and set(calls) == {"PutObject"}, calls  # its marker and files: nothing listed
    assert len(kept_windows(blobs, job.id)) == 1
    assert lease.retry("device_lost", "lost after its engine") == "queued"  # its tail never ran

    prefix, lease, restored = attempt("second")
    assert (lease.attempt, restored) == (2, 1) and prefix.may_hold()  # replayed: not computed again
    end(job, lease, "outputs/unused.mp4", InvalidRequest("the job ends here"), windows=prefix.may_hold())
    assert jobs.require(job.id).status == "failed" and not any(blobs.keys(work_prefix(job.id)))


def test_a_job_of_one_window_keeps_nothing_on_a_worker(request, settings, jobs, s3, queue, tmp_path):
    """Through a real worker (the task's head and tail): a job of one window uploads no window, so its `run` event
    reports no upload, and a commit that only dropped the window's local copy; a longer job's does."""
    short = write_clip(tmp_path / "short.mp4", 13, (144, 192), audio_codec="aac").read_bytes()
    job = create_record(jobs, s3, short, queue)
    done = completed_on_a_steady_worker(request, jobs, settings, job, restored="0 of 1")
    [run] = [event.detail for event in jobs.events(done.id) if event.type == "run"]
    assert run["windows"] == 1 and run["kept_upload_s"] == 0 and run["windows_s"]["kept"] < 0.05, run
    assert run["tail_s"]["kept_join"] < 0.05, run  # nothing to wait for


def test_kept_windows_in_a_local_store_resume_a_job_and_never_replay_into_another(tmp_path):
    """The same mirror over the local backend, in process: an attempt cancelled after two windows, the next one
    (a fresh scratch directory) computing only the rest; a key for other options starting the prefix over."""
    blobs = LocalBlobStore(tmp_path / "blobs")
    video = [np.random.default_rng(1).integers(0, 256, (24, 32, 3), dtype=np.uint8) for _ in range(30)]
    plan = plan_windows(30, window=13, overlap=4)  # 3 windows

    def attempt(key: str, cancel_after: int | None = None) -> tuple[list[int], torch.Tensor | None]:
        upscaler, out = Recording(LanczosUpscaler()), []
        store = BlobWindowStore(blobs, "video_1", tmp_path / secrets.token_hex(4), key, uploads_behind=100)
        try:
            upscale_windows(
                upscaler, iter(video), plan, SRRequest(scale=2), lambda f: out.append(quantise(f)), store=store,
                # each kept window's upload (FFV1 packing first) waited for: cancelled once `cancel_after` are kept
                cancelled=(lambda: store.wait(30) and len(kept_windows(blobs, "video_1")) >= cancel_after)
                if cancel_after
                else None,
            )  # fmt: skip
        except Cancelled:
            return upscaler.windows, None
        finally:  # as the worker's cleanup: no upload of this attempt lands once the next one has started
            store.close()
        return upscaler.windows, torch.cat(out)

    computed, uninterrupted = attempt("other options")
    assert computed == [0, 1, 2]
    assert attempt("options", cancel_after=2)[0] == [0, 1]
    kept = len(kept_windows(blobs, "video_1"))
    computed, resumed = attempt("options")
    assert kept >= 2 and computed == list(range(kept, 3)) and torch.equal(resumed, uninterrupted)
    assert attempt("new options")[0] == [0, 1, 2]  # kept for other options: recomputed, never replayed


@pytest.mark.parametrize("late", ["json", "pixels"])
def test_an_upload_that_lands_after_the_next_attempt_began_never_reaches_another_key(late, s3, tmp_path):
    """An attempt kept windows for its key (the input's old bytes); the next attempt, with another key, began, and
    then one of the first attempt's uploads (left in flight by its `close`) landed: a window's JSON alone (the next
    attempt kept nothing yet), or its pixel file over the window the next attempt kept. The attempt after that, with
    the new key, never reads it: no crash, no old pixels, the frames are the new input's."""
    rng = np.random.default_rng(3)
    old, new = ([rng.integers(0, 256, (24, 32, 3), dtype=np.uint8) for _ in range(30)] for _ in range(2))
    plan = plan_windows(30, window=13, overlap=4)  # 3 windows
    job_id = f"video_{secrets.token_hex(4)}"

    def attempt(key: str, video: list[np.ndarray], run: bool = True) -> tuple[list[int], torch.Tensor | None]:
        upscaler, out = Recording(LanczosUpscaler()), []
        store = BlobWindowStore(s3, job_id, tmp_path / secrets.token_hex(4), key, uploads_behind=100)
        if run:
            sink = lambda frames: out.append(quantise(frames))
            upscale_windows(upscaler, iter(video), plan, SRRequest(scale=2), sink, store=store)
            store.join()
        store.close()
        return upscaler.windows, torch.cat(out) if out else None

    attempt("old bytes", old)
    suffixes = (".json",) if late == "json" else (".mkv", ".u8")  # its frames, FFV1 or raw
    landing = [key for key in s3.keys(work_prefix(job_id)) if key.endswith(tuple(f"window-00001{s}" for s in suffixes))]
    assert len(landing) == 1, landing
    uploaded = {}
    for key in landing:
        with s3.open(key) as stream:
            uploaded[key] = stream.read()
    attempt("new bytes", new, run=late == "pixels")  # the window's JSON lands alone, or its pixels over the new
    for key, data in uploaded.items():
        s3.put(key, io.BytesIO(data))

    computed, resumed = attempt("new bytes", new)
    _, expected = attempt("expected", new)
    # the last window is never kept: computed by every attempt
    assert computed == ([2] if late == "pixels" else [0, 1, 2]) and torch.equal(resumed, expected)
    s3.delete_prefix(work_prefix(job_id))


HIGH = UpscaleOptions(SRRequest(scale=2, seed=5, quality="high"), window=9, window_overlap=4)
# What `high` ran on this CPU, computed or replayed: the FP8 GEMMs, FP8 attention emulated (no cuDNN here)
EMULATED = {"fp8_linear": "scaled_mm_rowwise", "fp8_attention": "fp8_emulated"}


def pixels_of(blobs: BlobStore, job_id: str) -> list[bytes]:
    """The frames the job's attempts handed their encoder, window by window, as blob storage keeps them (raw, or
    FFV1 expanded)."""
    frames = []
    for meta in kept_windows(blobs, job_id):
        kept, stem = json.loads(blobs.open(meta).read()), meta.removesuffix(".json")
        if blobs.exists(f"{stem}.u8"):
            frames.append(blobs.open(f"{stem}.u8").read())
            continue
        with tempfile.TemporaryDirectory() as directory:
            packed, raw = Path(directory, "window.mkv"), Path(directory, "window.u8")
            packed.write_bytes(blobs.open(f"{stem}.mkv").read())
            lossless.expand(packed, tuple(kept["shape"]), kept["dtype"], raw)
            frames.append(raw.read_bytes())
    return frames


@pytest.mark.parametrize("model", ["k6", "lanczos"])
def test_an_attempt_that_replays_every_window_reports_what_made_them(model, engine, s3, tmp_path):
    """`quality=high`, every window kept in blob storage by an earlier attempt: the attempt that replays them all
    reports the tier and levers that computed them (the tiny checkpoint: FP8 attention emulated on this CPU;
    lanczos, without a faster path: lossless, and says so), as the attempt that computed them did."""
    upscaler = engine if model == "k6" else LanczosUpscaler()
    source = write_clip(tmp_path / "in.mp4", 13, (16, 32))  # 2 windows of 9 frames, one tile of the tiny model
    job_id = f"video_{secrets.token_hex(4)}"

    def attempt(name: str):
        store = BlobWindowStore(s3, job_id, tmp_path / name, "key")
        store.keep_last = lambda: True  # every window kept, the last too: as a worker of the version before kept them
        return upscale_file(source, tmp_path / f"{name}.mp4", upscaler, HIGH, store=store)

    computed, replayed = attempt("computed"), attempt("replayed")
    assert (computed.windows, computed.restored, replayed.restored) == (2, 0, 2)
    assert (computed.quality, computed.levers) == (("high", EMULATED) if model == "k6" else ("lossless", {}))
    what_ran = lambda result: (result.quality, result.levers, result.tiles, result.devices, result.notes)
    assert what_ran(replayed) == what_ran(computed)
    s3.delete_prefix(work_prefix(job_id))


def test_a_job_whose_windows_were_all_kept_reports_the_quality_that_made_them(
    request, settings, jobs, s3, queue, long_clip, tmp_path
):
    """The record of a job whose worker replays every window says what made them: `high` asked of lanczos, kept
    by an attempt that ran `lossless` (lanczos has no faster path), is `lossless` on the job, not `high`."""
    job = create_record(jobs, s3, long_clip, queue, quality="high")
    # Every window kept, the last too, as by a worker of the version before that one died just after its last
    # window: the worker's options (WINDOWS) and key
    options = replace(job_options(job.params, LanczosUpscaler.default_steps), window=13, window_overlap=4)
    key = windows_key(job, job.input.sha256, "lanczos", options, LanczosUpscaler())
    (tmp_path / "input.mp4").write_bytes(long_clip)
    store = BlobWindowStore(s3, job.id, tmp_path / "windows", key, uploads_behind=100)
    store.keep_last = lambda: True
    upscale_file(tmp_path / "input.mp4", tmp_path / "output.mp4", LanczosUpscaler(), options, store=store)
    assert len(kept_windows(s3, job.id)) == 4
    sent_back_by_its_first_attempt(jobs, job)

    done = completed_on_a_steady_worker(request, jobs, settings, job, restored="4 of 4", attempt=2)
    assert (done.params["quality"], done.output.quality, done.output.quality_levers) == ("high", "lossless", {})


def sent_back_by_its_first_attempt(jobs: JobStore, job: JobRecord) -> None:
    """The job leased and requeued, as by the attempt that kept its windows: the worker's is the job's second (a first
    attempt lists no kept windows: none can be there)."""
    assert jobs.lease(job.id, "attempt-1", lease_s=60).retry("device_lost", "the attempt that kept windows") == "queued"


def completed_on_a_steady_worker(request, jobs, settings, job, restored: str, attempt: int = 1):
    """The job sent to a worker of its own, completed by its `attempt` with `restored` windows replayed."""
    enqueue(jobs, settings, job)
    log = request.getfixturevalue("steady_worker")
    done = wait_until(lambda: ended(jobs, job.id), 120, log)
    assert done.status == "completed", done
    pattern = re.compile(rf"{job.id} completed by attempt {attempt}: .*? (\d+ of \d+) windows")
    line = wait_until(lambda: pattern.search(log.read_text()), 30, log)
    assert line[1] == restored, line[0]
    return done


def test_windows_kept_for_other_input_bytes_are_never_replayed(request, settings, jobs, s3, queue, long_clip, tmp_path):
    """A referenced key written again between attempts (as a URL may serve other bytes on each fetch): every window
    an earlier attempt kept for the old bytes, whose digest it recorded on the job, is computed again from the bytes
    read now; the output is the new input's, never a mix."""
    key = upload_key("erin", new_upload_id())
    old = s3.put(key, io.BytesIO(long_clip))
    source = InputInfo(key=key, bytes=old.size, sha256=old.sha256, upload_id=key.rsplit("/", 1)[1])
    params = UpscaleParams(sr_resolution_scale=2, seed=7).model_dump()
    job = jobs.create(owner="erin", model="lanczos", queue=queue, params=params, input=source)
    # Attempt 1 kept every window of the old bytes, and recorded their digest (its heartbeat's `input_file`)
    options = replace(job_options(job.params, LanczosUpscaler.default_steps), window=13, window_overlap=4)
    (tmp_path / "old.mp4").write_bytes(long_clip)
    kept_for = windows_key(job, old.sha256, "lanczos", options, LanczosUpscaler())
    store = BlobWindowStore(s3, job.id, tmp_path / "windows", kept_for, uploads_behind=100)
    upscale_file(tmp_path / "old.mp4", tmp_path / "old-output.mp4", LanczosUpscaler(), options, store=store)
    assert len(kept_windows(s3, job.id)) == 3  # all but the last
    # The key now holds other bytes: the same 37 frames, but not the same pixels
    new = write_clip(tmp_path / "new.mp4", 37, (144, 192), crf=30, audio_codec="aac")
    s3.put(key, io.BytesIO(new.read_bytes()))
    upscale_file(new, tmp_path / "expected.mp4", LanczosUpscaler(), options)
    sent_back_by_its_first_attempt(jobs, job)

    done = completed_on_a_steady_worker(request, jobs, settings, job, restored="0 of 4", attempt=2)
    assert done.input.sha256 == hashlib.sha256(new.read_bytes()).hexdigest()
    assert output_sha256(s3, done) == hashlib.sha256((tmp_path / "expected.mp4").read_bytes()).hexdigest()
    s3.delete(key)


@pytest.mark.parametrize(("made_otherwise", "computed", "restored"), [(0, [0, 0, 1, 2], 0), (1, [0, 1, 2], 1)])
def test_kept_windows_made_otherwise_are_never_mixed_into_an_output(
    made_otherwise, computed, restored, engine, s3, tmp_path
):
    """An attempt kept two of three `high` windows; one of them says its FP8 attention ran on cuDNN (as a Hopper
    worker's would: this CPU cannot run it), under the same key (the worker that kept it expected cuDNN; a graph
    cuDNN would not build is emulated). The next attempt here, which emulates it, never mixes the two ways:
    - window 0 made otherwise: replayed, but its tail (dropped once window 1 was kept), computed here for window 1,
      disagrees with it: the kept windows are dropped and the output starts over in the same attempt, every window
      computed;
    - window 1 made otherwise: window 0 replayed (its tail computed again), window 1 computed again rather than
      replayed after it.
    Either way the frames are the uninterrupted attempt's, it reports what ran here, and what is kept now agrees."""
    source = write_clip(tmp_path / "in.mp4", 17, (16, 32))  # 3 windows of 9 frames, one tile each
    job_id = f"video_{secrets.token_hex(4)}"

    def attempt(name: str, cancelled=None):
        upscaler = Recording(engine)
        store = BlobWindowStore(s3, job_id, tmp_path / name, "key", uploads_behind=100)  # none skipped
        output = tmp_path / f"{name}.mp4"
        try:
            return upscaler, upscale_file(source, output, upscaler, HIGH, cancelled=cancelled, store=store)
        finally:
            store.wait(60)  # its uploads, in blob storage once it returns

    attempt("uninterrupted")
    uninterrupted = pixels_of(s3, job_id)
    s3.delete_prefix(work_prefix(job_id))
    with pytest.raises(Cancelled):
        attempt("cancelled", cancelled=lambda: len(kept_windows(s3, job_id)) >= 2)
    (name,) = [window for window in kept_windows(s3, job_id) if window.endswith(f"window-{made_otherwise:05d}.json")]
    with s3.open(name) as stream:
        kept = json.load(stream)
    kept["made"]["levers"]["fp8_attention"] = "cudnn_fp8"
    s3.put(name, io.BytesIO(json.dumps(kept).encode()))

    upscaler, resumed = attempt("resumed")
    assert (upscaler.windows, resumed.restored) == (computed, restored)
    frames = pixels_of(s3, job_id)
    assert len(frames) == 2 and frames == uninterrupted  # the last window is not kept
    assert (tmp_path / "resumed.mp4").read_bytes() == (tmp_path / "uninterrupted.mp4").read_bytes()  # and so the file
    assert (resumed.quality, resumed.levers) == ("high", EMULATED)
    for window in kept_windows(s3, job_id):
        with s3.open(window) as stream:
            assert json.load(stream)["made"]["levers"] == EMULATED
    s3.delete_prefix(work_prefix(job_id))


def test_the_kept_windows_key_names_what_changes_bits_not_where_the_weights_live(tiny_piflow, jobs, queue, monkeypatch):
    """Kept windows replay on a worker that gives the same bits, never on one that gives others: offloaded weights
    (`offload` against `memory`, both decoding 2 latent frames at a time) and more devices with whole tiles give the
    same bits; another decode segment (`speed`: 4, up to 2/255 apart on GPUs), a split tile (float rounding) and
    `high`'s FP8 levers, with the FP8 attention backend that will run them and the revision of their arithmetic,
    give others."""
    from worker.sr import quality
    from worker.sr.backends import open_upscaler
    from worker.sr.engine import SREngine

    job = jobs.create(owner="erin", model="lanczos", queue=queue, params={}, input=InputInfo(key="k", bytes=0))
    checkpoint = str(tiny_piflow)

    def key(upscaler, quality: str = "lossless") -> str:
        return windows_key(job, "0" * 64, checkpoint, UpscaleOptions(SRRequest(scale=2, quality=quality)), upscaler)

    memory, offload, speed = (open_upscaler(checkpoint, ["cpu"], mode, None) for mode in ("memory", "offload", "speed"))
    assert key(memory) == key(offload) != key(speed)
    whole, whole_on_two, split_on_two = (
        SREngine.from_pretrained(checkpoint, devices=["cpu"] * count, split=split)
        for count, split in ((1, "off"), (2, "off"), (2, "on"))
    )
    assert key(whole) == key(whole_on_two) != key(split_on_two)
    assert key(whole, "high") != key(whole)
    assert json.loads(whole.signature(SRRequest(quality="high")))["fp8_attention"] == "fp8_emulated"
    high, lossless = key(whole, "high"), key(whole)
    monkeypatch.setattr(quality, "REVISION", quality.REVISION + 1)  # a deploy that changes `high`'s arithmetic
    assert key(whole, "high") != high and key(whole) == lossless
    assert key(LanczosUpscaler(), "high") != key(whole, "high")


@pytest.mark.parametrize("direction", ["download", "upload"])
def test_a_transfer_slower_than_the_lease_keeps_it_alive(direction, redis_client, s3, queue, tmp_path):
    jobs = JobStore(redis_client, result_ttl_s=60, max_attempts=3, prefix=f"recovery-{secrets.token_hex(4)}")  # alone
    source = tmp_path / "big"
    source.write_bytes(os.urandom(6 * MiB))  # a multipart transfer (5 MiB parts), on boto3's threads
    key = upload_key("erin", new_upload_id())
    if direction == "download":
        s3.put(key, io.BytesIO(source.read_bytes()))

    def transfer(progress: Callable[[int], None]) -> float:
        """The transfer through a slow link, about 1.5 MiB/s per part (its progress callback paced): its seconds."""

        def paced(moved: int) -> None:
            progress(moved)
            time.sleep(moved / (1.5 * MiB))

        started = time.monotonic()
        if direction == "download":
            s3.download(key, tmp_path / "copy", paced)
        else:
            with source.open("rb") as file:
                s3.put(key, file, progress=paced)
        return time.monotonic() - started

    def leased_through(progress_of: Callable[[Lease], Callable[[int], None]]) -> tuple[float, list, JobRecord]:
        """The transfer under a 1 s lease while the reaper passes every 0.1 s: (seconds, lease expiries seen, job)."""
        job = jobs.create(owner="erin", model="lanczos", queue=queue, params={}, input=InputInfo(key=key, bytes=0))
        lease = jobs.lease(job.id, "test-transfer", lease_s=1)
        seen, done = [], threading.Event()

        def reaper() -> None:
            while not done.is_set():
                jobs.reap()
                seen.append(jobs.require(job.id).lease_until)
                time.sleep(0.1)

        thread = threading.Thread(target=reaper)
        thread.start()
        try:
            seconds = transfer(progress_of(lease))
        finally:
            done.set()
            thread.join()
        return seconds, seen, jobs.require(job.id)

    seconds, seen, job = leased_through(lambda lease: Heartbeat(lease, every_s=0.2).transfer)
    print(f"FIGURE {direction} of 6 MiB in {seconds:.1f} s under a 1 s lease: expiry moved {seen[-1] - seen[0]:.1f} s")
    assert seconds > 2.5, "the transfer must outlast the lease"
    assert (job.status, job.attempt) == ("in_progress", 1) and None not in seen, job  # never reaped
    assert seen[-1] - seen[0] > seconds - 1.5  # the expiry kept moving all through the transfer

    if direction == "download":  # the same transfer without heartbeats loses the lease to the reaper
        _, _, job = leased_through(lambda lease: lambda moved: None)
        requeued = [event.detail["reason"]["code"] for event in jobs.events(job.id) if event.type == "requeued"]
        assert (job.status, requeued) == ("queued", ["lease_expired"]), job


def test_a_job_whose_message_was_never_sent_is_sent_by_the_reaper(
    api, clip, settings, jobs, s3, queue, long_clip, steady_worker
):
    # A job created through the API confirms its message
    files = {"video_reference": ("clip.mp4", clip, "video/mp4")}
    data = {"model": "lanczos", "sr_resolution_scale": "2"}
    created = requests.post(f"{api}/v1/videos", data=data, files=files, headers=auth("erin"), timeout=30)
    assert created.status_code == 200, created.text
    assert created.json()["id"] not in unsent_ids(jobs)
    requests.post(f"{api}/v1/videos/{created.json()['id']}/cancel", headers=auth("erin"), timeout=30)  # no worker

    # The API died between writing the record and sending the message
    job = create_record(jobs, s3, long_clip, queue)
    assert job.id in unsent_ids(jobs)
    celery = make_celery(settings)
    reap_once(jobs, celery, enqueue_grace_s=3600)  # within its grace: its sender may still be about to send it
    assert job.id in unsent_ids(jobs)

    time.sleep(0.5)
    reap_once(jobs, celery, enqueue_grace_s=0.2)
    assert job.id not in unsent_ids(jobs)
    done = wait_until(lambda: ended(jobs, job.id), 120, steady_worker)
    assert (done.status, done.attempt) == ("completed", 1), done
    assert [event.type for event in jobs.events(job.id)].count("leased") == 1


@contextmanager
def held_window_upload(settings: Settings, name: str) -> Iterator[tuple[S3BlobStore, Partition]]:
    """A blob store whose way to SeaweedFS stalls the upload of the kept window file `name` until released (a slow
    call, for as long as the test needs); released at the end whatever happened."""
    partition = Partition(("127.0.0.1", urlsplit(settings.s3_endpoint_url).port))
    marker = f"/{name} ".encode()  # the end of the request line's path
    partition.hold(marker)
    try:
        yield S3BlobStore.from_settings(settings.model_copy(update={"s3_endpoint_url": f"http://127.0.0.1:{partition.port}"})), partition
    finally:
        partition.close()  # releases what it still holds, and its listener goes


def in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list]:
    """`call` on a thread of its own: the thread, and what it returned or raised once it ends."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def uploader_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "vsrq-kept-upload"]


def test_a_long_job_holds_a_few_windows_on_the_worker_s_disk_not_its_whole_output(s3, tmp_path):
    """Every window stayed on the worker's disk until the engine was done, as big as the raw output: 10 minutes of
    320x180 at x2 estimated 16.7 GB, a 600 MB scratch filled and the job failed three attempts as `worker_disk_full`.
    Each window's local copy now goes once it is up, and the estimate the worker's prefetch and held tails leave room
    for (`scratch_bytes` with the windows held) bounds what the disk held, sampled as the job ran."""
    source = write_clip(tmp_path / "input.mp4", 101, (48, 64))
    options = UpscaleOptions(SRRequest(scale=2, seed=7), window=13, window_overlap=4)  # 11 windows
    job_id = f"video_{secrets.token_hex(4)}"
    store = BlobWindowStore(s3, job_id, tmp_path / "windows", "key", keep_last=lambda: True)
    peak, running = [0], threading.Event()

    def sample() -> None:
        while not running.is_set():
            with contextlib.suppress(FileNotFoundError):
                held = sum(path.stat().st_size for path in (tmp_path / "windows").iterdir() if "window-" in path.name)
                peak[0] = max(peak[0], held)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = upscale_file(source, tmp_path / "output.mp4", LanczosUpscaler(), options, store=store)
        store.join()
    finally:
        running.set()
        sampler.join(10)
    every = scratch_bytes(source, 2, options.window, options.window_overlap)
    held = scratch_bytes(source, 2, options.window, options.window_overlap, windows_held=WINDOWS_HELD)
    assert result.windows == 11 and 1 <= len(kept_windows(s3, job_id)) <= 11  # all but those storage fell behind on
    raw_output = 101 * 96 * 128 * 3
    assert 0 < peak[0] <= held - (tmp_path / "output.mp4").stat().st_size and held < every, (peak, held, every)
    assert peak[0] < raw_output, (peak, raw_output)  # 2.0 MB of 3.7 in a loaded CI run: storage fell behind
    store.close()
    s3.delete_prefix(work_prefix(job_id))


def test_a_slow_window_upload_holds_neither_the_engine_nor_the_job_s_end(settings, s3, long_clip, tmp_path):
    """The first window's upload stalls on its way to SeaweedFS: the engine computes every window meanwhile (the
    uploads run beside it), the encoder's flush and check are done, and the output is finished only once every
    window it keeps is (the job's end deletes them: none may land after it); the next attempt replays them. With two
    windows waiting for their upload the third is not kept: the worker's disk holds two windows, not every one."""
    (tmp_path / "input.mp4").write_bytes(long_clip)
    options = UpscaleOptions(SRRequest(scale=2, seed=7), window=13, window_overlap=4)  # 4 windows
    job_id = f"video_{secrets.token_hex(4)}"
    with held_window_upload(settings, "window-00000.json") as (slow, partition):
        store = BlobWindowStore(slow, job_id, tmp_path / "windows", "key")
        upscaler = Recording(LanczosUpscaler())
        began, began_with = in_thread(
            lambda: begin_upscale(tmp_path / "input.mp4", tmp_path / "output.mp4", upscaler, options, store=store)
        )
        began.join(60)
        assert not began.is_alive(), "the engine waited for a window's upload"
        # the upload's request may reach SeaweedFS after the engine's last window, on a busy machine: it is held then
        wait_until(lambda: partition.held == 1, 30)
        assert upscaler.windows == [0, 1, 2, 3] and kept_windows(s3, job_id) == []
        assert sorted(window_files(path.name for path in (tmp_path / "windows").iterdir())) == [0, 1]
        encoding = began_with[0]
        finishing, finished_with = in_thread(encoding.finish)
        finishing.join(1.5)
        assert finishing.is_alive() and kept_windows(s3, job_id) == []  # held at the join, after flush and check
        held_s = time.monotonic()
        partition.release(b"/window-00000.json ")
        finishing.join(60)
    held_s = time.monotonic() - held_s
    result = finished_with[0]
    assert len(kept_windows(s3, job_id)) == 2 and not uploader_threads()
    assert result.windows_s["kept"] < result.kept_upload_s and result.tail["kept_join"] >= held_s * 0.5
    assert (tmp_path / "output.mp4").exists()
    store.close()  # the worker's cleanup after the join: nothing left to skip
    assert len(kept_windows(s3, job_id)) == 2 and not (tmp_path / "windows").exists()

    replay = BlobWindowStore(s3, job_id, tmp_path / "replay", "key")
    replayed = upscale_file(tmp_path / "input.mp4", tmp_path / "replayed.mp4", Recording(LanczosUpscaler()), options, store=replay)
    assert replayed.restored == 2
    s3.delete_prefix(work_prefix(job_id))


def test_a_lease_lost_during_the_last_kept_window_s_upload_stops_the_attempt_at_the_join(
    settings, redis_client, s3, queue, long_clip, tmp_path, monkeypatch
):
    """The last kept window's upload (the one before the job's last) stalls past the time its heartbeats keep the
    lease (`storage_retry_s`), the lease runs out and another attempt takes the job: the engine is done, but the
    heartbeat's error reaches the attempt's thread where it waits for the uploads (`Encoding.finish`), so the attempt
    never completes; the window's JSON never goes, and the upload's thread has ended."""
    # the settings are cached for the process: the test's own, not an environment variable read once
    monkeypatch.setattr(service, "worker_settings", lambda: WorkerSettings(storage_retry_s=0.5))
    jobs = JobStore(redis_client, result_ttl_s=60, max_attempts=3, prefix=f"recovery-{secrets.token_hex(4)}")
    job = jobs.create(owner="erin", model="lanczos", queue=queue, params={}, input=InputInfo(key="unused", bytes=0))
    lease = jobs.lease(job.id, "attempt-1", lease_s=2)
    beat = Heartbeat(lease, every_s=0.2)
    (tmp_path / "input.mp4").write_bytes(long_clip)
    options = UpscaleOptions(SRRequest(scale=2, seed=7), window=13, window_overlap=4)  # 4 windows
    with held_window_upload(settings, "window-00002.mkv") as (slow, partition):
        # none skipped however slow the machine: the held one is the third
        store = BlobWindowStore(
            slow, job.id, tmp_path / "windows", "key", beat.transfer, beat.kept_alive, uploads_behind=100
        )
        encoding = begin_upscale(
            tmp_path / "input.mp4", tmp_path / "output.mp4", LanczosUpscaler(), options, beat.window, beat.cancelled, store
        )  # the engine's beats keep the lease as the worker's do
        wait_until(lambda: partition.held == 1, 30)
        wait_until(lambda: jobs.reap().get(job.id) == "queued", 30, step_s=0.1)
        jobs.lease(job.id, "attempt-2", lease_s=60)  # the job is another attempt's now
        partition.release(b"/window-00002.mkv ")
        with pytest.raises((StaleAttempt, redis.exceptions.RedisError)):
            encoding.finish()
    assert not uploader_threads()
    assert len(kept_windows(s3, job.id)) == 2  # the held window's JSON never went: it never replays
    s3.delete_prefix(work_prefix(job.id))


def test_an_attempt_that_ends_while_storage_hangs_leaves_its_window_uploads_at_once(settings, s3, tmp_path):
    """Blob storage stops answering once the attempt's store is open (its connections accepted, nothing sent back):
    the engine computes 4 windows and queues their uploads, then the attempt ends without its tail (failed, cancelled
    or lost). Its cleanup (`close`) skips the uploads not begun, leaves the one in flight after `CLOSE_WAIT_S` and
    removes the local files: the worker is free at once, not after each window's timeouts and retries. The upload
    left behind ends with its request, and no window is kept."""
    video = [np.random.default_rng(2).integers(0, 256, (24, 32, 3), dtype=np.uint8) for _ in range(37)]
    job_id = f"video_{secrets.token_hex(4)}"
    partition = Partition(("127.0.0.1", urlsplit(settings.s3_endpoint_url).port))
    try:
        # 0.5 s per try, with botocore's standard retries as the worker's: 3 tries for each window's first file
        hung = {"s3_endpoint_url": f"http://127.0.0.1:{partition.port}", "s3_timeout_s": 0.5}
        hanging = S3BlobStore.from_settings(settings.model_copy(update=hung))
        store = BlobWindowStore(hanging, job_id, tmp_path / "w", "key")
        partition.cut()
        upscaler = Recording(LanczosUpscaler())
        upscale_windows(upscaler, iter(video), plan_windows(37, 13, 4), SRRequest(scale=2), lambda _: None, store=store)
        store.release_local()  # as the attempt's head does once the engine is done
        assert upscaler.windows == [0, 1, 2, 3] and uploader_threads()  # the uploads hang, the engine did not
        closing = time.monotonic()
        store.close()
        closed_s = time.monotonic() - closing
    finally:
        partition.close()  # what is left in flight meets a closed port once its request times out
    print(f"FIGURE kept_windows_close_hung: {closed_s:.2f} s with 4 windows queued")
    assert closed_s < 2, "the attempt's end waited for the uploads"
    assert not (tmp_path / "w").exists()  # the local copies went with the attempt
    wait_until(lambda: not uploader_threads(), 15, step_s=0.05)  # the rest skipped: no request, no timeout each
    assert kept_windows(s3, job_id) == []
    s3.delete_prefix(work_prefix(job_id))
