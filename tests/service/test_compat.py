"""The clients people already have, against the live stack: SGLang's cookbook request run by the real `curl` with no
header, and OpenAI's Python SDK (`openai`) driving every `videos` method. The API is gunicorn with auth off on
loopback, as `vsrq dev` runs it; a real Celery worker runs lanczos; Redis and SeaweedFS are the session's.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import http.client
import io
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import av
import httpx2
import openai
import pytest
import requests
from openai.types import Video
from PIL import Image

from infra.stack import free_ports

from .conftest import ROOT, log_lines, serve_api
from .test_worker import TERMINAL, celery_worker

COMPAT_KEY = f"sk-test-compat-{'0' * 16}"
PAGER_KEY = f"sk-test-pager-{'0' * 16}"  # a key of its own: its listing holds only the jobs its test made
QUEUE, IDLE_QUEUE = "vsrq.compat", "vsrq.compat-idle"  # IDLE_QUEUE has no worker: its jobs stay queued
POLL_AFTER_MS = 200


@pytest.fixture(scope="module")
def anonymous_api_log(tmp_path_factory) -> Path:
    """gunicorn's output: the API's log lines (JSON, the default format)."""
    return tmp_path_factory.mktemp("compat") / "gunicorn.log"


@pytest.fixture(scope="module")
def anonymous_api(service_env, anonymous_api_log) -> Iterator[str]:
    env = {
        **service_env,
        "VSRQ_AUTH": "none",
        "VSRQ_API_KEYS": json.dumps([{"id": "compat", "token": COMPAT_KEY}, {"id": "pager", "token": PAGER_KEY}]),
        "VSRQ_MODELS": json.dumps({"lanczos": QUEUE, "k6-vsr": IDLE_QUEUE}),  # lanczos first: the default
        "VSRQ_POLL_AFTER_MS": str(POLL_AFTER_MS),
    }
    with serve_api(env, anonymous_api_log) as url:
        yield url


@pytest.fixture(scope="module")
def lanczos_worker(service_env, redis_client, tmp_path_factory) -> Iterator[Path]:
    redis_client.delete(QUEUE)
    with celery_worker(service_env, "lanczos", QUEUE, tmp_path_factory.mktemp("compat-worker") / "cpu.log") as log:
        yield log


@pytest.fixture(scope="module")
def sdk(anonymous_api) -> Iterator[openai.OpenAI]:
    # "EMPTY": what SGLang's examples pass; with auth off any unknown token acts as the local owner
    with openai.OpenAI(base_url=f"{anonymous_api}/v1", api_key="EMPTY", max_retries=2) as client:
        yield client  # its kept-alive connections closed after, or gunicorn's shutdown waits for them


@pytest.fixture(scope="module")
def in_mp4(tmp_path_factory) -> Path:
    from worker.media.synthetic import write_clip

    return write_clip(tmp_path_factory.mktemp("in") / "in.mp4", 9, (32, 48), audio_codec="aac")


def curl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", *args], cwd=cwd, capture_output=True, timeout=60)


def test_sglang_cookbook_request_works_byte_for_byte_without_a_header(anonymous_api, lanczos_worker, in_mp4):
    api = anonymous_api
    # SGLang's cookbook request, exactly (only the host and port differ)
    created = curl(
        "-sS", "--fail-with-body", f"{api}/v1/videos",
        "-F", "video_reference=@in.mp4;type=video/mp4",
        "-F", "sr_resolution_scale=2", "-F", "sr_tiles_batch_size=1", "-F", "num_inference_steps=2", "-F", "seed=42",
        cwd=in_mp4.parent,
    )  # fmt: skip
    assert created.returncode == 0, created.stdout + created.stderr
    job = json.loads(created.stdout)
    assert (job["status"], job["model"], job["params"]["seed"]) == ("queued", "lanczos", 42)

    deadline = time.monotonic() + 60
    while job["status"] not in TERMINAL:
        assert time.monotonic() < deadline, f"{job}\n{lanczos_worker.read_text()[-3000:]}"
        time.sleep(0.2)
        polled = curl("-sS", "--fail-with-body", f"{api}/v1/videos/{job['id']}", cwd=in_mp4.parent)
        assert polled.returncode == 0, polled.stdout
        job = json.loads(polled.stdout)
    assert job["status"] == "completed", job
    # what ran is what the job says: lanczos has no denoising steps to report
    assert (job["output"]["model"], job["output"]["num_inference_steps"]) == ("lanczos", None)

    content = curl(
        "-sS", "--fail-with-body", "-o", "out.mp4", f"{api}/v1/videos/{job['id']}/content", cwd=in_mp4.parent
    )  # fmt: skip
    assert content.returncode == 0, content.stdout + content.stderr
    output = in_mp4.parent / "out.mp4"
    assert hashlib.sha256(output.read_bytes()).hexdigest() == job["output"]["sha256"]
    with av.open(str(output)) as container:
        assert (container.streams.video[0].width, container.streams.video[0].height) == (96, 64)
        assert container.streams.audio  # the input's audio, carried over


def test_a_deployment_with_keys_still_refuses_anonymous_requests(api, in_mp4):
    with open(in_mp4, "rb") as video:
        response = requests.post(f"{api}/v1/videos", files={"video_reference": video}, timeout=30)
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"


def test_auth_off_is_refused_on_a_public_bind(service_env):
    from pydantic import ValidationError

    from storage.config import Settings

    with pytest.raises(ValidationError, match="VSRQ_AUTH_NONE_PUBLIC"):
        Settings(_env_file=None, auth="none", bind="0.0.0.0:8000")
    assert Settings(_env_file=None, auth="none", bind="0.0.0.0:8000", auth_none_public=True).anonymous_key.id == "local"
    # a --bind on gunicorn's command line bypasses VSRQ_BIND: the sockets it bound are checked too
    env = {**os.environ, **service_env, "VSRQ_AUTH": "none", "VSRQ_WEB_WORKERS": "1"}
    server = subprocess.run(
        [sys.executable, "-m", "gunicorn", "--config", "infra/gunicorn.conf.py", "--bind", f"0.0.0.0:{free_ports(1)[0]}",
         "api.app:create_app()"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert server.returncode == 1 and "VSRQ_AUTH=none refused on 0.0.0.0" in server.stdout + server.stderr


def test_sgl_fields_are_honoured_or_refused_by_name(anonymous_api, in_mp4):
    def create(**fields) -> requests.Response:
        with open(in_mp4, "rb") as video:
            files = {"video_reference": ("in.mp4", video, "video/mp4")}
            return requests.post(f"{anonymous_api}/v1/videos", data=fields, files=files, timeout=30)

    honoured = create(
        model="k6-vsr", prompt="ignored", seed="-1", sr_target_resolution="none", upscaling_scale="4",
        enable_upscaling="true", n="1", enable_frame_interpolation="false", guidance_scale="1.0",
        extra_params=json.dumps({"sr_tiles_batch_size": 2}),
    ).json()  # fmt: skip
    params = honoured["params"]
    assert (params["sr_resolution_scale"], params["sr_target_resolution"]) == (4, None)
    assert params["sr_tiles_batch_size"] == 2
    assert 0 <= params["seed"] < 2**31  # drawn, and reported
    refusals = (
        ("seconds", "8"), ("enable_frame_interpolation", "true"), ("frame_interpolation_exp", "2"),
        ("diffusers_kwargs", "{}"), ("output_quality", "maximum"), ("guidance_scale", "5"),
    )  # fmt: skip
    for field, value in refusals:
        refused = create(model="k6-vsr", **{field: value})
        body = refused.json()
        assert (refused.status_code, body["code"], body["errors"][0]["field"]) == (422, "generation_only_field", field)
        assert body["errors"][0]["message"] and body["error"]["param"] == field
    # an input named by URL in a form without a file (SGLang's `reference_url` / `video_url`), checked as JSON's are
    def by_url(url: str) -> requests.Response:
        form = {"reference_url": (None, url), "model": (None, "k6-vsr")}
        return requests.post(f"{anonymous_api}/v1/videos", files=form, timeout=30)

    response = by_url("http://example.com/in.mp4")
    assert (response.status_code, response.json()["errors"][0]["field"]) == (422, "reference_url")
    queued = by_url("https://93.184.215.14/in.mp4").json()  # public: fetched only once a worker runs it
    assert queued["status"] == "queued" and queued["input"]["upload_id"] is None
    for job in (honoured, queued):  # nobody runs the idle queue: leave nothing in it
        requests.post(f"{anonymous_api}/v1/videos/{job['id']}/cancel", timeout=10)


def test_openai_sdk_drives_every_videos_method(anonymous_api, lanczos_worker, in_mp4, sdk, s3):
    clip = in_mp4.read_bytes()
    video = sdk.videos.create(
        prompt="upscale",  # the SDK requires one; super-resolution ignores it
        input_reference=("in.mp4", clip, "video/mp4"),
        model="lanczos",
        extra_body={"sr_resolution_scale": 2, "seed": -1, "metadata": {"ref": "sdk-1"}},  # sent as form fields
    )
    assert video.status == "queued" and video.model == "lanczos"
    # every field of OpenAI's Video is in the body: the SDKs type these string | null, and a typed client read undefined
    assert {"prompt", "remixed_from_video_id"} <= video.model_fields_set and video.prompt is None
    extra = video.model_extra
    assert extra["metadata"] == {"ref": "sdk-1"} and extra["params"]["seed"] >= 0

    done = sdk.videos.poll(video.id)
    assert done.status == "completed", done
    retrieved = sdk.videos.retrieve(video.id)
    assert retrieved.size == "96x64" and retrieved.model_extra["output"]["variants"] == [
        "video", "thumbnail", "spritesheet"
    ]  # fmt: skip
    output = retrieved.model_extra["output"]

    mp4 = sdk.videos.download_content(video.id)
    assert mp4.response.headers["content-type"] == "video/mp4"
    assert hashlib.sha256(mp4.content).hexdigest() == output["sha256"]
    thumbnail = sdk.videos.download_content(video.id, variant="thumbnail")
    assert thumbnail.response.headers["content-type"] == "image/jpeg"
    poster = Image.open(io.BytesIO(thumbnail.content))
    assert (poster.format, poster.size) == ("JPEG", (96, 64))
    sheet = sdk.videos.download_content(video.id, variant="spritesheet")
    assert sheet.response.headers["content-type"] == "image/jpeg"
    grid = Image.open(io.BytesIO(sheet.content))
    assert (grid.format, grid.size) == ("JPEG", (5 * 96, 2 * 64))  # the 9 frames, 5 to a row

    second = sdk.videos.create_and_poll(prompt="x", input_reference=("in.mp4", clip, "video/mp4"), model="lanczos")
    assert second.status == "completed"
    # paging one job at a time, newest first, as the SDK follows `last_id`
    ids = [item.id for item in sdk.videos.list(limit=1)]
    assert ids[:2] == [second.id, video.id]

    deleted = sdk.videos.delete(video.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (video.id, True, "video.deleted")
    with pytest.raises(openai.NotFoundError):
        sdk.videos.retrieve(video.id)
    assert list(s3.keys(f"outputs/{video.id}/")) == []  # the MP4 and its two JPEGs went with it


def test_openai_sdk_edit_upscales_a_file_or_a_completed_jobs_output(anonymous_api, lanczos_worker, in_mp4, sdk, s3):
    """`client.videos.edit`, the SDK's call for "change this video": its `video` a file (the input upscaled), or
    `{"id": ...}` naming a completed job, whose output is upscaled again (x2 then x2: four times the input's size),
    the first job's output left in place. Before /v1/videos/edits existed, both answered 404 (no such route).
    openai 3.57's `edit` takes only a file (a dict fails its file check before sending): the named form goes as
    JSON through the same client."""
    x2 = {"sr_resolution_scale": 2}
    first = sdk.videos.edit(
        prompt="upscale", video=("in.mp4", in_mp4.read_bytes(), "video/mp4"), extra_body={"model": "lanczos", **x2}
    )
    assert (first.status, first.model) == ("queued", "lanczos")
    first = sdk.videos.poll(first.id)
    assert (first.status, first.size) == ("completed", "96x64"), first
    running = sdk.videos.create(prompt="x", input_reference=("in.mp4", in_mp4.read_bytes(), "video/mp4"),
                                model="lanczos", extra_body={"sr_resolution_scale": 4})  # fmt: skip

    def edit_named(job_id: str) -> Video:
        body = {"prompt": "again", "video": {"id": job_id}, "model": "lanczos", **x2}
        return sdk.post("/videos/edits", body=body, cast_to=Video)

    with pytest.raises(openai.ConflictError) as refused:  # not completed yet: no output to edit
        edit_named(running.id)
    assert refused.value.code == "job_not_completed"
    again = sdk.videos.poll(edit_named(first.id).id)
    assert (again.status, again.size) == ("completed", "192x128"), again
    source = again.model_extra["input"]
    assert source["sha256"] == first.model_extra["output"]["sha256"] and source["filename"] == f"{first.id}.mp4"
    assert sdk.videos.retrieve(first.id).status == "completed"
    assert hashlib.sha256(sdk.videos.download_content(first.id).content).hexdigest() == source["sha256"]
    with pytest.raises(openai.NotFoundError):
        edit_named("video_does_not_exist")
    sdk.videos.poll(running.id)


def test_openai_sdk_errors_read_well_and_are_not_retried_in_vain(anonymous_api, sdk, in_mp4):
    clip = in_mp4.read_bytes()
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        sdk.videos.create(prompt="x", input_reference=("in.mp4", clip, "video/mp4"), seconds="8")
    error = refused.value
    assert (error.code, error.param, error.type) == ("generation_only_field", "seconds", "invalid_request_error")
    assert "not super-resolution" in error.message
    # the SDK keeps only the body's `error`: the reasons, per field, are in its message
    assert "seconds: the output keeps the input's frames" in error.message
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        sdk.videos.create(
            prompt="x", input_reference=("in.mp4", clip, "video/mp4"), extra_body={"sr_resolution_scale": 3, "seed": -2}
        )
    error = refused.value
    assert (error.code, error.param) == ("invalid_request", "sr_resolution_scale")
    assert "sr_resolution_scale: " in error.message and "must be one of 2, 2.25 or 4, got 3" in error.message
    assert "seed: " in error.message and "seed: " in error.body["message"]
    with pytest.raises(openai.UnprocessableEntityError) as refused:  # SGLang's list of seeds, as the SDK sends lists
        sdk.videos.create(prompt="x", input_reference=("in.mp4", clip, "video/mp4"), extra_body={"seed": [1, 2]})
    assert (refused.value.code, refused.value.param) == ("invalid_request", "seed")  # as a JSON body's list
    # a webhook this key could not sign (it has no webhook_secret) is refused at once, not failed unseen later
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        sdk.videos.create(
            prompt="x", input_reference=("in.mp4", clip, "video/mp4"), extra_body={"webhook_url": "https://8.8.8.8/h"}
        )
    assert (refused.value.code, refused.value.param) == ("webhook_secret_missing", "webhook_url")
    assert "no webhook_secret" in refused.value.message

    # a job nobody runs yet: the poll hint, then a 409 the SDK is told not to retry
    queued = sdk.videos.with_raw_response.create(
        prompt="x", input_reference=("in.mp4", clip, "video/mp4"), model="k6-vsr"
    )
    assert queued.headers["openai-poll-after-ms"] == str(POLL_AFTER_MS)
    job_id = queued.parse().id
    sent = []
    counted = sdk.with_options(http_client=httpx2.Client(event_hooks={"request": [sent.append]}))
    with pytest.raises(openai.ConflictError) as conflict:
        counted.videos.download_content(job_id)
    assert conflict.value.response.headers["x-should-retry"] == "false" and conflict.value.code == "job_not_completed"
    assert len(sent) == 1  # answered once, not retried (max_retries=2)

    # a create retried with the same Idempotency-Key makes one job (what README tells SDK users to send)
    key = {"Idempotency-Key": secrets.token_hex(8)}
    first, again = (
        sdk.videos.create(prompt="x", input_reference=("in.mp4", clip, "video/mp4"), model="k6-vsr", extra_headers=key)
        for _ in range(2)
    )
    assert again.id == first.id
    for job in (job_id, first.id):
        requests.post(f"{anonymous_api}/v1/videos/{job}/cancel", timeout=10)


def test_openai_sdk_generation_methods_are_refused_by_name(anonymous_api, sdk, in_mp4):
    """`remix`, `extend` and the characters answered Werkzeug's "If you entered the URL manually please check your
    spelling": an SDK user typed no URL."""
    calls = {
        "videos.remix": lambda: sdk.videos.remix("video_0123", prompt="x"),
        "videos.extend": lambda: sdk.videos.extend(prompt="x", seconds="4", video=in_mp4.open("rb")),
        "videos.create_character": lambda: sdk.videos.create_character(name="x", video=in_mp4.open("rb")),
        "videos.get_character": lambda: sdk.videos.get_character("char_0123"),
    }
    for operation, call in calls.items():
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert refused.value.code == "not_offered", (operation, refused.value.body)
        assert operation.split(".")[1].split("_")[0] in refused.value.message and "videos.edit" in refused.value.message
    # any other path or method says what it is, in the API's terms
    nothing = requests.post(f"{anonymous_api}/v1/nothing", timeout=10)
    assert (nothing.status_code, nothing.json()["code"]) == (404, "not_found")
    assert "/openapi.json" in nothing.json()["detail"] and "manually" not in nothing.json()["detail"]
    wrong = requests.put(f"{anonymous_api}/v1/videos", timeout=10)
    assert (wrong.status_code, wrong.json()["code"]) == (405, "method_not_allowed")
    assert wrong.json()["detail"].startswith("PUT is not offered on /v1/videos; it takes ")
    assert "POST" in wrong.headers["Allow"]


def test_served_models_are_listed_the_openai_way(anonymous_api, sdk):
    models = sdk.models.list()
    assert [(model.id, model.object, model.owned_by) for model in models] == [
        ("lanczos", "model", "vsrq"),
        ("k6-vsr", "model", "vsrq"),
    ]
    assert sdk.models.retrieve("lanczos").model_extra["default"] is True
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("sora-2")


def test_openai_async_sdk_deletes_the_jobs_of_the_pages_it_iterates(anonymous_api, in_mp4):
    """`async for video in client.videos.list(): await client.videos.delete(video.id)`: the SDK asks for each next
    page `after` the id it has just deleted, which must still mark its place."""
    upload = ("in.mp4", in_mp4.read_bytes(), "video/mp4")

    async def create_then_delete_all() -> tuple[list[str], list[str], list]:
        async with openai.AsyncOpenAI(base_url=f"{anonymous_api}/v1", api_key=PAGER_KEY, max_retries=0) as client:
            # queued on the idle queue: deletable, and nobody runs them
            created = [
                (await client.videos.create(prompt="x", input_reference=upload, model="k6-vsr")).id for _ in range(5)
            ]
            deleted = [(await client.videos.delete(video.id)).id async for video in client.videos.list(limit=2)]
            return created, deleted, (await client.videos.list()).data

    created, deleted, left = asyncio.run(create_then_delete_all())
    assert deleted == created[::-1] and left == []  # newest first, every page


def test_openai_input_reference_object_names_an_upload_or_a_url(anonymous_api, lanczos_worker, in_mp4, sdk):
    """OpenAI's `input_reference` object: {"file_id": ...} (here an upload's id) or {"image_url": ...} (an https URL).
    The SDK's own check refuses a dict in the `input_reference` argument, so it rides in `extra_body`, sent as
    `input_reference[file_id]` form fields."""
    with open(in_mp4, "rb") as video:
        upload = requests.post(f"{anonymous_api}/v1/uploads", files={"file": video}, timeout=30).json()
    done = sdk.videos.create_and_poll(
        prompt="x", model="lanczos", extra_body={"input_reference": {"file_id": upload["id"]}, "sr_resolution_scale": 2}
    )
    assert (done.status, done.size, done.model_extra["input"]["upload_id"]) == ("completed", "96x64", upload["id"])

    url = {"image_url": "https://93.184.215.14/in.mp4"}  # public: fetched only once a worker runs it
    queued = sdk.videos.create(prompt="x", model="k6-vsr", extra_body={"input_reference": url})
    assert queued.status == "queued" and queued.model_extra["input"]["upload_id"] is None
    requests.post(f"{anonymous_api}/v1/videos/{queued.id}/cancel", timeout=10)  # nobody runs the idle queue
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        sdk.videos.create(prompt="x", extra_body={"input_reference": {"image_url": "http://93.184.215.14/in.mp4"}})
    assert refused.value.param == "input_reference" and "https" in refused.value.message


def test_openai_sdk_uploads_a_video_in_parts_that_a_job_then_upscales(anonymous_api, lanczos_worker, in_mp4, sdk):
    """`uploads.upload_file_chunked`, what OpenAI's SDK offers for files too big for one request: create, a request
    per part, complete; its `file.id` is what `input_reference.file_id` names."""
    size = in_mp4.stat().st_size
    md5 = hashlib.md5(in_mp4.read_bytes()).hexdigest()
    upload = sdk.uploads.upload_file_chunked(
        file=in_mp4, mime_type="video/mp4", purpose="user_data", part_size=size // 3 + 1, md5=md5
    )
    assert (upload.status, upload.bytes, upload.filename, upload.file.bytes) == ("completed", size, "in.mp4", size)
    assert upload.model_extra["sha256"] == hashlib.sha256(in_mp4.read_bytes()).hexdigest()
    assert len(upload.model_extra["part_ids"]) == 3
    named = {"input_reference": {"file_id": upload.file.id}, "sr_resolution_scale": 2}
    done = sdk.videos.create_and_poll(prompt="x", model="lanczos", extra_body=named)
    assert (done.status, done.size, done.model_extra["input"]["upload_id"]) == ("completed", "96x64", upload.id)
    assert done.model_extra["input"]["filename"] == "in.mp4"


def test_a_request_id_the_sdk_reports_is_the_one_in_the_api_log(anonymous_api, anonymous_api_log, sdk, in_mp4):
    """A user quotes `e.request_id` to an operator, who greps the API's log for it."""
    clip = ("in.mp4", in_mp4.read_bytes(), "video/mp4")
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        sdk.videos.create(prompt="x", input_reference=clip, seconds="8")
    request_id = refused.value.request_id
    assert request_id and request_id.startswith("req_")
    assert refused.value.response.json()["request_id"] == request_id  # in the problem body too
    access = [line for line in log_lines(anonymous_api_log, request_id) if line["logger"] == "gunicorn.access"]
    assert len(access) == 1 and '"POST /v1/videos HTTP/1.1" 422' in access[0]["message"], access

    # one the client sent is kept when it is sane, replaced when it is not; a success carries one too
    models = sdk.models.with_raw_response.list(extra_headers={"X-Request-Id": "trace-7f3a.1"})
    assert models.headers["x-request-id"] == "trace-7f3a.1" == models.request_id
    assert log_lines(anonymous_api_log, "trace-7f3a.1")
    for insane in ("two words", "x" * 200, "a\"b"):
        response = requests.get(f"{anonymous_api}/v1/models", headers={"X-Request-Id": insane}, timeout=10)
        assert response.headers["x-request-id"].startswith("req_")
    ids = {requests.get(f"{anonymous_api}/v1/models", timeout=10).headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3


def test_the_request_that_created_a_job_is_found_from_its_id(anonymous_api, anonymous_api_log, sdk, jobs, in_mp4):
    """A user quotes a job's id, not the request id of its create: the job's `created` event names that request (the
    one the SDK was answered with, or the client's own), whose lines the operator then greps in the API's log."""
    clip = ("in.mp4", in_mp4.read_bytes(), "video/mp4")
    made = sdk.videos.create(prompt="x", input_reference=clip, model="k6-vsr")
    trace = {"X-Request-Id": f"trace-{secrets.token_hex(4)}"}
    traced = sdk.videos.create(prompt="x", input_reference=clip, model="k6-vsr", extra_headers=trace)
    try:
        for job in (made, traced):
            [created] = [event for event in jobs.events(job.id) if event.type == "created"]
            request_id = created.detail["request_id"]
            assert request_id == job._request_id, (created, job._request_id)  # the create's x-request-id
            access = [line for line in log_lines(anonymous_api_log, request_id) if line["logger"] == "gunicorn.access"]
            assert len(access) == 1 and '"POST /v1/videos HTTP/1.1" 200' in access[0]["message"], access
        assert made._request_id.startswith("req_") and traced._request_id == trace["X-Request-Id"]
    finally:
        for job in (made, traced):
            requests.post(f"{anonymous_api}/v1/videos/{job.id}/cancel", timeout=10)  # nobody runs the idle queue


def test_the_sdk_waits_out_an_upload_in_flight_under_its_idempotency_key(anonymous_api, sdk, in_mp4):
    """A create repeated (by the SDK's own retry, or a second process) while the first is still uploading: the 409 says
    how long to wait, and the SDK's retries, waiting that long, get the first request's job."""
    key, boundary, clip = secrets.token_hex(8), secrets.token_hex(8), in_mp4.read_bytes()
    fields = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in (("prompt", "x"), ("model", "k6-vsr"))  # the SDK's fields, so the requests are the same
    )
    body = (
        fields
        + f'--{boundary}\r\nContent-Disposition: form-data; name="input_reference"; filename="in.mp4"\r\n'.encode()
        + b"Content-Type: video/mp4\r\n\r\n" + clip + f"\r\n--{boundary}--\r\n".encode()
    )
    pieces, pause = 6, 0.5  # the first request takes ~3 s to send
    host, port = anonymous_api.removeprefix("http://").split(":")
    first = http.client.HTTPConnection(host, int(port), timeout=30)
    first.putrequest("POST", "/v1/videos")
    for name, value in (("Content-Type", f"multipart/form-data; boundary={boundary}"),
                        ("Content-Length", str(len(body))), ("Idempotency-Key", key)):  # fmt: skip
        first.putheader(name, value)
    first.endheaders()
    sent = time.monotonic()

    def trickle() -> dict:
        size = -(-len(body) // pieces)
        for at in range(0, len(body), size):
            first.send(body[at : at + size])
            time.sleep(pause)
        try:
            return json.loads(first.getresponse().read())
        finally:
            first.close()  # a kept-alive connection left open holds up gunicorn's shutdown

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        original = pool.submit(trickle)
        time.sleep(pause)
        upload = ("in.mp4", clip, "video/mp4")
        busy = requests.post(
            f"{anonymous_api}/v1/videos", data={"prompt": "x", "model": "k6-vsr"},
            files={"input_reference": upload}, headers={"Idempotency-Key": key}, timeout=10,
        )  # fmt: skip
        assert busy.status_code == 409 and busy.json()["code"] == "idempotency_in_flight"
        assert 1 <= int(busy.headers["Retry-After"]) <= 60
        again = sdk.videos.create(
            prompt="x", input_reference=upload, model="k6-vsr", extra_headers={"Idempotency-Key": key}
        )  # the SDK's default two retries
        job = original.result()
    assert again.id == job["id"] and time.monotonic() - sent >= pieces * pause
    requests.post(f"{anonymous_api}/v1/videos/{job['id']}/cancel", timeout=10)  # nobody runs the idle queue


# SGLang's VideoGenerationsRequest (multimodal_gen/runtime/entrypoints/openai/protocol.py) as a client fills it in:
# every field at its default, the unset ones as null, which is what `model_dump()` of it sends
SGLANG_DEFAULTS = {
    "input_reference": None, "reference_url": None, "video_path": None, "n": 1, "num_outputs_per_prompt": None,
    "seconds": 4, "size": "", "fps": None, "num_frames": None, "seed": None, "generator_device": "cuda",
    "width": None, "height": None, "num_inference_steps": None, "guidance_scale": None, "guidance_scale_2": None,
    "true_cfg_scale": None, "negative_prompt": None, "max_sequence_length": None, "flow_shift": None,
    "enable_teacache": False, "enable_frame_interpolation": False, "frame_interpolation_exp": 1,
    "frame_interpolation_scale": 1.0, "frame_interpolation_model_path": None, "enable_upscaling": False,
    "upscaling_model_path": None, "upscaling_scale": 4, "output_quality": "default", "output_compression": None,
    "output_path": None, "diffusers_kwargs": None, "perf_dump_path": None,
}  # fmt: skip


def test_sglang_defaults_sent_as_they_are_ask_for_nothing(anonymous_api, in_mp4):
    """A client sending every SGLang default (JSON with nulls, or a form of the set ones) gets its job; a value other
    than the default still gets 422 naming its field."""
    url = "https://93.184.215.14/in.mp4"  # public: fetched only once a worker runs it
    request = {**SGLANG_DEFAULTS, "prompt": "", "video_url": url, "model": "k6-vsr", "sr_resolution_scale": 2}
    as_json = requests.post(f"{anonymous_api}/v1/videos", json=request, timeout=30)
    assert as_json.status_code == 200, as_json.text
    assert as_json.json()["params"]["sr_resolution_scale"] == 2  # upscaling_scale 4 means nothing with upscaling off
    form = {name: str(value).lower() if isinstance(value, bool) else str(value)
            for name, value in request.items() if value not in (None, "") and name != "video_url"}  # fmt: skip
    with open(in_mp4, "rb") as video:
        files = {"video_reference": ("in.mp4", video, "video/mp4")}
        as_form = requests.post(f"{anonymous_api}/v1/videos", data=form, files=files, timeout=30)
    assert as_form.status_code == 200, as_form.text
    for job in (as_json.json(), as_form.json()):  # nobody runs the idle queue
        requests.post(f"{anonymous_api}/v1/videos/{job['id']}/cancel", timeout=10)

    for field, value in (("upscaling_scale", 2), ("frame_interpolation_scale", 2.0), ("output_quality", "high")):
        refused = requests.post(f"{anonymous_api}/v1/videos", json={**request, field: value}, timeout=30)
        body = refused.json()
        assert refused.status_code == 422 and body["errors"][0]["field"] == field, body
        assert field in body["error"]["message"]


def test_a_list_or_a_data_url_for_the_video_is_refused_for_what_it_is(anonymous_api, sdk, in_mp4):
    """Neither is a path on the server, and the answer must not say so."""
    url = "https://93.184.215.14/in.mp4"
    listed = requests.post(f"{anonymous_api}/v1/videos", json={"prompt": "x", "video_path": [url]}, timeout=30)
    body = listed.json()
    assert (listed.status_code, body["errors"][0]["field"], body["errors"][0]["code"]) == (
        422, "video_path", "list_not_accepted"
    )  # fmt: skip
    assert "server" not in body["detail"] and "one job per video" in body["detail"]

    inline = "data:video/mp4;base64," + base64.b64encode(in_mp4.read_bytes()).decode()
    for fields in ({"video_path": inline}, {"input_reference": {"image_url": inline}}):
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            sdk.videos.create(prompt="x", extra_body=fields)  # OpenAI's object, as the SDK sends it
        error = refused.value
        assert error.code == "data_url_not_accepted" and error.param == next(iter(fields)), error.message
        assert "server" not in error.message and "/v1/uploads" in error.message
