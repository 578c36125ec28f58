"""No one gets in: tenant isolation on every endpoint, the SSRF guard at submit and at send time, presigned URLs that
expire, per-key rate, job and upload limits, and no secret in any log or job body. Through the live API (gunicorn on
loopback) and a real worker.

No test here sends a packet beyond loopback: private and metadata addresses are only resolved and refused (the guard
never connects to what it refuses), and the send-time cases that do reach the connecting code use hosts that are
this machine (127.0.0.1, ::1, 0.0.0.0, the decimal and IPv4-mapped spellings of loopback).
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests
import trustme

from infra.stack import free_ports
from storage.ssrf import UnsafeUrl, public_addresses
from tests.service.test_api import assert_problem
from worker.fetch import FetchFailed, fetch
from worker.webhooks import post

from . import processes
from .conftest import LIMITED, PRESIGN_TTL_S, TOKENS, auth, create, wait_all, webhook_secret

# Every kind of address a user-supplied URL must not reach, spelled as attackers spell them.
UNSAFE_HOSTS = [
    "127.0.0.1", "[::1]", "localhost", "10.0.0.1", "10.255.255.254", "172.16.0.1", "172.31.255.254", "192.168.1.1",
    "169.254.169.254", "100.64.0.1", "100.127.255.254", "0.0.0.0", "2130706433", "0x7f000001", "127.1",
    "[::ffff:127.0.0.1]", "[::ffff:169.254.169.254]", "[::ffff:a9fe:a9fe]", "[64:ff9b::a9fe:a9fe]", "[fd00::1]",
    "[fe80::1]", "224.0.0.1",
]  # fmt: skip
# The ones whose address, were it ever connected to, is this machine: safe to hand to the code that connects.
LOOPBACK_HOSTS = ["127.0.0.1", "[::1]", "localhost", "0.0.0.0", "2130706433", "127.1", "[::ffff:127.0.0.1]"]


@pytest.fixture(scope="module")
def alices_job(rel_api, cpu_worker, clip) -> dict:
    """A completed job of alice's, with an output to steal."""
    job_id = create(rel_api.url, "alice", clip).json()["id"]
    job = wait_all(rel_api.url, "alice", [job_id], cpu_worker)[job_id]
    assert job["status"] == "completed", job
    return job


def test_no_key_reaches_another_keys_jobs_or_uploads(rel_api, alices_job, clip, s3):
    url, job_id = rel_api.url, alices_job["id"]
    upload = requests.post(
        f"{url}/v1/uploads", files={"file": ("mine.mp4", clip, "video/mp4")}, headers=auth("alice"), timeout=30
    ).json()
    # a queued job too (no worker serves k6-vsr here): cancel must not reach it either
    queued = create(url, "alice", clip, model="k6-vsr").json()
    missing = "video_" + secrets.token_hex(12)

    def as_bob(method: str, path: str, **kwargs) -> requests.Response:
        sent = {**auth("bob"), **kwargs.pop("headers", {})}
        return requests.request(method, f"{url}{path}", headers=sent, timeout=30, allow_redirects=False, **kwargs)

    tried = 0
    for target in (job_id, queued["id"]):
        for method, path in (("GET", ""), ("GET", "/content"), ("POST", "/cancel"), ("DELETE", "")):
            response = as_bob(method, f"/v1/videos/{target}{path}")
            control = as_bob(method, f"/v1/videos/{missing}{path}")
            body = assert_problem(response, 404, "job_not_found")
            # exactly what a job that does not exist answers, but for the path and the answer's own request id:
            # nothing tells that it does
            differs = {"instance": None, "request_id": None}
            assert body["request_id"] != control.json()["request_id"]
            assert {**body, **differs} == {**control.json(), **differs}
            tried += 1
    listed = as_bob("GET", "/v1/videos?limit=100").json()["data"]
    assert not {job["id"] for job in listed} & {job_id, queued["id"]}
    for status in ("queued", "completed"):
        assert not {job["id"] for job in as_bob("GET", f"/v1/videos?status={status}").json()["data"]} & {job_id}
    cursor, control = as_bob("GET", f"/v1/videos?after={job_id}"), as_bob("GET", f"/v1/videos?after={missing}")
    assert assert_problem(cursor, 400, "invalid_cursor")["detail"].replace(job_id, missing) == control.json()["detail"]
    tried += 4
    # alice's upload, by id and by key, straight or through a path that walks out of bob's own uploads
    for reference in (
        {"upload_id": upload["id"]},
        {"input_key": upload["key"]},
        {"input_key": f"uploads/bob/../alice/{upload['id']}"},
        {"input_key": f"outputs/{job_id}/1.mp4"},
    ):
        assert_problem(as_bob("POST", "/v1/videos", json={"model": "lanczos", **reference}), 404, "upload_not_found")
        tried += 1
    # an Idempotency-Key alice used replays nothing for bob
    key = {"Idempotency-Key": secrets.token_hex(8)}
    body = {"model": "k6-vsr", "upload_id": upload["id"]}
    first = requests.post(f"{url}/v1/videos", json=body, headers={**auth("alice"), **key}, timeout=30)
    assert first.status_code == 200, first.text
    replay = as_bob("POST", "/v1/videos", json=body, headers=key)
    assert_problem(replay, 404, "upload_not_found")
    tried += 1

    # all of alice's things are as they were
    mine = requests.get(f"{url}/v1/videos/{job_id}", headers=auth("alice"), timeout=30).json()
    assert (mine["status"], mine["output"]) == ("completed", alices_job["output"])
    still = requests.get(f"{url}/v1/videos/{queued['id']}", headers=auth("alice"), timeout=30).json()
    assert (still["status"], still["cancel_requested"]) == ("queued", False)
    assert s3.head(upload["key"]) is not None
    for job in (queued, first.json()):
        requests.post(f"{url}/v1/videos/{job['id']}/cancel", headers=auth("alice"), timeout=30)
    print(f"FIGURE security tenant isolation: {tried} cross-key requests -> 0 reads, cancels, deletes or downloads")


