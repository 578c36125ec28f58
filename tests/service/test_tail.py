"""A job's tail after its engine (worker.tasks `_complete`): the output's upload to the attempt's key runs beside its
read-back check, and only a job whose check passed and whose upload landed is promoted. A real Celery worker (lanczos)
for the overlap as the `run` event reports it; this process as the worker (its head and tail, against the session's
Redis and SeaweedFS) for a check that fails while the upload is held in flight, and for an upload that storage refuses
while the check is held (at its wait for the kept windows' uploads): whichever fails first ends the attempt, and the
other's error is not lost.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from storage.blobs import PREVIEWS, attempt_output_key, output_prefix, preview_key, work_prefix
from worker import service, tasks
from worker.attempt import classify, discard_attempt
from worker.kept_windows import KeptPrefix
from worker.media.synthetic import write_clip

from ..reliability.processes import Partition
from .test_recovery import (
    WINDOWS, create_record, ended, enqueue, note_requests, output_sha256, wait_until, window_files
)  # fmt: skip
from .test_worker import celery_worker


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> bytes:
    """37 frames of 384x288 H.264 with AAC: one window (the worker's default), an output whose check takes a while
    (tens of milliseconds: the upload's thread has started well before it ends)."""
    return write_clip(tmp_path_factory.mktemp("tail") / "clip.mp4", 37, (288, 384), audio_codec="aac").read_bytes()


def test_the_output_uploads_beside_its_check_and_is_promoted_once(
    settings, service_env, jobs, s3, queue, clip, tmp_path
):
    job = create_record(jobs, s3, clip, queue)
    with celery_worker(service_env, "lanczos", queue, tmp_path / "worker.log") as log:
        enqueue(jobs, settings, job)
        done = wait_until(lambda: ended(jobs, job.id), 120, log)
    assert (done.status, done.attempt) == ("completed", 1), done
    [run] = [event.detail for event in jobs.events(job.id) if event.type == "run"]
    at, seconds = run["tail_at_s"], run["tail_s"]
    print(f"FIGURE tail_beside: tail_s {seconds}; at {at}")
    # the upload started once the flush and the `uploading` beat were done, before the check ended
    assert at["flush"][1] <= at["uploading_beat"][1] <= at["upload"][0] < at["verify"][1], at
    assert at["verify_upload"] == [min(at["verify"][0], at["upload"][0]), max(at["verify"][1], at["upload"][1])]
    assert at["upload"][1] <= at["upload_previews"][0] and at["previews"][0] >= at["verify"][1], at
    assert all(abs(seconds[step] - (end - start)) <= 0.002 for step, (start, end) in at.items()), (seconds, at)
    # one video under the job's prefix, the promoted one, with its previews: the bytes the check read back
    assert sorted(s3.keys(output_prefix(job.id))) == sorted(done.output.keys())
    assert done.output.sha256 == output_sha256(s3, done) and done.output.media.frames == 37


@pytest.fixture
def worker_here(service_env, monkeypatch) -> Iterator[Callable[..., None]]:
    """This process as a lanczos worker of the session's service, with these `VSRQ_*` settings over it (read once
    each: `worker.service` caches them until the test ends)."""
    caches = (service.settings, service.worker_settings, service.jobs, service.blobs, service.upscaler)

    def configure(**env: str) -> None:
        here = {"VSRQ_WORKER_MODEL": "lanczos", "VSRQ_WORKER_DEVICES": "cpu", "VSRQ_WORKER_PREFETCH_INPUT": "false"}
        for name, value in {**service_env, **here, **env}.items():
            monkeypatch.setenv(name, value)
        for cache in caches:
            cache.cache_clear()

    yield configure
    for cache in caches:
        cache.cache_clear()


def storage_through(settings, worker_here, **env: str) -> Partition:
    """A partition in front of the session's SeaweedFS, and this process as a worker (`worker_here`, with `env`) whose
    storage is reached through it."""
    partition = Partition(("127.0.0.1", urlsplit(settings.s3_endpoint_url).port))
    try:
        worker_here(VSRQ_S3_ENDPOINT_URL=f"http://127.0.0.1:{partition.port}", **env)
    except BaseException:
        partition.close()
        raise
    return partition


def test_an_output_that_fails_its_check_stops_its_upload_and_is_discarded(
    worker_here, settings, jobs, s3, queue, clip, tmp_path
):
    """The output's check fails (its promise asks for a frame more than the encoder was given) while its upload is
    held on its way to SeaweedFS, for good: the upload is stopped rather than tried again for `storage_retry_s`.
    The output (178 KB) is sent before boto3 reports progress (every 256 KB): the attempt fails with the check's code
    and message without waiting for botocore's 3 tries of the request to time out (`s3_timeout_s`, after a second's
    wait for `100 Continue`), and nothing is left under the job's output prefix."""
    timeout_s, retry_s = 2, 60
    partition = storage_through(
        settings,
        worker_here,
        VSRQ_S3_TIMEOUT_S=str(timeout_s),
        VSRQ_WORKER_STORAGE_RETRY_S=str(retry_s),
    )
    try:
        job, finishing, _ = check_failing_beside_held_upload(partition, settings, jobs, s3, queue, clip, lease_s=30)
        held = time.monotonic()
        failed = wait_until(lambda: ended(jobs, job.id), 3 * (timeout_s + 1) + 5)  # far from `storage_retry_s`
        failed_s = time.monotonic() - held
        finishing.join(5)
        assert not finishing.is_alive()
        left = list(s3.keys(output_prefix(job.id)))
        partition.cut()  # the held requests are dropped, not sent on, as the forwarder closes
    finally:
        partition.close()
    print(f"FIGURE check_failed_upload_held: the job failed {failed_s:.2f} s after its upload was held")
    assert (failed.status, failed.error.code) == ("failed", "output_mismatch"), failed
    expected = ".output.mp4.partial is not what was promised: frame count is 37, expected 38"  # as before the change
    assert failed.error.message.startswith(expected), failed.error
    assert left == []


def test_an_attempt_that_failed_beside_its_hung_upload_ends_before_its_lease_can_lapse(
    worker_here, settings, jobs, s3, queue, clip
):
    """The output's check fails while its upload hangs on its way to SeaweedFS, and botocore's 3 tries of that
    request (`s3_timeout_s` each, after a second's wait for `100 Continue`) outlast the upload's keep-alive
    (`storage_retry_s`) and the lease after it, as at the defaults with a lease under a minute (3 x 61 s against
    120 s of keep-alive): the attempt fails with the check's error at once rather than once those tries have ended,
    by when the reaper (run here as often as it runs) would have requeued the job and the failure would be lost to a
    retry. The request, let through after the attempt ended, lands: the stopped upload deletes it. The lease leaves a
    loaded 2-core machine seconds for the flush and the check (2 s was outlasted there once)."""
    timeout_s, retry_s, lease_s = 4, 1, 6  # 3 x 5 s of tries against 7 s of keep-alive and lease
    partition = storage_through(
        settings,
        worker_here,
        VSRQ_S3_TIMEOUT_S=str(timeout_s),
        VSRQ_WORKER_STORAGE_RETRY_S=str(retry_s),
    )
    try:
        job, finishing, put = check_failing_beside_held_upload(partition, settings, jobs, s3, queue, clip, lease_s)
        held = time.monotonic()
        requeued = {}
        while finishing.is_alive() and time.monotonic() - held < 3 * (timeout_s + 1) + 5:
            # this job's: the reaper also requeues what earlier tests left leased (twice CI's failure here)
            requeued |= {job_id: status for job_id, status in jobs.reap().items() if job_id == job.id}
            time.sleep(0.1)
        ended_s = time.monotonic() - held
        assert not finishing.is_alive()
        stored = []  # the upload's answers from SeaweedFS
        service.blobs().client.meta.events.register(
            "after-call.s3.PutObject", lambda http_response, **_: stored.append(http_response.status_code)
        )
        partition.release(put)  # the held request reaches SeaweedFS and lands, after its attempt ended
        wait_until(lambda: not any(t.name.startswith("vsrq-output-upload") for t in threading.enumerate()), 30)
        left = list(s3.keys(output_prefix(job.id)))
        after = jobs.require(job.id)
    finally:
        partition.close()
        if jobs.require(job.id).status == "queued":
            jobs.cancel(job.id)
    print(f"FIGURE failed_beside_hung_upload: the attempt ended {ended_s:.2f} s after its upload was held; {requeued}")
    assert requeued == {} and (after.status, after.error.code, after.attempt) == ("failed", "output_mismatch", 1)
    assert ended_s < lease_s, ended_s
    assert stored == [200] and left == [], stored


def test_an_attempt_s_output_is_not_deleted_key_by_key_from_storage_that_does_not_answer(worker_here, settings, s3):
    """An ended attempt deletes its output and previews. With storage not answering, each delete waits out botocore's
    tries (3 x `s3_timeout_s`), after the job ended and holding any tail behind it: once one has failed, the others
    are left to the storage sweep, one request's tries in all instead of one per key."""
    timeout_s = 1
    output_key = attempt_output_key("video_" + os.urandom(12).hex(), 1, "t" * 16)
    keys = [output_key, *(preview_key(output_key, variant) for variant in PREVIEWS)]
    for key in keys:
        s3.put(key, io.BytesIO(b"x"))
    partition = storage_through(settings, worker_here, VSRQ_S3_TIMEOUT_S=str(timeout_s))
    try:
        deletes: list[str] = []
        service.blobs().client.meta.events.register(
            "before-call.s3.DeleteObject", lambda params, **_: deletes.append(params["url_path"])
        )
        partition.cut()
        started = time.monotonic()
        discard_attempt(output_key)
        ended_s = time.monotonic() - started
    finally:
        partition.close()
    print(f"FIGURE discard_unanswered: {len(deletes)} delete call(s), {ended_s:.1f} s")
    assert len(deletes) == 1 and ended_s < 2 * 3 * timeout_s, (deletes, ended_s)  # one call, its 3 tries
    assert sorted(s3.keys(output_key.rsplit("/", 1)[0])) == sorted(keys)  # for the sweep


@pytest.mark.parametrize("released", [False, True], ids=["held_at_its_commit", "released_before_its_commit"])
def test_a_job_keeps_its_last_window_iff_a_tail_is_held_as_its_engine_ends(
    released, worker_here, settings, jobs, s3, queue, clip
):
    """A tail held on the worker's finisher (its output's upload stalled on its way to SeaweedFS) when the next job's
    head starts. Still held as that job's engine ends (its one window's commit): the job's tail will wait its turn
    behind it, and may be sent back or lost meanwhile, so its last window (for a job of one window, its whole engine)
    is kept under its work prefix. Released and ended before (the job's head held at its input's download while
    it ends): the job's tail follows at once, and it keeps nothing. Both jobs then complete, and the job's end deletes
    what it kept. (A job with no tail held keeps no last window: test_recovery.py.)"""
    partition = storage_through(settings, worker_here)
    try:
        held, behind, put = held_at_its_output(partition, settings, jobs, s3, queue, clip, lease_s=30)
        lease = service.jobs().lease(behind.id, "test-tail/1", lease_s=30)
        if not released:
            head(behind, lease)
            # the one window's raw frames and its JSON (written last: it replays), as the held tail still waits
            kept = wait_until(lambda: landed(s3.keys(work_prefix(behind.id))), 30)
            assert kept == {0: {"mkv", "json"}} and tasks._finisher.busy(), kept
            partition.release(put)
        else:
            # its input's download (its HEAD), before its engine: a first attempt sends nothing for its windows
            # before a commit
            download = f" /{settings.s3_bucket}/{behind.input.key} ".encode()
            partition.hold(download)
            heading = threading.Thread(target=head, args=(behind, lease), daemon=True)
            heading.start()
            wait_until(lambda: partition.held == 2, 30)
            assert tasks._finisher.busy()  # as the head began
            partition.release(put)
            assert tasks._finisher.wait(60)
            partition.release(download)
            heading.join(60)
            assert not heading.is_alive()
        assert tasks._finisher.wait(60)
    finally:
        partition.close()
    for job in (held, behind):
        done = jobs.require(job.id)
        assert done.status == "completed", done
        assert sorted(s3.keys(output_prefix(job.id))) == sorted(done.output.keys())
        assert list(s3.keys(work_prefix(job.id))) == []
    [run] = [event.detail for event in jobs.events(behind.id) if event.type == "run"]
    if released:  # nothing uploaded; its one window written locally, then dropped at its commit
        assert run["kept_upload_s"] == 0 and run["tail_s"]["kept_join"] < 0.05, run
    else:
        assert run["kept_upload_s"] > 0, run  # its upload ran (the commit's own time rounds to 0 ms on a fast box)


def landed(keys) -> dict[int, set[str]] | None:
    """The window files once the first window's JSON (uploaded last) is in."""
    files = window_files(keys)
    return files if "json" in files.get(0, set()) else None


def held_at_its_output(partition, settings, jobs, s3, queue, clip, lease_s: float):
    """Two jobs; the first leased and its head run, its tail on the finisher with its output's upload held by
    `partition`: (that job, the next one, the held request)."""
    first, behind = create_record(jobs, s3, clip, queue), create_record(jobs, s3, clip, queue)
    lease = service.jobs().lease(first.id, "test-tail/1", lease_s=lease_s)
    put = f"PUT /{settings.s3_bucket}/{attempt_output_key(first.id, lease.attempt, lease.token)} ".encode()
    partition.hold(put)
    head(first, lease)
    wait_until(lambda: partition.held == 1, 30)
    return first, behind, put


def check_failing_beside_held_upload(partition, settings, jobs, s3, queue, clip, lease_s: float):
    """A job leased and its head run, its tail on a thread of its own with its output's upload held by `partition`
    and a check that will fail (its promise asks for a frame more than the encoder was given): (the job, the tail's
    thread, the held request)."""
    job = create_record(jobs, s3, clip, queue)
    lease = service.jobs().lease(job.id, "test-tail/1", lease_s=lease_s)
    output_key = attempt_output_key(job.id, lease.attempt, lease.token)
    put = f"PUT /{settings.s3_bucket}/{output_key} ".encode()  # the upload's request line, not the delete's
    partition.hold(put)
    prefix = KeptPrefix(lease.attempt)
    with tasks._attempt(job, lease, output_key, prefix):
        tail = tasks._head(job, lease, output_key, prefix)
    promise = tail.encoding._promise
    tail.encoding._promise = dataclasses.replace(promise, frames=promise.frames + 1)
    finishing = threading.Thread(target=tasks._finish, args=(tail,), daemon=True)
    finishing.start()
    wait_until(lambda: partition.held == 1, 30)
    return job, finishing, put


def head(job, lease) -> None:
    """The job's head on this thread, its tail handed to the worker's finisher (as the task does)."""
    output_key = attempt_output_key(job.id, lease.attempt, lease.token)
    prefix = KeptPrefix(lease.attempt)
    with tasks._attempt(job, lease, output_key, prefix):
        tail = tasks._head(job, lease, output_key, prefix)
    tasks._finisher.hand(lambda turn: tasks._finish(tail, overlapped=True, turn=turn), tail.silent_s)


@pytest.fixture(scope="module")
def windowed_clip(tmp_path_factory) -> bytes:
    """22 frames of 128x96 H.264 with AAC: 2 windows of 13 frames (`WINDOWS`), the first kept (1 MB of raw frames, a
    single PUT)."""
    return write_clip(tmp_path_factory.mktemp("windowed") / "clip.mp4", 22, (96, 128), audio_codec="aac").read_bytes()


@contextmanager
def upload_refused_check_held(
    worker_here, settings, jobs, s3, queue, clip: bytes, lease_s: int
) -> Iterator[tuple[Partition, bytes, tasks._Tail, threading.Thread]]:
    """A job's tail, run by this process, whose output upload SeaweedFS refuses (its connection closed unanswered)
    while the check waits for the kept window's upload, held on its way: the partition, the held upload's
    marker (to release), the tail and its thread, once the upload was refused. One try of it (`AWS_MAX_ATTEMPTS`,
    storage_retry_s 0: an outage is not waited out) and one attempt of the job (`VSRQ_MAX_ATTEMPTS`: none is sent
    again)."""
    partition = storage_through(
        settings,
        worker_here,
        VSRQ_WORKER_STORAGE_RETRY_S="0",
        AWS_MAX_ATTEMPTS="1",
        VSRQ_MAX_ATTEMPTS="1",
        **WINDOWS,
    )
    try:
        job = create_record(jobs, s3, clip, queue)
        lease = service.jobs().lease(job.id, "test-tail/1", lease_s=lease_s)
        output_key = attempt_output_key(job.id, lease.attempt, lease.token)
        partition.refuse(f"PUT /{settings.s3_bucket}/{output_key} ".encode())
        kept = b"/window-00000.mkv "  # the kept window's first file: its JSON (and the `join`) wait behind it
        partition.hold(kept)
        prefix = KeptPrefix(lease.attempt)
        with tasks._attempt(job, lease, output_key, prefix):
            tail = tasks._head(job, lease, output_key, prefix)
        wait_until(lambda: partition.held == 1, 30)
        raised = threading.Event()  # botocore has raised the refusal in the upload's thread
        service.blobs().client.meta.events.register("after-call-error.s3.PutObject", lambda **_: raised.set())
        finishing = threading.Thread(target=tasks._finish, args=(tail,), daemon=True)
        finishing.start()
        wait_until(lambda: partition.refused == 1, 30)
        assert raised.wait(30)
        yield partition, kept, tail, finishing
    finally:
        partition.close()  # releases what it still holds


def test_an_upload_refused_during_the_check_fails_the_attempt_before_the_previews(
    worker_here, settings, jobs, s3, queue, windowed_clip
):
    """The output's upload fails (storage refuses it) while its check still runs; the check then passes: the attempt
    fails at once with storage's error, and no preview is made for an output that will not be promoted."""
    with upload_refused_check_held(worker_here, settings, jobs, s3, queue, windowed_clip, lease_s=30) as (
        partition, kept, tail, finishing
    ):
        time.sleep(0.5)  # botocore raised the refusal: the upload's thread hands it to its future in milliseconds
        with files_written_in(tail.scratch) as written:
            released = time.monotonic()
            partition.release(kept)
            failed = wait_until(lambda: ended(jobs, tail.job.id), 30)
            failed_s = time.monotonic() - released
            finishing.join(5)
    assert not finishing.is_alive()
    print(f"FIGURE upload_refused_check_held: failed {failed_s:.2f} s after the check's wait was released")
    [last] = [event.detail["last"] for event in jobs.events(failed.id) if event.type == "failed"]  # its one attempt
    assert (failed.status, last["code"]) == ("failed", "storage_unavailable"), (failed, last)
    assert written == set()  # no thumbnail.jpg, no spritesheet.jpg
    assert list(s3.keys(output_prefix(tail.job.id))) == []


def test_an_upload_that_failed_before_the_check_did_is_logged(
    worker_here, settings, jobs, s3, queue, windowed_clip, caplog
):
    """The output's upload fails (storage refuses it), then the check does: its wait for the kept window's upload,
    held past the lease, ends as that upload finds the lease run out and the job reaped (so no beat can extend it
    meanwhile). The attempt ends with the check's error (it lost the job); the upload's own, storage's, is logged."""
    lease_s = 2
    caplog.set_level(logging.WARNING, logger="vsrq.worker")
    with upload_refused_check_held(worker_here, settings, jobs, s3, queue, windowed_clip, lease_s) as (
        partition, kept, tail, finishing
    ):
        wait_until(lambda: jobs.reap().get(tail.job.id) == "queued", 2 * lease_s + 10)
        partition.release(kept)
        finishing.join(30)
    assert not finishing.is_alive()
    job_id = tail.job.id
    lost = [record for record in caplog.records if "the output's upload failed too" in record.getMessage()]
    assert len(lost) == 1, caplog.text
    [record] = lost
    print(f"FIGURE upload_error_logged: {record.getMessage()}")
    assert record.getMessage().startswith(f"{job_id}: ")
    assert classify(record.exc_info[1])[1] == "storage_unavailable", record.exc_info
    assert f"{job_id} attempt 1 lost the job" in caplog.text  # the check's error ended the attempt
    assert jobs.require(job_id).status == "queued"  # as the reaper left it
    assert list(s3.keys(output_prefix(job_id))) == []
    jobs.cancel(job_id)


@contextmanager
def files_written_in(directory: Path) -> Iterator[set[str]]:
    """The names of the files opened for writing in `directory` while the block runs, from any thread, as the
    interpreter's audit events report each `open`."""
    names: set[str] = set()
    watch = (directory, names)
    _watched().append(watch)
    try:
        yield names
    finally:
        _watched().remove(watch)


@cache
def _watched() -> list[tuple[Path, set[str]]]:
    """An audit hook, added once (one cannot be removed) and idle while nothing is watched."""
    watched: list[tuple[Path, set[str]]] = []

    def hook(event: str, args: tuple) -> None:
        if event != "open" or not watched or not isinstance(args[0], (str, bytes, os.PathLike)):  # not an fd's
            return
        if isinstance(args[1], str) and set(args[1]) & set("wax+"):
            path = Path(os.fsdecode(args[0]))
            for directory, names in watched:
                if path.parent == directory:
                    names.add(path.name)

    sys.addaudithook(hook)
    return watched


@pytest.mark.parametrize("check", ["passes", "fails"])
def test_a_first_attempt_of_one_window_sends_no_request_for_its_windows_on_an_idle_worker(
    check, worker_here, settings, jobs, s3, queue, clip
):
    """The worker's own path (its head, its tail, the job's end): a job of one window on a worker holding no tail
    lists, marks, uploads and deletes nothing under its work prefix, whether it completes or its check fails (its
    promise asks for a frame more than the encoder was given). Each S3 call botocore makes is noted."""
    worker_here()
    assert not tasks._finisher.busy()  # no tail held: its window is not kept
    job = create_record(jobs, s3, clip, queue)
    calls = note_requests(service.blobs(), job.id)  # the worker's own store
    lease = service.jobs().lease(job.id, "test-tail/1", lease_s=30)
    output_key = attempt_output_key(job.id, lease.attempt, lease.token)
    prefix = KeptPrefix(lease.attempt)
    with tasks._attempt(job, lease, output_key, prefix):
        tail = tasks._head(job, lease, output_key, prefix)
    if check == "fails":
        promise = tail.encoding._promise
        tail.encoding._promise = dataclasses.replace(promise, frames=promise.frames + 1)
    tasks._finish(tail)
    done = jobs.require(job.id)
    assert done.status == ("completed" if check == "passes" else "failed"), done
    assert calls == [], calls


def test_a_job_sent_back_behind_a_stuck_tail_keeps_its_last_window_for_its_next_attempt(
    worker_here, settings, jobs, s3, queue, clip, monkeypatch
):
    """A tail stuck ahead (its output's upload held on its way to SeaweedFS, silent past VSRQ_WORKER_TAIL_STALL_S)
    as the next job's engine ends: that job's last window (its one window: its whole engine) is kept, since its tail
    would wait, and the job goes back to the queue (`worker_tail_stuck`) from the task (`_wait_for_room`) while the
    window's upload is still on its way (held 1.5 s: a slow network). The window lands whole (its JSON too) before the
    job is requeued, and the job's next attempt replays it instead of computing it again."""
    from celery.worker import state as worker_state

    from storage.queue import make_celery
    from worker import attempt

    monkeypatch.setattr(worker_state, "should_stop", worker_state.should_stop)  # `_stop_if_stuck` sets it
    monkeypatch.setattr(attempt, "app", make_celery(settings))  # the job sent back on the test stack's broker
    stall_s = 3
    partition = storage_through(
        settings,
        worker_here,
        VSRQ_WORKER_TAIL_STALL_S=str(stall_s),
        VSRQ_WORKER_STORAGE_RETRY_S="1",  # the stuck tail's lease is kept this long into its upload, then silent
    )
    try:
        assert not tasks._finisher.busy()
        stuck, behind, put = held_at_its_output(partition, settings, jobs, s3, queue, clip, lease_s=60)
        # the next job's task, leased before the stall, its input's download held until the tail ahead is stuck
        download = f" /{settings.s3_bucket}/{behind.input.key} ".encode()
        # its one window's raw frames (49 MB: a multipart upload, begun and its parts held), the JSON after them (the
        # stuck job kept no window: no tail was held as its engine ended)
        kept = b"/window-00000.mkv?"
        partition.hold(download)
        partition.hold(kept)
        task = threading.Thread(target=tasks.upscale, args=(behind.id,), daemon=True)
        task.start()
        wait_until(lambda: partition.held == 2, 30)
        wait_until(lambda: tasks._finisher.silent_s() > stall_s + 0.5, 30)
        partition.release(download)
        wait_until(lambda: partition.held >= 3, 30)
        time.sleep(1.5)  # the window's upload on its way, past the second an ended attempt gives it
        partition.release(kept)
        task.join(60)
        assert not task.is_alive()
        sent_back = jobs.require(behind.id)
        files = window_files(s3.keys(work_prefix(behind.id)))
        partition.release(put)
        assert tasks._finisher.wait(60)
    finally:
        partition.close()
    reasons = [event.detail["reason"]["code"] for event in jobs.events(behind.id) if event.type == "requeued"]
    assert (sent_back.status, reasons) == ("queued", ["worker_tail_stuck"]), (sent_back, reasons)
    assert files == {0: {"mkv", "json"}}, files
    lease = service.jobs().lease(behind.id, "test-tail/2", lease_s=60)
    head(behind, lease)
    assert tasks._finisher.wait(60)
    done = jobs.require(behind.id)
    [run] = [event.detail for event in jobs.events(behind.id) if event.type == "run"]
    assert (done.status, done.attempt, run["restored"]) == ("completed", 2, 1), (done, run)
    assert list(s3.keys(work_prefix(behind.id))) == []


def test_a_tail_whose_job_was_cancelled_is_not_taken_for_a_stuck_one_as_it_cleans_up(
    worker_here, settings, jobs, s3, queue, clip, monkeypatch
):
    """A job cancelled during its tail: its attempt ends (`cancelled`) and deletes its output, each delete held by
    storage until its try times out (VSRQ_S3_TIMEOUT_S, botocore's 3 tries), past VSRQ_WORKER_TAIL_STALL_S. The job
    has ended, so that tail's silence says nothing (as a completed one's, test_faults.py): the tail waiting its turn
    behind it is not sent back as `worker_tail_stuck` nor its worker stopped, and completes on its first attempt."""
    from celery.worker import state as worker_state

    from storage.queue import make_celery
    from worker import attempt

    stopping = worker_state.should_stop
    monkeypatch.setattr(worker_state, "should_stop", stopping)  # `_stop_if_stuck` would set it
    monkeypatch.setattr(attempt, "app", make_celery(settings))  # a job sent back: on the test stack's broker
    stall_s = 2
    partition = storage_through(
        settings,
        worker_here,
        VSRQ_S3_TIMEOUT_S="2",
        VSRQ_WORKER_TAIL_STALL_S=str(stall_s),
    )
    try:
        assert not tasks._finisher.busy()
        cancelled, behind, put = held_at_its_output(partition, settings, jobs, s3, queue, clip, lease_s=30)
        deletes = f"DELETE /{settings.s3_bucket}/{output_prefix(cancelled.id)}".encode()
        partition.hold(deletes)  # the attempt's deletes of its output, once it is cancelled
        head(behind, service.jobs().lease(behind.id, "test-tail/1", lease_s=30))  # its tail waits its turn
        jobs.cancel(cancelled.id)
        partition.release(put)
        wait_until(lambda: partition.held >= 2, 30)  # the cancelled attempt's deletes of its output
        time.sleep(2 * stall_s + 1)
        partition.release(deletes)
        assert tasks._finisher.wait(60)
    finally:
        partition.close()
    assert jobs.require(cancelled.id).status == "cancelled"
    done = jobs.require(behind.id)
    reasons = [event.detail["reason"]["code"] for event in jobs.events(behind.id) if event.type == "requeued"]
    assert (done.status, done.attempt, reasons) == ("completed", 1, []), (done, reasons)
    assert worker_state.should_stop is stopping
