"""Prometheus metrics of one Celery worker process, served on its own port (`VSRQ_METRICS_PORT`, 0 = off; one port
per worker: a solo worker is one process, so the process's registry is the worker's). worker/signals.py feeds them.

Job timings are read back from the job's events (storage.jobs), which carry Redis's clock: the stage durations and
the queued→end latency are the ones the job record shows, whichever host wrote each event.

No torch at import: the webhook worker counts its deliveries here too, and loads no model.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from storage.jobs import TERMINAL, JobEvent, JobStore

if TYPE_CHECKING:
    from worker.upscale import Result  # the engine, torch: not for the webhook worker

# GPU jobs run from seconds to hours
_JOB_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 43200)
_ENDS = frozenset({"completed", "failed", "cancelled", "requeued"})

JOB_SECONDS = Histogram(
    "vsrq_job_duration_seconds",
    "Jobs from creation (queued) to their end, observed by the worker whose attempt ended them.",
    ["queue", "status"],
    buckets=_JOB_BUCKETS,
)
STAGE_SECONDS = Histogram(
    "vsrq_job_stage_duration_seconds",
    "Time one attempt spent in each stage; 'queued' is its wait for this worker's lease.",
    ["queue", "stage"],
    buckets=_JOB_BUCKETS,
)
ATTEMPTS = Counter(
    "vsrq_worker_attempts_total",
    "Attempts this worker ran, by how they ended: completed, failed, cancelled, requeued (retry or reaped), lost.",
    ["queue", "outcome"],
)
ENGINE_SECONDS = Histogram(
    "vsrq_worker_engine_seconds",
    "The upscaler's own seconds per attempt (its calls over the computed windows); the rest of an attempt is the "
    "service's overhead: fetch, probe, MP4 tail, verify, upload.",
    buckets=_JOB_BUCKETS,
)
INPUT_PREFETCH = Counter(
    "vsrq_worker_input_prefetch_total",
    "Jobs whose input was looked up in the prefetch cache (worker.prefetch), by outcome: hit (the job used the copy "
    "downloaded while the previous job ran), stale (a copy of a blob since written again or deleted: not used), miss.",
    ["outcome"],
)
TILES = Counter("vsrq_worker_tiles_total", "Tiles upscaled (tiles per window x windows computed, not restored).")
FRAMES = Counter("vsrq_worker_output_frames_total", "Frames in verified outputs.")
TILES_PER_SECOND = Gauge(
    "vsrq_worker_tiles_per_second", "Tiles per second of the last job, end to end (rate() of the _total averages)."
)
FRAMES_PER_SECOND = Gauge("vsrq_worker_output_frames_per_second", "Output frames per second of the last job.")
GPU_MEMORY_PEAK = Gauge(
    "vsrq_gpu_memory_peak_bytes",
    "Peak memory PyTorch's allocator reserved during the last job, per CUDA device (absent on the CPU).",
    ["device"],
)
GPU_MEMORY_RESERVED = Gauge(
    "vsrq_gpu_memory_reserved_bytes",
    "Memory PyTorch's allocator holds after the last job, per CUDA device: a value that keeps growing over jobs of "
    "shapes seen before is a leak.",
    ["device"],
)
COMPILED_GRAPHS = Gauge(
    "vsrq_worker_compiled_graphs",
    "Graphs Dynamo has built in this process (warmup included): a rise after a job of a shape seen before is a "
    "rebuild, one after a new shape is its first job's compile.",
)
PINNED_HOST = Gauge(
    "vsrq_pinned_host_bytes",
    "Pinned host memory PyTorch's host allocator owns (in use and cached) after the last job (GPU workers).",
)
THREADS = Gauge("vsrq_worker_threads", "Python threads alive in the worker process.")
THREADS.set_function(threading.active_count)  # read when scraped: an idle worker's count is the one that tells a leak
RESIDENT = Gauge(
    "vsrq_worker_resident_bytes",
    "Host memory resident in the worker process after the last job. prometheus_client's process_ metrics need "
    "/proc/stat's boot time, which some sandboxes do not show; this needs only the process's own /proc entry.",
)
WEBHOOK_DELIVERIES = Counter("vsrq_webhook_deliveries_total", "Webhook deliveries attempted (each retry counts).")
WEBHOOK_FAILURES = Counter("vsrq_webhook_delivery_failures_total", "Webhook deliveries that did not get a 2xx.")


def serve(host: str, port: int) -> None:
    """/metrics on host:port, from a daemon thread."""
    start_http_server(port, addr=host)


def record_upscale(result: Result) -> None:
    tiles = result.tiles * (result.windows - result.restored)
    TILES.inc(tiles)
    FRAMES.inc(result.written.video.frames)
    ENGINE_SECONDS.observe(result.engine_seconds)
    import psutil  # the GPU worker's dependency, not the webhook worker's

    RESIDENT.set(psutil.Process().memory_info().rss)
    dynamo = sys.modules.get("torch._dynamo.utils")  # loaded by a compiling engine; never imported here (seconds)
    if dynamo is not None:
        COMPILED_GRAPHS.set(dynamo.counters["stats"]["unique_graphs"])
    if result.seconds > 0:
        TILES_PER_SECOND.set(tiles / result.seconds)
        FRAMES_PER_SECOND.set(result.written.video.frames / result.seconds)


def observe_attempt(jobs: JobStore, job_id: str, events_before: int) -> None:
    """Stage durations, outcome and (once the job has ended) latency of the attempt this worker just ran;
    `events_before`: how many events the job had when the task started. A dropped message observes nothing."""
    events = jobs.events(job_id)
    job = jobs.get(job_id)
    leased = next((event for event in events[events_before:] if event.type == "leased"), None)
    if leased is None or job is None:
        return
    queue = job.queue
    waited_since = next((e.at for e in reversed(events[:events_before]) if e.type in ("created", "requeued")), None)
    if waited_since is not None:
        STAGE_SECONDS.labels(queue, "queued").observe(leased.at - waited_since)
    timeline: list[JobEvent] = []
    for event in events[events_before:]:
        if event.attempt == leased.attempt and (event.type == "stage" or event.type in _ENDS):
            timeline.append(event)
            if event.type in _ENDS:
                break
    for stage, following in zip(timeline, timeline[1:]):  # a stage lasts until the next stage or the end
        STAGE_SECONDS.labels(queue, stage.detail["stage"]).observe(following.at - stage.at)
    end = timeline[-1] if timeline and timeline[-1].type in _ENDS else None
    ATTEMPTS.labels(queue, end.type if end else "lost").inc()
    if end is not None and end.status in TERMINAL:
        JOB_SECONDS.labels(queue, end.status.value).observe(end.at - job.created_at)


def cuda_devices(devices: list[str]) -> list[str]:
    return [device for device in devices if device.startswith("cuda")]


def reset_gpu_peaks(devices: list[str]) -> None:
    if cuda_devices(devices):
        import torch

        for device in cuda_devices(devices):
            torch.cuda.reset_peak_memory_stats(device)


def record_gpu_peaks(devices: list[str]) -> None:
    if cuda_devices(devices):
        import torch

        for device in cuda_devices(devices):
            GPU_MEMORY_PEAK.labels(device).set(torch.cuda.max_memory_reserved(device))
            GPU_MEMORY_RESERVED.labels(device).set(torch.cuda.memory_reserved(device))
        PINNED_HOST.set(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
