"""Load on the API under gunicorn (2 processes x 4 threads, on loopback): 200 creates at once, each a real multipart
upload into SeaweedFS and a Celery message, then 2,000 polls of those jobs, then a cancel of each. Bounded by count
and by time: it stops by itself. No worker runs their model here, so the jobs stay queued until cancelled."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import requests

from .conftest import auth

KEY = "erin"
CREATES, POLLS, POLLERS = 200, 2000, 16


def timed(call: Callable[[], requests.Response]) -> tuple[float, int | str]:
    """(seconds, status or the exception's name) of one request."""
    started = time.perf_counter()
    try:
        status: int | str = call().status_code
    except requests.RequestException as error:
        status = type(error).__name__
    return time.perf_counter() - started, status


def percentile(seconds: list[float], q: float) -> float:
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(name: str, results: list[tuple[float, int | str]], wall: float, ok: int) -> int:
    seconds = [elapsed for elapsed, _ in results]
    kinds = Counter(status for _, status in results if status != ok)
    errors = sum(kinds.values())
    print(
        f"FIGURE load {name}: {len(results)} requests in {wall:.1f} s, {errors} errors {dict(kinds)}, "
        f"p50 {percentile(seconds, 0.5) * 1000:.0f} ms, p99 {percentile(seconds, 0.99) * 1000:.0f} ms, "
        f"max {max(seconds) * 1000:.0f} ms"
    )
    return errors


@pytest.mark.timeout(300)
def test_200_concurrent_creates_and_2000_polls(rel_api, clip):
    url, headers = rel_api.url, auth(KEY)
    files = {"video_reference": ("clip.mp4", clip, "video/mp4")}
    ids: list[str] = []
    start = threading.Barrier(CREATES)

    def create(_: int) -> tuple[float, int | str]:
        start.wait(60)  # all 200 go at once
        started = time.perf_counter()
        try:
            response = requests.post(
                f"{url}/v1/videos", data={"model": "k6-vsr", "seed": "1"}, files=files, headers=headers, timeout=120
            )
        except requests.RequestException as error:
            return time.perf_counter() - started, type(error).__name__
        if response.status_code == 200:
            ids.append(response.json()["id"])  # list.append is atomic under the GIL
        return time.perf_counter() - started, response.status_code

    began = time.monotonic()
    with ThreadPoolExecutor(CREATES) as pool:
        created = list(pool.map(create, range(CREATES)))
    create_errors = report("creates (200 at once)", created, time.monotonic() - began, 200)

    rng = random.Random(6)
    targets = [rng.choice(ids) for _ in range(POLLS)] if ids else []
    clients = threading.local()  # each poller keeps its connection, as a polling client does

    retried: list[str] = []

    def poll(job_id: str) -> tuple[float, int | str]:
        if not hasattr(clients, "session"):
            clients.session = requests.Session()
        get = partial(clients.session.get, f"{url}/v1/videos/{job_id}", headers=headers, timeout=60)
        seconds, status = timed(get)
        if status == "ConnectionError":  # a kept-alive connection the server closed as this GET went out: sent
            # again, as HTTP clients do with an idempotent request (RFC 9112, 9.3.1), so that the figures still come;
            # counted, and a failure: no poll here idles, so no close is due (a paused drain closed some: PacedConn)
            retried.append(job_id)
            again, status = timed(get)
            seconds += again
        return seconds, status

    def cancel(job_id: str) -> tuple[float, int | str]:
        return timed(lambda: requests.post(f"{url}/v1/videos/{job_id}/cancel", headers=headers, timeout=60))

    began = time.monotonic()
    with ThreadPoolExecutor(POLLERS) as pool:
        polled = list(pool.map(poll, targets))
    poll_errors = report(f"polls ({POLLERS} clients)", polled, time.monotonic() - began, 200)
    print(f"FIGURE load polls: {len(retried)} sent again after the server closed their kept-alive connection")

    began = time.monotonic()
    with ThreadPoolExecutor(POLLERS) as pool:
        cancelled = list(pool.map(cancel, ids))
    cancel_errors = report(f"cancels ({POLLERS} clients)", cancelled, time.monotonic() - began, 200)

    assert len(ids) == CREATES and len(set(ids)) == CREATES
    assert (create_errors, poll_errors, cancel_errors) == (0, 0, 0)
    assert not retried, f"{len(retried)} polls met a kept-alive connection the server closed"
