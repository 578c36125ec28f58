"""A real Celery worker (`celery -A worker.tasks worker --pool solo`) against the real stack, driven through the API.

One worker per model, on the model's queue: lanczos (vsrq.cpu) runs most cases, since every path of the task (lease,
download, upscale with heartbeats, upload, fenced promotion, typed failures) is the same as with a checkpoint, in a
fraction of the CPU time; a tiny random checkpoint (vsrq.k6) shows the engine path.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path

import av
import pytest
import redis as redis_py
import requests
import torch
from boto3.exceptions import RetriesExceededError
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from api.schemas import UpscaleParams
from storage.blobs import BlobNotFound, attempt_output_key, new_upload_id, output_prefix, upload_key
from storage.jobs import InputInfo
from storage.queue import UPSCALE_TASK, make_celery, send_upscale
from worker.attempt import classify
from worker.errors import Cancelled, InvalidRequest
from worker.media.errors import InputCorrupt, InputNotFound
from worker.media.synthetic import write_clip
from worker.reaper import reap_once
from worker.scratch import scratch_bytes
from worker.tasks import JOB_PARAMS, job_options
from worker.sr.checkpoint import write_tiny

from .conftest import ROOT, UNREADABLE, WORKER_THREADS, auth, broker_messages, vsrq

TERMINAL = ("completed", "failed", "cancelled")


@contextmanager
def celery_worker(env: dict[str, str], model: str, queue: str, log: Path, name: str | None = None) -> Iterator[Path]:
    """A solo worker of `model` on `queue`, as the Procfile runs one (named `name`, else uniquely): its log file."""
    env = {**os.environ, **env, **WORKER_THREADS, "VSRQ_WORKER_MODEL": model, "VSRQ_WORKER_DEVICES": "cpu"}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "--pool", "solo", "--concurrency", "1",
             "-Q", queue, "-n", name or f"test-{secrets.token_hex(3)}@localhost",
             "--without-gossip", "--without-mingle", "--loglevel", "info"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield log
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture(scope="module")
def worker(service_env, redis_client, tmp_path_factory) -> Iterator[Path]:
    """The lanczos model's worker (queue vsrq.cpu): its log file."""
    redis_client.delete("vsrq.cpu")  # messages other tests left for jobs they only inspected
    with celery_worker(service_env, "lanczos", "vsrq.cpu", tmp_path_factory.mktemp("worker") / "cpu.log") as log:
        yield log


@pytest.fixture(scope="module")
def k6_worker(service_env, redis_client, tmp_path_factory) -> Iterator[Path]:
    """The k6-vsr model's worker (queue vsrq.k6), on a tiny random checkpoint in the real format: its log file."""
    redis_client.delete("vsrq.k6")
    checkpoint = write_tiny(tmp_path_factory.mktemp("tiny-k6"))
    with celery_worker(service_env, str(checkpoint), "vsrq.k6", checkpoint.parent / "k6.log") as log:
        yield log


@pytest.fixture(scope="module")
def stereo_clip(tmp_path_factory) -> bytes:
    """17 frames of 96x64 H.264 with stereo AAC."""
    path = tmp_path_factory.mktemp("stereo") / "stereo.mp4"
    return write_clip(path, 17, (64, 96), audio_codec="aac").read_bytes()


