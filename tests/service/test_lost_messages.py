"""Messages lost by a dying consumer (worker.lost): kombu's Redis transport pops a message off its list before the
consumer writes it to `unacked`, and a consumer killed in between takes it with it. On the real Redis, with a real
kombu consumer holding a message and messages in more than one priority step's list, under a key prefix as an
operator may configure: the reaper sends again the message of the job the broker no longer holds, once, after two
looks its grace apart, and no other."""

from __future__ import annotations

import contextlib
import logging
import secrets
import subprocess
import sys
import time

import pytest

from storage.config import Settings
from storage.jobs import InputInfo, JobStore
from storage.overview import overview
from storage.queue import (
    UPSCALE_TASK,
    _upscale_job_id,
    drop_ended_unacked,
    make_celery,
    next_job_ids,
    send_upscale,
)
from storage.workers import WorkerRegistry
from worker.lost import LostMessages
from worker.reaper import reap_once

GRACE_S = 0.5


@pytest.mark.parametrize("prefix", ["", "vsrq-lost:"])
def test_only_the_job_whose_message_a_dead_consumer_took_gets_another(
    settings: Settings, redis_client, caplog, prefix: str
):
    store = JobStore(redis_client, result_ttl_s=60, max_attempts=3, prefix=f"vsrq-lost-{secrets.token_hex(4)}")
    app = make_celery(settings.model_copy(update={"broker_transport_options": {"global_keyprefix": prefix}}))
    queue = f"vsrq.lost-{secrets.token_hex(3)}"
    held, lost, listed, urgent, unsent = (
        store.create(owner="lost", model="lanczos", queue=queue, params={}, input=InputInfo(key="k")) for _ in range(5)
    )
    looks = LostMessages([queue], GRACE_S)

    def look() -> None:
        assert reap_once(store, app, enqueue_grace_s=3600, lost=looks) == {}  # no lease expired, no sender died

    send_upscale(app, store, held)
    with app.connection_for_read() as connection, connection.SimpleQueue(queue, no_ack=False) as consumer:
        taken = consumer.get_nowait()  # basic_get: off the list and into `unacked`, not acknowledged: a live consumer's
        try:
            assert taken.decode()[0] == [held.id]
            assert redis_client.hlen(f"{prefix}unacked") >= 1
            send_upscale(app, store, lost)
            waiting = redis_client.lrange(f"{prefix}{queue}", 0, -1)
            [message] = [raw for raw in waiting if _upscale_job_id(raw) == lost.id]
            assert redis_client.lrem(f"{prefix}{queue}", 1, message) == 1  # a consumer took it, and died with it
            send_upscale(app, store, listed)
            app.send_task(UPSCALE_TASK, args=[urgent.id], queue=queue, priority=9)  # the last priority step's list
            store.sent(urgent.id)
            # `unsent` is due a message its sender never confirmed: the `unsent` pass's, not this one's

            with caplog.at_level(logging.INFO, logger="vsrq.reaper"):
                look()  # the first look: nothing is sent on one
                assert next_job_ids(app, [queue], limit=10) == [listed.id, urgent.id]
                time.sleep(GRACE_S)
                look()  # missing on both looks, its grace apart: sent again, at the front
                assert next_job_ids(app, [queue], limit=10) == [lost.id, listed.id, urgent.id]
                time.sleep(GRACE_S)
                look()  # held again by the broker: nothing more
                assert next_job_ids(app, [queue], limit=10) == [lost.id, listed.id, urgent.id]
        finally:
            taken.ack()
    resent = [record for record in caplog.records if "sent again" in record.getMessage()]
    assert [record.job_id for record in resent] == [lost.id]
    now = overview(store, WorkerRegistry(redis_client, prefix=store.prefix), {"lanczos": queue})
    assert now.lost_messages_resent == 1
    assert store.require(unsent.id).status == "queued" and [job.id for job in store.unsent(0)] == [unsent.id]
    redis_client.delete(*redis_client.keys(f"{prefix}{queue}*"), *redis_client.keys(f"{store.prefix}:*"))


# A consumer that takes the next message into `unacked` (basic_get, not acknowledged) and says so, then waits to be
# killed: a worker SIGKILLed between its write to `unacked` and its lease (its tail's, or a host's, death).
_TAKE_AND_WAIT = """
import sys, time
from kombu import Connection
with Connection(sys.argv[1]) as connection, connection.SimpleQueue(sys.argv[2], no_ack=False) as consumer:
    message = consumer.get(timeout=30)
    print(message.payload[0][0], flush=True)
    time.sleep(120)
"""


