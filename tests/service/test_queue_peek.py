"""The broker's next messages, read without taking them (storage.queue.next_job_ids, what a worker that prefetches
the next input guesses from): in exactly the order a consumer then takes them, on the real Redis, with message
priorities and a key prefix as an operator may configure them; and a requeued job's message, sent to the front."""

from __future__ import annotations

import json
import secrets
import time

import pytest

from storage.config import Settings
from storage.jobs import InputInfo, JobStore, Status, new_job_id
from storage.queue import UPSCALE_TASK, make_celery, next_job_ids, send_upscale
from worker.reaper import reap_once


def test_the_peek_names_the_jobs_in_the_order_a_worker_takes_them(settings: Settings, redis_client):
    prefix = f"peek-{secrets.token_hex(3)}:"
    app = make_celery(settings.model_copy(update={"broker_transport_options": {"global_keyprefix": prefix}}))
    queue = f"vsrq.peek-{secrets.token_hex(3)}"
    a, b, c, d, e = (new_job_id() for _ in range(5))
    sent = [(a, None), (b, 9), (c, 0), (d, 5), (e, None)]
    for job_id, priority in sent:
        app.send_task(UPSCALE_TASK, args=[job_id], queue=queue, priority=priority)
    app.send_task("vsrq.something_else", args=["not_a_job"], queue=queue)  # another task's message: no job
    waiting = sum(redis_client.llen(key) for key in redis_client.keys(f"{prefix}{queue}*"))

    peeked = next_job_ids(app, [queue])

    assert waiting == len(sent) + 1
    assert sum(redis_client.llen(key) for key in redis_client.keys(f"{prefix}{queue}*")) == waiting  # none taken
    taken = []
    with app.connection_for_read() as connection, connection.SimpleQueue(queue, no_ack=True) as messages:
        for _ in range(waiting):
            message = messages.get_nowait()  # basic_get: the lists in the order BRPOP takes them
            if message.headers["task"] == UPSCALE_TASK:
                taken.append(message.decode()[0][0])
    # lower priority numbers first (kombu's steps 0, 3, 6, 9), oldest first within one
    assert peeked == taken == [a, c, e, d, b]
    assert next_job_ids(app, [queue]) == []


@pytest.mark.parametrize("prefix", ["", "vsrq-front:"])
def test_a_requeued_job_is_taken_before_the_jobs_that_waited(settings: Settings, jobs: JobStore, redis_client, prefix):
    """An attempt requeued after a failure or a lost worker waited its turn already: its message goes to the front of
    the queue, under a Redis key prefix too."""
    app = make_celery(settings.model_copy(update={"broker_transport_options": {"global_keyprefix": prefix}}))
    queue = f"vsrq.front-{secrets.token_hex(3)}"
    records = [
        jobs.create(owner="erin", model="lanczos", queue=queue, params={}, input=InputInfo(key="k", bytes=0))
        for _ in range(3)
    ]
    for record in records[:2]:
        send_upscale(app, jobs, record)
    send_upscale(app, jobs, records[2], first=True)

    taken = []
    with app.connection_for_read() as connection, connection.SimpleQueue(queue, no_ack=True) as messages:
        for _ in range(3):
            taken.append(messages.get_nowait().decode()[0][0])
    assert taken == [records[2].id, records[0].id, records[1].id]
    assert not redis_client.keys(f"{prefix}{queue}*")


def test_of_two_jobs_a_dead_worker_held_the_one_nearer_its_end_runs_first(settings: Settings, jobs: JobStore):
    """A worker killed in one job's tail (90 %) with the next job begun (5 %): both leases run out together and the
    reaper requeues both. The one nearly done runs first: it ends in moments where the other would hold it back for
    a whole job (a user trial saw it wait 23 s behind a job just begun)."""
    app = make_celery(settings)
    # a store of its own: the reaper's pass would take any other test's expired lease too
    jobs = JobStore(jobs.redis, result_ttl_s=60, max_attempts=3, prefix=f"vsrq-nearer-{secrets.token_hex(4)}")
    queue = f"vsrq.nearer-{secrets.token_hex(3)}"
    tail, begun = (
        jobs.create(owner="erin", model="lanczos", queue=queue, params={}, input=InputInfo(key="k", bytes=0))
        for _ in range(2)
    )
    for record, progress in ((tail, 90), (begun, 5)):  # the tail's lease runs out first, as it was taken first
        jobs.lease(record.id, "killed@host/1", 1).heartbeat(progress=progress)
    time.sleep(1.1)

    assert reap_once(jobs, app, enqueue_grace_s=3600) == {begun.id: Status.QUEUED, tail.id: Status.QUEUED}
    assert [jobs.queue_position(jobs.require(job.id)) for job in (tail, begun)] == [0, 1]
    taken = []
    with app.connection_for_read() as connection, connection.SimpleQueue(queue, no_ack=True) as messages:
        for _ in range(2):
            taken.append(messages.get_nowait().decode()[0][0])
    assert taken == [tail.id, begun.id]
    assert next_job_ids(app, [queue]) == []  # no other message was sent


def test_the_peek_skips_messages_it_cannot_read_and_names_the_jobs_behind_them(settings: Settings, redis_client):
    """Bytes anyone who reaches the broker can push: a body nested past the parser's depth, arguments that are not a
    job id's list. Each is skipped (the worker then drops it at its lease), the messages behind it still peeked."""
    app = make_celery(settings)
    queue = f"vsrq.peek-{secrets.token_hex(3)}"
    job_id = new_job_id()
    app.send_task(UPSCALE_TASK, args=[job_id], queue=queue)
    # the worker takes from the list's tail: these sit in front of the real message
    envelope = json.loads(redis_client.lindex(queue, 0))
    for body in ("[" * 100_000 + "]" * 100_000, '["x", {}, {}]', '[[{"a": 1}], {}, {}]', '[["x"], {}, {}]', "{}"):
        redis_client.rpush(queue, json.dumps({**envelope, "body": body, "properties": {}}))

    assert next_job_ids(app, [queue]) == [job_id]
