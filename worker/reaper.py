"""The reaper: requeues the jobs whose worker stopped sending heartbeats (or fails them after `max_attempts`).

    python -m worker.reaper            every VSRQ_REAP_INTERVAL_S seconds (default 10), until SIGTERM / SIGINT

One reaper is enough, and more are safe: each requeue is an atomic, fenced script, so a job is requeued once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from celery import Celery

from storage.jobs import JobStore, Status
from worker import service
from worker.celery_app import app, send_upscale

log = logging.getLogger("vsrq.reaper")


def reap_once(jobs: JobStore, celery: Celery) -> dict[str, Status]:
    """One pass: expired leases are requeued (or failed), and a requeued job gets a new `vsrq.upscale` message."""
    outcome = jobs.reap()
    for job_id, status in outcome.items():
        job = jobs.get(job_id)
        if status == Status.QUEUED and job is not None:
            send_upscale(celery, job_id, job.queue)
        log.info("%s: lease expired, now %s", job_id, status)
    return outcome


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    interval = float(os.environ.get("VSRQ_REAP_INTERVAL_S", "10"))
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    log.info("reaping every %g s", interval)
    while not stop.is_set():
        try:
            reap_once(service.jobs(), app)
        except Exception:  # Redis restarting: try again next time rather than exit
            log.exception("reap failed")
        stop.wait(interval)


if __name__ == "__main__":
    main()
