"""The job record's state machine on a real Redis: transitions, fencing, leases, cancellation, listing."""

from __future__ import annotations

import secrets
import threading
import time

import pytest

from storage.jobs import (
    TRANSITIONS,
    InputInfo,
    InvalidCursor,
    InvalidTransition,
    JobActive,
    JobNotFound,
    JobStore,
    MediaInfo,
    OutputInfo,
    StaleAttempt,
    Status,
    VideoEvent,
    new_lease_token,
)
from worker.heartbeat import Heartbeat, Pace
from worker.sr.windows import WindowProgress

MEDIA = MediaInfo(width=96, height=64, frames=9, fps=24.0, duration=0.375, audio=False)


def make(jobs: JobStore, owner: str | None = None, queue: str | None = None):
    owner = owner or "owner-" + secrets.token_hex(4)
    return jobs.create(
        owner=owner,
        model="k6-vsr",
        queue=queue or "q-" + secrets.token_hex(4),
        params={"sr_resolution_scale": 2.0},
        input=InputInfo(key=f"uploads/{owner}/upload_x", bytes=10),
    )


def output(job_id: str) -> OutputInfo:
    return OutputInfo(key=f"outputs/{job_id}/video.mp4", bytes=1234, sha256="ab" * 32, media=MEDIA)


def test_the_table_is_the_one_documented():
    assert {status: sorted(targets) for status, targets in TRANSITIONS.items()} == {
        Status.QUEUED: [Status.CANCELLED, Status.FAILED, Status.IN_PROGRESS],
        Status.IN_PROGRESS: [Status.CANCELLED, Status.COMPLETED, Status.FAILED, Status.QUEUED],
        Status.COMPLETED: [],
        Status.FAILED: [],
        Status.CANCELLED: [],
    }


def test_a_job_runs_from_queued_to_completed(jobs: JobStore):
    job = make(jobs)
    assert (job.status, job.attempt, jobs.queue_position(job)) == (Status.QUEUED, 0, 0)

    lease = jobs.lease(job.id, "gpu-0", lease_s=30)
    assert lease.attempt == 1
    running = lease.job()
    assert (running.status, running.worker, running.progress) == (Status.IN_PROGRESS, "gpu-0", 0)
    assert running.started_at is not None and running.lease_until > running.started_at
    assert jobs.queue_position(running) is None

    assert lease.heartbeat(stage="probing", input_media=MEDIA) is False
    assert lease.heartbeat(progress=40, stage="upscaling") is False
    assert lease.heartbeat(progress=30) is False  # progress never goes back within an attempt
    running = lease.job()
    assert (running.progress, running.stage, running.input.media) == (40, "upscaling", MEDIA)

    done = lease.complete(output(job.id))
    assert (done.status, done.progress, done.stage, done.output) == (Status.COMPLETED, 100, None, output(job.id))
    assert done.expires_at == pytest.approx(done.completed_at + jobs.result_ttl_s)
    view = jobs.view(done)
    assert (view.size, view.seconds, view.output.sha256) == ("96x64", "0.375", "ab" * 32)
    assert [event.type for event in jobs.events(job.id)] == ["created", "leased", "stage", "stage", "completed"]


def test_forbidden_transitions_are_refused(jobs: JobStore):
    job = make(jobs)
    with pytest.raises(StaleAttempt):  # not leased: nobody holds attempt 0 or 1
        jobs.complete(job.id, "1:", output(job.id))
    lease = jobs.lease(job.id, "w", 30)
    with pytest.raises(InvalidTransition):  # in progress already
        jobs.lease(job.id, "other", 30)
    lease.fail("invalid_input", "not a video")
    for attempt in (lambda: jobs.lease(job.id, "w", 30), lambda: jobs.cancel(job.id)):
        with pytest.raises(InvalidTransition):
            attempt()
    for write in (
        lambda: lease.complete(output(job.id)),
        lambda: lease.heartbeat(progress=1),
        lambda: lease.retry("x", "y"),
    ):
        with pytest.raises(StaleAttempt):
            write()
    final = jobs.require(job.id)
    assert (final.status, final.error.code) == (Status.FAILED, "invalid_input")
    with pytest.raises(JobNotFound):
        jobs.lease("video_" + "0" * 24, "w", 30)