def test_unsafe_urls_are_refused_at_submit(rel_api, clip):
    refused = 0
    for host in UNSAFE_HOSTS:
        target = f"https://{host}:8443/hook"
        response = create(rel_api.url, "carol", clip, webhook_url=target)
        assert_problem(response, 422, "unsafe_webhook_url")
        body = {"model": "lanczos", "video_url": target}
        response = requests.post(f"{rel_api.url}/v1/videos", json=body, headers=auth("carol"), timeout=30)
        assert_problem(response, 422, UnsafeUrl.code)
        refused += 2
    print(f"FIGURE security SSRF at submit: {refused}/{2 * len(UNSAFE_HOSTS)} webhook and input URLs refused (422)")


def test_unsafe_urls_are_refused_at_send_time(settings, tmp_path):
    settings = settings.model_copy(update={"webhook_allow_loopback": False, "fetch_allow_loopback": False})
    for host in UNSAFE_HOSTS:  # what both senders check right before connecting, resolved and refused
        with pytest.raises(UnsafeUrl):
            public_addresses(f"https://{host}/")
    refused = 0
    for host in LOOPBACK_HOSTS:
        attempt = post(f"https://{host}:9/hook", b"{}", {}, settings, time.monotonic() + settings.webhook_timeout_s)
        assert (attempt.outcome, attempt.code) == ("failed", UnsafeUrl.code), attempt
        with pytest.raises(FetchFailed):
            fetch(f"https://{host}:9/video.mp4", tmp_path / "input", settings, lambda: False)
        refused += 2
    assert not (tmp_path / "input").exists()
    print(
        f"FIGURE security SSRF at send time: {len(UNSAFE_HOSTS)} hosts refused by the guard, {refused} webhook posts "
        "and input fetches refused before connecting"
    )


def test_presigned_urls_expire(rel_api, alices_job):
    response = requests.get(
        f"{rel_api.url}/v1/videos/{alices_job['id']}/content", headers=auth("alice"), timeout=30, allow_redirects=False
    )
    issued = time.monotonic()
    assert response.status_code == 302 and "X-Amz-Signature=" in response.headers["Location"], response.headers
    location = response.headers["Location"]
    fresh = requests.get(location, timeout=30)
    assert fresh.status_code == 200 and hashlib.sha256(fresh.content).hexdigest() == alices_job["output"]["sha256"]
    fresh_at = time.monotonic() - issued
    time.sleep(max(0.0, PRESIGN_TTL_S + 1.5 - (time.monotonic() - issued)))
    stale = requests.get(location, timeout=30)
    assert stale.status_code == 403, (stale.status_code, stale.text[:200])
    print(
        f"FIGURE security presigned URL (TTL {PRESIGN_TTL_S} s): 200 at {fresh_at:.1f} s, "
        f"403 at {time.monotonic() - issued:.1f} s"
    )


