"""The API under gunicorn, with Redis, SeaweedFS and the Celery broker real: what a client sees."""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import gzip
import time
import zlib

import pytest
import requests
from pydantic import SecretStr

from storage.blobs import attempt_output_key, output_prefix
from storage.jobs import OutputInfo
from storage.workers import WorkerInfo, WorkerRegistry

from .conftest import KEYS, ROOT, UPLOAD_LIMIT, MiB, auth, broker_messages

SGLANG_FIELDS = {
    # what an SGLang K6 SR client sends (its multipart create requires a prompt, which SR ignores)
    "prompt": "upscale",
    "sr_resolution_scale": "4",
    "sr_tiles_batch_size": "2",
    "sr_tile_min_overlap": "0.3",
    "sr_target_resolution": "fullhd",
    "sr_target_resize_mode": "exact",
    "num_inference_steps": "3",
    "seed": "7",
}


def create(
    api: str, key: str, clip: bytes, fields: dict | None = None, headers: dict | None = None
) -> requests.Response:
    files = {"video_reference": ("clip.mp4", clip, "video/mp4")}
    return requests.post(
        f"{api}/v1/videos", data=fields or {}, files=files, headers={**auth(key), **(headers or {})}, timeout=30
    )


def upload(api: str, key: str, clip: bytes) -> dict:
    response = requests.post(
        f"{api}/v1/uploads", files={"file": ("clip.mp4", clip, "video/mp4")}, headers=auth(key), timeout=30
    )
    assert response.status_code == 201, response.text
    return response.json()