def test_a_stale_attempt_cannot_write(jobs: JobStore):
    job = make(jobs)
    first = jobs.lease(job.id, "gpu-0", 30)
    assert first.retry("device_lost", "CUDA error") == Status.QUEUED
    assert jobs.require(job.id).status == Status.QUEUED
    second = jobs.lease(job.id, "gpu-1", 30)
    assert second.attempt == 2
    for write in (
        lambda: first.heartbeat(progress=90),
        lambda: first.complete(output(job.id)),
        lambda: first.fail("x", "y"),
        lambda: first.cancelled(),
    ):
        with pytest.raises(StaleAttempt):
            write()
    assert second.heartbeat(progress=10) is False
    assert second.complete(output(job.id)).status == Status.COMPLETED
    assert [event.type for event in jobs.events(job.id)] == ["created", "leased", "requeued", "leased", "completed"]


def test_a_lease_given_again_under_the_same_attempt_number_fences_out_the_first(jobs: JobStore):
    """Redis can lose a write it acknowledged (a crash before its fsync, a failover to a replica the write had not
    reached): the job is queued again with its attempt count unchanged, and its next lease gets the first's number."""
    job = make(jobs)
    key = jobs._job_key(job.id)
    before = jobs.redis.dump(key)
    first = jobs.lease(job.id, "gpu-0", 30)
    jobs.redis.restore(key, 0, before, replace=True)  # the lease's write, lost
    second = jobs.lease(job.id, "gpu-1", 30)
    assert first.attempt == second.attempt == 1
    for write in (lambda: first.heartbeat(progress=90), lambda: first.complete(output(job.id))):
        with pytest.raises(StaleAttempt, match="attempt 1 under another lease"):
            write()
    assert second.heartbeat(progress=10) is False
    assert second.complete(output(job.id)).status == Status.COMPLETED


def test_a_lease_whose_reply_was_lost_is_taken_over_by_the_next_try_and_only_by_it(jobs: JobStore):
    """A lease that reached Redis and lost its reply (a timeout, a connection reset): the worker sends its message
    again with the lost try's token, and that delivery takes the attempt over instead of waiting out its lease."""
    job = make(jobs)
    lost = new_lease_token()
    jobs.lease(job.id, "gpu-0", 30, token=lost)  # applied; the caller never saw its reply
    jobs.cancel(job.id)  # the owner's cancel, asked meanwhile, stays asked
    with pytest.raises(InvalidTransition):  # a delivery that does not carry the lost try's token
        jobs.lease(job.id, "gpu-1", 30, lost=[new_lease_token()])
    resumed = jobs.lease(job.id, "gpu-1", 30, lost=[new_lease_token(), lost])
    assert (resumed.attempt, resumed.job().worker, resumed.job().cancel_requested) == (1, "gpu-1", True)
    with pytest.raises(InvalidTransition):  # a copy of the same message: the lost token no longer holds the job
        jobs.lease(job.id, "gpu-2", 30, lost=[lost])
    with pytest.raises(StaleAttempt, match="under another lease"):  # nor can the lost try's token write
        jobs.touch(job.id, f"1:{lost}", 30, progress=5)
    assert resumed.heartbeat(progress=5) is True
    assert resumed.cancelled().status == Status.CANCELLED
    events = jobs.events(job.id)
    assert [event.type for event in events] == ["created", "leased", "cancel_requested", "leased", "cancelled"]
    assert events[3].detail == {"worker": "gpu-1", "taken_over": lost} and events[3].attempt == 1
    # its owner sees one attempt, leased once
    seen = [(event.type, event.attempt) for event in jobs.event_views(job.id).data]
    assert seen == [("created", 0), ("leased", 1), ("cancel_requested", 1), ("cancelled", 1)]