def test_a_key_over_its_request_rate_gets_429_with_retry_after(rel_api):
    limit, window = LIMITED["ratelimited"]["rate_limit_requests"], LIMITED["ratelimited"]["rate_limit_window_s"]
    url = f"{rel_api.url}/v1/videos"

    def get(_: int = 0) -> requests.Response:
        return requests.get(url, headers=auth("ratelimited"), timeout=30)

    # a burst from 4 threads at once: the count is atomic, so the limit gets through, plus one per interval the burst
    # itself lasted (GCRA refills one request every window / limit)
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        burst = list(pool.map(get, range(3 * limit)))
    lasted = time.monotonic() - started
    statuses = [response.status_code for response in burst]
    assert set(statuses) == {200, 429}, statuses
    assert limit <= statuses.count(200) <= limit + int(lasted / (window / limit)), (statuses, lasted)
    refused = next(response for response in burst if response.status_code == 429)
    assert_problem(refused, 429, "rate_limited")
    retry_after = int(refused.headers["Retry-After"])
    assert 1 <= retry_after <= math.ceil(window / limit)
    # others are not slowed by this key
    assert requests.get(url, headers=auth("carol"), timeout=30).status_code == 200
    time.sleep(retry_after)
    assert get().status_code == 200  # admitted again after the pause it was told
    print(
        f"FIGURE security rate limit: {limit} req / {window} s per key; burst of {3 * limit} from 4 threads -> "
        f"{statuses.count(200)} x 200, {statuses.count(429)} x 429 (Retry-After {retry_after} s)"
    )


def test_a_key_at_its_job_limit_gets_429_and_sends_no_video(rel_api, clip, s3):
    limit = LIMITED["twoslots"]["max_active_jobs"]
    url = rel_api.url
    go = threading.Barrier(3 * limit)

    def submit(_: int) -> requests.Response:
        go.wait(30)
        return create(url, "twoslots", clip, model="k6-vsr")  # no worker serves it here: the jobs stay queued

    with ThreadPoolExecutor(3 * limit) as pool:
        responses = list(pool.map(submit, range(3 * limit)))
    accepted = [response.json()["id"] for response in responses if response.status_code == 200]
    assert len(accepted) == limit, [response.status_code for response in responses]
    refused = [response for response in responses if response.status_code != 200]
    for response in refused:
        assert_problem(response, 429, "too_many_active_jobs")
        assert int(response.headers["Retry-After"]) > 0
    assert len(list(s3.keys("uploads/twoslots/"))) == limit  # the refused sent no video for nothing
    # a slot frees when a job ends
    requests.post(f"{url}/v1/videos/{accepted[0]}/cancel", headers=auth("twoslots"), timeout=30)
    accepted.append(create(url, "twoslots", clip, model="k6-vsr").json()["id"])
    for job_id in accepted[1:]:
        requests.post(f"{url}/v1/videos/{job_id}/cancel", headers=auth("twoslots"), timeout=30)
    print(
        f"FIGURE security active-job limit: {limit} per key; {3 * limit} concurrent creates -> {limit} accepted, "
        f"{len(refused)} x 429; a cancel frees a slot"
    )