def assert_problem(response: requests.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"] == "application/problem+json"
    body = response.json()
    assert (body["status"], body["code"], body["type"]) == (status, code, f"urn:vsrq:problem:{code}")
    assert body["detail"] and "Traceback" not in response.text
    return body


def uploads_of(s3, owner: str) -> list[str]:
    return sorted(s3.keys(f"uploads/{owner}/"))


def test_healthz(api):
    response = requests.get(f"{api}/healthz", timeout=10)
    assert response.status_code == 200
    checks = response.json()["checks"]
    assert checks["redis"]["ok"] and checks["storage"] == {"ok": True, "backend": "s3"}
    assert checks["workers"]["seen"] == 0 and response.json()["status"] == "degraded"
    assert checks["workers"]["queues"] == {"vsrq.k6": 0, "vsrq.cpu": 0}
    assert "no worker takes jobs from vsrq.k6" in response.json()["problems"]


def test_healthz_sees_a_live_worker(api, service_env):
    # a real Celery worker of our app, on a queue of its own (it must not take the tests' messages)
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker", "--pool", "solo",
         "-Q", "vsrq.healthz-probe", "-n", f"probe-{secrets.token_hex(3)}@localhost",
         "--without-gossip", "--without-mingle", "--loglevel", "warning"],
        cwd=ROOT, env={**os.environ, **service_env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        # the detailed view (with a key) names who answers Celery's ping (pinged at most every 10 s)
        while not (workers := requests.get(f"{api}/v1/health", headers=auth("alice"), timeout=10).json()["checks"][
            "workers"
        ])["answering"]:
            assert worker.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        assert any(name.startswith("probe-") for name in workers["answering"])
    finally:
        worker.terminate()
        worker.wait(30)


def test_requests_without_a_valid_key_are_refused(api, clip):
    for headers in (
        {},
        {"Authorization": "Bearer sk-not-a-key-000000000"},
        {"Authorization": f"Basic {KEYS['alice']}"},
    ):
        response = requests.get(f"{api}/v1/videos", headers=headers, timeout=10)
        assert_problem(response, 401, "unauthorized")
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    files = {"video_reference": ("clip.mp4", clip, "video/mp4")}
    assert_problem(requests.post(f"{api}/v1/videos", files=files, timeout=10), 401, "unauthorized")


def test_http_errors_and_our_own_faults_are_problems_without_tracebacks(api, clip, redis_client):
    assert_problem(requests.get(f"{api}/v1/nothing", headers=auth("alice"), timeout=10), 404, "not_found")
    # the one field's reason is the detail: OpenAI's `error.message` said it twice ("… at most 100. limit: … 100.")
    over = requests.get(f"{api}/v1/videos?limit=100000", headers=auth("alice"), timeout=10)
    over = assert_problem(over, 422, "invalid_request")
    assert over["error"]["message"] == over["detail"] and over["error"]["param"] == "limit"
    response = requests.put(f"{api}/v1/videos", headers=auth("alice"), timeout=10)
    assert_problem(response, 405, "method_not_allowed")
    assert "POST" in response.headers["Allow"]
    job = create(api, "alice", clip).json()
    redis_client.hset(f"vsrq:job:{job['id']}", "status", "bogus")  # a record we cannot read is our fault: 500
    body = assert_problem(
        requests.get(f"{api}/v1/videos/{job['id']}", headers=auth("alice"), timeout=10), 500, "internal_error"
    )
    assert "bogus" not in body["detail"]
    redis_client.hset(f"vsrq:job:{job['id']}", "status", "queued")


def test_sglang_multipart_create_queues_a_job_and_a_celery_message(api, clip, s3, redis_client):
    response = create(api, "alice", clip, SGLANG_FIELDS)
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["id"].startswith("video_") and job["object"] == "video"
    assert (job["status"], job["progress"], job["attempt"], job["stage"]) == ("queued", 0, 0, None)
    assert job["model"] == "k6-vsr" and isinstance(job["queue_position"], int)
    assert job["params"] == {
        "sr_resolution_scale": 4.0,
        "sr_tiles_batch_size": 2,
        "sr_tile_min_overlap": 0.3,
        "sr_target_resolution": "fullhd",
        "sr_target_resize_mode": "exact",
        "num_inference_steps": 3,
        "seed": 7,
        "output_codec": "h264",
        "output_crf": 18,
        "deinterlace": "frame",  # the defaults, recorded as the job runs them
        "background": "#000000",
        "quality": "lossless",
    }
    assert job["input"]["bytes"] == len(clip) and job["input"]["sha256"] == hashlib.sha256(clip).hexdigest()

    # the upload went to S3 as sent
    key = f"uploads/alice/{job['input']['upload_id']}"
    with s3.open(key) as stream:
        assert stream.read() == clip
    # and a real Celery message for the job waits on the model's queue
    messages = [m for m in broker_messages(redis_client, "vsrq.k6") if m["args"] == [job["id"]]]
    assert [(m["task"], m["kwargs"]) for m in messages] == [("vsrq.upscale", {})]

    polled = requests.get(f"{api}/v1/videos/{job['id']}", headers=auth("alice"), timeout=10)
    assert polled.status_code == 200 and polled.json()["status"] == "queued"


def test_sglang_defaults_and_a_second_model(api, clip, redis_client):
    job = create(api, "alice", clip, {"prompt": "x", "background": "#FFFFFF"}).json()
    assert job["params"]["sr_resolution_scale"] == 2.25 and job["params"]["seed"] == 42
    assert job["params"]["background"] == "#ffffff"  # one spelling: the kept windows are named by it
    assert (job["params"]["sr_tiles_batch_size"], job["params"]["sr_tile_min_overlap"]) == (1, 0.2)
    assert job["params"]["num_inference_steps"] is None  # the model's own

    other = create(
        api, "alice", clip, {"model": "lanczos", "extra_body": json.dumps({"sr_resolution_scale": 2})}
    ).json()
    assert (other["model"], other["params"]["sr_resolution_scale"]) == ("lanczos", 2.0)
    assert [m["args"] for m in broker_messages(redis_client, "vsrq.cpu") if m["args"] == [other["id"]]] == [
        [other["id"]]
    ]
    body = assert_problem(create(api, "alice", clip, {"model": "nope"}), 422, "unknown_model")
    assert body["error"]["param"] == "model"  # what OpenAI's SDK shows as `e.param`


def test_invalid_fields_are_422_with_details_and_leave_no_upload(api, clip, s3):
    before = uploads_of(s3, "alice")
    body = assert_problem(create(api, "alice", clip, {"sr_resolution_scale": "3", "seed": "x"}), 422, "invalid_request")
    assert {error["field"] for error in body["errors"]} == {"sr_resolution_scale", "seed"}
    body = assert_problem(create(api, "alice", clip, {"sr_scale": "2"}), 422, "unknown_field")
    assert body["errors"][0]["field"] == "sr_scale"
    assert_problem(create(api, "alice", clip, {"sr_target_resolution": "big"}), 422, "invalid_request")
    # the tier: lossless or high; OpenAI's and SGLang's encoder-quality values are pointed at output_crf
    body = assert_problem(create(api, "alice", clip, {"quality": "hd"}), 422, "invalid_request")
    assert body["errors"] == [
        {"field": "quality", "code": "invalid_quality", "message": "must be lossless or high (the encoder's quality is output_crf)"}
    ]  # fmt: skip
    assert_problem(create(api, "alice", clip, {"webhook_url": "http://example.com/hook"}), 422, "invalid_request")
    # an HEVC output in a box x265 is not run at: refused at submit (was by the worker, after the job's wait)
    body = assert_problem(
        create(api, "alice", clip, {"output_codec": "hevc", "sr_target_resolution": "48x24"}), 422, "invalid_request"
    )
    assert body["errors"] == [
        {"field": "output_codec", "code": "value_error", "message": "hevc is written at 64x64 or more, and sr_target_resolution 48x24 makes the output smaller: use h264 or av1, or a larger target"}
    ]  # fmt: skip
    body = assert_problem(create(api, "alice", clip, {"background": "white"}), 422, "invalid_request")
    assert body["errors"] == [  # in words, not the pattern's regex (what OpenAI's SDK shows as e.message)
        {"field": "background", "code": "invalid_background", "message": "must be a colour as #RRGGBB, e.g. #FFFFFF for white"}
    ]  # fmt: skip
    response = requests.post(
        f"{api}/v1/videos", data={"seed": "1"}, files={"other": ("a.txt", b"x")}, headers=auth("alice"), timeout=10
    )
    assert_problem(response, 422, "unexpected_file")
    assert_problem(
        requests.post(
            f"{api}/v1/videos", data="x", headers={**auth("alice"), "Content-Type": "text/plain"}, timeout=10
        ),
        415,
        "unsupported_media_type",
    )
    assert_problem(
        requests.post(
            f"{api}/v1/videos", data="{", headers={**auth("alice"), "Content-Type": "application/json"}, timeout=10
        ),
        400,
        "malformed_json",
    )
    assert uploads_of(s3, "alice") == before


def test_metadata_sent_as_a_json_blob_is_a_field(api, clip):
    # Swagger UI's "Try it out" and a browser's FormData send JSON as a part with a filename ("blob")
    blob = ("blob", json.dumps({"shot": "12a"}), "application/json")
    response = requests.post(
        f"{api}/v1/videos", files={"video_reference": ("clip.mp4", clip, "video/mp4"), "metadata": blob},
        headers=auth("alice"), timeout=30,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    assert response.json()["metadata"] == {"shot": "12a"}
    # a file that is not text under a name that takes none is still refused
    response = requests.post(
        f"{api}/v1/videos", files={"video_reference": ("clip.mp4", clip, "video/mp4"), "metadata": ("m.bin", b"x")},
        headers=auth("alice"), timeout=30,
    )  # fmt: skip
    assert_problem(response, 422, "unexpected_file")


def test_an_upload_says_it_takes_multipart_or_a_declaration(api):
    response = requests.post(f"{api}/v1/uploads", data=b"clip", headers=auth("alice"), timeout=10)
    body = assert_problem(response, 415, "unsupported_media_type")
    assert "`file`" in body["detail"] and "JSON declaring an upload in parts" in body["detail"]
    # JSON is a declaration of an upload in parts: one that names a file instead says what it lacks
    response = requests.post(f"{api}/v1/uploads", json={"file": "clip.mp4"}, headers=auth("alice"), timeout=10)
    fields = {item["field"] for item in assert_problem(response, 422, "invalid_request")["errors"]}
    assert fields == {"file", "bytes", "filename", "mime_type"}


def test_server_paths_are_refused(api, clip, s3):
    before = uploads_of(s3, "alice")
    for body in (
        {"video_path": "/etc/passwd"},
        {"input_reference": "/srv/videos/a.mp4"},
        {"upload_id": "upload_" + "0" * 24, "output_path": "/tmp"},
    ):
        response = requests.post(f"{api}/v1/videos", json=body, headers=auth("alice"), timeout=10)
        assert_problem(response, 422, "server_path_refused")
    assert_problem(create(api, "alice", clip, {"video_path": "/etc/passwd"}), 422, "server_path_refused")
    assert uploads_of(s3, "alice") == before  # the multipart one's file was stored, then removed with the refusal


def test_webhook_urls_must_reach_public_addresses(api, clip):
    for url in (
        "https://127.0.0.1/hook",
        "https://169.254.169.254/latest/meta-data",
        "https://[fd00::1]/",
        "https://localhost/",
    ):
        body = assert_problem(create(api, "alice", clip, {"webhook_url": url}), 422, "unsafe_webhook_url")
        assert body["errors"][0]["field"] == "webhook_url"
    job = create(api, "alice", clip, {"webhook_url": "https://93.184.215.14/hooks/vsrq"}).json()
    assert job["webhook_url"] == "https://93.184.215.14/hooks/vsrq"


def test_json_create_by_upload_id_or_key(api, clip, redis_client):
    uploaded = upload(api, "alice", clip)
    assert (uploaded["bytes"], uploaded["sha256"]) == (len(clip), hashlib.sha256(clip).hexdigest())

    response = requests.post(
        f"{api}/v1/videos",
        json={"upload_id": uploaded["id"], "sr_resolution_scale": 2, "metadata": {"ref": "a-1"}},
        headers=auth("alice"),
        timeout=10,
    )
    assert response.status_code == 200, response.text
    job = response.json()
    assert (job["status"], job["params"]["sr_resolution_scale"], job["metadata"]) == ("queued", 2.0, {"ref": "a-1"})
    assert (job["input"]["upload_id"], job["input"]["bytes"]) == (uploaded["id"], len(clip))
    assert job["input"]["filename"] == "clip.mp4"  # the upload's name, as a job made from the file itself shows
    assert [m["args"] for m in broker_messages(redis_client, "vsrq.k6") if m["args"] == [job["id"]]] == [[job["id"]]]

    by_key = requests.post(f"{api}/v1/videos", json={"input_key": uploaded["key"]}, headers=auth("alice"), timeout=10)
    assert by_key.status_code == 200 and by_key.json()["input"]["upload_id"] == uploaded["id"]
    assert by_key.json()["input"]["filename"] == "clip.mp4"
    # a URL's job is called what a download of it would be
    url = "https://127.0.0.1:9/clips/holiday%20clip.mp4?signature=x"
    by_url = requests.post(f"{api}/v1/videos", json={"video_url": url}, headers=auth("alice"), timeout=10)
    assert by_url.status_code == 200 and by_url.json()["input"]["filename"] == "holiday clip.mp4", by_url.text

    # someone else's upload, or a key outside one's uploads, is no upload at all
    for body in ({"upload_id": uploaded["id"]}, {"input_key": uploaded["key"]}, {"input_key": "outputs/x/video.mp4"}):
        assert_problem(
            requests.post(f"{api}/v1/videos", json=body, headers=auth("bob"), timeout=10), 404, "upload_not_found"
        )
    assert_problem(
        requests.post(f"{api}/v1/videos", json={"seed": 1}, headers=auth("alice"), timeout=10), 422, "missing_video"
    )


def test_a_compressed_json_create_is_read_and_an_upload_must_come_as_it_is(api, clip):
    """A client or proxy that gzips what it sends (Content-Encoding, RFC 9110) got "The body is not valid JSON"."""
    uploaded = upload(api, "alice", clip)
    body = json.dumps({"upload_id": uploaded["id"], "metadata": {"ref": "gz"}}).encode()
    headers = {**auth("alice"), "Content-Type": "application/json"}
    for coding, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        response = requests.post(
            f"{api}/v1/videos", data=data, headers={**headers, "Content-Encoding": coding}, timeout=10
        )
        assert response.status_code == 200, (coding, response.text)
        assert (response.json()["input"]["upload_id"], response.json()["metadata"]) == (uploaded["id"], {"ref": "gz"})
    # a few KiB that inflate past the JSON limit stop there; bytes that are not what the coding says are refused
    bomb = gzip.compress(b'{"metadata": "' + b" " * (8 * MiB) + b'"}')
    junk = gzip.compress(b"{}") + os.urandom(2 * MiB)  # read to its end and kept, bytes after the stream were
    cases = ((bomb, 413, "body_too_large"), (b"{not gzip}", 400, "malformed_json"), (junk, 400, "malformed_json"))
    for data, status, code in cases:
        sent = requests.post(f"{api}/v1/videos", data=data, headers={**headers, "Content-Encoding": "gzip"}, timeout=10)
        assert_problem(sent, status, code)
    assert_problem(
        requests.post(f"{api}/v1/videos", data=body, headers={**headers, "Content-Encoding": "br"}, timeout=10),
        415,
        "unsupported_content_encoding",
    )
    # a video is compressed already: a gzipped upload would be stored as the gzip, and fail as an unreadable video
    files = {"video_reference": ("clip.mp4", gzip.compress(clip), "video/mp4")}
    gzipped = {**auth("alice"), "Content-Encoding": "gzip"}
    sent = requests.post(f"{api}/v1/videos", files=files, headers=gzipped, timeout=10)
    assert_problem(sent, 415, "unsupported_content_encoding")


def test_list_paginates_and_filters_by_status(api, clip):
    ids = [create(api, "carol", clip).json()["id"] for _ in range(5)]
    for job_id in ids[:2]:
        assert (
            requests.post(f"{api}/v1/videos/{job_id}/cancel", headers=auth("carol"), timeout=10).json()["status"]
            == "cancelled"
        )

    seen, after = [], None
    while True:
        page = requests.get(
            f"{api}/v1/videos",
            params={"limit": 2, **({"after": after} if after else {})},
            headers=auth("carol"),
            timeout=10,
        ).json()
        assert page["object"] == "list" and len(page["data"]) <= 2
        seen += [job["id"] for job in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == ids[::-1]

    def listed(**params) -> list[str]:
        return [
            job["id"]
            for job in requests.get(f"{api}/v1/videos", params=params, headers=auth("carol"), timeout=10).json()["data"]
        ]

    assert listed(status="cancelled", order="asc") == ids[:2]
    assert listed(status="queued") == ids[:1:-1]
    assert listed(status="completed") == []
    response = requests.get(f"{api}/v1/videos", params={"status": "done"}, headers=auth("carol"), timeout=10)
    assert_problem(response, 422, "invalid_request")
    for limit in ("0", "101"):  # either end of the range names the field, as OpenAI's SDK reads it (`param`)
        body = assert_problem(
            requests.get(f"{api}/v1/videos", params={"limit": limit}, headers=auth("carol"), timeout=10),
            422,
            "invalid_request",
        )
        assert body["errors"][0]["field"] == body["error"]["param"] == "limit", body


def test_cancel_a_queued_job(api, clip):
    job = create(api, "alice", clip).json()
    cancelled = requests.post(f"{api}/v1/videos/{job['id']}/cancel", headers=auth("alice"), timeout=10)
    assert cancelled.status_code == 200
    body = cancelled.json()
    assert (body["status"], body["queue_position"]) == ("cancelled", None) and body["completed_at"] is not None
    again = requests.post(f"{api}/v1/videos/{job['id']}/cancel", headers=auth("alice"), timeout=10)
    assert_problem(again, 409, "not_cancellable")
    content = requests.get(f"{api}/v1/videos/{job['id']}/content", headers=auth("alice"), timeout=10)
    # not "once it is completed": a cancelled job never will be
    assert assert_problem(content, 409, "job_not_completed")["detail"] == "The job is cancelled: it has no video."


def finish(jobs, s3, job_id: str, payload: bytes) -> None:
    """What the worker does at the end of a job, through the same record API: lease, write, complete (= promote)."""
    lease = jobs.lease(job_id, "test-worker", 30)
    key = attempt_output_key(job_id, lease.attempt, lease.token)
    written = s3.put(key, io.BytesIO(payload), content_type="video/mp4")
    lease.complete(OutputInfo(key=written.key, bytes=written.size, sha256=written.sha256))


def test_content_then_delete_removes_everything(api, clip, jobs, s3, redis_client):
    job = create(api, "alice", clip).json()
    payload = secrets.token_bytes(3 * MiB)
    finish(jobs, s3, job["id"], payload)
    done = requests.get(f"{api}/v1/videos/{job['id']}", headers=auth("alice"), timeout=10).json()
    assert (done["status"], done["progress"], done["output"]["bytes"]) == ("completed", 100, len(payload))
    assert done["output"]["sha256"] == hashlib.sha256(payload).hexdigest() and done["expires_at"] > done["completed_at"]

    content = requests.get(f"{api}/v1/videos/{job['id']}/content", headers=auth("alice"), timeout=30)
    assert content.status_code == 200 and content.content == payload
    assert content.headers["Content-Type"] == "video/mp4" and content.headers["ETag"] == f'"{done["output"]["sha256"]}"'

    deleted = requests.delete(f"{api}/v1/videos/{job['id']}", headers=auth("alice"), timeout=10)
    assert deleted.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert_problem(
        requests.get(f"{api}/v1/videos/{job['id']}", headers=auth("alice"), timeout=10), 404, "job_not_found"
    )
    assert list(s3.keys(output_prefix(job["id"]))) == []
    assert not s3.exists(f"uploads/alice/{job['input']['upload_id']}")
    assert not redis_client.exists(f"vsrq:job:{job['id']}")


def test_content_removed_from_storage_under_its_job_is_gone_not_a_server_error(api, clip, jobs, s3):
    """An output deleted from the bucket before its job expired (a lifecycle rule, a cleanup by hand): downloading it
    answered 500 internal_error ("something went wrong on our side"), which pages someone and says nothing."""
    job = create(api, "alice", clip).json()
    finish(jobs, s3, job["id"], b"the output")
    s3.delete(jobs.require(job["id"]).output.key)
    content = requests.get(f"{api}/v1/videos/{job['id']}/content", headers=auth("alice"), timeout=10)
    body = assert_problem(content, 410, "output_gone")
    assert body["detail"] == "This job's video is no longer in storage (removed before the job expired).", body


def test_delete_refuses_a_running_job(api, clip, jobs):
    job = create(api, "alice", clip).json()
    lease = jobs.lease(job["id"], "test-worker", 30)
    assert_problem(
        requests.delete(f"{api}/v1/videos/{job['id']}", headers=auth("alice"), timeout=10), 409, "job_active"
    )
    running = requests.post(f"{api}/v1/videos/{job['id']}/cancel", headers=auth("alice"), timeout=10).json()
    assert (running["status"], running["cancel_requested"]) == ("in_progress", True)
    assert lease.heartbeat(progress=50) is True
    lease.cancelled()
    assert requests.delete(f"{api}/v1/videos/{job['id']}", headers=auth("alice"), timeout=10).status_code == 200


@pytest.mark.parametrize(
    "update, said",
    [
        ({"s3_secret_key": SecretStr("not-the-store-s-secret")}, "storage: it refuses the key (VSRQ_S3_ACCESS_KEY"),
        ({"s3_bucket": "vsrq-no-such-bucket"}, "storage: the bucket does not exist (VSRQ_S3_BUCKET): create it, 404"),
        ({"redis_url": "redis://:not-the-password@127.0.0.1:1/0"}, "redis: it does not answer"),
    ],
    ids=["wrong-secret", "no-bucket", "no-redis"],
)
def test_health_says_what_is_down_and_what_to_check(settings, update, said):
    """A refused key and a missing bucket both read `"error": "ClientError"`, with `problems` empty: an operator
    could not tell them apart, nor from storage being down."""
    from api.app import create_app

    client = create_app(settings.model_copy(update=update)).test_client()
    deadline = time.monotonic() + 10
    while (response := client.get("/healthz")).get_json()["checks"] == {}:  # its first checks under way
        assert time.monotonic() < deadline, response.get_json()
        time.sleep(0.2)
    body = response.get_json()
    assert response.status_code == 503 and body["status"] == "unavailable", body
    assert any(problem.startswith(said) for problem in body["problems"]), body


def test_redirect_delivery_gives_a_presigned_url(settings, clip, jobs, s3):
    # The delivery mode is a setting; this app runs in-process against the same Redis and S3.
    from api.app import create_app

    client = create_app(settings.model_copy(update={"content_delivery": "redirect"})).test_client()
    job = client.post(
        "/v1/videos", data={"video_reference": (io.BytesIO(clip), "clip.mp4")}, headers=auth("alice")
    ).get_json()
    finish(jobs, s3, job["id"], b"the output")
    response = client.get(f"/v1/videos/{job['id']}/content", headers=auth("alice"))
    assert response.status_code == 302 and "X-Amz-Signature=" in response.location
    fetched = requests.get(response.location, timeout=10)
    assert fetched.content == b"the output"
    # saved under the name a streamed answer gives, not the storage key's (attempt-1-<hex>.mp4)
    assert fetched.headers["Content-Disposition"] == f'attachment; filename="{job["id"]}.mp4"'
    assert fetched.headers["Content-Type"] == "video/mp4"


def test_redirect_delivery_signs_for_the_address_clients_reach_storage_at(settings, clip, jobs, s3):
    """A cluster's API reaches storage at an internal name (k8s: seaweedfs-s3.vsrq.svc.cluster.local) that clients
    cannot resolve: links were signed for it. Here the public address is "localhost", the service's 127.0.0.1."""
    from api.app import create_app

    public = settings.s3_endpoint_url.replace("127.0.0.1", "localhost")
    assert public != settings.s3_endpoint_url
    client = create_app(settings.model_copy(update={"content_delivery": "redirect", "s3_public_url": public}))
    client = client.test_client()
    job = client.post(
        "/v1/videos", data={"video_reference": (io.BytesIO(clip), "clip.mp4")}, headers=auth("alice")
    ).get_json()
    finish(jobs, s3, job["id"], b"the output")
    location = client.get(f"/v1/videos/{job['id']}/content", headers=auth("alice")).location
    assert location.startswith(f"{public}/") and requests.get(location, timeout=10).content == b"the output"


def test_a_key_cannot_touch_another_keys_job(api, clip, jobs, s3):
    job = create(api, "alice", clip).json()
    finish(jobs, s3, job["id"], b"alice's video")
    for method, path in (("get", ""), ("get", "/content"), ("post", "/cancel"), ("delete", "")):
        response = requests.request(method, f"{api}/v1/videos/{job['id']}{path}", headers=auth("bob"), timeout=10)
        assert_problem(response, 404, "job_not_found")
    assert job["id"] not in [
        j["id"] for j in requests.get(f"{api}/v1/videos", headers=auth("bob"), timeout=10).json()["data"]
    ]
    assert (
        requests.get(f"{api}/v1/videos/{job['id']}/content", headers=auth("alice"), timeout=10).content
        == b"alice's video"
    )


def test_idempotent_create(api, clip, redis_client):
    key = {"Idempotency-Key": secrets.token_hex(8)}
    first = create(api, "dave", clip, {"seed": "5"}, key)
    second = create(api, "dave", clip, {"seed": "5"}, key)
    assert first.status_code == second.status_code == 200
    assert second.json() == first.json() and second.headers["Idempotent-Replayed"] == "true"
    assert second.headers["openai-poll-after-ms"] == first.headers["openai-poll-after-ms"]  # queued: the SDK polls
    assert len([m for m in broker_messages(redis_client, "vsrq.k6") if m["args"] == [first.json()["id"]]]) == 1
    # one job made, listed once (other tests of this session may have made dave jobs of their own before it)
    listed = requests.get(f"{api}/v1/videos", headers=auth("dave"), timeout=10).json()["data"]
    assert [job["id"] for job in listed].count(first.json()["id"]) == 1 and listed[0]["id"] == first.json()["id"]

    assert_problem(create(api, "dave", clip, {"seed": "6"}, key), 422, "idempotency_key_reused")
    assert_problem(create(api, "dave", clip[:-1] + b"\0", {"seed": "5"}, key), 422, "idempotency_key_reused")
    json_key = {"Idempotency-Key": secrets.token_hex(8)}
    assert_problem(
        requests.post(f"{api}/v1/videos", json={"seed": 1}, headers={**auth("dave"), **json_key}, timeout=10),
        422,
        "missing_video",
    )
    # a request that failed is not remembered: the fixed one goes through under the same key
    assert create(api, "dave", clip, {}, json_key).status_code == 200
    # keys are per API key: the same key from another caller is another request
    assert create(api, "erin", clip, {"seed": "6"}, key).json()["id"] != first.json()["id"]
    # deleting the job frees its key: the same request makes a new job, not a replay of one nobody can fetch
    deleted = requests.delete(f"{api}/v1/videos/{first.json()['id']}", headers=auth("dave"), timeout=10)
    assert deleted.json()["deleted"] is True
    again = create(api, "dave", clip, {"seed": "5"}, key)
    assert again.status_code == 200 and "Idempotent-Replayed" not in again.headers
    assert again.json()["id"] != first.json()["id"] and again.json()["status"] == "queued"
    assert create(api, "dave", clip, {"seed": "5"}, key).json()["id"] == again.json()["id"]  # which it then replays


def test_idempotent_create_in_flight_is_409(api, clip, redis_client):
    key = {"Idempotency-Key": secrets.token_hex(8)}
    boundary = "vsrq-test-boundary"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="video_reference"; filename="clip.mp4"\r\n'
            "Content-Type: video/mp4\r\n\r\n").encode()  # fmt: skip
    tail = f"\r\n--{boundary}--\r\n".encode()
    release, results = threading.Event(), {}

    def slow_body():
        yield head + clip[:100]
        release.wait(30)  # the first request stays in flight until the second one has been answered
        yield clip[100:] + tail

    def first() -> None:
        headers = {**auth("dave"), **key, "Content-Type": f"multipart/form-data; boundary={boundary}"}
        results["first"] = requests.post(f"{api}/v1/videos", data=slow_body(), headers=headers, timeout=60)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        claim = f"vsrq:idem:dave:{hashlib.sha256(key['Idempotency-Key'].encode()).hexdigest()}"
        deadline = time.monotonic() + 10
        while not redis_client.exists(claim):  # until the first request holds the key
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert_problem(create(api, "dave", clip, {}, key), 409, "idempotency_in_flight")
    finally:
        release.set()
        thread.join()
    assert results["first"].status_code == 200, results["first"].text
    replay = create(api, "dave", clip, {}, key)
    assert replay.json()["id"] == results["first"].json()["id"]


def test_oversized_upload_is_refused_while_streaming(api, s3):
    before = uploads_of(s3, "alice")
    boundary = "vsrq-test-boundary"

    def body():  # chunked: no Content-Length, so only counting can stop it
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="video_reference"; filename="big.mp4"\r\n\r\n'
        ).encode()
        for _ in range(UPLOAD_LIMIT // MiB + 8):
            yield secrets.token_bytes(MiB)
        yield f"\r\n--{boundary}--\r\n".encode()

    headers = {**auth("alice"), "Content-Type": f"multipart/form-data; boundary={boundary}"}
    response = requests.post(f"{api}/v1/videos", data=body(), headers=headers, timeout=60)
    assert_problem(response, 413, "upload_too_large")
    assert uploads_of(s3, "alice") == before
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket, Prefix="uploads/alice/").get("Uploads", []) == []

    # a declared length over the limit is refused before reading
    big = {"video_reference": ("big.mp4", b"\0" * (UPLOAD_LIMIT + 2 * MiB), "video/mp4")}
    assert_problem(
        requests.post(f"{api}/v1/videos", files=big, headers=auth("alice"), timeout=60), 413, "upload_too_large"
    )


def test_the_api_never_imports_torch(service_env):
    code = (
        "import sys; from api.app import create_app; create_app(); assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **service_env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_a_create_that_prefers_to_wait_answers_as_the_wait_runs_out(api, clip):
    """`Prefer: wait=N` with no worker to run the job: the answer comes after N seconds, the job still queued, and
    says it waited; a wait that is no number, or another preference, is ignored (RFC 7240): answered at once."""
    started = time.monotonic()
    response = create(api, "erin", clip, headers={"Prefer": "respond-async, wait=2"})
    waited = time.monotonic() - started
    assert response.status_code == 200 and response.json()["status"] == "queued", response.text
    assert response.headers["Preference-Applied"] == "wait=2" and 2 <= waited < 10, (response.headers, waited)
    # the job deleted while its create waits: the create's answer stands, at once (it was a 500)
    answer: list[requests.Response] = []
    waiting = threading.Thread(target=lambda: answer.append(create(api, "erin", clip, headers={"Prefer": "wait=20"})))
    started = time.monotonic()
    waiting.start()
    while not (queued := requests.get(f"{api}/v1/videos?limit=1", headers=auth("erin"), timeout=10).json()["data"]) or (
        queued[0]["created_at"] < int(started) or queued[0]["id"] == response.json()["id"]
    ):
        time.sleep(0.1)
    assert requests.delete(f"{api}/v1/videos/{queued[0]['id']}", headers=auth("erin"), timeout=10).status_code == 200
    waiting.join(30)
    assert answer[0].status_code == 200 and answer[0].json()["id"] == queued[0]["id"], answer[0].text
    assert "Preference-Applied" not in answer[0].headers and time.monotonic() - started < 10
    # a poll that prefers to wait: as long, then the job as it is; a 404 where its job is deleted meanwhile
    started = time.monotonic()
    polled = requests.get(f"{api}/v1/videos/{response.json()['id']}", headers=auth("erin") | {"Prefer": "wait=1"},
                          timeout=30)  # fmt: skip
    assert (polled.json()["status"], polled.headers["Preference-Applied"]) == ("queued", "wait=1")
    assert 1 <= time.monotonic() - started < 8
    doomed = create(api, "erin", clip).json()["id"]
    waiting = threading.Thread(target=lambda: answer.append(requests.get(
        f"{api}/v1/videos/{doomed}", headers=auth("erin") | {"Prefer": "wait=20"}, timeout=30)))  # fmt: skip
    started = time.monotonic()
    waiting.start()
    time.sleep(0.5)
    assert requests.delete(f"{api}/v1/videos/{doomed}", headers=auth("erin"), timeout=10).status_code == 200
    waiting.join(30)
    assert answer[-1].status_code == 404 and time.monotonic() - started < 10, answer[-1].text
    for ignored in ("wait=soon", "respond-async", "wait=0"):
        started = time.monotonic()
        response = create(api, "erin", clip, headers={"Prefer": ignored})
        assert response.status_code == 200 and "Preference-Applied" not in response.headers, (ignored, response.headers)
        assert time.monotonic() - started < 2, ignored


def test_a_model_offers_the_faster_tier_only_where_a_worker_of_its_queue_runs_it(api, redis_client):
    """GET /v1/models says which tiers each model's jobs run as asked, from what its queue's workers registered: a GPU
    without FP8 GEMMs (an A100) registers `lossless` alone and the web page then offers no "Faster"; a Hopper card
    both; with none registered, or one of the version before (which said nothing), every tier: not known."""
    registry = WorkerRegistry(redis_client, ttl_s=30)

    def offered() -> list[str]:
        served = requests.get(f"{api}/v1/models", headers=auth("alice"), timeout=10).json()["data"]
        return {model["id"]: model["qualities"] for model in served}["k6-vsr"]

    assert offered() == ["lossless", "high"]
    a100 = WorkerInfo(name="a100@test", queues=["vsrq.k6"], model="/models/k6", devices=["cuda:0"], host="gpu-a",
                      pid=1, started_at=0.0, qualities=["lossless"])  # fmt: skip
    try:
        registry.register(a100)
        assert offered() == ["lossless"]
        registry.register(a100.model_copy(update={"name": "h100@test", "qualities": ["lossless", "high"]}))
        assert offered() == ["lossless", "high"]
        registry.remove("h100@test")
        registry.register(a100.model_copy(update={"name": "older@test"}))
        redis_client.hdel("vsrq:worker:older@test", "qualities")  # as a worker of the version before wrote it
        assert offered() == ["lossless", "high"]
    finally:
        for name in ("a100@test", "h100@test", "older@test"):
            registry.remove(name)


def test_a_wait_ends_when_its_client_hangs_up_and_a_deleted_job_is_404_to_a_waiting_poll(settings, jobs):
    """A waiting request holds one of half its process's threads: a client that hung up (a script killed, a browser
    tab closed) held it for the whole minute, and with it `Prefer: wait` from others. The wait looks at the connection
    as it polls, and a request sent after it on the same connection is no hang-up."""
    from api import prefer
    from api.app import create_app
    from storage.jobs import InputInfo, JobNotFound

    job = jobs.create(owner="erin", model="k6-vsr", queue="vsrq.k6", params={}, input=InputInfo(key="k", bytes=1))
    (kept, client), (left, gone) = socket.socketpair(), socket.socketpair()
    with create_app(settings).app_context():
        try:
            started = time.monotonic()
            assert prefer.wait_to_end(job.id, 1, kept).status == "queued" and time.monotonic() - started >= 1
            client.sendall(b"GET /v1/videos HTTP/1.1\r\n\r\n")  # the next request, kept alive: still there
            assert prefer.wait_to_end(job.id, 1, kept).status == "queued"
            gone.close()
            started = time.monotonic()
            assert prefer.wait_to_end(job.id, 30, left) is None and time.monotonic() - started < 2
            jobs.delete(job.id)
            with pytest.raises(JobNotFound):
                prefer.wait_to_end(job.id, 30)
        finally:
            for end in (kept, client, left):
                end.close()


def test_a_request_unheard_past_its_lease_makes_no_second_job_beside_the_repeat_s(redis_client, jobs):
    """A create that stalls for a whole lease between saying what it makes and making it (a paused VM, a process
    frozen), its key taken over meanwhile by a repeat: the repeat's job is the only one, whichever comes first. Before,
    the stalled request made its job too when it came back (two jobs for one key). The store and the jobs on the real
    Redis, each request's steps in the order such a stall gives them."""
    from api.errors import ApiError
    from api.idempotency import Claim, Idempotency
    from storage.jobs import FenceLost, InputInfo

    store = Idempotency(redis_client, ttl_s=600, in_flight_ttl_s=60, lease_s=0.5)

    def make(job_id, fence):
        return jobs.create(job_id=job_id, fence=fence, owner="dave", model="lanczos", queue="q-" + secrets.token_hex(4),
                           params={"sr_resolution_scale": 2.0}, input=InputInfo(key="uploads/dave/x", bytes=10))  # fmt: skip

    def made(job_id):
        job = jobs.get(job_id)
        return {"id": job.id, "status": job.status} if job else None

    # 1. the stalled request comes back after the repeat took its key: it makes nothing, the repeat its job
    key = secrets.token_hex(8)
    stalled = store.claim("dave", key, made)
    assert isinstance(stalled, Claim)
    stalled_job, stalled_fence = stalled.making("asks")
    time.sleep(0.7)
    repeat = store.claim("dave", key, made)
    assert isinstance(repeat, Claim) and repeat.job != stalled_job
    with pytest.raises(FenceLost):
        make(stalled_job, stalled_fence)
    assert jobs.get(stalled_job) is None and isinstance(stalled.taken_over(), ApiError)
    make(*repeat.making("asks"))
    assert repeat.finish("asks", 200, made(repeat.job)) and jobs.get(repeat.job) is not None

    # 2. it comes back just after the repeat found no job of its own: the repeat answers with that job, makes none
    key = secrets.token_hex(8)
    stalled = store.claim("dave", key, made)
    stalled_job, stalled_fence = stalled.making("asks")
    time.sleep(0.7)
    looks: list[str] = []

    def made_as_the_stalled_request_comes_back(job_id):
        looks.append(job_id)
        if len(looks) == 1:  # none yet, as the repeat looks; made right after
            make(stalled_job, stalled_fence)
            return None
        return made(job_id)

    replay = store.claim("dave", key, made_as_the_stalled_request_comes_back)
    assert not isinstance(replay, Claim) and replay.body["id"] == stalled_job, replay
    assert looks == [stalled_job, stalled_job]
    with pytest.raises(FenceLost):  # and a job of an id made already is never written again
        make(stalled_job, None)


def test_a_request_that_failed_after_making_its_job_leaves_the_key_to_that_job(redis_client, jobs):
    """A create that failed after its job was made (Redis gone as the job was read back: 503) forgot its key: the
    client, told to retry, made a second job. The claim stays, unrenewed; a repeat gets 409 until it lapses, then that
    job. One that failed before making its job still frees the key at once."""
    from api.idempotency import Claim, Idempotency
    from storage.jobs import InputInfo

    store = Idempotency(redis_client, ttl_s=600, in_flight_ttl_s=60, lease_s=0.5)

    def made(job_id):
        job = jobs.get(job_id)
        return {"id": job.id, "status": job.status} if job else None

    failed = store.claim("dave", key := secrets.token_hex(8), made)
    failed.making("asks")
    assert failed.release() and isinstance(store.claim("dave", key, made), Claim)  # nothing made: free at once

    claim = store.claim("dave", key := secrets.token_hex(8), made)
    job_id, fence = claim.making("asks")
    jobs.create(job_id=job_id, fence=fence, owner="dave", model="lanczos", queue="q-" + secrets.token_hex(4),
                params={}, input=InputInfo(key="uploads/dave/x", bytes=10))  # fmt: skip
    assert not claim.release()  # then the request failed: the key is not forgotten
    held = store.claim("dave", key, made)
    assert not isinstance(held, Claim) and held.state == "in_flight"
    time.sleep(0.7)
    replay = store.claim("dave", key, made)
    assert not isinstance(replay, Claim) and replay.body["id"] == job_id, replay


def test_a_key_whose_request_died_answers_with_the_job_it_made_exactly(redis_client):
    """The key's store on the real Redis: a claim whose request died after making its job (it said so, then never
    renewed) is found lapsed by a repeat a lease later, and remembered as that job's answer, byte for byte: its body
    went through Redis's Lua JSON once, which turns an empty list into {} and rounds 29.97002997002997."""
    from api.idempotency import Claim, Idempotency

    store = Idempotency(redis_client, ttl_s=600, in_flight_ttl_s=60, lease_s=1)
    key = secrets.token_hex(8)
    first = store.claim("dave", key, made=lambda job_id: None)
    assert isinstance(first, Claim)
    first.making("the fingerprint")  # then the process died: no renewal, no finish
    body = {"id": first.job, "status": "completed", "output": {"notes": [], "fps": 29.97002997002997},
            "seq": 12345678901234567890}  # fmt: skip
    repeat = store.claim("dave", key, made=lambda job_id: body)
    assert not isinstance(repeat, Claim) and repeat.state == "in_flight"  # within its lease: still its request's
    time.sleep(1.2)
    asked: list[str] = []
    replay = store.claim("dave", key, made=lambda job_id: asked.append(job_id) or body)
    assert asked == [first.job] and not isinstance(replay, Claim), replay
    assert store.check_replay(replay, lambda: "the fingerprint").body == body
    assert json.dumps(replay.body) == json.dumps(body)
    # the dead request, had it come back, finds its key no longer its own
    assert not first.finish("the fingerprint", 200, body) and store.claim("dave", key, lambda _: None).body == body
