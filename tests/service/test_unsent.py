"""The "unsent" mark (storage.jobs, `vsrq:unsent`) on a real Redis: it exists exactly while a job is queued and its
Celery message is not confirmed sent, because the transitions write it themselves; a requeue that fails (a stale
attempt) leaves none behind, so the reaper never sends a duplicate for a job whose message was already sent."""

from __future__ import annotations

import secrets

import pytest

from storage.jobs import InputInfo, JobStore, StaleAttempt, Status


@pytest.fixture
def store(redis_client) -> JobStore:
    """A store of its own on the session's Redis: reaping it reaps only this test's jobs."""
    return JobStore(redis_client, result_ttl_s=60, max_attempts=3, prefix=f"vsrq-unsent-{secrets.token_hex(4)}")


def marked(store: JobStore, job_id: str) -> bool:
    return store.redis.zscore(store._unsent_key, job_id) is not None  # the raw mark, never filtered by status


def new_job(store: JobStore):
    return store.create(
        owner="unsent", model="lanczos", queue="vsrq.unsent-test", params={}, input=InputInfo(key="uploads/x/y")
    )


def test_a_requeue_marks_the_job_in_the_same_write(store: JobStore):
    job = new_job(store)
    assert marked(store, job.id)  # created: due a message
    store.sent(job.id)
    lease = store.lease(job.id, "w1", lease_s=30)
    assert not marked(store, job.id)

    assert lease.retry("gpu_oom", "The GPU ran out of memory.") == Status.QUEUED
    assert marked(store, job.id)  # nothing sent yet: a sender dying now leaves the job to the reaper
    assert [found.id for found in store.unsent(0)] == [job.id]
    store.sent(job.id)
    assert not marked(store, job.id) and store.unsent(0) == []

    # a second attempt is reaped while the first one, stale, tries to requeue the job too
    store.lease(job.id, "w2", lease_s=0)
    assert store.reap() == {job.id: Status.QUEUED} and marked(store, job.id)
    store.sent(job.id)  # the reaper's message
    with pytest.raises(StaleAttempt):
        lease.retry("gpu_oom", "The GPU ran out of memory.")
    assert not marked(store, job.id) and store.unsent(0) == []  # no duplicate message is due

    # the last attempt's retry fails the job: no message is due
    third = store.lease(job.id, "w3", lease_s=30)
    assert not marked(store, job.id)
    assert third.retry("gpu_oom", "The GPU ran out of memory.") == Status.FAILED
    assert not marked(store, job.id)


def test_a_queued_job_loses_its_mark_when_it_moves_on(store: JobStore):
    cancelled, leased, deleted = new_job(store), new_job(store), new_job(store)
    store.cancel(cancelled.id)
    store.lease(leased.id, "w1", lease_s=30)  # its message arrived before its sender confirmed it
    store.delete(deleted.id)
    assert not any(marked(store, job.id) for job in (cancelled, leased, deleted))