def test_expired_leases_are_reaped_and_quarantined_after_max_attempts(jobs: JobStore):
    jobs = JobStore(jobs.redis, result_ttl_s=60, max_attempts=2, prefix="vsrq-reap-" + secrets.token_hex(4))
    job, alive = make(jobs), make(jobs)
    lease = jobs.lease(job.id, "dies", lease_s=1)
    kept = jobs.lease(alive.id, "beats", lease_s=2)
    assert jobs.expired_leases() == []
    time.sleep(1.5)
    kept.heartbeat(progress=5)  # extends its lease by another 2 s
    beat = time.monotonic()  # Redis extended it before this
    # past its first lease: the extension holds it. Read 1.4 s before the extension runs out: a loaded machine's
    # pause between the two calls (0.4 s of 0.6 s of margin broke it before) is not a lease that ran out
    time.sleep(0.6)
    assert jobs.expired_leases() == [job.id]
    assert jobs.reap() == {job.id: Status.QUEUED}
    assert jobs.reap() == {}
    with pytest.raises(StaleAttempt):  # the worker came back too late
        lease.heartbeat(progress=50)

    second = jobs.lease(job.id, "dies-again", lease_s=1)
    assert second.attempt == 2
    time.sleep(max(1.2, beat + 2.2 - time.monotonic()))  # past both leases
    assert set(jobs.reap()) == {job.id, alive.id}  # both silent now; the second is on its first attempt
    failed = jobs.require(job.id)
    assert (failed.status, failed.error.code) == (Status.FAILED, "lease_expired")  # the cause, not "too many"
    assert jobs.require(alive.id).status == Status.QUEUED


