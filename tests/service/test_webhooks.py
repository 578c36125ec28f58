"""Webhooks, end to end against the real things: the API (gunicorn), a lanczos Celery worker, the reaper (which runs
the relay) and the webhook Celery worker, delivering over HTTPS to a receiver this module runs on 127.0.0.1 with a
certificate from a throwaway CA (trustme). Retry delays and claims are cut to fractions of a second / seconds.

The delivery worker may reach loopback (`webhook_allow_loopback`), so this module clears the outbox first: only the
events of its own jobs are ever sent, all to its own receiver.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import redis
import requests
import standardwebhooks
import trustme
from jsonschema import Draft202012Validator
from pydantic import ValidationError

from infra.stack import free_ports
from storage.config import ApiKey, Settings
from storage.jobs import InputInfo, JobStore
from storage.signatures import WebhookVerificationError, new_secret, signed_headers, verify
from storage.webhooks import QUEUE, Outbox
from storage.workers import Held
from worker.backoff import retry_after_s
from worker.webhooks import backoff, post

from .conftest import ROOT, UNREADABLE, WEBHOOK_SECRETS, auth, serve_api
from .receiver import Receiver
from .test_worker import celery_worker, create, get, wait_for

SECRET = WEBHOOK_SECRETS["dave"]  # the owner of test_worker's `create`
CLAIM_S = 3.0


# -- Signatures (no stack) -----------------------------------------------------------------------------------------


def test_signatures_verify_as_standard_webhooks_specifies():
    old, current = new_secret(), new_secret()
    body, now = b'{"type":"video.completed","data":{"id":"video_1"}}', int(time.time())
    headers = signed_headers([current], "msg_1", now, body)

    verify(body, headers, [current])  # valid
    verify(body, {name.upper(): value for name, value in headers.items()}, [current])  # header names in any case
    standardwebhooks.Webhook(current).verify(body, headers)  # and the reference implementation agrees
    rotated = signed_headers([old, current], "msg_1", now, body)  # rotating: signed with both secrets
    assert len(rotated["webhook-signature"].split()) == 2
    for receiver_secrets in ([old], [current], [old, current]):
        verify(body, rotated, receiver_secrets)
    verify(body, headers, [old, current])  # a receiver that rotated accepts the new secret's single signature

    refused = {
        "tampered body": (body.replace(b"video_1", b"video_2"), headers, [current], "no_matching_signature"),
        "wrong secret": (body, headers, [old], "no_matching_signature"),
        "stale timestamp": (body, signed_headers([current], "msg_1", now - 301, body), [current], "stale_timestamp"),
        "missing headers": (body, {"webhook-id": "msg_1", "webhook-timestamp": str(now)}, [current], "missing_headers"),
        "malformed signatures": (body, {**headers, "webhook-signature": "v1,@ v2"}, [current], "no_matching_signature"),
        "other id, same signature": (body, {**headers, "webhook-id": "msg_2"}, [current], "no_matching_signature"),
    }
    for case, (payload, sent, accepted, code) in refused.items():
        with pytest.raises(WebhookVerificationError) as error:
            verify(payload, sent, accepted)
        assert error.value.code == code, case


def test_settings_refuse_a_secret_that_is_not_standard_webhooks():
    for bad in ("whsec_alice", "alice-secret", "whsec_" + "QUJD"):  # not base64; no prefix; 3 bytes
        with pytest.raises(ValidationError) as error:
            ApiKey(id="alice", token="sk-" + "0" * 16, webhook_secret=bad)
        assert "webhook_secret must" in str(error.value) and bad not in str(error.value)
    assert ApiKey(id="alice", token="sk-" + "0" * 16, webhook_secret=SECRET).webhook_secret.get_secret_value() == SECRET


def test_retries_back_off_exponentially_with_jitter_within_bounds():
    settings = Settings(_env_file=None)
    delays = [[backoff(attempt, settings) for _ in range(50)] for attempt in range(1, settings.webhook_max_attempts)]
    for attempt, tries in enumerate(delays, start=1):
        ceiling = min(settings.webhook_retry_max_s, settings.webhook_retry_base_s * 2 ** (attempt - 1))
        assert ceiling / 2 <= min(tries) and max(tries) <= ceiling and len(set(tries)) > 1  # jittered
    assert 3600 < sum(min(tries) for tries in delays) and sum(max(tries) for tries in delays) < 6 * 3600  # hours
    assert backoff(1, settings, retry_after=900) == 900  # the receiver's Retry-After, when later
    assert backoff(1, settings, retry_after=10**9) == settings.webhook_retry_max_s  # but bounded
    # Retry-After as a server sends it: seconds or an HTTP date; anything else is no advice (it raised on "²")
    assert (retry_after_s(" 12 "), retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT")) == (12.0, 0.0)
    assert retry_after_s("\xb2") is None and retry_after_s("5\x1c") is None and retry_after_s("soon") is None


# -- The receiver --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[trustme.LeafCert, Path]:
    """A certificate for localhost, and the file of the CA that issued it."""
    ca = trustme.CA()
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return ca.issue_cert("localhost", "127.0.0.1"), path


@pytest.fixture(scope="module")
def receiver(tls) -> Iterator[Receiver]:
    server = Receiver(tls[0])
    thread = threading.Thread(target=server.server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


# -- The processes -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hooks_env(service_env, tls, redis_client) -> dict[str, str]:
    """The service's settings, with loopback receivers allowed, the test CA trusted, and retries in fractions of a
    second: 4 attempts, 0.1-1 s apart."""
    redis_client.delete(*Outbox(redis_client).keys, QUEUE, "vsrq.cpu")  # earlier modules' events and messages
    return {
        **service_env,
        "VSRQ_WEBHOOK_ALLOW_LOOPBACK": "true",
        "VSRQ_WEBHOOK_CA_BUNDLE": str(tls[1]),
        "VSRQ_WEBHOOK_TIMEOUT_S": "2",
        "VSRQ_WEBHOOK_MAX_ATTEMPTS": "4",
        "VSRQ_WEBHOOK_RETRY_BASE_S": "0.2",
        "VSRQ_WEBHOOK_RETRY_MAX_S": "1",
        "VSRQ_WEBHOOK_CLAIM_S": str(CLAIM_S),
        "VSRQ_REAP_INTERVAL_S": "0.1",
    }


@contextmanager
def running(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """`python -m ARGS` with these settings, its output in `log`."""
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(30)


@pytest.fixture(scope="module")
def hooks_api(hooks_env, tmp_path_factory) -> Iterator[str]:
    """The API with loopback webhook URLs allowed (the session's refuses them, as production does)."""
    with serve_api(hooks_env, tmp_path_factory.mktemp("hooks-api") / "gunicorn.log") as url:
        yield url


@pytest.fixture(scope="module")
def upscaler(hooks_env, tmp_path_factory) -> Iterator[Path]:
    with celery_worker(hooks_env, "lanczos", "vsrq.cpu", tmp_path_factory.mktemp("hooks") / "cpu.log") as log:
        yield log


def delivery_worker(name: str) -> list[str]:
    """The Procfile's `webhooks` process, named `name`."""
    return ["celery", "-A", "worker.webhooks", "worker", "--pool", "threads", "--concurrency", "4", "-Q", QUEUE,
            "-n", name, "--without-gossip", "--without-mingle", "--loglevel", "info"]  # fmt: skip


@pytest.fixture(scope="module")
def webhook_worker(hooks_env, tmp_path_factory) -> Iterator[Path]:
    """The Procfile's `webhooks` process: its log file."""
    log = tmp_path_factory.mktemp("hooks") / "webhooks.log"
    with running(delivery_worker(f"hooks-{secrets.token_hex(3)}@localhost"), hooks_env, log):
        yield log


@pytest.fixture(scope="module")
def relay(hooks_env, tmp_path_factory) -> Iterator[subprocess.Popen]:
    """The reaper, which runs the relay: its process."""
    with running(["worker.reaper"], hooks_env, tmp_path_factory.mktemp("hooks") / "reaper.log") as process:
        yield process


def webhook_events(jobs: JobStore, job_id: str, count: int, limit_s: float = 30) -> list[dict]:
    """The job's first `count` webhook attempts (each is recorded once its answer is in)."""
    deadline = time.monotonic() + limit_s
    while len(found := [event.detail for event in jobs.events(job_id) if event.type == "webhook"]) < count:
        assert time.monotonic() < deadline, f"{job_id}: {len(found)} of {count} webhook attempts: {found}"
        time.sleep(0.05)
    return found


def ended_without_upscaling(jobs: JobStore, url: str) -> str:
    """A job of dave's with this webhook URL, cancelled while queued (the API's record, without the API's URL check):
    its event id."""
    job = jobs.create(
        owner="dave", model="k6-vsr", queue="vsrq.k6", params={}, input=InputInfo(key="uploads/dave/x", bytes=0),
        webhook_url=url,
    )  # fmt: skip
    jobs.cancel(job.id)
    return job.id


# -- Delivery ------------------------------------------------------------------------------------------------------


def test_a_job_that_ends_sends_its_webhook_without_waiting_for_the_reaper(
    hooks_api, upscaler, webhook_worker, receiver, jobs, redis_client, clip
):
    """The first delivery waited for the reaper's next pass: 3 to 10 s after the job ended, with the default 10 s
    between passes. The worker that completes a job, and the API that cancels a queued one, relay its event. No
    reaper runs in this test (the module's starts with the next one): its pass mark stays as it was."""
    last_pass = f"{jobs.prefix}:reaper:last_pass"  # storage.overview.reaper_passed writes it after each pass
    passes = redis_client.get(last_pass)
    completed, cancelled = receiver.path(), receiver.path()
    job_id = create(hooks_api, clip, webhook_url=receiver.url(completed))["id"]
    assert wait_for(hooks_api, job_id, upscaler)["status"] == "completed"
    (call,) = receiver.wait(completed, 1, limit_s=10)
    assert json.loads(call.body)["type"] == "video.completed"
    # no k6 worker here: it stays queued
    queued = create(hooks_api, UNREADABLE, model="k6-vsr", webhook_url=receiver.url(cancelled))
    requests.post(f"{hooks_api}/v1/videos/{queued['id']}/cancel", headers=auth("dave"), timeout=10).raise_for_status()
    (call,) = receiver.wait(cancelled, 1, limit_s=10)
    assert json.loads(call.body)["type"] == "video.cancelled"
    assert redis_client.get(last_pass) == passes  # no reaper relayed them


def test_a_completed_job_is_delivered_until_the_receiver_takes_it(
    hooks_api, upscaler, webhook_worker, relay, receiver, jobs, redis_client, clip
):
    path = receiver.path(500, 500)
    job_id = create(hooks_api, clip, webhook_url=receiver.url(path))["id"]
    assert wait_for(hooks_api, job_id, upscaler)["status"] == "completed"

    calls = receiver.wait(path, 3)
    attempts = webhook_events(jobs, job_id, 3)
    assert [(a["attempt"], a["outcome"], a["status_code"]) for a in attempts] == [
        (1, "retrying", 500), (2, "retrying", 500), (3, "delivered", 200)
    ], attempts  # fmt: skip
    # the job's owner sees the deliveries too, with the backoff the service chose
    events = requests.get(f"{hooks_api}/v1/videos/{job_id}/events", headers=auth("dave"), timeout=10).json()["data"]
    shown = [event["webhook"] for event in events if event["type"] == "webhook"]
    assert [(w["attempt"], w["outcome"], w["status_code"], w["webhook_id"]) for w in shown] == [
        (1, "retrying", 500, f"msg_{job_id}_completed"), (2, "retrying", 500, f"msg_{job_id}_completed"),
        (3, "delivered", 200, f"msg_{job_id}_completed"),
    ]  # fmt: skip
    assert shown[0]["retry_in_s"] > 0 and shown[2]["retry_in_s"] is None
    assert {call.headers["webhook-id"] for call in calls} == {f"msg_{job_id}_completed"}
    assert len({call.body for call in calls}) == 1  # the same bytes every time
    for call in calls:
        verify(call.body, call.headers, [SECRET])
        assert call.headers["Content-Type"] == "application/json"
    assert all(later.at - earlier.at >= 0.1 for earlier, later in zip(calls, calls[1:], strict=False))  # backoff
    payload = json.loads(calls[0].body)
    assert payload["type"] == "video.completed" and payload["timestamp"].endswith("Z")
    assert payload["data"] == get(hooks_api, job_id)  # the final job, as the API shows it
    assert SECRET.removeprefix("whsec_") not in calls[0].body.decode()
    time.sleep(0.5)  # and nothing more: the event left the outbox
    assert len(receiver.received(path)) == 3
    assert not redis_client.hexists(Outbox(redis_client).keys[1], f"msg_{job_id}_completed")


def test_a_failed_job_sends_video_failed(hooks_api, upscaler, webhook_worker, relay, receiver, jobs):
    path = receiver.path()
    job_id = create(hooks_api, UNREADABLE, webhook_url=receiver.url(path))["id"]
    assert wait_for(hooks_api, job_id, upscaler)["status"] == "failed"
    (call,) = receiver.wait(path, 1)
    verify(call.body, call.headers, [SECRET])
    payload = json.loads(call.body)
    assert (payload["type"], payload["data"]["error"]["code"]) == ("video.failed", "input_unreadable")
    # what was delivered is what /openapi.json's `webhooks` say (body and Standard Webhooks headers), and no other event
    document = requests.get(f"{hooks_api}/openapi.json", timeout=10).json()
    operation = document["webhooks"]["video.failed"]["post"]
    declared = {parameter["name"].lower() for parameter in operation["parameters"] if parameter["in"] == "header"}
    assert declared <= {name.lower() for name in call.headers}
    assert call.headers["Content-Type"] in operation["requestBody"]["content"]
    schema = "#/webhooks/{}/post/requestBody/content/application~1json/schema"
    Draft202012Validator({**document, "$ref": schema.format("video.failed")}).validate(payload)
    assert not Draft202012Validator({**document, "$ref": schema.format("video.completed")}).is_valid(payload)
    # a receiver verifies with the reference library as its docs show, or with OpenAI's SDK, and reads OpenAI's event
    assert standardwebhooks.Webhook(SECRET).verify(call.body, call.headers) == payload
    event = openai.OpenAI(api_key="unused", webhook_secret=SECRET).webhooks.unwrap(call.body, call.headers)
    assert (event.id, event.type, event.data.id) == (call.headers["webhook-id"], "video.failed", job_id)
    assert event.object == "event" and event.created_at == payload["data"]["completed_at"]
    assert webhook_events(jobs, job_id, 1)[0]["outcome"] == "delivered"


def test_a_cancelled_job_sends_video_cancelled(hooks_api, webhook_worker, relay, receiver):
    path = receiver.path()
    job = create(hooks_api, UNREADABLE, model="k6-vsr", webhook_url=receiver.url(path))  # no k6 worker here
    response = requests.post(f"{hooks_api}/v1/videos/{job['id']}/cancel", headers=auth("dave"), timeout=10)
    assert response.json()["status"] == "cancelled"
    (call,) = receiver.wait(path, 1)
    payload = json.loads(call.body)
    assert (payload["type"], payload["data"]["id"], payload["data"]["status"]) == (
        "video.cancelled", job["id"], "cancelled"
    )  # fmt: skip


def test_a_url_refused_at_send_time_fails_once_with_unsafe_url(webhook_worker, relay, receiver, jobs, redis_client):
    # Accepted when the job was created (a name that resolved publicly then), unspecified when it is sent: were the
    # guard to let it through, the request would land on this machine's receiver.
    path = receiver.path()
    job_id = ended_without_upscaling(jobs, f"https://0.0.0.0:{receiver.port}{path}")
    (attempt,) = webhook_events(jobs, job_id, 1)
    assert (attempt["outcome"], attempt["code"]) == ("failed", "unsafe_url"), attempt
    time.sleep(1.5)  # longer than any retry delay here
    assert len(webhook_events(jobs, job_id, 1)) == 1 and receiver.received(path) == []
    assert not redis_client.hexists(Outbox(redis_client).keys[1], f"msg_{job_id}_cancelled")


def test_an_owner_the_delivery_worker_does_not_know_yet_is_retried_not_given_up(webhook_worker, relay, jobs):
    """A key added to the API's VSRQ_API_KEYS before the delivery workers' (a rolling deploy): its webhooks failed
    for good at the first attempt; they wait for the configuration, over the attempts' backoff, as an outage's do."""
    job = jobs.create(
        owner="newcomer", model="k6-vsr", queue="vsrq.k6", params={}, input=InputInfo(key="uploads/n/x", bytes=0),
        webhook_url="https://127.0.0.1:9/hook",
    )  # fmt: skip
    jobs.cancel(job.id)
    attempts = webhook_events(jobs, job.id, 4)
    assert [(attempt["outcome"], attempt["code"]) for attempt in attempts] == [
        ("retrying", "webhook_secret_missing")
    ] * 3 + [("failed", "webhook_secret_missing")], attempts
    assert "'newcomer' is not in VSRQ_API_KEYS" in attempts[0]["message"]
    assert "gave up after 4 attempts" in attempts[-1]["message"]


def test_redirects_are_not_followed_and_410_ends_the_event(webhook_worker, relay, receiver, jobs):
    moved, gone = receiver.path(302), receiver.path(410)
    moved_job, gone_job = (ended_without_upscaling(jobs, receiver.url(path)) for path in (moved, gone))
    assert [(a["outcome"], a.get("code")) for a in webhook_events(jobs, moved_job, 2)] == [
        ("retrying", "redirect_refused"), ("delivered", None)
    ]  # fmt: skip
    assert [call.path for call in receiver.received(moved)] == [moved, moved]  # never to its Location
    (attempt,) = webhook_events(jobs, gone_job, 1)
    assert (attempt["outcome"], attempt["code"], attempt["status_code"]) == ("failed", "receiver_gone", 410)
    time.sleep(1.5)
    assert len(receiver.received(gone)) == 1


def test_an_answer_that_never_ends_is_cut_at_the_attempt_s_limit(webhook_worker, relay, receiver, jobs):
    """A receiver that sends a status line, then a header line a second (a chaos trial's): urllib3's timeout bounds
    each read, so the attempt lasted as long as the receiver liked, holding a delivery thread, and the claim's end
    sent the event again beside it. Now it ends at VSRQ_WEBHOOK_TIMEOUT_S (2 s here), is retried, and delivered."""
    path = receiver.path(Receiver.TRICKLE)
    job_id = ended_without_upscaling(jobs, receiver.url(path))
    try:
        first, second = webhook_events(jobs, job_id, 2, limit_s=20)
    finally:
        receiver.release(path)
    assert (first["outcome"], first["code"]) == ("retrying", "timeout") and second["outcome"] == "delivered"
    started, again = receiver.received(path)[:2]
    assert again.at - started.at < 2 + 8  # the limit, then the backoff (0.1-0.2 s) and a loaded box's slack


def test_a_certificate_for_another_name_or_from_an_unknown_ca_is_tls_failed(tmp_path):
    """Once the attempt had a connection of its own (to cut it at its deadline), a certificate for another name raised
    out of the attempt (urllib3's CertificateError, a ValueError) and an unknown CA was `connection_failed` (a
    review's). Both are `tls_failed`, retried; the right certificate is delivered."""
    ca, stranger = trustme.CA(), trustme.CA()
    ca_file, stranger_file = tmp_path / "ca.pem", tmp_path / "stranger.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    stranger.cert_pem.write_to_path(str(stranger_file))
    receivers = [Receiver(ca.issue_cert(name)) for name in ("example.org", "localhost")]
    for receiver in receivers:
        threading.Thread(target=receiver.server.serve_forever, daemon=True).start()
    wrong_name, right = (receiver.url("/h") for receiver in receivers)
    try:
        for url, bundle, expected in [
            (wrong_name, ca_file, ("retry", "tls_failed")), (right, stranger_file, ("retry", "tls_failed")),
            (right, ca_file, ("delivered", None)),
        ]:  # fmt: skip
            settings = Settings(_env_file=None, webhook_allow_loopback=True, webhook_ca_bundle=bundle)
            attempt = post(url, b"{}", {}, settings, time.monotonic() + 5)
            assert (attempt.outcome, attempt.code) == expected, attempt
    finally:
        for receiver in receivers:
            receiver.server.shutdown()
            receiver.server.server_close()


def test_a_relay_killed_between_taking_and_sending_loses_nothing(
    webhook_worker, relay, receiver, jobs, redis_client, hooks_env, tmp_path
):
    # The module's relay is paused; another one takes the event, then cannot reach the broker to send its message,
    # and is killed there.
    os.kill(relay.pid, signal.SIGSTOP)
    try:
        path = receiver.path()
        job_id = ended_without_upscaling(jobs, receiver.url(path))
        claim = f"msg_{job_id}_cancelled:claim"
        dead_broker = {**hooks_env, "VSRQ_BROKER_URL": f"redis://127.0.0.1:{free_ports(1)[0]}/0"}
        with running(["worker.reaper"], dead_broker, tmp_path / "doomed.log") as doomed:
            deadline = time.monotonic() + 30
            while redis_client.hget(Outbox(redis_client).keys[1], claim) != b"1":
                assert time.monotonic() < deadline and doomed.poll() is None, (tmp_path / "doomed.log").read_text()
                time.sleep(0.02)
            doomed.kill()
            doomed.wait()
        taken_at = time.monotonic()
    finally:
        os.kill(relay.pid, signal.SIGCONT)
    (call,) = receiver.wait(path, 1)
    assert call.at - taken_at > CLAIM_S - 1  # sent once the dead relay's claim ran out, by the live relay
    (attempt,) = webhook_events(jobs, job_id, 1)
    assert (attempt["attempt"], attempt["outcome"]) == (1, "delivered")
    verify(call.body, call.headers, [SECRET])


def test_an_attempt_is_held_by_its_worker_and_taken_back_only_while_it_still_runs(redis_client):
    """What the reaper and a restarted delivery worker act on (storage.webhooks): an attempt records its worker until
    it ends; taking it back makes the event due now, only for the attempt looked at (a later claim's is not touched)
    and only once it has run `silent_s`."""
    prefix = f"held-{secrets.token_hex(3)}"
    jobs = JobStore(redis_client, result_ttl_s=60, max_attempts=3, prefix=prefix)
    box = Outbox(redis_client, prefix)
    ended_without_upscaling(jobs, "https://example.com/hook")
    [claim] = box.take(claim_s=60)
    assert box.held() == []  # handed out, not started
    assert box.start(claim.event_id, claim.claim, 60, "hooks@a/123") is not None
    # its message given again while it runs (Celery restores one whose ack a lost broker connection cut off): sent
    # twice at once before (a Redis failover in a trial); dropped now
    assert box.start(claim.event_id, claim.claim, 60, "hooks@a/123") is None
    [held] = box.held()
    assert (held.id, held.token, held.holder) == (claim.event_id, str(claim.claim), "hooks@a/123")
    assert abs(held.since - time.time()) < 5
    assert box.take(claim_s=60) == []  # held for its attempt's hold (60 s)
    assert box.take_back([held], silent_s=30) == []  # running for less than `silent_s`
    assert box.take_back([held]) == [claim.event_id]
    assert box.held() == []
    [again] = box.take(claim_s=60)  # due at once, under a new claim
    assert box.start(claim.event_id, claim.claim, 60, "hooks@a/123") is None  # the old message is fenced out
    assert box.start(again.event_id, again.claim, 60, "hooks@b/456") is not None
    assert box.take_back([held]) == []  # the attempt looked at is over: another runs
    [now_held] = box.held()
    assert now_held.holder == "hooks@b/456"
    assert box.retry(again.event_id, again.claim, 60)  # an attempt's end: nothing holds it
    assert box.held() == [] and box.take_back([now_held]) == []
    # its message given again after it ended: its retry waits its backoff, not started again at once
    assert box.start(again.event_id, again.claim, 60, "hooks@b/456") is None
    # A rolling deploy: an attempt started by this version, then a new claim taken by an older relay, whose script
    # leaves the attempt's entry; the entry is no attempt's now, and goes at the next look
    redis_client.zadd(box.keys[0], {again.event_id: 0})  # due
    [third] = box.take(claim_s=60)
    assert box.start(third.event_id, third.claim, 60, "hooks@c/789") is not None
    [started] = box.held()
    redis_client.hincrby(box.keys[1], f"{third.event_id}:claim", 1)  # what an older relay's take does
    newer = Held(third.event_id, str(third.claim + 1), started.holder, started.since)  # the new claim, this holder
    assert box.take_back([started]) == [] and box.take_back([newer]) == [] and box.held() == []
    assert redis_client.zcard(box.keys[2]) == 0 and not redis_client.hexists(box.keys[1], f"{third.event_id}:holder")
    # an older relay's claim left the running attempt's holder: the new claim's message starts all the same
    redis_client.zadd(box.keys[0], {third.event_id: 0})
    [fourth] = box.take(claim_s=60)
    assert box.start(fourth.event_id, fourth.claim, 60, "hooks@c/789") is not None
    redis_client.hincrby(box.keys[1], f"{third.event_id}:claim", 1)
    assert box.start(fourth.event_id, fourth.claim + 1, 60, "hooks@d/1") is not None
    redis_client.delete(*box.keys, *redis_client.keys(f"{prefix}:*"))


@pytest.mark.parametrize("restarted", [True, False], ids=["started-again", "not-started-again"])
def test_a_delivery_worker_killed_mid_attempt_does_not_hold_its_webhook_for_the_claim(
    restarted, hooks_env, settings, receiver, tmp_path
):
    """A chaos trial: the receiver hung, the delivery worker was killed mid-attempt and started again under its name
    within a second, and the webhook went out 121 s after the job ended: the whole claim (`webhook_claim_s`, 60 s
    here). Started again under its name, the worker hands its predecessor's attempt out again at once; not started
    again (a pod evicted), the reaper does once the killed worker's registry entry has expired (`VSRQ_WORKER_TTL_S`,
    3 s here) and the attempt has run as long as a POST may (`VSRQ_WEBHOOK_TIMEOUT_S`, 10 s), not sooner: the killed
    worker might only be cut off, its POST still going. A Redis database of the test's own: no other test's
    processes."""
    store_url = settings.redis_url.rsplit("/", 1)[0] + "/8"
    own = redis.Redis.from_url(store_url)
    own.flushdb()
    jobs = JobStore(own, result_ttl_s=settings.result_ttl_s, max_attempts=settings.max_attempts)
    # The registry's TTL is 30 s where the worker is started again: the reaper's rule cannot act first. A blob store of
    # the test's own: its reaper's storage sweep deletes no other test's files.
    env = {**hooks_env, "VSRQ_REDIS_URL": store_url, "VSRQ_BROKER_URL": store_url, "VSRQ_WEBHOOK_CLAIM_S": "60",
           "VSRQ_WEBHOOK_TIMEOUT_S": "10", "VSRQ_WORKER_TTL_S": "30" if restarted else "3",
           "VSRQ_BLOB_BACKEND": "local", "VSRQ_LOCAL_BLOB_DIR": str(tmp_path / "blobs")}  # fmt: skip
    path = receiver.path(Receiver.HANG)
    job_id = ended_without_upscaling(jobs, receiver.url(path))
    name = f"hooks-{secrets.token_hex(3)}@localhost"
    try:
        with running(["worker.reaper"], env, tmp_path / "reaper.log"):
            with running(delivery_worker(name), env, tmp_path / "killed.log") as killed:
                receiver.wait(path, 1)  # its attempt is in flight
                killed.kill()
                killed.wait()
            at = time.monotonic()
            other = name if restarted else f"hooks-{secrets.token_hex(3)}@localhost"
            with running(delivery_worker(other), env, tmp_path / "other.log"):
                _, call = receiver.wait(path, 2, limit_s=45)
    finally:
        receiver.release(path)
    took = call.at - at
    how = "started again" if restarted else "another worker, registry TTL 3 s, attempt timeout 10 s"
    print(f"FIGURE webhook delivered {took:.1f} s after its delivery worker's kill ({how}; claim 60 s)")
    assert took < 25, f"waited for the claim: {took:.1f} s"
    assert restarted or took > 8, f"sent again within a POST's time limit: {took:.1f} s"
    (attempt,) = webhook_events(jobs, job_id, 1)  # the killed attempt never answered: counted, not recorded
    assert (attempt["attempt"], attempt["outcome"]) == (2, "delivered")
    verify(call.body, call.headers, [SECRET])
    event = f"msg_{job_id}_cancelled"
    if restarted:
        assert f"{event}: delivered by this worker's dead predecessor" in (tmp_path / "other.log").read_text()
    else:
        assert f"{event}: its delivery worker is gone" in (tmp_path / "reaper.log").read_text()
    own.flushdb()
