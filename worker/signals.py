"""A worker process's life around its tasks, through Celery's signals: logging (storage.logs), the job id on every
line logged while a job runs, the worker's entry in the registry (storage.workers) with a heartbeat thread, its
/metrics port and the job metrics (worker.metrics).

Importing this module connects the handlers: worker.tasks does, and so must any other Celery app run as a worker.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from contextvars import Token
from typing import Any

import psutil
import redis.exceptions
from celery.signals import setup_logging, task_postrun, task_prerun, worker_init, worker_ready, worker_shutdown

from storage.clock import redis_now
from storage.jobs import JobStore, Status
from storage.lifecycle import forget_attempts
from storage.logs import configure, current_job, settings_secrets
from storage.queue import UPSCALE_TASK, send_upscale
from storage.webhooks import DELIVER_TASK
from storage.workers import WorkerInfo, WorkerRegistry
from worker import metrics, service, started

log = logging.getLogger("vsrq.worker")


@setup_logging.connect
def configure_logging(loglevel: int | str | None = None, **_: Any) -> None:
    """Connected, so Celery leaves logging to us: its own lines go through the same handler."""
    settings = service.settings()
    configure(settings.log_format, loglevel or settings.log_level, settings_secrets(settings))


@worker_init.connect
def _metrics_port(**_: Any) -> None:
    settings = service.settings()
    if settings.metrics_port:
        metrics.serve(settings.metrics_host, settings.metrics_port)
        log.info("metrics on http://%s:%d/metrics", settings.metrics_host, settings.metrics_port)


@worker_init.connect
def _take_back_what_a_dead_predecessor_held(sender: Any, **_: Any) -> None:
    """A worker started under the name of one that died (`kill -9`, the OOM killer, a container or `vsrq dev`
    restarting it) requeues the jobs that process held, or hands out again the webhooks it was delivering, at once,
    instead of leaving them to their lease (120 s) or claim (120 s): the process is gone, and its pid says so. Never
    while a worker of this name is alive, here or on another host."""
    runs_jobs, delivers = UPSCALE_TASK in sender.app.tasks, DELIVER_TASK in sender.app.tasks
    if not runs_jobs and not delivers:
        return
    configure_logging()  # the first `worker_init` receiver: Celery sets logging up only after them
    name, host, pid, jobs = sender.hostname, socket.gethostname(), os.getpid(), service.jobs()
    try:
        live = WorkerRegistry(jobs.redis, ttl_s=service.settings().worker_ttl_s).get(name)
        if live is not None and (live.host != host or live.pid != pid and psutil.pid_exists(live.pid)):
            log.warning(
                "another worker named %s is alive (pid %d on %s): name each one uniquely", name, live.pid, live.host
            )
            return

        def dead(holder: str) -> bool:  # "{name}/{pid}"; this process's own pid was a predecessor's (a container's)
            holder_name, _, holder_pid = holder.rpartition("/")
            return holder_name == name and (int(holder_pid) == pid or not psutil.pid_exists(int(holder_pid)))

        if runs_jobs:
            _take_back_jobs(sender.app, jobs, dead)
        if delivers:
            box = service.outbox()
            for event_id in box.take_back([held for held in box.held() if dead(held.holder)]):
                log.warning("%s: delivered by this worker's dead predecessor, due again now", event_id)
    except redis.exceptions.RedisError as error:  # the reaper takes them back (worker.gone: the name is another pid's)
        log.warning("could not look for what a dead predecessor held: %s", error)


def _take_back_jobs(app: Any, jobs: JobStore, dead: Callable[[str], bool]) -> None:
    for job_id, status in jobs.take_back(jobs.leased_by(dead)).items():
        if (job := jobs.get(job_id)) is not None and status == Status.QUEUED:
            send_upscale(app, jobs, job, first=True)  # its turn had come
        elif job is not None:  # failed or cancelled: the dead attempt's files go now
            forget_attempts(service.blobs(), job)
        log.warning("%s: held by this worker's dead predecessor, now %s", job_id, status, extra={"job_id": job_id})


class Presence:
    """This worker's registry entry, rewritten on every heartbeat (a third of its TTL) and when a job starts or ends."""

    def __init__(self, info: WorkerInfo) -> None:
        settings = service.settings()
        self.registry = WorkerRegistry(service.jobs().redis, ttl_s=settings.worker_ttl_s)
        self.info = info
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="vsrq-registry", daemon=True)

    def start(self) -> None:
        self.publish()
        self._thread.start()

    def publish(self, **changes: Any) -> None:
        with self._lock:
            self.info = self.info.model_copy(update=changes)
            try:
                self.registry.register(self.info)
            except redis.exceptions.RedisError as error:  # Redis restarting: the next beat writes the entry again
                log.warning("could not update the worker registry: %s", error)
            except Exception:  # never the worker's end: the registry only informs `vsrq status` and the API
                log.warning("could not update the worker registry", exc_info=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.registry.ttl_s / 3):
            self.publish()

    def stop(self) -> None:
        self._stop.set()
        self.registry.remove(self.info.name)


