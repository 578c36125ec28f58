"""tests/reliability: the service on a bad day, against the same real processes as tests/service (Redis and SeaweedFS
from infra.stack, the API under gunicorn, a Celery worker), all on loopback.

The API here is the service's, with three more keys that carry limits of their own, and content delivered as a
presigned redirect with a short TTL; its log and the worker's are kept, so that the tests can scan them for secrets.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.service.conftest import (  # noqa: F401  (session fixtures, shared with this directory)
    KEYS,
    MiB,
    UPLOAD_LIMIT,
    clip,
    jobs,
    redis_client,
    s3,
    serve_api,
    service_env,
    settings,
    stack,
)
from tests.service.test_worker import TERMINAL, celery_worker

PRESIGN_TTL_S = 3
# Keys with limits of their own; every other key runs under the service-wide defaults (unlimited).
LIMITED = {
    "ratelimited": {"rate_limit_requests": 5, "rate_limit_window_s": 10},
    "twoslots": {"max_active_jobs": 2},
    "smalluploads": {"max_upload_bytes": 64 * 1024},
    # the clip (48x32, 9 frames) at x2 is 96x64: 6144 pixels a frame, 0.055 megapixel-frames
    "bomber": {"max_output_pixels": 5000},
    "budgeted": {"megapixel_frames_per_hour": 0.06},
}
TOKENS = {**KEYS, **{name: f"sk-test-{name}-{'1' * 16}" for name in LIMITED}}


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


@dataclass(frozen=True)
class Service:
    url: str
    log: Path  # gunicorn's output: its access log and errors


def webhook_secret(name: str) -> str:
    """A well-formed Standard Webhooks secret of the key, fixed so that the logs can be searched for it."""
    return "whsec_" + base64.b64encode(hashlib.sha256(f"secret of {name}".encode()).digest()).decode()


@pytest.fixture(scope="session")
def rel_env(service_env: dict[str, str]) -> dict[str, str]:
    keys = [{"id": name, "token": token, **LIMITED.get(name, {})} for name, token in TOKENS.items()]
    return {
        **service_env,
        "VSRQ_API_KEYS": json.dumps([{**key, "webhook_secret": webhook_secret(key["id"])} for key in keys]),
        "VSRQ_CONTENT_DELIVERY": "redirect",
        "VSRQ_PRESIGN_TTL_S": str(PRESIGN_TTL_S),
        "VSRQ_FETCH_ALLOW_LOOPBACK": "false",  # the SSRF guard as in production
        "VSRQ_WEBHOOK_ALLOW_LOOPBACK": "false",
    }


@pytest.fixture(scope="session")
def rel_api(rel_env: dict[str, str], tmp_path_factory) -> Iterator[Service]:
    log = tmp_path_factory.mktemp("rel-gunicorn") / "gunicorn.log"
    with serve_api(rel_env, log) as url:
        yield Service(url, log)


@pytest.fixture(scope="session")
def cpu_worker(rel_env: dict[str, str], redis_client, tmp_path_factory) -> Iterator[Path]:
    """A lanczos worker on the vsrq.cpu queue (every path of the task, in a fraction of a model's CPU time): its log."""
    redis_client.delete("vsrq.cpu")
    with celery_worker(rel_env, "lanczos", "vsrq.cpu", tmp_path_factory.mktemp("rel-worker") / "cpu.log") as log:
        yield log


def create(url: str, key: str, video: bytes, filename: str = "clip.mp4", **fields: str) -> requests.Response:
    """A multipart create on the lanczos model, as an SGLang client sends it."""
    data = {"model": "lanczos", "sr_resolution_scale": "2", **fields}
    files = {"video_reference": (filename, video, "video/mp4")}
    return requests.post(f"{url}/v1/videos", data=data, files=files, headers=auth(key), timeout=60)


def wait_all(url: str, key: str, job_ids: list[str], worker_log: Path, limit_s: float = 180) -> dict[str, dict]:
    """Polls until every job has ended: id -> its last body."""
    done: dict[str, dict] = {}
    deadline = time.monotonic() + limit_s
    while len(done) < len(job_ids):
        for job_id in set(job_ids) - done.keys():
            job = requests.get(f"{url}/v1/videos/{job_id}", headers=auth(key), timeout=30).json()
            if job["status"] in TERMINAL:
                done[job_id] = job
        assert time.monotonic() < deadline, f"jobs stuck; worker log:\n{worker_log.read_text()[-4000:]}"
        time.sleep(0.2)
    return done


def status_counts(log: Path) -> dict[int, int]:
    """How many responses of each status gunicorn's access log holds."""
    counts: dict[int, int] = {}
    for status in _ACCESS.findall(log.read_text(errors="replace")):
        counts[int(status)] = counts.get(int(status), 0) + 1
    return counts


# gunicorn's access log line: ... "METHOD /path HTTP/1.1" STATUS SIZE "referer" "agent" (quotes escaped when the
# line is the message of a JSON log record)
_ACCESS = re.compile(r'\\?"[A-Z]+ \S+ HTTP/[\d.]+\\?" (\d{3}) ')
