"""GET /metrics on the API, for Prometheus: request latency by route and status, and the service's state (queue depth,
jobs by status, live workers) computed from Redis at scrape time.

gunicorn runs several worker processes, and a scrape reaches one of them: request latency is therefore kept in
prometheus-client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set up by infra/gunicorn.conf.py), where each
process writes its samples to files in that directory and a scrape sums them all, dead processes included, so
totals never drop when gunicorn restarts a worker. Without that variable (the Flask test client, a single process)
the process's own registry is served. The Redis figures are read once per scrape by whichever process answers it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from time import perf_counter

from flask import Blueprint, Flask, Response, g, request
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from api.services import Services, services
from storage.overview import overview
from storage.workers import WorkerRegistry

blueprint = Blueprint("metrics", __name__)

REQUEST_SECONDS = Histogram(
    "vsrq_http_request_duration_seconds",
    "API requests by route (the URL rule, not the URL: job ids would explode the label set) and status; a streamed "
    "download is timed to its first byte.",
    ["method", "route", "status"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),  # uploads take minutes
)


class ServiceCollector(Collector):
    """Queue depth, jobs by status and live workers, read from Redis when collected."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc

    def collect(self) -> Iterator[Metric]:
        svc = self.svc
        now = overview(
            svc.jobs,
            WorkerRegistry(svc.redis, ttl_s=svc.settings.worker_ttl_s),
            svc.settings.models,
            svc.settings.reaper_stale_s,
        )
        depth = GaugeMetricFamily("vsrq_queue_depth", "Jobs queued, per queue (pipeline group).", labels=["queue"])
        for queue, size in now.queues.items():
            depth.add_metric([queue], size)
        jobs = GaugeMetricFamily("vsrq_jobs", "Job records kept, by status.", labels=["status"])
        for status, count in now.jobs.items():
            jobs.add_metric([status.value], count)
        workers = GaugeMetricFamily("vsrq_workers", "Live workers in the registry, per queue.", labels=["queue"])
        busy = GaugeMetricFamily("vsrq_workers_busy", "Live workers running a job, per queue.", labels=["queue"])
        for queue in sorted({queue for worker in now.workers for queue in worker.queues}):
            serving = [worker for worker in now.workers if queue in worker.queues]
            workers.add_metric([queue], len(serving))
            busy.add_metric([queue], sum(worker.job is not None for worker in serving))
        overdue = GaugeMetricFamily("vsrq_jobs_past_lease", "Jobs in progress past their lease (the reaper is behind).")
        overdue.add_metric([], now.health.overdue_jobs)
        resent = CounterMetricFamily(
            "vsrq_reaper_lost_messages_resent",
            "Queued jobs whose message a dying consumer took, sent again by the reaper (worker/lost.py).",
            value=now.lost_messages_resent,
        )
        yield from (depth, jobs, workers, busy, overdue, resent)
        if now.health.reaper_last_pass_s is not None:
            yield GaugeMetricFamily(
                "vsrq_reaper_last_pass_age_seconds",
                "Seconds since the reaper last finished a pass.",
                value=now.health.reaper_last_pass_s,
            )


@blueprint.get("/metrics")
def metrics() -> Response:
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    state = CollectorRegistry()
    state.register(ServiceCollector(services()))
    # content_type, not mimetype: CONTENT_TYPE_LATEST carries its charset already, and Flask would add a second one
    return Response(generate_latest(registry) + generate_latest(state), content_type=CONTENT_TYPE_LATEST)


def instrument(app: Flask) -> None:
    """Times every request; the route is the matched URL rule ("unmatched" for a 404 that matched none)."""

    @app.before_request
    def _start() -> None:
        g.metrics_started = perf_counter()

    @app.after_request
    def _observe(response: Response) -> Response:
        started = g.pop("metrics_started", None)
        if started is not None and request.endpoint != "metrics.metrics":
            route = request.url_rule.rule if request.url_rule else "unmatched"
            REQUEST_SECONDS.labels(request.method, route, str(response.status_code)).observe(perf_counter() - started)
        return response