def test_only_one_of_concurrent_transitions_wins(jobs: JobStore):
    job = make(jobs)
    barrier, results = threading.Barrier(8), []

    def lease(worker: str) -> None:
        barrier.wait()
        try:
            results.append(jobs.lease(job.id, worker, 30))
        except InvalidTransition:
            results.append(None)

    threads = [threading.Thread(target=lease, args=(f"w{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted((lease and lease.attempt for lease in results), key=str) == [1] + [None] * 7

    # the worker completing and its owner cancelling race: exactly one ending holds
    fence = [lease for lease in results if lease][0].fence
    barrier, ends = threading.Barrier(3), []

    def end(action) -> None:
        barrier.wait()
        try:
            ends.append(action().status)
        except (StaleAttempt, InvalidTransition):
            ends.append(None)

    actions = [
        lambda: jobs.complete(job.id, fence, output(job.id)),
        lambda: jobs.fail(job.id, fence, "x", "y"),
        lambda: jobs.cancelled(job.id, fence),
    ]
    threads = [threading.Thread(target=end, args=(action,)) for action in actions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(ends, key=str).count(None) == 2
    assert jobs.require(job.id).status in {s for s in ends if s}


def test_cancel(jobs: JobStore):
    queued = make(jobs)
    assert jobs.cancel(queued.id).status == Status.CANCELLED
    assert jobs.queue_depth(queued.queue) == 0
    with pytest.raises(InvalidTransition):
        jobs.lease(queued.id, "w", 30)  # its Celery message arrives later: the worker drops it

    running = make(jobs)
    lease = jobs.lease(running.id, "w", 30)
    assert lease.heartbeat(progress=10) is False
    flagged = jobs.cancel(running.id)
    assert (flagged.status, flagged.cancel_requested) == (Status.IN_PROGRESS, True)
    assert lease.heartbeat(progress=20) is True  # the worker sees it between tiles
    assert lease.cancelled().status == Status.CANCELLED


def test_a_cancel_asked_before_an_attempt_ends_in_a_requeue_is_not_lost(jobs: JobStore):
    """A worker that missed the flag (Redis out of reach) and ends its attempt as a retry, or whose lease the reaper
    finds expired: the job is cancelled, not run again by an attempt that starts without the flag."""
    retried, reaped = make(jobs), make(jobs)
    retrying = jobs.lease(retried.id, "w", 30)
    expiring = jobs.lease(reaped.id, "w", 1)
    jobs.cancel(retried.id), jobs.cancel(reaped.id)
    assert retrying.retry("redis_unavailable", "The job store could not be reached.") == Status.CANCELLED
    time.sleep(1.2)
    assert jobs.reap() == {reaped.id: Status.CANCELLED}
    for job_id in (retried.id, reaped.id):
        job = jobs.require(job_id)
        assert (job.status, job.attempt, job.expires_at is not None) == (Status.CANCELLED, 1, True)
        assert [event.type for event in jobs.events(job_id)][-1] == "cancelled"


def test_delete(jobs: JobStore):
    job = make(jobs)
    lease = jobs.lease(job.id, "w", 30)
    with pytest.raises(JobActive):
        jobs.delete(job.id)
    lease.complete(output(job.id))
    jobs.delete(job.id)
    assert jobs.get(job.id) is None and jobs.events(job.id) == []
    assert jobs.page(job.owner).jobs == []
    queued = make(jobs)
    jobs.delete(queued.id)
    assert jobs.queue_depth(queued.queue) == 0
    with pytest.raises(JobNotFound):
        jobs.delete(queued.id)


def test_queue_positions_follow_the_queue(jobs: JobStore):
    queue = "q-" + secrets.token_hex(4)
    first, second, third = (make(jobs, queue=queue) for _ in range(3))
    assert [jobs.view(jobs.require(j.id)).queue_position for j in (first, second, third)] == [0, 1, 2]
    lease = jobs.lease(first.id, "w", 30)
    assert [jobs.queue_position(jobs.require(j.id)) for j in (first, second, third)] == [None, 0, 1]
    lease.retry("device_lost", "x")  # a retried job goes first, as its message does (it waited its turn already)
    assert [jobs.queue_position(jobs.require(j.id)) for j in (first, second, third)] == [0, 1, 2]
    jobs.lease(second.id, "w", 30).retry("device_lost", "x")  # the latest requeued runs first among them
    assert [jobs.queue_position(jobs.require(j.id)) for j in (first, second, third)] == [1, 0, 2]


def test_pages_by_owner_with_status_filter(jobs: JobStore):
    owner = "owner-" + secrets.token_hex(4)
    created = [make(jobs, owner=owner) for _ in range(5)]
    make(jobs)  # someone else's
    for job in created[1:3]:
        jobs.cancel(job.id)

    newest_first = [job.id for job in reversed(created)]
    first = jobs.page(owner, limit=2)
    second = jobs.page(owner, limit=2, after=first.jobs[-1].id)
    third = jobs.page(owner, limit=2, after=second.jobs[-1].id)
    assert [j.id for page in (first, second, third) for j in page.jobs] == newest_first
    assert (first.has_more, second.has_more, third.has_more) == (True, True, False)
    assert [j.id for j in jobs.page(owner, limit=10, order="asc").jobs] == [job.id for job in created]

    cancelled = jobs.page(owner, status=Status.CANCELLED, limit=1)
    rest = jobs.page(owner, status=Status.CANCELLED, limit=1, after=cancelled.jobs[0].id)
    assert [j.id for j in cancelled.jobs + rest.jobs] == [created[2].id, created[1].id]
    assert [j.id for j in jobs.page(owner, status=Status.QUEUED).jobs] == [created[4].id, created[3].id, created[0].id]
    with pytest.raises(InvalidCursor):
        jobs.page("another-owner", after=created[0].id)


def test_an_attempt_sent_back_because_of_another_job_does_not_count(jobs: JobStore):
    """A job sent back because another job's tail is stuck on its worker (`counts=False`) is requeued even on its last
    attempt, and that attempt is not one of its `max_attempts`: the next failure that counts is what fails it."""
    jobs = JobStore(jobs.redis, result_ttl_s=60, max_attempts=2, prefix="vsrq-excused-" + secrets.token_hex(4))
    job = make(jobs)
    assert jobs.lease(job.id, "w", 30).retry("device_lost", "x") == Status.QUEUED
    for _ in range(3):  # three stuck tails in a row: none of them the job's fault
        assert jobs.lease(job.id, "w", 30).retry("worker_tail_stuck", "x", counts=False) == Status.QUEUED
    last = jobs.lease(job.id, "w", 30)
    assert last.attempt == 5
    assert last.retry("device_lost", "x") == Status.FAILED
    failed = jobs.require(job.id)
    assert failed.error.code == "device_lost" and failed.error.message == "gave up after 2 attempts; the last: x"


def test_a_job_begun_beside_another_s_tail_is_not_charged_for_kills_in_that_tail(jobs: JobStore):
    """A worker reads the next job while the last one's tail encodes and uploads: a kill there takes both. The next
    job, at 0 % each time, was charged each attempt and failed after `max_attempts` kills in another job's tail (a
    trial's valid 30 s clip; alone, it completed in 32 s). Of the jobs one dead process held, only the furthest on
    counts; a job that kills its worker alone still fails after `max_attempts`."""
    jobs = JobStore(jobs.redis, result_ttl_s=60, max_attempts=2, prefix="vsrq-beside-" + secrets.token_hex(4))
    tail, head = make(jobs), make(jobs)
    for kill in range(3):
        jobs.lease(tail.id, "w/7", 30).heartbeat(progress=95)
        jobs.lease(head.id, "w/7", 30).heartbeat(progress=0)
        outcome = jobs.take_back([tail.id, head.id])
        assert outcome[head.id] == Status.QUEUED, kill
    assert outcome[tail.id] == Status.FAILED  # no further than 95 twice: its own two attempts
    for expected in (Status.QUEUED, Status.FAILED):  # then alone, at 0 % each time: its own two
        jobs.lease(head.id, "w/8", 30).heartbeat(progress=0)
        assert jobs.take_back([head.id]) == {head.id: expected}


def test_an_attempt_that_got_further_than_every_one_before_does_not_count(jobs: JobStore):
    """A long job whose worker was killed three times (deploys, preemptions), each time further on (a kill resumes
    from its kept windows), failed `worker_restarted` with its work done; an attempt that gets nowhere new still counts,
    so a job that kills its worker at the same point fails after `max_attempts`."""
    jobs = JobStore(jobs.redis, result_ttl_s=60, max_attempts=2, prefix="vsrq-further-" + secrets.token_hex(4))
    job = make(jobs)

    def attempts_left(job_id: str) -> list[int | None]:  # what each `requeued` event told the job's owner
        return [VideoEvent.of(event).attempts_left for event in jobs.events(job_id) if event.type == "requeued"]

    for progress in (10, 35, 60, 85):  # four restarts, each further on: none counts
        lease = jobs.lease(job.id, "w", 30)
        lease.heartbeat(progress=progress)
        assert jobs.take_back([job.id]) == {job.id: Status.QUEUED}, progress
    for attempt in (5, 6):  # then twice no further than 85: the second is the job's second counted attempt
        lease = jobs.lease(job.id, "w", 30)
        assert lease.attempt == attempt
        lease.heartbeat(progress=85)
        requeued = jobs.take_back([job.id])
    assert requeued == {job.id: Status.FAILED}
    failed = jobs.require(job.id)
    assert failed.error.code == "worker_restarted" and failed.error.message.startswith("gave up after 2 attempts")
    assert attempts_left(job.id) == [2, 2, 2, 2, 1]  # the owner was told none of the four counted, then one did
    # a retry its worker chose (an error it caught) counts however far it got: VSRQ_MAX_ATTEMPTS=1 means one try
    other = make(jobs)
    for progress, status in ((40, Status.QUEUED), (70, Status.FAILED)):
        lease = jobs.lease(other.id, "w", 30)
        lease.heartbeat(progress=progress)
        assert lease.retry("storage_unavailable", "x") == status
    assert attempts_left(other.id) == [1]


def test_progress_a_client_sees_never_goes_back_when_an_attempt_resumes(jobs: JobStore):
    """A worker restarted at 60 % resumes from its kept windows, its new attempt counting again from 0: the job said
    0 % (a progress bar, the OpenAI SDK's `create_and_poll`, went back) until it got past where it was."""
    job = make(jobs)
    lease = jobs.lease(job.id, "w", 30)
    lease.heartbeat(progress=60)
    jobs.take_back([job.id])
    assert jobs.view(jobs.require(job.id)).progress == 60  # queued again
    lease = jobs.lease(job.id, "w", 30)
    seen = [jobs.view(jobs.require(job.id)).progress]
    for progress in (5, 59, 61, 90):
        lease.heartbeat(progress=progress)
        seen.append(jobs.view(jobs.require(job.id)).progress)
    assert seen == [60, 60, 60, 61, 90]
    assert jobs.require(job.id).progress == 90  # the attempt's own, which the reaper's count of attempts reads


def test_a_running_job_says_when_its_upscaling_should_end(jobs: JobStore):
    """A long job said only its percentage. Its `eta` is the worker's estimate at the pace of the windows it computes:
    windows an earlier attempt kept (replayed in moments) do not make it promise too soon."""
    job = make(jobs)
    lease = jobs.lease(job.id, "w", 30)
    beat = Heartbeat(lease, every_s=0, pace=Pace(after_s=0.4))
    view = lambda: jobs.view(jobs.require(job.id))  # noqa: E731
    windows = 25
    for window in range(10):  # ten kept by an attempt before: back at once
        beat.window(WindowProgress(window, windows, "restored", 1, 1, None))
    assert view().eta is None
    time.sleep(0.4)
    beat.window(WindowProgress(10, windows, "upscaling", 1, 1, None))  # the first computed window starts the clock
    started = time.monotonic()
    for window in range(11, 15):  # four more
        time.sleep(0.4)
        beat.window(WindowProgress(window, windows, "upscaling", 1, 1, None))
    pace = (time.monotonic() - started) / 4
    eta = view().eta  # ten windows left: counting the kept ones' moments would say a third of it
    assert eta is not None and abs(eta - (time.time() + 10 * pace)) <= 1.2, (eta - time.time(), 10 * pace)
    for window in range(15, windows):
        beat.window(WindowProgress(window, windows, "upscaling", 1, 1, None))
    assert (view().stage, view().eta) == ("encoding", None)  # the engine is done: the tail follows
    jobs.take_back([job.id])
    assert view().eta is None and jobs.require(job.id).eta is None


def test_a_retry_told_to_wait_gets_its_message_from_the_reaper_once_the_wait_is_over(jobs: JobStore):
    """An origin that is down gets time (worker.attempt.retry_wait_s): nobody sends the retry's message, `unsent`
    hands the job to the reaper when its wait ends, not `enqueue_grace_s` after it."""
    prefix = "vsrq-wait-" + secrets.token_hex(4)
    jobs = JobStore(jobs.redis, result_ttl_s=60, max_attempts=3, enqueue_grace_s=30, prefix=prefix)
    job, behind = make(jobs, queue="q-wait"), make(jobs, queue="q-wait")
    jobs.sent(job.id), jobs.sent(behind.id)
    assert jobs.lease(job.id, "w", 30).retry("input_fetch_unavailable", "down", wait_s=5) == Status.QUEUED
    assert jobs.unsent(30) == [] and 4 < jobs.next_unsent_s() <= 5  # still waiting; when the reaper wakes for it
    assert jobs.event_views(job.id).data[-1].retry_in_s == 5
    # out of line while it waits: the job behind it is next; a duplicate message does not start it early
    assert (jobs.view(jobs.require(job.id)).queue_position, jobs.view(behind).queue_position) == (None, 0)
    # the job object says when it goes back in line (it said only `queued`)
    assert 3.5 < jobs.view(jobs.require(job.id)).retry_at - time.time() <= 5 and jobs.view(behind).retry_at is None
    with pytest.raises(InvalidTransition, match="its retry waits"):
        jobs.lease(job.id, "duplicate", 30)
    jobs.sent(job.id)  # a sender confirming late (its message was for the attempt before) changes none of it
    assert jobs.view(jobs.require(job.id)).queue_position is None and jobs.unsent(30) == []
    time.sleep(5.1)
    assert [waited.id for waited in jobs.unsent(30)] == [job.id]
    jobs.sent(job.id)  # back in line, at the front, where its message goes
    assert (jobs.view(jobs.require(job.id)).queue_position, jobs.view(behind).queue_position) == (0, 1)
    assert jobs.view(jobs.require(job.id)).retry_at is None  # its wait is over
    assert jobs.unsent(30) == [] and jobs.lease(job.id, "w", 30).attempt == 2