def test_a_message_taken_by_a_consumer_killed_before_its_lease_is_sent_again(
    settings: Settings, redis_client, caplog
):
    """kombu keeps a message a consumer took, and never acknowledged, in `unacked` until its visibility timeout (above
    the longest job: hours); a worker leases its job first thing. The job of one taken `unacked_s` ago and still
    queued gets another message (after the grace's two looks); one taken by a live consumer since does not."""
    unacked_s = 3.0
    store = JobStore(redis_client, result_ttl_s=60, max_attempts=3, prefix=f"vsrq-lost-{secrets.token_hex(4)}")
    app = make_celery(settings)
    queue = f"vsrq.lost-{secrets.token_hex(3)}"
    dead, held = (
        store.create(owner="lost", model="lanczos", queue=queue, params={}, input=InputInfo(key="k")) for _ in range(2)
    )
    looks = LostMessages([queue], GRACE_S, unacked_s=unacked_s)

    def look() -> None:
        assert reap_once(store, app, enqueue_grace_s=3600, lost=looks) == {}

    send_upscale(app, store, dead)
    command = [sys.executable, "-c", _TAKE_AND_WAIT, settings.celery_broker_url, queue]
    consumer = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert consumer.stdout.readline().strip() == dead.id  # in `unacked` now
    finally:
        consumer.kill()  # SIGKILL: nothing given back
        consumer.wait()
    taken_at = time.monotonic()
    with caplog.at_level(logging.INFO, logger="vsrq.reaper"):
        look()  # taken just now: held
        assert not [record for record in caplog.records if "sent again" in record.getMessage()]
        time.sleep(max(0.0, taken_at + unacked_s - time.monotonic()))
        send_upscale(app, store, held)
        with app.connection_for_read() as connection, connection.SimpleQueue(queue, no_ack=False) as live:
            taken = live.get_nowait()  # a live consumer's, just taken
            try:
                assert taken.decode()[0] == [held.id]
                look()  # `dead`'s taken `unacked_s` ago: not held, a first look
                time.sleep(GRACE_S)
                look()  # and a second, its grace later: sent again, at the front
                assert next_job_ids(app, [queue], limit=10) == [dead.id]
            finally:
                taken.ack()
    resent = [record for record in caplog.records if "sent again" in record.getMessage()]
    assert [record.job_id for record in resent] == [dead.id]
    for tag, raw in redis_client.hgetall("unacked").items():  # the dead consumer's: kept for hours otherwise
        if dead.id.encode() in raw:
            redis_client.hdel("unacked", tag), redis_client.zrem("unacked_index", tag)
    redis_client.delete(*redis_client.keys(f"{queue}*"), *redis_client.keys(f"{store.prefix}:*"))


def test_a_backlog_of_cancelled_jobs_ahead_is_dropped_not_taken_for_lost_messages(settings: Settings, redis_client):
    """Jobs cancelled while queued leave their messages (a worker drops them when it gets there): a trial's 2,000
    cancels put them ahead of the live jobs' messages, deeper than the look reads, and the reaper sent 60 of those
    again as lost, with a warning each. The messages of ended jobs in the look's reach are removed, no live job's."""
    store = JobStore(redis_client, result_ttl_s=60, max_attempts=3, prefix=f"vsrq-lost-{secrets.token_hex(4)}")
    app = make_celery(settings)
    queue = f"vsrq.lost-{secrets.token_hex(3)}"

    def queued(n: int) -> list:
        made = [store.create(owner="lost", model="lanczos", queue=queue, params={}, input=InputInfo(key="k"))
                for _ in range(n)]  # fmt: skip
        for job in made:
            send_upscale(app, store, job)
        return made

    cancelled, live = queued(12), queued(3)
    for job in cancelled:
        store.cancel(job.id)
    looks = LostMessages([queue], grace_s=0, depth=5)  # fewer than the cancelled jobs' messages ahead
    try:
        for _ in range(5):
            assert looks.due(store, app) == []  # none taken for lost, on any look
            time.sleep(0.01)
        assert next_job_ids(app, [queue], limit=20) == [job.id for job in live]  # the cancelled ones' messages gone
    finally:
        redis_client.delete(*redis_client.keys(f"{queue}*"), *redis_client.keys(f"{store.prefix}:*"))


@pytest.mark.parametrize("prefix", ["", "vsrq-unacked:"])
def test_a_dead_workers_message_of_an_ended_job_is_dropped_from_unacked(settings: Settings, redis_client, prefix: str):
    """A worker killed mid-job leaves its message in kombu's `unacked` hash, to come back at the visibility timeout
    (13 hours); its job requeued and ended meanwhile, the entry stayed all that time (a soak: one per kill). The
    reaper's sweep removes the entries of ended or deleted jobs of its queues; a running job's stays, as does another
    queue's."""
    store = JobStore(redis_client, result_ttl_s=60, max_attempts=3, prefix=f"vsrq-lost-{secrets.token_hex(4)}")
    app = make_celery(settings.model_copy(update={"broker_transport_options": {"global_keyprefix": prefix}}))
    queue, other = f"vsrq.lost-{secrets.token_hex(3)}", f"vsrq.other-{secrets.token_hex(3)}"
    ended, deleted, running, elsewhere = (
        store.create(owner="lost", model="lanczos", queue=q, params={}, input=InputInfo(key="k"))
        for q in (queue, queue, queue, other)
    )

    def held_by(key: str) -> set[str]:  # the jobs of this test whose message `unacked` (or its index) holds
        found = redis_client.zrange(key, 0, -1) if key.endswith("index") else redis_client.hkeys(key)
        return {tags[tag] for tag in {tag.decode() for tag in found} & set(tags)}

    with app.connection_for_read() as connection, contextlib.ExitStack() as consumers:
        taken = {}  # each message taken by a consumer that never acknowledges it, as a killed worker's
        for job in (ended, deleted, running, elsewhere):
            send_upscale(app, store, job)
            taken[job.id] = consumers.enter_context(connection.SimpleQueue(job.queue, no_ack=False)).get_nowait()
        tags = {message.delivery_tag: job_id for job_id, message in taken.items()}
        try:
            assert held_by(f"{prefix}unacked") == set(taken) == held_by(f"{prefix}unacked_index")
            store.cancel(ended.id)
            store.cancel(deleted.id)
            store.delete(deleted.id)
            store.lease(running.id, "w@host/1", 60)
            assert drop_ended_unacked(app, store, [queue]) == 2  # what the reaper's sweep thread does
            assert held_by(f"{prefix}unacked") == {running.id, elsewhere.id} == held_by(f"{prefix}unacked_index")
        finally:
            for message in taken.values():
                message.ack()
            redis_client.delete(
                *redis_client.keys(f"{store.prefix}:*"), *redis_client.keys(f"{prefix}_kombu.binding.vsrq.*-*")
            )
