"""GET /v1/videos/{id}/content in stream mode as a video player uses it: one byte range at a time (206, served by a
ranged GET on SeaweedFS), conditional requests on the output's SHA-256, and ranged reads on both blob stores.

The output is a real MP4 in SeaweedFS, promoted through the real state machine (a Celery worker would add only time:
test_url_input.py reads a range of an output a worker wrote).
"""

from __future__ import annotations

import hashlib
import io
import secrets

import pytest
import requests

from storage.blobs import LocalBlobStore, attempt_output_key, upload_key
from storage.jobs import InputInfo, OutputInfo
from worker.media.synthetic import write_clip

from .conftest import auth


@pytest.fixture(scope="module")
def output(jobs, s3, tmp_path_factory) -> tuple[str, bytes]:
    """A completed job of erin's whose output is a real MP4 with audio: (job id, the MP4's bytes)."""
    body = write_clip(tmp_path_factory.mktemp("range") / "out.mp4", 17, (64, 96), audio_codec="aac").read_bytes()
    job = jobs.create(
        owner="erin", model="lanczos", queue="vsrq.range-test", params={}, input=InputInfo(key=upload_key("erin", "x"))
    )
    lease = jobs.lease(job.id, "range-test", lease_s=60)
    stored = s3.put(attempt_output_key(job.id, lease.attempt, lease.token), io.BytesIO(body), content_type="video/mp4")
    lease.complete(OutputInfo(key=stored.key, bytes=stored.size, sha256=stored.sha256))
    return job.id, body


def content(api: str, job_id: str, **headers: str) -> requests.Response:
    return requests.get(f"{api}/v1/videos/{job_id}/content", headers={**auth("erin"), **headers}, timeout=30)


def test_the_whole_video_says_ranges_are_accepted(api, output):
    job_id, body = output
    response = content(api, job_id)
    assert response.status_code == 200 and response.content == body
    assert response.headers["Accept-Ranges"] == "bytes"
    assert response.headers["ETag"] == f'"{hashlib.sha256(body).hexdigest()}"'
    assert "Content-Range" not in response.headers


@pytest.mark.parametrize(
    "header, part",
    [
        ("bytes=0-99", slice(0, 100)),  # the first bytes (a player reading the header)
        ("bytes=1000-", slice(1000, None)),  # from an offset to the end (a seek)
        ("bytes=-300", slice(-300, None)),  # the last bytes (a player looking for the moov atom)
        ("bytes=7-7", slice(7, 8)),  # one byte
        ("bytes=500-99999999", slice(500, None)),  # past the end: cut at the end
        ("bytes=-99999999", slice(0, None)),  # a suffix longer than the video: all of it
    ],
)
def test_a_range_is_the_slice_of_the_whole(api, output, header, part):
    job_id, body = output
    positions = range(len(body))[part]
    response = content(api, job_id, Range=header)
    assert response.status_code == 206, response.text
    assert response.content == body[part]
    assert response.headers["Content-Length"] == str(len(positions))
    assert response.headers["Content-Range"] == f"bytes {positions[0]}-{positions[-1]}/{len(body)}"


def test_a_range_past_the_end_is_416(api, output):
    job_id, body = output
    response = content(api, job_id, Range=f"bytes={len(body)}-")
    assert response.status_code == 416
    assert response.headers["Content-Type"] == "application/problem+json"
    assert response.json()["code"] == "range_not_satisfiable"
    assert response.headers["Content-Range"] == f"bytes */{len(body)}"


def test_what_is_not_one_byte_range_gets_the_whole_video(api, output):
    job_id, body = output
    sha = hashlib.sha256(body).hexdigest()
    for headers in (
        {"Range": "bytes=0-1,5-9"},  # several ranges may be answered whole
        {"Range": "bytes=9-2"},  # invalid: ignored
        {"Range": "frames=0-3"},  # another unit
        {"Range": "bytes=0-9", "If-Range": '"another-version"'},  # the client's copy is stale: start over
    ):
        response = content(api, job_id, **headers)
        assert (response.status_code, response.content) == (200, body), headers
    response = content(api, job_id, Range="bytes=0-9", **{"If-Range": f'"{sha}"'})
    assert (response.status_code, response.content) == (206, body[:10])


def test_if_none_match_on_the_sha256_is_304(api, output):
    job_id, body = output
    sha = hashlib.sha256(body).hexdigest()
    for tag in (f'"{sha}"', f'W/"{sha}"', f'"other", "{sha}"', "*"):
        response = content(api, job_id, **{"If-None-Match": tag})
        assert (response.status_code, response.content) == (304, b""), tag
        assert response.headers["ETag"] == f'"{sha}"'
    assert content(api, job_id, **{"If-None-Match": '"other"'}).status_code == 200


def test_another_callers_video_is_not_found_whatever_the_range(api, output):
    job_id, _ = output
    response = requests.get(
        f"{api}/v1/videos/{job_id}/content", headers={**auth("alice"), "Range": "bytes=0-9"}, timeout=10
    )
    assert response.status_code == 404 and response.json()["code"] == "job_not_found"


@pytest.mark.parametrize("backend", ["s3", "local"])
def test_blob_stores_read_a_range(backend, s3, tmp_path):
    store = s3 if backend == "s3" else LocalBlobStore(tmp_path)
    body = secrets.token_bytes(300_000)
    key = f"outputs/range-{secrets.token_hex(4)}/attempt-1.mp4"
    store.put(key, io.BytesIO(body))
    try:
        for first, last in ((0, 0), (0, 99), (1234, 250_000), (299_000, 299_999)):
            with store.open(key, (first, last)) as stream:
                pieces = iter(lambda: stream.read(4096), b"")  # in small reads: the end of the range stops them
                assert b"".join(pieces) == body[first : last + 1], (first, last)
        with store.open(key) as stream:
            assert stream.read() == body
    finally:
        store.delete(key)