def create(api: str, clip: bytes, model: str = "lanczos", **fields) -> dict:
    data = {"prompt": "upscale", "model": model, "sr_resolution_scale": "2", "seed": "3", **fields}
    files = {"video_reference": ("clip.mp4", clip, "video/mp4")}
    response = requests.post(f"{api}/v1/videos", data=data, files=files, headers=auth("dave"), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def get(api: str, job_id: str) -> dict:
    response = requests.get(f"{api}/v1/videos/{job_id}", headers=auth("dave"), timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for(api: str, job_id: str, log: Path, until=lambda job: job["status"] in TERMINAL, limit_s: float = 60):
    deadline = time.monotonic() + limit_s
    while not until(job := get(api, job_id)):
        assert time.monotonic() < deadline, f"job stuck at {job}; worker log:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)
    return job


def test_the_worker_reads_every_param_the_api_takes():
    """A param the API takes and the worker does not read would be dropped unsaid: JOB_PARAMS is what a job's `asks`
    is checked against (a rolling deploy's older worker gives such a job back)."""
    assert JOB_PARAMS == set(UpscaleParams.model_fields)
    read: set[str] = set()

    class Recorded(dict):
        def __getitem__(self, name: str):
            read.add(name)
            return super().__getitem__(name)

        def get(self, name: str, default=None):
            read.add(name)
            return super().get(name, default)

    job_options(Recorded(UpscaleParams(sr_target_resolution="hd").model_dump()))
    assert read == JOB_PARAMS


def test_a_job_runs_end_to_end(api, worker, stereo_clip, jobs, s3, tmp_path):
    job = wait_for(api, create(api, stereo_clip)["id"], worker)
    assert (job["status"], job["progress"], job["error"], job["attempt"]) == ("completed", 100, None, 1), job
    assert job["size"] == "192x128" and job["input"]["media"]["audio"]

    response = requests.get(f"{api}/v1/videos/{job['id']}/content", headers=auth("dave"), timeout=30)
    assert response.status_code == 200
    assert hashlib.sha256(response.content).hexdigest() == job["output"]["sha256"]
    assert len(response.content) == job["output"]["bytes"]
    (tmp_path / "out.mp4").write_bytes(response.content)
    with av.open(str(tmp_path / "out.mp4")) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert (video.width, video.height, audio.codec_context.channels) == (192, 128, 2)
        assert sum(1 for _ in container.decode(video=0)) == 17
    # promoted from the first attempt's key; the heartbeats went through the stages in order (a job this short may
    # end its only window before a throttled "upscaling" beat is due)
    assert re.fullmatch(rf"{output_prefix(job['id'])}attempt-1-[0-9a-f]{{16}}\.mp4", jobs.require(job["id"]).output.key)
    stages = [event.detail["stage"] for event in jobs.events(job["id"]) if event.type == "stage"]
    assert [stage for stage in stages if stage != "upscaling"] == ["probing", "encoding", "uploading"], stages
    # the attempt's engine seconds, beside its probe-to-verified-file seconds: what the service bench's overhead is
    [run] = [event.detail for event in jobs.events(job["id"]) if event.type == "run"]
    assert 0 < run["engine_s"] < run["upscale_s"] and (run["windows"], run["restored"]) == (1, 0), run


def test_a_jobs_events_tell_its_owner_what_happened_and_nobody_else(api, worker, stereo_clip, service_env):
    """GET /v1/videos/{id}/events: the job's moves and stages oldest first, the create's request id on `created`; an
    attempt's timings and its worker's name are the operator's (`vsrq events`, from Redis); another key's GET finds
    no such job."""
    request_id = f"events-{secrets.token_hex(4)}"
    files = {"video_reference": ("clip.mp4", stereo_clip, "video/mp4")}
    data = {"model": "lanczos", "sr_resolution_scale": "2"}
    headers = {**auth("dave"), "X-Request-Id": request_id}
    created = requests.post(f"{api}/v1/videos", data=data, files=files, headers=headers, timeout=30)
    assert created.status_code == 200, created.text
    job = wait_for(api, created.json()["id"], worker)
    assert job["status"] == "completed", job

    answer = requests.get(f"{api}/v1/videos/{job['id']}/events", headers=auth("dave"), timeout=10)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    events = body["data"]
    assert body["object"] == "list" and {event["object"] for event in events} == {"video.event"}
    assert [event["type"] for event in events if event["type"] != "stage"] == ["created", "leased", "completed"]
    stages = [event["stage"] for event in events if event["type"] == "stage"]
    assert [stage for stage in stages if stage != "upscaling"] == ["probing", "encoding", "uploading"], stages
    assert events[0]["request_id"] == request_id and events[0]["status"] == "queued"
    assert (events[-1]["status"], events[-1]["attempt"]) == ("completed", 1)
    assert [event["at"] for event in events] == sorted(event["at"] for event in events)
    assert abs(job["created_at"] - events[0]["at"]) < 1 and abs(job["completed_at"] - events[-1]["at"]) < 1
    assert "worker" not in answer.text and "engine_s" not in answer.text

    other = requests.get(f"{api}/v1/videos/{job['id']}/events", headers=auth("erin"), timeout=10)
    assert other.status_code == 404 and other.json()["code"] == "job_not_found", other.text

    stored = vsrq(service_env, "events", job["id"], "--json")
    assert stored.returncode == 0, stored.stderr
    history = json.loads(stored.stdout)
    [run] = [event for event in history if event["type"] == "run"]
    assert run["detail"]["engine_s"] > 0 and len(history) == len(events) + 1
    [leased] = [event for event in history if event["type"] == "leased"]
    text = vsrq(service_env, "events", job["id"])
    assert text.returncode == 0 and text.stdout.startswith(f"{job['id']}  owner "), text.stderr
    assert leased["detail"]["worker"] in text.stdout
    missing = vsrq(service_env, "events", "video_" + "0" * 24)
    assert missing.returncode == 2 and missing.stderr.startswith("vsrq: job_not_found: "), missing.stderr


def test_the_checkpoint_worker_runs_its_model(api, k6_worker, tmp_path):
    clip = write_clip(tmp_path / "small.mp4", 9, (32, 48), audio_codec="aac").read_bytes()
    job = wait_for(api, create(api, clip, model="k6-vsr")["id"], k6_worker, limit_s=120)
    assert (job["status"], job["progress"], job["size"]) == ("completed", 100, "96x64"), job
    assert job["output"]["media"]["frames"] == 9 and job["output"]["media"]["audio"]
    # what ran, as the job reports it: the checkpoint by its name, and the pi-Flow checkpoint's own 2 steps per tile
    assert job["output"]["model"].startswith("tiny-k6") and job["output"]["num_inference_steps"] == 2, job["output"]
    assert (job["params"]["quality"], job["output"]["quality"], job["output"]["quality_levers"]) == ("lossless", "lossless", {})
    # the faster tier, asked for by name, runs its levers and says how (on a CPU the FP8 attention is emulated)
    high = wait_for(api, create(api, clip, model="k6-vsr", quality="high")["id"], k6_worker, limit_s=120)
    assert (high["status"], high["params"]["quality"], high["output"]["quality"]) == ("completed", "high", "high"), high
    assert high["output"]["quality_levers"] == {"fp8_linear": "scaled_mm_rowwise", "fp8_attention": "fp8_emulated"}
    assert high["output"]["sha256"] != job["output"]["sha256"]
    # the checkpoint was loaded once, when the worker started, not per job
    assert len(re.findall(r"loading \S*tiny-k6\S* on cpu", k6_worker.read_text())) == 1


def test_high_quality_on_lanczos_runs_and_says_lossless(api, worker, clip):
    """Lanczos has no faster path: `high` is accepted (a client may send it for every model) and the job says what ran."""
    job = wait_for(api, create(api, clip, quality="high")["id"], worker)
    assert (job["status"], job["params"]["quality"], job["output"]["quality"]) == ("completed", "high", "lossless"), job


def test_an_interlaced_upload_at_the_field_rate_comes_back_with_a_frame_per_field(api, worker, tmp_path):
    """`deinterlace=field` through the API, on 25 frames a second of interlaced H.264 with its sound: 50 progressive
    frames a second over the same time, the sound kept, and the job's notes say so."""
    clip = write_clip(tmp_path / "in.mp4", 13, (64, 96), Fraction(25), audio_codec="aac",
                      video_options={"x264-params": "interlaced=1:tff=1"})  # fmt: skip
    job = wait_for(api, create(api, clip.read_bytes(), deinterlace="field")["id"], worker)
    assert (job["status"], job["params"]["deinterlace"]) == ("completed", "field"), job
    source, output = job["input"]["media"], job["output"]["media"]
    assert (source["frames"], source["fps"], output["frames"], output["fps"]) == (13, 25.0, 26, 50.0), job
    assert output["duration"] == pytest.approx(source["duration"], abs=1e-3) and output["audio"]
    [note] = [note for note in job["output"]["notes"] if "interlaced" in note]  # the job says what it did
    assert "one frame for each field" in note and "25 frames/s in, 50 out" in note, note


def test_a_film_upload_telecined_to_ntsc_comes_back_at_the_film_rate(api, worker, tmp_path):
    """`deinterlace=film` through the API, on 25 frames of 29.97i H.264 with sound: inverse telecine keeps four of every
    five, 20 frames at 23.976 over the same time, the sound kept, and the job's notes say so (the pictures' own
    fields put back together: tests/test_deinterlace.py)."""
    clip = write_clip(tmp_path / "in.mp4", 25, (64, 96), Fraction(30000, 1001), audio_codec="aac",
                      video_options={"x264-params": "interlaced=1:tff=1"})  # fmt: skip
    job = wait_for(api, create(api, clip.read_bytes(), deinterlace="film")["id"], worker)
    assert (job["status"], job["params"]["deinterlace"]) == ("completed", "film"), job
    source, output = job["input"]["media"], job["output"]["media"]
    assert (source["frames"], output["frames"]) == (25, 20), job
    assert (source["fps"], output["fps"]) == (pytest.approx(29.97, abs=1e-3), pytest.approx(23.976, abs=1e-3)), job
    assert output["duration"] == pytest.approx(source["duration"], abs=1e-3) and output["audio"]
    [note] = [note for note in job["output"]["notes"] if "telecine" in note]
    assert "25 frames in, 20 out (29.97 frames/s in, 23.976 out)" in note, note


def test_cancel_stops_a_running_job(api, worker, jobs, s3, tmp_path):
    # long enough (lanczos over 241 frames, two windows) to be caught while it runs
    clip = write_clip(tmp_path / "long.mp4", 241, (128, 192), crf=30).read_bytes()
    job_id = create(api, clip)["id"]
    running = wait_for(api, job_id, worker, until=lambda job: job["stage"] == "upscaling" or job["status"] in TERMINAL)
    # what the input is, known from the probe on: it was said only as the output was uploaded
    assert (running["input"]["media"]["frames"], running["size"], running["seconds"]) == (241, "384x256", "10.0417")
    response = requests.post(f"{api}/v1/videos/{job_id}/cancel", headers=auth("dave"), timeout=10)
    assert response.status_code == 200, response.text
    job = wait_for(api, job_id, worker)
    assert (job["status"], job["output"]) == ("cancelled", None), job
    # stopped between frames, not at the end: it never finished upscaling, never uploaded
    stages = [event.detail["stage"] for event in jobs.events(job_id) if event.type == "stage"]
    assert "upscaling" in stages and "encoding" not in stages and "uploading" not in stages, stages
    assert list(s3.keys(output_prefix(job_id))) == []
    # the worker's log says so in a line, without a traceback: a cancel is no fault to diagnose
    said = [line for line in worker.read_text().splitlines() if f"{job_id} attempt 1: cancelled" in line]
    assert said and not any("Traceback" in line for line in said), said


def test_a_create_that_prefers_to_wait_answers_with_its_finished_job(api, worker, stereo_clip):
    """Replicate's `Prefer: wait`: a short clip's job comes back finished in the request that sent it, its output there
    to download, no polling; so does a failed one, with its error."""
    files = {"video_reference": ("clip.mp4", stereo_clip, "video/mp4")}
    data = {"model": "lanczos", "sr_resolution_scale": "2"}
    response = requests.post(f"{api}/v1/videos", data=data, files=files, headers=auth("dave") | {"Prefer": "wait"},
                             timeout=90)  # fmt: skip
    job = response.json()
    assert (response.status_code, job["status"]) == (200, "completed"), (job, worker.read_text()[-3000:])
    assert response.headers["Preference-Applied"] == "wait=60" and "openai-poll-after-ms" not in response.headers
    content = requests.get(f"{api}/v1/videos/{job['id']}/content", headers=auth("dave"), timeout=30)
    assert content.status_code == 200 and content.content[4:8] == b"ftyp"
    assert len(content.content) == job["output"]["bytes"]
    files = {"video_reference": ("clip.mp4", UNREADABLE, "video/mp4")}
    response = requests.post(f"{api}/v1/videos", data=data, files=files, headers=auth("dave") | {"Prefer": "wait=30"},
                             timeout=60)  # fmt: skip
    assert (response.json()["status"], response.json()["error"]["code"]) == ("failed", "input_unreadable")
    # a poll that prefers to wait answers once the job has ended, in one request
    job = create(api, stereo_clip)
    response = requests.get(f"{api}/v1/videos/{job['id']}", headers=auth("dave") | {"Prefer": "wait=60"}, timeout=90)
    assert (response.json()["status"], response.headers["Preference-Applied"]) == ("completed", "wait=60")


def test_a_corrupt_upload_fails_with_an_input_code_and_the_worker_goes_on(api, worker, stereo_clip):
    job = wait_for(api, create(api, UNREADABLE)["id"], worker)
    assert job["status"] == "failed" and job["error"]["code"] == "input_unreadable", job
    assert "Traceback" not in job["error"]["message"]
    # refused after its probe: what was read is said beside why (it was null, the message naming the size)
    exact = {"sr_target_resolution": "4000x4000", "sr_target_resize_mode": "exact"}
    job = wait_for(api, create(api, stereo_clip, **exact)["id"], worker)
    assert (job["status"], job["error"]["code"]) == ("failed", "invalid_request"), job
    assert job["input"]["media"] is not None and job["seconds"] is not None, job
    assert wait_for(api, create(api, stereo_clip)["id"], worker)["status"] == "completed"


def test_a_duplicate_delivery_runs_once(api, worker, settings, jobs, s3, stereo_clip):
    # A job whose message is delivered twice (as a broker may after a lost ack), then another job behind both: the
    # worker takes messages in order, so once the second job is done, both deliveries of the first have been handled.
    key = upload_key("dave", new_upload_id())
    stored = s3.put(key, io.BytesIO(stereo_clip))
    params = UpscaleParams(sr_resolution_scale=2).model_dump()
    job = jobs.create(
        owner="dave", model="lanczos", queue="vsrq.cpu", params=params, input=InputInfo(key=key, bytes=stored.size)
    )
    celery = make_celery(settings)
    send_upscale(celery, jobs, job)
    send_upscale(celery, jobs, job)
    behind = create(api, stereo_clip)
    assert wait_for(api, behind["id"], worker)["status"] == "completed"

    done = jobs.require(job.id)
    assert (done.status, done.attempt) == ("completed", 1)
    assert [event.type for event in jobs.events(job.id)].count("leased") == 1
    assert sorted(s3.keys(output_prefix(job.id))) == sorted(done.output.keys())  # the video and its two JPEGs
    assert "dropped a message for " + job.id in worker.read_text()


def test_the_reaper_requeues_an_expired_lease_and_resends_its_task(settings, jobs, redis_client):
    queue = f"vsrq.reaper-{secrets.token_hex(3)}"  # no worker listens here: the message stays to be read
    job = jobs.create(
        owner="dave", model="lanczos", queue=queue, params={}, input=InputInfo(key="uploads/dave/none", bytes=0)
    )
    jobs.lease(job.id, "a-worker-that-died", lease_s=1)
    time.sleep(1.2)
    assert reap_once(jobs, make_celery(settings)).get(job.id) == "queued"
    assert jobs.require(job.id).status == "queued"
    assert [m["args"] for m in broker_messages(redis_client, queue) if m["task"] == UPSCALE_TASK] == [[job.id]]
    # its owner is told why the attempt ended and another will run
    *_, leased, requeued = jobs.event_views(job.id).data
    assert (leased.type, leased.attempt, requeued.type, requeued.status) == ("leased", 1, "requeued", "queued")
    assert requeued.reason.code == "lease_expired" and requeued.at - leased.at >= 1
    assert "a-worker-that-died" not in requeued.model_dump_json()  # the operator's (`vsrq events`), not the owner's


def test_errors_are_classified_by_whether_another_attempt_could_succeed():
    assert classify(Cancelled("stop")) == ("cancelled", "cancelled", "stop")
    assert classify(InputCorrupt("cut short")) == ("failed", "input_corrupt", "cut short")
    assert classify(InvalidRequest("bad scale"))[:2] == ("failed", "invalid_request")
    assert classify(InputNotFound("gone"))[:2] == ("failed", "input_not_found")  # the input itself: final
    assert classify(BlobNotFound("work/x"))[:2] == ("retry", "job_file_missing")  # any other file: try again
    assert classify(torch.cuda.OutOfMemoryError("CUDA out of memory"))[:2] == ("retry", "gpu_oom")
    assert classify(redis_py.ConnectionError("refused"))[:2] == ("retry", "redis_unavailable")
    assert classify(EndpointConnectionError(endpoint_url="http://s3"))[:2] == ("retry", "storage_unavailable")
    stalled = RetriesExceededError(ReadTimeoutError(endpoint_url="http://s3"))  # a download's body, on every try
    assert classify(stalled)[:2] == ("retry", "storage_unavailable")
    outcome, code, message = classify(KeyError("sr_resolution_scale"))
    assert (outcome, code) == ("failed", "internal_error") and "sr_resolution_scale" not in message
    # a full scratch disk anywhere in the attempt (a kept window, the MP4), not only the input's download: retried
    with pytest.raises(OSError) as full, open("/dev/full", "wb", buffering=0) as disk:
        disk.write(b"frame")
    assert classify(full.value)[:2] == ("retry", "worker_disk_full")
    assert classify(PermissionError(13, "denied"))[:2] == ("failed", "internal_error")


@pytest.mark.parametrize(
    "status, code, operation, outcome",
    [
        (400, "400", "PutObject", "retry"),  # no S3 error document: the upload reached storage damaged (no head)
        (400, "400", "UploadPart", "retry"),
        (400, "400", "CompleteMultipartUpload", "retry"),
        (400, "IncompleteBody", "PutObject", "retry"),  # AWS: a body shorter than its Content-Length
        (400, "BadRequest", "UploadPart", "retry"),
        (499, "ClientDisconnected", "PutObject", "retry"),  # SeaweedFS: the same
        (400, "RequestTimeout", "PutObject", "retry"),  # the body stalled on its way
        (400, "BadDigest", "PutObject", "retry"),
        (400, "XAmzContentSHA256Mismatch", "PutObject", "retry"),
        (408, "408", "PutObject", "retry"),
        (409, "OperationAborted", "PutObject", "retry"),  # "a conflicting operation is in progress: try again"
        (429, "429", "PutObject", "retry"),
        (503, "SlowDown", "HeadObject", "retry"),
        (500, "InternalError", "GetObject", "retry"),
        (400, "400", "HeadObject", "failed"),  # a request without a body: a bare 400 is a refusal (the wrong region)
        (400, "BadRequest", "GetObject", "failed"),
        (400, "IncompleteBody", "ListObjectsV2", "failed"),
        (403, "AccessDenied", "PutObject", "failed"),  # what another try gets the same answer to
        (403, "InvalidAccessKeyId", "PutObject", "failed"),
        (403, "SignatureDoesNotMatch", "PutObject", "failed"),
        (404, "NoSuchBucket", "PutObject", "failed"),
        (400, "InvalidArgument", "PutObject", "failed"),
        (400, "EntityTooLarge", "PutObject", "failed"),
    ],
)
def test_storage_answers_are_retried_unless_another_try_gets_the_same(status, code, operation, outcome):
    """As botocore raises them (a ClientError from the parsed S3 answer): a damaged upload, a timed-out or throttled
    request is tried again, a refusal (a damaged-looking answer to a request without a body among them) is final."""
    answer = {"Error": {"Code": code, "Message": ""}, "ResponseMetadata": {"HTTPStatusCode": status}}
    error = ClientError(answer, operation)
    expected = (outcome, "storage_unavailable") if outcome == "retry" else (outcome, "internal_error")
    assert classify(error)[:2] == expected


@pytest.mark.parametrize("completed", [True, False])
def test_an_attempt_that_lost_its_job_keeps_its_output_only_if_the_job_is_its(
    jobs, s3, monkeypatch, caplog, completed
):
    """A `complete` that went through with its reply lost (a timeout) ends the attempt as a retry: it finds the job
    completed by itself and must not delete the output the job points at. An attempt reaped meanwhile deletes it."""
    from storage.jobs import OutputInfo
    from worker import service
    from worker.attempt import end

    monkeypatch.setattr(service, "jobs", lambda: jobs)  # the real stores of the test stack
    monkeypatch.setattr(service, "blobs", lambda: s3)
    job = jobs.create(owner="dave", model="lanczos", queue="vsrq.end", params={}, input=InputInfo(key="k", bytes=0))
    lease = jobs.lease(job.id, "w", lease_s=1)
    key = attempt_output_key(job.id, lease.attempt, lease.token)
    stored = s3.put(key, io.BytesIO(b"an mp4"))
    if completed:
        lease.complete(OutputInfo(key=key, bytes=stored.size, sha256=stored.sha256))
    else:  # its lease expired meanwhile: requeued for another attempt
        time.sleep(1.2)
        assert jobs.reap() == {job.id: "queued"}
    caplog.set_level(logging.INFO, logger="vsrq.worker")
    cause = redis_py.TimeoutError("the reply to complete never came")
    end(job, lease, key, cause)
    assert s3.exists(key) is completed
    # the retry's line carries its cause: a retry that keeps coming back is diagnosed from the worker's log
    [line] = [record for record in caplog.records if "retry (redis_unavailable)" in record.getMessage()]
    assert line.exc_info[1] is cause


@pytest.mark.parametrize("container", ["mp4", "mkv"])  # Matroska states no frame count: counted from its duration
def test_a_prefetch_leaves_room_for_every_upscaled_frame_of_the_running_job(tmp_path, container):
    """The room a prefetch leaves the running job (worker.prefetch): at least its upscaled frames as raw RGB, what its
    kept windows and the encoder's input take on the scratch disk, plus its MP4."""
    source = write_clip(tmp_path / f"clip.{container}", 41, (64, 96))
    with av.open(str(source)) as clip:
        frames = [frame for frame in clip.decode(video=0)]
    width, height = frames[0].width, frames[0].height
    needed = len(frames) * (2 * width) * (2 * height) * 3
    assert needed <= scratch_bytes(source, 2) <= 1.2 * needed + 4 * source.stat().st_size


def test_the_scratch_estimate_covers_the_kept_windows_and_their_overlap_tails(tmp_path):
    """A job of three windows, upscaled as the worker does (its local window store: the blob store's peak is the same
    files, its last window's frames written before they are dropped at its commit) with the MP4 beside them: the
    estimate covers them, the float overlap tails (64 raw frames' worth each) among them."""
    from worker.sr.lanczos import LanczosUpscaler
    from worker.sr.request import SRRequest
    from worker.sr.windows import DirectoryWindowStore, plan_windows
    from worker.upscale import UpscaleOptions, upscale_file

    source = write_clip(tmp_path / "clip.mp4", 250, (48, 64))
    options = UpscaleOptions(request=SRRequest(scale=2))
    assert len(plan_windows(250, options.window, options.window_overlap).windows) == 3
    # every tail kept, as the blob store's local copies are until they are up (a folder's own drops them as it goes,
    # two at most: at three windows, the same two)
    store = DirectoryWindowStore(tmp_path / "windows", "job", drop_superseded_tails=False)
    upscale_file(source, tmp_path / "output.mp4", LanczosUpscaler(), options, store=store)
    kept = sum(path.stat().st_size for path in (tmp_path / "windows").iterdir())
    assert {path.suffix for path in (tmp_path / "windows").iterdir()} == {".u8", ".npy", ".json"}
    written = kept + (tmp_path / "output.mp4").stat().st_size
    estimate = scratch_bytes(source, 2, options.window, options.window_overlap)
    assert written <= estimate <= 1.05 * kept + 4 * source.stat().st_size, (written, estimate)