def test_a_key_over_its_upload_size_gets_413_while_streaming(rel_api, clip, s3):
    limit = LIMITED["smalluploads"]["max_upload_bytes"]
    url = rel_api.url
    assert len(clip) < limit and create(url, "smalluploads", clip).status_code == 200
    big = secrets.token_bytes(4 * limit)

    def chunked():  # no Content-Length: only counting while it streams can stop it
        boundary = "size-limit"
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.mp4"\r\n\r\n'.encode()
        yield from (big[at : at + 16384] for at in range(0, len(big), 16384))
        yield f"\r\n--{boundary}--\r\n".encode()

    before = sorted(s3.keys("uploads/smalluploads/"))
    declared = create(url, "smalluploads", big)
    streamed = requests.post(
        f"{url}/v1/uploads",
        data=chunked(),
        headers={**auth("smalluploads"), "Content-Type": "multipart/form-data; boundary=size-limit"},
        timeout=60,
    )
    for response in (declared, streamed):
        assert str(limit) in assert_problem(response, 413, "upload_too_large")["detail"]
    assert sorted(s3.keys("uploads/smalluploads/")) == before
    # keys without a limit of their own have the service-wide one
    files = {"file": ("big.mp4", big, "video/mp4")}
    assert requests.post(f"{url}/v1/uploads", files=files, headers=auth("carol"), timeout=60).status_code == 201
    print(f"FIGURE security upload size per key: {limit} B limit; {len(big)} B declared and chunked -> 413, 413")


def test_no_secret_in_logs_or_job_bodies(rel_api, cpu_worker, rel_env, stack, alices_job):
    # last in this file: the logs then hold this module's traffic (and every earlier module's in the session)
    found_secrets = {
        **{f"token of {name}": token for name, token in TOKENS.items()},
        **{f"webhook secret of {name}": webhook_secret(name) for name in TOKENS},
        "S3 secret key": stack.secret_key,
    }
    texts = {
        "gunicorn log": rel_api.log.read_text(errors="replace"),
        "worker log": Path(cpu_worker).read_text(errors="replace"),
    }
    bodies = 0
    for name in TOKENS:
        listed = requests.get(f"{rel_api.url}/v1/videos?limit=100", headers=auth(name), timeout=30)
        if listed.status_code == 200:
            texts[f"{name}'s job bodies"] = listed.text
            bodies += len(listed.json()["data"])
    leaks = [(what, where) for what, value in found_secrets.items() for where, text in texts.items() if value in text]
    assert not leaks, leaks
    assert bodies > 0 and "POST /v1/videos" in texts["gunicorn log"] and alices_job["id"] in texts["worker log"]
    lines = sum(text.count("\n") for text in texts.values())
    print(f"FIGURE security secrets: 0 of {len(found_secrets)} secrets in {lines} log lines and {bodies} job bodies")


def test_a_tls_redis_carries_the_jobs_and_its_certificate_is_checked(rel_env, clip, tmp_path):
    """A managed Redis behind TLS, named as redis-py documents it (`rediss://host:port/db?ssl_ca_certs=...`): every
    create answered 503 `enqueue_failed` (Celery's result backend, which vsrq never used, refused a rediss:// URL
    without `ssl_cert_reqs`), and the broker's connections, unlike the job store's, took any certificate."""
    from storage.config import Settings
    from storage.queue import make_celery

    authority = trustme.CA()
    authority.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    plain = urlsplit(rel_env["VSRQ_REDIS_URL"])
    front = processes.TlsFront((plain.hostname, plain.port), authority.issue_cert("127.0.0.1"))
    queue, tls = "vsrq.tls-probe", f"rediss://127.0.0.1:{front.port}/3"  # a database of its own on the stack's Redis
    env = {**rel_env, "VSRQ_REDIS_URL": f"{tls}?ssl_ca_certs={tmp_path / 'ca.pem'}", "VSRQ_WEB_WORKERS": "1",
           "VSRQ_MODELS": json.dumps({"lanczos": queue}), "VSRQ_CONTENT_DELIVERY": "stream"}  # fmt: skip
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    api = processes.api(env, port, tmp_path).start()
    worker = processes.worker(env, queue, tmp_path).start()
    try:
        processes.serving(api, url)
        processes.started(worker)
        job_id = create(url, "alice", clip).json().get("id")
        assert job_id, api.text()[-3000:]
        job = wait_all(url, "alice", [job_id], worker.log, limit_s=90)[job_id]
        assert job["status"] == "completed", job
        assert front.connections >= 3  # the API's, the worker's and the broker's all went through TLS

        # the broker checks the certificate as the job store does: without the authority, neither connects
        doubted = make_celery(Settings(**{"redis_url": tls}))
        with doubted.connection_for_write() as broker, pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
            broker.ensure_connection(max_retries=1)
            broker.default_channel.client.ping()
    finally:
        processes.stop_all([worker, api])
        front.close()
