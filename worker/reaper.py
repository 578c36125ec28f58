"""The reaper: requeues the jobs whose worker stopped sending heartbeats or is gone from the worker registry
(worker.gone), or fails them after `max_attempts`; sends the message of queued jobs whose sender died before sending
it, sends again the message of queued jobs the broker no longer holds (a consumer killed as it took it: worker.lost),
sweeps blob storage (storage.lifecycle), and relays due webhooks from the outbox to their delivery workers
(worker.webhooks), again before its claim runs out where the worker delivering it is gone (worker.gone).

    python -m worker.reaper            every VSRQ_REAP_INTERVAL_S seconds (default 10), until SIGTERM / SIGINT

One reaper is enough, and more are safe: each requeue is an atomic, fenced script, so a job is requeued once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from time import monotonic

import botocore.exceptions
from celery import Celery

from storage.blobs import refusal
from storage.config import Settings, say_unknown_variables
from storage.jobs import JobStore, Status
from storage.lifecycle import forget_attempts, sweep
from storage.logs import configure, settings_secrets
from storage.overview import lost_message_resent, reaper_passed, storage_problem, sweep_ended
from storage.queue import drop_ended_unacked, send_upscale
from storage.webhooks import Claim, Outbox, relay_once
from worker import service
from worker.celery_app import app
from worker.gone import GoneWorkers, leases
from worker.lost import LostMessages

log = logging.getLogger("vsrq.reaper")


def reap_once(
    jobs: JobStore,
    celery: Celery,
    enqueue_grace_s: float | None = None,
    lost: LostMessages | None = None,
    gone: GoneWorkers | None = None,
) -> dict[str, Status]:
    """One pass: expired leases are requeued (or failed), and so, given `gone` (the looks of earlier passes), are the
    jobs of workers gone from the registry; a requeued job gets a new `vsrq.upscale` message; so does a queued job
    whose message was not confirmed sent within `enqueue_grace_s` (default: the store's) or whose retry's wait is over,
    and, given `lost`, one whose message the broker has not held for its grace."""
    outcome = {job_id: (status, "lease expired") for job_id, status in jobs.reap().items()}
    if gone is not None:
        taken = jobs.take_back_silent(gone.due(leases(jobs), jobs.redis), gone.silent_s)
        outcome |= {job_id: (status, "its worker gone") for job_id, status in taken.items()}
    ended = []  # failed or cancelled with no attempt alive to clean up: their files go once the messages are sent
    for job_id, (status, why) in outcome.items():
        job = jobs.get(job_id)
        if status == Status.QUEUED and job is not None:
            send_upscale(celery, jobs, job, first=True)  # it waited its turn already: first among the queued
        elif job is not None:
            ended.append(job)
        log.info("%s: %s, now %s", job_id, why, status, extra={"job_id": job_id})
    for job in jobs.unsent(enqueue_grace_s):
        # a job attempted before ranks first among the queued (JobStore's queue order): its message goes there too
        send_upscale(celery, jobs, job, first=job.attempt > 0)
        if job.retry_at is not None:  # a retry told to wait (worker.attempt.retry_wait_s), now due
            log.info("%s: its retry's wait is over: sent its message", job.id, extra={"job_id": job.id})
        else:
            log.warning("%s: queued without a message (its sender died): sent one", job.id, extra={"job_id": job.id})
    for job in lost.due(jobs, celery) if lost is not None else ():
        send_upscale(celery, jobs, job, first=True)  # its turn had come when a consumer took it
        lost_message_resent(jobs)
        log.warning(
            "%s: queued, its message held by no queue nor consumer for %g s or more (a dying consumer took it): sent "
            "again", job.id, lost.grace_s, extra={"job_id": job.id},
        )  # fmt: skip
    for job in ended:  # storage that hangs holds the pass here, after every message it had to send
        forget_attempts(service.blobs(), job)
    return {job_id: status for job_id, (status, _) in outcome.items()}


def relay_pass(box: Outbox, celery: Celery, claim_s: float, gone: GoneWorkers | None = None) -> list[Claim]:
    """One pass of the webhook relay: given `gone` (the looks of earlier passes), the attempts of delivery workers gone
    from the registry (and silent for `gone.silent_s`) are due again now, not when their claim runs out; then every due
    event goes out."""
    if gone is not None:
        held = box.held()
        due = set(gone.due(held, box.redis))
        for event_id in box.take_back([holding for holding in held if holding.id in due], gone.silent_s):
            log.warning("%s: its delivery worker is gone: due again now", event_id)
    return relay_once(box, celery, claim_s)


class Outage:
    """One log line when a step starts failing (with its error, no traceback: it is a dependency, not a bug) and one
    when it works again, instead of a traceback on every pass while Redis or storage is down."""

    def __init__(self, step: str) -> None:
        self.step, self.since = step, None

    def failed(self, error: Exception) -> None:
        if self.since is None:
            self.since = monotonic()
            log.error("%s failing: %s: %s (logged again when it recovers)", self.step, type(error).__name__, error)

    def passed(self) -> None:
        if self.since is not None:
            log.warning("%s recovered after %.0f s", self.step, monotonic() - self.since)
            self.since = None


def _wait_for_next_pass(stop: threading.Event, settings: Settings, began: float) -> None:
    """Until the next pass: `reap_interval_s` after this one began, or sooner once a waiting retry (a job's, a
    webhook's) is due, so that it goes out when its `retry_in_s` says, not up to a pass later. Looked for every second
    (one marked meanwhile is found too), and never within a second of the last pass: what is due may not go out (the
    broker down)."""
    latest, earliest = began + settings.reap_interval_s, began + min(1.0, settings.reap_interval_s)
    while not stop.is_set():
        now = monotonic()
        due = _next_due_s() if now >= earliest else earliest - now
        if now >= latest or due <= 0:
            return
        stop.wait(min(latest - now, due, 1.0))


def _next_due_s() -> float:
    """Seconds until the next waiting retry is due: a job's (`JobStore.unsent`) or a webhook's (the outbox)."""
    try:
        return min(service.jobs().next_unsent_s(), service.outbox().next_due_s())
    except Exception:  # Redis down: the pass after the usual interval finds out
        return float("inf")


def main() -> None:
    settings = service.settings()
    configure(settings.log_format, settings.log_level, settings_secrets(settings))
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    log.info("reaping every %g s, sweeping storage every %g s", settings.reap_interval_s, settings.sweep_interval_s)
    say_unknown_variables(log)
    queues = list(dict.fromkeys(settings.models.values()))
    lost = LostMessages(queues, settings.lost_message_grace_s, unacked_s=settings.lost_unacked_s)
    # a worker's entry is rewritten every third of its TTL: half of it is past the beat a live one owes
    gone = GoneWorkers(grace_s=settings.worker_ttl_s / 2, silent_s=settings.worker_ttl_s)
    # the webhooks' attempts, looks of their own; silent for a POST's limit too, so that none is sent twice at once
    gone_hooks = GoneWorkers(grace_s=gone.grace_s, silent_s=max(gone.silent_s, settings.webhook_timeout_s))
    reaping, relaying = Outage("reap"), Outage("webhook relay")
    # on a thread of its own: expiring a day's jobs took a minute, no lease reaped, no message sent meanwhile. Its
    # clients made here first: two threads making boto3's at once may not
    service.jobs(), service.blobs()
    sweeper = threading.Thread(target=_sweep_every, args=(stop, settings, queues), name="storage sweep", daemon=True)
    sweeper.start()
    while not stop.is_set():
        began = monotonic()
        try:
            reap_once(service.jobs(), app, lost=lost, gone=gone)
            reaper_passed(service.jobs())  # /healthz and `vsrq status` tell a dead reaper by this
            reaping.passed()
        except Exception as error:  # Redis restarting: try again next time rather than exit
            reaping.failed(error)
        try:
            relay_pass(service.outbox(), app, settings.webhook_claim_s, gone_hooks)
            relaying.passed()
        except Exception as error:  # Redis or the broker down: the events wait in the outbox for the next pass
            relaying.failed(error)
        _wait_for_next_pass(stop, settings, began)
    sweeper.join(settings.reap_interval_s)  # a sweep stops at its next record or batch of blobs, else ends with us


def _sweep_every(stop: threading.Event, settings: Settings, queues: list[str]) -> None:
    """Sweeps blob storage every `sweep_interval_s`, the first time at once, until `stop`; and kombu's `unacked` of
    the messages of ended jobs (there for 13 hours otherwise), off the passes' path: a broker down stalls no pass."""
    sweeping, unacked = Outage("storage sweep"), Outage("the look at unacked messages")
    while not stop.is_set():
        began = monotonic()
        try:
            drop_ended_unacked(app, service.jobs(), queues)
            unacked.passed()
        except Exception as error:  # the broker or Redis down: the next sweep tries again
            unacked.failed(error)
        try:
            sweep(service.jobs(), service.blobs(), settings, stop)
            sweeping.passed()
            sweep_ended(service.jobs(), None)
        except Exception as error:  # storage or Redis down: the next sweep catches up
            sweeping.failed(error)
            # a refusal stays until someone mends it: said in health (an outage is said there as one already)
            if isinstance(error, botocore.exceptions.ClientError) and refusal(error):
                with contextlib.suppress(Exception):  # Redis down too: /healthz says that
                    sweep_ended(service.jobs(), storage_problem(error))
        stop.wait(max(0.0, began + settings.sweep_interval_s - monotonic()))


if __name__ == "__main__":
    main()
