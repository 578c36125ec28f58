"""A URL input that does not fit on the worker's scratch disk: a worker-side problem (`worker_disk_full`), retried,
never blamed on the origin. The disk is a real one that fills up: a 2 MiB tmpfs as the worker's TMPDIR (mounting
needs root, as on CI), while the origin streams far more than that.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.jobs import JobStore
from worker.attempt import classify
from worker.fetch import WorkerDiskFull, fetch

from .test_url_input import ca_bundle, never, origin, submit, url_clip  # noqa: F401 (fixtures)
from .test_worker import celery_worker, wait_for

DISK = "2m"


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("small-disk")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.fixture(scope="module")
def cramped_worker(service_env, redis_client, ca_bundle, small_disk, tmp_path_factory) -> Iterator[Path]:  # noqa: F811
    """The lanczos worker (queue vsrq.cpu) with its scratch directories on the small disk: its log file."""
    redis_client.delete("vsrq.cpu")
    env = {**service_env, "VSRQ_FETCH_CA_BUNDLE": str(ca_bundle[1]), "TMPDIR": str(small_disk)}
    with celery_worker(env, "lanczos", "vsrq.cpu", tmp_path_factory.mktemp("cramped") / "cpu.log") as log:
        yield log


def test_a_full_disk_is_the_workers_problem(origin, settings, ca_bundle, small_disk):  # noqa: F811
    fetch_settings = settings.model_copy(update={"fetch_ca_bundle": ca_bundle[1]})
    with pytest.raises(WorkerDiskFull, match="No space left on device") as error:
        fetch(f"{origin.base}/huge", small_disk / "input", fetch_settings, never)
    assert classify(error.value)[:2] == ("retry", "worker_disk_full")
    (small_disk / "input").unlink()


def test_a_job_whose_input_fills_the_disk_is_retried_then_fails(
    api, origin, cramped_worker, jobs: JobStore, small_disk  # noqa: F811
):
    response = submit(api, video_url=f"{origin.base}/huge")
    assert response.status_code == 200, response.text
    job = wait_for(api, response.json()["id"], cramped_worker, limit_s=120)
    # every attempt ran out of room; none of them was reported as the origin's failure
    assert (job["status"], job["attempt"], job["error"]["code"]) == ("failed", 3, "worker_disk_full"), job
    assert "ran out of disk space" in job["error"]["message"]
    reasons = [event.detail.get("reason") or event.detail.get("last") for event in jobs.events(job["id"])]
    codes = [reason["code"] for reason in reasons if reason]
    assert codes == ["worker_disk_full"] * 3, codes
    assert list(small_disk.iterdir()) == []  # each attempt gave its scratch space back