_presence: Presence | None = None
_job_tokens: dict[str, tuple[Token, int | None]] = {}  # task id -> (log context token, events the job had at the start)


@worker_ready.connect
def _register(sender: Any, **_: Any) -> None:
    global _presence
    runs_jobs = UPSCALE_TASK in sender.app.tasks
    devices = service.worker_settings().device_list if runs_jobs else []
    _presence = Presence(
        WorkerInfo(
            name=sender.hostname,
            queues=sorted(queue.name for queue in sender.task_consumer.queues),
            model=service.worker_settings().model if runs_jobs else None,
            served=service.worker_settings().served if runs_jobs else None,
            qualities=list(service.upscaler().qualities) if runs_jobs else None,
            devices=devices,
            gpus=_gpu_names(devices),
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=_redis_now(),
        )
    )
    # Logged before the entry is written: whoever sees the entry finds the line
    log.info("ready, %.1f s after the process started", started.seconds())
    _presence.start()
    # Connected now, after every module's own shutdown handlers (worker.tasks lets its last job's tail end): the entry
    # stays while the process still holds a job, which the reaper would take back once the entry is gone (worker.gone)
    worker_shutdown.connect(_unregister, weak=False)


def _redis_now() -> float:
    """Redis's clock, against which leases are taken (worker.gone compares them); 0 where Redis does not answer now:
    the entry must be written all the same, by its beats once Redis is back, or the reaper takes this live worker for
    gone (0: started before any lease, so never taken for a successor)."""
    try:
        return redis_now(service.jobs().redis)
    except redis.exceptions.RedisError as error:
        log.error("ready, but Redis does not answer (%s): the worker registry entry follows when it does", error)
        return 0.0


def _unregister(**_: Any) -> None:
    if _presence is not None:
        _presence.stop()


def _gpu_names(devices: list[str]) -> list[str]:
    if not metrics.cuda_devices(devices):
        return []
    import torch

    return [torch.cuda.get_device_name(device) for device in metrics.cuda_devices(devices)]


@task_prerun.connect
def _job_started(task_id: str, task: Any, args: tuple = (), **_: Any) -> None:
    if task.name != UPSCALE_TASK or not args:
        return
    job_id = args[0]
    try:
        events_before: int | None = len(service.jobs().events(job_id))
    except redis.exceptions.RedisError as error:  # the task finds the job store out of reach too, and says what next
        log.debug("no metrics for this delivery of %s: %s", job_id, error)
        events_before = None
    _job_tokens[task_id] = (current_job.set(job_id), events_before)
    metrics.reset_gpu_peaks(service.worker_settings().device_list)
    if _presence is not None:
        _presence.publish(job=job_id)


@task_postrun.connect
def _job_ended(task_id: str, task: Any, args: tuple = (), state: str | None = None, **_: Any) -> None:
    if task_id not in _job_tokens:
        return
    token, events_before = _job_tokens.pop(task_id)
    try:
        metrics.record_gpu_peaks(service.worker_settings().device_list)
        # A delivery that could not lease (RETRY) ran no attempt, even where its lost reply did lease the job: the
        # message it sent again runs that attempt and observes it
        if state != "RETRY":
            _observe(args[0], events_before)
    finally:
        if _presence is not None:
            _presence.publish(job=None)
        current_job.reset(token)


def observe_later(task_id: str, job_id: str) -> Callable[[], None]:
    """For an attempt that ends after its task returned (its tail on the finisher's thread, worker.finisher): the
    task's end observes nothing, the tail calls what this returns once the attempt has ended."""
    token, events_before = _job_tokens.get(task_id, (None, None))
    if token is not None:
        _job_tokens[task_id] = (token, None)
    return lambda: _observe(job_id, events_before)


def _observe(job_id: str, events_before: int | None) -> None:
    if events_before is None:
        return
    try:
        metrics.observe_attempt(service.jobs(), job_id, events_before)
    except redis.exceptions.RedisError as error:
        log.warning("could not record the job's metrics: %s", error)
    except Exception:  # metrics must never fail a job, nor the worker
        log.warning("could not record the job's metrics", exc_info=True)
